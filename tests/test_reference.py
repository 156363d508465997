"""The compiled tables mean what the spec says: for every shipped spec, every (state, event) and
random event sequences, the compiled ``Machine`` and the `transitions`-based ``ReferenceMachine``
agree on the next state and on every rejection (no row vs. a guard said no)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given

from kvfsm import GuardRejected, IllegalTransition, TransitionError
from kvfsm.fsm import Machine, ReferenceMachine, bind_all
from kvfsm.spec import Event, Lifecycle

from .strategies import (
    SettableOracle,
    Walk,
    guard_strings,
    shipped,
    shortest_paths,
    table_of,
    walks,
)


@attrs.frozen
class Moved:
    state: str


@attrs.frozen
class Refused:
    """A refusal as both machines report it; ``state`` is where the object still is."""

    kind: type[TransitionError]
    event: str
    states: tuple[str, ...]
    state: str


Outcome = Moved | Refused


class Pair:
    """One object driven by the compiled ``Machine`` and by ``ReferenceMachine`` side by side,
    both asking the same guard oracle."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.oracle = SettableOracle()
        table = table_of(lifecycle.name)
        self.compiled = Machine(table, 1, guards=bind_all(table, self.oracle), permissive=True)
        self.reference = ReferenceMachine(lifecycle, self.oracle)

    def fire(self, event: Event) -> tuple[Outcome, Outcome]:
        return self._fire_compiled(event), self._fire_reference(event)

    def _fire_compiled(self, event: Event) -> Outcome:
        try:
            new = self.compiled.fire(0, event)
        except TransitionError as exc:
            return Refused(type(exc), exc.event, exc.states, self.compiled.state_of(0))
        assert self.compiled.table.state_name(new) == self.compiled.state_of(0)
        return Moved(self.compiled.state_of(0))

    def _fire_reference(self, event: Event) -> Outcome:
        try:
            new = self.reference.fire(event)
        except TransitionError as exc:
            return Refused(type(exc), exc.event, exc.states, self.reference.current)
        assert new == self.reference.current
        return Moved(new)


def spec_outcome(
    lifecycle: Lifecycle, state: str, event: Event, failing: frozenset[str]
) -> Outcome:
    """What the spec itself says firing ``event`` in ``state`` does under ``failing`` guards."""
    for row in lifecycle.rows:
        if (row.source, row.event) == (state, event):
            if any(str(call) in failing for call in row.guards):
                return Refused(GuardRejected, event.spec_name, (state,), state)
            return Moved(row.dest)
    return Refused(IllegalTransition, event.spec_name, (state,), state)


CASES = [
    pytest.param(name, state, id=f"{name}-{state}")
    for name, lifecycle in shipped().items()
    for state in lifecycle.state_names
]


def test_every_state_of_every_shipped_spec_is_reachable() -> None:
    """The exhaustive comparison reaches each state by firing, so it needs them all reachable."""
    for lifecycle in shipped().values():
        assert set(shortest_paths(lifecycle)) == set(lifecycle.state_names), lifecycle.name


@pytest.mark.parametrize(("name", "state"), CASES)
def test_compiled_and_reference_agree_on_every_event_in_every_state(name: str, state: str) -> None:
    """For this (lifecycle, state) and every event of the vocabulary, under guards that all
    pass, that all fail, and where each guard of the row fails alone, the compiled machine,
    the reference machine and the spec give the same next state or the same refusal.

    Each state is reached by firing, on both machines, a shortest path of events found by BFS
    over the spec rows with every guard passing, rather than by setting the `transitions`
    machine's state: the comparison then uses only the public ``fire`` of each machine (and the
    path itself is checked step by step)."""
    lifecycle = shipped()[name]
    table = table_of(name)
    every_guard = frozenset(guard_strings(lifecycle))
    for event in Event:
        row = table.row(table.state_id(state), event)
        failing_sets = {frozenset(), every_guard}
        failing_sets |= {frozenset({str(call)}) for call in (row.guards if row else ())}
        for failing in sorted(failing_sets, key=sorted):
            pair = Pair(lifecycle)
            for step in shortest_paths(lifecycle)[state]:
                compiled, reference = pair.fire(step)
                assert isinstance(compiled, Moved)
                assert compiled == reference
            assert pair.compiled.state_of(0) == pair.reference.current == state
            pair.oracle.failing = failing
            compiled, reference = pair.fire(event)
            where = (event.spec_name, sorted(failing))
            assert compiled == reference, where
            assert compiled == spec_outcome(lifecycle, state, event, failing), where


def run_in_lockstep(walk: Walk) -> None:
    pair = Pair(walk.lifecycle)
    for event, failing in walk.steps:
        state = pair.reference.current
        pair.oracle.failing = failing
        compiled, reference = pair.fire(event)
        assert compiled == reference, (state, event.spec_name, sorted(failing))
        assert compiled == spec_outcome(walk.lifecycle, state, event, failing)
        assert pair.compiled.state_of(0) == pair.reference.current


@given(walk=walks(fixed_oracle=True))
def test_compiled_and_reference_agree_along_random_event_sequences(walk: Walk) -> None:
    """Stepping both machines in lockstep through any event sequence from the initial state,
    under one fixed guard oracle, they move to the same state after every step, and every event
    one rejects the other rejects too, with the same exception class and state left unchanged."""
    run_in_lockstep(walk)


@given(walk=walks())
def test_compiled_and_reference_agree_when_guards_change_between_steps(walk: Walk) -> None:
    """The same lockstep agreement holds when each step has its own set of failing guards (so a
    walk can get past a guard that a later step rejects, and reach deep states)."""
    run_in_lockstep(walk)
