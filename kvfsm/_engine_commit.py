"""Committing a prefill's blocks: which blocks each kind keeps, room made by giving back other
prompts' blocks, then allocate, write and settle, all or nothing across groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._engine_tiers import EngineTiers
from kvfsm._errors import KvfsmError
from kvfsm.spec import Event, Tier
from kvfsm.state import FAILED, NO_TARGET, GroupState, Prompt, StateCore, StateError

#: Content for one group's blocks: ``(group, block indices) -> uint8 [k, payload_bytes]``.
PayloadFn = Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]


def zero_payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
    return np.zeros((index.size, group.decl.payload_bytes), dtype=np.uint8)


@attrs.define(eq=False)
class _GroupCommit:
    """What a commit will do to one group, decided before anything changes."""

    group: GroupState
    #: Prompt block indices to write, and their content.
    fresh: NDArray[np.int64]
    payload: NDArray[np.uint8]
    #: Cached blocks of the prompt a lookup saw fail: invalidated and written again.
    replaced: NDArray[np.intp]
    #: Cached blocks of the prompt kept as they are (never evicted to make room).
    kept: NDArray[np.intp]
    #: Per entry of ``fresh``: a refresh, i.e. a block this prefill computed that is cached
    #: only in a lower tier (host, disk, remote; one whose load failed included), written
    #: anew where the device has room once the required blocks have theirs.
    refresh: NDArray[np.bool_]
    #: Per entry of ``fresh``: the cached block a refresh replaces (-1 for the others).
    stale: NDArray[np.intp]

    @property
    def required(self) -> int:
        return int(self.fresh.size - self.refresh.sum())


class Committer:
    """The engine's commit and give-back (the engine holds its lock around both)."""

    def __init__(self, core: StateCore, stored: EngineTiers) -> None:
        self.core = core
        self.stored = stored

    def commit(
        self,
        prompt: Prompt,
        *,
        payload: PayloadFn = zero_payload,
        groups: Sequence[str] | None = None,
        computed_from: int = 0,
        unavailable: Mapping[str, NDArray[np.int64]] | None = None,
    ) -> Mapping[str, NDArray[np.intp]]:
        """See :meth:`kvfsm.Engine.commit`: settle the prompt's cached blocks, plan every
        group, check room for all, then per group make room, write and settle."""
        chosen = self._groups(groups)
        for group in chosen:
            self._settle(group, prompt)
        plans: list[_GroupCommit] = []
        for group in chosen:
            plans.append(self._plan(group, prompt, payload, computed_from,
                                    (unavailable or {}).get(group.name),
                                    self._doomed(group, plans)))
        self._check_room(plans)
        out: dict[str, NDArray[np.intp]] = {}
        for plan in plans:
            self._make_room(plan)
            out[plan.group.name] = self._write(plan, prompt)
            # Settled before the groups pointing into it are written: settling (compressing)
            # moves epochs, which would leave their fresh references stale.
            self._settle(plan.group, prompt)
        return out

    def _groups(self, names: Sequence[str] | None) -> list[GroupState]:
        if names is not None:
            if isinstance(names, str) or not isinstance(names, Sequence | set | frozenset):
                raise KvfsmError(f"commit(groups=...) takes a list of group names, not a "
                                 f"{type(names).__name__}")
            for name in names:
                if not isinstance(name, str):
                    raise KvfsmError(f"commit(groups=...): {name!r} is not a group name")
                self.core.group(name)  # names the groups when one does not exist
        chosen = [g for g in self.core.groups.values() if names is None or g.name in names]
        # Groups whose blocks point into another group come after it.
        return sorted(chosen, key=lambda g: g.rule.has_targets)

    @staticmethod
    def _doomed(group: GroupState, earlier: list[_GroupCommit]) -> NDArray[np.intp]:
        """Blocks of ``group`` pointing at a block an earlier group's plan invalidates (a
        replaced one, or the stale copy a refresh replaces): invalidating a target invalidates
        its index blocks with it, so the prompt's are written again like failed ones."""
        if group.target is None or group.dependents is None:
            return np.zeros(0, dtype=np.intp)
        for plan in earlier:
            if plan.group is group.target:
                dropped = np.concatenate([plan.replaced, plan.stale[plan.refresh]])
                return group.dependents.rows_pointing_at(dropped.astype(np.intp))
        return np.zeros(0, dtype=np.intp)

    def _plan(self, group: GroupState, prompt: Prompt, payload: PayloadFn, computed_from: int,
              unavailable: NDArray[np.int64] | None, doomed: NDArray[np.intp]) -> _GroupCommit:
        decl = group.decl
        high, low = prompt.words(decl.block_size)
        index = group.rule.commit_blocks(decl, high.size)
        if unavailable is not None and unavailable.size:
            index = index[~np.isin(index, unavailable)]
        known = self.core.lookup_words(group.name, high[index], low[index])
        cached = known >= 0
        held = np.where(cached, known, 0)
        states = group.states[held]
        table = group.table
        unpinned = group.unpinned(held)
        failed = cached & (group.check[held] == FAILED) & unpinned
        if doomed.size:
            failed |= cached & np.isin(held, doomed)
        # Computed by this prefill yet cached only in a lower tier: the fresh copy replaces it
        # (it is readable at once; the stored one may be what failed to load).
        computed = (index + 1) * decl.block_size > computed_from
        lower = cached & ~failed & unpinned & computed & ~table.readable[states] \
            & ~table.in_flight[states] & table.hashed[states]
        writes = ~cached | failed | lower
        fresh = index[writes]
        content = payload(group, fresh)
        expected = (int(fresh.size), decl.payload_bytes)
        # Bytes as they are: never cast (a float array would be cached as its rounded values)
        # nor reshaped (a transposed array would be cached scrambled).
        if not isinstance(content, np.ndarray) or content.dtype != np.uint8 \
                or content.shape != expected:
            got = (f"{content.dtype} array of shape {list(content.shape)}"
                   if isinstance(content, np.ndarray) else type(content).__name__)
            raise KvfsmError(f"commit(payload=...): {group.name}: the payload of {fresh.size} "
                             f"blocks must be a uint8 array of shape {list(expected)} (each "
                             f"block's bytes as the kernels lay them out), got {got}")
        return _GroupCommit(group, fresh, content,
                            known[failed].astype(np.intp),
                            known[cached & ~failed & ~lower].astype(np.intp),
                            lower[writes], np.where(lower, known, -1)[writes].astype(np.intp))

    def device_short(self, prompt: Prompt, groups: Sequence[str] | None) -> dict[str, int]:
        """Per group: device blocks a commit of ``prompt`` would give back for room (at most:
        blocks already cached are not counted out), asking for no payload."""
        out = {}
        for group in self._groups(groups):
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            index = group.rule.commit_blocks(decl, high.size)
            fresh = int((self.core.lookup_words(group.name, high[index], low[index]) < 0).sum())
            short = fresh - group.pools[Tier.DEVICE].free
            if short > 0:
                out[group.name] = short
        return out

    def own_blocks(self, prompt: Prompt, group: str) -> NDArray[np.intp]:
        """The blocks of ``group`` already cached for ``prompt`` (never given back for its
        own room)."""
        state = self.core.group(group)
        high, low = prompt.words(state.decl.block_size)
        ids = self.core.lookup_words(group, high, low)
        own: NDArray[np.intp] = ids[ids >= 0].astype(np.intp)
        return own

    def _givable(self, plan: _GroupCommit, count: int) -> NDArray[np.intp]:
        """Up to ``count`` blocks of ``plan``'s group that :meth:`give_back` may take for
        room: invalid first, then least recently used; never the prompt's own."""
        return self.core.eviction_candidates(plan.group.name, count, exclude=plan.kept)

    def _check_room(self, plans: list[_GroupCommit]) -> None:
        for plan in plans:
            group = plan.group
            device = group.pools[Tier.DEVICE]
            # Replaced blocks holding a device slot give it back (one only in a lower tier
            # gives none).
            freed = int(((group.slot[Tier.DEVICE][plan.replaced] >= 0)
                         & group.unpinned(plan.replaced)).sum())
            short = plan.required - device.free - freed
            if short > 0 and short > (givable := self._givable(plan, short).size):
                raise StateError(
                    f"{group.name}: commit needs {plan.required} device blocks, "
                    f"{device.free} are free and only {givable} more can be "
                    "given back (the rest are pinned or this prompt's own); nothing changed")

    def _make_room(self, plan: _GroupCommit) -> None:
        group, core = plan.group, self.core
        if plan.replaced.size:
            # Those pointing at a target replaced just before were invalidated with it.
            core.fire(group.name, self._still_hashed(group, plan.replaced), Event.INVALIDATE)
            # Those left holding their slot with no reader give it back now (pinned ones wait).
            waiting = plan.replaced[group.reclaimable_mask(plan.replaced)
                                    & group.unpinned(plan.replaced)]
            core.fire(group.name, waiting, Event.FREE)
        device = group.pools[Tier.DEVICE]
        self.give_back(group.name, plan.required - device.free, plan.kept)
        if plan.refresh.any():
            # Refreshes take what room is left after the required blocks, as far as more can
            # be given back, in prompt order; the others keep their lower-tier copy.
            self.give_back(group.name, plan.fresh.size - device.free, plan.kept)
            room = device.free - plan.required
            order = np.cumsum(plan.refresh)
            dropped = plan.refresh & (order > room)
            keep = ~dropped
            plan.fresh, plan.payload = plan.fresh[keep], plan.payload[keep]
            plan.refresh, plan.stale = plan.refresh[keep], plan.stale[keep]
            stale = plan.stale[plan.refresh]
            # Out of the hash map first (their key is the fresh block's).
            core.fire(group.name, self._still_hashed(group, stale), Event.INVALIDATE)

    @staticmethod
    def _still_hashed(group: GroupState, ids: NDArray[np.intp]) -> NDArray[np.intp]:
        """``ids`` less those already invalidated (as dependents of a target replaced by this
        commit)."""
        still: NDArray[np.intp] = ids[group.table.hashed[group.states[ids]]]
        return still

    def give_back(self, group: str, count: int, keep: ArrayLike = ()) -> int:
        """See :meth:`kvfsm.Engine.give_back`."""
        if count <= 0:
            return 0
        core = self.core
        state = core.group(group)
        chosen = core.eviction_candidates(group, count, exclude=keep)
        invalid = state.reclaimable_mask(chosen)
        core.fire(group, chosen[invalid], Event.FREE)
        readable = chosen[~invalid]
        # To host where there is room, host's oldest moving on to disk (never one of keep).
        spilled = self.stored.spill_from_device(group, readable)
        core.fire(group, readable[~spilled], Event.EVICT)
        return int(chosen.size)

    def _write(self, plan: _GroupCommit, prompt: Prompt) -> NDArray[np.intp]:
        group, core, fresh = plan.group, self.core, plan.fresh
        if not fresh.size:
            return np.zeros(0, dtype=np.intp)
        high, low = prompt.words(group.decl.block_size)
        ids = core.allocate(group.name, fresh, high[fresh], low[fresh])
        core.fire(group.name, ids, Event.WRITE_BEGIN)
        if group.target is not None:
            core.set_index_refs(group.name, ids, self._targets(group, prompt, fresh))
        core.write(group.name, ids, plan.payload)
        core.fire(group.name, ids, Event.WRITE_DONE)
        return ids

    def _settle(self, group: GroupState, prompt: Prompt) -> None:
        """Fire the kind's settle events (compression) on the prompt's cached blocks whose
        state has a row for them; pinned ones wait (masked fire)."""
        if not group.rule.settle_events:
            return
        high, low = prompt.words(group.decl.block_size)
        ids = self.core.lookup_words(group.name, high, low)
        ids = ids[ids >= 0]
        for event in group.rule.settle_events:
            ready = ids[group.event_row(event)[group.states[ids]]]
            if ready.size:
                self.core.fire(group.name, ready, event, masked=True)

    def _targets(self, group: GroupState, prompt: Prompt,
                 index: NDArray[np.int64]) -> NDArray[np.int32]:
        """For each index block, the most recent target blocks complete before its end."""
        target = group.target
        if target is None:
            raise KvfsmError(f"{group.name}: not a sparse-index group")
        top_k = group.refs_target.shape[1]
        high, low = prompt.words(target.decl.block_size)
        target_ids = self.core.lookup_words(target.name, high, low)
        if not target_ids.size:
            return np.full((index.size, top_k), NO_TARGET, dtype=np.int32)
        # Row i: the top_k most recent cached targets complete before index block i ends,
        # oldest first, packed to the front of the row.
        complete = np.minimum((index + 1) * group.decl.block_size // target.decl.block_size,
                              target_ids.size)
        picks = complete[:, None] - top_k + np.arange(top_k)[None, :]
        chosen = np.where(picks >= 0, target_ids[np.maximum(picks, 0)], NO_TARGET)
        chosen = np.where(chosen >= 0, chosen, NO_TARGET)
        order = np.argsort(chosen == NO_TARGET, axis=1, kind="stable")
        refs: NDArray[np.int32] = np.take_along_axis(chosen, order, axis=1).astype(np.int32)
        return refs

