"""Sparse-index checks: every reference of an index block points at a current target of this
prompt's history.

An index block of a prompt is usable only if each of its ``top_k`` references (target block,
epoch) still holds: the target is hashed (alive) and at the epoch it was indexed against, and,
when the prompt's history group is known, it is the history block of this prompt at its
position and complete before the index block ends (layer 3, position/index intersection). An
unused reference (-1, recorded with epoch 0) always passes; one outside the target group
(corrupt metadata) always fails and is never read.

Every check reads only the references of the prompt's rows and the targets they name, so a
lookup costs the same whatever the size of the pools.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm._jit import settings as jit
from kvfsm.state import NO_TARGET, GroupState
from kvfsm.verify._types import Reason

Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]
_Rows = TypeVar("_Rows", NDArray[np.int32], NDArray[np.uint32])
#: First allowed row of a history block no row may point at (it is dead).
NEVER = np.iinfo(np.int32).max


class _Refs(NamedTuple):
    """References of some prompt rows, and what the checks need to know of them."""

    targets: NDArray[np.int32]  # [rows, top_k], -1 unused, out-of-range entries replaced by -1
    epochs: NDArray[np.uint32]  # [rows, top_k]
    used: Bools  # [rows, top_k]: a real target (in range)
    outside: Bools | None  # [rows, top_k]: out of range (None: none are)
    safe: NDArray[np.int32]  # targets with unused entries replaced by 0, to gather with


def _refs_fit_example() -> tuple[object, ...]:
    refs = np.full((1, 2), -1, dtype=np.int32)
    words, positions = np.zeros(2, dtype=np.uint32), np.zeros(2, dtype=np.int32)
    # A group's states and its table's per-state facts are read-only views.
    states, hashed = read_only(np.zeros(2, dtype=np.uint8)), read_only(np.ones(1, dtype=np.bool_))
    return (np.zeros(1, dtype=np.intp), refs, np.zeros((1, 2), dtype=np.uint32), words,
            states, hashed, positions, np.zeros(1, dtype=np.intp), words, positions, True,
            np.empty(1, dtype=np.bool_))


@kernel(example=_refs_fit_example)
def refs_fit_kernel(ids: IdArray, refs_target: NDArray[np.int32],
                    refs_epoch: NDArray[np.uint32], target_epoch: NDArray[np.uint32],
                    target_states: NDArray[np.uint8], hashed: Bools,
                    target_position: NDArray[np.int32], history_ids: IdArray,
                    epoch_at: NDArray[np.uint32], first_row_at: NDArray[np.int32],
                    check_history: bool, out: Bools) -> None:
    """``out[i]``: every reference of index block ``ids[i]`` (prompt row ``i``) passes (see the
    module docstring). With the prompt's history a target is looked up by its position in the
    small per-position tables; without, its epoch and state are read. Stops at a row's first
    bad reference."""
    n_targets = target_epoch.size
    for row in range(ids.size):
        block = ids[row]
        ok = True
        for j in range(refs_target.shape[1]):
            target = refs_target[block, j]
            epoch = refs_epoch[block, j]
            if target == -1:
                ok = epoch == 0
            elif target < 0 or target >= n_targets:
                ok = False
            elif check_history:
                position = target_position[target]
                ok = 0 <= position < history_ids.size and history_ids[position] == target \
                    and epoch_at[position] == epoch and first_row_at[position] <= row
            else:
                ok = target_epoch[target] == epoch and hashed[target_states[target]]
            if not ok:
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
        self.group, self.target, self.ids, self.history_ids = group, target, ids, history_ids
        # Per position of the prompt's history (small: the prompt's blocks, not the pool's):
        # the epoch of the block there, and the first index row allowed to point at it (the
        # first whose block ends at or after the history block's end; never if it is dead).
        self._epoch_at = np.zeros(0, dtype=np.uint32)
        self._first_row_at = np.zeros(0, dtype=np.int32)
        if history_ids is not None:
            held = np.maximum(history_ids, 0)
            alive = (history_ids >= 0) & target.table.hashed[target.states[held]]
            ends = (np.arange(history_ids.size, dtype=np.int64) + 1) * target.decl.block_size
            size = group.decl.block_size
            self._epoch_at = target.epoch[held]
            self._first_row_at = np.where(alive, (ends + size - 1) // size - 1,
                                          NEVER).astype(np.int32)
        #: Per prompt row: every reference current and allowed.
        self.fit = self._fit()

    def _fit(self) -> Bools:
        group, target, n = self.group, self.target, self.ids.size
        history = self.history_ids
        if jit.enabled:
            fit = np.empty(n, dtype=np.bool_)
            refs_fit_kernel(
                self.ids, group.refs_target, group.refs_epoch, target.epoch, target.states,
                target.table.hashed, target.position,
                history if history is not None else np.zeros(0, dtype=np.intp),
                self._epoch_at, self._first_row_at, history is not None, fit)
            return fit
        refs = self._refs(_rows_of(group.refs_target, self.ids),
                          _rows_of(group.refs_epoch, self.ids))
        return _rows_clean(self._bad(refs, np.arange(n)))

    def _refs(self, targets: NDArray[np.int32], epochs: NDArray[np.uint32]) -> _Refs:
        n_targets = self.target.n_blocks
        outside: Bools | None = None
        if targets.size and (int(targets.min()) < NO_TARGET or int(targets.max()) >= n_targets):
            outside = (targets < NO_TARGET) | (targets >= n_targets)
            targets = np.where(outside, NO_TARGET, targets).astype(np.int32)
        used = targets != NO_TARGET
        return _Refs(targets, epochs, used, outside, np.where(used, targets, 0).astype(np.int32))

    def _stale(self, refs: _Refs) -> Bools:
        """Per reference: not at its target's epoch, target dead, or out of range (an unused
        reference only if its recorded epoch is not 0)."""
        target = self.target
        current = np.where(refs.used, target.epoch[refs.safe], 0) == refs.epochs
        alive = target.table.hashed[target.states[refs.safe]] | ~refs.used
        stale: Bools = ~(current & alive)
        return stale if refs.outside is None else stale | refs.outside

    def _bad(self, refs: _Refs, rows: NDArray[np.int64]) -> Bools:
        """Per reference of the given prompt rows: stale, or (with the prompt's history) not
        this prompt's history block at its position, or not complete before its row ends."""
        history = self.history_ids
        if history is None:
            return self._stale(refs)
        if history.size:
            position = self.target.position[refs.safe]
            inside = (position >= 0) & (position < history.size)
            at = np.where(inside, position, 0)
            fits = inside & (history[at] == refs.safe) & (self._epoch_at[at] == refs.epochs) & \
                (self._first_row_at[at] <= rows[:, None])
        else:  # a prompt shorter than one history block: no target can be of it
            fits = np.zeros(refs.used.shape, dtype=np.bool_)
        bad: Bools = np.where(refs.used, ~fits, refs.epochs != 0)
        return bad if refs.outside is None else bad | refs.outside

    def targets_resident(self) -> Bools:
        """Per prompt row: every target readable now (needed only for a restore plan; restoring
        a target bumps its epoch, which would make the index stale)."""
        target = self.target
        refs = self._refs(self.group.refs_target[self.ids], self.group.refs_epoch[self.ids])
        readable = target.table.readable[target.states[refs.safe]] | ~refs.used
        return _rows_clean(~readable if refs.outside is None else ~readable | refs.outside)

    def reason(self, row: int) -> Reason:
        """Why row ``row`` failed: a stale or dead target, or a target not of this prompt."""
        block = self.ids[row : row + 1]
        refs = self._refs(self.group.refs_target[block], self.group.refs_epoch[block])
        return Reason.INDEX_STALE if bool(self._stale(refs).any()) else Reason.GROUP_GAP
