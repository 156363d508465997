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
from kvfsm._reasons import Reason
from kvfsm.state import NO_TARGET, GroupState

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
    # A group's metadata arrays, its states and its table's per-state facts are read-only
    # views; the per-position tables of the prompt's history are fresh arrays.
    refs = read_only(np.full((1, 2), -1, dtype=np.int32))
    refs_epoch = read_only(np.zeros((1, 2), dtype=np.uint32))
    target_epoch, target_position = (read_only(np.zeros(2, dtype=np.uint32)),
                                     read_only(np.zeros(2, dtype=np.int32)))
    states, hashed = read_only(np.zeros(2, dtype=np.uint8)), read_only(np.ones(1, dtype=np.bool_))
    return (np.zeros(1, dtype=np.intp), refs, refs_epoch, target_epoch, states, hashed,
            target_position, np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32),
            np.zeros(1, dtype=np.int32), True, np.empty(1, dtype=np.bool_))


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


def _refs(targets: NDArray[np.int32], epochs: NDArray[np.uint32], n_targets: int) -> _Refs:
    """The references ``targets`` / ``epochs`` (``[rows, top_k]``) into a target group of
    ``n_targets`` blocks."""
    outside: Bools | None = None
    if targets.size and (int(targets.min()) < NO_TARGET or int(targets.max()) >= n_targets):
        outside = (targets < NO_TARGET) | (targets >= n_targets)
        targets = np.where(outside, NO_TARGET, targets).astype(np.int32)
    used = targets != NO_TARGET
    return _Refs(targets, epochs, used, outside, np.where(used, targets, 0).astype(np.int32))


def _stale(refs: _Refs, target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8],
           hashed: Bools) -> Bools:
    """Per reference: not at its target's epoch, target dead, or out of range (an unused
    reference only if its recorded epoch is not 0)."""
    current = np.where(refs.used, target_epoch[refs.safe], 0) == refs.epochs
    alive = hashed[target_states[refs.safe]] | ~refs.used
    stale: Bools = ~(current & alive)
    return stale if refs.outside is None else stale | refs.outside


def _refs_fit_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Index rows (a contiguous run of blocks or any) whose references are unused, out of range
    or into a small target group; the prompt's history mostly consistent with the targets'
    positions and epochs (so the row bound decides), with some entries made wrong; checked with
    or without the history."""
    n_index, n_targets, top_k = (int(rng.integers(1, high)) for high in (9, 9, 5))
    n_states, n = int(rng.integers(1, 5)), int(rng.integers(0, n_index + 1))
    if rng.random() < 0.5:
        start = int(rng.integers(0, n_index - n + 1))
        ids = np.arange(start, start + n, dtype=np.intp)
    else:
        ids = rng.integers(0, n_index, n).astype(np.intp)
    target_epoch = rng.integers(0, 2, n_targets).astype(np.uint32)
    # The history: distinct targets by position (some missing), each recorded at its position.
    history_ids = rng.permutation(n_targets)[: int(rng.integers(0, n_targets + 1))].astype(np.intp)
    history_ids[rng.random(history_ids.size) < 0.1] = -1
    target_position = np.full(n_targets, -1, dtype=np.int32)
    held = np.flatnonzero(history_ids >= 0)
    target_position[history_ids[held]] = held
    epoch_at = target_epoch[np.maximum(history_ids, 0)]
    first_row_at = rng.integers(0, n + 1, history_ids.size).astype(np.int32)
    first_row_at[rng.random(history_ids.size) < 0.2] = NEVER
    # A few entries wrong: a target recorded elsewhere, an epoch the history does not have.
    wrong = rng.random(n_targets) < 0.2
    target_position[wrong] = rng.integers(-1, history_ids.size + 2, int(wrong.sum()))
    epoch_at[rng.random(history_ids.size) < 0.1] ^= 1
    # References: mostly real targets at their epoch; now and then unused (-1, at epoch 0 or
    # not), out of range or another negative.
    refs_target = rng.integers(0, n_targets, (n_index, top_k)).astype(np.int32)
    refs_epoch = target_epoch[refs_target]
    refs_epoch[rng.random((n_index, top_k)) < 0.1] ^= 1
    odd = rng.random((n_index, top_k))
    refs_target[odd < 0.3] = NO_TARGET
    refs_epoch[odd < 0.25] = 0
    refs_target[(odd >= 0.3) & (odd < 0.33)] = n_targets + int(rng.integers(0, 2))
    refs_target[(odd >= 0.33) & (odd < 0.35)] = -2 - int(rng.integers(0, 2))
    return (ids, read_only(refs_target), read_only(refs_epoch), read_only(target_epoch),
            read_only(rng.integers(0, n_states, n_targets).astype(np.uint8)),
            read_only(rng.random(n_states) < 0.8), read_only(target_position), history_ids,
            epoch_at, first_row_at, bool(rng.random() < 0.6), rng.random(n) < 0.5)


def _refs_fit_twin(ids: IdArray, refs_target: NDArray[np.int32],
                   refs_epoch: NDArray[np.uint32], target_epoch: NDArray[np.uint32],
                   target_states: NDArray[np.uint8], hashed: Bools,
                   target_position: NDArray[np.int32], history_ids: IdArray,
                   epoch_at: NDArray[np.uint32], first_row_at: NDArray[np.int32],
                   check_history: bool, out: Bools) -> None:
    """:func:`refs_fit_kernel` as array operations over every reference of the rows: a
    reference is bad when stale, or (with the prompt's history) not this prompt's history block
    at its position, or not complete before its row ends."""
    refs = _refs(_rows_of(refs_target, ids), _rows_of(refs_epoch, ids), target_epoch.size)
    if not check_history:
        out[:] = _rows_clean(_stale(refs, target_epoch, target_states, hashed))
        return
    if history_ids.size:
        position = target_position[refs.safe]
        inside = (position >= 0) & (position < history_ids.size)
        at = np.where(inside, position, 0)
        rows = np.arange(ids.size)
        fits = inside & (history_ids[at] == refs.safe) & (epoch_at[at] == refs.epochs) & \
            (first_row_at[at] <= rows[:, None])
    else:  # a prompt shorter than one history block: no target can be of it
        fits = np.zeros(refs.used.shape, dtype=np.bool_)
    bad: Bools = np.where(refs.used, ~fits, refs.epochs != 0)
    out[:] = _rows_clean(bad if refs.outside is None else bad | refs.outside)


@kernel(example=_refs_fit_example, twin=_refs_fit_twin, inputs=_refs_fit_inputs)
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


class IndexCheck:
    """The reference checks of one sparse-index group's blocks in one prompt.

    ``ids`` are the prompt's index blocks by row (0 where missing: such rows fail elsewhere);
    ``history_ids`` the prompt's history blocks by position (-1 where missing), or None to check
    only liveness and epochs; ``fit``, the rows' answers where a lookup's pass already has them.
    """

    def __init__(self, group: GroupState, ids: IdArray, history_ids: IdArray | None, *,
                 fit: Bools | None = None) -> None:
        target = group.target
        assert target is not None, f"group {group.decl.name!r} has no target group"
        self.group, self.target, self.ids, self.history_ids = group, target, ids, history_ids
        if fit is not None:
            #: Per prompt row: every reference current and allowed (here as a lookup's pass
            #: already found it).
            self.fit = fit
            return
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
        group, target, history = self.group, self.target, self.history_ids
        fit = np.empty(self.ids.size, dtype=np.bool_)
        refs_fit_kernel(
            self.ids, group.refs_target, group.refs_epoch, target.epoch, target.states,
            target.table.hashed, target.position,
            history if history is not None else np.zeros(0, dtype=np.intp),
            self._epoch_at, self._first_row_at, history is not None, fit)
        return fit

    def targets_resident(self) -> Bools:
        """Per prompt row: every target readable now (needed only for a restore plan; restoring
        a target bumps its epoch, which would make the index stale)."""
        target = self.target
        refs = _refs(self.group.refs_target[self.ids], self.group.refs_epoch[self.ids],
                     target.n_blocks)
        readable = target.table.readable[target.states[refs.safe]] | ~refs.used
        return _rows_clean(~readable if refs.outside is None else ~readable | refs.outside)

    def reason(self, row: int) -> Reason:
        """Why row ``row`` failed: a stale or dead target, or a target not of this prompt."""
        target, block = self.target, self.ids[row : row + 1]
        refs = _refs(self.group.refs_target[block], self.group.refs_epoch[block], target.n_blocks)
        stale = _stale(refs, target.epoch, target.states, target.table.hashed)
        return Reason.INDEX_STALE if bool(stale.any()) else Reason.GROUP_GAP
