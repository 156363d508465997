"""Pins, checksum failures, writes and index references reach the core's observers, whoever
writes them (``StateCore.pin``/``unpin``, a lease's take, give-back and expiry, a lookup's
checks, ``StateCore.write``, ``set_index_refs``); the event log writes them and a replay counts
the pins, refusing a block evicted, spilled or freed while pinned and a block read at the epoch
a lookup saw it fail its checksum at."""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, EventLog, LeaseLost, Level
from kvfsm.obs import _eventlog as eventlog
from kvfsm.obs import replay
from kvfsm.serve import flip_device_bytes
from kvfsm.spec import Event
from kvfsm.state import StateCore
from tests.test_obs_eventlog import GROUP, Recorder, records, tokens
from tests.test_obs_replay import rejected, write

Record = dict[str, Any]
DEEPSEEK = "deepseek_v4_like"
#: Tokens of the DeepSeek-style prompts: a few history blocks of 64 and index blocks of 16.
DEEPSEEK_TOKENS = 161
#: Seconds a lease lives in the expiry scenario, and how long the scenario waits past it.
SHORT_TTL_S = 0.01
PAST_TTL_S = 0.05


def net_pins(head: Record, lines: Sequence[Record]) -> dict[str, NDArray[np.int64]]:
    """Per group, the pins each block holds after ``lines``: the header's start plus every
    pin line and every run of a pins or take line, less a take's runs where a give_back
    line names it (a lease line gives back what it takes)."""
    held = {}
    for name, entry in head["groups"].items():
        pins = np.zeros(entry["blocks"], dtype=np.int64)
        start = entry["start"]
        pins[start["ids"]] = start.get("pins", [0] * len(start["ids"]))
        held[name] = pins
    taken: dict[int, list[list[Any]]] = {}
    for record in lines:
        if record["type"] == "pin":
            if "ids_runs" in record:
                ids = np.concatenate([np.arange(first, first + count)
                                      for first, count in record["ids_runs"]])
            else:
                ids = np.array(record["ids"], dtype=np.int64)
            np.add.at(held[record["group"]], ids, record["delta"])
        elif record["type"] == "pins":
            for group, first, count, delta in record["runs"]:
                held[group][first:first + count] += delta
        elif record["type"] in ("take", "take_read"):
            taken[record["seq"]] = record["runs"]
            for group, first, count, _ in record["runs"]:
                held[group][first:first + count] += 1
        elif record["type"] == "give_back":
            for group, first, count, _ in taken.pop(record["take"]):
                held[group][first:first + count] -= 1
    return held


def assert_log_holds_core_pins(log: EventLog, eng: Engine) -> None:
    """The pins replayed from the log so far are the ones the core holds, block by block."""
    log.flush()
    head, lines = records(log.path)
    held = net_pins(head, lines)
    for name, state in eng.core.groups.items():
        np.testing.assert_array_equal(held[name], state.pins.astype(np.int64), err_msg=name)


def deepseek(log: EventLog | None = None, device_blocks: int = 64) -> Engine:
    return Engine(DEEPSEEK, CoreConfig(device_blocks=device_blocks, backend="numpy"),
                  event_log=log)


def ds_prompt(eng: Engine, seed: int) -> Any:
    return eng.prompt(np.random.default_rng(seed).integers(0, 50_000, DEEPSEEK_TOKENS))


# -- every pin writer, told ---------------------------------------------------------------------


def test_every_pin_writer_is_logged_and_replays_to_the_pins_the_core_holds(
        tmp_path: Path) -> None:
    """One-pass leases, leases checked afresh after a change, leases reaped at their ttl,
    ``StateCore.pin``/``unpin`` of index blocks (their targets pinned through them): after
    each, the pins counted from the log are the core's, and the log replays clean."""
    path = tmp_path / "pins.jsonl"
    with EventLog(path) as log:
        eng = deepseek(log)
        first, second = ds_prompt(eng, 1), ds_prompt(eng, 2)
        eng.commit(first)
        _, lease = eng.lookup_and_lease(first)  # the one-pass take
        lease.validate()
        assert_log_holds_core_pins(log, eng)
        assert any(p > 0 for p in eng.core.group("history").pins)
        verdict = eng.lookup(first)
        eng.commit(second)  # a change since the lookup: the next lease is checked afresh
        other = eng.lease(verdict, first)
        assert_log_holds_core_pins(log, eng)
        lease.release()
        assert_log_holds_core_pins(log, eng)
        index = eng.core.group("index")
        blocks = np.flatnonzero(index.table.readable[index.states])[:2]
        eng.core.pin("index", blocks)  # pins the blocks and, through them, their targets
        assert_log_holds_core_pins(log, eng)
        eng.core.unpin("index", blocks)
        other.release()
        _, short = eng.lookup_and_lease(second, ttl_s=SHORT_TTL_S)
        time.sleep(PAST_TTL_S)
        eng.lookup(second)  # reaps the expired lease
        assert short.expired
        with pytest.raises(LeaseLost):
            short.validate()
        assert_log_holds_core_pins(log, eng)
        assert all(not state.pins.any() for state in eng.core.groups.values())
        eng.close()
    _, lines = records(path)
    kinds = {record["type"] for record in lines}
    assert {"pin", "take", "take_read", "give_back", "write", "refs"} <= kinds
    result = replay(path)
    assert result.accepted, result.violation
    assert result.pins > 0


def test_a_lease_over_thousands_of_consecutive_blocks_is_told_as_one_run() -> None:
    """A lease over 4 096 consecutive blocks is one ``(group, first, count, delta)`` run on
    its take and one on its give-back, never 4 096 ids."""
    blocks = 4096
    eng = Engine("dense", CoreConfig(device_blocks=blocks + 8, backend="numpy"))
    prompt = eng.prompt(tokens(0, blocks))
    eng.commit(prompt)
    told = RunsOnly()
    eng.core.add_observer(told)
    _, lease = eng.lookup_and_lease(prompt, level=Level.STANDARD)
    lease.release()
    assert told.calls == [[(GROUP, told.calls[0][0][1], blocks, 1)],
                          [(GROUP, told.calls[0][0][1], blocks, -1)]]
    eng.close()


# -- observers with or without the new methods --------------------------------------------------


class RunsOnly(Recorder):
    """An observer told of pins through ``pinned_runs`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[str, int, int, int]]] = []

    def pinned_runs(self, runs: Sequence[tuple[str, int, int, int]]) -> None:
        self.calls.append(list(runs))

    def held(self, core: StateCore) -> dict[str, NDArray[np.int64]]:
        held = {name: np.zeros(state.n_blocks, dtype=np.int64)
                for name, state in core.groups.items()}
        for runs in self.calls:
            for group, first, count, delta in runs:
                held[group][first:first + count] += delta
        return held


class IdsOnly(Recorder):
    """An observer told of pins through ``pinned`` only, and of the other writes."""

    def __init__(self) -> None:
        super().__init__()
        self.pins: list[tuple[str, list[int], int]] = []
        self.failed: list[tuple[str, list[int], list[int]]] = []
        self.writes: list[tuple[str, list[int], int]] = []
        self.refs: list[tuple[str, list[int]]] = []

    def pinned(self, group: str, ids: NDArray[np.intp], delta: int) -> None:
        self.pins.append((group, ids.tolist(), delta))

    def checks_failed(self, group: str, ids: NDArray[np.intp],
                      epochs: NDArray[np.uint32]) -> None:
        self.failed.append((group, ids.tolist(), epochs.tolist()))

    def written(self, group: str, ids: NDArray[np.intp], sub_mask: int) -> None:
        self.writes.append((group, ids.tolist(), sub_mask))

    def indexed(self, group: str, ids: NDArray[np.intp], targets: NDArray[np.int32],
                epochs: NDArray[np.uint32]) -> None:
        self.refs.append((group, ids.tolist()))

    def held(self, core: StateCore) -> dict[str, NDArray[np.int64]]:
        held = {name: np.zeros(state.n_blocks, dtype=np.int64)
                for name, state in core.groups.items()}
        for group, ids, delta in self.pins:
            np.add.at(held[group], ids, delta)
        return held


def _leases_and_pins(eng: Engine, seed: int) -> None:
    first, second = ds_prompt(eng, seed), ds_prompt(eng, seed + 1)
    eng.commit(first)
    _, lease = eng.lookup_and_lease(first)
    verdict = eng.lookup(first)
    eng.commit(second)
    eng.lease(verdict, first)  # left open: its pins stay held
    lease.release()
    index = eng.core.group("index")
    eng.core.pin("index", np.flatnonzero(index.table.readable[index.states])[:2])


def test_observers_with_either_pin_method_see_what_the_core_holds() -> None:
    """An observer with only ``pinned`` and one with only ``pinned_runs`` each count the
    pins the core holds; one with neither (written before pins were told) still sees every
    move and read, and the core then gathers nothing for it."""
    eng = deepseek()
    runs, ids, plain = RunsOnly(), IdsOnly(), Recorder()
    for observer in (runs, ids, plain):
        eng.core.add_observer(observer)
    _leases_and_pins(eng, 7)
    for name, state in eng.core.groups.items():
        np.testing.assert_array_equal(runs.held(eng.core)[name], state.pins, err_msg=name)
        np.testing.assert_array_equal(ids.held(eng.core)[name], state.pins, err_msg=name)
    assert ids.writes and ids.refs and plain.moves
    assert plain.moves == runs.moves == ids.moves
    eng.core.remove_observer(runs)
    eng.core.remove_observer(ids)
    assert not eng.core.pins_observed  # ``plain`` has no pin method: nothing to tell
    eng.close()


def test_nothing_is_gathered_for_pins_where_no_observer_takes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no observer, or only observers without pin methods, no pin writer calls the
    core's pin telling (zero cost)."""

    def told(*args: object) -> None:
        raise AssertionError("pins told with no observer taking them")

    eng = deepseek()
    monkeypatch.setattr(eng.core, "tell_pins", told)
    monkeypatch.setattr(eng.core, "tell_pin_runs", told)
    _leases_and_pins(eng, 11)
    eng.core.add_observer(Recorder())
    _leases_and_pins(eng, 21)
    assert not eng.core.pins_observed
    eng.close()


# -- replay: pins -------------------------------------------------------------------------------


def _renumbered(lines: list[Record]) -> list[Record]:
    """``lines`` numbered in turn, each give_back naming its take's new number (a line
    added, numbered 0, names none)."""
    renumbered = {record["seq"]: seq for seq, record in enumerate(lines)
                  if record["type"] in ("take", "take_read")}
    for seq, record in enumerate(lines):
        record["seq"] = seq
        if record["type"] == "give_back" and isinstance(record.get("take"), int):
            record["take"] = renumbered.get(record["take"], record["take"])
    return lines


@pytest.fixture
def evicted_after_lease(tmp_path: Path) -> tuple[Record, list[Record]]:
    """A dense engine's log: a commit, a lease taken, validated twice (a take_read line, then
    a reads line) and given back (a give_back line), then every device block evicted."""
    path = tmp_path / "evicted.jsonl"
    with EventLog(path) as log:
        eng = Engine("dense", CoreConfig(device_blocks=16, backend="numpy"), event_log=log)
        prompt = eng.prompt(tokens(0))
        eng.commit(prompt)
        _, lease = eng.lookup_and_lease(prompt)
        with lease:
            lease.validate()
            lease.validate()
        eng.core.fire(GROUP, eng.core.blocks_in(GROUP, "device"), Event.EVICT)
        eng.close()
    assert replay(path).accepted
    return records(path)


def _give_back(lines: list[Record]) -> int:
    """Index of the lease's give-back line."""
    return next(i for i, r in enumerate(lines) if r["type"] == "give_back")


def _given_runs(lines: list[Record], at: int) -> list[list[Any]]:
    """The runs ``[group, first id, count, epoch]`` of the take the give_back line at ``at``
    names."""
    return next(r["runs"] for r in lines if r["seq"] == lines[at]["take"])


def _evict(lines: list[Record]) -> int:
    return next(i for i, r in enumerate(lines) if r["type"] == "move" and r["event"] == "evict")


def test_an_eviction_while_pinned_is_refused(tmp_path: Path, evicted_after_lease: Any) -> None:
    """Drop the lease's give-back: its blocks are evicted while (as the log says) pinned."""
    head, lines = copy.deepcopy(evicted_after_lease)
    _, first, _, _ = _given_runs(lines, _give_back(lines))[0]
    del lines[_give_back(lines)]
    lines = _renumbered(lines)
    evict = _evict(lines)
    evicted = lines[evict]["ids"]
    result = replay(write(tmp_path / "t.jsonl", head, lines))
    block = next(b for b in evicted if b >= first)
    rejected(result, evict + 2, "pinned", f"group {GROUP!r} block {block}", "--evict-->",
             "1 pin(s) hold it")


def test_a_spill_while_pinned_is_refused(tmp_path: Path) -> None:
    """A pin line added before a spill_done of its block (the spill gives up the device
    slot: told by the table's columns, whatever the event's name)."""
    path = tmp_path / "spilled.jsonl"
    with EventLog(path) as log:
        eng = Engine("dense", CoreConfig(device_blocks=8, host_blocks=8, backend="numpy"),
                     event_log=log)
        eng.commit(eng.prompt(tokens(0)))
        ids = eng.core.blocks_in(GROUP, "device")[:1]
        eng.core.fire(GROUP, ids, Event.SPILL_BEGIN)
        eng.core.fire(GROUP, ids, Event.SPILL_DONE)
        eng.close()
    head, lines = records(path)
    assert replay(path).accepted
    done = next(i for i, r in enumerate(lines) if r["type"] == "move"
                and r["event"] == "spill_done")
    block = lines[done]["ids"][0]
    lines.insert(done, {"seq": 0, "type": "pin", "group": GROUP, "delta": 1, "ids": [block]})
    lines = _renumbered(lines)
    rejected(replay(write(tmp_path / "t.jsonl", head, lines)), done + 3, "pinned",
             f"block {block}", "--spill_done-->")


def test_an_unbalanced_unpin_or_a_pin_of_an_unreadable_block_is_refused(
        tmp_path: Path, evicted_after_lease: Any) -> None:
    head, lines = copy.deepcopy(evicted_after_lease)
    give_back = _give_back(lines)
    group, first, _, _ = _given_runs(lines, give_back)[0]
    lines.insert(give_back + 1, {"seq": 0, "type": "pin", "group": group, "delta": -1,
                                 "ids": [first]})
    rejected(replay(write(tmp_path / "t.jsonl", head, _renumbered(lines))), give_back + 3,
             "pin", f"block {first} unpinned while 0 pin(s) hold it")
    head, lines = copy.deepcopy(evicted_after_lease)
    never = head["groups"][GROUP]["blocks"] - 1  # never allocated: free
    lines.insert(0, {"seq": 0, "type": "pin", "group": GROUP, "delta": 1, "ids": [never]})
    rejected(replay(write(tmp_path / "t2.jsonl", head, _renumbered(lines))), 2, "pin",
             f"block {never} pinned in state 'free'")


@pytest.mark.parametrize("line, why", [
    ({"type": "pin", "group": GROUP, "ids": [0]}, "delta"),
    ({"type": "pin", "group": GROUP, "delta": 0, "ids": [0]}, "delta"),
    ({"type": "pin", "group": GROUP, "delta": 1, "ids": []}, "no ids"),
    ({"type": "pin", "group": GROUP, "delta": True, "ids": [0]}, "delta"),
    ({"type": "pins", "runs": []}, "no runs"),
    ({"type": "pins", "runs": [[GROUP, 0, 1]]}, "not [group, first id, count, delta]"),
    ({"type": "pins", "runs": [["nope", 0, 1, 1]]}, "unknown group"),
    ({"type": "take", "runs": []}, "no runs"),
    ({"type": "take_read", "runs": [[GROUP, 0, 1]]}, "not [group, first id, count, epoch]"),
    ({"type": "take", "runs": [[GROUP, 0, 1, -1]]}, "epoch"),
    ({"type": "give_back"}, "'take'"),
    ({"type": "give_back", "take": "0"}, "'take'"),
    ({"type": "check_failed", "group": GROUP, "ids": [0], "epochs": []}, "'epochs'"),
    ({"type": "write", "group": GROUP, "ids": [0], "sub_blocks": 0}, "names no sub-block"),
    ({"type": "refs", "group": GROUP, "ids": [0], "targets": [], "epochs": []}, "a list per id"),
])
def test_malformed_new_lines_are_refused(tmp_path: Path, evicted_after_lease: Any,
                                         line: Record, why: str) -> None:
    head, lines = copy.deepcopy(evicted_after_lease)
    lines.insert(0, {"seq": 0, **line})
    rejected(replay(write(tmp_path / "t.jsonl", head, _renumbered(lines))), 2, "malformed", why)


# -- replay: checksum failures ------------------------------------------------------------------


@pytest.fixture
def failed(tmp_path: Path) -> tuple[Record, list[Record]]:
    """A dense engine's log: a commit, a block's device bytes flipped, a FULL lookup that
    sees it fail its checksum (recorded), a lease of what stays usable, then the failed block
    evicted and the prompt committed and read again."""
    path = tmp_path / "failed.jsonl"
    with EventLog(path) as log:
        eng = Engine("dense", CoreConfig(device_blocks=16, backend="numpy"), event_log=log)
        prompt = eng.prompt(tokens(0))
        eng.commit(prompt)
        flip_device_bytes(eng, prompt, index=2, group=GROUP)
        _, lease = eng.lookup_and_lease(prompt, level=Level.FULL)
        with lease:
            lease.validate()
        assert eng.core.failed_blocks(GROUP).size == 1
        eng.core.fire(GROUP, eng.core.failed_blocks(GROUP), Event.EVICT)
        eng.commit(prompt)
        _, again = eng.lookup_and_lease(prompt, level=Level.FULL)
        with again:
            again.validate()
        eng.close()
    result = replay(path)
    assert result.accepted, result.violation
    return records(path)


def _read_epochs(record: Record) -> dict[int, int]:
    """The blocks a read or reads line reads, with their epochs."""
    if record["type"] == "reads":
        return {block: epoch for _, first, count, epoch in record["runs"]
                for block in range(first, first + count)}
    ids = [b for first, count in record["ids_runs"] for b in range(first, first + count)] \
        if "ids_runs" in record else record["ids"]
    epochs = [e for epoch, count in record["epochs_runs"] for e in [epoch] * count] \
        if "epochs_runs" in record else record["epochs"]
    return dict(zip(ids, epochs, strict=True))


def test_a_read_at_the_epoch_a_block_failed_its_checksum_at_is_refused(
        tmp_path: Path, failed: Any) -> None:
    head, lines = copy.deepcopy(failed)
    at = next(i for i, r in enumerate(lines) if r["type"] == "check_failed")
    block, epoch = lines[at]["ids"][0], lines[at]["epochs"][0]
    lines.insert(at + 1, {"seq": 0, "type": "read", "group": GROUP, "ids": [block],
                          "epochs": [epoch]})
    rejected(replay(write(tmp_path / "t.jsonl", head, _renumbered(lines))), at + 3,
             "failed_read", f"group {GROUP!r} block {block} read at epoch {epoch}")


def test_a_block_read_again_once_its_epoch_moved_is_accepted(tmp_path: Path,
                                                             failed: Any) -> None:
    """The failure holds at its epoch only: the block evicted (epoch moved) and written
    again is read by the second lease, and the log replays clean (the fixture checks it);
    moving the failure to that later epoch makes the read a violation."""
    head, lines = copy.deepcopy(failed)
    at = next(i for i, r in enumerate(lines) if r["type"] == "check_failed")
    block = lines[at]["ids"][0]
    reads = [i for i, r in enumerate(lines) if r["type"] in ("read", "reads")]
    read = _read_epochs(lines[reads[-1]])
    assert block in read, "the block evicted is written and read again under the same id"
    assert read[block] != lines[at]["epochs"][0]
    lines[at]["epochs"][0] = read[block]
    result = replay(write(tmp_path / "t.jsonl", head, lines))
    rejected(result, reads[-1] + 2, "failed_read", f"block {block}")


# -- replay: writes and index references --------------------------------------------------------


def test_a_write_or_refs_line_on_a_block_not_being_written_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.jsonl"
    with EventLog(path) as log:
        eng = deepseek(log)
        eng.commit(ds_prompt(eng, 3))
        history = eng.core.group("history")
        ids = eng.core.allocate("history", [0], [9], [9])
        eng.core.fire("history", ids, Event.WRITE_BEGIN)
        payload = np.zeros(-(-history.decl.payload_bytes // 4), dtype=np.uint8)
        eng.core.write("history", ids, payload[None, :payload.size], sub_block=1)
        eng.close()
    head, lines = records(path)
    assert replay(path).accepted
    sub = [r for r in lines if r["type"] == "write" and r["sub_blocks"] == 1 << 1]
    assert sub and sub[-1]["ids"] == ids.tolist()
    never = head["groups"]["index"]["blocks"] - 1
    for kind in ("write", "refs"):
        edited = copy.deepcopy(lines)
        at = next(i for i, r in enumerate(edited) if r["type"] == kind)
        edited[at]["group"] = "index"
        edited[at]["ids"] = [never]
        if kind == "refs":
            edited[at]["targets"], edited[at]["epochs"] = [[0]], [[0]]
        rejected(replay(write(tmp_path / f"{kind}.jsonl", head, edited)), at + 2, "write",
                 f"group 'index' block {never}", "state 'free'")


# -- the invariant, drawn -----------------------------------------------------------------------


OPS = st.lists(st.sampled_from(["lease", "lease_later", "release", "pin", "unpin", "commit",
                                "evict"]), min_size=1, max_size=12)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_the_pins_replayed_are_the_pins_held(tmp_path: Path, ops: list[str]) -> None:
    """Whatever mix of one-pass leases, leases taken after a change, give-backs, pins and
    unpins of index blocks, commits and evictions runs, the pins counted from the log equal
    the pins the core holds after every step, and the log replays clean (no block evicted
    while pinned)."""
    path = tmp_path / "drawn.jsonl"
    with EventLog(path) as log:
        eng = deepseek(log, device_blocks=48)
        prompts = [ds_prompt(eng, seed) for seed in range(3)]
        eng.commit(prompts[0])
        leases: list[Any] = []
        pinned: list[NDArray[np.intp]] = []
        for step, op in enumerate(ops):
            prompt = prompts[step % len(prompts)]
            if op == "lease":
                leases.append(eng.lookup_and_lease(prompt)[1])
            elif op == "lease_later":
                verdict = eng.lookup(prompt)
                eng.commit(prompts[(step + 1) % len(prompts)])
                with contextlib.suppress(LeaseLost):  # a block it needs moved: none taken
                    leases.append(eng.lease(verdict, prompt))
            elif op == "release" and leases:
                leases.pop(0).release()
            elif op == "pin":
                index = eng.core.group("index")
                free = np.flatnonzero(index.table.readable[index.states])[:1]
                if free.size:
                    eng.core.pin("index", free)
                    pinned.append(free)
            elif op == "unpin" and pinned:
                eng.core.unpin("index", pinned.pop())
            elif op == "commit":
                eng.commit(prompt)
            elif op == "evict":
                for name in eng.core.groups:
                    eng.give_back(name, 4)
            assert_log_holds_core_pins(log, eng)
        eng.close()
    result = replay(path)
    assert result.accepted, result.violation
    assert json.loads(path.read_text().splitlines()[0])["version"] == 5


def test_a_give_back_after_a_block_moved_under_the_lease_tells_only_the_pins_given_back(
        tmp_path: Path) -> None:
    """Where something moved a leased block's content behind its pins (here the epoch is
    bumped by hand), the give-back skips that block's own pin but still gives back its
    chunk's: the log tells exactly that, so the pins it replays stay the core's."""
    chunk = 4
    blocks = 10  # ids 0..9: two whole chunks of 4, then 8 and 9 pinned one by one
    path = tmp_path / "moved.jsonl"
    with EventLog(path) as log:
        eng = Engine("dense", CoreConfig(device_blocks=16, backend="numpy",
                                         pin_chunk_blocks=chunk), event_log=log)
        prompt = eng.prompt(tokens(0, blocks))
        eng.commit(prompt)
        _, lease = eng.lookup_and_lease(prompt, level=Level.STANDARD)
        leased = lease.blocks(GROUP)
        assert leased.tolist() == list(range(blocks))
        state = eng.core.group(GROUP)
        for block in (2, 9):  # inside a whole chunk, and an end pinned alone
            state._blocks.epoch[block] += 1
        state.changes += 1
        state.change_count.total += 1
        lease.release()
        assert state.pins[9] == 1 and state.pins[2] == 0
        assert_log_holds_core_pins(log, eng)
        eng.close()


# -- give-backs the log cannot name a take for --------------------------------------------------


def test_a_give_back_of_a_take_the_log_never_saw_lists_its_runs(tmp_path: Path) -> None:
    """A log attached while a lease is open (its pins in the header's start) writes that
    lease's give-back as a pins line of its runs, never a give_back naming a take it has not
    written; the pins it replays stay the core's and it replays clean."""
    path = tmp_path / "late.jsonl"
    eng = deepseek()
    prompt = ds_prompt(eng, 4)
    eng.commit(prompt)
    _, lease = eng.lookup_and_lease(prompt)
    with EventLog(path) as log:
        log.attach(eng.core)
        lease.release()
        assert_log_holds_core_pins(log, eng)
        _, again = eng.lookup_and_lease(prompt)  # taken while attached: named on give-back
        again.release()
        assert_log_holds_core_pins(log, eng)
    _, lines = records(path)
    assert [r["type"] for r in lines] == ["pins", "take", "give_back"]
    assert {run[3] for run in lines[0]["runs"]} == {-1}
    assert lines[2]["take"] == lines[1]["seq"]
    assert replay(path).accepted
    eng.close()


def test_takes_past_the_kept_ones_are_forgotten_and_given_back_as_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``OPEN_TAKES_KEPT`` open takes the log forgets them (a lease given back in part
    never names its take, so they could pile up): a forgotten take's give-back lists its
    runs, a kept one's names it, and the log replays to the pins the core holds."""
    monkeypatch.setattr(eventlog, "OPEN_TAKES_KEPT", 1)
    path = tmp_path / "forgot.jsonl"
    with EventLog(path) as log:
        eng = deepseek(log)
        prompts = [ds_prompt(eng, seed) for seed in (5, 6)]
        for prompt in prompts:
            eng.commit(prompt)
        leases = [eng.lookup_and_lease(prompt)[1] for prompt in prompts]
        for lease in leases:
            lease.release()
            assert_log_holds_core_pins(log, eng)
        eng.close()
    _, lines = records(path)
    kinds = [r["type"] for r in lines if r["type"] in ("take", "give_back", "pins")]
    assert kinds == ["take", "take", "pins", "give_back"]
    assert replay(path).accepted


def test_a_take_written_before_its_read_is_named_by_its_give_back(tmp_path: Path) -> None:
    """A take whose batch is written before the lease is read (a log writing every record)
    joins nothing: a take line, a reads line and a give_back naming the take; the pins
    replayed are the core's after each step and the log replays clean."""
    path = tmp_path / "every.jsonl"
    with EventLog(path, flush_every=1) as log:
        eng = deepseek(log)
        prompt = ds_prompt(eng, 8)
        eng.commit(prompt)
        _, lease = eng.lookup_and_lease(prompt)
        assert_log_holds_core_pins(log, eng)
        lease.validate()
        lease.release()
        assert_log_holds_core_pins(log, eng)
        eng.close()
    _, lines = records(path)
    leased = [r for r in lines if r["type"] not in ("move", "write", "refs")]
    assert [r["type"] for r in leased] == ["take", "reads", "give_back"]
    assert leased[2]["take"] == leased[0]["seq"]
    assert leased[0]["runs"] == leased[1]["runs"]
    result = replay(path)
    assert result.accepted and result.reads == len(leased[1]["runs"])


def test_a_lease_tells_answer_row_and_run_observers_each_their_own_way(
        tmp_path: Path) -> None:
    """An event log (which takes a lease's answer rows) and an observer taking runs only,
    attached together and apart: both count the core's pins after every lease."""
    with EventLog(tmp_path / "tellers.jsonl") as log:
        eng = deepseek(log)
        runs = RunsOnly()
        eng.core.add_observer(runs)
        _leases_and_pins(eng, 31)
        assert_log_holds_core_pins(log, eng)
        for name, state in eng.core.groups.items():
            np.testing.assert_array_equal(runs.held(eng.core)[name], state.pins, err_msg=name)
        eng.core.remove_observer(runs)
        _leases_and_pins(eng, 32)
        assert_log_holds_core_pins(log, eng)
    eng.close()


def test_an_index_leased_with_targets_outside_its_window_is_logged_pin_for_pin(
        tmp_path: Path) -> None:
    """An index pointing before its target's sliding window: the lease pins those targets
    through the core beside its one-pass take; the log holds the core's pins while it is
    held, after a validate that found a target moved, and after the release, and replays."""
    from tests import lookup_models as made

    decl = made.model("t_swa_index", made.SWA, made.group(
        "index", "sparse_index", "sparse_index", 16, 'target_group = "swa"\ntop_k = 4'))
    log = EventLog(tmp_path / "log.jsonl")
    eng = Engine(decl, CoreConfig(device_blocks=64, backend="numpy"), event_log=log)
    text = made.tokens(321)
    prompt = eng.prompt(text)
    eng.commit(prompt)
    lease = eng.lease(eng.lookup(prompt), prompt)
    swa = eng.core.group("swa")
    outside = made.block_id(eng, "swa", text, 5)
    assert swa.pins[outside] == 1 and outside not in lease.blocks("swa").tolist()
    assert_log_holds_core_pins(log, eng)
    lease.validate()
    eng.core.unpin("swa", [outside])  # bypassed: the lease's pin released behind its back
    eng.core.fire("swa", [outside], Event.EVICT)
    with pytest.raises(LeaseLost):
        lease.validate()
    assert_log_holds_core_pins(log, eng)
    lease.release()
    assert not swa.pins.any() and not eng.core.group("index").pins.any()
    assert_log_holds_core_pins(log, eng)
    log.close()
    assert replay(tmp_path / "log.jsonl").accepted
