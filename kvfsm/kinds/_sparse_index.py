"""Sparse routing index: every index block of the prefix, raw, with current references.

An index block's row is usable only where each of its ``top_k`` references (target block,
epoch) still holds: the target is alive (hashed), at the epoch it was indexed against, the
history block of this prompt at its position, and complete before the index row (its query
position) that points at it. An unused reference (:data:`NO_TARGET`, recorded with epoch 0)
always holds; one outside the target group (corrupt metadata) never does.
:func:`references_hold` states that rule over arrays (the reference); :func:`history_positions`
and :func:`index_rows` state it row by row, as the lookup's compiled group pass
(``kvfsm/lookup/_group_pass.py``) runs it for an index group before its own loop (compiled into
it: plain loops over plain arrays).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import inlined
from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import GroupDecl, GroupKind

#: A reference slot an index row does not use.
NO_TARGET: Final = -1

Bools = NDArray[np.bool_]


class References(NamedTuple):
    """What :func:`references_hold` found, per reference (``[rows, top_k]``) and per row."""

    #: A real reference (not :data:`NO_TARGET`).
    used: Bools
    #: The target is the history block of this prompt at the target's position.
    ours: Bools
    #: The target's position in the prompt's history (0 where it has none).
    at: NDArray[np.int64]
    #: Per row: every reference holds.
    fit: Bools
    #: Per row: some reference is stale (its target dead, at another epoch, or outside the
    #: target group; an unused one recorded with an epoch), not merely of another prompt.
    stale: Bools


def current_references(targets: NDArray[np.int32], epochs: NDArray[np.uint32], *,
                       target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8],
                       hashed: Bools) -> Bools:
    """Per reference: its target lies in the target group, is alive (``hashed[state]``) and at
    the epoch recorded (``NO_TARGET`` and any other id outside the group: False, unread)."""
    in_range = (targets >= 0) & (targets < target_epoch.size)
    held = np.where(in_range, targets, 0)
    current: Bools = in_range & hashed[target_states[held]] & (target_epoch[held] == epochs)
    return current


def references_hold(targets: NDArray[np.int32], epochs: NDArray[np.uint32],
                    rows: NDArray[np.int64], *, target_epoch: NDArray[np.uint32],
                    target_states: NDArray[np.uint8], hashed: Bools,
                    target_position: NDArray[np.int32],
                    history_ids: NDArray[np.int64], target_size: int, own_size: int
                    ) -> References:
    """The rule, for the index rows at prompt rows ``rows`` with references ``targets`` /
    ``epochs`` (``[rows, top_k]``) into a target group whose blocks have ``target_epoch``,
    ``target_states`` (alive where ``hashed[state]``) and ``target_position``; it reads only
    the targets named, never the whole group. ``history_ids`` are the prompt's
    target blocks by position (-1 where missing), ``target_size`` / ``own_size`` the two
    groups' block sizes in tokens."""
    n_targets, n_history = target_epoch.size, history_ids.size
    used = targets != NO_TARGET
    in_range = (targets >= 0) & (targets < n_targets)
    held = np.where(in_range, targets, 0)
    at = target_position[held].astype(np.int64)
    placed = in_range & (at >= 0) & (at < n_history)
    at = np.where(placed, at, 0)
    ours = placed & (history_ids[at] == held) if n_history else np.zeros_like(placed)
    # The first index row whose query position comes after the target block's last token.
    first_row = ((at + 1) * target_size + own_size - 1) // own_size - 1
    current = current_references(targets, epochs, target_epoch=target_epoch,
                                 target_states=target_states, hashed=hashed)
    bad = np.where(used, ~(ours & current & (first_row <= rows[:, None])), epochs != 0)
    return References(used, ours, at, ~np.asarray(bad.any(axis=1)),
                      stale_rows(targets, epochs, current))


def stale_rows(targets: NDArray[np.int32], epochs: NDArray[np.uint32], current: Bools) -> Bools:
    """Per row of references ``targets`` / ``epochs`` (``current``: their
    :func:`current_references`): :attr:`References.stale`."""
    stale: Bools = np.asarray(np.where(targets != NO_TARGET, ~current, epochs != 0).any(axis=1))
    return stale


@inlined
def history_positions(history_ids: NDArray[np.int64], target_states: NDArray[np.uint8],
                      target_epoch: NDArray[np.uint32], hashed: NDArray[np.int64],
                      target_size: int, own_size: int, rows: int,
                      epoch_at: NDArray[np.uint32], first_row_at: NDArray[np.int64]) -> None:
    """Per position of the prompt's history (``history_ids``, -1 where missing): the epoch of
    the block there into ``epoch_at`` (left 0 where none is alive: ``hashed[state]`` 0), and
    into ``first_row_at`` the first index row allowed to point at it (the first whose query
    position comes after the block's last token; ``rows``, past every row, where none is
    alive), so that each reference then costs two small reads."""
    for at in range(history_ids.size):
        held = history_ids[at]
        if held < 0 or not hashed[target_states[held]]:
            first_row_at[at] = rows
        else:
            epoch_at[at] = target_epoch[held]
            first_row_at[at] = ((at + 1) * target_size + own_size - 1) // own_size - 1


@inlined
def row_references(block: int, row: int, targets: NDArray[np.int32],
                   epochs: NDArray[np.uint32], target_position: NDArray[np.int32],
                   history_ids: NDArray[np.int64], history_settled: Bools,
                   all_settled: bool, epoch_at: NDArray[np.uint32],
                   first_row_at: NDArray[np.int64]) -> tuple[bool, bool]:
    """Index block ``block`` at prompt row ``row``: whether every one of its references
    (``targets[block]``, ``epochs[block]``) holds by the rule above, with the history's
    positions as :func:`history_positions` wrote them; and whether every target it names
    already sits settled (``all_settled``, or its position's ``history_settled``), so that
    no restore will move it (a reference to a target of no position: as ``all_settled``).
    Stops at the first reference that answers both."""
    fit, settled = True, True
    n_targets, n_history = target_position.size, history_ids.size
    for j in range(targets.shape[1]):
        target, epoch = targets[block, j], epochs[block, j]
        if target == NO_TARGET:
            if epoch != 0:
                fit = False
            continue
        if target < 0 or target >= n_targets:
            return False, all_settled
        at = target_position[target]
        if not (0 <= at < n_history and history_ids[at] == target):
            return False, all_settled
        if not all_settled and not history_settled[at]:
            settled = False
        if fit:
            fit = epoch_at[at] == epoch and first_row_at[at] <= row
        if not fit and (all_settled or not settled):
            break
    return fit, settled


@inlined
def same_references(block: int, previous: int, refs_target: NDArray[np.int32],
                    refs_epoch: NDArray[np.uint32]) -> bool:
    """Index block ``block`` holds the references block ``previous`` holds."""
    if block == previous:
        return True
    for j in range(refs_target.shape[1]):
        if refs_target[block, j] != refs_target[previous, j] or \
                refs_epoch[block, j] != refs_epoch[previous, j]:
            return False
    return True


def index_rows(ids: NDArray[np.int64], targets: NDArray[np.int32], epochs: NDArray[np.uint32],
               target_position: NDArray[np.int32], history_ids: NDArray[np.int64],
               history_settled: Bools, all_settled: bool, epoch_at: NDArray[np.uint32],
               first_row_at: NDArray[np.int64], fit: Bools, settled: Bools) -> None:
    """Per prompt row ``i`` (block ``ids[i]``, -1: missing, which fits nothing): into ``fit[i]``
    whether every reference of its block holds, into ``settled[i]`` whether every target it
    names sits settled (:func:`row_references`). A row holding the references of the row before,
    which all held, takes that row's answers: a target allowed from a row is allowed later."""
    previous = -1  # the row before's block where every reference held
    for i in range(ids.size):
        block = ids[i]
        if block < 0:
            fit[i], settled[i] = False, True
        elif previous >= 0 and same_references(block, previous, targets, epochs):
            fit[i], settled[i] = True, settled[i - 1]
        else:
            fit[i], settled[i] = row_references(block, i, targets, epochs, target_position,
                                                history_ids, history_settled, all_settled,
                                                epoch_at, first_row_at)
        previous = block if fit[i] and block >= 0 else -1


class SparseIndexRule(KindRule):
    kind = GroupKind.SPARSE_INDEX
    has_targets = True

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        start = np.zeros_like(lengths)
        return Needed(start, start, self.blocks_at(decl, lengths))

    def index_width(self, decl: GroupDecl) -> int:
        return decl.top_k or 0
