"""The only way a lease is taken and given back: one compiled call over every group each way.

A take on a lookup's own probe with no group changed since has only the pin limit left to
check. The groups' arrays are gathered once per core into one address table
(:class:`LeaseArrays`); :func:`take_probed_kernel` pins and touches the blocks read from the
lookup's pass outputs, :func:`unpin_probed_kernel` gives them back, and :func:`first_moved`
finds the first block a lease holds that moved since (its validate, where a group changed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import AddressTable, address_table, unowned, vector_at
from kvfsm._jit import kernel, read_only, settings
from kvfsm.lookup._buffers import (
    ANSWER_COLUMNS,
    BLOCK,
    CHUNK_PINS,
    EPOCH,
    FIRST_EPOCH,
    FIRST_ID,
    FIXED_COLUMNS,
    FULL,
    HEAD,
    HI,
    LAST_USE,
    LEASE_KINDS,
    LINKED_RUN,
    LIST_OF_STATE,
    LO,
    N_LEASE_ARRAYS,
    NEXT,
    ONE_READ,
    OUTSIDE,
    PINNED_AS,
    PINS,
    PREV,
    SHIFT,
    STATES,
    TAIL,
    TAKEN,
    TARGET,
    TARGET_BLOCK,
    probed_ids,
)
from kvfsm.state._group import FAILED, MAX_PINS, GroupState
from kvfsm.state._touch import (
    TOUCH_CALLS,
    UNPIN_CALLS,
    _touch_known,
    no_linked_run,
    unpin_loop,
)

IdArray = NDArray[np.intp]


def take_probed_loop(outs: tuple[NDArray[np.int64], ...], bounds: NDArray[np.int64],
                     offsets: NDArray[np.int64], at: int, fixed: NDArray[np.int64],
                     arrays: NDArray[np.int64], tick: int, max_pins: int,
                     answers: NDArray[np.int64]) -> tuple[int, int, int, int]:
    """A lease's pinning touch (:func:`_touch_known`) of every group, on the blocks a lookup
    found usable at candidate ``at``. Group ``g``'s are prompt blocks ``[bounds[g, 0, at],
    bounds[g, 1, at])``, read from ``outs[g]`` at ``offsets[g]`` (the third: ONE_RUN_BLOCKS's
    word, -1: none; a span inside it is pinned without reading its ids and epochs).

    Each group with blocks is touched at the next tick from ``tick``, writing ``answers[g]``.
    Returns ``(stop, touched, one_runs, outside)``: ``stop`` the first group refused (an id
    outside it, a block at ``max_pins``; groups before it stay pinned, it and those after
    are unchanged) or TAKEN; the ticks taken; the groups read as one run; 1 where an index
    may point outside what the lease holds of its target group (the caller pins those)."""
    # The caller holds the arrays for the call: views need no reference counting.
    bounds, offsets, fixed, arrays, answers = unowned(bounds), unowned(offsets), \
        unowned(fixed), unowned(arrays), unowned(answers)
    groups = len(outs)
    outside, one_runs = 0, 0
    for g in range(groups):
        target = fixed[g, TARGET]
        lo, hi = bounds[g, 0, at], bounds[g, 1, at]
        if target >= 0 and hi > lo:
            reach = hi * fixed[g, BLOCK] // fixed[g, TARGET_BLOCK]
            if bounds[target, 0, at] != 0 or bounds[target, 1, at] < reach:
                outside = 1
    touched = 0
    for g in range(groups):
        answer = answers[g]
        lo, hi = bounds[g, 0, at], bounds[g, 1, at]
        answer[OUTSIDE], answer[FULL], answer[PINNED_AS], answer[ONE_READ] = -1, -1, 0, 0
        answer[FIRST_ID], answer[FIRST_EPOCH], answer[LO], answer[HI] = -1, 0, lo, hi
        if hi <= lo:
            continue
        out = unowned(outs[g])
        ids, seen = probed_ids(out, offsets[g, 0], offsets[g, 1], lo, hi)
        run_at = offsets[g, 2]
        one_run = run_at >= 0 and hi <= out[run_at]
        base = g * N_LEASE_ARRAYS
        _touch_known(ids, vector_at(arrays, base + STATES, np.uint8),
                     vector_at(arrays, base + LIST_OF_STATE, np.int8),
                     vector_at(arrays, base + LAST_USE, np.uint32), tick + touched,
                     vector_at(arrays, base + PREV, np.int32),
                     vector_at(arrays, base + NEXT, np.int32),
                     vector_at(arrays, base + HEAD, np.int32),
                     vector_at(arrays, base + TAIL, np.int32), seen,
                     vector_at(arrays, base + PINS, np.uint16),
                     vector_at(arrays, base + CHUNK_PINS, np.uint16), fixed[g, SHIFT], max_pins,
                     vector_at(arrays, base + LINKED_RUN, np.int64), answer, one_run)
        if answer[OUTSIDE] >= 0 or answer[FULL] >= 0:
            return g, touched, one_runs, outside
        answer[FIRST_ID], answer[FIRST_EPOCH] = ids[0], seen[0]
        touched += 1
        one_runs += answer[ONE_READ]
    return TAKEN, touched, one_runs, outside


def unpin_probed_loop(outs: tuple[NDArray[np.int64], ...], offsets: NDArray[np.int64],
                      fixed: NDArray[np.int64], arrays: NDArray[np.int64],
                      answers: NDArray[np.int64], groups: int) -> None:
    """Give back what :func:`take_probed_loop` pinned in its first ``groups`` groups, as its
    answer rows say, through :func:`unpin_loop` per group."""
    # The caller holds the arrays for the call: views need no reference counting.
    offsets, fixed, arrays, answers = unowned(offsets), unowned(fixed), unowned(arrays), \
        unowned(answers)
    for g in range(groups):
        lo, hi = answers[g, LO], answers[g, HI]
        if hi > lo:
            ids, seen = probed_ids(unowned(outs[g]), offsets[g, 0], offsets[g, 1], lo, hi)
            base = g * N_LEASE_ARRAYS
            unpin_loop(ids, seen, vector_at(arrays, base + EPOCH, np.uint32),
                       vector_at(arrays, base + PINS, np.uint16),
                       vector_at(arrays, base + CHUNK_PINS, np.uint16), fixed[g, SHIFT],
                       answers[g, PINNED_AS])


def lease_table(groups: Sequence[Sequence[NDArray[Any]]]) -> AddressTable:
    """One address table of every group's arrays, :data:`LEASE_KINDS` per group. The passes
    write through it, so an array of another dtype or layout is refused (TypeError), never
    copied."""
    every = []
    for g, arrays in enumerate(groups):
        for which, (array, (dtype, _)) in enumerate(zip(arrays, LEASE_KINDS, strict=True)):
            if array.dtype != np.dtype(dtype) or not array.flags.c_contiguous:
                raise TypeError(f"group {g}'s lease array {which} must be C-contiguous "
                                f"{np.dtype(dtype)}, got {array.dtype}")
            every.append(array)
    table = address_table(every, LEASE_KINDS * len(groups))
    assert table is not None, "arrays of their kinds make a table"
    return table


def _take_example() -> tuple[object, ...]:
    """A take of one group holding one block (id 0, epoch 0), its pass output laid out as a
    lookup's: the one-run word first, the id at 2, the epoch's word at 3."""
    out = np.zeros(5, dtype=np.int64)
    out[0] = 1
    bounds = read_only(np.array([[[0], [1]]], dtype=np.int64))
    offsets = read_only(np.array([[2, 3, 0]], dtype=np.int64))
    nodes = np.full(1, -1, dtype=np.int32)
    fixed = np.array([[6, -1, 16, 16]], dtype=np.int64)
    arrays = lease_table([(read_only(np.zeros(1, dtype=np.uint8)),
                           read_only(np.full(1, -1, dtype=np.int8)),
                           np.zeros(1, dtype=np.uint32), nodes, nodes.copy(), nodes.copy(),
                           nodes.copy(), np.zeros(1, dtype=np.uint16),
                           np.zeros(1, dtype=np.uint16), read_only(np.zeros(1, np.uint32)),
                           no_linked_run())])
    return ((out,), bounds, offsets, 0, fixed, arrays, 1, MAX_PINS,
            np.zeros((1, ANSWER_COLUMNS), dtype=np.int64))


take_probed_kernel = kernel(example=_take_example,
                            calls=(probed_ids, *TOUCH_CALLS))(take_probed_loop)


def _unpin_example() -> tuple[object, ...]:
    """The give-back of :func:`_take_example`'s block."""
    outs, _, offsets, _, fixed, arrays, _, _, answers = _take_example()
    assert isinstance(answers, np.ndarray)
    answers[0, HI] = 1
    return (outs, offsets, fixed, arrays, answers, 1)


unpin_probed_kernel = kernel(example=_unpin_example,
                             calls=(probed_ids, *UNPIN_CALLS))(unpin_probed_loop)


def _moved_example() -> tuple[object, ...]:
    return (np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32),
            read_only(np.zeros(1, dtype=np.uint8)), read_only(np.zeros(1, dtype=np.uint32)),
            read_only(np.ones(1, dtype=np.bool_)), read_only(np.zeros(1, dtype=np.uint8)),
            np.empty(1, dtype=np.int64))


@kernel(example=_moved_example)
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


def first_moved(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32]) -> int:
    """:func:`first_moved_kernel`'s answer for ``state``'s blocks ``ids`` at ``epochs``."""
    out = np.empty(1, dtype=np.int64)
    first_moved_kernel(ids, epochs, state.states, state.epoch, state.table.readable,
                       state.check, out)
    return int(out[0])


class LeaseArrays:
    """A core's groups' arrays a lease pass reads and writes, as one address table in a
    lookup's order of the groups, gathered once (each array is its group's for life)."""

    def __init__(self, groups: Sequence[GroupState], names: tuple[str, ...] | None = None
                 ) -> None:
        if not groups:
            raise ValueError("a lease's arrays need at least one group")
        self.groups = tuple(groups)
        #: The groups' names (``names`` itself where given: compared by identity).
        self.names = tuple(state.name for state in self.groups) if names is None else names
        if self.names != tuple(state.name for state in self.groups):
            raise ValueError(f"names {self.names} are not the groups' "
                             f"{[state.name for state in self.groups]}")
        #: The core's use counter and count of changes to any group (shared by its groups).
        self.clock = self.groups[0].clock
        self.change_count = self.groups[0].change_count
        positions = {state.name: at for at, state in enumerate(self.groups)}
        self.fixed = np.zeros((len(self.groups), FIXED_COLUMNS), dtype=np.int64)
        for at, state in enumerate(self.groups):
            target = state.target
            self.fixed[at] = (state.pin_shift, -1 if target is None else positions[target.name],
                              state.decl.block_size,
                              state.decl.block_size if target is None
                              else target.decl.block_size)
        self.table = lease_table([
            (state.states, state.recency.list_of_state, state._blocks.last_use,
             state.recency.prev, state.recency.next, state.recency.head, state.recency.tail,
             state._blocks.pins, state._blocks.chunk_pins, state.epoch,
             state.recency.linked_run)
            for state in self.groups])
        #: Entry points, bound on their first checked calls (see :meth:`take`).
        self._take_entry: Callable[..., tuple[int, int, int, int]] | None = None
        self._unpin_entry: Callable[..., None] | None = None

    def take(self, outs: tuple[NDArray[np.int64], ...], bounds: NDArray[np.int64],
             offsets: NDArray[np.int64], at: int, tick: int, answers: NDArray[np.int64]
             ) -> tuple[int, int, int, int]:
        """:func:`take_probed_loop` over these groups. The arrays are a lookup's own (its pass
        outputs and spans) and ``answers`` is C-contiguous int64 of their dimensions: the entry
        point bound on the first call (which skips numba's type matching) reads them as such."""
        if settings.enabled:
            entry = self._take_entry
            if entry is None:
                entry = self._take_entry = take_probed_kernel.entry(*(
                    outs, bounds, offsets, at, self.fixed, self.table, tick, MAX_PINS, answers))
        else:
            entry = take_probed_kernel.twin
        answer: tuple[int, int, int, int] = entry(
            outs, bounds, offsets, at, self.fixed, self.table, tick, MAX_PINS, answers)
        return answer

    def unpin(self, outs: tuple[NDArray[np.int64], ...], offsets: NDArray[np.int64],
              answers: NDArray[np.int64], groups: int) -> None:
        """:func:`unpin_probed_loop` over the first ``groups`` groups (the arrays of a
        :meth:`take`)."""
        if settings.enabled:
            entry = self._unpin_entry
            if entry is None:
                entry = self._unpin_entry = unpin_probed_kernel.entry(*(
                    outs, offsets, self.fixed, self.table, answers, groups))
        else:
            entry = unpin_probed_kernel.twin
        entry(outs, offsets, self.fixed, self.table, answers, groups)


__all__ = ["LeaseArrays", "first_moved", "lease_table", "take_probed_kernel", "unpin_probed_kernel"]
