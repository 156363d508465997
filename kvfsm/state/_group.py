"""The logical line of one cache group: struct-of-arrays metadata plus the machine that moves it.

Every lifecycle state change goes through the group's :class:`~kvfsm.fsm.Machine`; the effects
bound here are the memory work the spec rows name (take/return a slot, copy between tiers,
checksum, bump epoch, enter/leave the hash map, invalidate dependents). Per block the metadata
is a handful of fixed-width integers; there are no per-block Python objects.

The per-block arrays are private (``_blocks``) and this class is their only writer: everyone
else sees read-only views, so no caller can move a block's metadata behind the machine's back.
Indexes derived from the states (the free-id stack) are kept by the machine's ``on_moved`` hook,
so every fire, whoever makes it, keeps them exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.fsm import INVALID, CompiledTable, EffectFn, GuardFn, Machine
from kvfsm.kinds import rule_of
from kvfsm.kinds._sparse_index import NO_TARGET as NO_TARGET  # the kind's, re-exported
from kvfsm.kinds._sparse_index import current_references
from kvfsm.memory import SlotPool
from kvfsm.spec import Call, Event, GroupDecl, Layout, Row, Tier
from kvfsm.spec._vocabulary import STORED_TIERS
from kvfsm.state._budget import RestoreBudget
from kvfsm.state._dependents import Dependents
from kvfsm.state._hashtable import BlockHashTable
from kvfsm.state._recency import NO_LIST, Clock, Recency
from kvfsm.state._scratch import Scratch

IdArray = NDArray[np.intp]
#: ``check`` codes: what lookups learned of a block's bytes at its current epoch.
UNCHECKED: Final = 0
VERIFIED: Final = 1
FAILED: Final = 2
#: Most pins one counter holds (a block's own, or its chunk's: each is uint16).
MAX_PINS: Final = int(np.iinfo(np.uint16).max)
#: Block ids per pin chunk by default, as a shift (64; ``CoreConfig.pin_chunk_blocks``): a
#: lease over a run of consecutive ids pins the whole chunks inside the run once each and only
#: the ids at its two ends one by one, so taking and giving back 8 192 blocks moves some 250
#: counters, not 8 192.
PIN_CHUNK_SHIFT: Final = 6
#: The recency lists of a group (see :func:`recency_classes`): blocks whose device slot waits
#: only to be freed (``invalid``), and readable device blocks that may be evicted; the blocks
#: resting in a lower tier have one list per tier after these.
RECLAIM_LIST: Final = 0
EVICT_LIST: Final = 1
#: Tiers with a list of the blocks resting there (what ``spill_down`` moves on).
RESTING_TIERS: Final = (Tier.HOST, Tier.DISK, Tier.REMOTE)
#: Most blocks one look past an eviction walk reads for the rest of its last batch (the
#: looks double from one block up to this).
_TIE_STEP_MAX: Final = 4096


def reclaim_states(table: CompiledTable) -> NDArray[np.bool_]:
    """Per state: a block there holds a device slot whose content is no longer trusted or
    reached (the states invalidation leads into, not ``allocated``, which looks the same but
    is a write about to start), and ``free`` returns the slot."""
    entered = table.next_state[:, Event.INVALIDATE]
    invalidated = np.zeros(table.n_states, dtype=np.bool_)
    invalidated[entered[entered != INVALID]] = True
    frees = table.next_state[:, Event.FREE] != INVALID
    reclaim: NDArray[np.bool_] = (invalidated & frees & table.holds_slot[:, Tier.DEVICE]
                                  & ~table.hashed)
    return reclaim


def resting_states(table: CompiledTable, tier: Tier) -> NDArray[np.bool_]:
    """Per state: a block there rests in ``tier`` (its copy is there, not readable, nothing
    in flight): what ``spill_down`` may move a tier down."""
    resting: NDArray[np.bool_] = ((table.residency == int(tier)) & ~table.in_flight
                                  & ~table.readable)
    return resting


def recency_classes(table: CompiledTable) -> tuple[NDArray[np.int8], dict[Tier, int]]:
    """Each state's recency list (NO_LIST: none) and the list of each resting tier that has
    states. Reclaimable states come first, then readable evictable ones, then resting ones
    per tier (a state matching several classes joins the first)."""
    lists = np.full(table.n_states, NO_LIST, dtype=np.int8)
    evictable = (table.next_state[:, Event.EVICT] != INVALID) & table.readable
    lists[evictable] = EVICT_LIST
    lists[reclaim_states(table)] = RECLAIM_LIST
    tiers: dict[Tier, int] = {}
    for tier in RESTING_TIERS:
        states = resting_states(table, tier) & (lists == NO_LIST)
        if states.any():
            tiers[tier] = EVICT_LIST + 1 + len(tiers)
            lists[states] = tiers[tier]
    return lists, tiers


class StateError(KvfsmError):
    """An operation is not allowed in the current state of some blocks; nothing changed."""


class CoreObserver(Protocol):
    """Told of every batch of blocks that moved, right after it moved (refused ids never),
    and of reads an engine reports (``StateCore.record_read``). The arrays are copies the
    observer may keep; an observer must not raise, since the move has already happened."""

    def moved(self, group: str, event: Event, ids: IdArray, before: NDArray[np.uint8],
              after: NDArray[np.uint8], epochs: NDArray[np.uint32]) -> None:
        """``ids`` moved on ``event`` from state ids ``before`` to ``after``, now at ``epochs``."""

    def read(self, group: str, ids: IdArray, epochs: NDArray[np.uint32]) -> None:
        """``ids`` were read at their current ``epochs`` (no state changed). An observer
        whose class sets ``observes_reads = False`` is never told of reads (a lease then
        gathers none to report where no other observer is), and one with a
        ``read_runs(runs)`` method is told of reads of consecutive ids at one epoch as
        ``(group, first, count, epoch)`` runs, several in one call.

        Optional methods, each looked up once when the observer is attached (one without
        them is told of moves and reads only): ``pinned(group, ids, delta)``, each of
        ``ids`` (repeats add up) gained ``delta`` pins (given back: below 0), whoever pinned
        them; ``pinned_runs(runs)``, the same of ``(group, first, count, delta)`` runs of
        consecutive ids (a lease over 4 096 consecutive blocks is one run; an observer with
        only one of the two is told everything through it); ``checks_failed(group, ids,
        epochs)``, a lookup saw ``ids`` fail their checksum at ``epochs``; ``written(group,
        ids, sub_mask)``, content was written into the sub-blocks of ``sub_mask`` of ``ids``
        (every one of them: the group's full mask); ``indexed(group, ids, targets,
        epochs)``, index blocks ``ids`` now point at ``targets`` (``[len(ids), top_k]``,
        -1 unused) at the targets' ``epochs``."""


def _read_only(array: NDArray[Any]) -> NDArray[Any]:
    view = array.view()
    view.setflags(write=False)
    return view


class _Blocks:
    """The writable per-block arrays of one group (private to :class:`GroupState`)."""

    def __init__(self, n: int, tiers: list[Tier], top_k: int, pin_shift: int) -> None:
        # ``tiers``: the pooled tiers this group has a pool in.
        self.epoch = np.zeros(n, dtype=np.uint32)
        self.position = np.full(n, -1, dtype=np.int32)
        self.pins = np.zeros(n, dtype=np.uint16)
        #: Pins held on whole chunks of ``1 << pin_shift`` consecutive ids (leases only): a
        #: block's pins are its own plus its chunk's.
        self.chunk_pins = np.zeros(-(-n >> pin_shift), dtype=np.uint16)
        self.last_use = np.zeros(n, dtype=np.uint32)
        #: UNCHECKED / VERIFIED / FAILED at the block's current epoch (every bump resets it).
        self.check = np.zeros(n, dtype=np.uint8)
        #: Index into ``GroupState.layouts`` of the layout the content was written under.
        self.layout_id = np.zeros(n, dtype=np.uint8)
        #: Per tier with a pool: the slot each block holds there, or -1.
        self.slot = {tier: np.full(n, -1, dtype=np.int32) for tier in tiers}
        #: One bit per stored tier (``1 << tier``): the block holds a copy there, by key.
        self.copies = np.zeros(n, dtype=np.uint8)
        self.hash_high = np.zeros(n, dtype=np.uint64)
        self.hash_low = np.zeros(n, dtype=np.uint64)
        # Which sub-blocks have been written; a block not split into sub-blocks is one, so no
        # kind can complete a block whose content was never written.
        self.sub_blocks = np.zeros(n, dtype=np.uint16)
        self.refs_target = np.full((n if top_k else 0, top_k), NO_TARGET, dtype=np.int32)
        self.refs_epoch = np.zeros((n if top_k else 0, top_k), dtype=np.uint32)
        # Logical ids in the free state, as a stack: allocation is O(k), not a scan.
        self.free_ids = np.arange(n - 1, -1, -1, dtype=np.int32)
        self.free_top = n



class ChangeCount:
    """Changes to any group of one core, ever (shared by its groups; each group's own count is
    :attr:`GroupState.changes`). While it stays put no group changed, so what a lookup saw of
    every group still holds: a lease made from the lookup checks one number, not one a group."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0


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
        stored: Mapping[Tier, int] | None = None,
        observers: list[CoreObserver] | None = None,
        budget: RestoreBudget | None = None,
        scratch: Scratch | None = None,
        clock: Clock | None = None,
        change_count: ChangeCount | None = None,
        pin_shift: int = PIN_CHUNK_SHIFT,
    ) -> None:
        self.decl = decl
        self.table = table
        self.rule = rule_of(decl)
        self.pools = dict(pools)
        #: The stored tiers attached to this group, with how many blocks may hold a copy in
        #: each (their copies are values the data path writes and loads by key; a block keeps
        #: one bit per stored tier in ``copies``).
        self.stored = {tier: int(count) for tier, count in (stored or {}).items()
                       if tier in STORED_TIERS and count > 0}
        self._stored_used = dict.fromkeys(self.stored, 0)
        n = sum(pool.capacity for pool in self.pools.values()) + sum(self.stored.values())
        self.n_blocks = n
        top_k = self.rule.index_width(decl)
        #: Block ids per pin chunk, as a shift (see :data:`PIN_CHUNK_SHIFT`).
        self.pin_shift = pin_shift
        self._blocks = blocks = _Blocks(n, list(self.pools), top_k, pin_shift)
        self.epoch = _read_only(blocks.epoch)
        self.position = _read_only(blocks.position)
        #: Pins taken block by block (:meth:`StateCore.pin`, a lease's ends); see
        #: :attr:`pins` for what each block holds in all.
        self.block_pins = _read_only(blocks.pins)
        #: Pins on whole chunks of ``1 << pin_shift`` consecutive ids (leases).
        self.chunk_pins = _read_only(blocks.chunk_pins)
        self.last_use = _read_only(blocks.last_use)
        self.check = _read_only(blocks.check)
        self.layout_id = _read_only(blocks.layout_id)
        self.slot = {tier: _read_only(slots) for tier, slots in blocks.slot.items()}
        self.copies = _read_only(blocks.copies)
        self.hash_high = _read_only(blocks.hash_high)
        self.hash_low = _read_only(blocks.hash_low)
        self.sub_blocks = _read_only(blocks.sub_blocks)
        self.refs_target = _read_only(blocks.refs_target)
        self.refs_epoch = _read_only(blocks.refs_epoch)
        self.free_ids = _read_only(blocks.free_ids)
        self.layouts: list[Layout] = [decl.layout]
        self.write_layout = 0
        #: The prefix hash map: 128-bit chained hash -> block id (complete blocks only), an
        #: open-addressing table sized for every block at once; it reads each block's key from
        #: the hash words (written before a block is published, kept while it is mapped).
        self.hash_map = BlockHashTable(n, (blocks.hash_high, blocks.hash_low))
        self.full_sub_mask = (1 << (decl.sub_blocks or 1)) - 1
        #: Set by the core for sparse-index groups: the group the index points into.
        self.target: GroupState | None = None
        #: Which index rows point at which target blocks (sparse-index groups, once bound).
        self.dependents: Dependents | None = None
        self._max_restores = max_restores_in_flight
        self._restoring = 0
        #: Changes to this group's blocks, ever: batches that moved blocks, and checksum
        #: failures recorded. While it stays put no block changed state, epoch or check, so
        #: what a lookup or a lease saw of its blocks still holds without looking again (an
        #: O(1) lease take and validate), even where something bypassed a lease's pins.
        self.changes = 0
        #: The core's count of changes to any of its groups (shared by its groups).
        self.change_count = ChangeCount() if change_count is None else change_count
        #: Working arrays for set operations on ids (shared by the core's groups).
        self.scratch = Scratch(n) if scratch is None else scratch
        #: Restores in flight across the core's groups and their caps (shared by its groups).
        self.budget = RestoreBudget() if budget is None else budget
        self._dependents = dependents
        #: The core's use counter (shared by its groups): ``last_use`` stamps.
        self.clock = Clock() if clock is None else clock
        #: The blocks of each recency class, least recently used first (O(1) per moved or
        #: touched block; see :mod:`kvfsm.state._recency`). 8 bytes per block.
        list_of_state, self.resting_lists = recency_classes(table)
        self.recency = Recency(n, list_of_state)
        # The core's observer list, shared by all its groups (empty: one `if` per move).
        self._observers = [] if observers is None else observers
        self.machine = Machine(table, n, guards=self._guards(), effects=self._effects(),
                               name=f"group {decl.name!r} ({table.name})",
                               on_moved=self._on_moved)

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def states(self) -> NDArray[np.uint8]:
        return self.machine.states

    @property
    def pins(self) -> NDArray[np.uint32]:
        """Per block: the readers holding it (its own pins plus its chunk's), a fresh array
        over the whole group, for inspection; :meth:`pin_counts` costs only the ids asked."""
        blocks = self._blocks
        chunks = np.repeat(blocks.chunk_pins, 1 << self.pin_shift)[: self.n_blocks]
        held: NDArray[np.uint32] = blocks.pins.astype(np.uint32) + chunks
        held.setflags(write=False)  # a reading, like the other per-block views
        return held

    def pin_counts(self, ids: IdArray) -> NDArray[np.uint32]:
        """The readers holding each of ``ids`` (its own pins plus its chunk's)."""
        blocks = self._blocks
        held: NDArray[np.uint32] = blocks.pins[ids].astype(np.uint32) + \
            blocks.chunk_pins[ids >> self.pin_shift]
        return held

    def unpinned(self, ids: IdArray) -> NDArray[np.bool_]:
        """Per id: no reader holds the block (neither a pin of its own nor its chunk's)."""
        blocks = self._blocks
        free: NDArray[np.bool_] = (blocks.pins[ids] == 0) & \
            (blocks.chunk_pins[ids >> self.pin_shift] == 0)
        return free

    @property
    def free_top(self) -> int:
        return self._blocks.free_top

    def stored_used(self, tier: Tier) -> int:
        """Blocks holding a copy in the stored ``tier`` (kept by every fire, O(1))."""
        return self._stored_used.get(tier, 0)

    def holds(self, tier: Tier) -> NDArray[np.bool_]:
        """Per block: it holds a copy in ``tier`` (a slot of a pooled tier, a stored copy)."""
        if tier in STORED_TIERS:
            held: NDArray[np.bool_] = (self._blocks.copies & np.uint8(1 << tier)) != 0
            return held
        if tier in self._blocks.slot:
            pooled: NDArray[np.bool_] = self._blocks.slot[tier] != -1
            return pooled
        return np.zeros(self.n_blocks, dtype=np.bool_)

    def bind_target(self, target: GroupState) -> None:
        """Make this sparse-index group point into ``target`` (called once by the core)."""
        self.target = target
        self.dependents = Dependents(self.n_blocks, self.refs_target.shape[1], target.n_blocks)

    # -- guards ----------------------------------------------------------------------------

    def _guards(self) -> dict[str, GuardFn]:
        return {
            "has_room": self._has_room,
            "no_pins": lambda ids, call: self.unpinned(ids),
            "admission_open": self._admission_open,
            "all_sub_blocks_present": lambda ids, call:
                self._blocks.sub_blocks[ids] == self.full_sub_mask,
            "checksum_ok": self._checksum_ok,
            "targets_current": lambda ids, call: self.targets_current(ids),
        }

    def _has_room(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        if call.tier in STORED_TIERS:
            room = self.stored.get(call.tier, 0) - self._stored_used.get(call.tier, 0)
            return np.arange(ids.shape[0]) < room
        pool = self.pools.get(call.tier) if call.tier is not None else None
        room = pool.free if pool is not None else 0
        return np.arange(ids.shape[0]) < room

    def restores_in_flight(self) -> int:
        """Blocks of this group in a restoring state (kept by every fire, O(1) to read)."""
        return self._restoring

    def restore_budget(self) -> int:
        """Restores the admission gate lets begin now: the least of this group's own cap and
        the core-wide room in operations and bytes (:class:`RestoreBudget`)."""
        own = max(self._max_restores - self.restores_in_flight(), 0)
        if not self.budget.capped:
            return own  # every lookup asks: no payload arithmetic when nothing is capped
        shared = self.budget.room(self.decl.payload_bytes)
        return own if shared is None else min(own, shared)

    def _admission_open(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        return np.arange(ids.shape[0]) < self.restore_budget()

    def _checksum_ok(self, ids: IdArray, call: Call) -> NDArray[np.bool_]:
        # Restores copy content and its recorded checksum into the device slot at begin; done
        # recomputes over the bytes that actually arrived, except where a loader from a stored
        # tier already hashed them in that very slot after they landed (record_load_check).
        slots = self._blocks.slot[Tier.DEVICE][ids]
        trusted = self.table.loading[self.states[ids]] & (self._blocks.check[ids] == VERIFIED)
        ok = np.ones(ids.shape[0], dtype=np.bool_)
        if not trusted.all():
            ok[~trusted] = self.pools[Tier.DEVICE].verify_checksum(slots[~trusted])
        return ok

    def index_targets(self, ids: IdArray) -> IdArray:
        """The target blocks index blocks ``ids`` point at, repeats kept (none for other
        kinds). A reference outside the target group (corrupt metadata) is a StateError
        naming it: used as an index it would wrap to another block (a negative one) or
        fail."""
        if self.target is None:
            return np.zeros(0, dtype=np.intp)
        refs = self.refs_target[ids].ravel()
        targets: IdArray = refs[refs != NO_TARGET].astype(np.intp)
        if targets.size and (targets.min() < 0 or targets.max() >= self.target.n_blocks):
            bad = targets[(targets < 0) | (targets >= self.target.n_blocks)]
            raise StateError(f"{self.name}: index blocks point outside {self.target.name} "
                             f"[0, {self.target.n_blocks}) (corrupt metadata): "
                             f"{bad[:8].tolist()}")
        return targets

    def targets_current(self, ids: IdArray) -> NDArray[np.bool_]:
        """Per index block: every target it holds is still at the epoch it was indexed at. A
        reference outside the target group (corrupt metadata) is never current: read as an
        index it would wrap (a negative one) or fail, so it is not read."""
        if self.target is None or self.refs_target.shape[1] == 0:
            return np.ones(ids.shape[0], dtype=np.bool_)
        targets, target = self.refs_target[ids], self.target
        current = current_references(targets, self.refs_epoch[ids], target_epoch=target.epoch,
                                     target_states=target.states, hashed=target.table.hashed)
        result: NDArray[np.bool_] = np.all((targets == NO_TARGET) | current, axis=1)
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
        if call.tier in STORED_TIERS:
            self._blocks.copies[ids] |= np.uint8(1 << call.tier)
            self._stored_used[call.tier] += ids.shape[0]
            return
        self._blocks.slot[call.tier][ids] = self._pool(call.tier, row).take(ids)  # type: ignore[index]

    def _return_slot(self, ids: IdArray, call: Call, row: Row) -> None:
        if call.tier in STORED_TIERS:
            # The block forgets its copy; the stored value may stay for others (it is named
            # by content, and verified by whoever loads it).
            self._blocks.copies[ids] &= np.uint8(~(1 << call.tier) & 0xFF)
            self._stored_used[call.tier] -= ids.shape[0]
            return
        slots = self._blocks.slot[call.tier]  # type: ignore[index]
        self._pool(call.tier, row).release(slots[ids])
        slots[ids] = -1

    def _copy_to(self, ids: IdArray, call: Call, row: Row) -> None:
        source = self.table.lifecycle.state(row.source).residency
        if source in STORED_TIERS or call.tier in STORED_TIERS:
            # Bytes to or from a stored tier move on the data path (``kvfsm.restore``) between
            # this row and its done row, whose guards check what arrived.
            return
        src_pool, dst_pool = self._pool(source, row), self._pool(call.tier, row)
        src_pool.copy_rows_to(self._blocks.slot[source][ids], dst_pool,  # type: ignore[index]
                              self._blocks.slot[call.tier][ids])  # type: ignore[index]

    def _bump_epoch(self, ids: IdArray, call: Call, row: Row) -> None:
        self._blocks.epoch[ids] += np.uint32(1)
        self._blocks.check[ids] = UNCHECKED

    def _record_checksum(self, ids: IdArray, call: Call, row: Row) -> None:
        tier = self.table.lifecycle.state(row.dest).residency
        self._pool(tier, row).record_checksum(self._blocks.slot[tier][ids])  # type: ignore[index]
        self._blocks.check[ids] = VERIFIED  # the checksum was just taken from these very bytes

    def _publish_hash(self, ids: IdArray, call: Call, row: Row) -> None:
        # A second block with the same content keeps the first as the one the map serves.
        self.hash_map.insert_first(self.hash_high[ids], self.hash_low[ids], ids)

    def _drop_hash(self, ids: IdArray, call: Call, row: Row) -> None:
        # Only where the map serves this very block: a duplicate's drop leaves the first alone.
        self.hash_map.remove_if(self.hash_high[ids], self.hash_low[ids], ids)

    def _clear_sub_blocks(self, ids: IdArray, call: Call, row: Row) -> None:
        # Forget everything written so far: the sub-block bitmap and any index references.
        self._blocks.sub_blocks[ids] = 0
        if self.dependents is not None:
            self.dependents.unlink(ids)
            self._blocks.refs_target[ids] = NO_TARGET
            self._blocks.refs_epoch[ids] = 0

    # -- the free-id stack, kept by every fire -------------------------------------------------

    def pop_free_ids(self, count: int) -> IdArray:
        """Up to ``count`` ids in the free state, the next ones :meth:`allocate` would take."""
        blocks = self._blocks
        take = min(count, blocks.free_top)
        return blocks.free_ids[blocks.free_top - take : blocks.free_top][::-1].astype(np.intp)

    def _on_moved(self, ids: IdArray, event: Event, before: NDArray[np.uint8]) -> None:
        blocks, initial = self._blocks, self.table.initial
        self.changes += 1
        self.change_count.total += 1
        after = self.states[ids]
        restoring = self.table.restoring
        entered_restoring = int(restoring[after].sum()) - int(restoring[before].sum())
        if entered_restoring:
            self._restoring += entered_restoring
            self.budget.moved(entered_restoring, self.decl.payload_bytes)
        # Only ids that crossed the free boundary touch the stack: a batch moving between two
        # other states (a restore, a spill) costs nothing here, whatever the pool's size.
        was_free, now_free = before == initial, after == initial
        left = was_free & ~now_free
        if left.any():
            self._left_free(ids[left])
        entered = ids[now_free & ~was_free]
        # Pushed last first, so the next allocation pops them in the order they were freed:
        # a prompt's blocks freed in prompt order come back as the same ascending run (which
        # a lookup confirms without the hash table and a lease pins by whole chunks), not
        # reversed.
        blocks.free_ids[blocks.free_top : blocks.free_top + entered.size] = entered[::-1]
        blocks.free_top += entered.size
        # A block joining a recency list is as recent as the latest use (lists stay ordered).
        joined = self.recency.moved(ids, before, after)
        if joined.size:
            blocks.last_use[joined] = self.clock.now
        if self._observers:
            moved, epochs = ids.copy(), blocks.epoch[ids]
            for observer in self._observers:
                observer.moved(self.name, event, moved, before, after, epochs)

    def _left_free(self, ids: IdArray) -> None:
        """Take ids that left the free state off the stack."""
        blocks = self._blocks
        top = blocks.free_top
        if not ids.size:
            return
        head = blocks.free_ids[top - ids.size : top]
        if ids.size <= top and np.array_equal(np.sort(head), np.sort(ids)):
            blocks.free_top -= ids.size  # the usual case: allocate took the top of the stack
            return
        # Fired on chosen free ids directly: remove them wherever they sit (rare, O(stack)).
        stack = blocks.free_ids[:top]
        kept = stack[~np.isin(stack, ids)]
        blocks.free_ids[: kept.size] = kept
        blocks.free_top = int(kept.size)

    # -- data the core writes (the lifecycle state allows it; the core checked) ---------------

    def record_identity(self, ids: IdArray, position: NDArray[np.int32],
                        high: NDArray[np.uint64], low: NDArray[np.uint64]) -> None:
        self._blocks.position[ids] = position
        self._blocks.hash_high[ids] = high
        self._blocks.hash_low[ids] = low

    def restore_identity(self, ids: IdArray, position: NDArray[np.int32],
                         high: NDArray[np.uint64], low: NDArray[np.uint64],
                         sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8]) -> None:
        """Put back what :meth:`record_identity` and :meth:`record_written` overwrote (a
        refused discovery)."""
        self.record_identity(ids, position, high, low)
        self._blocks.sub_blocks[ids] = sub_blocks
        self._blocks.layout_id[ids] = layout_id

    def record_load_check(self, ids: IdArray, *, verified: bool) -> None:
        """A loader put a stored copy into the device slots of restoring ``ids``: whether it
        verified those bytes in place (else ``checksum_ok`` re-hashes them)."""
        self._blocks.check[ids] = VERIFIED if verified else UNCHECKED

    def record_written(self, ids: IdArray, sub_mask: int | None = None) -> None:
        """Content was written: every sub-block (``sub_mask`` None) or those of the mask."""
        if sub_mask is None:
            self._blocks.sub_blocks[ids] = self.full_sub_mask
        else:
            self._blocks.sub_blocks[ids] |= np.uint16(sub_mask)
        self._blocks.layout_id[ids] = self.write_layout

    def record_refs(self, ids: IdArray, refs: NDArray[np.int32]) -> None:
        """Set index references at the targets' current epochs (sparse-index groups)."""
        if self.target is None or self.dependents is None:
            raise KvfsmError(f"{self.name}: not a sparse-index group")
        used = refs != NO_TARGET
        self._blocks.refs_target[ids] = refs
        self._blocks.refs_epoch[ids] = np.where(
            used, self.target.epoch[np.where(used, refs, 0)], 0)
        self.dependents.link(ids, refs)

    def add_pins(self, ids: IdArray, count: int = 1, *, distinct: bool = False,
                 counted: tuple[IdArray, NDArray[np.int32]] | None = None) -> None:
        """``count`` more readers hold each of ``ids`` (repeats add up; ``distinct``: the
        caller checked there are none; ``counted``: the caller has ``repeats(ids)``); never
        wraps."""
        pins = self._blocks.pins
        held: NDArray[np.int64] | None = None
        if distinct:
            touched = ids
        else:
            touched, repeats = counted if counted is not None else self.repeats(ids)
            held = repeats.astype(np.int64)
        delta = count if held is None else held * count
        after = pins[touched].astype(np.int64) + delta
        if count > 0 and (after > MAX_PINS).any():
            raise StateError(f"{self.name}: more than {MAX_PINS} pins on one block")
        pins[touched] = after.astype(np.uint16)  # touched are distinct: a plain scatter

    # -- sets of ids in O(ids) (the core's scratch arrays, no sort) ---------------------------

    def distinct(self, ids: IdArray) -> IdArray:
        """``ids`` without repeats (index targets repeat a lot)."""
        return self.scratch.distinct(ids)

    def repeats(self, ids: IdArray) -> tuple[IdArray, NDArray[np.int32]]:
        """The distinct ``ids`` and how often each occurs."""
        return self.scratch.repeats(ids)

    def without(self, ids: IdArray, drop: IdArray) -> IdArray:
        """``ids`` less those in ``drop``."""
        return self.scratch.without(ids, drop)

    def touch(self, ids: IdArray) -> None:
        """Blocks ``ids`` were used now (the clock's next tick): stamped, and moved to the
        young end of their recency list, in one compiled pass. An id outside the group is a
        KvfsmError, and then nothing changes (the clock included)."""
        bad = self.recency.touch(ids, self.states, self._blocks.last_use, self.clock.now + 1)
        if bad >= 0:
            raise KvfsmError(f"{self.name}: block ids must lie in [0, {self.n_blocks}), got "
                             f"{int(ids[bad])}")
        self.clock.advance()

    def oldest(self, list_id: int, count: int, exclude: IdArray | None = None) -> IdArray:
        """Up to ``count`` unpinned blocks of recency list ``list_id``, least recently used
        first, none of ``exclude``. Blocks last used together (a prompt's, touched in one
        call) go tail first, the furthest into its prompt first, as vLLM frees a request's
        blocks in reverse: what stays of a prompt is a prefix a lookup can still use, in every
        group alike. Costs the blocks returned, those skipped, and the rest of the last ones'
        batch."""
        if exclude is None or not exclude.size:
            return self._tail_first(list_id, count, None)
        marks = self.scratch.marks()
        marks[exclude] = True
        try:
            return self._tail_first(list_id, count, marks)
        finally:
            marks[exclude] = False

    def _tail_first(self, list_id: int, count: int, marks: NDArray[np.bool_] | None
                    ) -> IdArray:
        blocks = self._blocks

        def walk(limit: int, after: int = -1) -> IdArray:
            return self.recency.oldest(list_id, limit, blocks.pins, blocks.chunk_pins,
                                       self.pin_shift, marks, after=after)

        recency = self.recency
        chosen = walk(count)
        if chosen.size < count or not chosen.size:
            return chosen  # every candidate goes: their order does not matter
        # The walk may have cut the last batch short: find the rest of it (the list is in
        # last_use order, so the batch ends at the first younger block), a block first, then
        # twice as many each time.
        walked = recency.last_walked
        stamp = blocks.last_use[chosen[-1]]
        rest: list[IdArray] = []
        last, step = int(chosen[-1]), 1
        while True:
            more = walk(step, after=last)
            walked += recency.last_walked
            same = more[blocks.last_use[more] == stamp]
            if same.size:
                rest.append(same)
            if same.size < more.size or more.size < step:
                break
            last, step = int(more[-1]), min(2 * step, _TIE_STEP_MAX)
        recency.last_walked = walked
        if not rest:
            return chosen
        tied = blocks.last_use[chosen] == stamp
        batch = np.concatenate([chosen[tied], *rest])
        # Furthest into its prompt first; ties (another prompt's block at the same place) in
        # list order. The blocks taken are returned in list order all the same (the order
        # they are freed in is the order later allocations get ids in: ascending runs).
        order = np.argsort(-blocks.position[batch].astype(np.int64), kind="stable")
        taken = np.sort(order[:int(tied.sum())])
        out: IdArray = np.concatenate([chosen[~tied], batch[taken]])
        return out.astype(np.intp, copy=False)

    def in_list(self, ids: IdArray, list_id: int) -> NDArray[np.bool_]:
        """Per block: its state puts it on recency list ``list_id``."""
        member: NDArray[np.bool_] = self.recency.list_of_state[self.states[ids]] == list_id
        return member

    def reclaimable_mask(self, ids: IdArray) -> NDArray[np.bool_]:
        """Per block: it holds a device slot only waiting to be freed (``invalid``; pins not
        considered)."""
        return self.in_list(ids, RECLAIM_LIST)

    def record_checks(self, ids: IdArray, passed: NDArray[np.bool_]) -> None:
        """Checksum results a lookup saw at the blocks' current epochs. A failure sticks until
        the block's epoch moves; a pass never clears a failure."""
        check = self._blocks.check
        failed = ids[~passed]
        if failed.size:
            check[failed] = FAILED
            self.changes += 1
            self.change_count.total += 1
        good = ids[passed]
        check[good[check[good] == UNCHECKED]] = VERIFIED

    def add_layout(self, layout: Layout) -> None:
        """Blocks written from now on are laid out as ``layout``."""
        if layout not in self.layouts:
            if len(self.layouts) > int(np.iinfo(np.uint8).max):
                raise KvfsmError(f"{self.name}: too many layouts")
            self.layouts.append(layout)
        self.write_layout = self.layouts.index(layout)

    def event_row(self, event: Event) -> NDArray[np.bool_]:
        """Per state: the event has a row from it."""
        has_row: NDArray[np.bool_] = self.table.next_state[:, event] != INVALID
        return has_row
