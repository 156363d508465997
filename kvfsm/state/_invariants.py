"""The invariants of the state core, written once.

The four lifecycle-level invariants are the exhaustive checker's own (:data:`BUILTIN_INVARIANTS`,
evaluated here on the per-state counts of the real core); the rest need per-block detail that
only the real core has. Tests, the stateful fuzzer and :meth:`StateCore.check_invariants` all
call :func:`core_problems`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvfsm.fsm import BUILTIN_INVARIANTS, Bounds, View
from kvfsm.spec import Tier
from kvfsm.state._group import NO_TARGET, GroupState

if TYPE_CHECKING:
    from kvfsm.state._core import StateCore


@attrs.frozen
class CoreInvariant:
    name: str
    doc: str
    problems: Callable[[GroupState], list[str]]


def _view(group: GroupState) -> View:
    n_states = group.table.n_states
    pinned = group.pins > 0
    capacity = {tier: pool.capacity for tier, pool in group.pools.items()} | group.stored
    return View(
        group.table,
        Bounds(objects=group.n_blocks, capacity=capacity),
        np.bincount(group.states[~pinned], minlength=n_states),
        np.bincount(group.states[pinned], minlength=n_states),
    )


def _lifecycle_level(group: GroupState) -> list[str]:
    view = _view(group)
    return [f"{inv.name}: {inv.doc}" for inv in BUILTIN_INVARIANTS if not inv.holds(view)]


def _slots_owned_once(group: GroupState) -> list[str]:
    out: list[str] = []
    ids = np.arange(group.n_blocks)
    for tier, pool in group.pools.items():
        out += [f"{tier.spec_name} pool: {p}" for p in pool.problems()]
        slots = group.slot[tier]
        held = slots != -1
        if np.unique(slots[held]).size != int(held.sum()):
            out.append(f"{tier.spec_name}: a slot is held by two blocks")
        wrong_owner = pool.owner[slots[held]] != ids[held]
        if wrong_owner.any():
            out.append(f"{tier.spec_name}: blocks {ids[held][wrong_owner][:8].tolist()} hold "
                       "slots the physical line gives to another owner")
        if pool.used != int(held.sum()):
            out.append(f"{tier.spec_name}: pool has {pool.used} used slots, blocks hold "
                       f"{int(held.sum())}")
    for tier, capacity in group.stored.items():
        copies = int(group.holds(tier).sum())
        if copies != group.stored_used(tier) or copies > capacity:
            out.append(f"{tier.spec_name}: {copies} blocks hold a copy, the count says "
                       f"{group.stored_used(tier)} of {capacity}")
    return out


def _lines_agree(group: GroupState) -> list[str]:
    out: list[str] = []
    for tier in Tier:
        expected = group.table.holds_slot[group.states, tier]
        held = group.holds(tier)
        bad = np.flatnonzero(expected != held)
        if bad.size:
            out.append(f"{tier.spec_name}: blocks {bad[:8].tolist()} disagree between lifecycle "
                       "state and slot held")
    return out


def _hash_map_complete(group: GroupState) -> list[str]:
    complete = group.table.hashed & group.table.complete
    high, low, blocks = group.hash_map.entries()
    incomplete = ~complete[group.states[blocks]]
    out = [f"block {block} reachable by hash in state "
           f"{group.table.state_name(int(group.states[block]))!r}"
           for block in blocks[incomplete][:8].tolist()]
    elsewhere = ~incomplete & ((group.hash_high[blocks] != high) | (group.hash_low[blocks] != low))
    out += [f"block {block} is mapped under another block's hash"
            for block in blocks[elsewhere][:8].tolist()]
    return out


def _hash_table_sound(group: GroupState) -> list[str]:
    return group.hash_map.problems()


def _index_targets_current(group: GroupState) -> list[str]:
    if group.target is None:
        return []
    live = np.flatnonzero(group.table.readable[group.states])
    stale = live[~group.targets_current(live)]
    return [f"readable index blocks {stale[:8].tolist()} point at freed or reused blocks"] \
        if stale.size else []


def _dependents_exact(group: GroupState) -> list[str]:
    if group.dependents is None:
        return []
    linked = np.flatnonzero((group.refs_target != NO_TARGET).any(axis=1)).astype(np.intp)
    return group.dependents.problems(group.refs_target, linked)


def _sub_blocks_complete(group: GroupState) -> list[str]:
    complete = group.table.complete[group.states]
    bad = np.flatnonzero(complete & (group.sub_blocks != group.full_sub_mask))
    return [f"complete blocks {bad[:8].tolist()} miss sub-blocks"] if bad.size else []


def _free_ids_exact(group: GroupState) -> list[str]:
    stacked = np.sort(group.free_ids[: group.free_top])
    free = np.flatnonzero(group.states == group.table.initial)
    return [] if np.array_equal(stacked, free) else ["free-id stack differs from free blocks"]


def _recency_exact(group: GroupState) -> list[str]:
    return group.recency.problems(group.states, group.last_use)


def _restores_counted(group: GroupState) -> list[str]:
    restoring = int(group.table.restoring[group.states].sum())
    return [] if restoring == group.restores_in_flight() else [
        f"{restoring} blocks are restoring, the count says {group.restores_in_flight()}"]


CORE_INVARIANTS: tuple[CoreInvariant, ...] = (
    CoreInvariant("lifecycle", "the exhaustive checker's invariants hold on the real counts",
                  _lifecycle_level),
    CoreInvariant("slot_owned_once", "each slot is free or owned by exactly one block; "
                  "free + used = capacity per tier", _slots_owned_once),
    CoreInvariant("lines_agree", "the logical tier/slot of every block matches the physical line",
                  _lines_agree),
    CoreInvariant("hash_complete", "no block is reachable by hash unless its content is complete",
                  _hash_map_complete),
    CoreInvariant("hash_table_sound", "every hash map entry is found by lookup; the live and "
                  "tombstone counts match the table's slots", _hash_table_sound),
    CoreInvariant("index_current", "a readable index never points to a freed or reused block",
                  _index_targets_current),
    CoreInvariant("dependents_exact", "the reverse map from target blocks to index rows holds "
                  "exactly the references the index rows record", _dependents_exact),
    CoreInvariant("sub_blocks_complete", "a complete block has every sub-block written",
                  _sub_blocks_complete),
    CoreInvariant("free_ids_exact", "the free-id stack holds exactly the free blocks",
                  _free_ids_exact),
    CoreInvariant("recency_exact", "each recency list holds exactly the blocks its states "
                  "put there, least recently used first; the record of a run linked in "
                  "order is true of the links", _recency_exact),
    CoreInvariant("restores_counted", "the admission gate's count of restores in flight is "
                  "the number of blocks in restoring states", _restores_counted),
)


def _budget_exact(core: StateCore) -> list[str]:
    """The core-wide restore budget counts exactly the groups' restoring blocks and bytes."""
    budget = core.restore_budget
    ops = sum(group.restores_in_flight() for group in core.groups.values())
    nbytes = sum(group.restores_in_flight() * group.decl.payload_bytes
                 for group in core.groups.values())
    if (budget.ops, budget.bytes) == (ops, nbytes):
        return []
    return [f"*: restore_budget: counts {budget.ops} restores of {budget.bytes} bytes in "
            f"flight, the groups hold {ops} of {nbytes}"]


def core_problems(core: StateCore) -> list[str]:
    """Every invariant violation in ``core``, as ``group: invariant: detail`` lines."""
    return [
        f"{name}: {inv.name}: {problem}"
        for name, group in core.groups.items()
        for inv in CORE_INVARIANTS
        for problem in inv.problems(group)
    ] + _budget_exact(core)
