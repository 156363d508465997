"""Sparse-index checks: every reference of an index block points at a current target of this
prompt's history.

An index block of a prompt is usable only if each of its ``top_k`` references (target block,
epoch) still holds: the target is hashed (alive), at the epoch it was indexed against, and, when
the prompt's history group is known, it is the history block of this prompt at its position and
complete before the index block ends (layer 3, position/index intersection). Facts per target
are folded into one small table, ``first_row``: the first index row of the prompt allowed to
point at the target (never, for dead targets or targets outside the prompt), so a reference
costs two reads: the target's epoch and its ``first_row``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel
from kvfsm._jit import settings as jit
from kvfsm.state import NO_TARGET, GroupState
from kvfsm.verify._types import Reason

Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]
_Rows = TypeVar("_Rows", NDArray[np.int32], NDArray[np.uint32])
#: ``first_row`` of a target no row may point at.
NEVER = np.iinfo(np.int32).max


def _refs_fit_example() -> tuple[object, ...]:
    refs = np.full((1, 2), -1, dtype=np.int32)
    return (np.zeros(1, dtype=np.intp), refs, np.zeros((1, 2), dtype=np.uint32),
            np.zeros(2, dtype=np.uint32), np.zeros(2, dtype=np.int32), np.empty(1, dtype=np.bool_))


@kernel(example=_refs_fit_example)
def refs_fit_kernel(ids: IdArray, refs_target: NDArray[np.int32],
                    refs_epoch: NDArray[np.uint32], target_epoch: NDArray[np.uint32],
                    first_row: NDArray[np.int32], out: Bools) -> None:
    """``out[i]``: every reference of index block ``ids[i]`` (prompt row ``i``) is at its
    target's epoch and the target allows row ``i``. An unused reference (-1) reads the extra
    last entry of both tables, which it always passes; a reference outside the target group
    (corrupt metadata) fails, never read. Stops at a row's first bad reference."""
    unused = target_epoch.size - 1
    for row in range(ids.size):
        block = ids[row]
        ok = True
        for j in range(refs_target.shape[1]):
            target = refs_target[block, j]
            if target == -1:
                target = unused
            elif target < 0 or target >= unused:
                ok = False
                break
            if target_epoch[target] != refs_epoch[block, j] or first_row[target] > row:
                ok = False
                break
        out[row] = ok


def _rows_clean(bad: Bools) -> Bools:
    """Per row of a ``[n, k]`` mask: no entry set. Reductions along a short last axis are slow
    in NumPy, and bad entries are rare, so find the flat positions of the few that are set."""
    clean = np.ones(bad.shape[0], dtype=np.bool_)
    clean[np.flatnonzero(bad) // bad.shape[1]] = False
    return clean


def _rows_of(array: _Rows, rows: IdArray) -> _Rows:
    """``array[rows]``, as a view when the rows are one contiguous run (blocks allocated
    together usually are), which saves a gather."""
    count = rows.size
    if count and int(rows[-1]) - int(rows[0]) == count - 1 and \
            (count < 2 or bool((np.diff(rows) == 1).all())):
        return array[int(rows[0]) : int(rows[0]) + count]
    return array[rows]


class IndexCheck:
    """The reference checks of one sparse-index group's blocks in one prompt.

    ``ids`` are the prompt's index blocks by row (0 where missing: such rows fail elsewhere);
    ``history_ids`` the prompt's history blocks by position (-1 where missing), or None to check
    only liveness and epochs.
    """

    def __init__(self, group: GroupState, ids: IdArray, history_ids: IdArray | None) -> None:
        target = group.target
        assert target is not None, f"group {group.decl.name!r} has no target group"
        self.group, self.target, self.ids = group, target, ids
        size = group.decl.block_size
        # Tables over targets, with one extra last entry that unused references read.
        epoch = np.empty(target.n_blocks + 1, dtype=np.uint32)
        epoch[:-1] = target.epoch
        epoch[-1] = 0  # an unused reference is recorded with epoch 0
        alive = target.table.hashed[target.states]
        first_row = np.full(target.n_blocks + 1, NEVER, dtype=np.int32)
        first_row[-1] = -1
        if history_ids is None:
            first_row[:-1][alive] = -1
        else:
            # A target is allowed from the first row whose block ends at or after the end of
            # its history block, and only if it is this prompt's block at its position.
            position = target.position
            inside = np.flatnonzero(alive & (position >= 0) & (position < history_ids.size))
            mine = inside[history_ids[position[inside]] == inside]
            ends = (position[mine].astype(np.int64) + 1) * target.decl.block_size
            first_row[mine] = (ends + size - 1) // size - 1
        self._epoch, self._first_row = epoch, first_row
        #: Per prompt row: every reference current and allowed.
        self.fit = self._fit()

    def _fit(self) -> Bools:
        group, n = self.group, self.ids.size
        fit = np.empty(n, dtype=np.bool_)
        if jit.enabled:
            refs_fit_kernel(self.ids, group.refs_target, group.refs_epoch, self._epoch,
                            self._first_row, fit)
            return fit
        refs, epochs = _rows_of(group.refs_target, self.ids), _rows_of(group.refs_epoch, self.ids)
        refs, outside = self._in_range(refs)
        rows = np.arange(n, dtype=np.int32)[:, None]
        bad = (self._epoch[refs] != epochs) | (self._first_row[refs] > rows)
        return _rows_clean(bad if outside is None else bad | outside)

    def _in_range(self, refs: NDArray[np.int32]) -> tuple[NDArray[np.int32], Bools | None]:
        """``refs`` safe to gather with, and where they pointed outside the target group
        (corrupt metadata: such references fail), or None when none did (checked in two
        reductions, the common case)."""
        if not refs.size or (int(refs.min()) >= NO_TARGET
                             and int(refs.max()) < self.target.n_blocks):
            return refs, None
        outside = (refs < NO_TARGET) | (refs >= self.target.n_blocks)
        return np.where(outside, NO_TARGET, refs).astype(np.int32), outside

    def targets_resident(self) -> Bools:
        """Per prompt row: every target readable now (needed only for a restore plan; restoring
        a target bumps its epoch, which would make the index stale)."""
        target = self.target
        readable = np.empty(target.n_blocks + 1, dtype=np.bool_)
        readable[:-1] = target.table.readable[target.states]
        readable[-1] = True
        refs, outside = self._in_range(self.group.refs_target[self.ids])
        bad = ~readable[refs]
        return _rows_clean(bad if outside is None else bad | outside)

    def reason(self, row: int) -> Reason:
        """Why row ``row`` failed: a stale or dead target, or a target not of this prompt."""
        block = int(self.ids[row])
        refs, outside = self._in_range(self.group.refs_target[block])
        stale = (self._epoch[refs] != self.group.refs_epoch[block]) | ~self._alive(refs)
        if outside is not None:
            stale |= outside
        return Reason.INDEX_STALE if bool(stale.any()) else Reason.GROUP_GAP

    def _alive(self, refs: NDArray[np.int32]) -> Bools:
        target = self.target
        alive = np.ones(refs.size, dtype=np.bool_)
        used = refs >= 0
        alive[used] = target.table.hashed[target.states[refs[used]]]
        return alive
