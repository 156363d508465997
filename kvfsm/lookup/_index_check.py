"""Why a sparse-index row failed its reference checks.

An index block is usable only if each reference (target, epoch) holds: the target is hashed,
at that epoch, and this prompt's history block there, complete before the index block ends.
An unused reference (-1, epoch 0) passes; one outside the target group always fails, unread.
The checks run in :mod:`kvfsm.lookup._group_pass`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.state import NO_TARGET, GroupState

Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]


class _Refs(NamedTuple):
    """References of some prompt rows, and what the checks need to know of them."""

    targets: NDArray[np.int32]  # [rows, top_k], -1 unused, out-of-range entries replaced by -1
    epochs: NDArray[np.uint32]  # [rows, top_k]
    used: Bools  # [rows, top_k]: a real target (in range)
    outside: Bools | None  # [rows, top_k]: out of range (None: none are)
    safe: NDArray[np.int32]  # targets with unused entries replaced by 0, to gather with


def _refs(targets: NDArray[np.int32], epochs: NDArray[np.uint32], n_targets: int) -> _Refs:
    """The references ``[rows, top_k]`` into a target group of ``n_targets`` blocks."""
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


class IndexCheck:
    """The reference checks of one index group's blocks in one prompt, as the group pass
    found them: ``ids`` by row (0 where missing: such rows fail elsewhere), ``fit`` per row."""

    def __init__(self, group: GroupState, ids: IdArray, fit: Bools) -> None:
        target = group.target
        assert target is not None, f"group {group.decl.name!r} has no target group"
        self.group, self.target, self.ids = group, target, ids
        #: Per prompt row: every reference current and allowed.
        self.fit = fit

    def reason(self, row: int) -> Reason:
        """Why row ``row`` failed: a stale or dead target, or a target not of this prompt."""
        stale = bool(self.stale_rows(np.array([row], dtype=np.int64))[0])
        return Reason.INDEX_STALE if stale else Reason.GROUP_GAP

    def stale_rows(self, rows: NDArray[np.int64]) -> Bools:
        """Per failed row: some reference is stale or dead (else a group gap)."""
        target, block = self.target, self.ids[rows]
        refs = _refs(self.group.refs_target[block], self.group.refs_epoch[block], target.n_blocks)
        stale = _stale(refs, target.epoch, target.states, target.table.hashed)
        rows_stale: Bools = np.asarray(stale.any(axis=1))
        return rows_stale
