"""The stored tiers of the serving demo: a disk tier per engine, one remote store per demo run,
and the raw access to stored values that a hit-only reader and the fault injectors use.

* :func:`choose_remote` picks the remote backend (``--remote``): ``auto`` takes Mooncake when
  its client imports and ``mooncake_master`` is installed, else Redis when the ``redis`` client
  imports and ``redis-server`` is installed, else none (disk only, and the report says why).
* :class:`RemoteStore` starts the chosen server on 127.0.0.1, opens one client tier on it and
  stops both on exit (also on an error or Ctrl-C). Engines share that client; each engine keys
  its values in its own namespace (:func:`namespace`, the ``cache_salt`` of its core: it is part
  of every key's model digest), so no run sees another run's values.
* :class:`ObservedTier` is what an engine is given: it passes every call through to the real tier
  and records each key's last load status (the report shows them per restore step), and it can
  hold chosen keys' loads back for a while (the ``slow_remote`` fault).
* :func:`read_value`, :func:`write_value` and :func:`delete_value` reach a stored value behind
  the tier's back: the file of a :class:`~kvfsm.tiers.DiskTier`, or the value of a remote tier
  through its raw client (``prefix + key.name``). Nothing there checks a header or checksum.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.spec import Tier
from kvfsm.tiers import (
    BlockKey,
    DiskTier,
    LoadResult,
    LoadStatus,
    MooncakeMaster,
    MooncakeTier,
    RedisServer,
    RedisTier,
    StoredTier,
    TierError,
)

#: What ``kvfsm demo --remote`` accepts.
REMOTE_CHOICES: Final = ("auto", "mooncake", "redis", "none")
#: Backends in the order ``auto`` tries them.
REMOTE_BACKENDS: Final = ("mooncake", "redis")
#: What runs each backend, for the report.
SERVED_BY: Final = {"mooncake": "Mooncake Store (mooncake_master)", "redis": "Redis (redis-server)"}
#: Key prefix of every remote value the demo writes.
REMOTE_PREFIX: Final = "kvfsm-demo/"
#: Memory this process lends the Mooncake Store for values (every engine's values of a run).
MOONCAKE_SEGMENT_BYTES: Final = 256 << 20
#: Disk bytes a demo engine may keep: far more than its pools hold, so the disk's own size cap
#: never evicts behind the core's back (the core's ``disk_blocks`` bound what it keeps there).
DISK_CAPACITY_BYTES: Final = 1 << 30
#: The suffix of a disk tier's block files.
DISK_SUFFIX: Final = ".kvb"


def namespace(*parts: str) -> str:
    """The cache salt that keeps one engine's stored values apart from every other engine's."""
    return "kvfsm-demo/" + "/".join(parts)


# -- choosing and running the remote store ----------------------------------------------------

def remote_unusable(backend: str) -> str | None:
    """Why ``backend`` (``mooncake`` or ``redis``) cannot run here; None when it can."""
    server: MooncakeMaster | RedisServer
    if backend == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except (ImportError, OSError) as exc:
            return f"the Mooncake client does not import ({exc})"
        server = MooncakeMaster()
    elif backend == "redis":
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            return f"the redis client does not import ({exc})"
        server = RedisServer()
    else:
        raise KvfsmError(f"remote backend must be one of {list(REMOTE_BACKENDS)}, got "
                         f"{backend!r}")
    try:
        server.executable()
    except TierError as exc:
        return str(exc)
    return None


def choose_remote(wanted: str) -> tuple[str | None, str]:
    """The remote backend to run for ``--remote wanted`` (None: no remote tier) and one line
    saying what was chosen and why. ``mooncake`` or ``redis`` asked for by name and unusable is a
    :class:`KvfsmError`; ``auto`` falls back along :data:`REMOTE_BACKENDS`, then to none."""
    if wanted not in REMOTE_CHOICES:
        raise KvfsmError(f"--remote must be one of {list(REMOTE_CHOICES)}, got {wanted!r}")
    if wanted == "none":
        return None, "No remote tier (--remote none): blocks spill to host and disk only"
    if wanted != "auto":
        why = remote_unusable(wanted)
        if why is not None:
            raise KvfsmError(f"--remote {wanted}: {why}")
        return wanted, f"Remote tier: {SERVED_BY[wanted]} on 127.0.0.1 (--remote {wanted})"
    reasons = []
    for backend in REMOTE_BACKENDS:
        why = remote_unusable(backend)
        if why is None:
            return backend, f"Remote tier: {SERVED_BY[backend]} on 127.0.0.1 (--remote auto)"
        reasons.append(f"{backend}: {why}")
    return None, ("No remote tier (--remote auto found none usable: " + "; ".join(reasons)
                  + "): blocks spill to host and disk only")


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null meanwhile: Mooncake's client logs its setup and
    teardown there (glog, before any logging setup a caller could change)."""
    import sys

    with contextlib.suppress(AttributeError, ValueError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class RemoteStore:
    """A store server on 127.0.0.1 and one client tier on it, for one demo run (a context
    manager: the client is closed and the server stopped on exit, error or Ctrl-C)."""

    def __init__(self, backend: str) -> None:
        if backend not in REMOTE_BACKENDS:
            raise KvfsmError(f"remote backend must be one of {list(REMOTE_BACKENDS)}, got "
                             f"{backend!r}")
        self.backend = backend
        self.server: MooncakeMaster | RedisServer | None = None
        self.tier: MooncakeTier | RedisTier | None = None

    @property
    def address(self) -> str:
        return "-" if self.server is None else self.server.address

    def start(self) -> RemoteStore:
        try:
            if self.backend == "mooncake":
                master = self.server = MooncakeMaster()
                master.start()
                with quiet_stderr():
                    self.tier = MooncakeTier(master.address, prefix=REMOTE_PREFIX,
                                             global_segment_bytes=MOONCAKE_SEGMENT_BYTES,
                                             local_buffer_bytes=32 << 20,
                                             lease_s=master.lease_s)
            else:
                server = self.server = RedisServer()
                server.start()
                self.tier = RedisTier(server.address, prefix=REMOTE_PREFIX)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close the client and stop the server; safe to call twice."""
        tier, self.tier = self.tier, None
        server, self.server = self.server, None
        try:
            if tier is not None:
                with quiet_stderr():
                    tier.close()
        finally:
            if server is not None:
                server.stop()

    def __enter__(self) -> RemoteStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RemoteStore({self.backend} at {self.address})"


@contextlib.contextmanager
def remote_store(backend: str | None) -> Iterator[RemoteStore | None]:
    """A running :class:`RemoteStore` of ``backend``, or None for none."""
    if backend is None:
        yield None
        return
    with RemoteStore(backend) as store:
        yield store


# -- the tier an engine is given --------------------------------------------------------------

class ObservedTier(StoredTier):
    """A stored tier passed through, with what the demo needs around it: each key's last load
    status (:meth:`status_of`), loads of chosen keys held back (:meth:`slow_down`), and raw
    access to values (:func:`read_value`). ``owned``: close the inner tier on :meth:`close`
    (not for a client shared by several engines)."""

    def __init__(self, inner: StoredTier, *, owned: bool = True) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.owned = owned
        self._lock = threading.Lock()
        self._status: dict[BlockKey, LoadStatus] = {}
        self._slow: dict[BlockKey, float] = {}

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        return self.inner.put(keys, payloads, checksums)

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        with self._lock:
            delay = max((self._slow.pop(key, 0.0) for key in keys), default=0.0)
        if delay > 0:
            time.sleep(delay)  # a slow store: the read answers only after this
        result = self.inner.load_into(keys, outs)
        with self._lock:
            for key, status in zip(keys, result.status.tolist(), strict=True):
                self._status[key] = LoadStatus(int(status))
        return result

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.contains(keys)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.remove(keys)

    def drain_evicted(self) -> list[BlockKey]:
        drain = getattr(self.inner, "drain_evicted", None)
        return [] if drain is None else list(drain())

    def close(self) -> None:
        if self.owned:
            self.inner.close()

    def status_of(self, key: BlockKey) -> LoadStatus | None:
        """The status of ``key``'s last load through this tier, None if it was never loaded."""
        with self._lock:
            return self._status.get(key)

    def slow_down(self, keys: Sequence[BlockKey], seconds: float) -> None:
        """The next load of any of ``keys`` answers ``seconds`` later than the store does."""
        with self._lock:
            for key in keys:
                self._slow[key] = seconds


def _inner(tier: StoredTier) -> StoredTier:
    return tier.inner if isinstance(tier, ObservedTier) else tier


def _disk_path(tier: DiskTier, key: BlockKey) -> Path:
    return tier.directory / (key.name + DISK_SUFFIX)


def value_name(tier: StoredTier, key: BlockKey) -> str:
    """Where ``key``'s value lives: a file path for a disk tier, the store key for a remote."""
    inner = _inner(tier)
    if isinstance(inner, DiskTier):
        return str(_disk_path(inner, key))
    if isinstance(inner, MooncakeTier | RedisTier):
        return inner.prefix + key.name
    raise KvfsmError(f"no raw access to a {type(inner).__name__}")


def read_value(tier: StoredTier, key: BlockKey) -> bytes | None:
    """The bytes stored under ``key`` (header, then payload) as they are, None if nothing is:
    no header, length or checksum checked."""
    inner = _inner(tier)
    if isinstance(inner, DiskTier):
        try:
            return _disk_path(inner, key).read_bytes()
        except FileNotFoundError:
            return None
    name = value_name(inner, key)
    if isinstance(inner, MooncakeTier):
        data = inner.client.get(name)
        return bytes(data) if data else None
    data = _inner_client(inner).get(name)
    return None if data is None else bytes(data)


def write_value(tier: StoredTier, key: BlockKey, data: bytes) -> None:
    """Put ``data`` under ``key`` behind the tier's back (over whatever is there)."""
    inner = _inner(tier)
    if isinstance(inner, DiskTier):
        _disk_path(inner, key).write_bytes(data)
        return
    name = value_name(inner, key)
    if isinstance(inner, MooncakeTier):
        with quiet_stderr():
            code = inner.client.upsert(name, data)
        if code != 0:
            raise KvfsmError(f"Mooncake upsert of {name} answered {code}")
        return
    _inner_client(inner).set(name, data)


def delete_value(tier: StoredTier, key: BlockKey) -> bool:
    """Drop ``key``'s value behind the tier's back (a store evicting it, a file deleted): its
    index, if it keeps one, still says it is there. True if something was deleted."""
    inner = _inner(tier)
    if isinstance(inner, DiskTier):
        try:
            _disk_path(inner, key).unlink()
        except FileNotFoundError:
            return False
        return True
    name = value_name(inner, key)
    if isinstance(inner, MooncakeTier):
        with quiet_stderr():
            return bool(inner.client.remove(name, True) == 0)  # forced: past any read lease
    return bool(_inner_client(inner).delete(name))


def _inner_client(tier: StoredTier) -> Any:
    if not isinstance(tier, RedisTier):
        raise KvfsmError(f"no raw client for a {type(tier).__name__}")
    return tier.client


# -- an engine's own stored tiers -------------------------------------------------------------

@contextlib.contextmanager
def engine_tiers(remote: RemoteStore | None, *, disk: bool = True,
                 use_remote: bool = True) -> Iterator[dict[Tier | str, StoredTier]]:
    """The stored tiers of one demo engine: a :class:`DiskTier` in a fresh temporary directory
    (removed on exit) and, when ``remote`` runs and ``use_remote``, the run's shared remote
    client; each wrapped in an :class:`ObservedTier`."""
    tiers: dict[Tier | str, StoredTier] = {}
    directory = tempfile.mkdtemp(prefix="kvfsm-demo-disk-") if disk else None
    try:
        if directory is not None:
            tiers["disk"] = ObservedTier(DiskTier(directory, capacity_bytes=DISK_CAPACITY_BYTES,
                                                  fsync=False))
        if remote is not None and remote.tier is not None and use_remote:
            tiers["remote"] = ObservedTier(remote.tier, owned=False)
        yield tiers
    finally:
        for tier in tiers.values():
            tier.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def observed(tiers: Mapping[Tier, StoredTier], tier: Tier) -> ObservedTier | None:
    """The :class:`ObservedTier` an engine was given for ``tier``, if any."""
    found = tiers.get(tier)
    return found if isinstance(found, ObservedTier) else None
