"""Between a transformers KV cache and kvfsm's pools: commit by block, rebuild by verdict.

:class:`CacheAdapter` serves a model whose layers keep full-attention or sliding-window K/V
(GPT-OSS): each ``full`` group of the declaration holds the config's ``full_attention`` layers,
each ``sliding_window`` group its ``sliding_attention`` layers, and one block's payload is
``[layers of that type, 2 (K, V), num_key_value_heads, block_size, head_dim]`` with the layers
in ``config.layer_types`` order.

**How sliding-window blocks are captured.** transformers' ``DynamicSlidingWindowLayer`` keeps
only the last ``sliding_window - 1`` tokens, so after an ordinary prefill of a long prompt the
early window blocks no longer exist anywhere. Every cache the adapter hands out
(:meth:`CacheAdapter.new_cache`, :meth:`CacheAdapter.rebuild`) therefore has its sliding layers
*recording their past* (``activate_past_recording``: the layer keeps every token it is given
until ``crop``, and attends exactly as it would without recording). One prefill of any length
then leaves every block of the prompt in the cache; :meth:`CacheAdapter.store` commits them and
ends the recording, trimming each sliding layer back to its window (``crop(0)``). Only blocks the
cache never held stay out of reach: those before the window a cache was rebuilt with
(:meth:`rebuild` reads only what the verdict needs). When the engine asks for such a block
(because it is no longer cached, e.g. it was given back under memory pressure), that group is
not committed for this prompt (:attr:`Stored.skipped` says why) and the other groups are; this
never makes anything usable that is not, it only caches less.

**No second copy of the truth.** The adapter keeps no K/V: :meth:`store` slices the model's
cache tensors into the engine's pools through ``Engine.commit(prompt, payload=...)`` and
:meth:`rebuild` reads them back through ``engine.core.read`` (which refuses blocks that are not
readable), viewing the bytes it returns as the declared dtype with ``torch.from_numpy`` (no copy)
and making the one copy that turns block-major payloads into the cache's token-major
``[1, kv_heads, tokens, head_dim]`` tensors.

transformers and torch are imported inside the methods: ``import kvfsm`` needs neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.spec import Form, GroupDecl, GroupKind
from kvfsm.state import GroupState
from kvfsm.verify import Level, Prompt, Verdict

if TYPE_CHECKING:
    from transformers import DynamicCache

#: The ``config.layer_types`` entry whose K/V each group kind holds.
LAYER_TYPE_OF: Mapping[GroupKind, str] = MappingProxyType({
    GroupKind.FULL: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_attention",
})

#: Reads the payload bytes of blocks: ``(group name, block ids) -> uint8 [k, payload_bytes]``.
ReadFn = Callable[[str, NDArray[np.intp]], NDArray[np.uint8]]


class CacheAdapterError(KvfsmError):
    """A cache and a declaration that do not fit, or a rebuild the verdict does not allow."""


class _Unavailable(KvfsmError):
    """The model's cache no longer holds a block the engine asks for (internal)."""

    def __init__(self, group: str, why: str) -> None:
        super().__init__(f"{group}: {why}")
        self.group = group
        self.why = why


@attrs.frozen
class LayerGroup:
    """Which model layers one declared group holds, in payload order."""

    name: str
    kind: GroupKind
    #: Model layer indices (positions in ``config.layer_types``), in payload order.
    layers: tuple[int, ...]
    decl: GroupDecl


@attrs.frozen(eq=False)
class Stored:
    """What :meth:`CacheAdapter.store` committed."""

    #: New block ids per committed group (``Engine.commit``'s answer).
    ids: Mapping[str, NDArray[np.intp]]
    #: Groups not committed for this prompt, and why (blocks the cache never held).
    skipped: Mapping[str, str]


def _torch() -> Any:
    import torch

    return torch


class CacheAdapter:
    """Commits a transformers ``DynamicCache`` into ``engine``'s pools and rebuilds one from
    them, for a model with full-attention and sliding-window layers (``config``)."""

    def __init__(self, engine: Engine, config: Any) -> None:
        self.engine = engine
        self.config = config
        layer_types = list(getattr(config, "layer_types", None) or [])
        if not layer_types:
            raise CacheAdapterError("config has no layer_types: cannot map layers to groups")
        kv_heads = int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        groups: list[LayerGroup] = []
        for decl in engine.model.groups:
            if decl.kind not in LAYER_TYPE_OF:
                raise CacheAdapterError(
                    f"{decl.name}: CacheAdapter holds full and sliding_window groups only, not "
                    f"{decl.kind.value}")
            layer_type = LAYER_TYPE_OF[decl.kind]
            layers = tuple(i for i, t in enumerate(layer_types) if t == layer_type)
            if any(g.kind is decl.kind for g in groups):
                raise CacheAdapterError(f"{decl.name}: a second {decl.kind.value} group; the "
                                        f"{layer_type} layers are already held by another")
            expected = (len(layers), 2, kv_heads, decl.block_size, head_dim)
            if decl.shape != expected:
                raise CacheAdapterError(
                    f"{decl.name}: block shape {list(decl.shape)} does not fit the config's "
                    f"{len(layers)} {layer_type} layers; expected {list(expected)} "
                    "(layers, K/V, kv heads, block tokens, head dim)")
            if decl.kind is GroupKind.SLIDING_WINDOW and decl.window != config.sliding_window:
                raise CacheAdapterError(f"{decl.name}: window {decl.window} but the config's "
                                        f"sliding_window is {config.sliding_window}")
            groups.append(LayerGroup(decl.name, decl.kind, layers, decl))
        held = {layer for group in groups for layer in group.layers}
        unheld = sorted(set(range(len(layer_types))) - held)
        if unheld:
            raise CacheAdapterError(
                f"layers {unheld} ({sorted({layer_types[i] for i in unheld})}) have no group "
                f"in {engine.model.name!r}: their cache would be lost")
        self.groups: tuple[LayerGroup, ...] = tuple(groups)

    # -- caches ----------------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        """An empty cache for ``config`` whose sliding layers record their past until
        :meth:`store` (so a prefill leaves every block of the prompt in it)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        self._record(cache, True)
        return cache

    def _sliding_layers(self, cache: DynamicCache) -> list[Any]:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        return [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]

    def _record(self, cache: DynamicCache, on: bool) -> None:
        for layer in self._sliding_layers(cache):
            if on:
                layer.activate_past_recording()
                continue
            if layer.record_past and layer.cumulative_length >= layer.sliding_window:
                layer.crop(0)  # back to the last sliding_window - 1 tokens
            layer.record_past = False

    def _prompt(self, prompt: Prompt | Sequence[int] | ArrayLike) -> Prompt:
        if not isinstance(prompt, Prompt):
            return self.engine.prompt(prompt)
        sizes = [group.block_size for group in self.engine.model.groups]
        prompt.check_made_for(self.engine.core.seed, sizes, "engine")
        return prompt

    # -- store -----------------------------------------------------------------------------

    def store(self, prompt: Prompt | Sequence[int] | ArrayLike, cache: DynamicCache) -> Stored:
        """Commit every complete block of ``prompt`` from ``cache`` (which holds at least the
        prompt's tokens, e.g. right after its prefill) through ``Engine.commit``, then end the
        sliding layers' recording (also when the commit raises, e.g. a ``StateError`` for lack
        of room). A group whose blocks the cache never held is skipped (see the module
        docstring); the others are committed, all or nothing among themselves."""
        prompt = self._prompt(prompt)
        layers = cache.layers
        if len(layers) != len(self.config.layer_types):
            raise CacheAdapterError(f"cache has {len(layers)} layers, the config "
                                    f"{len(self.config.layer_types)}")

        def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
            return self._payload(cache, self._group(group.name), index)

        names = [g.name for g in self.groups]
        skipped: dict[str, str] = {}
        ids: Mapping[str, NDArray[np.intp]] = {}
        # Engine.commit asks for every payload before it changes anything, so a refused group
        # is simply left out of the next try.
        try:
            while names:
                try:
                    ids = self.engine.commit(prompt, payload=payload, groups=names)
                    break
                except _Unavailable as gap:
                    skipped[gap.group] = gap.why
                    names.remove(gap.group)
        finally:
            self._record(cache, False)
        return Stored(MappingProxyType(dict(ids)), MappingProxyType(skipped))

    def _group(self, name: str) -> LayerGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise CacheAdapterError(f"no group {name!r}; groups: {[g.name for g in self.groups]}")

    def _payload(self, cache: DynamicCache, group: LayerGroup,
                 index: NDArray[np.int64]) -> NDArray[np.uint8]:
        """Blocks ``index`` of ``group`` sliced out of ``cache``: uint8 [k, payload_bytes]."""
        torch = _torch()
        decl = group.decl
        size = decl.block_size
        if not index.size:
            return np.zeros((0, decl.payload_bytes), dtype=np.uint8)
        per_layer = []
        for layer_idx in group.layers:
            layer: Any = cache.layers[layer_idx]
            keys, values = layer.keys, layer.values
            if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
                raise CacheAdapterError(f"{group.name}: layer {layer_idx} holds no batch-1 K/V")
            held = int(keys.shape[-2])
            end = int(getattr(layer, "cumulative_length", held))
            first = end - held  # absolute position of the first token the layer holds
            lo, hi = int(index.min()) * size, (int(index.max()) + 1) * size
            if lo < first or hi > end:
                raise _Unavailable(group.name, (
                    f"blocks {index.tolist()} need tokens [{lo}, {hi}); layer {layer_idx} holds "
                    f"[{first}, {end}) (earlier ones slid out of its window before they could "
                    "be captured)"))
            if str(keys.dtype) != f"torch.{decl.dtype}":
                raise CacheAdapterError(f"{group.name}: layer {layer_idx} holds {keys.dtype}, "
                                        f"the declaration {decl.dtype}")
            tokens = (torch.as_tensor(index, device=keys.device)[:, None] * size
                      + torch.arange(size, device=keys.device)[None, :]).reshape(-1) - first
            pair = torch.stack([keys[0][:, tokens], values[0][:, tokens]])  # [2, h, k*B, d]
            pair = pair.reshape(2, pair.shape[1], index.size, size, pair.shape[-1])
            per_layer.append(pair.permute(2, 0, 1, 3, 4))  # [k, 2, h, B, d]
        blocks = torch.stack(per_layer, dim=1).contiguous().cpu()  # [k, layers, 2, h, B, d]
        data: NDArray[np.uint8] = blocks.numpy().view(np.uint8).reshape(index.size, -1)
        padding = decl.layout.padding
        if padding:
            data = np.concatenate([data, np.zeros((index.size, padding), np.uint8)], axis=1)
        return data

    # -- rebuild ---------------------------------------------------------------------------

    def rebuild(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        length: int,
        *,
        verdict: Verdict | None = None,
        level: Level | str | None = None,
        device: Any = None,
    ) -> DynamicCache:
        """A cache holding exactly the first ``length`` tokens of ``prompt``, read from the
        engine's pools, once the verdict allows ``length``: ``verdict.usable_tokens == length``
        for a given ``verdict`` of this prompt, else a lookup (at ``level``) of the prompt cut
        to ``length + 1`` tokens must find ``length`` usable (usability is not monotone in the
        length: a shorter prefix needs other window blocks). Its sliding layers record their
        past (see :meth:`new_cache`)."""
        prompt = self._prompt(prompt)
        length = int(length)
        if length < 0 or length > max(prompt.n_tokens - 1, 0):
            raise CacheAdapterError(f"length {length} outside [0, {prompt.n_tokens}): the "
                                    "last prompt token is always computed")
        if length == 0:
            return self.new_cache()
        if verdict is not None:
            if verdict.prompt_tokens != prompt.n_tokens:
                raise CacheAdapterError(f"the verdict is for a prompt of {verdict.prompt_tokens} "
                                        f"tokens, this one has {prompt.n_tokens}")
            allowed = verdict.usable_tokens
        else:
            allowed = self.engine.lookup(prompt.token_ids[: length + 1], level=level).usable_tokens
        if allowed != length:
            raise CacheAdapterError(f"the verdict does not allow reusing {length} tokens "
                                    f"(usable: {allowed})")
        core = self.engine.core

        def read(name: str, ids: NDArray[np.intp]) -> NDArray[np.uint8]:
            core.pin(name, ids)  # a reader pins what it reads
            try:
                return core.read(name, ids, form=Form.RAW)
            finally:
                core.unpin(name, ids)

        return self.rebuild_unchecked(prompt, length, read, device=device)

    def needed_blocks(self, prompt: Prompt, group: LayerGroup, length: int) -> NDArray[np.int64]:
        """Indices of ``prompt``'s blocks of ``group`` a cache of ``length`` tokens holds (the
        kind's rule: every block for full attention, the window's for a sliding window)."""
        state = self.engine.core.group(group.name)
        needed = state.rule.needed(group.decl, np.array([length], dtype=np.int64))
        return np.arange(int(needed.lo[0]), int(needed.hi[0]), dtype=np.int64)

    def rebuild_unchecked(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        length: int,
        read: ReadFn,
        *,
        device: Any = None,
    ) -> DynamicCache:
        """A cache of the first ``length`` tokens from whatever ``read`` returns for the blocks
        the prompt's hashes find, **without asking the verdict**: what a hit-only engine does
        (``serve``'s ``naive`` mode). :meth:`rebuild` is this behind the verdict's check."""
        torch = _torch()
        prompt = self._prompt(prompt)
        cache = self.new_cache()
        if length == 0:
            return cache
        if length % self.engine.model.lcm_block_size:
            raise CacheAdapterError(f"length {length} is not a multiple of the block size "
                                    f"{self.engine.model.lcm_block_size}")
        core = self.engine.core
        for group in self.groups:
            decl = group.decl
            index = self.needed_blocks(prompt, group, length)
            high, low = prompt.words(decl.block_size)
            ids = core.lookup_words(group.name, high[index], low[index])
            if (ids < 0).any():
                raise CacheAdapterError(f"{group.name}: blocks {index[ids < 0].tolist()} of the "
                                        "prompt are not cached")
            raw = read(group.name, ids)
            data_bytes = decl.payload_bytes - decl.layout.padding
            typed = np.ascontiguousarray(raw[:, :data_bytes]).view(np.dtype(decl.dtype))
            blocks = torch.from_numpy(typed.reshape(index.size, *decl.shape))  # no copy
            # [k, layers, 2, h, B, d] -> [layers, 2, h, k*B, d]: the one copy, token-major.
            layers, _, heads, size, dim = decl.shape
            kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, index.size * size,
                                                          dim)
            if device is not None:
                kv = kv.to(device)
            for slot, layer_idx in enumerate(group.layers):
                cache.update(kv[slot, 0][None], kv[slot, 1][None], layer_idx)
                layer: Any = cache.layers[layer_idx]
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = length
        return cache
