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

import os
import socket
import time
from collections.abc import Callable, Sequence
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
    TierError,
    encode_header,
    verify,
)

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
#: The master's default ``--default_kv_lease_ttl`` (10 000 ms).
DEFAULT_LEASE_S: Final = 10.0
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
      next calls first try a TCP connection to the master and answer FAILED at once while it is
      refused (a call into a dead master can take 4 s). Mooncake's client reconnects by itself
      (it pings the master and, after three failed pings, reconnects and remounts its segment);
      for about a second after a master restart puts answer False (-200) and loads MISSING (a
      restarted master has lost every key), then both work again.
    * **Evictions.** A key evicted (or removed by anyone) between ``contains`` and
      ``load_into`` is MISSING.

    Building one needs a master that answers (else TierError at once; Mooncake's own setup
    would retry for 90 s); ``close()`` takes a second or two (it unmounts at the master). With
    ``local_hostname`` on loopback the constructor sets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` and
    ``MC_TE_FILTERS=lo`` in ``os.environ``, else the transfer engine advertises another
    interface than the one it listens on.
    """

    tier = Tier.REMOTE

    def __init__(self, master_address: str, *, global_segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 64 << 20, local_hostname: str = "127.0.0.1",
                 prefix: str = "kvfsm/", lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.monotonic,
                 probe_timeout_s: float = 0.5) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as exc:
            raise TierError(f"MooncakeTier needs the Mooncake Store client ({exc}); install it "
                            f"with: {_INSTALL}") from exc
        host, _, port = master_address.rpartition(":")
        if not host or not port.isdigit():
            raise TierError(f"master_address must be 'host:port', got {master_address!r}")
        self.master_address = master_address
        self.prefix = prefix
        self.lease_s = lease_s
        self._master = (host, int(port))
        self._clock = clock
        self._probe_timeout_s = probe_timeout_s
        self._suspect = True  # a probe first: setup() retries a dead master for 90 s
        if not self._reachable():
            raise TierError(f"no Mooncake master answers at {master_address}: is "
                            "`mooncake_master` running there?")
        if local_hostname in ("127.0.0.1", "localhost"):
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
            os.environ["MC_TE_FILTERS"] = "lo"
        self._client = MooncakeDistributedStore()
        code = self._client.setup(local_hostname, "P2PHANDSHAKE", global_segment_bytes,
                                 local_buffer_bytes, "tcp", "", master_address)
        if code != 0:
            self._client = None
            raise TierError(f"Mooncake client setup against master {master_address} failed "
                            f"with code {code}")
        self._suspect = False

    def close(self) -> None:
        """Unmount this process's segment (values stored in it are gone) and close the client."""
        super().close()

    # -- plumbing ------------------------------------------------------------------------------

    def _reachable(self) -> bool:
        """True unless a recent call saw the master fail and it still refuses connections."""
        if not self._suspect:
            return True
        try:
            with socket.create_connection(self._master, timeout=self._probe_timeout_s):
                return True
        except OSError:
            return False

    def _call(self, method: str, *args: Any) -> Any:
        """``client.method(*args)``; None on an exception (and the master is suspect)."""
        try:
            result = getattr(self.client, method)(*args)
        except TierError:
            raise
        except Exception:
            self._suspect = True
            return None
        codes = result if isinstance(result, list) else [result]
        self._suspect = any(isinstance(c, int) and c < 0 and c not in _PER_KEY for c in codes)
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
