"""Compile a lifecycle into dense NumPy tables: ``next_state[state, event]`` and friends.

Per-block state is one ``uint8``; a transition over a batch is a gather from these tables.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm.spec._model import Lifecycle, Row, StateDef
from kvfsm.spec._vocabulary import STORED_TIERS, Content, Event, Form, Tier

_A = TypeVar("_A", bound=np.ndarray)

#: ``next_state`` value of a ``(state, event)`` pair that has no row.
INVALID: Final = 255
#: ``row_of`` value of a ``(state, event)`` pair that has no row.
NO_ROW: Final = -1

#: ``form`` codes: the representation of a state's content, as one int8 per state.
FORM_NONE: Final = 0
FORM_RAW: Final = 1
FORM_COMPRESSED: Final = 2
#: The ``form`` code of each :class:`Form`.
FORM_CODE: Final[Mapping[Form, int]] = MappingProxyType(
    {Form.NONE: FORM_NONE, Form.RAW: FORM_RAW, Form.COMPRESSED: FORM_COMPRESSED}
)


@attrs.frozen(eq=False)
class CompiledTable:
    """Dense, read-only tables of one lifecycle. State ids follow declaration order."""

    lifecycle: Lifecycle
    #: ``[n_states, n_events]`` uint8: the destination state id, or :data:`INVALID`.
    next_state: NDArray[np.uint8]
    #: ``[n_states, n_events]`` int16: the index into ``lifecycle.rows``, or :data:`NO_ROW`.
    row_of: NDArray[np.int16]
    #: Per state: a kernel may read it now / it is reachable by hash / an operation is running.
    readable: NDArray[np.bool_]
    hashed: NDArray[np.bool_]
    in_flight: NDArray[np.bool_]
    #: ``[n_states, n_tiers]`` bool: the state holds a slot in that tier.
    holds_slot: NDArray[np.bool_]
    #: Per state: the tier of the authoritative content, or -1.
    residency: NDArray[np.int8]
    #: Per state: the content is complete / partial.
    complete: NDArray[np.bool_]
    partial: NDArray[np.bool_]
    #: Per state: partial content resident on the device, where a write may land.
    writable: NDArray[np.bool_]
    #: Per state: the content's representation, a :data:`FORM_CODE` value.
    form: NDArray[np.int8]
    #: Per state: being restored: in flight, content in a lower tier, a device slot held
    #: (what the restore admission gate counts).
    restoring: NDArray[np.bool_]
    #: Per state: a restore from a stored tier (disk, remote) is in flight: the data path
    #: loads the stored copy into the device slot before ``restore_done``.
    loading: NDArray[np.bool_]
    #: Per state: the stored tier a spill in flight is writing a copy into, or -1.
    storing_to: NDArray[np.int8]
    state_ids: MappingProxyType[str, int]

    @property
    def name(self) -> str:
        return self.lifecycle.name

    @property
    def n_states(self) -> int:
        return int(self.next_state.shape[0])

    @property
    def initial(self) -> int:
        return self.state_ids[self.lifecycle.initial]

    def state_id(self, name: str) -> int:
        """The id of the state called ``name``; ``KeyError`` names the lifecycle when unknown."""
        try:
            return self.state_ids[name]
        except KeyError:
            raise KeyError(f"{self.name}: no state {name!r}") from None

    def state_name(self, state_id: int) -> str:
        return self.lifecycle.states[state_id].name

    def row(self, state_id: int, event: Event) -> Row | None:
        """The row for ``(state, event)``, or None."""
        index = int(self.row_of[state_id, event])
        return None if index == NO_ROW else self.lifecycle.rows[index]


def _storing_to(state: StateDef) -> int:
    """The stored tier a spill in flight in ``state`` writes into, or -1."""
    if not state.in_flight or state.residency is None or Tier.DEVICE in state.slots:
        return -1
    targets = [t for t in state.slots if t in STORED_TIERS and t != state.residency]
    return int(targets[0]) if targets else -1


def _readonly(array: _A) -> _A:
    array.setflags(write=False)
    return array


@functools.lru_cache(maxsize=64)
def compile_lifecycle(lifecycle: Lifecycle) -> CompiledTable:
    """Build the dense tables of a validated lifecycle (cached: tables are read-only)."""
    ids = {state.name: index for index, state in enumerate(lifecycle.states)}
    n_states, n_events, n_tiers = len(ids), len(Event), len(Tier)
    next_state = np.full((n_states, n_events), INVALID, dtype=np.uint8)
    row_of = np.full((n_states, n_events), NO_ROW, dtype=np.int16)
    for index, row in enumerate(lifecycle.rows):
        next_state[ids[row.source], row.event] = ids[row.dest]
        row_of[ids[row.source], row.event] = index
    holds_slot = np.zeros((n_states, n_tiers), dtype=np.bool_)
    for index, state in enumerate(lifecycle.states):
        holds_slot[index, list(state.slots)] = True
    states = lifecycle.states

    def column(flags: list[bool]) -> NDArray[np.bool_]:
        return _readonly(np.array(flags, dtype=np.bool_))

    return CompiledTable(
        lifecycle=lifecycle,
        next_state=_readonly(next_state),
        row_of=_readonly(row_of),
        readable=column([s.readable for s in states]),
        hashed=column([s.hashed for s in states]),
        in_flight=column([s.in_flight for s in states]),
        holds_slot=_readonly(holds_slot),
        residency=_readonly(
            np.array([-1 if s.residency is None else int(s.residency) for s in states], np.int8)
        ),
        complete=column([s.content is Content.COMPLETE for s in states]),
        partial=column([s.content is Content.PARTIAL for s in states]),
        writable=column(
            [s.content is Content.PARTIAL and s.residency is Tier.DEVICE for s in states]
        ),
        form=_readonly(np.array([FORM_CODE[s.form] for s in states], dtype=np.int8)),
        restoring=column(
            [
                s.in_flight and s.residency not in (None, Tier.DEVICE) and Tier.DEVICE in s.slots
                for s in states
            ]
        ),
        loading=column([
            s.in_flight and s.residency in STORED_TIERS and Tier.DEVICE in s.slots
            for s in states
        ]),
        storing_to=_readonly(np.array([_storing_to(s) for s in states], dtype=np.int8)),
        state_ids=MappingProxyType(ids),
    )
