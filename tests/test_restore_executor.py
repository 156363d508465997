"""The restore executor against a core and real stored tiers: plans loaded and verified into
device slots, what each load status does to a block, waits that time out and polls that settle,
room and admission, plans made while loads run, and spills into stored tiers (host -> disk,
disk -> remote) with the failures each can meet."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from numpy.typing import NDArray

from kvfsm import CoreConfig, KvfsmError, StateCore, shipped_models
from kvfsm.lookup import RestoreStep
from kvfsm.restore import RestoreExecutor
from kvfsm.restore._executor import CHUNK_BLOCKS
from kvfsm.spec import Event, Tier
from kvfsm.state import StateError
from kvfsm.tiers import BlockKey, DiskTier, LoadResult, LoadStatus, StoredTier

DENSE = shipped_models()["dense"]
GROUP = "attn"
WIDTH = DENSE.group(GROUP).payload_bytes
WAIT = 30.0
RESTORE = (Event.RESTORE_BEGIN, Event.RESTORE_DONE)


def content(i: int) -> NDArray[np.uint8]:
    return np.random.default_rng(i).integers(0, 256, WIDTH, dtype=np.uint8)


def checksums(rows: Sequence[Any]) -> NDArray[np.uint64]:
    return np.array([xxhash.xxh3_64_intdigest(r) for r in rows], dtype=np.uint64)


def make_core(**sizes: int) -> StateCore:
    config = {"device_blocks": 8, "host_blocks": 8, "disk_blocks": 32,
              "remote_blocks": 16} | sizes
    return StateCore(DENSE, CoreConfig(backend="numpy", **config))


def disk(tmp_path: Path, name: str = "d") -> DiskTier:
    return DiskTier(tmp_path / name, capacity_bytes=1 << 24, fsync=False)


def stored(core: StateCore, ex: RestoreExecutor, store: StoredTier, blocks: range,
           tier: Tier = Tier.DISK) -> NDArray[np.intp]:
    """Blocks at ``blocks`` positions (block i: words (1000+i, 2000+i), content(i)) known to
    the core only as copies in ``store``, which holds them."""
    pos = np.array(blocks, dtype=np.int64)
    ids = core.discover(GROUP, pos, pos + 1000, pos + 2000, tier)
    rows = [content(i) for i in blocks]
    assert store.put(ex.keys.keys(GROUP, ids), rows, checksums(rows)).all()
    return ids


def plan(core: StateCore, ids: NDArray[np.intp], path: tuple[Event, ...] = RESTORE
         ) -> list[RestoreStep]:
    group = core.group(GROUP)
    return [RestoreStep(GROUP, int(group.position[b]), int(b), group.machine.state_of(int(b)),
                        Tier.DISK, path) for b in ids.tolist()]


def state_of(core: StateCore, block: int) -> str:
    return core.group(GROUP).machine.state_of(int(block))


def assert_right_bytes(core: StateCore, ids: NDArray[np.intp]) -> None:
    group = core.group(GROUP)
    for block in ids.tolist():
        if group.table.readable[group.states[block]]:
            position = int(group.position[block])
            assert np.array_equal(core.read(GROUP, [block])[0], content(position))


def on_host(core: StateCore, blocks: range) -> NDArray[np.intp]:
    """Blocks written on device then spilled to host (block i holds content(i))."""
    pos = np.array(blocks, dtype=np.int64)
    ids = core.allocate(GROUP, pos, pos + 1000, pos + 2000)
    core.fire(GROUP, ids, Event.WRITE_BEGIN)
    core.write(GROUP, ids, np.stack([content(i) for i in blocks]))
    core.fire(GROUP, ids, Event.WRITE_DONE)
    core.fire(GROUP, ids, Event.SPILL_BEGIN)
    core.fire(GROUP, ids, Event.SPILL_DONE)
    return ids


class Doctored(StoredTier):
    """A disk tier whose loads answer ``status`` for the keys in ``bad`` (after loading them
    for real), or raise ``error``; ``gate`` holds loads while shut; ``put_ok`` overrides puts."""

    def __init__(self, inner: DiskTier, tier: Tier = Tier.DISK) -> None:
        self.inner, self.tier = inner, tier
        self.bad: set[BlockKey] = set()
        self.status = LoadStatus.OK
        self.error: Exception | None = None
        self.put_ok: NDArray[np.bool_] | None = None
        self.gate = threading.Event()
        self.gate.set()

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        if self.error is not None:
            raise self.error
        if self.put_ok is not None:
            chosen = np.flatnonzero(self.put_ok[:len(keys)])
            self.inner.put([keys[i] for i in chosen], [payloads[i] for i in chosen],
                           checksums[chosen])
            return self.put_ok[:len(keys)].copy()
        return self.inner.put(keys, payloads, checksums)

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        self.gate.wait(WAIT)
        if self.error is not None:
            raise self.error
        result = self.inner.load_into(keys, outs)
        status = result.status.copy()
        status[[k in self.bad for k in keys]] = int(self.status)
        return LoadResult(status, result.checksum)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.contains(keys)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.remove(keys)


def until_done(ticket: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not ticket.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ticket.done()


# -- restores ------------------------------------------------------------------------------------


def test_a_plan_from_disk_lands_verified_in_the_device_slots(tmp_path: Path) -> None:
    core, store = make_core(), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        ids = stored(core, ex, store, range(3))
        ticket = ex.submit(plan(core, ids))
        out = ticket.wait(timeout=WAIT)
    assert set(out) == {GROUP} and ticket.groups == (GROUP,) and ticket.done()
    got = out[GROUP]
    assert sorted(got.restored) == sorted(ids.tolist())
    assert (got.failed, got.lost, got.pending) == ((), (), ())
    assert got.statuses == {"OK": 3} and got.bytes_loaded == 3 * WIDTH
    assert {state_of(core, b) for b in ids} == {"device_disk"}
    assert len(store) == 3  # the copies stay
    assert_right_bytes(core, ids)
    assert core.check_invariants() == []


def test_plans_larger_than_a_worker_chunk_all_land(tmp_path: Path) -> None:
    count = 3 * CHUNK_BLOCKS + 1
    core, store = make_core(device_blocks=count, disk_blocks=count,
                            max_restores_in_flight=count), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}, workers=3) as ex:
        ids = stored(core, ex, store, range(count))
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
    assert sorted(got.restored) == sorted(ids.tolist()) and got.statuses == {"OK": count}
    assert_right_bytes(core, ids)
    assert core.check_invariants() == []


#: status -> (where the block ends, still a hash hit, reported as)
CONSEQUENCE = {
    LoadStatus.OK: ("device_disk", True, "restored"),
    LoadStatus.MISSING: ("free", False, "lost"),
    LoadStatus.CORRUPT: ("free", False, "lost"),
    LoadStatus.FOREIGN: ("free", False, "lost"),
    LoadStatus.FAILED: ("disk", True, "failed"),
    LoadStatus.LATE: ("disk", True, "failed"),
}


@pytest.mark.parametrize("status", list(LoadStatus), ids=lambda s: s.name)
def test_each_load_status_has_its_consequence(tmp_path: Path, status: LoadStatus) -> None:
    """Only OK makes a block readable; a copy gone or bad for good is forgotten (the block is
    recomputed); one that did not answer in time or at all is kept for a retry. The bytes
    really landed in every case: only the status keeps them out."""
    core, inner = make_core(), disk(tmp_path)
    tier = Doctored(inner)
    with RestoreExecutor(core, {Tier.DISK: tier}) as ex:
        ids = stored(core, ex, inner, range(3))
        tier.bad, tier.status = {ex.keys.keys(GROUP, ids[1:2])[0]}, status
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
        where, hit, reported = CONSEQUENCE[status]
        block = int(ids[1])
        assert block in getattr(got, reported)
        assert got.statuses == ({"OK": 3} if status is LoadStatus.OK
                                else {"OK": 2, status.name: 1})
        assert state_of(core, block) == where
        assert (core.lookup_words(GROUP, [1001], [2001])[0] == block) == hit
        assert state_of(core, int(ids[0])) == state_of(core, int(ids[2])) == "device_disk"
        assert_right_bytes(core, ids)
        assert core.check_invariants() == []
        if hit and where == "disk":  # kept: a retry loads it
            tier.bad = set()
            again = ex.submit(plan(core, ids[1:2])).wait(timeout=WAIT)[GROUP]
            assert again.restored == (block,)
            assert_right_bytes(core, ids)


def test_a_tier_that_raises_fails_the_batch_and_keeps_the_copies(tmp_path: Path) -> None:
    """A tier that raises fails the whole batch (copies kept, slots given back) and backs
    off: a plan submitted before its pause ends asks nothing of it (a note says why), one
    submitted after it restores every block."""
    core, inner = make_core(), disk(tmp_path)
    tier = Doctored(inner)
    now = [0.0]
    with RestoreExecutor(core, {Tier.DISK: tier}, clock=lambda: now[0]) as ex:
        ids = stored(core, ex, inner, range(4))
        tier.error = OSError("the disk went away")
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
        assert sorted(got.failed) == sorted(ids.tolist()) and got.statuses == {"FAILED": 4}
        assert {state_of(core, b) for b in ids} == {"disk"}
        assert core.group(GROUP).pools[Tier.DEVICE].free == 8  # every slot given back
        assert core.check_invariants() == []
        tier.error = None
        assert ex.health[Tier.DISK].down()
        backing_off = ex.submit(plan(core, ids))
        assert not backing_off.wait(timeout=WAIT)[GROUP].restored
        assert any("not answering" in note for note in backing_off.notes)
        assert {state_of(core, b) for b in ids} == {"disk"}
        now[0] += ex.timeouts.backoff_max_s
        assert len(ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP].restored) == 4
        assert not ex.health[Tier.DISK].down() and ex.health[Tier.DISK].up
        assert_right_bytes(core, ids)


def test_a_restore_from_a_tier_not_attached_fails_and_keeps_the_copy(tmp_path: Path) -> None:
    core, store = make_core(), disk(tmp_path)
    remote = Doctored(disk(tmp_path, "r"), Tier.REMOTE)
    with RestoreExecutor(core, {Tier.REMOTE: remote}) as ex:
        ids = stored(core, ex, remote, range(2), Tier.REMOTE)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
    assert got.statuses == {"FAILED": 2}
    assert {state_of(core, b) for b in ids} == {"remote"}
    assert core.check_invariants() == []


def test_a_restore_from_remote_keeps_the_remote_copy(tmp_path: Path) -> None:
    core = make_core()
    remote = Doctored(disk(tmp_path, "r"), Tier.REMOTE)
    with RestoreExecutor(core, {Tier.REMOTE: remote}) as ex:
        ids = stored(core, ex, remote, range(2), Tier.REMOTE)
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
    assert len(got.restored) == 2
    assert {state_of(core, b) for b in ids} == {"device_remote"}
    assert_right_bytes(core, ids)
    assert core.check_invariants() == []


def test_a_wait_that_times_out_leaves_the_blocks_loading_until_a_poll(tmp_path: Path) -> None:
    core, inner = make_core(), disk(tmp_path)
    tier = Doctored(inner)
    with RestoreExecutor(core, {Tier.DISK: tier}, workers=1) as ex:  # one load for the batch
        ids = stored(core, ex, inner, range(3))
        tier.gate.clear()
        try:
            ticket = ex.submit(plan(core, ids))
            got = ticket.wait(timeout=0.02)[GROUP]
            assert sorted(got.pending) == sorted(ids.tolist()) and got.restored == ()
            assert not ticket.done() and not ticket.done(GROUP)
            assert ex.loads_in_flight == 1
            assert {state_of(core, b) for b in ids} == {"restoring_disk"}
            with pytest.raises(StateError):
                core.read(GROUP, ids)
            assert ex.poll() == 0
            assert core.check_invariants() == []
        finally:
            tier.gate.set()
        until_done(ticket)
        assert ex.poll() == 1 and ex.loads_in_flight == 0
        assert {state_of(core, b) for b in ids} == {"device_disk"}
        assert len(ticket.wait(GROUP, timeout=0)[GROUP].restored) == 3  # polled, still told
        assert_right_bytes(core, ids)


def test_a_plan_made_while_loads_run_joins_them(tmp_path: Path) -> None:
    """Regression: a second plan (``restore_done`` for blocks still loading) fired done early,
    rolled the blocks back and forgot them, returning slots the load still wrote into."""
    core, inner = make_core(), disk(tmp_path)
    tier = Doctored(inner)
    with RestoreExecutor(core, {Tier.DISK: tier}) as ex:
        ids = stored(core, ex, inner, range(3))
        tier.gate.clear()
        try:
            first = ex.submit(plan(core, ids))
            second = ex.submit(plan(core, ids, (Event.RESTORE_DONE,)))
            assert second.notes == ()
            assert sorted(second.wait(timeout=0.01)[GROUP].pending) == sorted(ids.tolist())
            assert {state_of(core, b) for b in ids} == {"restoring_disk"}
            assert core.group(GROUP).pools[Tier.DEVICE].free == 5  # slots still the loads'
        finally:
            tier.gate.set()
        for ticket in (second, first):
            assert sorted(ticket.wait(timeout=WAIT)[GROUP].restored) == sorted(ids.tolist())
        assert_right_bytes(core, ids)
        assert core.check_invariants() == []


def test_a_block_left_restoring_with_no_load_gets_one(tmp_path: Path) -> None:
    core, store = make_core(), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        ids = stored(core, ex, store, range(2))
        core.fire(GROUP, ids, Event.RESTORE_BEGIN)  # begun by hand
        got = ex.submit(plan(core, ids, (Event.RESTORE_DONE,))).wait(timeout=WAIT)[GROUP]
    assert sorted(got.restored) == sorted(ids.tolist())
    assert_right_bytes(core, ids)


def test_make_room_is_asked_for_the_shortfall_and_told_what_to_keep(tmp_path: Path) -> None:
    core, store = make_core(device_blocks=4), disk(tmp_path)
    calls: list[tuple[str, int, list[int]]] = []

    def make_room(group: str, count: int, keep: NDArray[np.intp]) -> int:
        calls.append((group, count, sorted(keep.tolist())))
        victims = [b for b in busy.tolist() if b not in keep.tolist()][:count]
        core.fire(group, victims, Event.EVICT)
        return len(victims)

    with RestoreExecutor(core, {Tier.DISK: store}, make_room=make_room) as ex:
        ids = stored(core, ex, store, range(3))
        busy = core.allocate(GROUP, [10, 11, 12], [1, 2, 3], [4, 5, 6])
        core.fire(GROUP, busy, Event.WRITE_BEGIN)
        core.write(GROUP, busy, np.zeros((3, WIDTH), np.uint8))
        core.fire(GROUP, busy, Event.WRITE_DONE)
        got = ex.submit(plan(core, ids), keep={GROUP: [int(busy[0])]}).wait(timeout=WAIT)
    assert calls == [(GROUP, 2, [int(busy[0])])]  # 3 wanted, 1 free
    assert len(got[GROUP].restored) == 3
    assert state_of(core, int(busy[0])) == "device"
    assert core.check_invariants() == []


def test_without_room_or_admission_a_restore_is_refused_and_named(tmp_path: Path) -> None:
    core, store = make_core(device_blocks=2, max_restores_in_flight=1), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        ids = stored(core, ex, store, range(3))
        ticket = ex.submit(plan(core, ids))
        got = ticket.wait(timeout=WAIT)[GROUP]
    assert len(got.restored) == 1
    assert len(ticket.notes) == 2
    assert all("restore_begin refused" in note for note in ticket.notes)
    assert any("admission_open" in note for note in ticket.notes)
    assert sorted(state_of(core, b) for b in ids) == ["device_disk", "disk", "disk"]
    assert core.check_invariants() == []


def test_an_executor_needs_a_worker() -> None:
    with pytest.raises(KvfsmError, match="worker"):
        RestoreExecutor(make_core(), {}, workers=0)


# -- spills into stored tiers ----------------------------------------------------------------------


def _loaded(store: StoredTier, keys: list[BlockKey]) -> tuple[LoadResult, NDArray[np.uint8]]:
    outs = np.zeros((len(keys), WIDTH), dtype=np.uint8)
    return store.load_into(keys, list(outs)), outs


def test_a_spill_from_host_writes_verified_copies(tmp_path: Path) -> None:
    core, store = make_core(device_blocks=16, host_blocks=16), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        ids = on_host(core, range(10))  # several store tasks per worker-split batch
        assert ex.store(GROUP, ids).all()
        keys = ex.keys.keys(GROUP, ids)
    assert {state_of(core, b) for b in ids} == {"disk"}
    result, outs = _loaded(store, keys)
    assert result.ok.all()
    assert all(np.array_equal(outs[i], content(i)) for i in range(ids.size))
    assert core.check_invariants() == []


@pytest.mark.parametrize("how", ["refused", "raised"])
def test_a_spill_the_tier_does_not_take_stays_on_host(tmp_path: Path, how: str) -> None:
    core, inner = make_core(), disk(tmp_path)
    tier = Doctored(inner)
    if how == "refused":
        tier.put_ok = np.array([True, False, True])
    else:
        tier.error = OSError("no space left on device")
    with RestoreExecutor(core, {Tier.DISK: tier}) as ex:
        ids = on_host(core, range(3))
        moved = ex.store(GROUP, ids)
    expected = [True, False, True] if how == "refused" else [False] * 3
    assert moved.tolist() == expected
    assert [state_of(core, b) for b in ids] == ["disk" if m else "host" for m in expected]
    assert core.group(GROUP).stored_used(Tier.DISK) == sum(expected)
    assert core.check_invariants() == []


def test_a_store_of_blocks_not_on_a_spilling_tier_moves_nothing(tmp_path: Path) -> None:
    """Regression: a device block was sent to host by ``spill_begin`` and then the store
    crashed (host is no stored tier), leaving it stuck spilling."""
    core, store = make_core(), disk(tmp_path)
    with RestoreExecutor(core, {Tier.DISK: store}) as ex:
        ids = core.allocate(GROUP, [0], [1], [2])
        core.fire(GROUP, ids, Event.WRITE_BEGIN)
        core.write(GROUP, ids, content(0)[None])
        core.fire(GROUP, ids, Event.WRITE_DONE)
        assert not ex.store(GROUP, ids).any()  # device -> host is no stored tier's spill
    assert state_of(core, int(ids[0])) == "device"
    assert len(store) == 0 and core.check_invariants() == []


def test_a_relay_from_disk_to_remote_copies_verified_values(tmp_path: Path) -> None:
    core, store = make_core(), disk(tmp_path)
    remote = Doctored(disk(tmp_path, "r"), Tier.REMOTE)
    with RestoreExecutor(core, {Tier.DISK: store, Tier.REMOTE: remote}) as ex:
        ids = stored(core, ex, store, range(3))
        assert ex.store(GROUP, ids).all()
        keys = ex.keys.keys(GROUP, ids)
        assert {state_of(core, b) for b in ids} == {"remote"}
        result, outs = _loaded(remote, keys)
        assert result.ok.all()
        assert all(np.array_equal(outs[i], content(i)) for i in range(3))
        got = ex.submit(plan(core, ids)).wait(timeout=WAIT)[GROUP]
    assert len(got.restored) == 3
    assert_right_bytes(core, ids)
    assert core.check_invariants() == []


def test_a_relay_whose_source_copy_is_bad_forgets_the_block(tmp_path: Path) -> None:
    """Regression: the relay's load deleted the corrupt disk file, the spill failed and the
    block stayed on disk with no file behind it: a restorable hit that could only fail."""
    core, store = make_core(), disk(tmp_path)
    remote = Doctored(disk(tmp_path, "r"), Tier.REMOTE)
    with RestoreExecutor(core, {Tier.DISK: store, Tier.REMOTE: remote}) as ex:
        ids = stored(core, ex, store, range(3))
        path = store.directory / (ex.keys.keys(GROUP, ids[1:2])[0].name + ".kvb")
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
        moved = ex.store(GROUP, ids)
    assert moved.tolist() == [True, False, True]
    assert state_of(core, int(ids[1])) == "free"
    assert core.lookup_words(GROUP, [1001], [2001]).tolist() == [-1]
    assert core.check_invariants() == []


def test_loads_that_hang_do_not_hold_up_a_spill(tmp_path: Path) -> None:
    """Regression: loads and spills shared one worker pool, so a tier whose loads hung kept
    every worker and a spill made to free room (``give_back``) waited behind them."""
    core, inner = make_core(device_blocks=16, host_blocks=8), disk(tmp_path)
    tier = Doctored(inner)
    with RestoreExecutor(core, {Tier.DISK: tier}, workers=1) as ex:
        loading = stored(core, ex, inner, range(4))
        cold = on_host(core, range(10, 14))
        tier.gate.clear()
        try:
            ticket = ex.submit(plan(core, loading))
            assert len(ticket.wait(timeout=0.01)[GROUP].pending) == 4  # the worker is stuck
            done: list[NDArray[np.bool_]] = []
            spill = threading.Thread(target=lambda: done.append(ex.store(GROUP, cold)))
            spill.start()
            # Well under the gate's hold (WAIT): a spill stuck behind the loads misses it.
            spill.join(timeout=WAIT / 6)
            assert done and done[0].all(), "the spill waited behind hung loads"
        finally:
            tier.gate.set()
        until_done(ticket)
        ex.poll()
    assert {state_of(core, b) for b in cold} == {"disk"}
    assert {state_of(core, b) for b in loading} == {"device_disk"}
    assert core.check_invariants() == []


# -- listeners --------------------------------------------------------------------------------


class Heard:
    """A restore listener that keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Tier, dict[str, int], int, float]] = []

    def __call__(self, group: str, tier: Tier, outcomes: Any, nbytes: int,
                 seconds: float) -> None:
        self.told.append((group, tier, dict(outcomes), nbytes, seconds))


def test_listeners_hear_each_batch_with_its_tier_outcomes_bytes_and_time(tmp_path: Path
                                                                         ) -> None:
    """Every batch of restores that ends is reported once: disk loads by load status with the
    bytes made readable and the worker's seconds, host copies as OK with theirs."""
    core = make_core()
    inner = disk(tmp_path)
    store = Doctored(inner)
    with RestoreExecutor(core, {Tier.DISK: store}, workers=2) as ex:
        heard = Heard()
        ex.listeners.append(heard)
        ids = stored(core, ex, inner, range(4))
        store.bad, store.status = {ex.keys.keys(GROUP, ids[3:])[0]}, LoadStatus.CORRUPT
        ex.submit(plan(core, ids)).wait(timeout=WAIT)
        host = on_host(core, range(10, 12))
        group = core.group(GROUP)
        ex.submit([RestoreStep(GROUP, int(group.position[b]), int(b), "host", Tier.HOST,
                               RESTORE) for b in host.tolist()])
    from_disk = [t for t in heard.told if t[1] is Tier.DISK]
    statuses: dict[str, int] = {}
    for _, _, outcomes, _, seconds in from_disk:
        for name, count in outcomes.items():
            statuses[name] = statuses.get(name, 0) + count
        assert seconds > 0
    assert statuses == {"OK": 3, "CORRUPT": 1}
    assert sum(t[3] for t in from_disk) == 3 * WIDTH
    (from_host,) = [t for t in heard.told if t[1] is Tier.HOST]
    assert from_host[:4] == (GROUP, Tier.HOST, {"OK": 2}, 2 * WIDTH) and from_host[4] > 0
