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
from kvfsm.state import FAILED, NO_TARGET, GroupState, StateCore, StateError
from kvfsm.verify import Prompt

#: Content for one group's blocks: ``(group, block indices) -> uint8 [k, payload_bytes]``.
PayloadFn = Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]


def zero_payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
    return np.zeros((index.size, group.decl.payload_bytes), dtype=np.uint8)


@attrs.frozen(eq=False)
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
    ) -> Mapping[str, NDArray[np.intp]]:
        """See :meth:`kvfsm.Engine.commit`: settle the prompt's cached blocks, plan every
        group, check room for all, then per group make room, write and settle."""
        chosen = self._groups(groups)
        for group in chosen:
            self._settle(group, prompt)
        plans = [self._plan(group, prompt, payload) for group in chosen]
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
            if isinstance(names, str):
                raise KvfsmError("commit(groups=...) takes a list of group names, not a str")
            for name in names:
                self.core.group(name)  # names the groups when one does not exist
        chosen = [g for g in self.core.groups.values() if names is None or g.name in names]
        # Groups whose blocks point into another group come after it.
        return sorted(chosen, key=lambda g: g.rule.has_targets)

    def _plan(self, group: GroupState, prompt: Prompt, payload: PayloadFn) -> _GroupCommit:
        decl = group.decl
        high, low = prompt.words(decl.block_size)
        index = group.rule.commit_blocks(decl, high.size)
        known = self.core.lookup_words(group.name, high[index], low[index])
        cached = known >= 0
        held = np.where(cached, known, 0)
        failed = cached & (group.check[held] == FAILED) & group.unpinned(held)
        fresh = index[~cached | failed]
        content = np.asarray(payload(group, fresh), dtype=np.uint8)
        if content.size != fresh.size * decl.payload_bytes:
            raise KvfsmError(f"{group.name}: payload gave {content.size} bytes for "
                             f"{fresh.size} blocks; expected shape "
                             f"[{fresh.size}, {decl.payload_bytes}]")
        return _GroupCommit(group, fresh, content.reshape(fresh.size, decl.payload_bytes),
                            known[failed].astype(np.intp),
                            known[cached & ~failed].astype(np.intp))

    def _givable(self, plan: _GroupCommit, count: int) -> NDArray[np.intp]:
        """Up to ``count`` blocks of ``plan``'s group that :meth:`give_back` may take for
        room: invalid first, then least recently used; never the prompt's own."""
        return self.core.eviction_candidates(plan.group.name, count, exclude=plan.kept)

    def _check_room(self, plans: list[_GroupCommit]) -> None:
        for plan in plans:
            group = plan.group
            device = group.pools[Tier.DEVICE]
            short = plan.fresh.size - device.free - plan.replaced.size
            if short > 0 and short > (givable := self._givable(plan, short).size):
                raise StateError(
                    f"{group.name}: commit needs {plan.fresh.size} device blocks, "
                    f"{device.free} are free and only {givable} more can be "
                    "given back (the rest are pinned or this prompt's own); nothing changed")

    def _make_room(self, plan: _GroupCommit) -> None:
        group, core = plan.group, self.core
        if plan.replaced.size:
            core.fire(group.name, plan.replaced, Event.INVALIDATE)
            # Those left holding their slot with no reader give it back now (pinned ones wait).
            waiting = plan.replaced[group.reclaimable_mask(plan.replaced)
                                    & group.unpinned(plan.replaced)]
            core.fire(group.name, waiting, Event.FREE)
        self.give_back(group.name, plan.fresh.size - group.pools[Tier.DEVICE].free, plan.kept)

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
        spilled = self.stored.spill_from_device(group, readable, keep)
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

