"""Replay an event log through the lifecycle tables and report the first line they refuse.

Every block starts free at epoch 0 (or where the header's ``start`` puts it). Each move line is
re-fired on the replayed states: the event must have a row from the logged from-state, the
from-state must be the replayed one, the to-state the row's destination, and the epochs must
move exactly as the row's ``bump_epoch`` effects say. A read must be of blocks a kernel may read
(``readable`` states) at their replayed epoch, and not at an epoch a lookup saw them fail their
checksum at. Pins are counted from the pin lines (version 5): a pin is of a readable block, a
lease's take of blocks at their replayed epochs, an unpin never takes a block below 0, a
give-back names an open take (one not given back yet), and no move gives up a block's device
slot or takes its content to a lower tier while a pin holds it. Writes and index references
land only on blocks being written. After every line, the blocks holding a slot or a copy in
each tier never exceed that tier's capacity from the header.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm.fsm import INVALID, compile_lifecycle
from kvfsm.obs._eventlog import (
    CHAIN,
    CHAINED_VERSION,
    CHECK_FAILED,
    FORMAT,
    GIVE_BACK,
    LEASE,
    MOVE,
    PIN,
    PINS,
    READ,
    READABLE_VERSIONS,
    READS,
    REFS,
    TAKE,
    TAKE_READ,
    WRITE,
    chain_digest,
    chain_start,
    table_digest,
)
from kvfsm.spec import Event, Lifecycle, Tier, shipped_lifecycles
from kvfsm.spec._vocabulary import EVENT_NAMES, TIER_NAMES

#: The effect that moves a block's epoch (once per naming in a row).
EPOCH_EFFECT: Final = "bump_epoch"
#: Epochs are uint32 in the core and wrap there.
_EPOCH_MODULUS: Final = 1 << 32

#: What a replay checks; a violation names one of these.
CHECKS: Final = (
    "malformed",   # not JSON, a missing or mistyped field, an unknown group, event or state
    "header",      # not a kvfsm event log, another version, tables other than the replay's
    "sequence",    # a sequence number out of order (lines missing, repeated or reordered)
    "no_row",      # the event has no row from the logged from-state
    "from_state",  # the logged from-state is not the block's replayed state
    "to_state",    # the logged to-state is not the row's destination
    "epoch",       # the logged epoch is not the replayed one moved by the row's bump_epoch
    "read",        # a read of a block not readable, or at another epoch than its current one
    "capacity",    # more blocks in a tier than the header's capacity for it
    "chain",       # lines not those written (changed, dropped, added, renumbered, cut)
    "pin",         # a pin of a block not readable (a take: or not at its epoch), or an
                   # unpin of a block no pin holds
    "give_back",   # a give-back naming no open lease take (none, not a take, given back)
    "pinned",      # a move giving up a device slot or leaving the device while pins hold it
    "failed_read",  # a read at the epoch a lookup saw the block fail its checksum at
    "write",       # a write or index references on a block not being written
)

#: The ``type`` of each kind of line after the header (the chain line aside).
_LINE_TYPES: Final = [MOVE, READ, READS, PIN, PINS, TAKE, TAKE_READ, LEASE, GIVE_BACK,
                      CHECK_FAILED, WRITE, REFS]
#: Most pins one line may give or take per block (the core's counters are uint16).
_MAX_PIN_DELTA: Final = 1 << 16
#: ``_Group.failed`` of a block no lookup saw fail at its current epoch.
_NOT_FAILED: Final = -1


@attrs.frozen
class ReplayViolation:
    """The first line a replay refused: its number (the header is line 1), which check, why."""

    line: int
    check: str = attrs.field(validator=attrs.validators.in_(CHECKS))
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.check}: {self.message}"


@attrs.frozen
class ReplayResult:
    """What a replay of one log found."""

    path: str
    #: Lines read, the header included (up to and including a violation's line).
    lines: int
    #: Move and read lines replayed, and the block moves they held.
    moves: int
    reads: int
    blocks_moved: int
    violation: ReplayViolation | None = None
    #: Pin lines and runs of pins lines replayed (each a pin or a give-back of its blocks).
    pins: int = 0

    @property
    def accepted(self) -> bool:
        return self.violation is None

    def to_json(self) -> dict[str, Any]:
        violation = None if self.violation is None else attrs.asdict(self.violation)
        return {"path": self.path, "accepted": self.accepted, "lines": self.lines,
                "moves": self.moves, "reads": self.reads, "blocks_moved": self.blocks_moved,
                "pins": self.pins, "violation": violation}

    def summary(self) -> str:
        """One line for a person."""
        if self.violation is None:
            return (f"accepted {self.path}: {self.moves} moves ({self.blocks_moved} block "
                    f"moves) and {self.reads} reads replayed over {self.lines} lines")
        return f"rejected {self.path}: {self.violation}"


class _Reject(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check
        self.message = message


def _runs(record: Mapping[str, Any], what: str, last: str) -> list[tuple[list[Any], str]]:
    """A record's ``runs``, each ``[group, first id, count, <last>]``, with where it sits (a
    line with none, or a run of another shape, is malformed)."""
    runs = _field(record, "runs", list, what)
    if not runs:
        raise _Reject("malformed", f"{what}: no runs")
    out = []
    for at, run in enumerate(runs):
        where = f"{what} run {at}"
        if not isinstance(run, list) or len(run) != 4 or not isinstance(run[0], str):
            raise _Reject("malformed", f"{where}: {run!r} is not [group, first id, count, "
                          f"{last}]")
        out.append((run, where))
    return out


def _field(record: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
           what: str) -> Any:
    if name not in record:
        raise _Reject("malformed", f"{what} has no {name!r} field")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _Reject("malformed", f"{what}: {name!r} is {value!r}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", str: "a string", list: "a list",
                        dict: "an object"}.get(k, k.__name__) for k in kinds)


def _ints(values: list[Any], what: str, low: int, high: int) -> NDArray[np.int64]:
    """``values`` as int64, each an integer in ``[low, high)``."""
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
            raise _Reject("malformed", f"{what}: {value!r} is not an integer in "
                                       f"[{low}, {high})")
    return np.array(values, dtype=np.int64)


#: The most values a read's runs may spell (a tampered count is refused before it is
#: expanded).
_MAX_RUN: Final = 1 << 24


def _expand(rows: list[Any], step: int, what: str, low: int, high: int, *,
            limit: int = _MAX_RUN) -> NDArray[np.int64]:
    """``[first, count]`` rows (each run continuing by ``step``) as the values they spell,
    each an integer in ``[low, high)``; counts are integers >= 1, at most ``limit`` values in
    all (checked before anything is expanded)."""
    pairs = []
    total = 0
    for row in rows:
        if not isinstance(row, list) or len(row) != 2:
            raise _Reject("malformed", f"{what}: {row!r} is not a [first, count] pair")
        first, count = _ints(row[:1], what, low, high), _ints(row[1:], f"{what} count", 1,
                                                               _MAX_RUN)
        last = int(first[0]) + step * (int(count[0]) - 1)
        if not low <= last < high:
            raise _Reject("malformed", f"{what}: the run {row!r} leaves [{low}, {high})")
        pairs.append((int(first[0]), int(count[0])))
        total += int(count[0])
        if total > limit:
            raise _Reject("malformed", f"{what}: the runs spell more than {limit} values")
    if not pairs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([first + step * np.arange(count, dtype=np.int64)
                           for first, count in pairs])


class _Group:
    """One group's replayed states, epochs and tier occupancy."""

    def __init__(self, name: str, entry: Mapping[str, Any],
                 lifecycles: Mapping[str, Lifecycle]) -> None:
        what = f"header: group {name!r}"
        if not isinstance(entry, dict):
            raise _Reject("malformed", f"{what} is not an object")
        lifecycle_name = _field(entry, "lifecycle", str, what)
        if lifecycle_name not in lifecycles:
            raise _Reject("header", f"group {name!r} follows lifecycle {lifecycle_name!r}, "
                          f"which is neither shipped nor given ({sorted(lifecycles)}); pass "
                          f"--lifecycle {lifecycle_name}=PATH")
        table = compile_lifecycle(lifecycles[lifecycle_name])
        logged, ours = _field(entry, "table", str, what), table_digest(table)
        if logged != ours:
            raise _Reject("header", f"group {name!r}: the log was written with other "
                          f"{lifecycle_name!r} tables (digest {logged[:12]}, replaying "
                          f"{ours[:12]}); pass the lifecycle it was written with "
                          f"(--lifecycle {lifecycle_name}=PATH)")
        self.name, self.table = name, table
        self.n_blocks = _field(entry, "blocks", int, what)
        if self.n_blocks < 1:
            raise _Reject("malformed", f"{what}: 'blocks' must be >= 1, got {self.n_blocks}")
        capacity = np.zeros(len(Tier), dtype=np.int64)
        for key in ("slots", "copies"):
            for tier_name, count in _field(entry, key, dict, what).items():
                if tier_name not in TIER_NAMES or not isinstance(count, int) \
                        or isinstance(count, bool) or count < 0:
                    raise _Reject("malformed", f"{what}: {key} {tier_name!r}: {count!r} is not "
                                  f"a count of a tier ({list(TIER_NAMES)})")
                capacity[Tier[tier_name.upper()]] = count
        self.capacity = capacity
        self.state_ids = dict(table.state_ids)
        self.state_names = table.lifecycle.state_names
        self.holds = table.holds_slot.astype(np.int64)
        self.bumps = np.array([sum(call.name == EPOCH_EFFECT for call in row.effects)
                               for row in table.lifecycle.rows], dtype=np.int64)
        self.states = np.full(self.n_blocks, table.initial, dtype=np.int64)
        self.epochs = np.zeros(self.n_blocks, dtype=np.int64)
        self.used = self.holds[self.states].sum(axis=0)
        # Moves a pin forbids, per (from, to) state, from the table's columns: those giving
        # up a device slot (evict, free, spill done) or taking the content from the device
        # to a lower tier (a spill, an eviction to a stored copy).
        on_device = table.holds_slot[:, Tier.DEVICE]
        resident = table.residency == int(Tier.DEVICE)
        lower = (table.residency >= 0) & ~resident
        self.leaves_device = (on_device[:, None] & ~on_device[None, :]) | \
            (resident[:, None] & lower[None, :])
        #: Pins held per block (from the header's start and the pin lines), and the epoch a
        #: lookup saw each fail its checksum at (_NOT_FAILED: none).
        self.pins = np.zeros(self.n_blocks, dtype=np.int64)
        self.failed = np.full(self.n_blocks, _NOT_FAILED, dtype=np.int64)
        start = _field(entry, "start", dict, what)
        ids = self.ids(_field(start, "ids", list, f"{what} start"), f"{what} start")
        self.states[ids] = self.state_list(start, "states", ids.size, f"{what} start")
        self.epochs[ids] = self.epoch_list(start, ids.size, f"{what} start")
        if "pins" in start:  # version 5 on
            pins = _field(start, "pins", list, f"{what} start")
            if len(pins) != ids.size:
                raise _Reject("malformed", f"{what} start: {len(pins)} 'pins' for {ids.size} "
                              "ids")
            self.pins[ids] = _ints(pins, f"{what} start pins", 0, _MAX_PIN_DELTA)
        self.used = self.holds[self.states].sum(axis=0)
        self.check_capacity()

    def ids(self, values: list[Any], what: str) -> NDArray[np.int64]:
        ids = _ints(values, f"{what} ids", 0, self.n_blocks)
        if np.unique(ids).size != ids.size:
            raise _Reject("malformed", f"{what}: block ids repeat")
        return ids

    def state_list(self, record: Mapping[str, Any], key: str, count: int, what: str
                   ) -> NDArray[np.int64]:
        names = _field(record, key, list, what)
        if len(names) != count:
            raise _Reject("malformed", f"{what}: {len(names)} {key!r} for {count} ids")
        try:
            return np.array([self.state_ids[name] for name in names], dtype=np.int64)
        except (KeyError, TypeError):
            unknown = next(n for n in names if not isinstance(n, str) or n not in self.state_ids)
            raise _Reject("malformed", f"{what}: {key!r} names {unknown!r}, not a state of "
                          f"{self.table.name!r} ({list(self.state_names)})") from None

    def epoch_list(self, record: Mapping[str, Any], count: int, what: str) -> NDArray[np.int64]:
        epochs = _field(record, "epochs", list, what)
        if len(epochs) != count:
            raise _Reject("malformed", f"{what}: {len(epochs)} 'epochs' for {count} ids")
        return _ints(epochs, f"{what} epochs", 0, _EPOCH_MODULUS)

    def check_capacity(self) -> None:
        over = np.flatnonzero(self.used > self.capacity)
        if over.size:
            tier = Tier(int(over[0]))
            raise _Reject("capacity", f"group {self.name!r}: {int(self.used[tier])} blocks "
                          f"hold a {tier.spec_name} slot or copy, more than its capacity of "
                          f"{int(self.capacity[tier])}")

    def name_of(self, state: int) -> str:
        return self.state_names[state]

    def move(self, record: Mapping[str, Any], what: str) -> int:
        event_name = _field(record, "event", str, what)
        if event_name not in EVENT_NAMES:
            raise _Reject("malformed", f"{what}: unknown event {event_name!r}")
        event = Event.from_name(event_name)
        ids = self.ids(_field(record, "ids", list, what), what)
        if not ids.size:
            raise _Reject("malformed", f"{what}: no ids")
        source = self.state_list(record, "from", ids.size, what)
        dest = self.state_list(record, "to", ids.size, what)
        epochs = self.epoch_list(record, ids.size, what)
        table = self.table
        where = table.next_state[source, event]
        bad = np.flatnonzero(where == INVALID)
        if bad.size:
            i = int(bad[0])
            raise _Reject("no_row", f"group {self.name!r} block {int(ids[i])}: "
                          f"{table.name!r} has no row for {event_name} from "
                          f"{self.name_of(int(source[i]))!r}")
        bad = np.flatnonzero(source != self.states[ids])
        if bad.size:
            i = int(bad[0])
            raise _Reject("from_state", f"group {self.name!r} block {int(ids[i])}: logged "
                          f"from {self.name_of(int(source[i]))!r} on {event_name}, but the "
                          f"replay has it in {self.name_of(int(self.states[ids[i]]))!r}")
        bad = np.flatnonzero(dest != where)
        if bad.size:
            i = int(bad[0])
            raise _Reject("to_state", f"group {self.name!r} block {int(ids[i])}: logged "
                          f"{self.name_of(int(source[i]))!r} --{event_name}--> "
                          f"{self.name_of(int(dest[i]))!r}, but the table moves it to "
                          f"{self.name_of(int(where[i]))!r}")
        rows = table.row_of[source, event].astype(np.int64)
        expected = (self.epochs[ids] + self.bumps[rows]) % _EPOCH_MODULUS
        bad = np.flatnonzero(epochs != expected)
        if bad.size:
            i = int(bad[0])
            row = table.lifecycle.rows[int(rows[i])]
            raise _Reject("epoch", f"group {self.name!r} block {int(ids[i])}: logged epoch "
                          f"{int(epochs[i])} after {event_name}, expected {int(expected[i])} "
                          f"(epoch {int(self.epochs[ids[i]])} before; row {row.label} bumps it "
                          f"{int(self.bumps[rows[i]])} time(s))")
        bad = np.flatnonzero(self.leaves_device[source, dest] & (self.pins[ids] > 0))
        if bad.size:
            i = int(bad[0])
            raise _Reject("pinned", f"group {self.name!r} block {int(ids[i])}: "
                          f"{self.name_of(int(source[i]))!r} --{event_name}--> "
                          f"{self.name_of(int(dest[i]))!r} gives up its device slot or "
                          f"leaves the device while {int(self.pins[ids[i]])} pin(s) hold it")
        self.used += self.holds[dest].sum(axis=0) - self.holds[source].sum(axis=0)
        self.states[ids] = dest
        self.epochs[ids] = epochs
        self.check_capacity()
        return int(ids.size)

    def read(self, record: Mapping[str, Any], what: str) -> None:
        if "ids_runs" in record:
            ids = _expand(_field(record, "ids_runs", list, what), 1, f"{what} ids_runs",
                          0, self.n_blocks)
        else:
            ids = _ints(_field(record, "ids", list, what), f"{what} ids", 0, self.n_blocks)
        if "epochs_runs" in record:
            epochs = _expand(_field(record, "epochs_runs", list, what), 0,
                             f"{what} epochs_runs", 0, _EPOCH_MODULUS, limit=ids.size)
            if epochs.size != ids.size:
                raise _Reject("malformed", f"{what}: {epochs.size} epochs for {ids.size} ids")
        else:
            epochs = self.epoch_list(record, ids.size, what)
        self.check_read(ids, epochs)

    def read_run(self, run: list[Any], what: str) -> None:
        """A run of a reads line: ``[group, first id, count, epoch]`` (the group checked by
        the caller), read as the ids and epochs it spells."""
        ids = _expand([run[1:3]], 1, what, 0, self.n_blocks)
        epoch = _ints(run[3:], f"{what} epoch", 0, _EPOCH_MODULUS)
        self.check_read(ids, np.full(ids.size, epoch[0], dtype=np.int64))

    def check_read(self, ids: NDArray[np.int64], epochs: NDArray[np.int64]) -> None:
        """Refuse a read of any of ``ids`` that is not readable now, or read at another epoch
        than its own (``epochs``)."""
        states = self.states[ids]
        bad = np.flatnonzero(~self.table.readable[states])
        if bad.size:
            i = int(bad[0])
            raise _Reject("read", f"group {self.name!r} block {int(ids[i])} read in state "
                          f"{self.name_of(int(states[i]))!r}, which a kernel may not read")
        bad = np.flatnonzero(epochs != self.epochs[ids])
        if bad.size:
            i = int(bad[0])
            raise _Reject("read", f"group {self.name!r} block {int(ids[i])} read at epoch "
                          f"{int(epochs[i])}, but its content is at epoch "
                          f"{int(self.epochs[ids[i]])} (it changed)")
        bad = np.flatnonzero(self.failed[ids] == epochs)
        if bad.size:
            i = int(bad[0])
            raise _Reject("failed_read", f"group {self.name!r} block {int(ids[i])} read at "
                          f"epoch {int(epochs[i])}, where a lookup saw it fail its checksum")

    def pin(self, record: Mapping[str, Any], what: str) -> None:
        """A pin line: each of its ids (repeats add up) gains ``delta`` pins."""
        delta = self.delta(record.get("delta"), what)
        if "ids_runs" in record:
            ids = _expand(_field(record, "ids_runs", list, what), 1, f"{what} ids_runs",
                          0, self.n_blocks)
        else:
            ids = _ints(_field(record, "ids", list, what), f"{what} ids", 0, self.n_blocks)
        if not ids.size:
            raise _Reject("malformed", f"{what}: no ids")
        self.add_pins(ids, delta)

    def take_run(self, run: list[Any], what: str) -> NDArray[np.int64]:
        """A run of a take line: ``[group, first id, count, epoch]`` (the group checked by
        the caller), one pin on each block, each at ``epoch``; its ids."""
        ids = _expand([run[1:3]], 1, what, 0, self.n_blocks)
        epoch = int(_ints(run[3:], f"{what} epoch", 0, _EPOCH_MODULUS)[0])
        self.add_pins(ids, 1)
        bad = np.flatnonzero(self.epochs[ids] != epoch)
        if bad.size:
            block = int(ids[bad[0]])
            raise _Reject("pin", f"group {self.name!r} block {block} taken at epoch {epoch}, "
                          f"but its content is at epoch {int(self.epochs[block])}")
        return ids

    def pin_run(self, run: list[Any], what: str) -> None:
        """A run of a pins line: ``[group, first id, count, delta]`` (the group checked by
        the caller)."""
        ids = _expand([run[1:3]], 1, what, 0, self.n_blocks)
        self.add_pins(ids, self.delta(run[3], what))

    @staticmethod
    def delta(value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value == 0 or \
                abs(value) >= _MAX_PIN_DELTA:
            raise _Reject("malformed", f"{what}: delta {value!r} is not a non-zero integer in "
                          f"(-{_MAX_PIN_DELTA}, {_MAX_PIN_DELTA})")
        return value

    def add_pins(self, ids: NDArray[np.int64], delta: int) -> None:
        """Refuse a pin of a block not readable or an unpin below 0; else count it."""
        if delta > 0:
            states = self.states[ids]
            bad = np.flatnonzero(~self.table.readable[states])
            if bad.size:
                i = int(bad[0])
                raise _Reject("pin", f"group {self.name!r} block {int(ids[i])} pinned in "
                              f"state {self.name_of(int(states[i]))!r}, which a kernel may "
                              "not read")
        pins = self.pins.copy()
        np.add.at(pins, ids, delta)
        bad = np.flatnonzero(pins[ids] < 0)
        if bad.size:
            block = int(ids[bad[0]])
            raise _Reject("pin", f"group {self.name!r} block {block} unpinned while "
                          f"{int(self.pins[block])} pin(s) hold it (an unbalanced unpin)")
        self.pins = pins

    def checks_failed(self, record: Mapping[str, Any], what: str) -> None:
        """A check_failed line: its blocks failed their checksum at its epochs."""
        ids = _ints(_field(record, "ids", list, what), f"{what} ids", 0, self.n_blocks)
        self.failed[ids] = self.epoch_list(record, ids.size, what)

    def write(self, record: Mapping[str, Any], kind: str, what: str) -> None:
        """A write line (content into sub-blocks) or a refs line (index references): only
        into blocks being written."""
        ids = self.ids(_field(record, "ids", list, what), what)
        if kind == WRITE:
            mask = _field(record, "sub_blocks", int, what)
            if mask < 1:
                raise _Reject("malformed", f"{what}: sub_blocks {mask} names no sub-block")
            allowed, doing = self.table.writable, "written"
        else:
            targets = _field(record, "targets", list, what)
            epochs = _field(record, "epochs", list, what)
            if len(targets) != ids.size or len(epochs) != ids.size or \
                    not all(isinstance(row, list) for row in [*targets, *epochs]):
                raise _Reject("malformed", f"{what}: 'targets' and 'epochs' are not a list "
                              "per id")
            allowed, doing = self.table.partial, "given index references"
        states = self.states[ids]
        bad = np.flatnonzero(~allowed[states])
        if bad.size:
            i = int(bad[0])
            raise _Reject("write", f"group {self.name!r} block {int(ids[i])} {doing} in "
                          f"state {self.name_of(int(states[i]))!r}, which is not being "
                          "written")


class _Replay:
    def __init__(self, path: str, lifecycles: Mapping[str, Lifecycle]) -> None:
        self.path = path
        self.lifecycles = lifecycles
        self.groups: dict[str, _Group] = {}
        self.lines = self.moves = self.reads = self.blocks_moved = self.pins = 0
        #: Take lines not given back yet, by sequence number: each run's group and ids.
        self.takes: dict[int, list[tuple[_Group, NDArray[np.int64]]]] = {}
        #: Chained logs: the last chain digest, and the lines read since it.
        self.chained = False
        self.chain = b""
        self.segment: list[bytes] = []

    def result(self, violation: ReplayViolation | None = None) -> ReplayResult:
        return ReplayResult(self.path, self.lines, self.moves, self.reads, self.blocks_moved,
                            violation, self.pins)

    def run(self, lines: Iterable[bytes]) -> ReplayResult:
        seq = 0
        for number, raw in enumerate(lines, 1):
            self.lines = number
            try:
                record = self.parse(raw)
                if number == 1:
                    self.header(record)
                    self.chained = record.get("version", 0) >= CHAINED_VERSION
                    self.chain = chain_start(raw)
                elif self.chained and record.get("type") == CHAIN:
                    self.check_chain(record)
                else:
                    if self.chained:
                        self.segment.append(raw)
                    self.line(record, seq)
                    seq += 1
            except _Reject as reject:
                return self.result(ReplayViolation(number, reject.check, reject.message))
            except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
                # A shape the field checks did not foresee: still a line, never a traceback.
                return self.result(ReplayViolation(number, "malformed", f"unreadable record "
                                                   f"({type(exc).__name__}: {exc})"))
        if self.lines == 0:
            return self.result(ReplayViolation(1, "header", "empty file: no header line"))
        if self.segment:
            return self.result(ReplayViolation(
                self.lines, "chain", f"the last {len(self.segment)} lines are covered by no "
                "chain line (the log was cut after its last write, or lines were added)"))
        return self.result()

    def check_chain(self, record: Mapping[str, Any]) -> None:
        """A chain line: the lines since the last one are exactly those the writer wrote."""
        count = _field(record, "lines", int, "chain line")
        digest = _field(record, "digest", str, "chain line")
        if count != len(self.segment):
            raise _Reject("chain", f"the chain line covers {count} lines, {len(self.segment)} "
                          "were read since the last one (lines dropped or added)")
        expected = chain_digest(self.chain, b"".join(self.segment))
        if digest != expected.hex():
            raise _Reject("chain", "the lines since the last chain line are not the ones "
                          "written (a line changed, dropped, added or renumbered)")
        self.chain = expected
        self.segment = []

    @staticmethod
    def parse(raw: bytes) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Reject("malformed", f"not UTF-8 text ({exc.reason} at byte "
                                       f"{exc.start})") from None
        if not text.strip():
            raise _Reject("malformed", "an empty line")
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _Reject("malformed", f"not JSON ({exc.msg} at column {exc.colno}); "
                                       "a truncated or damaged line") from None
        if not isinstance(record, dict):
            raise _Reject("malformed", f"a JSON {type(record).__name__}, not an object")
        return record

    def header(self, record: Mapping[str, Any]) -> None:
        if record.get("format") != FORMAT:
            raise _Reject("header", f"not a kvfsm event log (format {record.get('format')!r}, "
                          f"expected {FORMAT!r})")
        if record.get("version") not in READABLE_VERSIONS:
            raise _Reject("header", f"event log version {record.get('version')!r}; this kvfsm "
                          f"replays versions {sorted(READABLE_VERSIONS)}")
        _field(record, "model", str, "header")
        groups = _field(record, "groups", dict, "header")
        if not groups:
            raise _Reject("malformed", "header: no groups")
        self.groups = {name: _Group(name, entry, self.lifecycles)
                       for name, entry in groups.items()}

    def line(self, record: Mapping[str, Any], expected_seq: int) -> None:
        seq = _field(record, "seq", int, "line")
        if seq != expected_seq:
            raise _Reject("sequence", f"sequence number {seq}, expected {expected_seq} "
                          "(lines missing, repeated or out of order)")
        what = f"record {seq}"
        kind = _field(record, "type", str, what)
        if kind == READS:
            self.lease_reads(record, what)
            return
        if kind == PINS:
            self.lease_pins(record, what)
            return
        if kind in (TAKE, TAKE_READ, LEASE):
            self.take(record, seq, kind != TAKE, what)
            if kind == LEASE:  # given back at once: nothing was logged while it was held
                self.give_back({TAKE: seq}, what)
            return
        if kind == GIVE_BACK:
            self.give_back(record, what)
            return
        group = self.group(_field(record, "group", str, what), what)
        if kind == MOVE:
            self.blocks_moved += group.move(record, what)
            self.moves += 1
        elif kind == READ:
            group.read(record, what)
            self.reads += 1
        elif kind == PIN:
            group.pin(record, what)
            self.pins += 1
        elif kind == CHECK_FAILED:
            group.checks_failed(record, what)
        elif kind in (WRITE, REFS):
            group.write(record, kind, what)
        else:
            raise _Reject("malformed", f"{what}: type {kind!r}, expected one of {_LINE_TYPES}")

    def group(self, name: str, what: str) -> _Group:
        """The replayed group ``name``, or a malformed line naming the groups there are."""
        if name not in self.groups:
            raise _Reject("malformed", f"{what}: unknown group {name!r}; groups: "
                          f"{sorted(self.groups)}")
        return self.groups[name]

    def lease_reads(self, record: Mapping[str, Any], what: str) -> None:
        """A lease's reads: per group, ``[group, first id, count, epoch]``, each checked as a
        read of its own (and counted as one)."""
        for run, where in _runs(record, what, "epoch"):
            self.group(run[0], where).read_run(run, where)
            self.reads += 1


    def lease_pins(self, record: Mapping[str, Any], what: str) -> None:
        """A lease's pins: per group, ``[group, first id, count, delta]``."""
        for run, where in _runs(record, what, "delta"):
            self.group(run[0], where).pin_run(run, where)
            self.pins += 1


    def take(self, record: Mapping[str, Any], seq: int, read: bool, what: str) -> None:
        """A lease's take: per group, ``[group, first id, count, epoch]``, a pin on each
        block, at that epoch; with ``read``, then a read of those blocks at those epochs. Kept
        open for the give-back naming ``seq``."""
        taken = []
        for run, where in _runs(record, what, "epoch"):
            group = self.group(run[0], where)
            taken.append((group, group.take_run(run, where)))
            self.pins += 1
            if read:
                group.read_run(run, where)
                self.reads += 1
        self.takes[seq] = taken

    def give_back(self, record: Mapping[str, Any], what: str) -> None:
        """The give-back of every pin the open take line it names took."""
        take = _field(record, TAKE, int, what)
        taken = self.takes.pop(take, None)
        if taken is None:
            raise _Reject("give_back", f"{what} gives back take {take}, which is no open "
                          "lease take (no take line of that number, or given back already)")
        for group, ids in taken:
            group.add_pins(ids, -1)
            self.pins += 1


def replay(path: str | os.PathLike[str],
           lifecycles: Mapping[str, Lifecycle] | None = None) -> ReplayResult:
    """Replay the event log at ``path`` through the lifecycle tables: the shipped ones, with
    ``lifecycles`` (name -> Lifecycle) added or overriding them. Returns the counts and the
    first violation, if any (a malformed line is a violation too). A file that cannot be read
    raises ``OSError``."""
    known = {**shipped_lifecycles(), **(lifecycles or {})}
    target = Path(path)
    with target.open("rb") as stream:
        return _Replay(str(target), known).run(stream)


__all__ = ["CHECKS", "EPOCH_EFFECT", "ReplayResult", "ReplayViolation", "replay"]
