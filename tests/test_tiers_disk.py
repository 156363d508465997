"""The disk tier: round trips, content addressing, every fault a file can suffer (each found by
its status and lost files deleted), crashes and reopening, the LRU size cap counted in what files
take on disk, a full file system (ENOSPC) evicting and recovering, threads (remove among puts and
loads), misuse."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from numpy.typing import NDArray

from kvfsm.tiers import HEADER_BYTES, BlockKey, DiskTier, LoadResult, LoadStatus, TierError

SIZE = 4096
FILE = HEADER_BYTES + SIZE


def key(i: int, *, model: bytes = b"m" * 16, layout: int = 7, chain: int | None = None,
        start: int | None = None) -> BlockKey:
    start = 16 * i if start is None else start
    return BlockKey(model=model, group=3, layout=layout, chain_high=0xABC,
                    chain_low=1000 + i if chain is None else chain,
                    token_start=start, token_end=start + 16)


def payload(seed: int, n: int = SIZE) -> NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sums(payloads: list[Any]) -> NDArray[np.uint64]:
    return np.array([xxhash.xxh3_64_intdigest(p) for p in payloads], dtype=np.uint64)


def put(tier: DiskTier, keys: list[BlockKey], payloads: list[Any]) -> NDArray[np.bool_]:
    return tier.put(keys, payloads, sums(payloads))


def load(tier: DiskTier, keys: list[BlockKey],
         n: int = SIZE) -> tuple[LoadResult, NDArray[np.uint8]]:
    outs = np.zeros((len(keys), n), dtype=np.uint8)
    return tier.load_into(keys, list(outs)), outs


def file_of(tier: DiskTier, k: BlockKey) -> Path:
    return tier.directory / (k.name + ".kvb")


def taken(path: Path) -> int:
    """Bytes a file takes on disk, as ``os.stat`` reports them."""
    return path.stat().st_blocks * 512


def on_disk(tier: DiskTier) -> int:
    """Bytes the tier's files take on disk, by ``os.stat`` of each."""
    held = tier.keys()
    return sum(taken(file_of(tier, k)) for k in held)


def room(directory: Path) -> int:
    """What a ``FILE``-byte block file takes on ``directory``'s file system."""
    probe = directory / "probe"
    probe.write_bytes(bytes(payload(0, FILE)))
    size = taken(probe)
    probe.unlink()
    return size


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", capacity_bytes=1 << 24)


def test_round_trip_of_a_batch(tier: DiskTier) -> None:
    keys = [key(i) for i in range(6)]
    data = [payload(i) for i in range(6)]
    mixed: list[Any] = [data[0], bytes(data[1]), data[2].data, *data[3:]]
    assert put(tier, keys, mixed).all()
    result, outs = load(tier, keys)
    assert (result.status == LoadStatus.OK).all() and result.ok.all()
    assert np.array_equal(outs, np.stack(data))
    assert result.checksum.tolist() == sums(data).tolist()
    assert len(tier) == 6 and tier.bytes_used == on_disk(tier)
    assert tier.contains([*keys, key(99)]).tolist() == [True] * 6 + [False]
    assert set(tier.keys()) == set(keys)
    assert sorted(p.name for p in tier.directory.iterdir()) == sorted(
        k.name + ".kvb" for k in keys)
    assert all(file_of(tier, k).stat().st_size == FILE for k in keys)


def test_put_of_an_existing_key_does_not_rewrite(tier: DiskTier) -> None:
    k, data = key(0), payload(0)
    assert put(tier, [k], [data]).all()
    before = file_of(tier, k).stat()
    assert put(tier, [k], [data]).all()
    after = file_of(tier, k).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert len(tier) == 1 and tier.bytes_used == on_disk(tier)


def test_put_replaces_a_bad_file_atomically(tier: DiskTier) -> None:
    k, data = key(0), payload(0)
    put(tier, [k], [data])
    path = file_of(tier, k)
    with path.open("r+b") as f:
        f.truncate(FILE // 2)
    before = path.stat().st_ino
    assert put(tier, [k], [data]).all()
    assert path.stat().st_ino != before and path.stat().st_size == FILE
    result, outs = load(tier, [k])
    assert result.ok.all() and np.array_equal(outs[0], data)
    assert len(tier) == 1 and tier.bytes_used == on_disk(tier)


def _truncate(size: int) -> Callable[[Path], None]:
    def fault(path: Path) -> None:
        with path.open("r+b") as f:
            f.truncate(size)
    return fault


def _flip(offset: int) -> Callable[[Path], None]:
    def fault(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x10
        path.write_bytes(bytes(raw))
    return fault


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


FAULTS: dict[str, Callable[[Path], None]] = {
    "torn mid-payload": _truncate(HEADER_BYTES + SIZE // 2),
    "header only": _truncate(HEADER_BYTES),
    "torn header": _truncate(HEADER_BYTES // 2),
    "empty": _truncate(0),
    "flipped payload bit": _flip(HEADER_BYTES + 100),
    "flipped header bit": _flip(40),
    "flipped header checksum": _flip(HEADER_BYTES - 1),
    "one byte too long": _append,
    "deleted behind the tier's back": Path.unlink,
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_file_is_found_and_lost_for_good(tier: DiskTier, fault: str) -> None:
    keys, data = [key(0), key(1)], [payload(0), payload(1)]
    put(tier, keys, data)
    FAULTS[fault](file_of(tier, keys[0]))
    result, outs = load(tier, keys)
    missing = fault.startswith("deleted")
    assert result.status.tolist() == [LoadStatus.MISSING if missing else LoadStatus.CORRUPT,
                                      LoadStatus.OK]
    assert result.checksum[0] == 0 and np.array_equal(outs[1], data[1])
    assert not file_of(tier, keys[0]).exists()
    assert tier.contains(keys).tolist() == [False, True]
    assert len(tier) == 1 and tier.bytes_used == on_disk(tier)
    assert load(tier, keys[:1])[0].status.tolist() == [LoadStatus.MISSING]


def test_a_directory_where_a_file_belongs_is_no_copy_and_is_left_alone(tier: DiskTier) -> None:
    """A directory sitting under a block's file name is not a copy of it, for good (CORRUPT:
    the engine forgets the block and recomputes it) rather than a failed read to retry for
    ever; the directory is not the tier's to delete, and a put cannot replace it."""
    put(tier, [key(1)], [payload(1)])
    file_of(tier, key(0)).mkdir()  # opens, but reading it is EISDIR
    result, _ = load(tier, [key(0), key(1)])
    assert result.status.tolist() == [LoadStatus.CORRUPT, LoadStatus.OK]
    assert LoadStatus.CORRUPT.lost and file_of(tier, key(0)).is_dir()
    assert tier.available
    assert put(tier, [key(0), key(2)], [payload(0), payload(2)]).tolist() == [False, True]
    assert list(tier.directory.glob(".*.tmp")) == [] and len(tier) == 2


OTHERS: dict[str, tuple[BlockKey, int]] = {
    "another model": (key(0, model=b"x" * 16), SIZE),
    "another layout, same size": (key(0, layout=8), SIZE),
    "another layout, another size": (key(0, layout=9), 2 * SIZE),
    "another chain hash": (key(0, chain=5), SIZE),
    "another token range": (key(0, start=32), SIZE),
}


@pytest.mark.parametrize("other", list(OTHERS))
def test_a_whole_file_of_another_key_is_foreign(tier: DiskTier, other: str) -> None:
    mine, (theirs, size) = key(0), OTHERS[other]
    put(tier, [mine, theirs], [payload(0), payload(1, size)])
    os.replace(file_of(tier, theirs), file_of(tier, mine))
    result, _ = load(tier, [mine])
    assert result.status.tolist() == [LoadStatus.FOREIGN] and result.checksum[0] == 0
    assert not file_of(tier, mine).exists() and not tier.contains([mine]).any()


def test_a_failed_rename_stores_nothing(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("no rename today")

    monkeypatch.setattr(os, "replace", refuse)
    assert put(tier, [key(0), key(1)], [payload(0), payload(1)]).tolist() == [False, False]
    assert list(tier.directory.iterdir()) == []
    assert len(tier) == 0 and tier.bytes_used == 0 and not tier.contains([key(0)]).any()


class Crash(BaseException):
    """The process dies: nothing after it runs."""


def test_a_crash_between_write_and_rename_leaves_a_temp_file_reopening_removes(
        tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    put(tier, [key(0)], [payload(0)])

    def crash(*args: Any, **kwargs: Any) -> None:
        raise Crash

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(Crash):
        put(tier, [key(1)], [payload(1)])
    monkeypatch.undo()
    assert [p.name for p in tier.directory.glob("*.tmp")] != []
    assert not file_of(tier, key(1)).exists()
    again = DiskTier(tier.directory, capacity_bytes=1 << 24)
    assert list(again.directory.glob("*.tmp")) == []
    assert again.keys() == [key(0)]
    assert load(again, [key(0), key(1)])[0].status.tolist() == [LoadStatus.OK,
                                                                LoadStatus.MISSING]


def test_reopening_indexes_whole_files_and_deletes_torn_ones(tier: DiskTier) -> None:
    keys, data = [key(i) for i in range(8)], [payload(i) for i in range(8)]
    put(tier, keys, data)
    _truncate(HEADER_BYTES + 10)(file_of(tier, keys[1]))
    _flip(20)(file_of(tier, keys[2]))
    _append(file_of(tier, keys[3]))
    os.replace(file_of(tier, keys[4]), tier.directory / (key(50).name + ".kvb"))  # misnamed
    (tier.directory / "notes.txt").write_text("mine")
    (tier.directory / "NOTES.kvb").write_text("mine too")
    again = DiskTier(tier.directory, capacity_bytes=1 << 24)
    good = [0, 5, 6, 7]
    assert sorted(again.keys(), key=lambda k: k.chain_low) == [keys[i] for i in good]
    assert len(again) == 4 and again.bytes_used == on_disk(again)
    result, outs = load(again, keys)
    assert [i for i, s in enumerate(result.status) if s == LoadStatus.OK] == good
    assert all(np.array_equal(outs[i], data[i]) for i in good)
    assert sorted(p.name for p in again.directory.iterdir()) == sorted(
        [keys[i].name + ".kvb" for i in good] + ["notes.txt", "NOTES.kvb"])


def test_the_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    per = room(tmp_path)
    tier = DiskTier(tmp_path, capacity_bytes=4 * per)
    keys, data = [key(i) for i in range(7)], [payload(i) for i in range(7)]
    assert put(tier, keys[:4], data[:4]).all()
    assert tier.drain_evicted() == []
    assert load(tier, keys[:1])[0].ok.all()     # uses: 1 2 3 0
    assert put(tier, keys[1:2], data[1:2]).all()  # uses: 2 3 0 1
    assert put(tier, keys[4:5], data[4:5]).all()
    assert tier.drain_evicted() == [keys[2]] and tier.drain_evicted() == []
    assert put(tier, keys[5:7], data[5:7]).all()
    assert tier.drain_evicted() == [keys[3], keys[0]]
    assert tier.contains(keys).tolist() == [False, True, False, False, True, True, True]
    assert {p.name for p in tmp_path.iterdir()} == {keys[i].name + ".kvb" for i in (1, 4, 5, 6)}
    assert tier.bytes_used == on_disk(tier) == 4 * per <= tier.capacity_bytes
    for age, i in enumerate((6, 1, 5, 4)):  # reopening orders uses by modification time
        os.utime(file_of(tier, keys[i]), ns=(age * 10**9, age * 10**9))
    smaller = DiskTier(tmp_path, capacity_bytes=2 * per)  # reopened with less room
    assert smaller.drain_evicted() == [keys[6], keys[1]] and smaller.keys() == [keys[5], keys[4]]
    assert len(list(tmp_path.iterdir())) == 2


def test_a_value_bigger_than_the_capacity_is_refused(tmp_path: Path) -> None:
    per = room(tmp_path)
    tier = DiskTier(tmp_path, capacity_bytes=2 * per)
    put(tier, [key(0)], [payload(0)])
    assert put(tier, [key(1)], [payload(1, 2 * per - HEADER_BYTES + 1)]).tolist() == [False]
    assert tier.keys() == [key(0)] and tier.drain_evicted() == []
    assert not file_of(tier, key(1)).exists()


def test_misconfiguration_raises(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(TierError, match="file"):
        DiskTier(tmp_path / "file", capacity_bytes=FILE)
    for capacity in (0, -1, "1024", 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            DiskTier(tmp_path / "d", capacity_bytes=capacity)  # type: ignore[arg-type]


def test_bad_batches_raise_and_write_nothing(tier: DiskTier) -> None:
    data = [payload(0), payload(1)]
    with pytest.raises(ValueError, match="payloads"):
        tier.put([key(0), key(1)], data[:1], sums(data))
    with pytest.raises(ValueError, match="checksums"):
        tier.put([key(0), key(1)], data, sums(data[:1]))
    with pytest.raises(ValueError, match="buffers"):
        tier.load_into([key(0)], [])
    with pytest.raises(ValueError, match="writable"):
        tier.load_into([key(0)], [bytes(SIZE)])
    assert list(tier.directory.iterdir()) == [] and len(tier) == 0


def test_remove_counts_missing_as_gone(tier: DiskTier) -> None:
    put(tier, [key(0), key(1)], [payload(0), payload(1)])
    assert tier.remove([key(0), key(9)]).tolist() == [True, True]
    assert not file_of(tier, key(0)).exists() and tier.keys() == [key(1)]
    assert tier.bytes_used == on_disk(tier) and tier.drain_evicted() == []


def test_concurrent_loads_and_puts_see_only_whole_values(tier: DiskTier) -> None:
    written, data = [key(i) for i in range(16)], [payload(i) for i in range(16)]
    put(tier, written, data)
    statuses: list[int] = []
    mismatches: list[int] = []
    stored: list[bool] = []

    def work(worker: int) -> None:
        for round_ in range(20):
            picks = [(worker * 5 + round_ * 3 + j) % 16 for j in range(4)]
            result, outs = load(tier, [written[i] for i in picks])
            statuses.extend(result.status.tolist())
            mismatches.extend(j for j, i in enumerate(picks)
                              if not np.array_equal(outs[j], data[i]))
            fresh = 100 + worker * 100 + round_
            stored.extend(put(tier, [key(fresh), written[picks[0]]],
                              [payload(fresh), data[picks[0]]]).tolist())

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 4 * 20 * 4 and set(statuses) == {LoadStatus.OK}
    assert mismatches == [] and all(stored)
    assert len(tier) == 16 + 80 and tier.bytes_used == on_disk(tier)
    assert list(tier.directory.glob("*.tmp")) == []


def test_a_put_over_a_file_with_a_damaged_payload_rewrites_it(tmp_path: Path) -> None:
    """A whole header over a flipped payload is not "already stored": the put writes the value
    again, so the next load is OK rather than CORRUPT."""
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)
    key = BlockKey(b"m" * 16, 1, 2, 3, 4, 0, 16)
    payload = np.arange(256, dtype=np.uint8)
    sums = np.array([xxhash.xxh3_64_intdigest(payload)], dtype=np.uint64)
    assert tier.put([key], [payload], sums).all()
    path = tmp_path / (key.name + ".kvb")
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    assert tier.put([key], [payload], sums).all()
    out = np.empty(256, dtype=np.uint8)
    assert tier.load_into([key], [out]).status.tolist() == [LoadStatus.OK]
    assert (out == payload).all()


# -- what files take on disk, and a full file system -----------------------------------------------


def test_bytes_used_and_the_cap_count_what_files_take_on_disk(tmp_path: Path) -> None:
    """An 8 KiB block file takes more than 8 KiB of disk: the cap counts what ``os.stat`` says
    files take (allocated blocks), not their length."""
    tier = DiskTier(tmp_path / "sizes", capacity_bytes=1 << 24)
    sizes = [1, 4096 - HEADER_BYTES, 4096 - HEADER_BYTES + 1, 8192, 100_000]
    keys = [key(i) for i in range(len(sizes))]
    assert put(tier, keys, [payload(i, n) for i, n in enumerate(sizes)]).all()
    assert tier.bytes_used == on_disk(tier) > sum(HEADER_BYTES + n for n in sizes)
    assert DiskTier(tier.directory, capacity_bytes=1 << 24).bytes_used == tier.bytes_used
    per = room(tmp_path)
    assert per > FILE  # files are allocated in whole blocks
    capped = DiskTier(tmp_path / "capped", capacity_bytes=3 * per)
    four = [key(10 + i) for i in range(4)]
    for i, k in enumerate(four):
        assert put(capped, [k], [payload(10 + i)]).all()
    assert capped.drain_evicted() == four[:1]
    assert capped.bytes_used == on_disk(capped) == 3 * per


def test_capacity_for_sizes_the_cap_in_block_files(tmp_path: Path) -> None:
    where = tmp_path / "not" / "yet"
    capacity = DiskTier.capacity_for(where, SIZE, 4)
    assert capacity == 4 * room(tmp_path)
    tier = DiskTier(where, capacity_bytes=capacity)
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys[:4]):
        assert put(tier, [k], [payload(i)]).all()
    assert tier.drain_evicted() == [] and tier.bytes_used == capacity
    assert put(tier, keys[4:], [payload(4)]).all() and tier.drain_evicted() == keys[:1]
    with pytest.raises(ValueError, match="blocks"):
        DiskTier.capacity_for(where, SIZE, -1)


class FullDisk:
    """``os.writev`` on a file system with room for ``files`` block files only, whatever the
    tier's ``capacity_bytes`` says: ENOSPC (nothing written) where one more would not fit, as a
    disk shared with other data fills up. ``files=0``: a disk full of other data."""

    def __init__(self, directory: Path, per: int, files: int) -> None:
        self.directory, self.per, self.files = directory, per, files
        self.refused = 0
        self._writev = os.writev

    def __call__(self, fd: int, buffers: Any) -> int:
        used = sum(taken(p) for p in self.directory.iterdir())
        if used + self.per > self.files * self.per:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._writev(fd, buffers)


def test_a_full_disk_evicts_least_recently_used_and_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "disk", capacity_bytes=1 << 30)  # far more than the disk holds
    disk = FullDisk(tier.directory, room(tmp_path), files=5)
    monkeypatch.setattr(os, "writev", disk)
    keys, data = [key(i) for i in range(12)], [payload(i) for i in range(12)]
    for k, d in zip(keys, data, strict=True):
        assert put(tier, [k], [d]).all()
        assert on_disk(tier) <= 5 * disk.per
    assert disk.refused > 0 and tier.available
    assert tier.drain_evicted() == keys[:7]
    assert tier.contains(keys).tolist() == [False] * 7 + [True] * 5
    result, outs = load(tier, keys[7:])
    assert result.ok.all() and np.array_equal(outs, np.stack(data[7:]))
    batch = [key(20 + i) for i in range(3)]
    assert put(tier, batch, [payload(20 + i) for i in range(3)]).all()
    assert tier.drain_evicted() == keys[7:10] and tier.bytes_used == on_disk(tier)
    assert list(tier.directory.glob(".*.tmp")) == []


def test_a_disk_full_of_other_data_fails_puts_reports_it_and_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvfsm.tiers")
    tier = DiskTier(tmp_path / "disk", capacity_bytes=1 << 30)
    keys, data = [key(i) for i in range(20)], [payload(i) for i in range(20)]
    assert put(tier, keys, data).all()
    monkeypatch.setattr(os, "writev", FullDisk(tier.directory, room(tmp_path), files=0))
    assert put(tier, [key(30)], [payload(30)]).tolist() == [False]
    assert put(tier, [key(31)], [payload(31)]).tolist() == [False]
    assert not tier.available and "No space left" in (tier.last_error or "")
    evicted = tier.drain_evicted()
    assert 0 < len(tier) < 20 and set(evicted) | set(tier.keys()) == set(keys)  # bounded
    assert not tier.contains(evicted).any() and tier.bytes_used == on_disk(tier)
    assert list(tier.directory.glob(".*.tmp")) == []
    monkeypatch.undo()  # room again
    assert put(tier, [key(30)], [payload(30)]).all() and tier.available
    assert tier.last_error is None
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvfsm.tiers"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]
    assert str(tier.directory) in lines[0][1] and "works again" in lines[1][1]


# -- what the engine asks from worker threads ------------------------------------------------------


def test_contains_answers_from_memory(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which of a set of keys the tier holds is answered without a file system call."""
    keys = [key(i) for i in range(4)]
    put(tier, keys[:3], [payload(i) for i in range(3)])
    tier.remove(keys[1:2])

    def no_io(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("contains touched the file system")

    for name in ("open", "stat", "lstat", "access", "scandir", "listdir"):
        monkeypatch.setattr(os, name, no_io)
    assert tier.contains(keys).tolist() == [True, False, True, False]


def test_remove_on_a_worker_thread_while_puts_and_loads_run(tier: DiskTier) -> None:
    """Removes race puts and loads of the same keys: a load finds each key whole or missing,
    never torn; every put and remove succeeds; index, files and byte count agree after."""
    keys, data = [key(i) for i in range(24)], [payload(i) for i in range(24)]
    put(tier, keys, data)
    stop = threading.Event()
    problems: list[str] = []
    rounds = {"loads": 0, "puts": 0, "removes": 0}
    seen: set[int] = set()

    def loads() -> None:
        while not stop.is_set():
            result, outs = load(tier, keys)
            for i, status in enumerate(result.status.tolist()):
                seen.add(status)
                if status not in (LoadStatus.OK, LoadStatus.MISSING):
                    problems.append(f"load of key {i}: {LoadStatus(status).name}")
                elif status == LoadStatus.OK and not np.array_equal(outs[i], data[i]):
                    problems.append(f"load of key {i}: wrong bytes")
            rounds["loads"] += 1

    def puts() -> None:
        while not stop.is_set():
            picks = [(rounds["puts"] * 5 + j) % 24 for j in range(3)]
            if not put(tier, [keys[i] for i in picks], [data[i] for i in picks]).all():
                problems.append(f"put of keys {picks} failed")
            rounds["puts"] += 1

    def removes() -> None:
        deadline = time.monotonic() + 30
        while min(rounds.values()) < 100 and time.monotonic() < deadline:
            picks = [(rounds["removes"] * 7 + j) % 24 for j in range(4)]
            if not tier.remove([keys[i] for i in picks]).all():
                problems.append(f"remove of keys {picks} failed")
            rounds["removes"] += 1

    workers = [threading.Thread(target=loads), threading.Thread(target=puts)]
    for worker in workers:
        worker.start()
    remover = threading.Thread(target=removes)
    remover.start()
    remover.join()
    stop.set()
    for worker in workers:
        worker.join()
    assert problems == [] and min(rounds.values()) >= 100
    assert seen == {LoadStatus.OK, LoadStatus.MISSING}  # loads ran among the removes
    held = tier.keys()
    assert sorted(p.name for p in tier.directory.iterdir()) == sorted(
        k.name + ".kvb" for k in held)  # index and directory agree, no temporary file left
    assert tier.contains(keys).tolist() == [k in held for k in keys]
    assert tier.bytes_used == on_disk(tier)
    result, outs = load(tier, held)
    assert result.ok.all()
    assert all(np.array_equal(outs[j], data[keys.index(k)]) for j, k in enumerate(held))
