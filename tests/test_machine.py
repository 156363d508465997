"""Tests of ``Machine``: scalar and batched fires over a compiled table, their refusals, the
guards and effects they drive, and the equivalence of a batch with firing its ids one by one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import pytest
from hypothesis import given
from numpy.typing import NDArray

from kvfsm import (
    BindingError,
    GuardRejected,
    IllegalTransition,
    KvfsmError,
    TransitionError,
)
from kvfsm.fsm import CompiledTable, EffectFn, GuardFn, Machine, bind_all, compile_lifecycle
from kvfsm.spec import Call, Event, Row

from .strategies import (
    BatchScenario,
    GuardOrderScenario,
    SettableOracle,
    batch_scenarios,
    guard_order_scenarios,
    shipped,
    shortest_paths,
    table_of,
)

IdArray = NDArray[np.intp]
Decide = Callable[[IdArray, Call], Sequence[bool] | NDArray[np.bool_]]

FULL_KV = "full_kv"


# -- recording bindings ----------------------------------------------------------------------


@attrs.frozen
class Entry:
    """One guard or effect call: which call, for which row (effects only) and which ids."""

    kind: str
    call: str
    row: int | None
    ids: tuple[int, ...]


def used_guards(table: CompiledTable) -> set[str]:
    return {call.name for row in table.lifecycle.rows for call in row.guards}


def used_effects(table: CompiledTable) -> set[str]:
    return {call.name for row in table.lifecycle.rows for call in row.effects}


def always(ids: IdArray, call: Call) -> NDArray[np.bool_]:
    return np.ones(ids.shape[0], dtype=np.bool_)


class Log:
    """Guard and effect bindings that record every call in order; ``decide`` answers guards."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.decide: Decide = always

    def guards(self, table: CompiledTable) -> dict[str, GuardFn]:
        def guard(ids: IdArray, call: Call) -> NDArray[np.bool_]:
            self.entries.append(Entry("guard", str(call), None, tuple(ids.tolist())))
            return np.asarray(self.decide(ids, call), dtype=np.bool_)

        return dict.fromkeys(used_guards(table), guard)

    def effects(self, table: CompiledTable) -> dict[str, EffectFn]:
        def effect(ids: IdArray, call: Call, row: Row) -> None:
            self.entries.append(Entry("effect", str(call), row.index, tuple(ids.tolist())))

        return dict.fromkeys(used_effects(table), effect)

    def of(self, kind: str) -> list[Entry]:
        return [entry for entry in self.entries if entry.kind == kind]

    def clear(self) -> None:
        self.entries.clear()


def fail_ids(guard: str, bad: Sequence[int]) -> Decide:
    """``guard`` says no for the ids in ``bad``; every other guard call passes."""

    def decide(ids: IdArray, call: Call) -> NDArray[np.bool_]:
        if str(call) != guard:
            return always(ids, call)
        return ~np.isin(ids, np.asarray(bad, dtype=np.intp))

    return decide


class AdmitFirst:
    """A capacity-style guard: ``guard`` has room for ``k`` objects per call and admits the first
    ``k`` ids it is shown; every other guard call passes. Remembers whom it admitted."""

    def __init__(self, guard: str, k: int) -> None:
        self.guard, self.k = guard, k
        self.admitted: set[int] = set()

    def __call__(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        if str(call) != self.guard:
            return always(ids, call)
        verdict = np.arange(ids.shape[0]) < self.k
        self.admitted |= set(ids[verdict].tolist())
        return verdict


def drive(machine: Machine, obj: int, state: str) -> None:
    """Fire the spec's shortest path from the initial state to ``state`` on ``obj``."""
    for event in shortest_paths(machine.table.lifecycle)[state]:
        machine.fire(obj, event)


def machine_in(name: str, starts: Sequence[str], log: Log) -> Machine:
    """A fully bound machine whose object ``i`` has been driven to ``starts[i]``; the log is
    cleared afterwards, so it holds only what the test itself fires."""
    table = table_of(name)
    machine = Machine(table, len(starts), guards=log.guards(table), effects=log.effects(table))
    for obj, state in enumerate(starts):
        drive(machine, obj, state)
    log.clear()
    return machine


def names(machine: Machine) -> list[str]:
    return [machine.state_of(obj) for obj in range(machine.capacity)]


def row_named(name: str, source: str, event: Event) -> Row:
    table = table_of(name)
    row = table.row(table.state_id(source), event)
    assert row is not None
    return row


ALL_ROWS = [
    pytest.param(name, position, id=f"{name}-{row.source}-{row.event.spec_name}")
    for name, lifecycle in shipped().items()
    for position, row in enumerate(lifecycle.rows)
]


# -- scalar fire -----------------------------------------------------------------------------


@pytest.mark.parametrize("event", [Event.ALLOCATE, "allocate", int(Event.ALLOCATE)])
def test_fire_moves_one_object_and_returns_its_new_state_id(event: Event | str | int) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 3, log)
    new = machine.fire(1, event)
    assert new == machine.table.state_id("allocated")
    assert names(machine) == ["free", "allocated", "free"]
    assert machine.states.tolist() == [machine.table.initial, new, machine.table.initial]


def test_fire_illegal_names_id_event_and_state_and_changes_nothing() -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["allocated", "free"], log)
    with pytest.raises(IllegalTransition) as info:
        machine.fire(1, Event.WRITE_DONE)
    exc = info.value
    assert (exc.lifecycle, exc.event, exc.ids, exc.states) == (
        FULL_KV, "write_done", (1,), ("free",)
    )
    assert "1 (free)" in str(exc)
    assert "write_done" in str(exc)
    assert names(machine) == ["allocated", "free"]
    assert log.entries == []


def test_fire_event_without_any_row_in_the_lifecycle_is_illegal() -> None:
    machine = machine_in(FULL_KV, ["free"], Log())
    with pytest.raises(IllegalTransition):
        machine.fire(0, Event.COMPRESS_BEGIN)
    assert names(machine) == ["free"]


def test_fire_guard_rejected_names_the_guard_and_changes_nothing() -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["host", "host"], log)
    log.decide = fail_ids("admission_open", [0])
    with pytest.raises(GuardRejected) as info:
        machine.fire(0, Event.RESTORE_BEGIN)
    exc = info.value
    assert (exc.event, exc.ids, exc.states) == ("restore_begin", (0,), ("host",))
    assert "admission_open" in exc.why
    assert "admission_open" in str(exc)
    assert names(machine) == ["host", "host"]
    assert log.of("effect") == []


@pytest.mark.parametrize("obj", [-1, 2, 100])
def test_fire_out_of_range_object_is_refused(obj: int) -> None:
    machine = machine_in(FULL_KV, ["free", "free"], Log())
    with pytest.raises(KvfsmError, match="out of range"):
        machine.fire(obj, Event.ALLOCATE)
    assert names(machine) == ["free", "free"]


def test_unknown_event_name_is_refused() -> None:
    machine = machine_in(FULL_KV, ["free"], Log())
    with pytest.raises(KvfsmError, match="no_such_event"):
        machine.fire(0, "no_such_event")
    with pytest.raises(KvfsmError, match="no_such_event"):
        machine.fire_batch([0], "no_such_event")


@pytest.mark.parametrize(("name", "position"), ALL_ROWS)
def test_fire_runs_row_guards_then_effects_in_declared_order(name: str, position: int) -> None:
    row = shipped()[name].rows[position]
    log = Log()
    machine = machine_in(name, ["free", row.source], log)
    assert machine.fire(1, row.event) == machine.table.state_id(row.dest)
    guards, effects = log.of("guard"), log.of("effect")
    assert sorted(e.call for e in guards) == sorted(str(c) for c in row.guards)
    assert all(e.ids == (1,) for e in guards)
    assert [(e.call, e.row, e.ids) for e in effects] == [
        (str(c), row.index, (1,)) for c in row.effects
    ]
    assert log.entries == guards + effects, "every guard is asked before any effect runs"


# -- batched fire: all-or-nothing ------------------------------------------------------------


@pytest.mark.parametrize(("name", "position"), ALL_ROWS)
def test_fire_batch_runs_each_effect_once_in_declared_order(name: str, position: int) -> None:
    row = shipped()[name].rows[position]
    log = Log()
    machine = machine_in(name, [row.source, "free", row.source, row.source], log)
    mask = machine.fire_batch([3, 0, 2], row.event)
    assert mask.tolist() == [True, True, True]
    assert names(machine) == [row.dest, "free", row.dest, row.dest]
    guards, effects = log.of("guard"), log.of("effect")
    assert sorted(e.call for e in guards) == sorted(str(c) for c in row.guards)
    assert all(sorted(e.ids) == [0, 2, 3] for e in guards)
    assert [(e.call, e.row, sorted(e.ids)) for e in effects] == [
        (str(c), row.index, [0, 2, 3]) for c in row.effects
    ]
    assert log.entries == guards + effects, "every guard is asked before any effect runs"


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [3, 1, 0, 2]], ids=["sorted", "unsorted"])
def test_one_illegal_id_refuses_the_whole_batch(ids: list[int]) -> None:
    log = Log()
    starts = ["allocated", "allocated", "free", "allocated"]
    machine = machine_in(FULL_KV, starts, log)
    with pytest.raises(IllegalTransition) as info:
        machine.fire_batch(ids, Event.WRITE_BEGIN)
    assert (info.value.ids, info.value.states) == ((2,), ("free",))
    assert "2 (free)" in str(info.value)
    assert names(machine) == starts
    assert log.entries == []


def test_batch_in_one_state_without_a_row_lists_every_id() -> None:
    machine = machine_in(FULL_KV, ["free"] * 4, Log())
    with pytest.raises(IllegalTransition) as info:
        machine.fire_batch([2, 0, 3], Event.WRITE_DONE)
    assert sorted(info.value.ids) == [0, 2, 3]
    assert info.value.states == ("free",) * 3
    assert names(machine) == ["free"] * 4


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [2, 3, 0, 1]], ids=["sorted", "unsorted"])
def test_one_guard_rejection_refuses_the_whole_batch(ids: list[int]) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 4, log)
    log.decide = fail_ids("has_room:device", [2])
    with pytest.raises(GuardRejected) as info:
        machine.fire_batch(ids, Event.ALLOCATE)
    assert (info.value.ids, info.value.states) == ((2,), ("free",))
    assert "has_room:device" in info.value.why
    assert names(machine) == ["free"] * 4
    assert log.of("effect") == []


def test_guard_rejection_in_a_mixed_batch_refuses_the_whole_batch() -> None:
    log = Log()
    starts = ["host", "disk", "host", "disk"]
    machine = machine_in(FULL_KV, starts, log)
    log.decide = fail_ids("admission_open", [1])
    with pytest.raises(GuardRejected) as info:
        machine.fire_batch([0, 1, 2, 3], Event.RESTORE_BEGIN)
    assert (info.value.ids, info.value.states) == ((1,), ("disk",))
    assert "admission_open" in info.value.why
    assert names(machine) == starts
    assert log.of("effect") == []


def test_all_or_nothing_capacity_guard_short_of_room_refuses_the_batch() -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 5, log)
    log.decide = AdmitFirst("has_room:device", 3)
    with pytest.raises(GuardRejected) as info:
        machine.fire_batch([0, 1, 2, 3, 4], Event.ALLOCATE)
    assert len(info.value.ids) == 2
    assert names(machine) == ["free"] * 5
    assert log.of("effect") == []


@pytest.mark.parametrize("kind", ["illegal", "guard"])
def test_refusal_of_a_large_batch_names_a_state_for_every_id(kind: str) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 100, log)
    log.decide = fail_ids("has_room:device", list(range(100)))
    event = Event.WRITE_DONE if kind == "illegal" else Event.ALLOCATE
    with pytest.raises(TransitionError) as info:
        machine.fire_batch(np.arange(100), event)
    assert len(info.value.ids) == 100
    assert len(info.value.states) == len(info.value.ids)


# -- batched fire: masked --------------------------------------------------------------------


def test_masked_moves_exactly_the_movable_ids_and_returns_the_mask() -> None:
    log = Log()
    starts = ["device", "free", "host", "device", "writing", "host"]
    machine = machine_in(FULL_KV, starts, log)
    log.decide = fail_ids("no_pins", [3])
    ids = [5, 4, 3, 2, 1, 0]
    mask = machine.fire_batch(ids, Event.EVICT, masked=True)
    # 5, 2: host rows (no guard); 0: device row; 3: pinned; 4, 1: no evict row.
    assert mask.tolist() == [True, False, False, True, False, True]
    assert names(machine) == ["free", "free", "free", "device", "writing", "free"]
    assert {e.call for e in log.of("effect") if 3 in e.ids} == set()


def test_masked_batch_with_no_movable_id_changes_nothing() -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free", "free"], log)
    mask = machine.fire_batch([1, 0], Event.WRITE_DONE, masked=True)
    assert mask.tolist() == [False, False]
    assert names(machine) == ["free", "free"]
    log.decide = fail_ids("has_room:device", [0, 1])
    mask = machine.fire_batch([1, 0], Event.ALLOCATE, masked=True)
    assert mask.tolist() == [False, False]
    assert names(machine) == ["free", "free"]
    assert log.of("effect") == []


@pytest.mark.parametrize("k", range(7))
def test_masked_capacity_guard_moves_exactly_k(k: int) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 6, log)
    room = AdmitFirst("has_room:device", k)
    log.decide = room
    ids = [4, 1, 5, 0, 3, 2]
    mask = machine.fire_batch(ids, Event.ALLOCATE, masked=True)
    moved = {obj for obj, ok in zip(ids, mask.tolist(), strict=True) if ok}
    assert len(moved) == k
    assert moved == room.admitted
    assert set(machine.ids_in("allocated").tolist()) == moved
    assert set(machine.ids_in("free").tolist()) == set(range(6)) - moved
    taken = [set(e.ids) for e in log.of("effect") if e.call == "take_slot:device"]
    assert taken == ([moved] if k else [])


@pytest.mark.parametrize("k", range(6))
def test_masked_capacity_guard_shared_by_rows_moves_exactly_k(k: int) -> None:
    log = Log()
    starts = ["host", "disk", "disk", "host", "device"]
    machine = machine_in(FULL_KV, starts, log)
    room = AdmitFirst("has_room:device", k)
    log.decide = room
    mask = machine.fire_batch([3, 2, 1, 0], Event.RESTORE_BEGIN, masked=True)
    assert int(mask.sum()) == min(k, 4)
    moved = {obj for obj in range(4) if machine.state_of(obj).startswith("restoring")}
    assert moved == room.admitted
    assert machine.state_of(4) == "device"


# -- batched fire: mixed states --------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_mixed_state_evict_calls_each_rows_effects_once_with_its_ids(masked: bool) -> None:
    log = Log()
    starts = ["device", "host", "device", "host", "free"]
    machine = machine_in(FULL_KV, starts, log)
    mask = machine.fire_batch([3, 0, 1, 2], Event.EVICT, masked=masked)
    assert mask.tolist() == [True] * 4
    assert names(machine) == ["free"] * 5
    device_row = row_named(FULL_KV, "device", Event.EVICT)
    host_row = row_named(FULL_KV, "host", Event.EVICT)
    by_row: dict[int | None, list[tuple[str, list[int]]]] = defaultdict(list)
    for entry in log.of("effect"):
        by_row[entry.row].append((entry.call, sorted(entry.ids)))
    assert dict(by_row) == {
        device_row.index: [(str(c), [0, 2]) for c in device_row.effects],
        host_row.index: [(str(c), [1, 3]) for c in host_row.effects],
    }
    assert [(e.call, sorted(e.ids)) for e in log.of("guard")] == [("no_pins", [0, 2])]


def test_mixed_state_batch_with_an_illegal_id_refuses_the_whole_batch() -> None:
    log = Log()
    starts = ["device", "host", "free"]
    machine = machine_in(FULL_KV, starts, log)
    with pytest.raises(IllegalTransition) as info:
        machine.fire_batch([0, 1, 2], Event.EVICT)
    assert (info.value.ids, info.value.states) == ((2,), ("free",))
    assert names(machine) == starts
    assert log.of("effect") == []


def test_guard_call_shared_by_rows_is_evaluated_once_over_the_union() -> None:
    log = Log()
    starts = ["host", "disk", "host", "disk", "device"]
    machine = machine_in(FULL_KV, starts, log)
    mask = machine.fire_batch([3, 0, 2, 1], Event.RESTORE_BEGIN)
    assert mask.all()
    assert names(machine) == ["restoring_host", "restoring_disk"] * 2 + ["device"]
    guards = log.of("guard")
    assert sorted(e.call for e in guards) == ["admission_open", "has_room:device"]
    assert all(sorted(e.ids) == [0, 1, 2, 3] for e in guards)
    assert log.entries == guards + log.of("effect"), "every guard is asked before any effect"


# -- ids -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids", [[1, 1], [0, 1, 1, 2], [2, 0, 2], [3, 1, 2, 1], np.array([0, 3, 3], dtype=np.int32)],
    ids=["pair", "sorted", "unsorted", "unsorted-inner", "int32"],
)
def test_duplicate_ids_are_refused(ids: list[int]) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 4, log)
    with pytest.raises(KvfsmError, match="more than once") as info:
        machine.fire_batch(ids, Event.ALLOCATE)
    assert not isinstance(info.value, TransitionError)
    assert names(machine) == ["free"] * 4
    assert log.entries == []


@pytest.mark.parametrize("ids", [[0, 0, 1, 2], [1, 0, 1, 2]], ids=["sorted", "unsorted"])
def test_duplicate_ids_longer_than_capacity_are_refused(ids: list[int]) -> None:
    machine = machine_in(FULL_KV, ["free"] * 3, Log())
    with pytest.raises(KvfsmError, match="more than once"):
        machine.fire_batch(ids, Event.ALLOCATE)


@pytest.mark.parametrize("ids", [[-1], [4], [0, 9], [3, -2, 1]])
def test_out_of_range_ids_are_refused(ids: list[int]) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 4, log)
    with pytest.raises(KvfsmError, match=r"\[0, 4\)"):
        machine.fire_batch(ids, Event.ALLOCATE)
    assert names(machine) == ["free"] * 4
    assert log.entries == []


@pytest.mark.parametrize(
    "ids",
    [
        [[0, 1]],
        np.zeros((2, 2), dtype=np.intp),
        np.int64(1),
        [0.0, 1.0],
        np.array([0.5]),
        [True, False],
        ["0"],
    ],
    ids=["nested", "2d", "0d", "float-list", "float-array", "bool", "str"],
)
def test_non_integer_or_not_1d_ids_are_refused(ids: object) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free"] * 4, log)
    with pytest.raises(KvfsmError, match="1-D integer"):
        machine.fire_batch(ids, Event.ALLOCATE)  # type: ignore[arg-type]
    assert names(machine) == ["free"] * 4
    assert log.entries == []


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("ids", [[], np.empty(0, dtype=np.intp)], ids=["list", "array"])
@pytest.mark.parametrize("event", [Event.ALLOCATE, Event.WRITE_DONE, Event.COMPRESS_BEGIN])
def test_empty_batch_is_a_no_op(ids: object, event: Event, masked: bool) -> None:
    log = Log()
    machine = machine_in(FULL_KV, ["free", "device"], log)
    mask = machine.fire_batch(ids, event, masked=masked)  # type: ignore[arg-type]
    assert mask.shape == (0,)
    assert mask.dtype == np.bool_
    assert names(machine) == ["free", "device"]
    assert log.entries == []


# -- bindings and the states view ------------------------------------------------------------


@pytest.mark.parametrize("name", tuple(shipped()))
def test_unbound_table_is_a_binding_error_unless_permissive(name: str) -> None:
    table = table_of(name)
    with pytest.raises(BindingError):
        Machine(table, 2)
    machine = Machine(table, 2, permissive=True)
    assert machine.states.tolist() == [table.initial] * 2


@pytest.mark.parametrize(
    ("kind", "missing"),
    [("guard", name) for name in sorted(used_guards(table_of(FULL_KV)))]
    + [("effect", name) for name in sorted(used_effects(table_of(FULL_KV)))],
)
def test_each_missing_binding_is_named(kind: str, missing: str) -> None:
    table = table_of(FULL_KV)
    log = Log()
    guards, effects = log.guards(table), log.effects(table)
    del (guards if kind == "guard" else effects)[missing]
    with pytest.raises(BindingError, match=missing):
        Machine(table, 1, guards=guards, effects=effects)
    Machine(table, 1, guards=guards, effects=effects, permissive=True)


def test_permissive_machine_passes_unbound_guards_and_skips_unbound_effects() -> None:
    table = table_of(FULL_KV)
    machine = Machine(table, 2, permissive=True)
    for event in shortest_paths(table.lifecycle)["restoring_disk"]:
        machine.fire_batch([0, 1], event)
    assert [machine.state_of(0), machine.state_of(1)] == ["restoring_disk"] * 2


def test_states_view_is_read_only() -> None:
    machine = machine_in(FULL_KV, ["free", "free"], Log())
    states = machine.states
    assert states.dtype == np.uint8
    assert states.shape == (2,)
    with pytest.raises(ValueError, match="read-only"):
        states[0] = machine.table.state_id("device")
    assert names(machine) == ["free", "free"]
    machine.fire(0, Event.ALLOCATE)
    assert machine.states.tolist() == [
        machine.table.state_id("allocated"), machine.table.initial
    ]


def test_zero_capacity_machine_fires_only_empty_batches() -> None:
    machine = Machine(table_of(FULL_KV), 0, permissive=True)
    assert machine.fire_batch([], Event.ALLOCATE).shape == (0,)
    with pytest.raises(KvfsmError):
        machine.fire_batch([0], Event.ALLOCATE)


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Machine(table_of(FULL_KV), -1, permissive=True)


# -- properties: a batch is its ids fired one by one -----------------------------------------


@attrs.frozen
class Outcome:
    """What one fire did: the mask (or the refusal) and every object's state and effects."""

    states: tuple[str, ...]
    effects: dict[int, list[tuple[int | None, str]]]


def build(scenario: BatchScenario, bound: bool) -> tuple[Machine, Log, SettableOracle]:
    """A machine with recording effects whose objects sit in the scenario's start states.

    ``bound``: guards come from ``bind_all`` with the scenario's oracle and the machine is
    strict; otherwise guards are left unbound and the machine is permissive (they all pass).
    """
    table = table_of(scenario.lifecycle_name)
    log, oracle = Log(), SettableOracle()
    guards = bind_all(table, oracle) if bound else None
    machine = Machine(
        table, scenario.capacity, guards=guards, effects=log.effects(table), permissive=not bound
    )
    for obj, state in enumerate(scenario.starts):
        drive(machine, obj, state)
    log.clear()
    oracle.failing = scenario.oracle.failing
    return machine, log, oracle


def effects_per_id(log: Log) -> dict[int, list[tuple[int | None, str]]]:
    """Each id's effects in the order they ran on it: ``(row index, call)``."""
    out: dict[int, list[tuple[int | None, str]]] = defaultdict(list)
    for entry in log.of("effect"):
        for obj in entry.ids:
            out[obj].append((entry.row, entry.call))
    return dict(out)


def one_by_one(scenario: BatchScenario, bound: bool) -> tuple[list[bool], dict[int, str], Outcome]:
    """Fire the scenario's event on each id with scalar ``fire``: which moved, why each refused
    one was refused (exception class name), and the resulting states and effects."""
    machine, log, _ = build(scenario, bound)
    moved: list[bool] = []
    refused: dict[int, str] = {}
    for obj in scenario.ids:
        try:
            machine.fire(obj, scenario.event)
        except TransitionError as exc:
            moved.append(False)
            refused[obj] = type(exc).__name__
        else:
            moved.append(True)
    return moved, refused, Outcome(tuple(names(machine)), effects_per_id(log))


@pytest.mark.parametrize("bound", [False, True], ids=["permissive", "oracle"])
@given(scenario=batch_scenarios())
def test_masked_batch_equals_firing_each_id_alone(scenario: BatchScenario, bound: bool) -> None:
    """For any lifecycle, start states, event, set of ids (in any order) and deterministic guard
    oracle, ``fire_batch(masked=True)`` moves exactly the ids that scalar ``fire`` moves one by
    one, returns that as its mask, and leaves every object in the same state having run the same
    effects, in the same order, on each id."""
    moved, _, expected = one_by_one(scenario, bound)
    machine, log, _ = build(scenario, bound)
    mask = machine.fire_batch(list(scenario.ids), scenario.event, masked=True)
    assert mask.dtype == np.bool_
    assert mask.tolist() == moved
    assert Outcome(tuple(names(machine)), effects_per_id(log)) == expected


@pytest.mark.parametrize("bound", [False, True], ids=["permissive", "oracle"])
@given(scenario=batch_scenarios())
def test_all_or_nothing_batch_moves_every_id_or_changes_nothing(
    scenario: BatchScenario, bound: bool
) -> None:
    """An all-or-nothing ``fire_batch`` either moves every id, ending exactly where firing each
    id alone ends, or raises a refusal that lists only ids scalar ``fire`` refuses too (every one
    of them when no row applies) with their states, and leaves every state unchanged and every
    effect unrun."""
    moved, refused, expected = one_by_one(scenario, bound)
    machine, log, _ = build(scenario, bound)
    before = tuple(names(machine))
    try:
        mask = machine.fire_batch(np.array(scenario.ids, dtype=np.intp), scenario.event)
    except TransitionError as exc:
        assert not all(moved)
        assert exc.ids, "a refusal names at least one id"
        assert set(exc.ids) <= set(refused)
        assert all(refused[obj] == type(exc).__name__ for obj in exc.ids)
        if isinstance(exc, IllegalTransition):
            illegal = {obj for obj, why in refused.items() if why == "IllegalTransition"}
            assert set(exc.ids) == illegal
        assert list(exc.states) == [before[obj] for obj in exc.ids]
        assert tuple(names(machine)) == before
        assert log.entries == []
    else:
        assert all(moved)
        assert mask.tolist() == [True] * len(scenario.ids)
        assert Outcome(tuple(names(machine)), effects_per_id(log)) == expected


# -- properties: guard order with a capacity guard -------------------------------------------

CAPACITY_GUARD = Call("has_room", "device")
STATELESS_GUARD = Call("no_pins")
GUARD_ORDERS = {
    "capacity-first": (CAPACITY_GUARD, STATELESS_GUARD),
    "stateless-first": (STATELESS_GUARD, CAPACITY_GUARD),
}


def with_row_guards(name: str, event: Event, guards: tuple[Call, ...]) -> CompiledTable:
    """The shipped lifecycle ``name`` with every row of ``event`` given exactly ``guards``."""
    lifecycle = shipped()[name]
    rows = tuple(attrs.evolve(row, guards=guards) if row.event is event else row
                 for row in lifecycle.rows)
    return compile_lifecycle(attrs.evolve(lifecycle, rows=rows))


class OrderedGuards:
    """The capacity guard admits the first ``room`` ids it is shown (every id while ``room`` is
    None) and records what it was shown; the stateless guard refuses the ids in ``refused``."""

    def __init__(self) -> None:
        self.room: int | None = None
        self.refused: frozenset[int] = frozenset()
        self.shown: list[tuple[int, ...]] = []

    def capacity(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        if self.room is None:
            return always(ids, call)
        self.shown.append(tuple(ids.tolist()))
        return np.arange(ids.shape[0]) < self.room

    def stateless(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        return ~np.isin(ids, np.fromiter(self.refused, dtype=np.intp, count=len(self.refused)))

    def bindings(self) -> dict[str, GuardFn]:
        return {CAPACITY_GUARD.name: self.capacity, STATELESS_GUARD.name: self.stateless}


@attrs.frozen
class Expected:
    """What the plain reference says a batch does: the ids that move (in batch order), the ids
    the capacity guard is shown, or the refusal (exception class name and the ids it names)."""

    moved: tuple[int, ...] = ()
    shown: tuple[tuple[int, ...], ...] = ()
    refusal: tuple[str, tuple[int, ...]] | None = None


def reference_guarded_fire(
    scenario: GuardOrderScenario, order: tuple[Call, ...], masked: bool
) -> Expected:
    """Guards in declared order, each over the ids that survived the ones before it, in batch
    order; all-or-nothing stops at the first id without a row or the first guard that says no."""
    lifecycle = shipped()[scenario.lifecycle_name]
    sources = {row.source for row in lifecycle.rows if row.event is scenario.event}
    survivors = [obj for obj in scenario.ids if scenario.starts[obj] in sources]
    if not masked and len(survivors) < len(scenario.ids):
        illegal = tuple(obj for obj in scenario.ids if obj not in survivors)
        return Expected(refusal=("IllegalTransition", illegal))
    shown: list[tuple[int, ...]] = []
    for call in order:
        if not survivors:
            break
        if call == CAPACITY_GUARD:
            shown.append(tuple(survivors))
            verdict = [position < scenario.room for position in range(len(survivors))]
        else:
            verdict = [obj not in scenario.refused for obj in survivors]
        failed = tuple(obj for obj, ok in zip(survivors, verdict, strict=True) if not ok)
        if failed and not masked:
            return Expected(shown=tuple(shown), refusal=("GuardRejected", failed))
        survivors = [obj for obj, ok in zip(survivors, verdict, strict=True) if ok]
    return Expected(moved=tuple(survivors), shown=tuple(shown))


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "all-or-nothing"])
@pytest.mark.parametrize("order", list(GUARD_ORDERS), ids=list(GUARD_ORDERS))
@given(scenario=guard_order_scenarios(FULL_KV, Event.RESTORE_BEGIN))
def test_guards_run_in_declared_order_each_over_the_survivors_of_the_ones_before(
    scenario: GuardOrderScenario, order: str, masked: bool
) -> None:
    """Whatever the declared order of a capacity guard and a stateless guard on the rows of an
    event, and whatever mix of rows the batch takes, ``fire_batch`` evaluates the guards in that
    order, each exactly once, over the ids (in batch order) that have a row and passed every
    guard before it: so a capacity guard placed after a stateless one gives its room only to ids
    the stateless one let through, and one placed before it may spend room on ids the stateless
    one then refuses. Masked, exactly the ids surviving every guard move and the rest stay put;
    all-or-nothing, the first refusing guard (or a missing row) is raised naming the ids it
    refused and nothing changes."""
    guards = GUARD_ORDERS[order]
    table = with_row_guards(FULL_KV, scenario.event, guards)
    oracle = OrderedGuards()
    machine = Machine(table, scenario.capacity, guards=oracle.bindings(), permissive=True)
    for obj, state in enumerate(scenario.starts):
        drive(machine, obj, state)
    oracle.room, oracle.refused = scenario.room, scenario.refused
    before = names(machine)
    expected = reference_guarded_fire(scenario, guards, masked)
    try:
        mask = machine.fire_batch(list(scenario.ids), scenario.event, masked=masked)
    except TransitionError as exc:
        assert expected.refusal == (type(exc).__name__, exc.ids)
        assert names(machine) == before
    else:
        assert expected.refusal is None
        moved = tuple(obj for obj, ok in zip(scenario.ids, mask.tolist(), strict=True) if ok)
        assert moved == expected.moved
        dest = {row.source: row.dest for row in table.lifecycle.rows
                if row.event is scenario.event}
        assert names(machine) == [dest[state] if obj in moved else state
                                  for obj, state in enumerate(before)]
    assert tuple(oracle.shown) == expected.shown
