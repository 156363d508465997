"""Pins for leases, in compiled passes per group: check what a lookup saw and pin it, give it
back, and tell whether it is still as pinned.

A lease pins the blocks a verdict called usable (see :mod:`kvfsm.gates`). The lookup already
found their ids and epochs; a lease made from them proves with one gather per block that
nothing moved since (every row that changes a block's content, frees it or makes it unreadable
bumps its epoch or its state) and pins exactly those blocks. Where nothing in the group changed
since the lookup, only the pin limit is left to check, and the pins are taken in the same pass
that marks the blocks used (:mod:`kvfsm.state._touch`). Unlike :meth:`StateCore.pin`, a pin
here never pins an index block's targets through its references: the lease pins those targets
directly, as blocks of the prompt's history it reads anyway (the caller checks that they are),
so a lease costs its blocks, not their references. A lease gives back exactly what it pinned
with :func:`unpin_unmoved`; nothing else may release these pins.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm._jit import kernel, read_only
from kvfsm.fsm import FORM_COMPRESSED, FORM_RAW
from kvfsm.state._group import FAILED, MAX_PINS, PIN_CHUNK_SHIFT, GroupState
from kvfsm.state._touch import (
    ONE_BY_ONE,
    run_chunks,
    touch_kernel,
    unpin_loop,
)

IdArray = NDArray[np.intp]

#: Why :func:`first_unusable` stopped (its second answer).
FINE: Final = 0
MOVED: Final = 1
UNREADABLE: Final = 2
WRONG_FORM: Final = 3
CHECK_FAILED: Final = 4
PINNED_FULL: Final = 5


def _unusable_example() -> tuple[object, ...]:
    u8 = read_only(np.zeros(1, dtype=np.uint8))
    return (np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32), 0, u8,
            read_only(np.zeros(1, dtype=np.uint32)), u8, read_only(np.ones(1, dtype=np.bool_)),
            read_only(np.zeros(1, dtype=np.int8)), np.zeros(1, dtype=np.uint16),
            MAX_PINS, np.empty(2, dtype=np.int64))


def _unusable_twin(ids: IdArray, seen: NDArray[np.uint32], cut: int,
                   states: NDArray[np.uint8], epoch: NDArray[np.uint32],
                   check: NDArray[np.uint8], readable: NDArray[np.bool_],
                   form: NDArray[np.int8], pins: NDArray[np.uint16], max_pins: int,
                   out: NDArray[np.int64]) -> None:
    """:func:`first_unusable_kernel` as array operations."""
    codes = states[ids]
    wanted = np.where(np.arange(ids.size) < cut, FORM_COMPRESSED, FORM_RAW)
    why = np.select(
        [epoch[ids] != seen, ~readable[codes], form[codes] != wanted, check[ids] == FAILED,
         pins[ids] >= max_pins],
        [MOVED, UNREADABLE, WRONG_FORM, CHECK_FAILED, PINNED_FULL], FINE)
    bad = np.flatnonzero(why != FINE)
    out[0], out[1] = (int(bad[0]), int(why[bad[0]])) if bad.size else (-1, FINE)
    if not bad.size:
        pins[ids] += np.uint16(1)


@kernel(example=_unusable_example, twin=_unusable_twin)
def first_unusable_kernel(ids: IdArray, seen: NDArray[np.uint32], cut: int,
                          states: NDArray[np.uint8], epoch: NDArray[np.uint32],
                          check: NDArray[np.uint8], readable: NDArray[np.bool_],
                          form: NDArray[np.int8], pins: NDArray[np.uint16], max_pins: int,
                          out: NDArray[np.int64]) -> None:
    """``out = (i, why)`` for the first block ``ids[i]`` not at epoch ``seen[i]``, not
    readable, not in its form (compressed before ``cut``, raw from it), seen failing a
    checksum, or pinned to the limit; ``(-1, FINE)`` when every block is usable, and then
    each is pinned once more (distinct ids: one pass, nothing pinned on a refusal)."""
    for i in range(ids.size):
        block = ids[i]
        code = states[block]
        wanted = FORM_COMPRESSED if i < cut else FORM_RAW
        why = FINE
        if epoch[block] != seen[i]:
            why = MOVED
        elif not readable[code]:
            why = UNREADABLE
        elif form[code] != wanted:
            why = WRONG_FORM
        elif check[block] == FAILED:
            why = CHECK_FAILED
        elif pins[block] >= max_pins:
            why = PINNED_FULL
        if why != FINE:
            out[0], out[1] = i, why
            return
    out[0], out[1] = -1, FINE
    for i in range(ids.size):
        pins[ids[i]] += 1


def _moved_example() -> tuple[object, ...]:
    return (np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32),
            read_only(np.zeros(1, dtype=np.uint8)), read_only(np.zeros(1, dtype=np.uint32)),
            read_only(np.ones(1, dtype=np.bool_)), read_only(np.zeros(1, dtype=np.uint8)),
            np.empty(1, dtype=np.int64))


def _first_moved_twin(ids: IdArray, recorded: NDArray[np.uint32], states: NDArray[np.uint8],
                      epoch: NDArray[np.uint32], readable: NDArray[np.bool_],
                      check: NDArray[np.uint8], out: NDArray[np.int64]) -> None:
    bad = np.flatnonzero((epoch[ids] != recorded) | ~readable[states[ids]]
                         | (check[ids] == FAILED))
    out[0] = int(bad[0]) if bad.size else -1


@kernel(example=_moved_example, twin=_first_moved_twin)
def first_moved_kernel(ids: IdArray, recorded: NDArray[np.uint32], states: NDArray[np.uint8],
                       epoch: NDArray[np.uint32], readable: NDArray[np.bool_],
                       check: NDArray[np.uint8], out: NDArray[np.int64]) -> None:
    """``out[0]``: the first ``i`` whose block moved off epoch ``recorded[i]``, is no longer
    readable, or was seen failing its checksum since; -1 when none did."""
    out[0] = -1
    for i in range(ids.size):
        block = ids[i]
        if epoch[block] != recorded[i] or not readable[states[block]] or \
                check[block] == FAILED:
            out[0] = i
            return


def _pins_example() -> tuple[object, ...]:
    return (np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32),
            read_only(np.zeros(1, dtype=np.uint32)), np.zeros(1, dtype=np.uint16),
            np.zeros(1, dtype=np.uint16), PIN_CHUNK_SHIFT, ONE_BY_ONE)


def _unpin_twin(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
                pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
                run: int) -> None:
    if run != ONE_BY_ONE:
        # A single run's whole chunks are its runs' (it is one): one rule for both.
        inside, chunks = run_chunks(ids, shift)
        chunks = chunks[chunk_pins[chunks] > 0]
        chunk_pins[chunks] -= np.uint16(1)
        ids, recorded = ids[~inside], recorded[~inside]
    unmoved = ids[epoch[ids] == recorded]
    held = unmoved[pins[unmoved] > 0]
    pins[held] -= np.uint16(1)


unpin_kernel = kernel(example=_pins_example, twin=_unpin_twin)(unpin_loop)


def take_unchanged(state: GroupState, ids: IdArray, seen: NDArray[np.uint32],
                   answer: NDArray[np.int64]) -> tuple[int, int, bool]:
    """Pin each of the distinct blocks ``ids`` (seen at epochs ``seen``) once, as a lookup
    saw them usable when the group has not changed since (its ``changes`` then and now are
    equal: every block is still at the epoch, state and check the lookup saw, so only the
    pin limit is left to check), and touch them (used now: the clock's next tick), in one
    compiled pass: ``(-1, run, one_run)``, ``run`` telling :func:`unpin_unmoved` how they
    were pinned (``ONE_BY_ONE``, ``ONE_RUN`` or ``RUNS``: by whole chunks where one run, or
    each of several runs, spans them), ``one_run`` that the ids are
    consecutive at one epoch. Else nothing is pinned or touched and the first answer is the
    first index pinned to the limit. ``answer``: four int64 the pass writes its answer to
    (the caller's, reused). The ids are the core's own (a lookup's): an id outside the group
    is a KvfsmError, and then nothing changes."""
    blocks, recency, clock = state._blocks, state.recency, state.clock
    touch_kernel.run(
        ids, state.states, recency.list_of_state, blocks.last_use,
        clock.now + 1, recency.prev, recency.next, recency.head, recency.tail, seen,
        blocks.pins, blocks.chunk_pins, state.pin_shift, MAX_PINS, recency.linked_run, answer)
    outside, first, run, one_run = answer.tolist()
    if outside >= 0:
        raise KvfsmError(f"{state.name}: block ids must lie in [0, {state.n_blocks}), got "
                         f"{int(ids[outside])}")
    if first < 0:
        clock.advance()
    return first, run, one_run == 1


def pin_if_usable(state: GroupState, ids: IdArray, seen: NDArray[np.uint32], cut: int
                  ) -> tuple[int, int]:
    """Pin each of the distinct blocks ``ids`` once (never an index's targets) if every one
    is at the epoch the lookup saw (``seen[i]``), readable in its form (compressed before
    index ``cut``, raw from it), not seen failing a checksum and not pinned ``MAX_PINS``
    times: ``(-1, FINE)``. Else nothing is pinned and the answer is ``(i, why)`` for the
    first that is not."""
    out = np.empty(2, dtype=np.int64)
    table = state.table
    first_unusable_kernel(ids, seen, cut, state.states, state.epoch, state.check,
                          table.readable, table.form, state._blocks.pins, MAX_PINS, out)
    return int(out[0]), int(out[1])


def unpin_unmoved(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32],
                  run: int = ONE_BY_ONE) -> None:
    """Give back the pins :func:`pin_if_usable` or :func:`take_unchanged` took on ``ids``
    (``run``: the latter's answer), except on blocks pinned one by one that are no longer at
    ``epochs`` (their pin went with their content)."""
    blocks = state._blocks
    unpin_kernel.run(ids, epochs, state.epoch, blocks.pins, blocks.chunk_pins, state.pin_shift,
                     run)


def given_back(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32],
               run: int = ONE_BY_ONE) -> IdArray:
    """The blocks of ``ids`` whose pin :func:`unpin_unmoved` gives back (``run``: how they
    were pinned): all of them, but for blocks pinned one by one that are no longer at
    ``epochs`` (a block inside a run's whole chunk always gives its pin back with the chunk).
    What a lease's give-back tells pin observers; O(ids), on a path only they take."""
    moved = state.epoch[ids] != epochs
    if not moved.any():
        return ids
    kept = ~moved
    if run != ONE_BY_ONE:
        kept |= run_chunks(ids, state.pin_shift)[0]
    given: IdArray = ids[kept]
    return given


def first_moved(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32]) -> int:
    """The first index into ``ids`` whose block is no longer at ``epochs``, no longer
    readable, or was seen failing its checksum (a lookup recorded it); -1."""
    out = np.empty(1, dtype=np.int64)
    first_moved_kernel(ids, epochs, state.states, state.epoch, state.table.readable,
                       state.check, out)
    return int(out[0])
