"""The engine over a real disk tier: every fault a block's file can suffer between spill and
restore, slow and failing loads, spills under pressure, the disk's size cap, restarts, misuse.

After every fault three things are asserted: the verdict after restore + wait + lookup is exactly
the prefix up to the first failing block (the expectation is computed from the fault, not from
the engine), the core's invariants hold, and every block the core lets a kernel read holds
exactly the bytes committed for its prefix. Content is a deterministic function of each block's
prefix hash, so the test always knows the right bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, KvfsmError, shipped_models
from kvfsm.lookup import Level
from kvfsm.spec import Event, Layout, Tier
from kvfsm.state import GroupState, Prompt, StateError
from kvfsm.tiers import (
    HEADER_BYTES,
    BlockKey,
    DiskTier,
    LoadResult,
    LoadStatus,
    StoredTier,
    block_keys,
    encode_header,
    group_hash,
    layout_hash,
    model_digest,
)
from kvfsm.tiers import _disk as disk_module
from tests.wrapped_tier import Wrapped

DENSE = shipped_models()["dense"]
GROUP = "attn"
DECL = DENSE.group(GROUP)
BS = DECL.block_size
WIDTH = DECL.payload_bytes
FILE_BYTES = HEADER_BYTES + WIDTH
#: Blocks per test prompt.
BLOCKS = 8
#: Generous waits: a test never depends on them passing quickly.
WAIT = 30.0


# -- content and prompts ------------------------------------------------------------------------


def content(prompt: Prompt, index: int) -> NDArray[np.uint8]:
    """The committed bytes of block ``index`` of ``prompt``: a function of its prefix hash, so
    two prompts sharing a prefix share those blocks' bytes and no other block has them."""
    high, low = prompt.words(BS)
    rng = np.random.default_rng([int(high[index]), int(low[index])])
    return rng.integers(0, 256, WIDTH, dtype=np.uint8)


def payload_of(prompt: Prompt) -> Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]:
    def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
        rows = [content(prompt, int(i)) for i in index.tolist()]
        return np.stack(rows) if rows else np.zeros((0, WIDTH), dtype=np.uint8)

    return payload


def text(k: int, blocks: int = BLOCKS) -> NDArray[np.int64]:
    """Tokens of test prompt ``k``: ``blocks`` full blocks and one token more (a lookup leaves
    at least one token to compute, so every full block can be usable)."""
    return np.arange(blocks * BS + 1, dtype=np.int64) + 100_000 * (k + 1)


def make(tmp_path: Path, *, device: int = 8, host: int = 8, disk: int = 64,
         files: int = 1 << 12, wrap: Callable[[DiskTier], StoredTier] | None = None,
         fsync: bool = False) -> tuple[Engine, DiskTier]:
    """An engine on the dense model with a disk tier holding at most ``files`` block files
    (seen through ``wrap`` when given)."""
    store = DiskTier(tmp_path / "d", capacity_bytes=DiskTier.capacity_for(tmp_path / "d", WIDTH,
                                                                         files), fsync=fsync)
    config = CoreConfig(device_blocks=device, host_blocks=host, disk_blocks=disk,
                        backend="numpy")
    tier = store if wrap is None else wrap(store)
    return Engine("dense", config, tiers={"disk": tier}), store


def commit(eng: Engine, prompt: Prompt) -> None:
    eng.commit(prompt, payload=payload_of(prompt))


def ids_of(eng: Engine, prompt: Prompt) -> NDArray[np.intp]:
    high, low = prompt.words(BS)
    return eng.core.lookup_words(GROUP, high, low)


def states(eng: Engine, prompt: Prompt) -> list[str | None]:
    group = eng.core.group(GROUP)
    return [None if i < 0 else group.machine.state_of(int(i)) for i in ids_of(eng, prompt)]


def count(eng: Engine, state: str) -> int:
    return int(eng.core.blocks_in(GROUP, state).size)


def park(eng: Engine, prompt: Prompt) -> None:
    """Commit ``prompt`` on an empty device and move all its blocks to disk (device -> host ->
    disk), leaving the device empty."""
    commit(eng, prompt)
    eng.give_back(GROUP, BLOCKS)
    eng.spill_down(GROUP, Tier.HOST, BLOCKS)
    assert states(eng, prompt) == ["disk"] * BLOCKS


def key(eng: Engine, prompt: Prompt, index: int) -> BlockKey:
    """Block ``index``'s key built from the contract alone (not the engine's key maker)."""
    high, low = prompt.words(BS)
    (found,) = block_keys(model_digest(DENSE, eng.core.seed), DECL, layout_hash(DECL),
                          high[index:index + 1], low[index:index + 1], np.array([index]))
    return found


def file_of(store: DiskTier, eng: Engine, prompt: Prompt, index: int) -> Path:
    return store.directory / (key(eng, prompt, index).name + ".kvb")


def write_value(path: Path, value_key: BlockKey, payload: NDArray[np.uint8]) -> None:
    """A whole, self-consistent value of ``value_key`` put at ``path`` by rename."""
    header = encode_header(value_key, payload.size, xxhash.xxh3_64_intdigest(payload))
    tmp = path.with_name("scratch.bin")
    tmp.write_bytes(header + payload.tobytes())
    os.replace(tmp, path)


def restore(eng: Engine, prompt: Prompt) -> Any:
    """Lookup, restore the plan, wait for every load: the group's outcome."""
    ticket = eng.restore(eng.lookup(prompt), prompt)
    return ticket.wait(timeout=WAIT).get(GROUP)


def readable_ok(eng: Engine, prompt: Prompt) -> int:
    """Every block of ``prompt`` the core lets a kernel read holds exactly its committed bytes.
    Returns how many are readable."""
    group = eng.core.group(GROUP)
    ids = ids_of(eng, prompt)
    readable = 0
    for index, block in enumerate(ids.tolist()):
        if block >= 0 and group.table.readable[group.states[block]]:
            got = eng.core.read(GROUP, [block])[0]
            assert np.array_equal(got, content(prompt, index)), f"block {index} wrong bytes"
            readable += 1
        elif block >= 0:
            with pytest.raises(StateError):
                eng.core.read(GROUP, [block])
    return readable


def sound(eng: Engine, *prompts: Prompt) -> None:
    assert eng.core.check_invariants() == []
    for prompt in prompts:
        readable_ok(eng, prompt)


# -- faults of a block's file -------------------------------------------------------------------


def _flip(path: Path, offset: int, bit: int = 0x04) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _other_model(eng: Engine, prompt: Prompt, index: int, path: Path, other: Prompt) -> None:
    theirs = attrs.evolve(key(eng, prompt, index),
                          model=model_digest(shipped_models()["gpt_oss_like"], eng.core.seed))
    write_value(path, theirs, content(other, index))


def _other_layout(eng: Engine, prompt: Prompt, index: int, path: Path, other: Prompt) -> None:
    flipped = Layout(dim_order=tuple(reversed(DECL.layout.dim_order)),
                     alignment=DECL.layout.alignment, padding=DECL.layout.padding)
    theirs = attrs.evolve(key(eng, prompt, index), layout=layout_hash(DECL, flipped))
    write_value(path, theirs, content(other, index))


def _other_chain(eng: Engine, prompt: Prompt, index: int, path: Path, other: Prompt) -> None:
    # A real file this engine spilled for another prompt's block at the same position.
    os.replace(path.with_name(key(eng, other, index).name + ".kvb"), path)


#: name -> (fault, the status its load reports)
FAULTS: dict[str, tuple[Callable[..., None], LoadStatus]] = {
    "torn": (lambda e, p, i, path, o: _truncate(path, HEADER_BYTES + WIDTH // 2),
             LoadStatus.CORRUPT),
    "payload_bit": (lambda e, p, i, path, o: _flip(path, HEADER_BYTES + WIDTH // 3),
                    LoadStatus.CORRUPT),
    "header_bit": (lambda e, p, i, path, o: _flip(path, 60, 0x01), LoadStatus.CORRUPT),
    "header_only": (lambda e, p, i, path, o: _truncate(path, HEADER_BYTES), LoadStatus.CORRUPT),
    "longer": (lambda e, p, i, path, o: path.write_bytes(path.read_bytes() + b"\0"),
               LoadStatus.CORRUPT),
    "deleted": (lambda e, p, i, path, o: path.unlink(), LoadStatus.MISSING),
    "other_model": (_other_model, LoadStatus.FOREIGN),
    "other_layout": (_other_layout, LoadStatus.FOREIGN),
    "other_chain": (_other_chain, LoadStatus.FOREIGN),
}


@pytest.mark.parametrize(("fault", "bad"), [*((f, 3) for f in sorted(FAULTS)),
                                           ("torn", 0), ("other_chain", 7)])
def test_a_bad_file_stops_the_usable_prefix_at_its_block(tmp_path: Path, fault: str,
                                                         bad: int) -> None:
    """8 blocks on disk, block ``bad``'s file damaged after the spill: the blocks before it are
    usable after the restore, it is recomputed, the ones after it are not usable (whatever
    they loaded), its bad copy is forgotten and deleted, and a recompute heals the prefix."""
    eng, store = make(tmp_path, device=16, host=8)
    prompt, other = eng.prompt(text(0)), eng.prompt(text(1))
    park(eng, other)
    park(eng, prompt)
    path = file_of(store, eng, prompt, bad)
    assert path.exists()
    apply, status = FAULTS[fault]
    apply(eng, prompt, bad, path, other)

    verdict = eng.lookup(prompt)
    assert (verdict.hit_tokens, verdict.usable_tokens) == (BLOCKS * BS, 0)
    out = restore(eng, prompt)
    ids = ids_of(eng, prompt)
    assert out.statuses[status.name] == 1
    assert out.statuses["OK"] == BLOCKS - 1
    assert len(out.lost) == 1 and out.failed == () and out.pending == ()
    assert ids[bad] == -1  # forgotten: no longer a hash hit
    after = eng.lookup(prompt)
    assert after.usable_tokens == bad * BS
    assert after.hit_tokens == bad * BS
    assert not path.exists()  # a bad copy is deleted, never loaded again
    sound(eng, prompt, other)
    assert readable_ok(eng, prompt) == BLOCKS - 1  # the later ones hold the right bytes too

    commit(eng, prompt)  # the recompute
    assert eng.lookup(prompt).usable_tokens == BLOCKS * BS
    sound(eng, prompt, other)
    assert readable_ok(eng, prompt) == BLOCKS


@pytest.mark.parametrize("how", ["unlinked", "removed", "evicted_by_the_cap"])
def test_a_copy_gone_between_lookup_and_restore_is_recomputed(tmp_path: Path, how: str) -> None:
    eng, store = make(tmp_path, device=16, host=8, files=BLOCKS)
    prompt = eng.prompt(text(0))
    park(eng, prompt)
    verdict = eng.lookup(prompt)
    assert verdict.restorable_tokens == BLOCKS * BS
    if how == "unlinked":
        file_of(store, eng, prompt, 5).unlink()
    elif how == "removed":
        assert store.remove([key(eng, prompt, 5)]).all()
    else:  # another value arrives: the cap evicts the least recently used file
        stranger = eng.prompt(text(9))
        data = content(stranger, 0)
        assert store.put([key(eng, stranger, 0)], [data],
                         np.array([xxhash.xxh3_64_intdigest(data)], dtype=np.uint64)).all()
    present = np.array([file_of(store, eng, prompt, i).exists() for i in range(BLOCKS)])
    assert not present.all()
    expected = int(np.argmin(present))  # the first block whose copy is gone

    out = eng.restore(verdict, prompt).wait(timeout=WAIT)[GROUP]
    assert out.statuses == {"OK": BLOCKS - 1, "MISSING": 1}
    after = eng.lookup(prompt)
    assert after.usable_tokens == expected * BS
    sound(eng, prompt)


def test_a_crash_between_write_and_rename_keeps_the_block_on_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spill host -> disk dies before its rename: no file is published, the spill fails,
    the block stays on host (still a hit) and restores from there with the right bytes."""
    eng, store = make(tmp_path)
    first, second, third = (eng.prompt(text(k)) for k in range(3))
    commit(eng, first)
    commit(eng, second)
    assert states(eng, first) == ["host"] * BLOCKS

    def crash(src: Any, dst: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "crashed before the rename")

    monkeypatch.setattr(disk_module.os, "replace", crash)
    commit(eng, third)  # host is full: the first prompt's spill to disk fails
    monkeypatch.undo()
    assert states(eng, first) == ["host"] * BLOCKS
    assert len(store) == 0
    assert list(store.directory.iterdir()) == []  # no file, no temporary left behind
    sound(eng, first, second, third)

    out = restore(eng, first)
    assert len(out.restored) == BLOCKS
    assert eng.lookup(first).usable_tokens == BLOCKS * BS
    sound(eng, first, second, third)
    assert readable_ok(eng, first) == BLOCKS


# -- slow, late and failing loads ---------------------------------------------------------------


class Slow(Wrapped):
    """Loads wait until ``gate`` opens (at most ``WAIT`` seconds, so a failing test ends)."""

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        self.gate.wait(WAIT)
        return self.inner.load_into(keys, outs)


class Flaky(Wrapped):
    """The first load of each key in ``bad`` answers ``status`` (after really loading it, so
    the bytes in the slot are the right ones: the status alone must keep them out); later
    loads of it, and every other key, answer what the disk says. Per key, so it does not
    matter which worker's batch holds it."""

    def __init__(self, inner: DiskTier, status: LoadStatus, bad: set[BlockKey]) -> None:
        super().__init__(inner)
        self.status, self.bad = status, bad
        self.answered: set[BlockKey] = set()
        self.lock = threading.Lock()

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        result = self.inner.load_into(keys, outs)
        status = result.status.copy()
        with self.lock:
            for index, key in enumerate(keys):
                if key in self.bad and key not in self.answered:
                    self.answered.add(key)
                    status[index] = int(self.status)
        return LoadResult(status, result.checksum)


def _until_done(ticket: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not ticket.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ticket.done()


def test_a_slow_load_stays_unusable_until_it_lands(tmp_path: Path) -> None:
    eng, _ = make(tmp_path, wrap=Slow)
    slow = eng.tiers[Tier.DISK]
    assert isinstance(slow, Slow)
    prompt = eng.prompt(text(0))
    try:
        park(eng, prompt)
        ticket = eng.restore(eng.lookup(prompt), prompt)
        out = ticket.wait(timeout=0.05)[GROUP]
        assert sorted(out.pending) == sorted(ids_of(eng, prompt).tolist())
        assert out.restored == () and not ticket.done()
        during = eng.lookup(prompt)  # recompute: nothing is usable while it loads
        assert during.usable_tokens == 0
        assert during.hit_tokens == BLOCKS * BS
        assert readable_ok(eng, prompt) == 0
        assert eng.core.check_invariants() == []
    finally:
        slow.gate.set()
    _until_done(ticket)
    assert eng.lookup(prompt).usable_tokens == BLOCKS * BS  # the lookup polled them in
    assert len(ticket.wait(timeout=0)[GROUP].restored) == BLOCKS
    sound(eng, prompt)
    assert readable_ok(eng, prompt) == BLOCKS


def test_a_plan_made_while_loads_run_leaves_their_slots_alone(tmp_path: Path) -> None:
    """Regression: a lookup during a slow load plans ``restore_done`` for the loading blocks;
    restoring that plan fired it early (refused: the bytes were not there yet), rolled the
    blocks back and forgot them, returning the slots the load was still writing into. A
    commit took those slots and the late load overwrote its blocks: wrong bytes readable."""
    eng, _ = make(tmp_path, wrap=Slow)
    slow = eng.tiers[Tier.DISK]
    assert isinstance(slow, Slow)
    prompt, other = eng.prompt(text(0)), eng.prompt(text(1))
    try:
        park(eng, prompt)
        first = eng.restore(eng.lookup(prompt), prompt)
        assert len(first.wait(timeout=0.05)[GROUP].pending) == BLOCKS
        second = eng.restore(eng.lookup(prompt), prompt)  # joins the running loads
        assert second.notes == ()
        assert len(second.wait(timeout=0.01)[GROUP].pending) == BLOCKS
        assert set(states(eng, prompt)) == {"restoring_disk"}
        with pytest.raises(StateError, match="nothing changed"):
            commit(eng, other)  # every device slot is still the loads'
    finally:
        slow.gate.set()
    out = second.wait(timeout=WAIT)[GROUP]
    assert len(out.restored) == BLOCKS and out.statuses == {"OK": BLOCKS}
    assert len(first.wait(timeout=WAIT)[GROUP].restored) == BLOCKS
    commit(eng, other)
    sound(eng, prompt, other)
    assert readable_ok(eng, other) == BLOCKS


@pytest.mark.parametrize("status", [LoadStatus.LATE, LoadStatus.FAILED], ids=lambda s: s.name)
def test_a_late_or_failed_load_keeps_the_copy_and_the_same_restore_retries_it(
        tmp_path: Path, status: LoadStatus) -> None:
    """A load answering LATE or FAILED (the other blocks of the batch loading fine) rolls its
    block back with the copy kept (``restore_fail``, still a hit), and the restore call's next
    round loads it again: the whole prefix lands in one call."""
    eng, store = make(tmp_path, wrap=lambda inner: Flaky(inner, status, set()))
    flaky = eng.tiers[Tier.DISK]
    assert isinstance(flaky, Flaky)
    prompt = eng.prompt(text(0))
    park(eng, prompt)
    flaky.bad = {key(eng, prompt, 3)}
    verdict = eng.lookup(prompt)
    ticket = eng.restore(verdict, prompt)
    out = ticket.wait(timeout=WAIT)[GROUP]
    assert ticket.rounds == 2
    assert out.statuses == {"OK": BLOCKS, status.name: 1}
    assert out.failed == (int(ids_of(eng, prompt)[3]),) and out.lost == ()
    assert file_of(store, eng, prompt, 3).exists()
    assert eng.lookup(prompt).usable_tokens == BLOCKS * BS
    sound(eng, prompt)
    assert readable_ok(eng, prompt) == BLOCKS


# -- copies kept, restarts, the disk's cap ---------------------------------------------------------


def test_a_restored_block_keeps_its_file_and_evicting_it_writes_nothing(tmp_path: Path) -> None:
    eng, store = make(tmp_path)
    prompt, other = eng.prompt(text(0)), eng.prompt(text(1))
    park(eng, prompt)
    assert len(restore(eng, prompt).restored) == BLOCKS
    assert states(eng, prompt) == ["device_disk"] * BLOCKS
    files = [file_of(store, eng, prompt, i) for i in range(BLOCKS)]
    before = [(s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, files)]
    disk_before = eng.core.group(GROUP).stored_used(Tier.DISK)

    commit(eng, other)  # device pressure: the restored blocks go
    assert states(eng, prompt) == ["disk"] * BLOCKS  # straight back to their files, not host
    assert [(s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, files)] == before
    assert eng.core.group(GROUP).stored_used(Tier.DISK) == disk_before
    verdict = eng.lookup(prompt)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (0, BLOCKS * BS)
    sound(eng, prompt, other)

    assert len(restore(eng, prompt).restored) == BLOCKS
    assert eng.lookup(prompt).usable_tokens == BLOCKS * BS
    sound(eng, prompt, other)
    assert readable_ok(eng, prompt) == BLOCKS


@pytest.mark.parametrize("torn", [None, 5])
def test_a_restarted_engine_finds_the_prefix_on_disk(tmp_path: Path, torn: int | None) -> None:
    eng, store = make(tmp_path, fsync=True)
    prompt = eng.prompt(text(0))
    park(eng, prompt)
    if torn is not None:  # a file torn by the crash
        _truncate(file_of(store, eng, prompt, torn), HEADER_BYTES + 10)
    eng.close()

    again, _ = make(tmp_path)
    prompt = again.prompt(text(0))
    found = BLOCKS if torn is None else torn
    verdict = again.lookup(prompt)
    assert (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens) == (
        found * BS, 0, found * BS)
    assert len(restore(again, prompt).restored) == found
    assert again.lookup(prompt).usable_tokens == found * BS
    sound(again, prompt)
    assert readable_ok(again, prompt) == found
    # A prompt sharing only the first blocks finds just those.
    shared = again.prompt(np.concatenate([text(0)[:3 * BS], text(5)[:5 * BS + 1]]))
    assert again.lookup(shared).usable_tokens == 3 * BS
    sound(again, shared)
    again.close()


@pytest.mark.parametrize("bad", [{"typo": DECL.layout}, {GROUP: "kv_first"}])
def test_a_lookup_with_bad_arguments_adopts_nothing_from_disk(tmp_path: Path,
                                                              bad: dict[str, Any]) -> None:
    """A restarted engine would adopt the prompt's blocks from the disk on its first lookup;
    a lookup whose ``kernel_layouts`` are wrong (a group that does not exist, a layout that
    is not a Layout) is refused before that: the core still knows none of the blocks, and a
    good lookup after it finds them all."""
    eng, _ = make(tmp_path, fsync=True)
    park(eng, eng.prompt(text(0)))
    eng.close()

    again, _ = make(tmp_path)
    prompt = again.prompt(text(0))
    with pytest.raises(KvfsmError, match=r"kernel_layouts|no group 'typo'"):
        again.lookup(prompt, kernel_layouts=bad)
    assert states(again, prompt) == [None] * BLOCKS
    assert again.lookup(prompt).restorable_tokens == BLOCKS * BS
    again.close()


def test_files_the_cap_evicts_stop_being_hits(tmp_path: Path) -> None:
    eng, store = make(tmp_path, files=12)
    prompts = [eng.prompt(text(k)) for k in range(4)]
    for prompt in prompts:
        commit(eng, prompt)
    # The first two prompts went to disk (16 files), the cap kept the 12 newest.
    assert len(store) == 12
    leads = []
    for prompt in prompts[:2]:
        present = store.contains([key(eng, prompt, i) for i in range(BLOCKS)])
        leading = BLOCKS if present.all() else int(np.argmin(present))
        verdict = eng.lookup(prompt)
        assert verdict.hit_tokens == leading * BS
        assert verdict.restorable_tokens == leading * BS
        leads.append(leading)
    # Which four files went depends on the order the spill workers finished their puts; a
    # prompt missing one of them is a shorter hit.
    assert min(leads) < BLOCKS
    # Every block the core believes is on disk has its file.
    group = eng.core.group(GROUP)
    on_disk = eng.core.blocks_in(GROUP, "disk")
    assert store.contains(eng.restorer.keys.keys(GROUP, on_disk)).all()
    assert group.stored_used(Tier.DISK) == len(store)
    sound(eng, *prompts)
    # Making device room for this restore spills host to disk, and the cap may evict some of
    # the files about to be loaded: whatever it took, the verdict is the prefix still on file.
    restore(eng, prompts[1])
    present = store.contains([key(eng, prompts[1], i) for i in range(BLOCKS)])
    leading = BLOCKS if present.all() else int(np.argmin(present))
    assert eng.lookup(prompts[1]).usable_tokens == leading * BS
    sound(eng, *prompts)


def test_a_restored_block_whose_file_the_cap_evicted_is_forgotten_once_evicted(
        tmp_path: Path) -> None:
    """Regression: a ``device_disk`` block whose file the cap evicted kept its disk bit and,
    once evicted from the device, was a restorable hit whose load could only fail."""
    eng, store = make(tmp_path, files=BLOCKS)
    prompt, stranger = eng.prompt(text(0)), eng.prompt(text(1))
    park(eng, prompt)
    assert len(restore(eng, prompt).restored) == BLOCKS
    data = [content(stranger, i) for i in range(BLOCKS)]
    sums = np.array([xxhash.xxh3_64_intdigest(d) for d in data], dtype=np.uint64)
    assert store.put([key(eng, stranger, i) for i in range(BLOCKS)], data, sums).all()
    assert eng.lookup(prompt).usable_tokens == BLOCKS * BS  # still on the device
    eng.give_back(GROUP, BLOCKS)
    assert set(states(eng, prompt)) <= {None, "disk"}
    verdict = eng.lookup(prompt)
    assert (verdict.hit_tokens, verdict.restorable_tokens) == (0, 0)
    sound(eng, prompt)


def test_spills_cascade_to_disk_under_device_and_host_pressure(tmp_path: Path) -> None:
    """Regression: a device batch larger than the free host pool evicted the rest although
    the disk had room."""
    eng, store = make(tmp_path, device=8, host=4, disk=64)
    prompts = [eng.prompt(text(k)) for k in range(6)]
    on_disk = [0]
    for n, prompt in enumerate(prompts, 1):
        commit(eng, prompt)
        on_disk.append(count(eng, "disk"))
        held = count(eng, "device") + count(eng, "host") + count(eng, "disk")
        assert held == n * BLOCKS  # nothing dropped while the disk has room
        assert len(store) == on_disk[-1]
        assert eng.core.check_invariants() == []
    assert on_disk == sorted(on_disk) and on_disk[-1] > on_disk[2] > 0
    for prompt in prompts:
        assert eng.lookup(prompt).restorable_tokens == BLOCKS * BS
    sound(eng, *prompts)
    assert len(restore(eng, prompts[0]).restored) == BLOCKS
    assert eng.lookup(prompts[0]).usable_tokens == BLOCKS * BS
    sound(eng, *prompts)


def test_making_room_for_a_restore_never_forgets_the_blocks_it_restores(tmp_path: Path) -> None:
    """Regression: with the disk's block budget full, making device room spilled host to
    disk by forgetting the oldest disk blocks: the very ones the plan was about to load."""
    eng, _ = make(tmp_path, device=8, host=8, disk=16)
    prompts = [eng.prompt(text(k)) for k in range(4)]
    for prompt in prompts:
        commit(eng, prompt)
    assert states(eng, prompts[0]) == ["disk"] * BLOCKS
    assert count(eng, "disk") == 16
    out = restore(eng, prompts[0])
    assert len(out.restored) == BLOCKS and out.statuses == {"OK": BLOCKS}
    assert eng.lookup(prompts[0]).usable_tokens == BLOCKS * BS
    sound(eng, *prompts)


def test_restoring_host_copies_never_spills_them_to_disk_first(tmp_path: Path) -> None:
    eng, store = make(tmp_path, device=8, host=8)
    prompts = [eng.prompt(text(k)) for k in range(2)]
    for prompt in prompts:
        commit(eng, prompt)
    assert states(eng, prompts[0]) == ["host"] * BLOCKS
    out = restore(eng, prompts[0])  # the device's blocks must go to host, which is full
    assert len(out.restored) == BLOCKS and out.statuses == {}  # from host, no disk I/O
    assert len(store) == 0
    assert eng.lookup(prompts[0]).usable_tokens == BLOCKS * BS
    sound(eng, *prompts)


# -- misuse ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tiers", "disk", "match"), [
    ({"host": "tier"}, 8, "pool the core owns"),
    ({"device": "tier"}, 8, "pool the core owns"),
    ({"nvme": "tier"}, 8, "unknown tier 'nvme'"),
    ({"disk": "tier"}, 0, "disk_blocks"),
    ({"disk": object()}, 8, "must be a StoredTier.*object"),
    ({"remote": "tier"}, 8, "remote_blocks"),
])
def test_tier_misuse_is_named(tmp_path: Path, tiers: dict[str, Any], disk: int,
                              match: str) -> None:
    store = DiskTier(tmp_path / "d", capacity_bytes=1 << 20)
    given_tiers = {name: store if value == "tier" else value for name, value in tiers.items()}
    config = CoreConfig(device_blocks=8, disk_blocks=disk, backend="numpy")
    with pytest.raises(KvfsmError, match=match):
        Engine("dense", config, tiers=given_tiers)


# -- property ------------------------------------------------------------------------------------

#: Prompt universe for the property: shared prefixes of different lengths.
_BASE = np.arange(6 * BS + 1, dtype=np.int64) + 7_000_000


def _universe() -> list[NDArray[np.int64]]:
    out = []
    for shared, blocks, k in ((6, 6, 0), (2, 5, 1), (4, 6, 2), (0, 3, 3), (1, 2, 4)):
        tail = np.arange(BS * (blocks - shared) + 1, dtype=np.int64) + 8_000_000 + 1000 * k
        out.append(np.concatenate([_BASE[:shared * BS], tail]))
    return out


UNIVERSE = _universe()

class Gated(Wrapped):
    """Loads run while ``gate`` is open and wait while it is shut (at most ``WAIT``)."""

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        self.gate.wait(WAIT)
        return self.inner.load_into(keys, outs)


_PROMPT = st.integers(0, len(UNIVERSE) - 1)
_ops = st.one_of(
    st.tuples(st.sampled_from(["commit", "lookup", "restore", "restore"]), _PROMPT),
    st.tuples(st.just("give_back"), st.integers(1, 6)),
    st.tuples(st.sampled_from(["flip", "truncate", "delete"]), st.integers(0, 1 << 16),
              st.integers(0, FILE_BYTES - 1)),
    st.tuples(st.sampled_from(["hold", "land", "restart"])),
)


def _pending(ticket: Any) -> tuple[int, ...]:
    out = ticket.wait(timeout=WAIT).get(GROUP)
    return () if out is None else tuple(out.pending)


class _Run:
    """One property run: an engine over a gated disk tier and the restores still loading."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.tickets: list[Any] = []
        self.eng, self.store = self._open()
        for tokens in UNIVERSE:  # start with blocks on every tier
            commit(self.eng, self.eng.prompt(tokens))

    def _open(self) -> tuple[Engine, DiskTier]:
        eng, store = make(self.where, device=8, host=3, disk=12, files=10, wrap=Gated)
        self.gated = eng.tiers[Tier.DISK]
        assert isinstance(self.gated, Gated)
        return eng, store

    def land(self) -> None:
        self.gated.gate.set()
        for ticket in self.tickets:
            assert not _pending(ticket)
        self.tickets.clear()

    def step(self, op: tuple[Any, ...]) -> None:
        eng, held = self.eng, not self.gated.gate.is_set()
        name = op[0]
        if name in ("commit", "lookup", "restore"):
            prompt = eng.prompt(UNIVERSE[op[1]])
            if name == "commit":
                try:
                    commit(eng, prompt)
                except StateError:
                    assert held  # only loads holding the device slots leave no room
            elif name == "lookup":
                eng.lookup(prompt)
            else:
                ticket = eng.restore(eng.lookup(prompt), prompt)
                if held:
                    self.tickets.append(ticket)
                else:
                    assert not _pending(ticket)
        elif name == "give_back":
            eng.give_back(GROUP, op[1])
        elif name == "hold":
            self.gated.gate.clear()
        elif name == "land":
            self.land()
        elif name == "restart":
            self.land()
            eng.close()
            self.eng, self.store = self._open()
        else:
            files = sorted(self.store.directory.glob("*.kvb"))
            if files:
                path = files[op[1] % len(files)]
                size = path.stat().st_size
                if name == "flip" and size:
                    _flip(path, op[2] % size, 1 << (op[1] % 8))
                elif name == "truncate":
                    _truncate(path, op[2] % max(size, 1))
                elif name == "delete":
                    path.unlink()


@settings(settings.default, deadline=None,
          max_examples=max(20, settings.default.max_examples // 2),
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, min_size=1, max_size=30))
# The regression of a plan made while loads run (see the test above): found by hand.
@example(ops=[("hold",), ("restore", 0), ("restore", 0), ("commit", 3), ("land",)])
def test_no_sequence_of_faults_makes_a_wrong_byte_readable(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]]) -> None:
    """Whatever sequence of commits, lookups, restores and disk faults (flip/truncate/delete a
    random file), every block the core lets a kernel read holds exactly the bytes committed
    for that prefix, and the core's invariants hold. (Restores may also be left loading
    while the others go on: ``hold`` stalls the disk's loads until ``land``.)"""
    run = _Run(tmp_path_factory.mktemp("prop"))
    try:
        for op in ops:
            run.step(op)
            sound(run.eng, *(run.eng.prompt(t) for t in UNIVERSE))
        run.land()
        # Whatever happened, restoring every prompt never lands a wrong byte.
        for tokens in UNIVERSE:
            prompt = run.eng.prompt(tokens)
            run.eng.restore(run.eng.lookup(prompt), prompt).wait(timeout=WAIT)
            sound(run.eng, prompt)
    finally:
        run.gated.gate.set()
        run.eng.close()


def test_the_key_maker_agrees_with_the_contract(tmp_path: Path) -> None:
    eng, _ = make(tmp_path)
    prompt = eng.prompt(text(0))
    commit(eng, prompt)
    ids = ids_of(eng, prompt)
    assert eng.restorer.keys.keys(GROUP, ids) == [key(eng, prompt, i) for i in range(BLOCKS)]
    assert group_hash(GROUP) == key(eng, prompt, 0).group


# -- offload: a serving engine gives its device copy back ----------------------------------------


def _host_only(device: int = 8, host: int = 4) -> Engine:
    return Engine("dense", CoreConfig(device_blocks=device, host_blocks=host, backend="numpy"))


def test_offload_moves_device_blocks_to_host_where_they_stay_hits() -> None:
    eng = _host_only()
    prompt = eng.prompt(text(0, blocks=4))
    commit(eng, prompt)
    ids = ids_of(eng, prompt)
    assert eng.offload(GROUP, ids[:2]).tolist() == [True, True]
    assert states(eng, prompt) == ["host", "host", "device", "device"]
    verdict = eng.lookup(prompt)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (0, 4 * BS)
    sound(eng, prompt)


def test_offload_without_a_tier_below_host_evicts_hosts_oldest_never_the_kept() -> None:
    """Host full, nothing below it: the least recently used host blocks make way, a prompt's
    tail first (the newest offloaded stay hits); a kept host block never goes."""
    eng = _host_only(device=8, host=4)
    first, second = eng.prompt(text(0, blocks=4)), eng.prompt(text(1, blocks=4))
    commit(eng, first)
    eng.offload(GROUP, ids_of(eng, first))
    assert states(eng, first) == ["host"] * 4
    commit(eng, second)
    kept = ids_of(eng, first)[3]
    moved = eng.offload(GROUP, ids_of(eng, second)[:2], keep=[kept])
    assert moved.tolist() == [True, True]
    assert states(eng, first) == ["host", None, None, "host"]
    assert states(eng, second)[:2] == ["host", "host"]
    sound(eng, first, second)


def test_offload_cascades_hosts_oldest_to_disk(tmp_path: Path) -> None:
    eng, store = make(tmp_path, device=8, host=4)
    first, second = eng.prompt(text(0, blocks=4)), eng.prompt(text(1, blocks=4))
    commit(eng, first)
    eng.offload(GROUP, ids_of(eng, first))
    commit(eng, second)
    assert eng.offload(GROUP, ids_of(eng, second)).all()
    assert states(eng, first) == ["disk"] * 4 and states(eng, second) == ["host"] * 4
    assert len(store) == 4
    sound(eng, first, second)


def test_offload_gives_a_restored_copys_device_slot_back_without_writing(tmp_path: Path) -> None:
    eng, store = make(tmp_path)
    prompt = eng.prompt(text(0))
    park(eng, prompt)
    restore(eng, prompt)
    assert states(eng, prompt) == ["device_disk"] * BLOCKS
    stamps = [os.stat(file_of(store, eng, prompt, i)).st_mtime_ns for i in range(BLOCKS)]
    assert eng.offload(GROUP, ids_of(eng, prompt)).all()
    assert states(eng, prompt) == ["disk"] * BLOCKS
    assert [os.stat(file_of(store, eng, prompt, i)).st_mtime_ns
            for i in range(BLOCKS)] == stamps
    sound(eng, prompt)


def test_offload_leaves_pinned_and_misnamed_blocks_alone() -> None:
    eng = _host_only()
    prompt = eng.prompt(text(0, blocks=4))
    commit(eng, prompt)
    ids = ids_of(eng, prompt)
    eng.core.pin(GROUP, ids[:1])
    assert eng.offload(GROUP, ids[:2]).tolist() == [False, True]
    before = states(eng, prompt)
    for bad in ([ids[2], ids[2]], [eng.core.group(GROUP).n_blocks], [-1], [1.5]):
        with pytest.raises(KvfsmError):
            eng.offload(GROUP, bad)
        assert states(eng, prompt) == before
    with pytest.raises(KvfsmError):
        eng.offload("no-such-group", ids[:1])
    sound(eng, prompt)



def _moves(how: str) -> Callable[[Engine, Any], object]:
    """A call that would move blocks of the prompt (offload its device blocks, give back
    device slots, spill host down to disk), keeping ``keep``."""
    return {
        "offload": lambda eng, keep: eng.offload(GROUP, np.arange(BLOCKS), keep=keep),
        "give_back": lambda eng, keep: eng.give_back(GROUP, 3, keep=keep),
        "spill_down": lambda eng, keep: eng.spill_down(GROUP, Tier.HOST, 3, keep=keep),
    }[how]


@pytest.mark.parametrize("how", ["offload", "give_back", "spill_down"])
@pytest.mark.parametrize("restored", [False, True])
@pytest.mark.parametrize("keep", [["x"], [1.5], [-1], [1 << 40], "x", None])
def test_a_bad_keep_is_named_and_moves_nothing(tmp_path: Path, how: str, restored: bool,
                                               keep: Any) -> None:
    """``keep`` (the blocks a call must not move) that are not integers or name no block are
    a KvfsmError naming ``keep``, raised before anything moves: never read as other blocks
    (1.5 as block 1), ignored, or a bare ValueError after some blocks already moved (a
    restored block gives its slot back before the spill to host reads ``keep``)."""
    eng, _ = make(tmp_path, device=8, host=4)
    prompt = eng.prompt(text(0))
    commit(eng, prompt)
    if restored:
        park(eng, prompt)
        restore(eng, prompt)
    eng.offload(GROUP, ids_of(eng, prompt)[:2])  # two on host (or back on disk)
    before = states(eng, prompt), eng.core.group(GROUP).epoch.tolist()
    with pytest.raises(KvfsmError, match="keep"):
        _moves(how)(eng, keep)
    assert (states(eng, prompt), eng.core.group(GROUP).epoch.tolist()) == before
    _moves(how)(eng, ids_of(eng, prompt)[:1])  # a good keep: it moves (host holds nothing
    # to spill where the two offloaded blocks kept their disk copies)
    moved = (states(eng, prompt), eng.core.group(GROUP).epoch.tolist()) != before
    assert moved == (not (restored and how == "spill_down"))
    sound(eng, prompt)

# -- the plan's promise with disk copies ----------------------------------------------------


def test_a_restore_may_give_back_the_prompts_block_past_its_prefix(tmp_path: Path) -> None:
    """A device exactly as large as the restorable prefix, filled by it and by the prompt's
    last block (cached, but always computed again: the prompt's last token is): the plan's
    restore makes room by giving that block back, and the whole prefix becomes usable. (Kept
    as one of the prompt's own, the restore found no room and the promise failed.)"""
    eng, _ = make(tmp_path, device=16, host=4)
    whole = text(0, blocks=17)[: 17 * BS]  # 17 full blocks; the last token ends block 16
    first = eng.prompt(whole[: 12 * BS])
    commit(eng, first)
    commit(eng, eng.prompt(text(1, blocks=4)))  # another prompt fills the device
    assert eng.offload(GROUP, ids_of(eng, first)[2:3]).all()  # one block to host
    prompt = eng.prompt(whole)
    commit(eng, prompt)  # five more blocks: the other prompt's four give way
    assert states(eng, prompt).count("host") == 1
    assert eng.core.group(GROUP).pools[Tier.DEVICE].free == 0
    verdict = eng.lookup(prompt)
    assert verdict.restorable_tokens == 16 * BS and len(verdict.plan) == 1
    eng.restore(verdict, prompt).wait(timeout=WAIT)
    assert eng.lookup(prompt).usable_tokens == 16 * BS
    sound(eng, prompt)


def test_a_plan_cancels_a_spill_to_disk_begun_by_hand_and_restores_from_host(
        tmp_path: Path) -> None:
    """A block whose spill from host to disk was begun by hand (``spill_begin``, no copy
    written yet) is restored from its host copy, the spill cancelled (``spill_fail``): a plan
    never declares another's spill done, which would load a disk copy that is not there and
    forget the block."""
    eng, _ = make(tmp_path, device=8, host=8)
    prompt = eng.prompt(text(0, blocks=4))
    commit(eng, prompt)
    ids = ids_of(eng, prompt)
    assert eng.offload(GROUP, ids[1:2]).all()
    eng.core.fire(GROUP, ids[1:2], Event.SPILL_BEGIN)
    assert states(eng, prompt)[1] == "spilling_disk"
    verdict = eng.lookup(prompt)
    assert [step.path for step in verdict.plan] == [
        (Event.SPILL_FAIL, Event.RESTORE_BEGIN, Event.RESTORE_DONE)]
    eng.restore(verdict, prompt).wait(timeout=WAIT)
    assert eng.lookup(prompt).usable_tokens == verdict.restorable_tokens == 4 * BS
    sound(eng, prompt)


@settings(settings.default, deadline=None,
          max_examples=max(20, settings.default.max_examples // 2),
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(["dense", "gpt_oss", "qwen", "deepseek"]))
def test_restoring_a_plan_with_disk_loads_makes_its_restorable_prefix_usable(
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, name: str) -> None:
    """On states reached by commits, lifecycle events, blocks offloaded to host and moved on
    to disk, a FULL verdict's plan, restored and waited for (host copies land at once, disk
    loads on the engine's workers), makes exactly its ``restorable_tokens`` usable: never
    more, never less, never less than was usable before (nothing is corrupted here, so no
    copy may fail its check); the invariants hold."""
    from tests.lookup_models import DEEPSEEK, DENSE, GPT_OSS, PROMPTS, QWEN, drive

    decl = {"dense": DENSE, "gpt_oss": GPT_OSS, "qwen": QWEN, "deepseek": DEEPSEEK}[name]
    store = DiskTier(tmp_path_factory.mktemp("plan") / "d", capacity_bytes=1 << 26)
    # Devices that hold a whole prompt (20 blocks of 16 tokens): a prefix needing more device
    # blocks than the pool has cannot be restored whole, and the verdict counts restores
    # against the admission budget, not device slots (docs/gates.md).
    config = CoreConfig(device_blocks=data.draw(st.sampled_from([24, 64]), label="device"),
                        host_blocks=data.draw(st.sampled_from([4, 16]), label="host"),
                        disk_blocks=256, backend="numpy")
    eng = Engine(decl, config, tiers={"disk": store})
    try:
        text = data.draw(st.sampled_from(PROMPTS), label="prompt")
        text = text[: data.draw(st.integers(1, text.size), label="cut")]
        with contextlib.suppress(KvfsmError):
            eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
        drive(eng, data, data.draw(st.integers(0, 6), label="steps"), ops=("commit", "event"))
        for group in data.draw(st.lists(st.sampled_from(sorted(eng.core.groups)),
                                        max_size=4), label="moved groups"):
            state = eng.core.group(group)
            held = np.flatnonzero(state.slot[Tier.DEVICE] != -1)
            if held.size:
                eng.offload(group, data.draw(st.lists(st.sampled_from(held.tolist()),
                                                      max_size=8, unique=True),
                                             label="offloaded"))
            eng.spill_down(group, Tier.HOST, data.draw(st.integers(0, 8), label="to disk"))
        prompt = eng.prompt(text)
        verdict = eng.lookup(prompt, level=Level.FULL)
        event("disk loads" if any(step.tier is Tier.DISK for step in verdict.plan)
              else "a plan" if verdict.plan else "no plan")
        eng.restore(verdict, prompt).wait(timeout=WAIT)
        after = eng.lookup(prompt, level=Level.FULL)
        assert after.usable_tokens == verdict.restorable_tokens, (verdict.plan, after.reasons)
        assert after.usable_tokens >= verdict.usable_tokens
        assert eng.core.check_invariants() == []
    finally:
        eng.close()
