"""The embedding API a serving engine calls: prompts, lookups, and committing computed blocks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._engine_tiers import EngineTiers, check_tiers
from kvfsm._errors import KvfsmError
from kvfsm._jit import warm_up
from kvfsm.restore import RestoreExecutor, RestoreTicket
from kvfsm.spec import Event, Lifecycle, ModelDecl, Tier, shipped_models
from kvfsm.state import FAILED, NO_TARGET, CoreConfig, GroupState, StateCore, StateError
from kvfsm.tiers import StoredTier
from kvfsm.verify import (
    DeviceProfile,
    KernelLayouts,
    Level,
    Prompt,
    Verdict,
    as_level,
    lookup,
)

#: Content for one group's blocks: ``(group, block indices) -> uint8 [k, payload_bytes]``.
PayloadFn = Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]


@attrs.frozen
class VerifyPolicy:
    """Which verification level a request priority gets (higher number = more important)."""

    full_at_or_above: int = 10
    fast_below: int = 0

    def level_for(self, priority: int) -> Level:
        if priority >= self.full_at_or_above:
            return Level.FULL
        return Level.FAST if priority < self.fast_below else Level.STANDARD


def _zero_payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
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


class Engine:
    """A model's cache state core plus the lookup that turns a prompt into a :class:`Verdict`."""

    def __init__(
        self,
        model: ModelDecl | str,
        config: CoreConfig | None = None,
        *,
        lifecycles: Mapping[str, Lifecycle] | None = None,
        profile: DeviceProfile | None = None,
        policy: VerifyPolicy | None = None,
        tiers: Mapping[Tier | str, StoredTier] | None = None,
        workers: int = 2,
    ) -> None:
        if isinstance(model, str):
            models = shipped_models()
            if model not in models:
                raise KvfsmError(f"no shipped model {model!r}; shipped: {sorted(models)} "
                                 "(pass a ModelDecl from load_model for others)")
            model = models[model]
        self.core = StateCore(model, config, lifecycles=lifecycles)
        self.tiers = check_tiers(self.core, tiers or {})
        #: Runs restore plans and spills into the stored tiers (host restores need no tier).
        self.restorer = RestoreExecutor(self.core, self.tiers, workers=workers,
                                        make_room=self.give_back)
        self._stored = EngineTiers(self.core, self.tiers, self.restorer)
        # Compile the lookup's kernels now (or load them from the disk cache), not during the
        # first request.
        warm_up()
        self.model = model
        self.profile = profile or DeviceProfile()
        self.policy = policy or VerifyPolicy()
        self._block_sizes = tuple(g.block_size for g in model.groups)

    def prompt(self, token_ids: Sequence[int] | ArrayLike = ()) -> Prompt:
        """A prompt whose block hashes (every block size of the model) are kept incrementally."""
        return Prompt(self.core.seed, self._block_sizes, token_ids)

    def _own(self, prompt: Prompt | Sequence[int] | ArrayLike) -> Prompt:
        """``prompt`` made here (token ids become a prompt), or a ForeignPromptError."""
        if not isinstance(prompt, Prompt):
            return self.prompt(prompt)
        prompt.check_made_for(self.core.seed, self._block_sizes, "engine")
        return prompt

    def lookup(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        level: Level | str | None = None,
        priority: int = 0,
        kernel_layouts: KernelLayouts | None = None,
        drop_last_block: bool = False,
    ) -> Verdict:
        """The verdict for ``prompt``; ``level`` defaults to the policy's level for
        ``priority``. The checksums the lookup computed are recorded in the core, so a block
        seen failing is unusable at every level until its content changes."""
        chosen = self.policy.level_for(priority) if level is None else as_level(level)
        prompt = self._own(prompt)
        if self.tiers:
            self.restorer.poll()  # loads that finished since: their blocks are readable now
            self._forget_evicted()
            self.discover(prompt)
        verdict = lookup(self.core, prompt, level=chosen,
                         kernel_layouts=kernel_layouts, profile=self.profile,
                         drop_last_block=drop_last_block)
        for checks in verdict.checks:
            self.core.record_checks(checks.group, checks.block_ids, checks.passed)
        return verdict

    # -- stored tiers ------------------------------------------------------------------------

    def discover(self, prompt: Prompt | Sequence[int] | ArrayLike) -> int:
        """Adopt copies of ``prompt``'s blocks that the stored tiers hold but this core does
        not know (another engine spilled them, or this one before a restart): per group, the
        blocks a prefill keeps, in order, each from the fastest tier that has it, up to the
        first found nowhere. They become hash hits to restore; loading verifies them. Returns
        the blocks adopted. :meth:`lookup` calls it when tiers are attached."""
        return self._stored.discover(self._own(prompt))

    def restore(self, verdict: Verdict, prompt: Prompt | None = None) -> RestoreTicket:
        """Start the restores of ``verdict.plan``: device room is made first (never by giving
        back, spilling or forgetting ``prompt``'s own blocks), host copies land at once, disk
        and remote copies load on worker threads. ``ticket.wait(group, timeout)`` settles
        them; a block whose copy fails stays unusable and the next lookup recomputes from it."""
        return self._stored.restore(verdict, None if prompt is None else self._own(prompt))

    def _forget_evicted(self) -> None:
        """Blocks known only in a stored tier whose copy that tier has since evicted (its own
        size cap) are forgotten, so they stop being hits."""
        self._stored.forget_evicted()

    def spill_down(self, group: str, tier: Tier, count: int, keep: ArrayLike = ()) -> int:
        """Move up to ``count`` least recently used unpinned blocks resident in ``tier`` (never
        one of ``keep``) one tier down (host -> disk, disk -> remote) through the stored tiers,
        making room there first the same way; where no tier below takes them, blocks on disk
        are forgotten (their files stay until the disk's own cap evicts them). Returns the
        blocks moved or dropped."""
        return self._stored.spill_down(group, tier, count, keep)

    def close(self) -> None:
        """Finish running I/O and stop the restore workers (the tiers stay open)."""
        self.restorer.close()

    # -- commit ----------------------------------------------------------------------------

    def commit(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        payload: PayloadFn = _zero_payload,
        groups: Sequence[str] | None = None,
    ) -> Mapping[str, NDArray[np.intp]]:
        """Cache every complete block of ``prompt`` the model keeps, as a prefill leaves them
        (each kind's rule says which blocks and what follows the write: compressed history
        is compressed, index blocks point at the history before them, recurrent snapshots
        exist only at checkpoints). Blocks already cached are kept; ones a lookup saw fail
        are replaced.

        All or nothing across groups: when a group lacks device room, unpinned blocks of
        other prompts are given back first (invalid ones, then least recently used ones,
        spilled where a tier has room, else evicted); if that cannot make enough room a
        :class:`StateError` says where, and no block was allocated or given back. (Blocks of
        the prompt already cached are settled first, e.g. compressed, as the prefill does to
        them anyway: it takes no room, and index blocks are then written against the settled
        history.) Returns the new block ids per group.
        """
        prompt = self._own(prompt)
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
        failed = cached & (group.check[held] == FAILED) & (group.pins[held] == 0)
        fresh = index[~cached | failed]
        content = np.asarray(payload(group, fresh), dtype=np.uint8)
        if content.size != fresh.size * decl.payload_bytes:
            raise KvfsmError(f"{group.name}: payload gave {content.size} bytes for "
                             f"{fresh.size} blocks; expected shape "
                             f"[{fresh.size}, {decl.payload_bytes}]")
        return _GroupCommit(group, fresh, content.reshape(fresh.size, decl.payload_bytes),
                            known[failed].astype(np.intp),
                            known[cached & ~failed].astype(np.intp))

    def _givable(self, plan: _GroupCommit) -> NDArray[np.intp]:
        """Blocks of ``plan``'s group that :meth:`give_back` may take for room: invalid
        first, then least recently used; never the prompt's own."""
        group = plan.group
        candidates = self.core.eviction_candidates(group.name, group.n_blocks)
        return candidates[~np.isin(candidates, plan.kept)]

    def _check_room(self, plans: list[_GroupCommit]) -> None:
        for plan in plans:
            group = plan.group
            device = group.pools[Tier.DEVICE]
            short = plan.fresh.size - device.free - plan.replaced.size
            if short > 0 and short > self._givable(plan).size:
                raise StateError(
                    f"{group.name}: commit needs {plan.fresh.size} device blocks, "
                    f"{device.free} are free and only {self._givable(plan).size} more can be "
                    "given back (the rest are pinned or this prompt's own); nothing changed")

    def _make_room(self, plan: _GroupCommit) -> None:
        group, core = plan.group, self.core
        if plan.replaced.size:
            core.fire(group.name, plan.replaced, Event.INVALIDATE)
            waiting = core.reclaimable(group.name)
            core.fire(group.name, waiting[np.isin(waiting, plan.replaced)], Event.FREE)
        self.give_back(group.name, plan.fresh.size - group.pools[Tier.DEVICE].free, plan.kept)

    def give_back(self, group: str, count: int, keep: ArrayLike = ()) -> int:
        """Free up to ``count`` device slots of ``group``: unpinned invalid blocks first, then
        the least recently used unpinned ones, spilled a tier down where there is room (still
        a hit, restorable), else evicted; never a block of ``keep``. Returns the blocks given
        back (commit uses it for room; a restore executor can too)."""
        if count <= 0:
            return 0
        core = self.core
        state = core.group(group)
        candidates = core.eviction_candidates(group, state.n_blocks)
        chosen = candidates[~np.isin(candidates, np.asarray(keep, dtype=np.intp))][:count]
        invalid = np.isin(chosen, core.reclaimable(group))
        core.fire(group, chosen[invalid], Event.FREE)
        readable = chosen[~invalid]
        # To host where there is room, host's oldest moving on to disk (never one of keep).
        spilled = self._stored.spill_from_device(group, readable, keep)
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

