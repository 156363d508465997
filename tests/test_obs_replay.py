"""Replaying an event log: a real engine run is accepted; every kind of tampering is rejected
at the line it happened on, by the check it breaks, with a message and never a traceback."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvfsm import CoreConfig, Engine, EventLog, parse_lifecycle, shipped_lifecycles
from kvfsm.obs import CHECKS, ReplayResult, replay
from kvfsm.obs._eventlog import VERSION
from kvfsm.spec import Event, shipped_specs_dir
from tests.test_obs_eventlog import GROUP, core, records, run_workload, written

FULL_KV_TEXT = (shipped_specs_dir() / "lifecycles" / "full_kv.toml").read_text()
#: full_kv with one row changed: evicting a device block needs no free pins (a valid spec).
UNGUARDED_EVICT = FULL_KV_TEXT.replace('event = "evict"\ndest = "free"\nguards = ["no_pins"]\n',
                                       'event = "evict"\ndest = "free"\n', 1)

Record = dict[str, Any]


@pytest.fixture
def logged(tmp_path: Path) -> tuple[Record, list[Record]]:
    """The header and records of a real engine run (spills to host and disk, restores from
    both, reads, evictions)."""
    with EventLog(tmp_path / "run.jsonl", flush_every=5) as log:
        run_workload(tmp_path, event_log=log)
    assert replay(tmp_path / "run.jsonl").accepted
    return records(tmp_path / "run.jsonl")


def chained(head: Record, lines: list[Record]) -> str:
    """The text of a log of ``head`` and ``lines``, chained as a writer chains one write: one
    chain line at the end, the xxh3-128 of the header line's xxh3-128 and the lines' bytes
    (what a forger who knew the scheme would write: the checks below still catch the edit,
    each at its own line)."""
    first = json.dumps(head) + "\n"
    body = "".join(json.dumps(r) + "\n" for r in lines)
    digest = xxhash.xxh3_128_digest(xxhash.xxh3_128_digest(first.encode()) + body.encode())
    end = json.dumps({"type": "chain", "lines": len(lines), "digest": digest.hex()})
    return first + body + end + "\n"


def write(path: Path, head: Record, lines: list[Record], *, chain: bool = True) -> Path:
    """``head`` and ``lines`` as a log file, chained (as version 4 logs are) unless ``chain``
    is False (older versions)."""
    text = chained(head, lines) if chain else \
        "\n".join(json.dumps(r) for r in [head, *lines]) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def tamper(tmp_path: Path, logged: tuple[Record, list[Record]],
           edit: Callable[[Record, list[Record]], int]) -> tuple[ReplayResult, int]:
    """Replay the run after ``edit`` changed a copy of it; ``edit`` returns the index of the
    record it broke, whose file line (the header is line 1) is returned with the result."""
    head, lines = copy.deepcopy(logged)
    index = edit(head, lines)
    return replay(write(tmp_path / "tampered.jsonl", head, lines)), index + 2


def first(lines: list[Record], event: str, source: str | None = None) -> int:
    """Index of the first move record of ``event`` (from ``source``)."""
    return next(i for i, r in enumerate(lines) if r["type"] == "move" and r["event"] == event
                and (source is None or r["from"][0] == source))


def rejected(result: ReplayResult, line: int, check: str, *words: str) -> None:
    assert result.violation is not None, "accepted"
    assert (result.violation.line, result.violation.check) == (line, check), result.violation
    for word in words:
        assert word in result.violation.message, result.violation
    assert not result.accepted


# -- each check -----------------------------------------------------------------------------


def test_an_event_without_a_row_from_the_logged_state(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "write_done")
        lines[i]["event"] = "restore_done"  # writing has no restore_done row
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "no_row", "no row for restore_done from 'writing'")


def test_a_from_state_the_replay_does_not_have(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "spill_begin", "device")
        lines[i]["from"][0] = "host"  # a row exists (host -> spilling_disk), the block is not
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "from_state", "logged from 'host'", "replay has it in 'device'")


def test_a_to_state_that_is_not_the_rows_destination(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "write_done")
        lines[i]["to"][1] = "host"
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "to_state", "table moves it to 'device'")


def test_a_wrong_epoch(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "restore_done", "restoring_disk")  # bumps once
        lines[i]["epochs"][0] -= 1
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "epoch", "bumps it 1 time(s)")


def test_an_epoch_moved_by_a_row_that_does_not_bump_it(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "spill_begin", "device")  # take_slot, copy_to: no bump
        lines[i]["epochs"][0] += 1
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "epoch", "bumps it 0 time(s)")


def _last_epoch_back(record: Record) -> None:
    """The last epoch of a read one lower, in whichever spelling the log used."""
    if "epochs" in record:
        record["epochs"][-1] -= 1
        return
    value, count = record["epochs_runs"][-1]
    record["epochs_runs"][-1:] = [[value, count - 1], [value - 1, 1]] if count > 1 \
        else [[value - 1, 1]]


def test_a_read_at_an_epoch_the_block_has_left(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = next(i for i, r in enumerate(lines) if r["type"] == "read")
        _last_epoch_back(lines[i])
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "read", "content is at epoch", "(it changed)")


def test_a_long_read_is_written_as_runs_and_replays(tmp_path: Path) -> None:
    """A read of consecutive blocks at one epoch (a lease's blocks) is logged as runs, which
    replay reads back exactly: one epoch moved inside a run is still caught."""
    c = core()
    ids = written(c, 4)
    with EventLog(tmp_path / "log.jsonl") as log:
        log.attach(c)
        c.record_read(GROUP, ids)
    record = records(tmp_path / "log.jsonl")[1][-1]
    assert record["ids_runs"] == [[int(ids[0]), 4]] and "ids" not in record
    assert record["epochs_runs"] == [[int(c.group(GROUP).epoch[ids[0]]), 4]]
    assert replay(tmp_path / "log.jsonl").accepted


@pytest.mark.parametrize("runs, why", [
    ([[0, 10**9]], "count"),
    ([[0, 0]], "count"),
    ([[5, 2, 1]], "pair"),
    ([[10**6, 1]], "integer in"),
])
def test_malformed_runs_are_refused_before_they_are_expanded(
        tmp_path: Path, runs: list[list[int]], why: str) -> None:
    c = core()
    ids = written(c, 4)
    with EventLog(tmp_path / "log.jsonl") as log:
        log.attach(c)
        c.record_read(GROUP, ids)
    head, lines = records(tmp_path / "log.jsonl")
    lines[-1]["ids_runs"] = runs
    result = replay(write(tmp_path / "log.jsonl", head, lines))
    assert result.violation is not None and why in result.violation.message, result


def test_a_read_of_a_block_a_kernel_may_not_read(tmp_path: Path) -> None:
    """The core reports what it is told; replay finds a read of a spilled block."""
    c = core()
    ids = written(c, 2)
    with EventLog(tmp_path / "log.jsonl") as log:
        log.attach(c)
        c.record_read(GROUP, ids)
        c.fire(GROUP, ids[:1], Event.SPILL_BEGIN)
        c.fire(GROUP, ids[:1], Event.SPILL_DONE)
        c.record_read(GROUP, ids)  # block 0 is on the host now
    result = replay(tmp_path / "log.jsonl")
    rejected(result, 5, "read", f"block {ids[0]} read in state 'host'")


@pytest.fixture
def leased(tmp_path: Path) -> tuple[Record, list[Record]]:
    """The header and records of a DeepSeek-style engine's commit and a lease validated
    twice: its take and first read are one take_read line, its second read a reads line, a
    run per group each, and its give-back a give_back line naming the take."""
    path = tmp_path / "leased.jsonl"
    with EventLog(path) as log:
        eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, backend="numpy"),
                     event_log=log)
        prompt = eng.prompt(np.random.default_rng(5).integers(0, 50_000, 161))
        eng.commit(prompt)
        _, lease = eng.lookup_and_lease(prompt)
        with lease:
            lease.validate()
            lease.validate()
        eng.close()
    assert replay(path).reads == 2 * 3
    head, lines = records(path)
    assert [r["type"] for r in lines if r["type"] not in ("move", "write", "refs")] == \
        ["take_read", "reads", "give_back"]
    return head, lines


def _reads(lines: list[Record], kind: str = "reads") -> int:
    return next(i for i, r in enumerate(lines) if r["type"] == kind)


def test_a_leases_run_read_at_an_epoch_the_block_has_left(tmp_path: Path, leased: Any
                                                          ) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = _reads(lines)
        lines[i]["runs"][1][3] += 1
        return i

    result, line = tamper(tmp_path, leased, edit)
    rejected(result, line, "read", "group 'swa'", "content is at epoch", "(it changed)")


def test_a_leases_run_over_a_block_a_kernel_may_not_read(tmp_path: Path, leased: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = _reads(lines)
        run = lines[i]["runs"][0]
        run[2] += 1  # one block past the run: never written, still free
        return i

    result, line = tamper(tmp_path, leased, edit)
    rejected(result, line, "read", "group 'history'", "read in state 'free'")


def test_a_take_of_blocks_at_an_epoch_they_are_not_at_or_not_readable(tmp_path: Path,
                                                                      leased: Any) -> None:
    """A take names the epoch of the blocks it pins: another epoch, or a block past the run
    (free), is refused at the take line."""
    def later(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "take_read")
        lines[i]["runs"][1][3] += 1
        return i

    result, line = tamper(tmp_path, leased, later)
    rejected(result, line, "pin", "group 'swa'", "taken at epoch", "content is at epoch")

    def longer(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "take_read")
        lines[i]["runs"][0][2] += 1  # one block past the run: never written, still free
        return i

    result, line = tamper(tmp_path, leased, longer)
    rejected(result, line, "pin", "group 'history'", "pinned in state 'free'")


def test_a_take_reads_checks_its_read(tmp_path: Path, leased: Any) -> None:
    """A take_read line's read is checked as a read: a check_failed line before it at the
    epoch of one of its blocks makes it a read where a lookup saw the block fail."""
    def failed_before(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "take_read")
        group, first, _, epoch = lines[i]["runs"][0]
        lines.insert(i, {"seq": i, "type": "check_failed", "group": group, "ids": [first],
                         "epochs": [epoch]})
        for seq, record in enumerate(lines):
            record["seq"] = seq
        back = _reads(lines, "give_back")
        lines[back]["take"] += 1
        return i + 1

    result, line = tamper(tmp_path, leased, failed_before)
    rejected(result, line, "failed_read", "group 'history'", "fail its checksum")


def test_a_give_back_naming_no_open_take_is_refused(tmp_path: Path, leased: Any) -> None:
    """A give_back must name an open take line: one naming a move line, a line not yet
    written, or a take given back already is refused at the give_back line; the real one is
    accepted (the fixture replays clean)."""
    def not_a_take(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "give_back")
        lines[i]["take"] = 0  # the commit's first move
        return i

    def not_yet(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "give_back")
        lines[i]["take"] = lines[i]["seq"] + 1
        return i

    def twice(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "give_back")
        lines.insert(i + 1, {**lines[i], "seq": lines[i]["seq"] + 1})
        for seq, record in enumerate(lines[i + 2:], lines[i]["seq"] + 2):
            record["seq"] = seq
        return i + 1

    for edit in (not_a_take, not_yet, twice):
        result, line = tamper(tmp_path, leased, edit)
        rejected(result, line, "give_back", "gives back take", "no open lease take")


@pytest.mark.parametrize("runs, why", [
    ([], "no runs"),
    ([["history", 0, 1]], "not [group, first id, count, epoch]"),
    ([[0, 0, 1, 0]], "not [group, first id, count, epoch]"),
    ("history", "not a list"),
    ([["nope", 0, 1, 0]], "unknown group 'nope'"),
    ([["history", 0, 0, 0]], "count"),
    ([["history", 0, 10**9, 0]], "count"),
    ([["history", 10**6, 1, 0]], "integer in"),
    ([["history", 60, 5, 0]], "leaves"),
    ([["history", 0, 1, -1]], "epoch"),
    ([["history", 0, 1, True]], "epoch"),
])
def test_a_malformed_leases_reads_line_is_refused(tmp_path: Path, leased: Any, runs: Any,
                                                  why: str) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = _reads(lines)
        lines[i]["runs"] = runs
        return i

    result, line = tamper(tmp_path, leased, edit)
    rejected(result, line, "malformed", why)


def _before_version_5(head: Record, lines: list[Record]) -> list[Record]:
    """``lines`` as a writer before version 5 wrote them: no pin, pins, check_failed, write
    or refs lines (the rest renumbered), no pins in the header's start."""
    for entry in head["groups"].values():
        del entry["start"]["pins"]
    kept = [r for r in lines if r["type"] in ("move", "read", "reads")]
    for seq, record in enumerate(kept):
        record["seq"] = seq
    return kept


def test_a_version_2_log_replays(tmp_path: Path, logged: Any) -> None:
    """Logs written before a lease's reads shared a line (a read line per group) replay."""
    head, lines = copy.deepcopy(logged)
    assert head["version"] == VERSION and any(r["type"] == "read" for r in lines)
    lines = _before_version_5(head, lines)
    head["version"] = 4  # chained, no pin lines
    assert replay(write(tmp_path / "old4.jsonl", head, lines)).accepted
    for version in (2, 3):  # before chain lines
        head["version"] = version
        assert replay(write(tmp_path / "old.jsonl", head, lines, chain=False)).accepted


def test_more_blocks_in_a_tier_than_its_slots(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        head["groups"][GROUP]["slots"]["host"] = 3  # the run spills four blocks at once
        return first(lines, "spill_begin", "device")

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "capacity", "4 blocks hold a host slot", "capacity of 3")


def test_more_copies_in_a_stored_tier_than_it_may_hold(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        head["groups"][GROUP]["copies"]["disk"] = 2
        return first(lines, "spill_begin", "host")

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "capacity", "hold a disk slot or copy", "capacity of 2")


def test_a_log_of_other_tables_is_refused_at_its_header(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        head["groups"][GROUP]["table"] = "0" * 64
        return -1

    result, _ = tamper(tmp_path, logged, edit)
    rejected(result, 1, "header", "other 'full_kv' tables", "--lifecycle full_kv=PATH")


def test_other_tables_given_for_replay_are_refused(tmp_path: Path, logged: Any) -> None:
    path = write(tmp_path / "log.jsonl", *logged)
    assert UNGUARDED_EVICT != FULL_KV_TEXT
    other = parse_lifecycle(UNGUARDED_EVICT)
    rejected(replay(path, {"full_kv": other}), 1, "header", "other 'full_kv' tables")
    docs_only = parse_lifecycle(FULL_KV_TEXT.replace("A full-attention KV block.", "Docs."))
    assert replay(path, {"full_kv": docs_only}).accepted  # the digest is of the table alone


def test_a_custom_lifecycle_replays_with_its_own_table(tmp_path: Path) -> None:
    """A core built on a custom full_kv logs a run the shipped table refuses and the custom
    one accepts."""
    from kvfsm import CoreConfig, StateCore, shipped_models

    custom = parse_lifecycle(UNGUARDED_EVICT)
    c = StateCore(shipped_models()["dense"], CoreConfig(device_blocks=4, backend="numpy"),
                  lifecycles={**shipped_lifecycles(), "full_kv": custom})
    with EventLog(tmp_path / "log.jsonl") as log:
        log.attach(c)
        written(c, 2)
    assert replay(tmp_path / "log.jsonl", {"full_kv": custom}).accepted
    rejected(replay(tmp_path / "log.jsonl"), 1, "header")


def test_a_missing_line_breaks_the_sequence(tmp_path: Path, logged: Any) -> None:
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "write_begin")
        del lines[i]
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "sequence", f"expected {line - 2}")


# -- lines that are not records ---------------------------------------------------------------


@pytest.mark.parametrize(("damage", "words"), [
    (lambda text: text[: len(text) // 2], "not JSON"),
    (lambda text: "{not json", "not JSON"),
    (lambda text: "", "an empty line"),
    (lambda text: "[1, 2]", "not an object"),
    (lambda text: text.replace('"ids"', '"idz"'), "no 'ids' field"),
    (lambda text: text.replace('"group": "attn"', '"group": "nope"'), "unknown group 'nope'"),
    (lambda text: text.replace('"event": "write_begin"', '"event": "jump"'),
     "unknown event 'jump'"),
    (lambda text: text.replace('"allocated"', '"limbo"', 1), "names 'limbo', not a state"),
    (lambda text: text.replace('"seq": ', '"seq": "x", "was": '), "not an integer"),
    (lambda text: text.replace('"ids": [', '"ids": [-1, '), "not an integer in"),
    (lambda text: text.replace('"type": "move"', '"type": "jump"'), "type 'jump'"),
    (lambda text: text.replace('"epochs": [', '"epochs": [1, '), "'epochs' for"),
    (lambda text: text.replace('"from": [', '"from": 7, "was": ['), "not a list"),
    (lambda text: text.replace('"from": [', '"from": ["allocated", '), "'from' for"),
    (lambda text: text.replace('"ids": [0, ', '"ids": [1, '), "block ids repeat"),
])
def test_a_malformed_line_is_reported_with_its_number(tmp_path: Path, logged: Any,
                                                      damage: Callable[[str], str],
                                                      words: str) -> None:
    head, lines = logged
    i = first(lines, "write_begin")
    path = write(tmp_path / "log.jsonl", head, lines)
    text = path.read_text().splitlines()
    text[i + 1] = damage(text[i + 1])
    path.write_text("\n".join(text) + "\n")
    rejected(replay(path), i + 2, "malformed", words)


def test_a_line_that_is_not_utf8(tmp_path: Path, logged: Any) -> None:
    path = write(tmp_path / "log.jsonl", *logged)
    data = path.read_bytes().split(b"\n")
    data[3] = b"\xff\xfe" + data[3]
    path.write_bytes(b"\n".join(data))
    rejected(replay(path), 4, "malformed", "not UTF-8")


@pytest.mark.parametrize(("header", "words"), [
    ({"format": "something-else", "version": 1}, "not a kvfsm event log"),
    ({"format": "kvfsm-eventlog", "version": 99}, "version 99"),
])
def test_a_header_that_is_not_ours(tmp_path: Path, logged: Any, header: Record,
                                   words: str) -> None:
    head, lines = logged
    rejected(replay(write(tmp_path / "log.jsonl", {**head, **header}, lines)), 1, "header",
             words)


@pytest.mark.parametrize(("entry", "words"), [
    (5, "is not an object"),
    ({"blocks": 0}, "'blocks' must be >= 1"),
    ({"slots": {"moon": 3}}, "'moon': 3 is not a count of a tier"),
    ({"copies": {"disk": -1}}, "'disk': -1 is not a count of a tier"),
    ({"start": {"ids": [0], "states": ["device", "host"], "epochs": [1]}}, "2 'states' for 1"),
    ({"table": 7}, "'table' is 7, not a string"),
])
def test_a_malformed_group_header(tmp_path: Path, logged: Any, entry: Any, words: str) -> None:
    head, lines = copy.deepcopy(logged)
    group = head["groups"][GROUP]
    head["groups"][GROUP] = {**group, **entry} if isinstance(entry, dict) else entry
    rejected(replay(write(tmp_path / "log.jsonl", head, lines)), 1, "malformed", words)


def test_a_header_without_groups(tmp_path: Path, logged: Any) -> None:
    head, lines = logged
    rejected(replay(write(tmp_path / "log.jsonl", {**head, "groups": {}}, lines)), 1,
             "malformed", "no groups")


def test_a_move_of_no_blocks(tmp_path: Path, logged: Any) -> None:
    """The core never reports an empty batch; a line holding one was made by someone else."""
    def edit(head: Record, lines: list[Record]) -> int:
        i = first(lines, "write_begin")
        lines[i].update(ids=[], epochs=[], **{"from": [], "to": []})
        return i

    result, line = tamper(tmp_path, logged, edit)
    rejected(result, line, "malformed", "no ids")


def test_a_header_naming_an_unknown_lifecycle(tmp_path: Path, logged: Any) -> None:
    head, lines = copy.deepcopy(logged)
    head["groups"][GROUP]["lifecycle"] = "mystery"
    rejected(replay(write(tmp_path / "log.jsonl", head, lines)), 1, "header",
             "--lifecycle mystery=PATH")


def test_an_empty_file_has_no_header(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    rejected(replay(tmp_path / "empty.jsonl"), 1, "header", "empty file")


def test_an_unreadable_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        replay(tmp_path / "missing.jsonl")


def test_the_result_reports_counts_and_json(tmp_path: Path, logged: Any) -> None:
    head, lines = logged
    result = replay(write(tmp_path / "log.jsonl", head, lines))
    moves = [r for r in lines if r["type"] == "move"]
    reads = [r for r in lines if r["type"] == "read"]
    pins = sum(1 if r["type"] == "pin" else len(r["runs"]) for r in lines
               if r["type"] in ("pin", "pins"))
    assert (result.moves, result.reads, result.pins, result.lines) == \
        (len(moves), len(reads), pins, len(lines) + 2)  # header, chain
    assert result.to_json()["pins"] == pins
    assert result.to_json()["accepted"] is True
    assert result.summary().startswith("accepted ")
    assert set(CHECKS) >= {"no_row", "from_state", "to_state", "epoch", "read", "capacity"}
    assert np.isfinite(result.blocks_moved)


# -- the chain over the lines ---------------------------------------------------------------


def _raw(tmp_path: Path) -> list[str]:
    with EventLog(tmp_path / "run.jsonl", flush_every=5) as log:
        run_workload(tmp_path, event_log=log)
    return (tmp_path / "run.jsonl").read_text().splitlines()


def _replayed(tmp_path: Path, lines: list[str]) -> ReplayResult:
    (tmp_path / "edited.jsonl").write_text("\n".join(lines) + "\n")
    return replay(tmp_path / "edited.jsonl")


def test_a_dropped_and_renumbered_line_is_refused_by_the_chain(tmp_path: Path) -> None:
    """A line dropped and every later sequence number rewritten to match (so the sequence
    check cannot see it) is refused at the chain line closing that write."""
    lines = _raw(tmp_path)
    records_ = [json.loads(line) for line in lines]
    drop = next(i for i, r in enumerate(records_) if r.get("type") == "read")
    kept = lines[:drop] + lines[drop + 1:]
    renumbered = []
    for line in kept:
        record = json.loads(line)
        if "seq" in record and record["seq"] > records_[drop]["seq"]:
            record["seq"] -= 1
            line = json.dumps(record, separators=(",", ":"))
        renumbered.append(line)
    result = _replayed(tmp_path, renumbered)
    assert result.violation is not None and result.violation.check == "chain", result


def test_a_line_changed_in_place_or_a_log_cut_after_its_last_write_is_refused(
        tmp_path: Path) -> None:
    lines = _raw(tmp_path)
    record = json.loads(lines[2])
    record["epochs"] = record["epochs"]  # the same content, spelled another way
    changed = [*lines[:2], json.dumps(record), *lines[3:]]
    result = _replayed(tmp_path, changed)
    assert result.violation is not None and result.violation.check == "chain"
    cut = lines[:-1]  # the last chain line lost: its lines are vouched for by nothing
    result = _replayed(tmp_path, cut)
    assert result.violation is not None and result.violation.check == "chain"
    assert "covered by no chain line" in result.violation.message
    assert _replayed(tmp_path, lines).accepted


@pytest.fixture
def whole_lease(tmp_path: Path) -> tuple[Record, list[Record]]:
    """A DeepSeek-style engine's commit and a lease taken, validated once and given back with
    nothing logged between: one lease line, a run per group."""
    path = tmp_path / "whole.jsonl"
    with EventLog(path) as log:
        eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, backend="numpy"),
                     event_log=log)
        prompt = eng.prompt(np.random.default_rng(5).integers(0, 50_000, 161))
        eng.commit(prompt)
        _, lease = eng.lookup_and_lease(prompt)
        with lease:
            lease.validate()
        eng.close()
    result = replay(path)
    assert result.accepted and result.reads == 3 and result.pins == 2 * 3
    head, lines = records(path)
    assert [r["type"] for r in lines if r["type"] not in ("move", "write", "refs")] == ["lease"]
    return head, lines


def test_a_lease_line_is_checked_as_its_take_read_and_give_back(tmp_path: Path,
                                                                whole_lease: Any) -> None:
    """A lease line's take is checked (a run at an epoch its blocks are not at is refused),
    a block past the run (free) too, and it leaves no take open: a
    give_back naming it is refused."""
    def later(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "lease")
        lines[i]["runs"][2][3] += 1
        return i

    result, line = tamper(tmp_path, whole_lease, later)
    rejected(result, line, "pin", "group 'index'", "taken at epoch")

    def past_the_run(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "lease")
        # Pinned first, so the free block is refused as a pin of a block a kernel may not read.
        lines[i]["runs"][0][2] += 1
        return i

    result, line = tamper(tmp_path, whole_lease, past_the_run)
    rejected(result, line, "pin", "group 'history'", "state 'free'")

    def given_again(head: Record, lines: list[Record]) -> int:
        i = _reads(lines, "lease")
        lines.append({"seq": len(lines), "type": "give_back", "take": lines[i]["seq"]})
        return len(lines) - 1

    result, line = tamper(tmp_path, whole_lease, given_again)
    rejected(result, line, "give_back", "gives back take", "no open lease take")
