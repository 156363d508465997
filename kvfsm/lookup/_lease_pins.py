"""Per-group helpers of a lease's pins: whether its blocks are still as pinned, and which pins
its give-back returns (the pins themselves move in :mod:`kvfsm.lookup._lease_pass`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.state._group import FAILED, GroupState
from kvfsm.state._touch import ONE_BY_ONE, run_chunks

IdArray = NDArray[np.intp]


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


def _unpin_twin(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
                pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
                run: int) -> None:
    """:func:`~kvfsm.state._touch.unpin_loop` as array operations."""
    if run != ONE_BY_ONE:
        inside, chunks = run_chunks(ids, shift)
        chunks = chunks[chunk_pins[chunks] > 0]
        chunk_pins[chunks] -= np.uint16(1)
        ids, recorded = ids[~inside], recorded[~inside]
    unmoved = ids[epoch[ids] == recorded]
    held = unmoved[pins[unmoved] > 0]
    pins[held] -= np.uint16(1)


def given_back(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32],
               run: int = ONE_BY_ONE) -> IdArray:
    """The blocks of ``ids`` whose pin a give-back returns (``run``: how they were pinned):
    all but those pinned one by one that are no longer at ``epochs`` (a block inside a run's
    whole chunk gives its pin back with the chunk). For pin observers only."""
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
    readable, or was seen failing its checksum; -1 when none."""
    out = np.empty(1, dtype=np.int64)
    first_moved_kernel(ids, epochs, state.states, state.epoch, state.table.readable,
                       state.check, out)
    return int(out[0])
