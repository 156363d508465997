"""Between a transformers cache and kvfsm's pools: commit by block, rebuild by verdict.

:class:`CacheAdapter` serves the three architectures ``kvfsm.serve.declare`` declares (GPT-OSS,
Qwen3-Next, DeepSeek-V4), with the groups and packing conventions of
``kvfsm/serve/_declare.py`` (docs/models.md, "Declarations from transformers configs").

**One kind, one codec.** Each declared group gets the codec of its kind, which alone knows how
that kind's blocks map to transformers' cache fields:

* :class:`KVBlocks` (``full``, ``sliding_window``): per-token K/V, sliced by block. GPT-OSS and
  Qwen3-Next blocks are ``[layers, 2 (K, V), kv_heads, block, head_dim]``; DeepSeek-V4's shared
  K=V blocks are ``[layers, block, head_dim]`` (one vector per token, stored once).
* :class:`Snapshots` (``recurrent``): the fixed-size state at a checkpoint, packed per layer
  into one float32 vector (Qwen3-Next: every linear layer's conv then recurrent state,
  ``qwen3_next_state_shapes``; DeepSeek-V4: every CSA layer's overlap state,
  ``deepseek_v4_overlap_shapes``).
* :class:`Entries` (``compressed``): DeepSeek-V4's compressed entries (``compressed_kv`` of the
  CSA compressor, ``csa``; of its lightning indexer, ``csa_index``; of the HCA compressor,
  ``hca``), ``block / rate`` entries per block. The entry counters are ``L // rate``.

Which layers a group holds follows its kind (and, for the three ``compressed`` groups, its
name); every layer's every state must be held by some group, or the cache would be lost.

**Capturing what transformers does not keep.** A cache holds the state *after its last token*:
a recurrent layer keeps one state, a sliding-window layer its last ``window - 1`` tokens. The
adapter gets the rest two ways, both only while a cache it handed out (:meth:`new_cache`,
:meth:`rebuild`) is *recording*, that is until :meth:`store` commits it:

* GPT-OSS's sliding layers (``DynamicSlidingWindowLayer``) record their past themselves
  (``activate_past_recording``: every token is kept until ``crop``; attention is unchanged);
  :meth:`store` commits and trims them back to their window (``crop(0)``).
* Everything else is captured by :meth:`prefill`, which forwards a prompt **in chunks ending at
  each capture point** (every checkpoint of a recurrent group; every block end of a sliding
  group whose layers do not record, DeepSeek-V4's) and, after each chunk, copies what the
  codecs capture there: the packed snapshot at a checkpoint, the sliding block that just ended
  (the layer still holds it: ``block <= window - 1`` is checked). A ``csa_overlap``
  checkpoint is a multiple of the CSA rate (its block is ``lcm(B, m)``), so there the CSA
  compressor's buffer is empty and its overlap state is the one at that boundary; any other
  chunk end only splits a forward (the compressors' buffers carry across forwards, and a rebuild
  happens only at multiples of the LCM block size, where every buffer is empty). Chunked and
  single forwards agree to float32 rounding. ``ServeLoop`` forwards prompts through
  :meth:`prefill`; a model called directly leaves only what the cache itself holds (a snapshot
  only at the cache's own length).

**Partial commits.** :meth:`CacheAdapter.store` works out, per group, which of the prompt's
blocks it can give content for (captured during a prefill, or still held by the cache) and
passes the others that the engine would have to write (not cached, or cached but failing) to
``Engine.commit(unavailable=...)``: only those are left out, the group's other blocks are
committed. So a block before the resume point that was given back since the lookup (an older
window block, an earlier snapshot of a cache rebuilt at a later one) costs only itself, never the
blocks the prefill computed past it. :attr:`Stored.missing` names the blocks left out and
:attr:`Stored.skipped` says why. This never makes anything usable that is not, it only caches
less.

**Rebuild.** :meth:`rebuild` reads, through ``engine.core.read`` (which refuses unreadable
blocks), exactly the blocks the verdict's usable length ``L`` needs, each kind by its rule:
every full block before ``L``; the sliding blocks of ``[L - (W-1), L)``; the one snapshot
ending at ``L``; every compressed block before ``L``; and writes them into a fresh cache: K/V
through ``update``, with ``cumulative_length = L``; conv and recurrent states through
``update_conv_state`` / ``update_recurrent_state``, with each linear layer's token count (where
transformers keeps one) set to ``L``; overlap states, compressed entries and
``entry_count = L // rate`` directly. Exact: restoring at ``L`` and forwarding the rest gives the
logits of one uninterrupted forward to float32 rounding. Not rebuilt, because never needed at a
block boundary: DeepSeek-V4's compressor buffers (empty there), transformers' conv states
beyond the kernel, tokens of a sliding layer older than ``L - (W-1)`` (never read at ``L``).

**No second copy of the truth.** Payloads are sliced from the cache's tensors (or from a
capture of them) straight into the engine's pools through ``Engine.commit(prompt,
payload=...)``; a rebuild views the bytes ``read`` returns as the declared dtype with
``torch.from_numpy`` (no copy) before the one copy into the cache's layout. Captures live with
the cache they were taken from and are dropped when :meth:`store` ends its recording.

transformers and torch are imported inside the methods: ``import kvfsm`` needs neither.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm import _args
from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.lookup import Level, Verdict
from kvfsm.serve._declare import layer_types as declared_layer_types
from kvfsm.spec import Form, GroupDecl, GroupKind
from kvfsm.state import GroupState, Prompt

if TYPE_CHECKING:
    from transformers import DynamicCache

#: The ``config.layer_types`` entry whose K/V each per-token group kind holds (GPT-OSS,
#: Qwen3-Next; DeepSeek-V4's ``sliding`` group holds every layer's K=V).
LAYER_TYPE_OF: Mapping[GroupKind, str] = MappingProxyType({
    GroupKind.FULL: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_attention",
})

#: Reads the payload bytes of blocks: ``(group name, block ids) -> uint8 [k, payload_bytes]``.
ReadFn = Callable[[str, NDArray[np.intp]], NDArray[np.uint8]]

_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"

#: The states each layer type keeps, each of which some group must hold: ``kv`` per-token
#: K/V, ``state`` a recurrent snapshot, ``compressor`` / ``indexer`` compressed entries.
_STATES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "full_attention": ("kv",),
    "sliding_attention": ("kv",),
    "linear_attention": ("state",),
    _CSA: ("kv", "compressor", "indexer", "state"),
    _HCA: ("kv", "compressor"),
})

#: The ``compressed`` groups by name: (layer type, compressed_kv entry).
_ENTRY_GROUPS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "csa": (_CSA, "compressor"),
    "csa_index": (_CSA, "indexer"),
    "hca": (_HCA, "compressor"),
})


class CacheAdapterError(KvfsmError):
    """A cache and a declaration that do not fit, or a rebuild the verdict does not allow."""


class _Unavailable(KvfsmError):
    """The model's cache no longer holds blocks the engine asks for (internal): ``index``, the
    prompt block indices it lacks (empty: it cannot tell which)."""

    def __init__(self, group: str, why: str,
                 index: NDArray[np.int64] | None = None) -> None:
        super().__init__(f"{group}: {why}")
        self.group = group
        self.why = why
        self.index = np.zeros(0, dtype=np.int64) if index is None else index


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
    #: Groups with blocks left out for this prompt, and why: the blocks, and what the cache
    #: held instead (the group's other blocks were committed).
    skipped: Mapping[str, str]
    #: Per group in :attr:`skipped`: the prompt block indices left out (the adapter had no
    #: content for them and the engine held no good copy), in order.
    missing: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)


@attrs.define
class _Record:
    """What a recording cache's prefills captured: per group, block index -> typed block."""

    captured: dict[str, dict[int, Any]] = attrs.Factory(dict)


def _torch() -> Any:
    import torch

    return torch


def _seen(cache: Any) -> int | None:
    """Tokens the cache has processed, from its attention layers (None if it has none)."""
    for layer in cache.layers:
        count = getattr(layer, "cumulative_length", None)
        if count is not None:
            return int(count)
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4:
            return int(keys.shape[-2])
    return None


def _check_dtype(group: str, layer: int, tensor: Any, decl: GroupDecl) -> None:
    if str(tensor.dtype) != f"torch.{decl.dtype}":
        raise CacheAdapterError(f"{group}: layer {layer} holds {tensor.dtype}, the declaration "
                                f"{decl.dtype}")


def _spans(index: NDArray[np.int64], size: int) -> str:
    """Token ranges of blocks ``index`` (sorted) of ``size`` tokens, runs merged:
    ``[0, 16), [96, 128)``."""
    runs: list[list[int]] = []
    for i in index.tolist():
        if runs and runs[-1][1] == i * size:
            runs[-1][1] = (i + 1) * size
        else:
            runs.append([i * size, (i + 1) * size])
    return ", ".join(f"[{lo}, {hi})" for lo, hi in runs)


# ------------------------------------------------------------------------------ codecs


class Codec:
    """How the blocks of one group kind map to transformers cache fields.

    :meth:`encode` slices blocks out of a cache, :meth:`decode` writes blocks into a fresh
    cache; both in the declared shape (``[k, *decl.shape]``, typed tensors). A codec that needs
    the cache at a position it will not stay at sets :attr:`capture_every`: :meth:`capture` is
    then called after each prefill chunk ending at a positive multiple of it."""

    #: The kinds this codec serves.
    kinds: ClassVar[tuple[GroupKind, ...]] = ()
    #: The states (see ``_STATES``) this codec's group holds for each of its layers.
    state: str = "kv"
    #: Capture after every prefill chunk ending at a multiple of this many tokens (0: never).
    capture_every: int = 0

    def __init__(self, group: LayerGroup, config: Any, probe: Any) -> None:
        self.group = group
        self.decl = group.decl
        self.config = config

    def _shape_error(self, expected: tuple[int, ...], what: str) -> CacheAdapterError:
        return CacheAdapterError(
            f"{self.group.name}: block shape {list(self.decl.shape)} does not fit the config's "
            f"{len(self.group.layers)} layers; expected {list(expected)} ({what})")

    def begin(self, cache: Any) -> None:
        """A cache the adapter hands out starts recording."""

    def end(self, cache: Any) -> None:
        """The cache's recording ends (after :meth:`CacheAdapter.store`)."""

    def capture(self, cache: Any, end: int) -> Any | None:
        """The block ending at ``end`` (the cache's current length), or None."""
        return None

    def holds(self, cache: Any, index: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Per block of ``index``: whether :meth:`encode` can slice it from what ``cache``
        holds now."""
        raise NotImplementedError

    def held(self, cache: Any) -> str:
        """What ``cache`` holds of this group now, in words (for :attr:`Stored.skipped`)."""
        raise NotImplementedError

    def encode(self, cache: Any, index: NDArray[np.int64]) -> Any:
        """Blocks ``index`` from what ``cache`` holds now: ``[k, *shape]``; raises
        ``_Unavailable`` for a block it no longer holds."""
        raise NotImplementedError

    def decode(self, cache: Any, blocks: Any, index: NDArray[np.int64], length: int) -> None:
        """Write blocks ``index`` (``[k, *shape]``, what a cache of ``length`` tokens needs of
        this group) into the fresh ``cache``."""
        raise NotImplementedError


class KVBlocks(Codec):
    """Per-token K/V by block (``full``, ``sliding_window``). Separate K and V
    (``[layers, 2, kv_heads, B, head_dim]``) or shared K=V (``[layers, B, head_dim]``,
    DeepSeek-V4). Sliding layers whose ``update`` honours ``record_past`` record their past;
    others are captured at every block end."""

    kinds = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)

    def __init__(self, group: LayerGroup, config: Any, probe: Any) -> None:
        super().__init__(group, config, probe)
        from transformers.cache_utils import DynamicSlidingWindowLayer

        decl = self.decl
        heads = int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        self.shared = len(decl.shape) == 3
        layers = len(group.layers)
        if self.shared:
            expected: tuple[int, ...] = (layers, decl.block_size, head_dim)
            if decl.shape != expected or heads != 1:
                raise self._shape_error(expected, "layers, block tokens, head dim; shared K=V "
                                                  "needs one KV head")
        else:
            expected = (layers, 2, heads, decl.block_size, head_dim)
            if decl.shape != expected:
                raise self._shape_error(expected, "layers, K/V, kv heads, block tokens, head dim")
        self.sliding = decl.kind is GroupKind.SLIDING_WINDOW
        if self.sliding and decl.window != config.sliding_window:
            raise CacheAdapterError(f"{group.name}: window {decl.window} but the config's "
                                    f"sliding_window is {config.sliding_window}")
        # Layers whose update keeps every token while recording (transformers' own sliding
        # layer); DeepSeek-V4's cache layers override update and always trim.
        self.records = self.sliding and all(
            type(probe.layers[i]).update is DynamicSlidingWindowLayer.update
            for i in group.layers)
        if self.sliding and not self.records:
            if decl.block_size > config.sliding_window - 1:
                raise CacheAdapterError(
                    f"{group.name}: its layers keep {config.sliding_window - 1} tokens, fewer "
                    f"than a block of {decl.block_size}: a block cannot be captured whole")
            self.capture_every = decl.block_size

    def begin(self, cache: Any) -> None:
        if self.records:
            for i in self.group.layers:
                cache.layers[i].activate_past_recording()

    def end(self, cache: Any) -> None:
        if not self.records:
            return
        for i in self.group.layers:
            layer = cache.layers[i]
            if layer.record_past and layer.cumulative_length >= layer.sliding_window:
                layer.crop(0)  # back to the last sliding_window - 1 tokens
            layer.record_past = False

    def capture(self, cache: Any, end: int) -> Any | None:
        index = np.array([end // self.decl.block_size - 1], dtype=np.int64)
        try:
            return self.encode(cache, index)[0].clone()
        except _Unavailable:
            return None

    def _span(self, cache: Any, layer_idx: int) -> tuple[int, int]:
        """Tokens ``[first, end)`` (absolute positions) layer ``layer_idx`` holds now."""
        layer: Any = cache.layers[layer_idx]
        keys = layer.keys
        if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
            raise CacheAdapterError(f"{self.group.name}: layer {layer_idx} holds no "
                                    "batch-1 K/V")
        held = int(keys.shape[-2])
        end = int(getattr(layer, "cumulative_length", held))
        return end - held, end

    def holds(self, cache: Any, index: NDArray[np.int64]) -> NDArray[np.bool_]:
        size = self.decl.block_size
        inside = np.ones(index.size, dtype=np.bool_)
        for layer_idx in self.group.layers:
            first, end = self._span(cache, layer_idx)
            inside &= (index * size >= first) & ((index + 1) * size <= end)
        return inside

    def held(self, cache: Any) -> str:
        spans = {self._span(cache, i) for i in self.group.layers}
        said = ", ".join(f"[{first}, {end})" for first, end in sorted(spans))
        return f"its layers hold tokens {said} (earlier ones slid out of its window)"

    def encode(self, cache: Any, index: NDArray[np.int64]) -> Any:
        torch = _torch()
        size = self.decl.block_size
        per_layer = []
        for layer_idx in self.group.layers:
            layer: Any = cache.layers[layer_idx]
            keys, values = layer.keys, layer.values
            first, end = self._span(cache, layer_idx)  # absolute positions held
            lo, hi = int(index.min()) * size, (int(index.max()) + 1) * size
            if lo < first or hi > end:
                raise _Unavailable(self.group.name, (
                    f"blocks {index.tolist()} need tokens [{lo}, {hi}); layer {layer_idx} holds "
                    f"[{first}, {end}) (earlier ones slid out of its window before they could "
                    "be captured)"), index[~self.holds(cache, index)])
            _check_dtype(self.group.name, layer_idx, keys, self.decl)
            tokens = (torch.as_tensor(index, device=keys.device)[:, None] * size
                      + torch.arange(size, device=keys.device)[None, :]).reshape(-1) - first
            if self.shared:  # [k*B, d] -> [k, B, d]
                per_layer.append(keys[0, 0][tokens].reshape(index.size, size, -1))
                continue
            pair = torch.stack([keys[0][:, tokens], values[0][:, tokens]])  # [2, h, k*B, d]
            pair = pair.reshape(2, pair.shape[1], index.size, size, pair.shape[-1])
            per_layer.append(pair.permute(2, 0, 1, 3, 4))  # [k, 2, h, B, d]
        return torch.stack(per_layer, dim=1)

    def decode(self, cache: Any, blocks: Any, index: NDArray[np.int64], length: int) -> None:
        k = index.size
        if self.shared:  # [k, layers, B, d] -> [layers, k*B, d]: the one copy, token-major.
            layers, size, dim = self.decl.shape
            kv = blocks.permute(1, 0, 2, 3).reshape(layers, k * size, dim)
            for slot, layer_idx in enumerate(self.group.layers):
                shared = kv[slot][None, None]
                cache.update(shared, shared, layer_idx)
                cache.layers[layer_idx].cumulative_length = length
            return
        # [k, layers, 2, h, B, d] -> [layers, 2, h, k*B, d]: the one copy, token-major.
        layers, _, heads, size, dim = self.decl.shape
        kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, k * size, dim)
        for slot, layer_idx in enumerate(self.group.layers):
            cache.update(kv[slot, 0][None], kv[slot, 1][None], layer_idx)
            layer: Any = cache.layers[layer_idx]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = length


class Snapshots(Codec):
    """A recurrent snapshot (``recurrent``): the pieces of every layer's fixed-size state,
    flattened row-major into one float32 vector per checkpoint. Captured after each prefill
    chunk ending at a checkpoint; the cache's live state is the snapshot at its own length."""

    kinds = (GroupKind.RECURRENT,)
    state = "state"

    def __init__(self, group: LayerGroup, config: Any, probe: Any) -> None:
        super().__init__(group, config, probe)
        from kvfsm.serve._declare import deepseek_v4_overlap_shapes, qwen3_next_state_shapes

        shapes = (qwen3_next_state_shapes(config) if config.model_type == "qwen3_next"
                  else deepseek_v4_overlap_shapes(config))
        #: (layer, path after the layer index, shape) per piece, in packing order.
        self.pieces = [(int(name.split(".")[1]), tuple(name.split(".")[2:]), shape)
                       for name, shape in shapes]
        floats = sum(math.prod(shape) for _, _, shape in self.pieces)
        if self.decl.shape != (floats,):
            raise self._shape_error((floats,), "one packed snapshot")
        self.capture_every = self.decl.checkpoint_interval or self.decl.block_size

    @staticmethod
    def _get(layer: Any, path: tuple[str, ...]) -> Any:
        if path == ("conv_state",):
            return layer.conv_states[0]
        if path == ("recurrent_state",):
            return layer.recurrent_states[0]
        part, field = path
        return getattr(layer, field)[part]

    def _pack(self, cache: Any) -> Any:
        torch = _torch()
        flat = []
        for layer_idx, path, shape in self.pieces:
            piece = self._get(cache.layers[layer_idx], path)
            if piece is None:
                raise _Unavailable(self.group.name, f"layer {layer_idx} holds no "
                                                    f"{'.'.join(path)} yet")
            if path == ("conv_state",):
                piece = piece[..., -shape[-1]:]  # the kernel's inputs (more while recording)
            if tuple(piece.shape) != (1, *shape):
                raise CacheAdapterError(f"{self.group.name}: layer {layer_idx} "
                                        f"{'.'.join(path)} is {list(piece.shape)}, expected "
                                        f"{[1, *shape]}")
            _check_dtype(self.group.name, layer_idx, piece, self.decl)
            flat.append(piece.reshape(-1))
        return torch.cat(flat)

    def capture(self, cache: Any, end: int) -> Any | None:
        try:
            return self._pack(cache).clone()
        except _Unavailable:
            return None

    def holds(self, cache: Any, index: NDArray[np.int64]) -> NDArray[np.bool_]:
        at = _seen(cache)
        ready = at is not None and all(self._get(cache.layers[layer_idx], path) is not None
                                       for layer_idx, path, _shape in self.pieces)
        inside: NDArray[np.bool_] = ((index + 1) * self.decl.block_size == at) & ready
        return inside

    def held(self, cache: Any) -> str:
        return (f"the cache holds only the state after {_seen(cache)} tokens (a snapshot is "
                "captured only by a CacheAdapter.prefill passing its checkpoint)")

    def encode(self, cache: Any, index: NDArray[np.int64]) -> Any:
        at = _seen(cache)
        ends = ((index + 1) * self.decl.block_size).tolist()
        if at is None or ends != [at]:
            raise _Unavailable(self.group.name, (
                f"snapshots after tokens {ends} were not captured and the cache holds only the "
                f"state after {at} (prefill through CacheAdapter.prefill to capture them)"),
                index[~self.holds(cache, index)])
        return self._pack(cache)[None]

    def decode(self, cache: Any, blocks: Any, index: NDArray[np.int64], length: int) -> None:
        flat, offset = blocks[0], 0
        for layer_idx, path, shape in self.pieces:
            size = math.prod(shape)
            piece = flat[offset:offset + size].reshape(1, *shape).clone()
            offset += size
            layer: Any = cache.layers[layer_idx]
            if path == ("conv_state",):
                layer.update_conv_state(piece, conv_kernel_size=shape[-1])
                _set_linear_length(layer, length)
            elif path == ("recurrent_state",):
                layer.update_recurrent_state(piece)
            else:
                part, field = path
                getattr(layer, field)[part] = piece


def _set_linear_length(layer: Any, length: int) -> None:
    """Make a rebuilt linear-attention layer count ``length`` tokens. transformers >= 5.25 keeps
    the count on the layer (``cumulative_length_linear``, grown by ``update_conv_state`` by the
    kernel's width on a rebuild) and answers ``get_seq_length`` from it when a linear layer comes
    first, which sets the positions of a forward given none; older versions keep no count."""
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.fill_(length)  # in place: the tensor may be marked as a static address


class Entries(Codec):
    """Compressed entries (``compressed``): ``compressed_kv[part]`` of the group's layers, one
    entry per ``rate`` tokens, ``block / rate`` per block (``[layers, block / rate, dim]``)."""

    kinds = (GroupKind.COMPRESSED,)

    def __init__(self, group: LayerGroup, config: Any, probe: Any) -> None:
        super().__init__(group, config, probe)
        layer_type, self.part = _ENTRY_GROUPS[group.name]
        self.state = self.part
        self.rate = int(config.compress_rates[layer_type])
        dim = int(config.index_head_dim if self.part == "indexer" else config.head_dim)
        size = self.decl.block_size
        expected = (len(group.layers), size // self.rate, dim)
        if size % self.rate or self.decl.shape != expected:
            raise self._shape_error(expected, f"layers, entries of {self.rate} tokens, dim")
        self.per_block = size // self.rate

    def _entries(self, cache: Any) -> list[int]:
        """Entries each of the group's layers holds now."""
        counts = []
        for layer_idx in self.group.layers:
            entries = cache.layers[layer_idx].compressed_kv[self.part]
            counts.append(0 if entries is None else int(entries.shape[1]))
        return counts

    def holds(self, cache: Any, index: NDArray[np.int64]) -> NDArray[np.bool_]:
        inside: NDArray[np.bool_] = (index + 1) * self.per_block <= min(self._entries(cache))
        return inside

    def held(self, cache: Any) -> str:
        return f"its layers hold {sorted(set(self._entries(cache)))} entries"

    def encode(self, cache: Any, index: NDArray[np.int64]) -> Any:
        torch = _torch()
        per, rows = self.per_block, []
        wanted = (index[:, None] * per + np.arange(per)[None, :]).reshape(-1)
        for layer_idx in self.group.layers:
            entries = cache.layers[layer_idx].compressed_kv[self.part]
            have = 0 if entries is None else int(entries.shape[1])
            if int(wanted.max()) >= have:
                raise _Unavailable(self.group.name, (
                    f"blocks {index.tolist()} need entries up to {int(wanted.max())}; layer "
                    f"{layer_idx} holds {have}"), index[~self.holds(cache, index)])
            _check_dtype(self.group.name, layer_idx, entries, self.decl)
            picked = entries[0][torch.as_tensor(wanted, device=entries.device)]
            rows.append(picked.reshape(index.size, per, -1))
        return torch.stack(rows, dim=1)  # [k, layers, per, dim]

    def decode(self, cache: Any, blocks: Any, index: NDArray[np.int64], length: int) -> None:
        count = length // self.rate
        dim = self.decl.shape[-1]
        for slot, layer_idx in enumerate(self.group.layers):
            layer: Any = cache.layers[layer_idx]
            entries = blocks[:, slot].reshape(-1, dim)[:count]
            layer.compressed_kv[self.part] = entries[None].clone()
            layer.entry_count[self.part] = count


#: The codec of each group kind.
CODECS: Mapping[GroupKind, type[Codec]] = MappingProxyType({
    kind: codec for codec in (KVBlocks, Snapshots, Entries) for kind in codec.kinds})


def _layers_of(decl: GroupDecl, config: Any, layer_types: list[str]) -> tuple[int, ...]:
    """The layers ``decl`` holds, by the declaration conventions."""
    deepseek = config.model_type == "deepseek_v4"
    kind = decl.kind
    if kind is GroupKind.SLIDING_WINDOW and deepseek:
        wanted: tuple[str, ...] = tuple(_STATES)  # every layer keeps its sliding K=V
    elif kind in LAYER_TYPE_OF:
        wanted = (LAYER_TYPE_OF[kind],)
    elif kind is GroupKind.RECURRENT:
        wanted = (_CSA,) if deepseek else ("linear_attention",)
    elif kind is GroupKind.COMPRESSED and decl.name in _ENTRY_GROUPS:
        wanted = (_ENTRY_GROUPS[decl.name][0],)
    elif kind is GroupKind.COMPRESSED:
        raise CacheAdapterError(f"{decl.name}: a compressed group is one of "
                                f"{sorted(_ENTRY_GROUPS)} (which entries it holds)")
    else:
        raise CacheAdapterError(f"{decl.name}: CacheAdapter has no codec for "
                                f"{kind.value} groups")
    return tuple(i for i, t in enumerate(layer_types) if t in wanted)


def _new_dynamic_cache(config: Any) -> Any:
    from transformers import DynamicCache

    # An architecture's own cache layer classes register when its module is imported.
    with contextlib.suppress(ImportError):
        importlib.import_module(f"transformers.models.{config.model_type}."
                                f"modeling_{config.model_type}")
    return DynamicCache(config=config)


class CacheAdapter:
    """Commits a transformers ``DynamicCache`` into ``engine``'s pools and rebuilds one from
    them, for the model of ``config`` (see the module docstring)."""

    def __init__(self, engine: Engine, config: Any) -> None:
        self.engine = engine
        self.config = config
        layer_types = list(getattr(config, "layer_types", None) or [])
        if not layer_types:
            # Llama's and Mistral's configs have none: what transformers' cache infers.
            try:
                layer_types = declared_layer_types(config)
            except KvfsmError as exc:
                raise CacheAdapterError(f"config has no layer_types, and none follows from "
                                        f"it ({exc}): cannot map layers to groups") from None
        self._layer_count = len(layer_types)
        probe = _new_dynamic_cache(config)
        groups: list[LayerGroup] = []
        codecs: dict[str, Codec] = {}
        held: dict[tuple[int, str], str] = {}
        for decl in engine.model.groups:
            layers = _layers_of(decl, config, layer_types)
            group = LayerGroup(decl.name, decl.kind, layers, decl)
            codec = CODECS[decl.kind](group, config, probe)
            for layer in layers:
                other = held.setdefault((layer, codec.state), decl.name)
                if other != decl.name:
                    raise CacheAdapterError(
                        f"{decl.name}: layer {layer}'s {codec.state} state is already held by "
                        f"{other!r} (a second {decl.kind.value} group)")
            groups.append(group)
            codecs[decl.name] = codec
        unheld = sorted({f"{i} ({t}: {state})" for i, t in enumerate(layer_types)
                         for state in _STATES.get(t, ("?",)) if (i, state) not in held},
                        key=lambda s: int(s.split()[0]))
        if unheld:
            raise CacheAdapterError(f"layers {unheld} have no group in "
                                    f"{engine.model.name!r}: their cache would be lost")
        self.groups: tuple[LayerGroup, ...] = tuple(groups)
        self.codecs: Mapping[str, Codec] = MappingProxyType(codecs)
        #: Caches handed out and still recording, with what their prefills captured.
        self._records: weakref.WeakKeyDictionary[Any, _Record] = weakref.WeakKeyDictionary()

    # -- caches ----------------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        """An empty cache for ``config``, recording until :meth:`store` (its sliding layers
        keep their past where they can, :meth:`prefill` captures the rest)."""
        cache: DynamicCache = _new_dynamic_cache(self.config)
        for codec in self.codecs.values():
            codec.begin(cache)
        self._records[cache] = _Record()
        return cache

    def recording(self, cache: DynamicCache) -> bool:
        """Whether ``cache`` was handed out by this adapter and not stored yet."""
        return cache in self._records

    def _end(self, cache: DynamicCache) -> None:
        if self._records.pop(cache, None) is not None:
            for codec in self.codecs.values():
                codec.end(cache)

    def _prompt(self, prompt: Prompt | Sequence[int] | ArrayLike) -> Prompt:
        if not isinstance(prompt, Prompt):
            return self.engine.prompt(prompt)
        sizes = [group.block_size for group in self.engine.model.groups]
        prompt.check_made_for(self.engine.core.seed, sizes, "engine")
        return prompt

    # -- prefill ---------------------------------------------------------------------------

    def chunk_ends(self, start: int, end: int) -> list[int]:
        """Where :meth:`prefill` cuts ``[start, end)``: every capture point inside it, then
        ``end``."""
        steps = {c.capture_every for c in self.codecs.values() if c.capture_every}
        points = {p for step in steps for p in range((start // step + 1) * step, end, step)}
        return [*sorted(points), end] if end > start else []

    def prefill(self, model: Any, cache: DynamicCache, tokens: Sequence[int], start: int = 0,
                *, all_logits: bool = False, device: Any = None) -> Any:
        """Forward ``tokens`` at positions ``start``.. on ``cache``. While the cache records
        (it came from :meth:`new_cache` or :meth:`rebuild` and was not stored yet) the tokens
        go in chunks ending at :meth:`chunk_ends`, and after each chunk (and at ``start``) the
        codecs capture what they need there; otherwise in one forward. Returns float logits:
        ``[1, vocab]`` of the last position, or ``[len(tokens), vocab]`` with
        ``all_logits``."""
        torch = _torch()
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise CacheAdapterError("prefill needs at least one token")
        stop = start + len(tokens)
        seen = _seen(cache)
        if seen is not None and seen != start:
            raise CacheAdapterError(f"the cache holds {seen} tokens; a prefill from position "
                                    f"{start} would misplace every state it captures")
        record = self._records.get(cache)
        ends = self.chunk_ends(start, stop) if record is not None else [stop]
        if record is not None:
            self._capture(cache, record, start)
        out, here = [], start
        for end in ends:
            ids = torch.tensor([tokens[here - start:end - start]], dtype=torch.long,
                               device=device)
            positions = torch.arange(here, end, dtype=torch.long, device=device)[None]
            logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                           logits_to_keep=0 if all_logits else 1).logits[0]
            out.append(logits.float())
            if record is not None:
                self._capture(cache, record, end)
            here = end
        return torch.cat(out) if all_logits else out[-1][-1:]

    def _capture(self, cache: DynamicCache, record: _Record, end: int) -> None:
        for name, codec in self.codecs.items():
            step = codec.capture_every
            if not step or end <= 0 or end % step:
                continue
            captured = record.captured.setdefault(name, {})
            index = end // codec.decl.block_size - 1
            if index not in captured:
                block = codec.capture(cache, end)
                if block is not None:
                    captured[index] = block

    # -- store -----------------------------------------------------------------------------

    def store(self, prompt: Prompt | Sequence[int] | ArrayLike, cache: DynamicCache, *,
              computed_from: int = 0) -> Stored:
        """Commit every complete block of ``prompt`` from ``cache`` (which holds at least the
        prompt's tokens, e.g. right after its prefill) through ``Engine.commit``, then end the
        cache's recording (also when the commit raises, e.g. a ``StateError`` for lack of
        room). ``computed_from``: the tokens the prefill reused before it computed the rest
        (the rebuilt length; 0 for a cache prefilled from the start), passed on to the commit,
        which writes anew a block computed past it that is cached only in a lower tier.

        Per group, the blocks the adapter has no content for (neither captured nor held by the
        cache) and the engine holds no good copy of are left out (``Engine.commit``'s
        ``unavailable``), the group's other blocks committed; :attr:`Stored.missing` and
        :attr:`Stored.skipped` name them. All groups are committed or none (a ``StateError``)."""
        prompt = self._prompt(prompt)
        computed_from = _args.count("computed_from", computed_from)
        layers = cache.layers
        if len(layers) != self._layer_count:
            raise CacheAdapterError(f"cache has {len(layers)} layers, the config "
                                    f"{self._layer_count}")

        def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
            return self._payload(cache, self._group(group.name), index)

        try:
            missing = self._missing(prompt, cache)
            absent = {name: index.copy() for name, index in missing.items()}
            # Engine.commit asks for every payload before it changes anything, so blocks it
            # asked for and the adapter lacks (a cached copy it replaces: one a lookup saw
            # fail, or one only in a lower tier past ``computed_from``) are left out of the
            # next try. Each retry leaves out at least one more block, so this ends.
            while True:
                try:
                    ids = self.engine.commit(prompt, payload=payload,
                                             computed_from=computed_from, unavailable=missing)
                    break
                except _Unavailable as gap:
                    known = missing.get(gap.group, np.zeros(0, dtype=np.int64))
                    more = np.setdiff1d(gap.index, known)
                    if not more.size:  # cannot happen: the commit never asks for these
                        raise CacheAdapterError(f"{gap.group}: the commit asked again for "
                                                f"blocks left out ({gap.why})") from None
                    missing[gap.group] = np.union1d(known, more)
            skipped = {name: self._skip_text(name, cache, index, absent.get(name))
                       for name, index in missing.items() if index.size}
        finally:
            self._end(cache)
        return Stored(MappingProxyType(dict(ids)), MappingProxyType(skipped),
                      MappingProxyType({name: tuple(int(i) for i in index)
                                        for name, index in missing.items() if index.size}))

    def _missing(self, prompt: Prompt, cache: DynamicCache) -> dict[str, NDArray[np.int64]]:
        """Per group: the blocks a commit of ``prompt`` keeps (the kind's ``commit_blocks``)
        that the adapter has no content for and the engine does not hold (not in its hash
        map). Those the engine holds are left to the commit: it keeps a good copy (and never
        gives it back for this prompt's room), and asks for content only to replace a bad
        one, which :meth:`store` then leaves out too."""
        out: dict[str, NDArray[np.int64]] = {}
        core = self.engine.core
        for group in self.groups:
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            index = core.group(group.name).rule.commit_blocks(decl, high.size)
            lacking = index[~self._providable(cache, group, index)]
            if not lacking.size:
                continue
            with self.engine.lock:
                cached = core.lookup_words(group.name, high[lacking], low[lacking]) >= 0
            out[group.name] = lacking[~cached]
        return out

    def _providable(self, cache: DynamicCache, group: LayerGroup,
                    index: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Per block of ``index``: captured during a prefill of the recording ``cache``, or
        still held by it."""
        record = self._records.get(cache)
        captured = record.captured.get(group.name, {}) if record is not None else {}
        have = np.isin(index, np.fromiter(captured, dtype=np.int64, count=len(captured)))
        if not have.all():
            have[~have] = self.codecs[group.name].holds(cache, index[~have])
        return have

    def _skip_text(self, name: str, cache: DynamicCache, index: NDArray[np.int64],
                   absent: NDArray[np.int64] | None) -> str:
        """Why blocks ``index`` of group ``name`` were left out; ``absent``: those of them the
        engine had no copy of (the others it holds a copy of that it would have replaced)."""
        size = self._group(name).decl.block_size
        absent = np.zeros(0, dtype=np.int64) if absent is None else absent
        replaced = np.setdiff1d(index, absent)
        said = []
        if absent.size:
            said.append(f"the engine has no copy of {absent.tolist()}")
        if replaced.size:
            said.append(f"its copy of {replaced.tolist()} is one the commit would replace "
                        "(seen failing a checksum, or computed by this prefill yet only in a "
                        "lower tier)")
        return (f"blocks {index.tolist()} (tokens {_spans(index, size)}) not committed: not "
                f"captured during a prefill and {self.codecs[name].held(cache)}; "
                + "; ".join(said))

    def _group(self, name: str) -> LayerGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise CacheAdapterError(f"no group {name!r}; groups: {[g.name for g in self.groups]}")

    def _payload(self, cache: DynamicCache, group: LayerGroup,
                 index: NDArray[np.int64]) -> NDArray[np.uint8]:
        """Blocks ``index`` of ``group``, captured or sliced out of ``cache``: uint8
        [k, payload_bytes]."""
        torch = _torch()
        decl = group.decl
        if not index.size:
            return np.zeros((0, decl.payload_bytes), dtype=np.uint8)
        have = self._providable(cache, group, index)
        if not have.all():
            lacking = index[~have]
            raise _Unavailable(group.name, f"blocks {lacking.tolist()} were neither captured "
                               f"nor held by the cache", lacking)
        record = self._records.get(cache)
        captured = record.captured.get(group.name, {}) if record is not None else {}
        live = np.array([i for i in index.tolist() if i not in captured], dtype=np.int64)
        sliced = iter(self.codecs[group.name].encode(cache, live)) if live.size else iter(())
        blocks = torch.stack([captured[i] if i in captured else next(sliced)
                              for i in index.tolist()]).contiguous().cpu()
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
        length: a shorter prefix needs other window blocks, another snapshot). It records (see
        :meth:`new_cache`)."""
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
            allowed = self.engine.lookup(prompt.head(length + 1), level=level).usable_tokens
        if allowed != length:
            raise CacheAdapterError(f"the verdict does not allow reusing {length} tokens "
                                    f"(usable: {allowed})")
        core = self.engine.core

        def read(name: str, ids: NDArray[np.intp]) -> NDArray[np.uint8]:
            # ids are the needed blocks [lo, hi) in order: [lo, cut) in compressed form.
            group = core.group(name)
            needed = group.rule.needed(group.decl, np.array([length], dtype=np.int64))
            compressed = int(needed.cut[0] - needed.lo[0])
            core.pin(name, ids)  # a reader pins what it reads
            try:
                data = np.concatenate([core.read(name, ids[:compressed], form=Form.COMPRESSED),
                                       core.read(name, ids[compressed:], form=Form.RAW)])
                # Told to the observers (an event log's replay checks every read was of a
                # readable block at its epoch).
                core.record_read(name, ids)
                return data
            finally:
                core.unpin(name, ids)

        return self.rebuild_unchecked(prompt, length, read, device=device)

    def needed_blocks(self, prompt: Prompt, group: LayerGroup, length: int) -> NDArray[np.int64]:
        """Indices of ``prompt``'s blocks of ``group`` a cache of ``length`` tokens holds (the
        kind's rule: every block for full attention and compressed entries, the window's for a
        sliding window, the one ending at ``length`` for a recurrent snapshot)."""
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
            if not index.size:
                continue
            high, low = prompt.words(decl.block_size)
            ids = core.lookup_words(group.name, high[index], low[index])
            if (ids < 0).any():
                raise CacheAdapterError(f"{group.name}: blocks {index[ids < 0].tolist()} of the "
                                        "prompt are not cached")
            raw = read(group.name, ids)
            data_bytes = decl.payload_bytes - decl.layout.padding
            typed = np.ascontiguousarray(raw[:, :data_bytes]).view(np.dtype(decl.dtype))
            blocks = torch.from_numpy(typed.reshape(index.size, *decl.shape))  # no copy
            if device is not None:
                blocks = blocks.to(device)
            self.codecs[group.name].decode(cache, blocks, index, length)
        return cache
