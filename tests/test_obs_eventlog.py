"""The core's observer hook and the JSON Lines event log: every moved batch is reported once,
after it moved, with its states and epochs; refused ids never; the log writes them in batches
and a real engine run (commits, lookups, evictions, host and disk spills and restores, reads)
replays clean."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, EventLog, GuardRejected, KvfsmError, shipped_models
from kvfsm.lookup import Verdict
from kvfsm.lookup._buffers import FIRST_EPOCH, FIRST_ID, HI, LO
from kvfsm.obs import FLUSH_EVERY, replay, table_digest
from kvfsm.obs._eventlog import _one_run_line, _put_runs, _read_line
from kvfsm.obs._read_lines import run_read_line
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore
from kvfsm.tiers import HEADER_BYTES, DiskTier

DENSE = shipped_models()["dense"]
GROUP = "attn"
BS = DENSE.group(GROUP).block_size
#: Blocks per workload prompt; the device holds two prompts, the host one.
BLOCKS = 4
WAIT = 30.0


class Recorder:
    """A core observer keeping everything it is told."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, Event, list[int], list[int], list[int], list[int]]] = []
        self.reads: list[tuple[str, list[int], list[int]]] = []

    def moved(self, group: str, event: Event, ids: NDArray[np.intp], before: NDArray[np.uint8],
              after: NDArray[np.uint8], epochs: NDArray[np.uint32]) -> None:
        self.moves.append((group, event, ids.tolist(), before.tolist(), after.tolist(),
                           epochs.tolist()))

    def read(self, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> None:
        self.reads.append((group, ids.tolist(), epochs.tolist()))


def tokens(k: int, blocks: int = BLOCKS) -> NDArray[np.int64]:
    """``blocks`` full blocks and one token more (so every full block can be usable)."""
    return np.arange(blocks * BS + 1, dtype=np.int64) + 100_000 * (k + 1)


def run_workload(tmp_path: Path, **observers: Any) -> tuple[Engine, list[Verdict]]:
    """A dense engine with a host pool and a disk tier, given ``event_log`` / ``metrics``:
    commits that spill to host and on to disk, lookups, host and disk restores, reads of the
    usable blocks, evictions. Returns the (closed) engine and every verdict it gave."""
    width = DENSE.group(GROUP).payload_bytes
    store = DiskTier(tmp_path / "disk", capacity_bytes=64 * (HEADER_BYTES + width), fsync=False)
    config = CoreConfig(device_blocks=2 * BLOCKS, host_blocks=BLOCKS, disk_blocks=8 * BLOCKS,
                        backend="numpy")
    eng = Engine("dense", config, tiers={"disk": store}, **observers)
    prompts = [eng.prompt(tokens(k)) for k in range(4)]
    verdicts = []
    for prompt in prompts:  # the third spills the first to host, the fourth it on to disk
        eng.commit(prompt)
        verdicts.append(eng.lookup(prompt))
    for prompt in (prompts[0], prompts[2]):  # from disk, then from host
        plan = eng.lookup(prompt)
        verdicts.append(plan)
        eng.restore(plan, prompt).wait(timeout=WAIT)
        after = eng.lookup(prompt)
        verdicts.append(after)
        high, low = prompt.words(BS)
        usable = eng.core.lookup_words(GROUP, high, low)[: after.usable_tokens // BS]
        eng.core.record_read(GROUP, usable)
    eng.give_back(GROUP, BLOCKS)
    eng.spill_down(GROUP, Tier.HOST, BLOCKS)
    eng.core.fire(GROUP, eng.core.blocks_in(GROUP, "device"), Event.EVICT)
    eng.close()
    return eng, verdicts


def records(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A log's header and its records (the chain lines that close each write left out)."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return lines[0], [line for line in lines[1:] if line.get("type") != "chain"]


# -- the hook -------------------------------------------------------------------------------


def core() -> StateCore:
    return StateCore(DENSE, CoreConfig(device_blocks=4, host_blocks=4, backend="numpy"))


def written(c: StateCore, count: int) -> NDArray[np.intp]:
    keys = np.arange(1, count + 1, dtype=np.uint64)
    ids = c.allocate(GROUP, np.arange(count), keys, keys)
    c.fire(GROUP, ids, Event.WRITE_BEGIN)
    c.write(GROUP, ids, np.zeros((count, DENSE.group(GROUP).payload_bytes), dtype=np.uint8))
    c.fire(GROUP, ids, Event.WRITE_DONE)
    return ids


def test_an_observer_sees_every_batch_with_states_and_epochs_after_it_moved() -> None:
    c, seen = core(), Recorder()
    c.add_observer(seen)
    ids = written(c, 3)
    table = c.group(GROUP).table
    name = table.state_name
    assert [(e.spec_name, i, [name(s) for s in b], [name(s) for s in a], ep)
            for _, e, i, b, a, ep in seen.moves] == [
        ("allocate", ids.tolist(), ["free"] * 3, ["allocated"] * 3, [0] * 3),
        ("write_begin", ids.tolist(), ["allocated"] * 3, ["writing"] * 3, [1] * 3),
        ("write_done", ids.tolist(), ["writing"] * 3, ["device"] * 3, [2] * 3),
    ]
    c.group(GROUP).machine.fire(int(ids[0]), Event.SPILL_BEGIN)  # the scalar path too
    assert seen.moves[-1][1:4] == (Event.SPILL_BEGIN, [int(ids[0])],
                                   [table.state_id("device")])


def test_refused_ids_are_never_reported() -> None:
    c, seen = core(), Recorder()
    ids = written(c, 3)
    c.pin(GROUP, ids[:1])
    c.add_observer(seen)
    with pytest.raises(GuardRejected):
        c.fire(GROUP, ids, Event.EVICT)
    assert seen.moves == []  # all or nothing: nothing moved, nothing told
    moved = c.fire(GROUP, ids, Event.EVICT, masked=True)
    assert moved.tolist() == [False, True, True]
    assert [m[2] for m in seen.moves] == [ids[1:].tolist()]
    c.fire(GROUP, ids[:1], Event.EVICT, masked=True)  # pinned: none moves
    assert len(seen.moves) == 1


def test_a_move_nested_in_another_groups_effect_is_reported() -> None:
    """Evicting history blocks invalidates the index blocks pointing at them (an effect):
    that fire, in the index group, is reported too."""
    model = shipped_models()["deepseek_v4_like"]
    eng = Engine(model, CoreConfig(device_blocks=64, backend="numpy"))
    seen = Recorder()
    eng.core.add_observer(seen)
    prompt = eng.prompt(np.arange(4 * model.lcm_block_size + 1))
    eng.commit(prompt)
    index = next(g for g in eng.core.groups.values() if g.target is not None)
    target = index.target
    assert target is not None
    held = np.unique(index.refs_target[index.refs_target >= 0])
    eng.core.fire(target.name, held, Event.EVICT, masked=True)
    assert any(group == index.name and event is Event.INVALIDATE
               for group, event, *_ in seen.moves)
    eng.close()


def test_observers_are_added_once_and_removed() -> None:
    c, seen = core(), Recorder()
    c.add_observer(seen)
    with pytest.raises(KvfsmError, match="already attached"):
        c.add_observer(seen)
    c.remove_observer(seen)
    with pytest.raises(KvfsmError, match="not attached"):
        c.remove_observer(seen)
    written(c, 2)
    assert seen.moves == []


def test_record_read_reports_current_epochs_and_changes_nothing() -> None:
    c, seen = core(), Recorder()
    ids = written(c, 2)
    c.add_observer(seen)
    before = c.group(GROUP).states.copy()
    c.record_read(GROUP, ids)
    assert seen.reads == [(GROUP, ids.tolist(), [2, 2])]
    assert (c.group(GROUP).states == before).all() and seen.moves == []
    with pytest.raises(KvfsmError, match="block ids must lie in"):
        c.record_read(GROUP, [99])
    with pytest.raises(KvfsmError, match="no group"):
        c.record_read("nope", ids)
    assert len(seen.reads) == 1


# -- the log ----------------------------------------------------------------------------------


def test_a_real_engine_run_is_logged_and_replays_clean(tmp_path: Path) -> None:
    log_path = tmp_path / "events.jsonl"
    seen = Recorder()
    with EventLog(log_path, flush_every=3) as log:
        eng, _ = run_workload(tmp_path, event_log=log)
        eng.core.add_observer(seen)  # only to compare the log with; after the run: nothing
    head, lines = records(log_path)
    assert head["model"] == "dense"
    group = head["groups"][GROUP]
    assert group["lifecycle"] == "full_kv"
    assert group["table"] == table_digest(eng.core.group(GROUP).table)
    assert group["slots"] == {"device": 2 * BLOCKS, "host": BLOCKS}
    assert group["copies"] == {"disk": 8 * BLOCKS}
    assert group["blocks"] == eng.core.group(GROUP).n_blocks
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    moves = {(m["from"][i], m["event"], m["to"][i]) for m in lines if m["type"] == "move"
             for i in range(len(m["ids"]))}
    for step in [("device", "spill_begin", "spilling_host"), ("host", "spill_begin",
                 "spilling_disk"), ("spilling_disk", "spill_done", "disk"),
                 ("restoring_disk", "restore_done", "device_disk"),
                 ("restoring_host", "restore_done", "device"), ("device", "evict", "free")]:
        assert step in moves, step
    assert sum(line["type"] == "read" for line in lines) == 2
    result = replay(log_path)
    assert result.accepted, result.violation
    assert result.lines == len(log_path.read_text().splitlines())  # header, records, chains
    assert result.blocks_moved == sum(len(m["ids"]) for m in lines if m["type"] == "move")


def test_every_move_the_core_made_is_a_line(tmp_path: Path) -> None:
    """The log holds exactly what an observer attached beside it saw, in the same order."""
    seen = Recorder()

    class Both(EventLog):
        def moved(self, *args: Any) -> None:
            seen.moved(*args)
            super().moved(*args)

    with Both(tmp_path / "log.jsonl") as log:
        run_workload(tmp_path, event_log=log)
    _, lines = records(tmp_path / "log.jsonl")
    moves = [line for line in lines if line["type"] == "move"]
    assert [(m["group"], m["event"], m["ids"], m["epochs"]) for m in moves] == [
        (g, e.spec_name, i, ep) for g, e, i, _, _, ep in seen.moves]


def test_records_are_written_in_batches(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    c = core()
    log = EventLog(path, flush_every=5)
    log.attach(c)
    written(c, 1)  # three batches and a write: still buffered, the header with them
    assert path.read_text() == ""
    assert log.write_seconds == 0.0  # nothing written yet: nothing spent writing
    written(c, 1)  # the fifth record writes five lines, then the chain line closing them
    assert len(path.read_text().splitlines()) == 1 + 5 + 1
    after_one = log.write_seconds
    assert after_one > 0
    c.record_read(GROUP, [0])
    log.flush()
    assert len(path.read_text().splitlines()) == 1 + 5 + 1 + 4 + 1
    assert log.write_seconds > after_one
    after_flush = log.write_seconds
    log.flush()  # nothing buffered: no write, no time
    assert log.write_seconds == after_flush
    log.close()
    log.close()  # again: nothing
    written(c, 1)  # not observed any more
    assert len(path.read_text().splitlines()) == 1 + 5 + 1 + 4 + 1
    assert replay(path).accepted


def test_a_log_attached_to_a_used_core_starts_from_its_states(tmp_path: Path) -> None:
    c = core()
    ids = written(c, 3)
    c.fire(GROUP, ids[:1], Event.EVICT)
    c.pin(GROUP, ids[2:])  # held when the log attaches: its give-back replays from there
    with EventLog(tmp_path / "log.jsonl") as log:
        log.attach(c)
        c.fire(GROUP, ids[1:], Event.SPILL_BEGIN)
        c.unpin(GROUP, ids[2:])
    head, lines = records(tmp_path / "log.jsonl")
    assert head["groups"][GROUP]["start"] == {
        "ids": ids.tolist(), "states": ["free", "device", "device"], "epochs": [3, 2, 2],
        "pins": [0, 0, 1]}
    assert lines[-1] == {"seq": 1, "type": "pin", "group": GROUP, "delta": -1,
                         "ids": ids[2:].tolist()}
    assert replay(tmp_path / "log.jsonl").accepted


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(KvfsmError, match="flush_every must be an int >= 1"):
            EventLog(tmp_path / "x.jsonl", flush_every=bad)  # type: ignore[arg-type]
    assert FLUSH_EVERY >= 1
    c = core()
    log = EventLog(tmp_path / "log.jsonl")
    log.attach(c)
    with pytest.raises(KvfsmError, match="already attached"):
        log.attach(core())
    log.close()
    with pytest.raises(KvfsmError, match="closed"):
        log.attach(core())
    with pytest.raises(OSError):
        EventLog(tmp_path / "missing" / "log.jsonl")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failing_write_never_fails_a_move_and_is_raised_by_flush() -> None:
    c = core()
    log = EventLog("/dev/full", flush_every=1)
    log.attach(c)
    ids = written(c, 2)  # every batch tries to write; the disk is full
    assert c.describe(GROUP, int(ids[0])).state == "device"
    with pytest.raises(OSError):
        log.flush()
    with pytest.raises(OSError):
        log.close()  # the buffered header and lines cannot be written either
    assert log.closed
    written(c, 1)  # detached: moves go on


def _general_read(seq: int, group: str, ids: NDArray[np.intp],
                  epochs: NDArray[np.uint32]) -> dict[str, Any]:
    line: dict[str, Any] = {"seq": seq, "type": "read", "group": group}
    _put_runs(line, "ids", ids, step=1)
    _put_runs(line, "epochs", epochs, step=0)
    return line


@pytest.mark.parametrize(("ids", "epochs"), [
    (np.arange(5, 8197), np.full(8192, 3)),  # a lease's usual read: one run of each
    (np.arange(5, 8197), np.r_[np.full(8191, 3), 4]),  # one block at another epoch
    (np.r_[np.arange(5, 100), np.arange(200, 300)], np.full(195, 1)),  # two runs of ids
    (np.array([9, 4]), np.array([1, 1])),  # too short for runs to be shorter
    (np.array([4, 5, 6]), np.array([2, 2, 2])),
])
def test_a_read_line_is_what_the_general_formatter_writes(ids: NDArray[Any],
                                                          epochs: NDArray[Any]) -> None:
    """A read of consecutive ids at one epoch is formatted without building the line as a
    dict (the path every lease validation takes); whichever path formats a read, the line
    parses to what the general formatter makes of it."""
    ids, epochs = ids.astype(np.intp), epochs.astype(np.uint32)
    line = _one_run_line(7, json.dumps("index"), ids, epochs, np.empty(2, dtype=np.int64)) \
        or _read_line(7, "index", ids, epochs)
    assert json.loads(line) == _general_read(7, "index", ids, epochs)


@pytest.mark.parametrize("count", [1, 2, 3, 500])
def test_a_read_told_as_one_run_is_written_as_the_arrays_would_be(count: int) -> None:
    """An observer told ``read_runs`` (a lease that found its ids consecutive at one epoch)
    writes the very line the arrays would have made."""
    ids = np.arange(40, 40 + count, dtype=np.intp)
    epochs = np.full(count, 6, dtype=np.uint32)
    line = run_read_line(3, json.dumps("swa"), 40, count, 6)
    assert json.loads(line) == _general_read(3, "swa", ids, epochs)


class RunRecorder(Recorder):
    """A recorder that also takes reads told as runs (``read_runs``), call by call."""

    def __init__(self) -> None:
        super().__init__()
        self.run_calls: list[list[tuple[str, int, int, int]]] = []

    def read_runs(self, runs: list[tuple[str, int, int, int]]) -> None:
        self.run_calls.append(list(runs))


def _committed_with(*observers: Any) -> tuple[Engine, Any]:
    """A DeepSeek-style engine telling ``observers``, with a committed prompt of 1 025 tokens
    (each group's blocks one run of ids)."""
    eng = Engine(shipped_models()["deepseek_v4_like"],
                 CoreConfig(device_blocks=256, host_blocks=0, backend="numpy"))
    for observer in observers:
        eng.core.add_observer(observer)
    prompt = eng.prompt(np.arange(1025))
    eng.commit(prompt)
    return eng, prompt


def test_a_validated_lease_tells_each_observer_its_reads_in_the_form_it_takes() -> None:
    """A validated lease over several groups tells an observer that takes runs all of its
    runs in one call, and one that takes only arrays each group's ids and epochs: the same
    reads either way."""
    plain, runs = Recorder(), RunRecorder()
    eng, prompt = _committed_with(plain, runs)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
    held = {group: (lease.blocks(group).tolist(), lease.epochs(group).tolist())
            for group in lease.groups}
    assert {group: (ids, epochs) for group, ids, epochs in plain.reads} == held
    assert runs.reads == [] and len(runs.run_calls) == 1
    assert {group: (list(range(first, first + count)), [epoch] * count)
            for group, first, count, epoch in runs.run_calls[0]} == held


def test_a_leased_read_is_logged_as_runs_and_replays(tmp_path: Path) -> None:
    """A lease over a committed prompt reports its reads as runs: the log holds one line for
    the lease's take, read and give-back (nothing logged between them), a run of ids at one
    epoch per group, and replays clean."""
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        eng = Engine(shipped_models()["dense"], CoreConfig(device_blocks=256, host_blocks=0,
                                                           backend="numpy"), event_log=log)
        prompt = eng.prompt(np.arange(161))
        eng.commit(prompt)
        with eng.lease(eng.lookup(prompt), prompt) as lease:
            lease.validate()
        eng.close()
    reads = [json.loads(line) for line in path.read_text().splitlines()[1:]
             if json.loads(line)["type"] in ("read", "reads", "take", "take_read", "lease",
                                             "give_back")]
    assert [r["type"] for r in reads] == ["lease"]
    assert [r["runs"] for r in reads] == [
        [["attn", int(lease.blocks("attn")[0]), 10, int(lease.epochs("attn")[0])]]]
    result = replay(path)
    assert result.accepted and result.reads == 1


def test_lease_reads_buffered_among_moves_are_written_in_order(tmp_path: Path) -> None:
    """A validated lease's reads (one run per group, buffered as numbers) and the moves
    around them reach the file in the order they happened, numbered one by one, each lease's
    line naming every group it read, in one batch write; the log replays clean."""
    path = tmp_path / "log.jsonl"
    with EventLog(path, flush_every=100_000) as log:
        eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, backend="numpy"),
                     event_log=log)
        for seed in (1, 2):
            prompt = eng.prompt(np.random.default_rng(seed).integers(0, 50_000, 161))
            eng.commit(prompt)  # moves
            with eng.lease(eng.lookup(prompt), prompt) as lease:
                lease.validate()  # a read line per group
        eng.close()
    _, lines = records(path)
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    kinds = [line["type"] for line in lines]
    assert kinds.index("lease") < len(kinds) - 1 - kinds[::-1].index("move")  # interleaved
    reads = [line for line in lines if line["type"] == "lease"]
    assert [[run[0] for run in line["runs"]] for line in reads] == [
        ["history", "swa", "index"]] * 2
    assert "read" not in kinds
    assert replay(path).accepted


def test_an_observer_without_read_runs_is_told_a_leases_runs_as_arrays() -> None:
    """A one-pass lease reports its reads as runs; an observer that only has ``read`` gets
    each run as its ids and epochs, once, as an event log gets it as a run."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, backend="numpy"))
    seen = Recorder()
    eng.core.add_observer(seen)
    prompt = eng.prompt(np.random.default_rng(3).integers(0, 50_000, 161))
    eng.commit(prompt)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
        expected = [(group, lease.blocks(group).tolist(), lease.epochs(group).tolist())
                    for group in lease.groups]
    assert seen.reads == expected


class MovesOnly(Recorder):
    """A recorder that says it takes no reads (as the metrics do)."""

    observes_reads = False

    def read(self, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> None:
        raise AssertionError("an observer that takes no reads was told of one")


def test_an_observer_that_takes_no_reads_is_told_only_of_moves() -> None:
    """An observer saying ``observes_reads = False`` sees every move but no read, reported or
    leased; with only such observers attached the core says no reads are observed (a lease
    then gathers none), and one that takes reads attached beside it is told as before."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, backend="numpy"))
    moves = MovesOnly()
    eng.core.add_observer(moves)
    assert eng.core.observed and not eng.core.reads_observed
    prompt = eng.prompt(np.random.default_rng(4).integers(0, 50_000, 161))
    eng.commit(prompt)
    assert moves.moves  # the commit's moves
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
    eng.core.record_read("swa", lease.blocks("swa"))
    seen = Recorder()
    eng.core.add_observer(seen)
    assert eng.core.reads_observed
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
    assert [group for group, _, _ in seen.reads] == list(lease.groups)
    eng.core.remove_observer(seen)
    assert not eng.core.reads_observed


class AnswerRecorder(RunRecorder):
    """A recorder that also takes a lease's reads as its take's answer rows."""

    def __init__(self) -> None:
        super().__init__()
        self.answer_calls: list[tuple[tuple[str, ...], list[list[int]], int]] = []

    def read_answer_runs(self, names: tuple[str, ...], answers: NDArray[np.int64],
                         count: int) -> None:
        self.answer_calls.append((names, answers.tolist(), count))


def _two_run_engine(**observers: Any) -> tuple[Engine, Any]:
    """A dense engine whose last prompt was committed while making room: its blocks are
    two runs of ids (not one), the oldest prompt's one run given back whole (ids 0-119;
    a younger prompt holds 120-159)."""
    eng = Engine(shipped_models()["dense"],
                 CoreConfig(device_blocks=200, host_blocks=0, backend="numpy"), **observers)
    eng.commit(eng.prompt(np.random.default_rng(1).integers(0, 50_000, 1921)))
    eng.commit(eng.prompt(np.random.default_rng(3).integers(0, 50_000, 641)))
    second = eng.prompt(np.random.default_rng(2).integers(0, 50_000, 2561))
    assert eng.commit(second)["attn"].tolist() == list(range(120)) + list(range(160, 200))
    return eng, second


def test_a_lease_of_one_run_per_group_is_told_as_its_answer_rows() -> None:
    """A validated lease whose every group holds one run at one epoch is told to an observer
    taking answer rows in one call (names, rows, groups holding blocks), and to one taking
    runs or arrays as before: the same blocks at the same epochs; a lease of two runs in a
    group is told as arrays to every observer (never as rows that would misstate it)."""
    rows, plain = AnswerRecorder(), Recorder()
    eng, prompt = _committed_with(rows, plain)
    _, lease = eng.lookup_and_lease(prompt)
    with lease:
        lease.validate()
    held = {group: (lease.blocks(group).tolist(), lease.epochs(group).tolist())
            for group in lease.groups}
    ((names, answers, count),) = rows.answer_calls
    assert names == tuple(lease.groups) and count == len(held)
    told = {names[g]: (list(range(row[FIRST_ID], row[FIRST_ID] + row[HI] - row[LO])),
                       [row[FIRST_EPOCH]] * (row[HI] - row[LO])) for g, row in enumerate(answers)}
    assert told == held
    assert {group: (ids, epochs) for group, ids, epochs in plain.reads} == held
    assert rows.reads == [] and rows.run_calls == []

    two, second = _two_run_engine()
    rows, plain = AnswerRecorder(), Recorder()
    two.core.add_observer(rows)
    two.core.add_observer(plain)
    _, lease = two.lookup_and_lease(second)
    with lease:
        lease.validate()
        expected = [("attn", lease.blocks("attn").tolist(), lease.epochs("attn").tolist())]
    assert rows.answer_calls == [] and rows.reads == plain.reads == expected


def test_leases_told_as_answer_rows_are_logged_as_runs_in_order(tmp_path: Path) -> None:
    """A log buffering leases' answer rows among moves and other reads writes each lease's
    runs as the line its runs make, every line numbered in turn: the same lines as a log
    told the reads as a list of runs (which cannot tell they are the take's: a take line, a
    reads line and a give_back line where the rows make one lease line, or a take_read line
    where a batch ended before the give-back), and it replays clean."""
    paths = [tmp_path / "rows.jsonl", tmp_path / "runs.jsonl"]

    class RunsOnly(EventLog):
        read_answer_runs = None  # type: ignore[assignment]

    for path, kind in zip(paths, (EventLog, RunsOnly), strict=True):
        with kind(path, flush_every=7) as log:
            eng, second = _two_run_engine(event_log=log)
            for _ in range(3):
                _, lease = eng.lookup_and_lease(second)  # two runs: told as arrays
                with lease:
                    lease.validate()
                third = eng.prompt(np.random.default_rng(3).integers(0, 50_000, 161))
                eng.commit(third)  # moves
                _, lease = eng.lookup_and_lease(third)  # one run: told as rows
                with lease:
                    lease.validate()
            log.flush()
            assert log.records == len(records(path)[1])  # the lines besides header and chains
            eng.close()
    _, lines = records(paths[0])
    assert _leases_split(lines) == records(paths[1])[1]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    kinds = [line["type"] for line in lines]
    assert kinds.count("read") == 3  # two runs, then one
    assert kinds.count("lease") + kinds.count("take_read") + kinds.count("take") == 3
    assert "lease" in kinds
    assert all(replay(path).accepted for path in paths)


def _leases_split(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lines`` with each take_read line split into a take line and a reads line of its
    runs, and each lease line into those and a give_back line naming the take, renumbered
    (a give_back naming its take's new number): what a log writes where nothing joins."""
    split: list[dict[str, Any]] = []
    renumbered: dict[int, int] = {}

    def add(line: dict[str, Any]) -> None:
        split.append({**line, "seq": len(split)})

    for line in lines:
        renumbered[line["seq"]] = len(split)
        kind = line["type"]
        if kind in ("take_read", "lease"):
            add({**line, "type": "take"})
            add({**line, "type": "reads"})
            if kind == "lease":
                add({"type": "give_back", "take": renumbered[line["seq"]]})
            continue
        if kind == "give_back":
            line = {**line, "take": renumbered[line["take"]]}
        add(line)
    return split
