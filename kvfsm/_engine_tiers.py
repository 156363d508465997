"""The engine's stored tiers (disk, remote): discovering their copies, forgetting copies they
evicted, spilling down into them and restoring from them.

What a block records of its stored copies is one bit per tier; the tier is the truth about what
it holds. This module keeps the two in step from the engine's side: a copy the tier's own size
cap evicted is forgotten once no state still leans on it (a block restored from it keeps the bit
until it is evicted back to the tier), blocks the caller is about to use are never spilled or
forgotten to make room, and a device batch larger than the host pool still moves down through
host to disk rather than being dropped while the tiers below have room.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm.fsm import INVALID
from kvfsm.restore import RestoreExecutor, RestoreTicket
from kvfsm.spec import Event, Tier
from kvfsm.spec._vocabulary import STORED_TIERS
from kvfsm.state import StateCore
from kvfsm.tiers import BlockKey, StoredTier
from kvfsm.verify import Prompt, Verdict

IdArray = NDArray[np.intp]


def check_tiers(core: StateCore, tiers: Mapping[Tier | str, StoredTier]) -> dict[Tier, StoredTier]:
    """``tiers`` keyed by ``Tier``, each one a stored tier the config gives blocks to, or a
    KvfsmError naming what is wrong."""
    out: dict[Tier, StoredTier] = {}
    for name, store in tiers.items():
        try:
            tier = Tier[name.upper()] if isinstance(name, str) else Tier(name)
        except (KeyError, ValueError):
            raise KvfsmError(f"Engine(tiers=...): unknown tier {name!r}; stored tiers are "
                             "'disk' and 'remote'") from None
        if tier not in STORED_TIERS:
            raise KvfsmError(f"Engine(tiers=...): {tier.spec_name} is a pool the core owns, "
                             "not a stored tier; pass 'disk' or 'remote'")
        if not isinstance(store, StoredTier):
            raise KvfsmError(f"Engine(tiers=...): {tier.spec_name} must be a StoredTier "
                             f"(DiskTier, MooncakeTier, RedisTier), got {type(store).__name__}")
        if not any(tier in group.stored for group in core.groups.values()):
            raise KvfsmError(f"Engine(tiers=...): a {tier.spec_name} tier was given but no "
                             f"group keeps blocks there: set CoreConfig.{tier.spec_name}_blocks")
        out[tier] = store
    return out


def _kept(size: int, keep: ArrayLike) -> IdArray:
    """The ids of ``keep`` that name blocks (others are ignored)."""
    kept = np.asarray(keep, dtype=np.intp).ravel()
    in_range: IdArray = kept[(kept >= 0) & (kept < size)]
    return in_range


class EngineTiers:
    """The stored-tier side of an :class:`~kvfsm.Engine` (``core``, its checked ``tiers`` and
    the ``restorer`` running I/O against them)."""

    def __init__(self, core: StateCore, tiers: Mapping[Tier, StoredTier],
                 restorer: RestoreExecutor) -> None:
        self.core = core
        self.tiers = dict(tiers)
        self.restorer = restorer
        #: Per tier, keys the tier reported evicted whose block could not be forgotten yet (it
        #: was restoring, or restored and still holding the copy's bit): looked at again by
        #: every :meth:`forget_evicted` until the block lands back on that tier or goes.
        self._gone: dict[Tier, dict[BlockKey, None]] = {tier: {} for tier in self.tiers}

    # -- discovery ---------------------------------------------------------------------------

    def discover(self, prompt: Prompt) -> int:
        """See :meth:`kvfsm.Engine.discover`."""
        adopted = 0
        for group in self.core.groups.values():
            tiers = [t for t in sorted(group.stored) if t in self.tiers]
            if not tiers:
                continue
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            index = group.rule.commit_blocks(decl, high.size)
            known = self.core.lookup_words(group.name, high[index], low[index]) >= 0
            missing = index[~known]
            if not missing.size:
                continue
            # Only the run before the first block neither known nor stored can ever be used.
            found_in = np.full(missing.size, -1, dtype=np.int64)
            for tier in tiers:
                unsure = np.flatnonzero(found_in < 0)
                keys = self.restorer.keys.prompt_keys(group.name, high, low, missing[unsure])
                found_in[unsure[self.tiers[tier].contains(keys)]] = int(tier)
            # Missing blocks are in index order: the first found nowhere ends the usable run.
            nowhere = np.flatnonzero(found_in < 0)
            limit = int(nowhere[0]) if nowhere.size else int(missing.size)
            for tier in tiers:
                chosen = missing[:limit][found_in[:limit] == int(tier)]
                room = min(group.stored[tier] - group.stored_used(tier), group.free_top)
                chosen = chosen[:max(room, 0)]
                if chosen.size:
                    self.core.discover(group.name, chosen, high[chosen], low[chosen], tier)
                    adopted += int(chosen.size)
        return adopted

    def forget_evicted(self) -> None:
        """Blocks whose only copy is in a stored tier that has since evicted it (its own size
        cap) are forgotten, so they stop being hits. A block still restoring from the copy, or
        restored from it (``device_disk``: readable, holding the copy's bit), is forgotten once
        it is back on the tier and the tier still lacks the copy."""
        for tier, store in self.tiers.items():
            drain = getattr(store, "drain_evicted", None)
            gone = self._gone[tier]
            if drain is not None:
                gone.update(dict.fromkeys(drain()))
            if gone:
                self._forget(tier, store, gone)

    def _forget(self, tier: Tier, store: StoredTier, gone: dict[BlockKey, None]) -> None:
        by_group: dict[str, list[BlockKey]] = {}
        for key in list(gone):
            name = self.restorer.keys.group_of.get(key.group)
            if name is None:
                del gone[key]
            else:
                by_group.setdefault(name, []).append(key)
        for name, keys in by_group.items():
            group = self.core.group(name)
            table = group.table
            words = np.array([(k.chain_high, k.chain_low) for k in keys], dtype=np.uint64)
            ids = self.core.lookup_words(name, words[:, 0], words[:, 1])
            known = ids >= 0
            own = np.zeros(ids.size, dtype=np.bool_)
            if known.any():
                # The evicted file was this block's copy (same layout and range) and the block
                # still records holding it.
                current = self.restorer.keys.keys(name, ids[known])
                own[known] = np.array([a == b for a, b in
                                       zip(current, [keys[i] for i in np.flatnonzero(known)],
                                           strict=True)], dtype=np.bool_)
                own &= np.where(known, group.holds(tier)[np.maximum(ids, 0)], False)
            states = group.states[np.maximum(ids, 0)]
            waiting = own & (table.in_flight[states] | (table.residency[states] != int(tier)))
            back = own & ~waiting
            if back.any():
                # A copy written again since the eviction (the block was recomputed and
                # spilled anew) is the block's copy now: keep it.
                chosen = np.flatnonzero(back)
                there = store.contains([keys[i] for i in chosen.tolist()])
                self.core.fire(name, ids[chosen[~there]], Event.EVICT, masked=True)
            for i in np.flatnonzero(~waiting).tolist():
                del gone[keys[i]]

    # -- spills ------------------------------------------------------------------------------

    def spill_down(self, group: str, tier: Tier, count: int, keep: ArrayLike = ()) -> int:
        """See :meth:`kvfsm.Engine.spill_down`."""
        if count <= 0:
            return 0
        core = self.core
        state = core.group(group)
        resting = state.resting_lists.get(Tier(tier))
        if resting is None:
            return 0  # no state of this lifecycle rests there
        # The oldest unpinned blocks resting there (a recency list: costs what it walks).
        ids = state.oldest(resting, count, _kept(state.n_blocks, keep))
        if not ids.size:
            return 0
        below = Tier(int(tier) + 1) if int(tier) + 1 < len(Tier) else None
        if below is not None and below in state.stored and below in self.tiers:
            room = state.stored[below] - state.stored_used(below)
            self.spill_down(group, below, ids.size - room, keep)
            moved = self.restorer.store(group, ids)
        else:
            moved = np.zeros(ids.size, dtype=np.bool_)
        if tier in state.stored:
            core.fire(group, ids[~moved], Event.EVICT, masked=True)
            return int(ids.size)
        return int(moved.sum())

    def spill_from_device(self, group: str, ids: IdArray, keep: ArrayLike = ()
                          ) -> NDArray[np.bool_]:
        """Spill readable device blocks ``ids`` (oldest first) to host, a host pool's room at
        a time: before each batch the host's oldest blocks (never one of ``keep``) move down to
        disk (and disk's to remote) where those tiers are attached, so a batch larger than
        the host pool still lands. Returns which of ``ids`` moved (the rest stay on device)."""
        core = self.core
        state = core.group(group)
        spilled = np.zeros(ids.size, dtype=np.bool_)
        host = state.pools.get(Tier.HOST)
        if host is None or not ids.size:
            return spilled
        cascade = Tier.DISK in state.stored and Tier.DISK in self.tiers
        todo = np.flatnonzero(state.event_row(Event.SPILL_BEGIN)[state.states[ids]])
        while todo.size:
            if cascade:
                self.spill_down(group, Tier.HOST, todo.size - host.free, keep)
            part, todo = todo[:host.free], todo[host.free:]
            if not part.size:
                break
            batch = ids[part]
            began = core.fire(group, batch, Event.SPILL_BEGIN, masked=True)
            done = np.zeros(batch.size, dtype=np.bool_)
            done[began] = core.fire(group, batch[began], Event.SPILL_DONE, masked=True)
            core.fire(group, batch[began & ~done], Event.SPILL_FAIL)
            spilled[part[done]] = True
        return spilled

    def offload(self, group: str, ids: IdArray, keep: ArrayLike = ()) -> NDArray[np.bool_]:
        """See :meth:`kvfsm.Engine.offload`."""
        core = self.core
        state = core.group(group)
        table = state.table
        moved = np.zeros(ids.size, dtype=np.bool_)
        if not ids.size:
            return moved
        states = state.states[ids]
        on_device = (table.residency[states] == int(Tier.DEVICE)) & ~table.in_flight[states]
        after_evict = table.next_state[states, int(Event.EVICT)]
        # A restored block that kept its stored copy gives the device slot back and stays a
        # hit on that copy (its eviction lands in a hashed state).
        keeps_copy = on_device & (after_evict != INVALID) & \
            table.hashed[np.where(after_evict == INVALID, 0, after_evict)]
        if keeps_copy.any():
            chosen = np.flatnonzero(keeps_copy)
            moved[chosen] = core.fire(group, ids[chosen], Event.EVICT, masked=True)
        spill = np.flatnonzero(on_device & ~keeps_copy & table.readable[states])
        host = state.pools.get(Tier.HOST)
        if not spill.size or host is None:
            return moved
        protect = np.concatenate([_kept(state.n_blocks, keep), ids]).astype(np.intp)
        short = int(spill.size) - host.free
        below_host = Tier.DISK in state.stored and Tier.DISK in self.tiers
        resting = state.resting_lists.get(Tier.HOST)
        if short > 0 and not below_host and resting is not None:
            # Nothing below host takes its oldest: they make way (the newest stay hits).
            oldest = state.oldest(resting, short, protect)
            core.fire(group, oldest, Event.EVICT, masked=True)
        moved[spill] = self.spill_from_device(group, ids[spill], protect)
        return moved

    # -- restores ----------------------------------------------------------------------------

    def restore(self, verdict: Verdict, prompt: Prompt | None) -> RestoreTicket:
        """See :meth:`kvfsm.Engine.restore`."""
        keep: dict[str, NDArray[np.intp]] = {}
        if prompt is not None:
            # Room is made only in the groups the plan restores into: their blocks of the
            # prompt that the restorable prefix reads are kept (an array: costs those blocks
            # once, never the pool). Blocks past it (the prompt's last block, always computed
            # again) may make room: keeping them could leave a device exactly the prefix's
            # size one slot short.
            for name in {step.group for step in verdict.plan}:
                group = self.core.group(name)
                size = group.decl.block_size
                needed = -(-verdict.restorable_tokens // size)
                high, low = prompt.words(size)
                ids = self.core.lookup_words(name, high[:needed], low[:needed])
                keep[name] = ids[ids >= 0]
        return self.restorer.submit(verdict.plan, keep=keep)
