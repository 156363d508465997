"""``MooncakeTier``: block copies in a Mooncake Store, shared by every engine that mounts it.

A Mooncake Store is a master (metadata: which key lives where) and the memory segments that its
clients mount; a value lives in one client's segment and is read by any other over the transfer
engine (TCP here). Each value is ``encode_header(...) + payload`` under ``prefix + key.name``.

The data path stays zero-copy: a put gathers the 128-byte header and the caller's payload buffer
into one value (``batch_put_from_multi_buffers``) and a load scatters the value into a header
scratch row and the caller's ``out`` (``batch_get_into_multi_buffers``), one batched call each.
Over TCP neither buffer needs ``register_buffer`` (measured: same throughput either way).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm.spec._vocabulary import Tier
from kvfsm.tiers._client import ClientTier
from kvfsm.tiers._contract import (
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    BlockKey,
    LoadResult,
    LoadStatus,
    TierConnectError,
    TierError,
    encode_header,
    verify,
)
from kvfsm.tiers._health import Health

#: Mooncake ``ErrorCode`` values the tier tells apart (``mooncake-store/include/types.h``).
NO_AVAILABLE_HANDLE: Final = -200  # no segment has room (or none is mounted yet)
INVALID_PARAMS: Final = -600  # on a read: the value is longer than the buffers
REPLICA_IS_NOT_READY: Final = -703  # another client's put is still in flight
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
OBJECT_HAS_LEASE: Final = -706  # a read lease still holds the value: no remove until it ends
TRANSFER_FAIL: Final = -800  # on a read also: the value is shorter than the buffers
RPC_FAIL: Final = -900  # the master did not answer
#: Codes about one key; any other negative code means the client or master is in trouble.
_PER_KEY: Final = frozenset({NO_AVAILABLE_HANDLE, INVALID_PARAMS, REPLICA_IS_NOT_READY,
                             OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE,
                             TRANSFER_FAIL})
#: Mooncake's log level setting, and the level a tier sets where the user has not chosen one.
_LOG_LEVEL_ENV: Final = "MC_LOG_LEVEL"
_QUIET_LOG_LEVEL: Final = "ERROR"
#: The master's default ``--default_kv_lease_ttl`` (10 000 ms).
DEFAULT_LEASE_S: Final = 10.0
#: Default bound on asking the master whether it is one, at construction: a master on the same
#: network answers in milliseconds; a few seconds leave room for a loaded one.
DEFAULT_CONNECT_TIMEOUT_S: Final = 3.0
#: Default bound on one call to the master (``MC_RPC_TIMEOUT_MS``; Mooncake's own is 30 s, every
#: call into a frozen master waiting that long): metadata calls answer in milliseconds.
DEFAULT_RPC_TIMEOUT_S: Final = 5.0
#: The client reads its master-call timeout from this variable when it is set up.
_RPC_TIMEOUT_ENV: Final = "MC_RPC_TIMEOUT_MS"

# The master's RPC protocol (coro_rpc of yalantinglibs), little-endian: a request header of
# magic, version, serialization, message type, sequence number, function id, body length and
# attachment length; a reply header of magic, version, error code, message type, sequence number,
# body length and attachment length (read off Mooncake 0.3.13's client and master).
_RPC_REQUEST: Final = struct.Struct("<BBBBIIII")
_RPC_REPLY: Final = struct.Struct("<BBBBIII")
_RPC_MAGIC: Final = 21
#: Any number: the reply echoes it.
_RPC_SEQUENCE: Final = 1
#: coro_rpc names a function by the first 4 bytes (big-endian) of the MD5 of its qualified name.
#: ``ServiceReady`` takes no argument and answers the master's version; every client calls it
#: first, so every master a client can use serves it.
_SERVICE_READY: Final = int.from_bytes(hashlib.md5(
    b"mooncake::WrappedMasterService::ServiceReady", usedforsecurity=False).digest()[:4], "big")
#: Bytes of a foreign reply quoted in an error.
_SHOWN_BYTES: Final = 32
_INSTALL: Final = ("pip install mooncake-transfer-engine-non-cuda && "
                   "apt-get install -y libibverbs1")


def byte_view(buffer: Any, *, writable: bool) -> NDArray[np.uint8]:
    """A flat uint8 array over ``buffer``'s memory (no copy); ValueError for a buffer that is
    not C-contiguous, or read-only where ``writable``."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("stored-tier buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("load_into needs writable output buffers")
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view,
                         dtype=np.uint8)


def _address(array: NDArray[np.uint8]) -> int:
    address: int = array.__array_interface__["data"][0]
    return address


def probe_master(host: str, port: int, timeout_s: float) -> str | None:
    """None if a Mooncake master at ``host:port`` answers ``ServiceReady`` within ``timeout_s``
    (connecting included), else what was found there instead (for an error message). Plain
    socket calls against a deadline: a silent or frozen server costs ``timeout_s`` at most and
    Ctrl-C interrupts the wait, where the client's own setup blocks in C++ holding the GIL and
    retries for minutes."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return "nothing listens there (connection refused)"
    except TimeoutError:
        return f"no TCP connection within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot connect ({exc})"
    reply, silent = b"", False
    with sock:
        try:
            sock.sendall(_RPC_REQUEST.pack(_RPC_MAGIC, 0, 0, 0, _RPC_SEQUENCE, _SERVICE_READY,
                                           0, 0))
            while len(reply) < _RPC_REPLY.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(_RPC_REPLY.size - len(reply))
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            silent = not reply
        except OSError:
            pass  # reset: judged by what arrived before
    if silent:
        return (f"it accepted the connection but sent nothing back within {timeout_s:g} s: "
                "not a Mooncake master, or a frozen one")
    if not reply:
        return "it closed the connection without answering: not a Mooncake master"
    if len(reply) < _RPC_REPLY.size or reply[0] != _RPC_MAGIC:
        return (f"it answered {reply[:_SHOWN_BYTES]!r}, not Mooncake's RPC: another server's "
                "port?")
    _magic, _version, error, _kind, sequence, _body, _attached = _RPC_REPLY.unpack(reply)
    if error != 0 or sequence != _RPC_SEQUENCE:
        return (f"it speaks Mooncake's RPC protocol but answered ServiceReady with error "
                f"{error}: not a Mooncake master this client can use")
    return None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _describe(method: str, result: Any) -> str:
    """What a failed client call answered, for :attr:`MooncakeTier.last_error`."""
    if isinstance(result, Exception):
        return f"{method} raised {type(result).__name__}: {result}"
    codes = result if isinstance(result, list) else [result]
    bad = next(c for c in codes if isinstance(c, int) and c < 0 and c not in _PER_KEY)
    why = "the master did not answer" if bad == RPC_FAIL else "a client or master error"
    return f"{method} answered error code {bad} ({why})"


class MooncakeTier(ClientTier):
    """A ``StoredTier`` over ``mooncake.store.MooncakeDistributedStore``.

    The client mounts ``global_segment_bytes`` of this process's memory into the store (values
    of any engine may land there; they vanish with this process) and keeps
    ``local_buffer_bytes`` for transfers. Semantics, each measured on Mooncake 0.3.13:

    * **No silent overwrite.** Mooncake's put of an existing key answers 0 and keeps the old
      value, so ``put`` first asks ``batch_is_exist``; a key already there is read back and
      verified: whole, this key's, and of the same checksum → True (content-addressed: same
      key, same content). Anything else is replaced with ``upsert`` → True where it answers 0,
      else False. (Remove-then-put cannot work here: the read-back, like any read or existence
      check, takes a lease that refuses a remove with -706 for the lease's length; ``upsert`` is
      the store's own replace and is allowed under a lease. Readers caught mid-replace verify.)
      Two engines putting a key at once: the first value stays, and loads verify it.
    * **Empty reads.** A missing key (-704, or -703: a put still in flight) → MISSING.
    * **Wrong values.** A value of another length is read whole and verified, so another key's
      block is FOREIGN and a torn one CORRUPT; failing ``verify`` → CORRUPT/FOREIGN. Bad values
      are then removed with ``force`` (best effort): the read that found them took a lease, and
      every later existence check or read takes another, so an unforced remove is always
      refused (-706) and the bad value would stay for good: every engine's lookup would find
      it again, restore it and refuse it, and never cache its own recomputed block in its place.
      A forced remove skips the lease; a reader still copying the value fails to verify it
      (nothing it loads is trusted unverified). The one cost: a good value another engine
      ``upsert``-ed in the instant between this read and the remove is dropped too (a later
      load of it is MISSING and recomputes).
    * **Leases.** Every read holds a lease of the master's ``--default_kv_lease_ttl`` (10 s by
      default; pass ``lease_s`` to match). A batch whose read took longer than ``lease_s`` from
      start to finish (by ``clock``) answers LATE for every key, even where bytes verify: the
      store was free to replace them during the read.
    * **Store down.** Client errors, exceptions and non-zero codes are FAILED (load) / False
      (put, remove, contains), never an exception. After a call that saw the master fail, the
      next calls first ask the master ``ServiceReady`` (bounded by ``probe_timeout_s``) and
      answer FAILED at once while it does not answer. A call into a killed master fails within
      about 4 s; one into a frozen master (``kill -STOP``) waits for the master-call timeout,
      ``rpc_timeout_s`` (Mooncake's own default is 30 s; measured: 30.0 s per call, every call,
      before this bound). Mooncake's client reconnects by itself (it pings the master and, after
      three failed pings, reconnects and remounts its segment); for about a second after a
      master restart puts answer False (-200) and loads MISSING (a restarted master has lost
      every key), then both work again.
    * **Health.** :attr:`available` turns False (one warning on the ``kvfsm.tiers`` logger,
      :attr:`last_error` saying what failed) when a call finds the master failing, and True
      (one info line) at the next call that works.
    * **Evictions.** A key evicted (or removed by anyone) between ``contains`` and
      ``load_into`` is MISSING.

    Building one asks the master ``ServiceReady`` over its own RPC protocol first, bounded by
    ``connect_timeout_s``: nothing listening, a silent listener, a frozen master or another
    server's port is a :class:`TierConnectError` naming the address and what answered (setup
    itself would block in C++ without answering Ctrl-C, retrying for minutes). ``close()``
    takes a second or two (it unmounts at the master). With ``local_hostname`` on loopback the
    constructor sets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` and ``MC_TE_FILTERS=lo`` in
    ``os.environ``, else the transfer engine advertises another interface than the one it
    listens on; ``MC_RPC_TIMEOUT_MS`` is set from ``rpc_timeout_s`` only while the client is
    set up (it reads it then), and left as it was.
    """

    tier = Tier.REMOTE

    def __init__(self, master_address: str, *, global_segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 64 << 20, local_hostname: str = "127.0.0.1",
                 prefix: str = "kvfsm/", lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.monotonic,
                 probe_timeout_s: float = 0.5,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 rpc_timeout_s: float | None = None) -> None:
        """``rpc_timeout_s``: bound on each call to the master; None takes ``MC_RPC_TIMEOUT_MS``
        from the environment where it is set, else ``DEFAULT_RPC_TIMEOUT_S``."""
        # The client logs every step of its setup at INFO (some 20 lines per client); a library
        # keeps quiet unless asked: errors only, where the user has not chosen a level.
        os.environ.setdefault(_LOG_LEVEL_ENV, _QUIET_LOG_LEVEL)
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as exc:
            raise TierError(f"MooncakeTier needs the Mooncake Store client ({exc}); install it "
                            f"with: {_INSTALL}") from exc
        host, _, port = master_address.rpartition(":")
        if not host or not port.isdigit():
            raise TierError(f"master_address must be 'host:port', got {master_address!r}")
        for name, seconds in (("probe_timeout_s", probe_timeout_s),
                              ("connect_timeout_s", connect_timeout_s),
                              ("rpc_timeout_s", rpc_timeout_s)):
            if seconds is not None and not seconds > 0:
                raise ValueError(f"MooncakeTier {name} must be > 0 seconds, got {seconds!r}")
        self.master_address = master_address
        self.prefix = prefix
        self.lease_s = lease_s
        self._master = (host, int(port))
        self._clock = clock
        self._probe_timeout_s = probe_timeout_s
        self._health = Health(f"MooncakeTier(master {master_address})")
        self._suspect = False
        refused = probe_master(host, int(port), connect_timeout_s)
        if refused is not None:
            raise TierConnectError("Mooncake master", master_address, refused)
        if local_hostname in ("127.0.0.1", "localhost"):
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
            os.environ["MC_TE_FILTERS"] = "lo"
        setting: dict[str, str] = {}
        if rpc_timeout_s is not None or _RPC_TIMEOUT_ENV not in os.environ:
            seconds = DEFAULT_RPC_TIMEOUT_S if rpc_timeout_s is None else rpc_timeout_s
            setting[_RPC_TIMEOUT_ENV] = str(max(1, round(seconds * 1000)))
        self._client = MooncakeDistributedStore()
        with _environment(setting):
            code = self._client.setup(local_hostname, "P2PHANDSHAKE", global_segment_bytes,
                                      local_buffer_bytes, "tcp", "", master_address)
        if code != 0:
            self._client = None
            raise TierError(f"Mooncake client setup against master {master_address} failed "
                            f"with code {code}")

    def close(self) -> None:
        """Unmount this process's segment (values stored in it are gone) and close the client."""
        super().close()

    # -- plumbing ------------------------------------------------------------------------------

    def _reachable(self) -> bool:
        """True unless a recent call saw the master fail and it still does not answer."""
        if not self._suspect:
            return True
        host, port = self._master
        refused = probe_master(host, port, self._probe_timeout_s)
        if refused is None:
            return True
        self._health.failed(f"master {self.master_address}: {refused}")
        return False

    def _call(self, method: str, *args: Any) -> Any:
        """``client.method(*args)``; None on an exception. A call that finds the client or
        master in trouble (an exception, a code not about one key) makes the master suspect and
        the tier unavailable; one that does not makes it available."""
        try:
            result = getattr(self.client, method)(*args)
        except TierError:
            raise
        except Exception as exc:
            self._suspect = True
            self._health.failed(_describe(method, exc))
            return None
        codes = result if isinstance(result, list) else [result]
        self._suspect = any(isinstance(c, int) and c < 0 and c not in _PER_KEY for c in codes)
        if self._suspect:
            self._health.failed(_describe(method, result))
        else:
            self._health.ok()
        return result

    @staticmethod
    def _parts(heads: NDArray[np.uint8], arrays: Sequence[NDArray[np.uint8]]
               ) -> tuple[list[list[int]], list[list[int]]]:
        """Per key: the addresses and sizes of its header row and its payload buffer."""
        base = _address(heads)
        addresses = [[base + i * HEADER_BYTES, _address(a)] if a.nbytes else
                     [base + i * HEADER_BYTES] for i, a in enumerate(arrays)]
        sizes = [[HEADER_BYTES, a.nbytes] if a.nbytes else [HEADER_BYTES] for a in arrays]
        return addresses, sizes

    def _read(self, keys: Sequence[BlockKey], names: list[str],
              arrays: Sequence[NDArray[np.uint8]]) -> tuple[list[LoadStatus], list[int]]:
        """Read and verify into ``arrays``: per key (LoadStatus, checksum); FAILED for all where
        the client failed."""
        heads = np.empty((len(keys), HEADER_BYTES), np.uint8)
        addresses, sizes = self._parts(heads, arrays)
        codes = self._call("batch_get_into_multi_buffers", names, addresses, sizes)
        if not isinstance(codes, list) or len(codes) != len(keys):
            return [LoadStatus.FAILED] * len(keys), [0] * len(keys)
        status, sums = [], []
        for i, code in enumerate(codes):
            n = arrays[i].nbytes
            if code == HEADER_BYTES + n:
                found, checksum = verify(keys[i], heads[i].data, arrays[i], n)
            elif code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                found, checksum = LoadStatus.MISSING, 0
            elif code >= 0 or code in (INVALID_PARAMS, TRANSFER_FAIL):
                found, checksum = self._odd_length(keys[i], names[i], n), 0
            else:
                found, checksum = LoadStatus.FAILED, 0
            status.append(found)
            sums.append(checksum)
        return status, sums

    def _odd_length(self, key: BlockKey, name: str, payload_bytes: int) -> LoadStatus:
        """A value that did not fit ``HEADER_BYTES + payload_bytes`` (or a transfer that failed):
        read it whole to tell a foreign block from a torn one."""
        size = self._call("get_size", name)
        if size == OBJECT_NOT_FOUND:
            return LoadStatus.MISSING
        if not isinstance(size, int) or size < 0 or size == HEADER_BYTES + payload_bytes:
            return LoadStatus.FAILED
        if size < HEADER_BYTES or size > HEADER_BYTES + MAX_PAYLOAD_BYTES:
            return LoadStatus.CORRUPT
        whole = np.empty(size, np.uint8)
        got = self._call("get_into", name, _address(whole), size)
        if got != size:
            return LoadStatus.MISSING if got == OBJECT_NOT_FOUND else LoadStatus.FAILED
        found, _ = verify(key, whole[:HEADER_BYTES].data, whole[HEADER_BYTES:], payload_bytes)
        return LoadStatus.CORRUPT if found == LoadStatus.OK else found

    # -- the contract --------------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        if not len(keys) == len(payloads) == len(checksums):
            raise ValueError("put needs as many payloads and checksums as keys")
        done = np.zeros(len(keys), np.bool_)
        arrays = [byte_view(p, writable=False) for p in payloads]
        if len(keys) == 0 or not self._reachable():
            return done
        heads = np.empty((len(keys), HEADER_BYTES), np.uint8)
        for i, key in enumerate(keys):
            heads[i] = np.frombuffer(encode_header(key, arrays[i].nbytes, int(checksums[i])),
                                     np.uint8)
        names = self._names(keys)
        exists = self._call("batch_is_exist", names)
        if not isinstance(exists, list) or len(exists) != len(keys):
            return done
        fresh = [i for i, e in enumerate(exists) if e == 0]
        if fresh:
            fresh_heads = heads[fresh]  # a copy: it must outlive the call below
            addresses, sizes = self._parts(fresh_heads, [arrays[i] for i in fresh])
            codes = self._call("batch_put_from_multi_buffers", [names[i] for i in fresh],
                               addresses, sizes)
            if isinstance(codes, list) and len(codes) == len(fresh):
                done[fresh] = [c == 0 for c in codes]
        held = [i for i, e in enumerate(exists) if e == 1]
        if held:
            self._keep_or_replace(held, keys, names, heads, arrays, checksums, done)
        return done

    def _keep_or_replace(self, held: list[int], keys: Sequence[BlockKey], names: list[str],
                         heads: NDArray[np.uint8], arrays: Sequence[NDArray[np.uint8]],
                         checksums: NDArray[np.uint64], done: NDArray[np.bool_]) -> None:
        """Keys that already hold a value: keep a verified copy of this content, replace any
        other value with ours (``upsert``), put again where it vanished meanwhile."""
        scratch = [np.empty(arrays[i].nbytes, np.uint8) for i in held]
        status, sums = self._read([keys[i] for i in held], [names[i] for i in held], scratch)
        for j, i in enumerate(held):
            if status[j] == LoadStatus.OK and sums[j] == int(checksums[i]):
                done[i] = True
            elif status[j] == LoadStatus.FAILED:
                done[i] = False
            else:
                method = "put_parts" if status[j] == LoadStatus.MISSING else "upsert_parts"
                payload = arrays[i].data if arrays[i].nbytes else b""
                done[i] = self._call(method, names[i], heads[i].data, payload) == 0

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        if len(keys) != len(outs):
            raise ValueError("load_into needs as many output buffers as keys")
        arrays = [byte_view(o, writable=True) for o in outs]
        status = np.full(len(keys), LoadStatus.FAILED, np.uint8)
        checksum = np.zeros(len(keys), np.uint64)
        if len(keys) == 0 or not self._reachable():
            return LoadResult(status, checksum)
        names = self._names(keys)
        start = self._clock()
        found, sums = self._read(keys, names, arrays)
        if self._clock() - start > self.lease_s:
            status[:] = LoadStatus.LATE
            return LoadResult(status, checksum)
        status[:] = found
        checksum[:] = sums
        bad = [names[i] for i, s in enumerate(found)
               if s in (LoadStatus.CORRUPT, LoadStatus.FOREIGN)]
        if bad:
            # Forced: the lease this read took would refuse it (see the class docstring).
            self._call("batch_remove", bad, True)
        return LoadResult(status, checksum)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        """Whether each key holds a value. Mooncake's existence check takes a read lease too."""
        if len(keys) == 0 or not self._reachable():
            return np.zeros(len(keys), np.bool_)
        exists = self._call("batch_is_exist", self._names(keys))
        if not isinstance(exists, list) or len(exists) != len(keys):
            return np.zeros(len(keys), np.bool_)
        return np.array([e == 1 for e in exists], np.bool_)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        """Drop each value; False where the store refuses (a read lease: -706) or failed."""
        if len(keys) == 0 or not self._reachable():
            return np.zeros(len(keys), np.bool_)
        codes = self._call("batch_remove", self._names(keys))
        if not isinstance(codes, list) or len(codes) != len(keys):
            return np.zeros(len(keys), np.bool_)
        return np.array([c in (0, OBJECT_NOT_FOUND) for c in codes], np.bool_)
