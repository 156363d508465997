"""The disk tier: one crash-safe, self-checking file per block under a directory.

A block's file is named ``key.name + ".kvb"`` (lower-case hex and dashes: no name can leave the
directory) and holds the contract's 128-byte header (:func:`encode_header`), then the raw payload;
no pickle. Why it survives crashes and bit rot:

* **Atomic rename.** A value is written under a temporary name in the same directory, fsync-ed,
  then ``os.replace``-d onto its name; the directory is fsync-ed once per batch. A reader sees the
  old file, the new one or none, never half of one; a crash before the rename leaves a ``*.tmp``
  file that reopening deletes.
* **Verify before use.** A load reads header and payload with one ``readv`` straight into the
  caller's buffer and checks the header's own xxh3, its key, the length and the payload's xxh3
  (:func:`verify`; the short way where the header is byte for byte the one a put of this key
  writes, so no header is decoded per block) before saying OK. A torn, flipped or foreign file
  is deleted (lost for good).
* **Reopening.** The constructor reads only each ``*.kvb`` file's header and indexes the whole
  ones, so a restarted engine finds its prefixes again; torn files are deleted.

At most ``capacity_bytes`` (headers included) are kept, least recently used (put or loaded)
evicted first. Threads may share a tier: one lock guards the index, the LRU order, the counters
and the name changes (rename onto a final name, unlink), so index and directory always agree;
reads, writes and fsyncs run outside it. One ``DiskTier`` per directory at a time: opening one
deletes the temporary files of puts in flight.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm.spec._vocabulary import Tier
from kvfsm.tiers._contract import (
    _FIELDS,
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    BlockKey,
    LoadResult,
    LoadStatus,
    StoredTier,
    TierError,
    decode_header,
    encode_header,
    verify,
)

#: Suffix of a block's file.
SUFFIX: Final = ".kvb"
#: Every file name the tier builds or indexes matches this; anything else in the directory is
#: left alone.
_NAME: Final = re.compile(r"^[0-9a-f-]+\.kvb$")
#: Temporary files: ``.<name>.<pid>.<thread id>.tmp``.
_TMP: Final = re.compile(r"^\.[0-9a-f-]+\.kvb\.[0-9]+\.[0-9]+\.tmp$")
_FILE_MODE: Final = 0o644
_READ_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
#: Bytes read past the expected end of a file to notice that it is too long.
_TAIL_BYTES: Final = 1
_LOST: Final = (LoadStatus.CORRUPT, LoadStatus.FOREIGN)


def _rest(views: list[memoryview], done: int) -> list[memoryview]:
    """``views`` less their first ``done`` bytes (after a short read or write)."""
    out = []
    for view in views:
        if done < view.nbytes:
            out.append(view[done:])
        done = max(0, done - view.nbytes)
    return out


def _full(op: Callable[[int, list[memoryview]], int], fd: int, views: list[memoryview],
          want: int) -> int:
    """Bytes moved by ``op`` (``os.readv`` or ``os.writev``), called again only after a short
    transfer that is neither ``want`` bytes nor the end of the file."""
    done = op(fd, views)
    while 0 < done < want:
        more = op(fd, _rest(views, done))
        if more == 0:
            break
        done += more
    return done


def _check(key: BlockKey, header: memoryview, view: memoryview) -> tuple[LoadStatus, int]:
    """What :func:`verify` answers for ``header`` + ``view`` (read whole), the short way first:
    a header byte for byte the one ``encode_header`` writes for ``key``, this length and the
    checksum it carries is whole, this key's and of this length, so the answer is OK exactly
    where the payload hashes to that checksum (else CORRUPT), with no header decoded and no key
    built (about 3 us a block less). Any other header gets :func:`verify`'s own answer
    (CORRUPT, FOREIGN, or OK for a whole header written another way)."""
    size = view.nbytes
    checksum: int = _FIELDS.unpack_from(header)[-1]
    if size <= MAX_PAYLOAD_BYTES and header == encode_header(key, size, checksum):
        if xxhash.xxh3_64_intdigest(view) == checksum:
            return LoadStatus.OK, checksum
        return LoadStatus.CORRUPT, 0
    return verify(key, header, view, size)


def _head(path: str) -> tuple[os.stat_result, bytes] | None:
    """The file's stat and its first ``HEADER_BYTES`` (fewer if it is shorter); None if it
    cannot be read."""
    try:
        fd = os.open(path, _READ_FLAGS)
        try:
            return os.fstat(fd), os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
    except OSError:
        return None


def _payload_matches(path: str, payload_bytes: int, checksum: int) -> bool:
    """Whether the file's payload hashes to ``checksum`` (a put over an existing file trusts
    it only then: a header can be whole over a flipped or torn payload)."""
    try:
        fd = os.open(path, _READ_FLAGS)
        try:
            payload = os.pread(fd, payload_bytes, HEADER_BYTES)
        finally:
            os.close(fd)
    except OSError:
        return False
    return len(payload) == payload_bytes and xxhash.xxh3_64_intdigest(payload) == checksum


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):  # a leftover that cannot go stays; it is never indexed
        os.unlink(path)


class DiskTier(StoredTier):
    """Block copies as files under ``directory``, at most ``capacity_bytes`` of them (headers
    included), least recently used evicted first. ``fsync=False`` skips the fsyncs (tests,
    scratch caches): a crash may then lose recent values, never return a wrong one."""

    tier = Tier.DISK

    def __init__(self, directory: str | os.PathLike[str], *, capacity_bytes: int,
                 fsync: bool = True) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 1:
            raise ValueError(f"DiskTier capacity_bytes must be an int >= 1, got "
                             f"{capacity_bytes!r}")
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)  # FileExistsError where it is a file
        except OSError as exc:
            raise TierError(f"disk tier directory {str(path)!r} is unusable: {exc}") from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise TierError(f"disk tier directory {str(path)!r} is not writable")
        self._dir = str(path.resolve())
        self._prefix = os.path.join(self._dir, "")
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        #: File name -> (key, file bytes), least recently used first.
        self._index: OrderedDict[str, tuple[BlockKey, int]] = OrderedDict()
        self._used = 0
        #: Bytes reserved by puts whose files are being written.
        self._pending = 0
        self._evicted: list[BlockKey] = []
        self._scan()

    def _key_path(self, key: BlockKey) -> tuple[str, str]:
        """``(file name, path)`` of ``key``'s file. A key's name is hex and dashes by
        construction (:attr:`BlockKey.name`), so unlike names read from the directory it needs
        no check to stay inside it (a load asks this per block)."""
        name = key.name + SUFFIX
        return name, self._prefix + name

    def _path(self, name: str) -> str:
        path = self._prefix + name
        if _NAME.match(name) is None or path.rpartition(os.sep)[0] != self._dir:
            raise TierError(f"unsafe disk tier file name {name!r}")
        return path

    def _scan(self) -> None:
        found: list[tuple[int, str, BlockKey, int]] = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if _TMP.match(entry.name):
                    _unlink(entry.path)
                elif _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    whole = self._scan_one(entry.name)
                    if whole is not None:
                        found.append(whole)
        for _mtime, name, key, size in sorted(found, key=lambda item: (item[0], item[1])):
            self._index[name] = (key, size)
            self._used += size
        with self._lock:
            self._evict_for(0)  # the capacity shrank since the last run

    def _scan_one(self, name: str) -> tuple[int, str, BlockKey, int] | None:
        """``(mtime, name, key, size)`` of a whole file; a torn or mismatched one is deleted, an
        unreadable one left alone, both answer None."""
        path = self._path(name)
        head = _head(path)
        if head is None:
            return None
        stat, header = head[0], decode_header(head[1])
        if (header is None or header.key.name + SUFFIX != name
                or stat.st_size != HEADER_BYTES + header.payload_bytes):
            _unlink(path)
            return None
        return stat.st_mtime_ns, name, header.key, int(stat.st_size)

    def _evict_for(self, size: int) -> None:
        """Under the lock: evict least recently used files until ``size`` more bytes fit, their
        keys queued for :meth:`drain_evicted`."""
        while self._index and self._used + self._pending + size > self._capacity:
            name, (key, old) = self._index.popitem(last=False)
            self._used -= old
            self._evicted.append(key)
            _unlink(self._path(name))

    def _drop(self, name: str) -> None:  # under the lock
        entry = self._index.pop(name, None)
        if entry is not None:
            self._used -= entry[1]

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        if not len(keys) == len(payloads) == len(checksums):
            raise ValueError(f"put got {len(keys)} keys, {len(payloads)} payloads and "
                             f"{len(checksums)} checksums")
        views = [memoryview(payload).cast("B") for payload in payloads]
        sums = np.asarray(checksums, dtype=np.uint64).tolist()
        done = np.zeros(len(keys), dtype=np.bool_)
        written = np.zeros(len(keys), dtype=np.bool_)
        for i, (key, view, checksum) in enumerate(zip(keys, views, sums, strict=True)):
            done[i], written[i] = self._put_one(key, view, checksum)
        if self._fsync and written.any():
            try:
                fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                done[written] = False  # the renames may not survive a crash
        return done

    def _put_one(self, key: BlockKey, view: memoryview, checksum: int) -> tuple[bool, bool]:
        """``(stored, wrote a file)`` for one key."""
        name = key.name + SUFFIX
        path = self._path(name)
        size = HEADER_BYTES + view.nbytes
        if size > self._capacity or view.nbytes > MAX_PAYLOAD_BYTES:
            return False, False
        header = encode_header(key, view.nbytes, checksum)
        with self._lock:
            present = name in self._index
        head = _head(path) if present else None
        if head is not None and head[0].st_size == size and head[1] == header \
                and _payload_matches(path, view.nbytes, checksum):
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
                    return True, False
        with self._lock:
            self._drop(name)  # bad (or evicted meanwhile): replaced below
            self._evict_for(size)
            if self._used + self._pending + size > self._capacity:
                return False, False  # the room is reserved by puts in flight
            self._pending += size
        tmp = f"{self._prefix}.{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        stored = self._write(tmp, header, view)
        with self._lock:
            self._pending -= size
            if stored:
                try:
                    os.replace(tmp, path)
                except OSError:
                    stored = False
                else:
                    self._drop(name)
                    self._index[name] = (key, size)
                    self._used += size
        if not stored:
            _unlink(tmp)
        return stored, stored

    def _write(self, tmp: str, header: bytes, view: memoryview) -> bool:
        try:
            fd = os.open(tmp, _WRITE_FLAGS, _FILE_MODE)
            try:
                size = HEADER_BYTES + view.nbytes
                if _full(os.writev, fd, [memoryview(header), view], size) != size:
                    return False
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        if len(keys) != len(outs):
            raise ValueError(f"load_into got {len(keys)} keys and {len(outs)} buffers")
        views = [memoryview(out).cast("B") for out in outs]
        if any(view.readonly for view in views):
            raise ValueError("load_into needs writable buffers")
        status = [LoadStatus.MISSING] * len(keys)
        checksum = [0] * len(keys)
        header = memoryview(bytearray(HEADER_BYTES))
        tail = memoryview(bytearray(_TAIL_BYTES))
        touched: list[str] = []
        lost: list[tuple[str, tuple[int, int] | None]] = []
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            name, path = self._key_path(key)
            try:
                fd = os.open(path, _READ_FLAGS)
            except FileNotFoundError:
                lost.append((name, None))
                continue
            except OSError:
                status[i] = LoadStatus.FAILED
                continue
            try:
                want = HEADER_BYTES + view.nbytes
                got = _full(os.readv, fd, [header, view, tail], want)
                if got == want:
                    found, checksum[i] = _check(key, header, view)
                else:
                    whole = decode_header(header) if got >= HEADER_BYTES else None
                    foreign = whole is not None and whole.key != key
                    found = LoadStatus.FOREIGN if foreign else LoadStatus.CORRUPT
                if found in _LOST:
                    stat = os.fstat(fd)
                    lost.append((name, (stat.st_dev, stat.st_ino)))
                else:
                    touched.append(name)
                status[i] = found
            except OSError:
                status[i] = LoadStatus.FAILED
            finally:
                os.close(fd)
        with self._lock:
            for name in touched:
                if name in self._index:
                    self._index.move_to_end(name)
            for name, inode in lost:
                self._forget(name, inode)
        return LoadResult(np.array(status, dtype=np.uint8), np.array(checksum, dtype=np.uint64))

    def _forget(self, name: str, inode: tuple[int, int] | None) -> None:
        """Under the lock: drop a file found missing (``inode`` None) or bad (delete it) unless
        a put replaced it since the load looked."""
        path = self._path(name)
        try:
            stat = os.stat(path)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                self._drop(name)
            return
        if inode == (stat.st_dev, stat.st_ino):
            _unlink(path)
            self._drop(name)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        with self._lock:
            return np.array([key.name + SUFFIX in self._index for key in keys], dtype=np.bool_)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        gone = np.zeros(len(keys), dtype=np.bool_)
        with self._lock:
            for i, key in enumerate(keys):
                name = key.name + SUFFIX
                try:
                    os.unlink(self._path(name))
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self._drop(name)
                gone[i] = True
        return gone

    def drain_evicted(self) -> list[BlockKey]:
        """Keys whose files the size cap evicted since the last call, each reported once. The
        engine forgets these blocks' disk copies (clears their disk bit) so it never plans a
        restore from a file that is gone. Files found lost by a load are not reported here:
        their status already says so."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def keys(self) -> list[BlockKey]:
        """The keys indexed, least recently used first."""
        with self._lock:
            return [key for key, _size in self._index.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        """Header + payload bytes of the indexed files."""
        with self._lock:
            return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def directory(self) -> Path:
        return Path(self._dir)

    def close(self) -> None:
        """Nothing to release: the tier holds no file open between calls. Stored files stay."""
