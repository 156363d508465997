"""Sparse-index checks: every reference of an index block points at a current target of this
prompt's history.

An index block of a prompt is usable only if each of its ``top_k`` references (target block,
epoch) still holds: the target is hashed (alive) and at the epoch it was indexed against, and
it is the history block of this prompt at its position and complete before the index block
ends (layer 3, position/index intersection). An unused reference (-1, recorded with epoch 0)
always passes; one outside the target group (corrupt metadata) always fails and is never
read.

Every check reads only the references of the prompt's rows and the targets they name, so a
lookup costs the same whatever the size of the pools. The checks run in the group pass
(:mod:`kvfsm.lookup._group_pass`); this module tells why a row failed.
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


class IndexCheck:
    """The reference checks of one sparse-index group's blocks in one prompt, as a lookup's
    group pass found them: ``ids`` are the prompt's index blocks by row (0 where missing:
    such rows fail elsewhere), ``fit`` per row whether every reference is current and of this
    prompt's history (:func:`~kvfsm.lookup._group_pass.group_pass` checks them)."""

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
        """Per failed row of ``rows``: some reference is stale or dead (else its targets are
        current but not all of this prompt's history: a group gap)."""
        target, block = self.target, self.ids[rows]
        refs = _refs(self.group.refs_target[block], self.group.refs_epoch[block], target.n_blocks)
        stale = _stale(refs, target.epoch, target.states, target.table.hashed)
        rows_stale: Bools = np.asarray(stale.any(axis=1))
        return rows_stale
