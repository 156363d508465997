"""Stores that hang, fail or fill, as an engine meets them: stored-tier I/O never runs under the
engine's lock, a failing tier backs off and is named in verdicts, a copy that cannot be loaded
gives way to a fresh commit, and the disk holds exactly the copies the core counts.

The "hung" store here is a real disk tier behind a wrapper that blocks its calls on an event
until the test releases it; every wait on the engine is bounded by a watchdog, so a call that
would block behind the hung one fails the test instead of hanging it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine
from kvfsm.lookup import Reason
from kvfsm.restore import StoreTimeouts
from kvfsm.restore._health import TierHealth
from kvfsm.spec import Tier
from kvfsm.state import GroupState, Prompt
from kvfsm.tiers import BlockKey, DiskTier, LoadResult
from tests.wrapped_tier import Wrapped

GROUP = "attn"
#: Bounds every wait of a test on an engine call (far above what the calls take).
WATCHDOG_S = 20.0
WAIT = 30.0


class Held(Wrapped):
    """A remote tier (a disk tier underneath) whose calls block while ``hang`` is set, or
    raise while ``error`` is set; it counts the calls that reached it."""

    tier = Tier.REMOTE

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner)
        self.hang = threading.Event()
        self.released = threading.Event()
        self.error: Exception | None = None
        self.calls = {"put": 0, "load_into": 0, "contains": 0}

    def _gate(self, name: str) -> None:
        self.calls[name] += 1
        if self.hang.is_set():
            self.released.wait()
        if self.error is not None:
            raise self.error

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        self._gate("put")
        return super().put(keys, payloads, checksums)

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        self._gate("load_into")
        return super().load_into(keys, outs)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        self._gate("contains")
        return super().contains(keys)


def payload_of(prompt: Prompt) -> Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]:
    def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
        high, _ = prompt.words(group.decl.block_size)
        return np.stack([np.full(group.decl.payload_bytes, int(high[i]) % 251, np.uint8)
                         for i in index.tolist()]) if index.size else \
            np.zeros((0, group.decl.payload_bytes), np.uint8)

    return payload


def tokens(k: int, blocks: int = 8) -> NDArray[np.int64]:
    return np.arange(blocks * 16 + 1, dtype=np.int64) + 100_000 * (k + 1)


def make(tmp_path: Path, *, timeouts: StoreTimeouts | None = None, device: int = 16,
         host: int = 8, disk: int = 8, remote: int = 256) -> tuple[Engine, Held]:
    held = Held(DiskTier(tmp_path / "remote", capacity_bytes=1 << 30, fsync=False))
    eng = Engine("dense", CoreConfig(device_blocks=device, host_blocks=host, disk_blocks=disk,
                                     remote_blocks=remote, backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path / "disk", capacity_bytes=1 << 30,
                                         fsync=False), "remote": held},
                 store_timeouts=timeouts)
    return eng, held


def ids_of(eng: Engine, prompt: Prompt) -> NDArray[np.intp]:
    high, low = prompt.words(16)
    return eng.core.lookup_words(GROUP, high, low)


def states(eng: Engine, prompt: Prompt) -> list[str | None]:
    group = eng.core.group(GROUP)
    return [None if i < 0 else group.machine.state_of(int(i)) for i in ids_of(eng, prompt)]


def in_time(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread, which must end within the watchdog (else the test fails)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    assert not thread.is_alive(), "the call blocked behind the hung store"
    return out[0]


def to_remote(eng: Engine, prompt: Prompt) -> None:
    ids = ids_of(eng, prompt)
    eng.offload(GROUP, ids)
    eng.spill_down(GROUP, Tier.HOST, ids.size)
    eng.spill_down(GROUP, Tier.DISK, ids.size)
    assert set(states(eng, prompt)) == {"remote"}


def test_a_lookup_asks_the_stores_only_about_a_prompt_it_cannot_serve_to_its_end(
        tmp_path: Path) -> None:
    """A prompt usable to its end asks no store (a scheduler's usual lookup costs what the
    device holds, nothing more); a prompt with blocks the core does not know asks, once per
    lookup, and one whose stored copy is found reuses it."""
    eng, held = make(tmp_path)
    resident = eng.prompt(tokens(0))
    eng.commit(resident, payload=payload_of(resident))
    before = held.calls["contains"]
    for _ in range(3):
        assert eng.lookup(resident).usable_tokens == 128
    assert held.calls["contains"] == before
    assert eng.lookup(eng.prompt(tokens(5))).hit_tokens == 0
    assert held.calls["contains"] == before + 1


# -- I/O outside the lock -----------------------------------------------------------------------


def test_a_hung_put_holds_up_neither_lookups_nor_commits(tmp_path: Path) -> None:
    """A spill into a store that stops answering waits for it without the engine's lock:
    other threads look prompts up and commit new ones meanwhile (before, every call waited
    for the hung put: a lookup of a device-resident prompt took as long as the hang)."""
    eng, held = make(tmp_path, timeouts=StoreTimeouts(spill_wait_s=WATCHDOG_S * 2))
    resident, parked = eng.prompt(tokens(0)), eng.prompt(tokens(1))
    eng.commit(parked, payload=payload_of(parked))
    ids = ids_of(eng, parked)
    eng.offload(GROUP, ids)
    eng.spill_down(GROUP, Tier.HOST, ids.size)
    eng.commit(resident, payload=payload_of(resident))
    held.hang.set()
    spill = threading.Thread(target=lambda: eng.spill_down(GROUP, Tier.DISK, ids.size),
                             daemon=True)
    spill.start()
    try:
        deadline = time.monotonic() + WATCHDOG_S
        while not held.calls["put"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.calls["put"], "the spill never reached the store"
        assert in_time(lambda: eng.lookup(resident).usable_tokens) == 128
        other = eng.prompt(tokens(2))
        in_time(lambda: eng.commit(other, payload=payload_of(other)))
        assert in_time(lambda: eng.lookup(other).usable_tokens) == 128
    finally:
        held.released.set()
        spill.join(WATCHDOG_S)
    assert not spill.is_alive()
    assert eng.core.check_invariants() == []


def test_a_lookup_asks_a_hung_store_for_its_presence_question_only(tmp_path: Path) -> None:
    """A lookup of a prompt the core does not know asks the remote store which blocks it holds;
    a store that does not answer costs that lookup its ``presence_s`` and backs off, and a
    lookup of a resident prompt asks it nothing."""
    eng, held = make(tmp_path, timeouts=StoreTimeouts(presence_s=0.05, backoff_max_s=60))
    resident = eng.prompt(tokens(0))
    eng.commit(resident, payload=payload_of(resident))
    held.hang.set()
    try:
        unknown = eng.prompt(tokens(5))
        assert in_time(lambda: eng.lookup(unknown).hit_tokens) == 0
        asked = held.calls["contains"]
        assert asked == 1 and eng.restorer.health[Tier.REMOTE].down()
        assert in_time(lambda: eng.lookup(unknown).hit_tokens) == 0
        assert held.calls["contains"] == asked  # backing off: not asked again
        assert in_time(lambda: eng.lookup(resident).usable_tokens) == 128
    finally:
        held.released.set()


def fill_down_to_disk(eng: Engine, prompts: int = 4) -> None:
    """Device, host and disk full (``make``'s sizes): a further commit relays disk's oldest
    blocks to the remote store for room."""
    for k in range(prompts):
        prompt = eng.prompt(tokens(10 + k))
        eng.commit(prompt, payload=payload_of(prompt))
    for tier, size in (("device", 16), ("host", 8), ("disk", 8)):
        assert eng.core.blocks_in(GROUP, tier).size == size


def test_a_commit_does_not_wait_out_spill_wait_s_on_a_store_that_stopped_answering(
        tmp_path: Path) -> None:
    """A commit whose room below needs copies into a remote store that hangs finds the store
    silent within its presence question's bound and stops waiting for them (the copies end
    by the client's timeout; disk's oldest are evicted instead). Before, it waited the whole
    ``spill_wait_s`` on them, and every thread making room did the same: under a frozen
    Redis the tool's load fell to 2 % of normal."""
    eng, held = make(tmp_path, timeouts=StoreTimeouts(spill_wait_s=WATCHDOG_S * 3))
    fill_down_to_disk(eng)
    held.hang.set()
    try:
        prompt = eng.prompt(tokens(20))
        in_time(lambda: eng.commit(prompt, payload=payload_of(prompt)))
        assert held.calls["put"] >= 1  # the relay reached the store and hangs there
        assert not eng.restorer.health[Tier.REMOTE].up
        assert in_time(lambda: eng.lookup(prompt).usable_tokens) == 128
    finally:
        held.released.set()


def test_a_store_that_failed_gets_a_presence_question_not_loads_until_it_answers(
        tmp_path: Path) -> None:
    """Once a failed store's back-off is over, a restore asks it a presence question first
    (bounded by ``presence_s``) and sends loads only after an answer: a store that still
    hangs costs one short question, and the verdict keeps naming it; once it answers, the
    same restore loads. Before, the back-off's end let loads go straight into the hung store,
    each holding a worker until the client's own timeout."""
    timeouts = StoreTimeouts(backoff_first_s=60, backoff_max_s=60)
    eng, held = make(tmp_path, timeouts=timeouts)
    prompt = eng.prompt(tokens(0))
    eng.commit(prompt, payload=payload_of(prompt))
    to_remote(eng, prompt)
    health = eng.restorer.health[Tier.REMOTE]
    held.hang.set()
    try:
        assert in_time(lambda: eng.lookup(eng.prompt(tokens(9))).hit_tokens) == 0
        assert not health.up
        health.retry_at = 0.0  # the back-off is over; the store still hangs
        verdict = in_time(lambda: eng.lookup(prompt))
        assert verdict.restorable_tokens == 128
        assert verdict.reasons_of(Reason.TIER_UNAVAILABLE)
        asked = held.calls["contains"]
        ticket = in_time(lambda: eng.restore(verdict, prompt))
        ticket.wait(timeout=0.2)
        assert held.calls["load_into"] == 0 and held.calls["contains"] == asked + 1
        assert not health.up
        held.hang.clear()  # it answers again (the question still hung stays so)
        health.retry_at = 0.0
        verdict = in_time(lambda: eng.lookup(prompt))
        in_time(lambda: eng.restore(verdict, prompt).wait(timeout=WAIT))
        assert eng.lookup(prompt).usable_tokens == 128
        assert health.up and held.calls["load_into"] >= 1
    finally:
        held.released.set()
    assert eng.core.check_invariants() == []


def test_loads_after_a_store_returns_do_not_queue_behind_calls_still_hung_in_it(
        tmp_path: Path) -> None:
    """Calls a store left hanging keep their worker threads until the client's timeout (as
    behind a dropped connection); once the store answers again, loads run on fresh workers
    and restore at once. Before, they queued behind the hung calls: no restore from the
    store until those timed out, however long it had been back."""
    timeouts = StoreTimeouts(backoff_first_s=60, backoff_max_s=60)
    eng, held = make(tmp_path, timeouts=timeouts)
    stuck, later = eng.prompt(tokens(0)), eng.prompt(tokens(1))
    for each in (stuck, later):
        eng.commit(each, payload=payload_of(each))
        to_remote(eng, each)
    health = eng.restorer.health[Tier.REMOTE]
    held.hang.set()
    try:
        first = in_time(lambda: eng.restore(eng.lookup(stuck), stuck))
        first.wait(timeout=0.2)  # both workers now hang in its loads
        assert held.calls["load_into"] == 2 and eng.restorer.loads_in_flight == 2
        assert in_time(lambda: eng.lookup(eng.prompt(tokens(9))).hit_tokens) == 0
        assert not health.up  # its presence question went unanswered
        held.hang.clear()  # the store is back; the two loads still hang
        health.retry_at = 0.0
        verdict = in_time(lambda: eng.lookup(later))
        in_time(lambda: eng.restore(verdict, later).wait(timeout=5.0))
        assert eng.lookup(later).usable_tokens == 128
    finally:
        held.released.set()
    eng.close()  # waits for the calls left hanging, and settles them
    assert "restoring_remote" not in states(eng, stuck)
    assert eng.core.check_invariants() == []


def test_a_store_failing_for_hours_still_backs_off_and_never_raises() -> None:
    """Thousands of failed calls in a row (a store down for hours, probed twice a second)
    keep the back-off at its cap. Before, the doubling overflowed after 1 030 failures
    (``OverflowError: int too large to convert to float``), raised out of every later call
    that found the store failing: lookups included."""
    health = TierHealth(Tier.REMOTE, StoreTimeouts())
    for _ in range(5000):
        health.failed("no answer")
    assert 0 < health.wait_s() <= StoreTimeouts().backoff_max_s


def test_calls_racing_a_failure_never_find_their_workers_shut_down(tmp_path: Path) -> None:
    """Threads asking a store while other threads find it failing (which leaves its worker
    threads behind) always get an answer or a miss, never an error: found by
    tools/store_outage.py, where a restore died with "cannot schedule new futures after
    shutdown" when a failure retired the workers between its look-up and its submit."""
    eng, held = make(tmp_path)
    executor = eng.restorer
    keys = [BlockKey(model=b"t" * 16, group=0, layout=0, chain_high=0, chain_low=1,
                     token_start=0, token_end=16)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def ask() -> None:
        try:
            while not stop.is_set():
                eng.restorer.health[Tier.REMOTE].answered()
                executor.presence(held, keys, 1.0)
        except BaseException as exc:  # what the test is about
            errors.append(exc)

    def fail() -> None:
        while not stop.is_set():
            executor._failed(Tier.REMOTE, "found failing")

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave between any two bytecodes
    threads = [threading.Thread(target=ask) for _ in range(3)] + [threading.Thread(target=fail)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(2.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WATCHDOG_S)
        sys.setswitchinterval(switch)
    assert not errors, errors[0]


def test_a_store_down_for_long_is_asked_again_within_half_a_second() -> None:
    """However many times a store failed, its back-off stays short enough that its first good
    restore follows its return within a second (before, the default cap was 1 s, and the
    tool measured 1.07 s from a Redis's return to its first good restore)."""
    health = TierHealth(Tier.REMOTE, StoreTimeouts())
    for _ in range(50):
        health.failed("no answer")
    assert 0 < health.wait_s() <= 0.5


# -- a failing store backs off, is named, and gives way to fresh copies ------------------------


def test_a_failing_store_backs_off_is_named_and_a_commit_replaces_its_copies(
        tmp_path: Path) -> None:
    """Loads from a store that raises fail once, then the tier backs off: restores skip it (no
    storm of doomed loads), the verdict names it (``tier_unavailable``), and the prompt,
    recomputed and committed, is reusable at once from the fresh copies (before, the copies
    that failed to load were kept and the prompt stayed unusable). When the store answers
    again, its copies restore."""
    timeouts = StoreTimeouts(backoff_first_s=60, backoff_max_s=60)
    eng, held = make(tmp_path, timeouts=timeouts)
    prompt, other = eng.prompt(tokens(0)), eng.prompt(tokens(3))
    for each in (prompt, other):
        eng.commit(each, payload=payload_of(each))
        to_remote(eng, each)
    held.error = OSError("the store went away")
    first = eng.lookup(prompt)
    assert first.restorable_tokens == 128
    eng.restore(first, prompt).wait(timeout=WAIT)
    loads = held.calls["load_into"]
    assert loads >= 1 and eng.restorer.health[Tier.REMOTE].down()
    for _ in range(20):
        verdict = eng.lookup(other)
        assert verdict.reasons_of(Reason.TIER_UNAVAILABLE)
        eng.restore(verdict, other).wait(timeout=WAIT)
    assert held.calls["load_into"] == loads  # backing off: asked nothing
    eng.commit(prompt, payload=payload_of(prompt))
    assert eng.lookup(prompt).usable_tokens == 128
    held.error = None
    eng.restorer.health[Tier.REMOTE].retry_at = 0.0  # the pause is over
    verdict = eng.lookup(other)
    eng.restore(verdict, other).wait(timeout=WAIT)
    assert eng.lookup(other).usable_tokens == 128
    assert eng.restorer.health[Tier.REMOTE].up
    assert eng.core.check_invariants() == []


def test_a_directory_where_a_block_file_belongs_costs_that_block_only(tmp_path: Path) -> None:
    """Something else sitting where a block's file belongs (a directory) is that block's
    trouble: the blocks before it restore, it is forgotten and recomputed, the prompt is usable
    whole after its commit, and the disk tier is not called failing (before, the load failed,
    the copy stayed counted as cached and the prefix was blocked for good)."""
    eng = Engine("dense", CoreConfig(device_blocks=16, host_blocks=8, disk_blocks=16,
                                     backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path, capacity_bytes=1 << 30, fsync=False)})
    prompt = eng.prompt(tokens(0))
    eng.commit(prompt, payload=payload_of(prompt))
    ids = ids_of(eng, prompt)
    eng.offload(GROUP, ids)
    eng.spill_down(GROUP, Tier.HOST, ids.size)
    assert set(states(eng, prompt)) == {"disk"}
    (key,) = eng.restorer.keys.keys(GROUP, ids[3:4])
    path = tmp_path / f"{key.name}.kvb"
    path.unlink()
    path.mkdir()
    verdict = eng.lookup(prompt)
    eng.restore(verdict, prompt).wait(timeout=WAIT)
    assert eng.lookup(prompt).usable_tokens == 48
    assert not eng.restorer.health[Tier.DISK].down()
    eng.commit(prompt, payload=payload_of(prompt), computed_from=48)
    assert eng.lookup(prompt).usable_tokens == 128
    assert eng.core.check_invariants() == []


def test_a_failing_store_shows_on_the_metrics_and_comes_back(tmp_path: Path) -> None:
    """``kvfsm_tier_up`` is 1 while a tier answers, 0 while it backs off, 1 again when it
    answers; ``kvfsm_tier_failures_total`` counts the times it stopped."""
    from prometheus_client import CollectorRegistry

    from kvfsm.obs import EngineMetrics

    registry = CollectorRegistry()
    held = Held(DiskTier(tmp_path / "remote", capacity_bytes=1 << 30, fsync=False))
    eng = Engine("dense", CoreConfig(device_blocks=16, host_blocks=8, disk_blocks=8,
                                     remote_blocks=64, backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path / "disk", capacity_bytes=1 << 30,
                                         fsync=False), "remote": held},
                 metrics=EngineMetrics(registry))

    def up() -> float | None:
        return registry.get_sample_value("kvfsm_tier_up", {"tier": "remote"})

    assert up() == 1
    held.error = OSError("the store went away")
    eng.lookup(eng.prompt(tokens(7)))  # a presence question that raises
    assert up() == 0
    assert registry.get_sample_value("kvfsm_tier_failures_total", {"tier": "remote"}) == 1
    held.error = None
    eng.restorer.health[Tier.REMOTE].retry_at = 0.0
    eng.lookup(eng.prompt(tokens(8)))
    assert up() == 1


# -- the disk holds what the core counts --------------------------------------------------------


def test_disk_files_are_exactly_the_blocks_the_core_keeps_there_and_all_come_back(
        tmp_path: Path) -> None:
    """A block leaving disk takes its file along, so the directory holds exactly the core's
    disk copies (before: every file ever written stayed, 48 against 8), and a restarted engine
    finds every one of them again."""
    def engine() -> Engine:
        return Engine("dense", CoreConfig(device_blocks=8, host_blocks=8, disk_blocks=16,
                                          backend="numpy"),
                      tiers={"disk": DiskTier(tmp_path, capacity_bytes=1 << 30, fsync=False)})

    eng = engine()
    prompts = [eng.prompt(tokens(k)) for k in range(6)]
    for prompt in prompts:
        eng.commit(prompt, payload=payload_of(prompt))
    on_disk = {k for k, prompt in enumerate(prompts) if "disk" in states(eng, prompt)}
    kept = int(eng.core.blocks_in(GROUP, "disk").size)
    assert 0 < kept <= 16
    eng.close()  # removals run on workers: close waits for them
    assert len(list(tmp_path.glob("*.kvb"))) == kept

    again = engine()
    found = 0
    for k in on_disk:
        found += again.discover(again.prompt(tokens(k)))
    assert found == kept


def test_an_offload_larger_than_host_moves_every_block_down_to_disk(tmp_path: Path) -> None:
    """Offloading more device blocks than host has free moves them all while the disk has
    room (before, only as many as host had free moved)."""
    eng = Engine("dense", CoreConfig(device_blocks=16, host_blocks=4, disk_blocks=64,
                                     backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path, capacity_bytes=1 << 30, fsync=False)})
    prompt = eng.prompt(tokens(0))
    eng.commit(prompt, payload=payload_of(prompt))
    moved = eng.offload(GROUP, ids_of(eng, prompt))
    assert moved.all()
    assert set(states(eng, prompt)) <= {"host", "disk"}
    assert states(eng, prompt).count("host") <= 4


@pytest.mark.parametrize("field", ["presence_s", "spill_wait_s", "backoff_first_s",
                                   "backoff_max_s"])
def test_bad_store_timeouts_are_named(field: str) -> None:
    with pytest.raises(Exception, match=field):
        StoreTimeouts(**{field: -1.0})


def test_close_settles_a_relay_to_remote_and_removes_its_disk_file(tmp_path: Path) -> None:
    """Spills disk -> remote begun before close() are settled by it: each block lands on
    remote (its disk file removed in place, the workers being stopped) or, its copy cancelled
    before it started, stays on disk; close raises nothing and the files are the core's."""
    eng, _ = make(tmp_path)
    prompt = eng.prompt(tokens(0))
    eng.commit(prompt, payload=payload_of(prompt))
    ids = ids_of(eng, prompt)
    eng.offload(GROUP, ids)
    eng.spill_down(GROUP, Tier.HOST, ids.size)
    on_disk = ids[[state == "disk" for state in states(eng, prompt)]]
    assert on_disk.size
    with eng.lock:
        eng.restorer.begin_store(GROUP, on_disk)
    eng.close()
    group = eng.core.group(GROUP)
    assert {group.machine.state_of(int(b)) for b in on_disk} <= {"remote", "disk"}
    assert len(list((tmp_path / "disk").glob("*.kvb"))) == \
        int(eng.core.blocks_in(GROUP, "disk").size)
    assert eng.core.check_invariants() == []
