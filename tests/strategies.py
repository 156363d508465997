"""Shared Hypothesis strategies for the kvfsm tests, and the few spec helpers they rely on.

Everything here is derived from the shipped lifecycle specs, so a new spec file is picked up by
every property test without editing the tests.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs
from hypothesis import strategies as st

from kvfsm.fsm import CompiledTable, compile_lifecycle
from kvfsm.spec import Call, Event, Lifecycle, shipped_lifecycles

#: What a guard oracle is: a deterministic verdict per guard call.
GuardOracle = Callable[[Call], bool]

#: The failing set under which every guard passes.
NO_FAILURES: frozenset[str] = frozenset()


# -- spec helpers ----------------------------------------------------------------------------


@functools.cache
def shipped() -> Mapping[str, Lifecycle]:
    """Every shipped lifecycle by name, in name order (loaded once per test session)."""
    return MappingProxyType(dict(sorted(shipped_lifecycles().items())))


@functools.cache
def table_of(name: str) -> CompiledTable:
    """The compiled table of the shipped lifecycle called ``name`` (compiled once)."""
    return compile_lifecycle(shipped()[name])


def guard_strings(lifecycle: Lifecycle | None = None) -> tuple[str, ...]:
    """Every guard call (``has_room:host``) the rows of ``lifecycle`` (default: of every shipped
    lifecycle) name, sorted."""
    chosen = shipped().values() if lifecycle is None else (lifecycle,)
    return tuple(sorted({str(call) for lc in chosen for row in lc.rows for call in row.guards}))


@functools.cache
def shortest_paths(lifecycle: Lifecycle) -> Mapping[str, tuple[Event, ...]]:
    """For every state reachable from ``initial``, a shortest sequence of events reaching it.

    Found by breadth-first search over the spec rows alone (guards assumed to pass); rows are
    visited in declaration order, so the paths are deterministic.
    """
    paths: dict[str, tuple[Event, ...]] = {lifecycle.initial: ()}
    queue = deque([lifecycle.initial])
    while queue:
        state = queue.popleft()
        for row in lifecycle.rows:
            if row.source == state and row.dest not in paths:
                paths[row.dest] = (*paths[state], row.event)
                queue.append(row.dest)
    return MappingProxyType(paths)


# -- guard oracles ---------------------------------------------------------------------------


@attrs.frozen
class FailingGuards:
    """A deterministic guard oracle: a guard call says no exactly when its string (``str(call)``,
    e.g. ``has_room:device``) is in ``failing``."""

    failing: frozenset[str] = frozenset()

    def __call__(self, call: Call) -> bool:
        return str(call) not in self.failing


@attrs.define
class SettableOracle:
    """A guard oracle whose failing set a test changes between fires: every guard passes while
    objects are driven to their start states, then the failing set under test is put in."""

    failing: frozenset[str] = frozenset()

    def __call__(self, call: Call) -> bool:
        return str(call) not in self.failing


# -- strategies ------------------------------------------------------------------------------


def lifecycle_names() -> st.SearchStrategy[str]:
    """The name of any shipped lifecycle."""
    return st.sampled_from(tuple(shipped()))


def lifecycles() -> st.SearchStrategy[Lifecycle]:
    """Any shipped lifecycle."""
    return st.sampled_from(tuple(shipped().values()))


def events() -> st.SearchStrategy[Event]:
    """Any event of the vocabulary, used by the lifecycle at hand or not."""
    return st.sampled_from(Event)


def lifecycle_events(lifecycle: Lifecycle | None = None) -> st.SearchStrategy[Event]:
    """Any event, biased towards those ``lifecycle`` has rows for, so that random sequences
    move often enough to reach deep states; without a lifecycle, the same as :func:`events`."""
    if lifecycle is None:
        return events()
    return st.one_of(st.sampled_from(lifecycle.events), events())


def event_sequences(
    max_size: int = 40, lifecycle: Lifecycle | None = None
) -> st.SearchStrategy[list[Event]]:
    """Lists of events (see :func:`lifecycle_events` for the bias a lifecycle gives)."""
    return st.lists(lifecycle_events(lifecycle), max_size=max_size)


def failing_sets(lifecycle: Lifecycle | None = None) -> st.SearchStrategy[frozenset[str]]:
    """Sets of guard-call strings that say no, drawn from the guards the rows name."""
    return st.frozensets(st.sampled_from(guard_strings(lifecycle)))


def guard_oracles(lifecycle: Lifecycle | None = None) -> st.SearchStrategy[FailingGuards]:
    """Deterministic guard oracles ``Call -> bool``: a drawn set of guard calls fails."""
    return st.builds(FailingGuards, failing_sets(lifecycle))


@attrs.frozen
class Walk:
    """Events fired in turn from the initial state; before each, ``failing`` is put in the
    guard oracle (so a guard may pass at one step and fail at another)."""

    lifecycle_name: str
    steps: tuple[tuple[Event, frozenset[str]], ...]

    @property
    def lifecycle(self) -> Lifecycle:
        return shipped()[self.lifecycle_name]


def legal_events(lifecycle: Lifecycle, state: str) -> tuple[Event, ...]:
    """The events the spec has a row for in ``state``, in row order."""
    return tuple(row.event for row in lifecycle.rows if row.source == state)


@st.composite
def walks(draw: st.DrawFn, max_size: int = 40, fixed_oracle: bool = False) -> Walk:
    """A lifecycle and a random walk over it from the initial state.

    Each step's event is mostly one the spec has a row for in the state the spec says the walk
    is in by then (so walks reach deep states), otherwise any event. With ``fixed_oracle`` one
    drawn failing set holds for the whole walk; otherwise each step either fails no guard or
    draws its own failing set.
    """
    name = draw(lifecycle_names())
    lifecycle = shipped()[name]
    fixed = draw(failing_sets(lifecycle)) if fixed_oracle else NO_FAILURES
    state = lifecycle.initial
    steps: list[tuple[Event, frozenset[str]]] = []
    for _ in range(draw(st.integers(0, max_size))):
        legal = legal_events(lifecycle, state)
        # Three times in four (when there is one), an event with a row in the current state.
        if legal and draw(st.integers(0, 3)) > 0:
            event = draw(st.sampled_from(legal))
        else:
            event = draw(events())
        failing = fixed
        if not fixed_oracle and draw(st.booleans()):
            failing = draw(failing_sets(lifecycle))
        steps.append((event, failing))
        for row in lifecycle.rows:
            if (row.source, row.event) == (state, event):
                if not any(str(call) in failing for call in row.guards):
                    state = row.dest
                break
    return Walk(name, tuple(steps))


@st.composite
def id_lists(draw: st.DrawFn, capacity: int) -> list[int]:
    """Distinct object ids below ``capacity``, each in with even odds, in any order."""
    chosen = [obj for obj in range(capacity) if draw(st.booleans())]
    return draw(st.permutations(chosen))


@attrs.frozen
class BatchScenario:
    """One batched fire to judge: object ``i`` is first driven to ``starts[i]`` with every guard
    passing, then ``event`` is fired on ``ids`` with the guards ``oracle`` decides."""

    lifecycle_name: str
    starts: tuple[str, ...]
    event: Event
    ids: tuple[int, ...]
    oracle: FailingGuards

    @property
    def lifecycle(self) -> Lifecycle:
        return shipped()[self.lifecycle_name]

    @property
    def capacity(self) -> int:
        return len(self.starts)


@st.composite
def batch_scenarios(draw: st.DrawFn, max_capacity: int = 12) -> BatchScenario:
    """A lifecycle, a start state per object (any reachable state), an event, a batch of
    distinct ids in random order and a guard oracle."""
    name = draw(lifecycle_names())
    lifecycle = shipped()[name]
    capacity = draw(st.integers(1, max_capacity))
    # A few distinct start states, so that batches are often in one state and often mixed.
    reachable = sorted(shortest_paths(lifecycle))
    used = draw(st.lists(st.sampled_from(reachable), min_size=1, max_size=3, unique=True))
    starts = draw(st.lists(st.sampled_from(used), min_size=capacity, max_size=capacity))
    event = draw(lifecycle_events(lifecycle))
    ids = draw(id_lists(capacity))
    oracle = draw(guard_oracles(lifecycle))
    return BatchScenario(name, tuple(starts), event, tuple(ids), oracle)


@attrs.frozen
class GuardOrderScenario:
    """One batched fire of ``event`` whose rows are given a capacity guard and a stateless guard:
    object ``i`` is first driven to ``starts[i]`` with every guard passing, then ``event`` is
    fired on ``ids`` while the capacity guard admits the first ``room`` ids it is shown and the
    stateless guard refuses exactly the ids in ``refused``."""

    lifecycle_name: str
    event: Event
    starts: tuple[str, ...]
    ids: tuple[int, ...]
    room: int
    refused: frozenset[int]

    @property
    def capacity(self) -> int:
        return len(self.starts)


@st.composite
def guard_order_scenarios(
    draw: st.DrawFn, lifecycle_name: str, event: Event, max_capacity: int = 10
) -> GuardOrderScenario:
    """Objects mostly in states with a row for ``event`` (often several such states, so that
    several rows share the guards), sometimes in one without; a batch of distinct ids in random
    order; room for any number of them; and any set of ids the stateless guard refuses."""
    lifecycle = shipped()[lifecycle_name]
    reachable = sorted(shortest_paths(lifecycle))
    with_row = [s for s in reachable if event in legal_events(lifecycle, s)]
    without = [s for s in reachable if s not in with_row]
    used = draw(st.lists(st.sampled_from(with_row), min_size=1, max_size=3, unique=True))
    if without and draw(st.booleans()):
        used.append(draw(st.sampled_from(without)))
    capacity = draw(st.integers(1, max_capacity))
    starts = draw(st.lists(st.sampled_from(used), min_size=capacity, max_size=capacity))
    ids = draw(id_lists(capacity))
    room = draw(st.integers(0, capacity))
    refused = draw(st.frozensets(st.integers(0, capacity - 1)))
    return GuardOrderScenario(lifecycle_name, event, tuple(starts), tuple(ids), room, refused)
