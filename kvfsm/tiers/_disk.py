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

**Room.** Files take at most ``capacity_bytes`` of disk, counted as the file system allocates
them (``st_blocks * 512``, at least the length rounded up to the file system's block size: the
8 320-byte file of an 8 KiB payload takes 12 KiB with 4 KiB blocks), least recently used (put or
loaded) evicted first.
A write the file system refuses for want of room (``ENOSPC``, ``EDQUOT``: the disk is fuller than
``capacity_bytes`` assumed) evicts least recently used files and retries, a bounded number of
times, so a full disk recovers instead of refusing every put from then on.

Threads may share a tier: one lock guards the index, the LRU order, the counters and the name
changes (rename onto a final name, unlink), so index and directory always agree; reads, writes
and fsyncs run outside it. ``remove`` may run on one thread while puts and loads run on others.
One ``DiskTier`` per directory at a time: opening one deletes the temporary files of puts in
flight.
"""

from __future__ import annotations

import contextlib
import errno
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
from kvfsm.tiers._health import Health

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
#: ``st_blocks`` counts 512-byte units whatever the file system's block size (POSIX).
_STAT_BLOCK: Final = 512
#: Errors of a file system without room for a write.
_NO_ROOM: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Times a put evicts and writes again after the file system said it is full; each round frees
#: twice what the last did, so the last frees 2**_NO_ROOM_ROUNDS times the file's room. Bounded:
#: another process may fill the disk faster than the tier frees it, and a put must not empty the
#: tier trying.
_NO_ROOM_ROUNDS: Final = 3


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


def _rounded(length: int, block: int) -> int:
    """``length`` rounded up to a whole number of ``block``-byte blocks."""
    return -(-length // block) * block


def _block_size(directory: Path) -> int:
    """The allocation unit of the file system ``directory`` (or its nearest existing parent)
    is on: a file takes its length rounded up to it."""
    for where in (directory, *directory.parents):
        try:
            found = os.statvfs(where)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise TierError(f"disk tier directory {str(directory)!r} is unusable: {exc}") from exc
        return max(1, found.f_frsize or found.f_bsize)
    raise TierError(f"disk tier directory {str(directory)!r} has no existing parent")


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):  # a leftover that cannot go stays; it is never indexed
        os.unlink(path)


class DiskTier(StoredTier):
    """Block copies as files under ``directory``, taking at most ``capacity_bytes`` of disk (as
    allocated: see the module's docstring), least recently used evicted first. ``fsync=False``
    skips the fsyncs (tests, scratch caches): a crash may then lose recent values, never return
    a wrong one. :attr:`available` turns False when a write fails for the file system (no room
    even after evicting, an I/O error, read-only) and True at the next write that works."""

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
        self._block = _block_size(Path(self._dir))
        self._health = Health(f"DiskTier({self._dir})")
        self._lock = threading.Lock()
        #: File name -> (key, bytes the file takes on disk), least recently used first.
        self._index: OrderedDict[str, tuple[BlockKey, int]] = OrderedDict()
        self._used = 0
        #: Bytes reserved by puts whose files are being written (their length rounded up to
        #: the block size; what they take is counted once written).
        self._pending = 0
        self._evicted: list[BlockKey] = []
        self._scan()

    @staticmethod
    def capacity_for(directory: str | os.PathLike[str], payload_bytes: int, blocks: int) -> int:
        """The ``capacity_bytes`` that holds ``blocks`` block files of ``payload_bytes`` each in
        ``directory`` (which need not exist yet): header and payload rounded up to the block
        size of the file system it is on, times ``blocks``. Exact where the file system
        allocates whole blocks and nothing more (ext4, tmpfs); a bound to check with
        :attr:`bytes_used` elsewhere."""
        if payload_bytes < 0 or blocks < 0:
            raise ValueError(f"DiskTier.capacity_for needs payload_bytes and blocks >= 0, got "
                             f"{payload_bytes} and {blocks}")
        block = _block_size(Path(directory))
        return blocks * _rounded(HEADER_BYTES + payload_bytes, block)

    @property
    def available(self) -> bool:
        return self._health.available

    @property
    def last_error(self) -> str | None:
        return self._health.last_error

    def _room(self, length: int, stat: os.stat_result | None = None) -> int:
        """Bytes a file of ``length`` bytes takes: its length rounded up to the block size, or
        what ``stat`` of it says it takes where that is more (blocks preallocated, a bigger
        allocation unit than the file system reports)."""
        rounded = _rounded(length, self._block)
        return rounded if stat is None else max(rounded, stat.st_blocks * _STAT_BLOCK)

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
        """``(mtime, name, key, room)`` of a whole file; a torn or mismatched one is deleted, an
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
        return stat.st_mtime_ns, name, header.key, self._room(stat.st_size, stat)

    def _evict_for(self, size: int) -> None:
        """Under the lock: evict least recently used files until ``size`` more bytes fit."""
        while self._index and self._used + self._pending + size > self._capacity:
            self._evict_one()

    def _evict_one(self) -> int:
        """Under the lock: evict the least recently used file, its key queued for
        :meth:`drain_evicted`; the bytes it took."""
        name, (key, old) = self._index.popitem(last=False)
        self._used -= old
        self._evicted.append(key)
        _unlink(self._path(name))
        return old

    def _free(self, room: int) -> bool:
        """Evict least recently used files until they took ``room`` bytes (or none is left), for
        a write the file system refused as full; whether any was evicted."""
        freed = 0
        with self._lock:
            while self._index and freed < room:
                freed += self._evict_one()
        return freed > 0

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
        room = self._room(size)
        if room > self._capacity or view.nbytes > MAX_PAYLOAD_BYTES:
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
            self._evict_for(room)
            if self._used + self._pending + room > self._capacity:
                return False, False  # the room is reserved by puts in flight
            self._pending += room
        tmp = f"{self._prefix}.{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        taken = self._write_making_room(tmp, header, view, room)
        stored = taken is not None
        with self._lock:
            self._pending -= room
            if taken is not None:
                try:
                    os.replace(tmp, path)
                except OSError:
                    stored = False
                else:
                    self._drop(name)
                    self._index[name] = (key, taken)
                    self._used += taken
                    self._evict_for(0)  # where it took more than the room reserved
        if not stored:
            _unlink(tmp)
        return stored, stored

    def _write_making_room(self, tmp: str, header: bytes, view: memoryview,
                           room: int) -> int | None:
        """Write ``tmp``; the bytes it takes, or None if it could not be written. Where the file
        system is full, evict least recently used files (twice as much each round) and write
        again, at most ``_NO_ROOM_ROUNDS`` times."""
        for round_ in range(_NO_ROOM_ROUNDS + 1):
            try:
                taken = self._write(tmp, header, view)
            except OSError as exc:
                _unlink(tmp)  # a partial file holds blocks
                why = ""
                if exc.errno in _NO_ROOM and round_ < _NO_ROOM_ROUNDS:
                    if self._free(room << round_):
                        continue
                    why = " (no file of this tier left to evict)"
                elif exc.errno in _NO_ROOM:
                    why = f" (still full after evicting {_NO_ROOM_ROUNDS} times)"
                self._health.failed(f"writing {tmp}: {exc}{why}")
                return None
            self._health.ok()
            return taken
        return None  # not reached: the last round returns

    def _write(self, tmp: str, header: bytes, view: memoryview) -> int:
        """Write header and payload to a new ``tmp`` (fsync-ed unless told not to); the bytes it
        takes on disk. OSError where the file system refused."""
        fd = os.open(tmp, _WRITE_FLAGS, _FILE_MODE)
        try:
            size = HEADER_BYTES + view.nbytes
            if _full(os.writev, fd, [memoryview(header), view], size) != size:
                raise OSError(errno.EIO, f"short write of {size} bytes")
            if self._fsync:
                os.fsync(fd)
            return self._room(size, os.fstat(fd))
        finally:
            os.close(fd)

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
        # Names where something else (a directory) sits instead of a file: no copy there, for
        # good; one key's trouble, never a reason to call the whole tier failing.
        blocked: list[str] = []
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            name, path = self._key_path(key)
            try:
                fd = os.open(path, _READ_FLAGS)
            except FileNotFoundError:
                lost.append((name, None))
                continue
            except IsADirectoryError:
                status[i] = LoadStatus.CORRUPT
                blocked.append(name)
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
            except IsADirectoryError:
                status[i] = LoadStatus.CORRUPT
                blocked.append(name)
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
            for name in blocked:
                self._drop(name)
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
        """Which keys the tier holds, from its in-memory index: no file system call (one dict
        lookup per key), so an engine may ask it for every key it considers. It reflects puts,
        removes and evictions at once; a file deleted behind the tier's back is found by the
        next load (MISSING)."""
        with self._lock:
            return np.array([key.name + SUFFIX in self._index for key in keys], dtype=np.bool_)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        """Delete each key's file; True where it is gone (or was never there). Safe on a worker
        thread while puts and loads run: the unlink and the index change happen under the lock,
        a load that opened the file first still reads it whole, and a put that renames its file
        after this is simply stored (the later put wins). Removed keys are not reported by
        :meth:`drain_evicted` (the caller knows them)."""
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
        """Bytes the indexed files take on disk (as allocated: see the module's docstring)."""
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
