"""The embedding API a serving engine calls: prompts, lookups, and committing computed blocks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm._jit import warm_up
from kvfsm.spec import Event, GroupKind, ModelDecl
from kvfsm.state import NO_TARGET, CoreConfig, GroupState, StateCore
from kvfsm.verify import DeviceProfile, KernelLayouts, Level, Prompt, Verdict, lookup

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


class Engine:
    """A model's cache state core plus the lookup that turns a prompt into a :class:`Verdict`."""

    def __init__(
        self,
        model: ModelDecl,
        config: CoreConfig | None = None,
        *,
        profile: DeviceProfile | None = None,
        policy: VerifyPolicy | None = None,
    ) -> None:
        self.core = StateCore(model, config)
        # Compile the lookup's kernels now (or load them from the disk cache), not during the
        # first request.
        warm_up()
        self.model = model
        self.profile = profile or DeviceProfile()
        self.policy = policy or VerifyPolicy()

    def prompt(self, token_ids: Sequence[int] | ArrayLike = ()) -> Prompt:
        """A prompt whose block hashes (every block size of the model) are kept incrementally."""
        return Prompt(self.core.seed, (g.block_size for g in self.model.groups), token_ids)

    def lookup(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        level: Level | None = None,
        priority: int = 0,
        kernel_layouts: KernelLayouts | None = None,
        drop_last_block: bool = False,
    ) -> Verdict:
        """The verdict for ``prompt``; ``level`` defaults to the policy's level for
        ``priority``."""
        if not isinstance(prompt, Prompt):
            prompt = self.prompt(prompt)
        return lookup(self.core, prompt, level=level or self.policy.level_for(priority),
                      kernel_layouts=kernel_layouts, profile=self.profile,
                      drop_last_block=drop_last_block)

    def commit(
        self,
        prompt: Prompt,
        *,
        payload: PayloadFn = _zero_payload,
        groups: Sequence[str] | None = None,
    ) -> Mapping[str, NDArray[np.intp]]:
        """Cache every complete block of ``prompt`` the model keeps, as a prefill would leave
        them: written and complete; compressed-history blocks older than the tail compressed;
        index blocks pointing at the history blocks before them; recurrent snapshots only at
        checkpoints. Blocks already cached are skipped. Returns the new block ids per group."""
        out: dict[str, NDArray[np.intp]] = {}
        order = sorted(self.core.groups.values(),
                       key=lambda g: g.decl.kind is GroupKind.SPARSE_INDEX)
        for group in order:
            if groups is None or group.name in groups:
                out[group.name] = self._commit_group(group, prompt, payload)
        return out

    def _commit_group(self, group: GroupState, prompt: Prompt,
                      payload: PayloadFn) -> NDArray[np.intp]:
        decl = group.decl
        high, low = prompt.words(decl.block_size)
        index = np.arange(high.size, dtype=np.int64)
        if decl.kind is GroupKind.RECURRENT:
            interval = decl.checkpoint_interval or decl.block_size
            index = index[(index + 1) * decl.block_size % interval == 0]
        known = self.core.lookup_words(group.name, high[index], low[index])
        fresh = index[known < 0]
        core, name = self.core, group.name
        ids = np.zeros(0, dtype=np.intp)
        if fresh.size:
            ids = core.allocate(name, fresh, high[fresh], low[fresh])
            core.fire(name, ids, Event.WRITE_BEGIN)
            if group.target is not None:
                core.set_index_refs(name, ids, self._targets(group, prompt, fresh))
            core.write(name, ids, payload(group, fresh))
            core.fire(name, ids, Event.WRITE_DONE)
        if decl.kind is GroupKind.COMPRESSED:
            self._compress_old(group, prompt)
        return ids

    def _compress_old(self, group: GroupState, prompt: Prompt) -> None:
        """Compress every raw history block of the prompt that is now older than the tail
        (blocks cached by a shorter prompt included); pinned ones wait (masked fire)."""
        decl = group.decl
        high, low = prompt.words(decl.block_size)
        ids = self.core.lookup_words(group.name, high, low)
        ends = (np.arange(ids.size) + 1) * decl.block_size
        old = ids[(ids >= 0) & (ends <= prompt.n_tokens - (decl.tail_tokens or 0))]
        # Which blocks can start compressing is the table's answer, not a state name.
        raw = old[group.event_row(Event.COMPRESS_BEGIN)[group.states[old]]]
        if raw.size:
            moved = self.core.fire(group.name, raw, Event.COMPRESS_BEGIN)
            self.core.fire(group.name, raw[moved], Event.COMPRESS_DONE, masked=True)

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
