"""The logical line of one cache group: struct-of-arrays metadata plus the machine that moves it.

Every lifecycle state change goes through the group's :class:`~kvfsm.fsm.Machine`; the effects
bound here are the memory work the spec rows name (take/return a slot, copy between tiers,
checksum, bump epoch, enter/leave the hash map, invalidate dependents). Per block the metadata
is a handful of fixed-width integers; there are no per-block Python objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import NDArray

from kvfsm.fsm import INVALID, CompiledTable, EffectFn, GuardFn, Machine
from kvfsm.memory import SlotPool
from kvfsm.spec import Call, Event, GroupDecl, GroupKind, Layout, Row, Tier
from kvfsm.state._hashtable import BlockHashTable

IdArray = NDArray[np.intp]
#: ``refs_target`` value of an unused index entry.
NO_TARGET = -1


class GroupState:
    """Metadata of every block of one group, and the pools of its tiers."""

    def __init__(
        self,
        decl: GroupDecl,
        table: CompiledTable,
        pools: Mapping[Tier, SlotPool],
        *,
        max_restores_in_flight: int,
        dependents: Callable[[IdArray], None],
    ) -> None:
        self.decl = decl
        self.table = table
        self.pools = dict(pools)
        n = sum(pool.capacity for pool in self.pools.values())
        self.n_blocks = n
        self.epoch = np.zeros(n, dtype=np.uint32)
        self.position = np.full(n, -1, dtype=np.int32)
        self.pins = np.zeros(n, dtype=np.uint16)
        self.last_use = np.zeros(n, dtype=np.uint32)
        #: The block's content was verified against its checksum at its current epoch
        #: (set by record_checksum and by verifying lookups, cleared by every epoch bump).
        self.verified = np.zeros(n, dtype=np.bool_)
        #: Index into ``layouts`` of the layout the block's content was written under.
        self.layout_id = np.zeros(n, dtype=np.uint8)
        self.layouts: list[Layout] = [decl.layout]
        self.write_layout = 0
        #: Per tier this group has a pool for: the slot each block holds there, or -1.
        self.slot = {tier: np.full(n, -1, dtype=np.int32) for tier in self.pools}
        self.hash_high = np.zeros(n, dtype=np.uint64)
        self.hash_low = np.zeros(n, dtype=np.uint64)
        #: The prefix hash map: 128-bit chained hash -> block id (complete blocks only), an
        #: open-addressing table of arrays sized for every block at once.
        self.hash_map = BlockHashTable(n)
        # Which sub-blocks have been written; a block not split into sub-blocks is one, so no
        # kind can complete a block whose content was never written.
        self.sub_blocks = np.zeros(n, dtype=np.uint16)
        self.full_sub_mask = (1 << (decl.sub_blocks or 1)) - 1
        top_k = decl.top_k if decl.kind is GroupKind.SPARSE_INDEX and decl.top_k else 0
        self.refs_target = np.full((n if top_k else 0, top_k), NO_TARGET, dtype=np.int32)
        self.refs_epoch = np.zeros((n if top_k else 0, top_k), dtype=np.uint32)
        #: Set by the core for sparse-index groups: the group the index points into.
        self.target: GroupState | None = None
        self._max_restores = max_restores_in_flight
        self._dependents = dependents
        # Logical ids in the free state, as a stack: allocation is O(k), not a scan.
        self.free_ids = np.arange(n - 1, -1, -1, dtype=np.int32)
        self.free_top = n
        self.machine = Machine(table, n, guards=self._guards(), effects=self._effects(),
                               name=f"group {decl.name!r} ({table.name})")
        self._restoring = np.array(
            [s.in_flight and s.residency not in (None, Tier.DEVICE)
             and Tier.DEVICE in s.slots for s in table.lifecycle.states], dtype=np.bool_)

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def states(self) -> NDArray[np.uint8]:
        return self.machine.states

    # -- guards ----------------------------------------------------------------------------

    def _guards(self) -> dict[str, GuardFn]:
        return {
            "has_room": self._has_room,
            "no_pins": lambda ids, call: self.pins[ids] == 0,
            "admission_open": self._admission_open,
            "all_sub_blocks_present": lambda ids, call: self.sub_blocks[ids] == self.full_sub_mask,
            "checksum_ok": self._checksum_ok,
            "targets_current": lambda ids, call: self.targets_current(ids),
        }

    def _has_room(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        pool = self.pools.get(call.tier) if call.tier is not None else None
        room = pool.free if pool is not None else 0
        return np.arange(ids.shape[0]) < room

    def _admission_open(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        in_flight = int(self._restoring[self.states].sum())
        return np.arange(ids.shape[0]) < max(self._max_restores - in_flight, 0)

    def _checksum_ok(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        # Restores copy content and its recorded checksum into the device slot at begin; done
        # recomputes over the bytes that actually arrived.
        return self.pools[Tier.DEVICE].verify_checksum(self.slot[Tier.DEVICE][ids])

    def targets_current(self, ids: IdArray) -> NDArray[np.bool_]:
        """Per index block: every target it holds is still at the epoch it was indexed at."""
        if self.target is None or self.refs_target.shape[1] == 0:
            return np.ones(ids.shape[0], dtype=np.bool_)
        targets = self.refs_target[ids]
        used = targets != NO_TARGET
        current = self.target.epoch[np.where(used, targets, 0)] == self.refs_epoch[ids]
        alive = self.target.table.hashed[self.target.states[np.where(used, targets, 0)]]
        result: NDArray[np.bool_] = np.all(~used | (current & alive), axis=1)
        return result

    # -- effects ---------------------------------------------------------------------------

    def _effects(self) -> dict[str, EffectFn]:
        return {
            "take_slot": self._take_slot,
            "return_slot": self._return_slot,
            "copy_to": self._copy_to,
            "bump_epoch": self._bump_epoch,
            "record_checksum": self._record_checksum,
            "publish_hash": self._publish_hash,
            "drop_hash": self._drop_hash,
            "invalidate_dependents": lambda ids, call, row: self._dependents(ids),
            "clear_sub_blocks": self._clear_sub_blocks,
        }

    def _pool(self, tier: Tier | None, row: Row) -> SlotPool:
        if tier is None or tier not in self.pools:
            # Guards (has_room) keep rows into a tier without a pool from firing.
            raise AssertionError(f"{self.name}: row {row.label} needs a {tier} pool")
        return self.pools[tier]

    def _take_slot(self, ids: IdArray, call: Call, row: Row) -> None:
        self.slot[call.tier][ids] = self._pool(call.tier, row).take(ids)  # type: ignore[index]

    def _return_slot(self, ids: IdArray, call: Call, row: Row) -> None:
        self._pool(call.tier, row).release(self.slot[call.tier][ids])  # type: ignore[index]
        self.slot[call.tier][ids] = -1  # type: ignore[index]

    def _copy_to(self, ids: IdArray, call: Call, row: Row) -> None:
        source = self.table.lifecycle.state(row.source).residency
        src_pool, dst_pool = self._pool(source, row), self._pool(call.tier, row)
        src_pool.copy_rows_to(self.slot[source][ids], dst_pool,  # type: ignore[index]
                              self.slot[call.tier][ids])  # type: ignore[index]

    def _bump_epoch(self, ids: IdArray, call: Call, row: Row) -> None:
        self.epoch[ids] += np.uint32(1)
        self.verified[ids] = False

    def _record_checksum(self, ids: IdArray, call: Call, row: Row) -> None:
        tier = self.table.lifecycle.state(row.dest).residency
        self._pool(tier, row).record_checksum(self.slot[tier][ids])  # type: ignore[index]
        self.verified[ids] = True  # the checksum was just taken from these very bytes

    def _publish_hash(self, ids: IdArray, call: Call, row: Row) -> None:
        # A second block with the same content keeps the first as the one the map serves.
        self.hash_map.insert_first(self.hash_high[ids], self.hash_low[ids], ids)

    def _drop_hash(self, ids: IdArray, call: Call, row: Row) -> None:
        # Only where the map serves this very block: a duplicate's drop leaves the first alone.
        self.hash_map.remove_if(self.hash_high[ids], self.hash_low[ids], ids)

    def _clear_sub_blocks(self, ids: IdArray, call: Call, row: Row) -> None:
        # Forget everything written so far: the sub-block bitmap and any index references.
        self.sub_blocks[ids] = 0
        if self.refs_target.size:
            self.refs_target[ids] = NO_TARGET
            self.refs_epoch[ids] = 0

    # -- free-id stack ---------------------------------------------------------------------

    def pop_free_ids(self, count: int) -> IdArray:
        """Up to ``count`` ids in the free state (not yet moved out of it)."""
        take = min(count, self.free_top)
        return self.free_ids[self.free_top - take : self.free_top][::-1].astype(np.intp)

    def note_allocated(self, ids: IdArray, moved: NDArray[np.bool_]) -> None:
        """``ids`` came from :meth:`pop_free_ids`; put back the ones that did not move."""
        rest = ids[~moved][::-1].astype(np.int32)
        self.free_top -= ids.size
        self.free_ids[self.free_top : self.free_top + rest.size] = rest
        self.free_top += rest.size

    def note_entered_free(self, ids: IdArray) -> None:
        """Push ids that a fire moved into the initial state."""
        entered = ids[self.states[ids] == self.table.initial]
        self.free_ids[self.free_top : self.free_top + entered.size] = entered
        self.free_top += entered.size

    def event_row(self, event: Event) -> NDArray[np.bool_]:
        """Per state: the event has a row from it."""
        has_row: NDArray[np.bool_] = self.table.next_state[:, event] != INVALID
        return has_row
