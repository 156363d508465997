"""A kvfsm model declaration from a transformers config: one group per cache state kept.

``declaration_toml(config)`` writes the declaration's TOML text and ``declare(config)`` loads it
(``parse_model(declaration_toml(config))``), so a generated declaration passes every check a
hand-written one does, including that each group's kind is its lifecycle's kind. Only the
config's attributes are read: no model is built, and transformers itself is not imported.

Every block payload is float32 (numpy has no bfloat16: a bf16 model's cache is widened), every
layout has alignment 256 and no padding, and the batch dimension is never part of a block: a
block holds one sequence's state. Layers appear in ``config.layer_types`` order.

Group conventions (the adapter packs and unpacks blocks by exactly these):

``gpt_oss``
    ``full`` (kind ``full``, lifecycle ``full_kv``): the ``full_attention`` layers' K and V,
    shape ``[layers, 2, num_key_value_heads, block_size, head_dim]``, dim_order
    ``block, layer, kv, head, token, dim`` (``kv`` 0 is K, 1 is V): slice ``[..., t0:t1, :]`` of
    transformers' ``DynamicLayer.keys`` / ``.values`` (``[batch, head, token, dim]``).
    ``sliding`` (kind and lifecycle ``sliding_window``): the same for the ``sliding_attention``
    layers, ``window = config.sliding_window``: ``DynamicSlidingWindowLayer`` keeps the last
    ``sliding_window - 1`` tokens, exactly the ``[L-(W-1), L)`` kvfsm's sliding-window rule needs
    when ``W = sliding_window``.

``qwen3_next``
    ``full`` as above for its ``full_attention`` layers.
    ``linear`` (kind and lifecycle ``recurrent``, ``checkpoint_interval`` default
    ``block_size``): one snapshot of the state after the block's last token of every
    ``linear_attention`` (Gated DeltaNet) layer, packed into one float32 vector of shape
    ``[n_floats]``, dim_order ``block, state``. Packing order, per linear layer in layer order:
    the conv state (``LinearAttentionLayer.conv_states[0]`` without the batch dimension,
    ``[conv_dim, linear_conv_kernel_dim]`` with ``conv_dim = 2 * linear_num_key_heads *
    linear_key_head_dim + linear_num_value_heads * linear_value_head_dim``; transformers keeps
    the last ``linear_conv_kernel_dim`` inputs of the short convolution) flattened row-major,
    then the recurrent state (``recurrent_states[0]`` without the batch dimension,
    ``[linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]``) flattened
    row-major. :func:`qwen3_next_state_shapes` lists the pieces in that order.

``deepseek_v4``
    ``sliding`` (``sliding_window``): every layer's shared K=V (V4 is shared-KV MQA: one vector
    per token, keys and values are the same tensor), shape ``[layers, block_size, head_dim]``,
    dim_order ``block, layer, token, dim``, ``window = config.sliding_window`` (transformers
    keeps the last ``sliding_window - 1`` tokens, as above).
    ``csa`` (``compressed``): the compressed entries of the compressed sparse attention layers
    (``compressed_kv["compressor"]``), one per ``m`` tokens (``m =
    compress_rates["compressed_sparse_attention"]``). Its block size is ``C = lcm(block_size,
    m)``: whole windows, so the compressor's buffer is empty at every block boundary, and
    boundaries shared with every other group. Shape ``[layers, C // m, head_dim]``, dim_order
    ``block, layer, entry, dim``; ``sub_blocks = gcd(C // m, 16)``, one per window while a
    block holds at most 16 windows (a partially written block has the entries of its closed
    windows).
    ``csa_index`` (``compressed``): the lightning indexer's compressed keys
    (``compressed_kv["indexer"]``), same windows and block size, ``[layers, C // m,
    index_head_dim]``.
    ``csa_overlap`` (``recurrent``, block size and default ``checkpoint_interval`` ``C``): the
    CSA overlap state at the block boundary, which the next window's entry mixes in: per CSA
    layer in order, ``overlap_kv["compressor"]``, ``overlap_gate["compressor"]`` (each ``[m,
    head_dim]``), ``overlap_kv["indexer"]``, ``overlap_gate["indexer"]`` (each ``[m,
    index_head_dim]``), batch dimension dropped, each flattened row-major into one float32
    vector ``[n_floats]``, dim_order ``block, state``; :func:`deepseek_v4_overlap_shapes`
    lists them.
    ``hca`` (``compressed``): the heavily compressed attention layers' entries, as ``csa`` with
    rate ``m' = compress_rates["heavily_compressed_attention"]``: block ``lcm(block_size, m')``.
    Not held by any group (see docs/models.md): the compressors' buffers ``buffer_kv`` /
    ``buffer_gate`` (projections of the tokens since the last window boundary, empty at every
    block boundary), the counters ``entry_count`` (``L // m``) and no ``sparse_index`` group,
    since transformers caches no top-k choices: the indexer re-scores its compressed keys at
    every step. A group is declared only when some layer has that state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Final

import attrs

from kvfsm._errors import KvfsmError
from kvfsm.serve._tiny import check_model_type
from kvfsm.spec import ModelDecl, parse_model

#: Every generated layout: the block's base aligned to 256 bytes, nothing appended.
ALIGNMENT: Final = 256
#: A compressed block's written sub-blocks are tracked in a 16-bit mask.
_MAX_SUB_BLOCKS: Final = 16

_FULL = "full_attention"
_SLIDING = "sliding_attention"
_LINEAR = "linear_attention"
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"


@attrs.frozen
class _Group:
    """One group as it is written: its TOML keys, with the names of its dimensions after
    ``block`` and its kind-specific keys (``extra``) in the order they are written."""

    name: str
    kind: str
    lifecycle: str
    block_size: int
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    extra: tuple[tuple[str, int], ...] = ()


@attrs.frozen
class _Plan:
    description: str
    notes: tuple[str, ...]
    groups: tuple[_Group, ...]


def declare(
    config: Any,
    *,
    block_size: int = 16,
    name: str | None = None,
    checkpoint_interval: int | None = None,
) -> ModelDecl:
    """The validated declaration of ``config``'s cache (see the module docstring for the
    groups). ``block_size`` is the tokens per block of the per-token groups, ``name`` the
    model's name (default: ``config.model_type``), ``checkpoint_interval`` the tokens between
    recurrent snapshots (default: one per block of the recurrent group). Raises
    :class:`KvfsmError` for an unsupported ``model_type`` or a config it cannot read."""
    text = declaration_toml(
        config, block_size=block_size, name=name, checkpoint_interval=checkpoint_interval
    )
    return parse_model(text, source=f"<{config.model_type} config>")


def declaration_toml(
    config: Any,
    *,
    block_size: int = 16,
    name: str | None = None,
    checkpoint_interval: int | None = None,
    generated_by: str | None = None,
) -> str:
    """The TOML text of :func:`declare`'s declaration. Its header comment says how it was made
    (``generated_by``, a command line, when given) and what each group holds. Deterministic:
    equal configs and arguments give the same text, byte for byte."""
    model_type = check_model_type(getattr(config, "model_type", None))
    _positive("block_size", block_size)
    if checkpoint_interval is not None:
        _positive("checkpoint_interval", checkpoint_interval)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise KvfsmError(f"name must be a non-empty string, got {name!r}")
    reader = _Reader(config, model_type)
    if model_type == "gpt_oss":
        plan = _gpt_oss(reader, block_size, checkpoint_interval)
    elif model_type == "qwen3_next":
        plan = _qwen3_next(reader, block_size, checkpoint_interval)
    else:
        plan = _deepseek_v4(reader, block_size, checkpoint_interval)
    return _render(model_type, name or model_type, plan, generated_by)


def qwen3_next_state_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The pieces of one ``linear`` snapshot of a qwen3_next model, in packing order: for each
    ``linear_attention`` layer ``i``, ``("layers.i.conv_state", (conv_dim, kernel))`` then
    ``("layers.i.recurrent_state", (value_heads, key_dim, value_dim))``. The snapshot's float
    count is the sum of the products of the shapes."""
    reader = _Reader(config, "qwen3_next")
    conv, recurrent = _qwen3_next_linear_shapes(reader)
    out: list[tuple[str, tuple[int, ...]]] = []
    for layer in reader.layers_of(_LINEAR):
        out.append((f"layers.{layer}.conv_state", conv))
        out.append((f"layers.{layer}.recurrent_state", recurrent))
    return out


def deepseek_v4_overlap_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The pieces of one ``csa_overlap`` snapshot of a deepseek_v4 model, in packing order: for
    each ``compressed_sparse_attention`` layer ``i``, ``layers.i.compressor.overlap_kv``,
    ``layers.i.compressor.overlap_gate`` (each ``(m, head_dim)``), then
    ``layers.i.indexer.overlap_kv``, ``layers.i.indexer.overlap_gate`` (each ``(m,
    index_head_dim)``), ``m`` being the CSA compress rate."""
    reader = _Reader(config, "deepseek_v4")
    rate = reader.rate(_CSA)
    head_dim = reader.integer("head_dim")
    index_dim = reader.integer("index_head_dim")
    out: list[tuple[str, tuple[int, ...]]] = []
    for layer in reader.layers_of(_CSA):
        for part, dim in (("compressor", head_dim), ("indexer", index_dim)):
            out.append((f"layers.{layer}.{part}.overlap_kv", (rate, dim)))
            out.append((f"layers.{layer}.{part}.overlap_gate", (rate, dim)))
    return out


# ------------------------------------------------------------------------------ architectures


def _kv_groups(
    reader: _Reader, block_size: int, full: Sequence[int], sliding: Sequence[int]
) -> list[_Group]:
    """Per-token K/V groups: ``full`` for full-attention layers, ``sliding`` for the others."""
    heads = reader.integer("num_key_value_heads")
    head_dim = reader.integer("head_dim")
    dims = ("layer", "kv", "head", "token", "dim")
    groups = []
    if full:
        shape = (len(full), 2, heads, block_size, head_dim)
        groups.append(_Group("full", "full", "full_kv", block_size, shape, dims))
    if sliding:
        window = reader.integer("sliding_window")
        shape = (len(sliding), 2, heads, block_size, head_dim)
        groups.append(
            _Group("sliding", "sliding_window", "sliding_window", block_size, shape, dims,
                   (("window", window),))
        )
    return groups


def _gpt_oss(reader: _Reader, block_size: int, checkpoint_interval: int | None) -> _Plan:
    reader.only_layer_types((_FULL, _SLIDING))
    if checkpoint_interval is not None:
        raise KvfsmError("gpt_oss keeps no recurrent state: checkpoint_interval does not apply")
    full, sliding = reader.layers_of(_FULL), reader.layers_of(_SLIDING)
    groups = _kv_groups(reader, block_size, full, sliding)
    notes = [
        "A gpt_oss model: full causal attention and sliding-window attention layers, each",
        "keeping K and V per token and KV head (transformers' DynamicLayer and",
        "DynamicSlidingWindowLayer keys / values, [batch, head, token, dim] per layer).",
    ]
    if full:
        notes.append(
            f"  full     full_attention layers {_listed(full)}: every block of the prefix."
        )
    if sliding:
        window = reader.integer("sliding_window")
        notes += [
            f"  sliding  sliding_attention layers {_listed(sliding)}: transformers keeps the last",
            f"           sliding_window - 1 = {window - 1} tokens, the W-1 before the next query,"
            f" so window = {window}.",
        ]
    description = (
        f"gpt_oss from its config: {_count(full, 'full-attention layer')} and "
        f"{_count(sliding, 'sliding-window layer')}, {reader.integer('num_key_value_heads')} KV "
        f"heads of {reader.integer('head_dim')}."
    )
    return _Plan(description, tuple(notes), tuple(groups))


def _qwen3_next_linear_shapes(reader: _Reader) -> tuple[tuple[int, int], tuple[int, int, int]]:
    key_heads = reader.integer("linear_num_key_heads")
    value_heads = reader.integer("linear_num_value_heads")
    key_dim = reader.integer("linear_key_head_dim")
    value_dim = reader.integer("linear_value_head_dim")
    kernel = reader.integer("linear_conv_kernel_dim")
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    return (conv_dim, kernel), (value_heads, key_dim, value_dim)


def _qwen3_next(reader: _Reader, block_size: int, checkpoint_interval: int | None) -> _Plan:
    reader.only_layer_types((_FULL, _LINEAR))
    full, linear = reader.layers_of(_FULL), reader.layers_of(_LINEAR)
    groups = _kv_groups(reader, block_size, full, [])
    notes = [
        "A qwen3_next model: gated full-attention layers keep K and V per token; Gated DeltaNet",
        "(linear attention) layers keep a fixed-size state instead.",
    ]
    if full:
        notes.append(f"  full    full_attention layers {_listed(full)}: every block of the prefix.")
    if linear:
        interval = _interval(checkpoint_interval, block_size, "linear")
        conv, recurrent = _qwen3_next_linear_shapes(reader)
        floats = len(linear) * (math.prod(conv) + math.prod(recurrent))
        groups.append(
            _Group("linear", "recurrent", "recurrent", block_size, (floats,), ("state",),
                   (("checkpoint_interval", interval),))
        )
        notes += [
            f"  linear  linear_attention layers {_listed(linear)}: a snapshot of the state after",
            f"          the block's last token, every {interval} tokens, packed per layer in"
            " order:",
            f"          conv state {list(conv)} (conv_states[0]) then recurrent state"
            f" {list(recurrent)}",
            "          (recurrent_states[0]), each without the batch dimension and flattened",
            "          row-major: kvfsm.serve.qwen3_next_state_shapes(config).",
        ]
    description = (
        f"qwen3_next from its config: {_count(full, 'gated full-attention layer')} and "
        f"{_count(linear, 'Gated DeltaNet layer')} (conv and recurrent state snapshots)."
    )
    return _Plan(description, tuple(notes), tuple(groups))


def _deepseek_v4(reader: _Reader, block_size: int, checkpoint_interval: int | None) -> _Plan:
    reader.only_layer_types((_SLIDING, _CSA, _HCA))
    layers = reader.layer_types()
    csa, hca = reader.layers_of(_CSA), reader.layers_of(_HCA)
    head_dim = reader.integer("head_dim")
    window = reader.integer("sliding_window")
    groups = [
        _Group("sliding", "sliding_window", "sliding_window", block_size,
               (len(layers), block_size, head_dim), ("layer", "token", "dim"),
               (("window", window),))
    ]
    notes = [
        "A deepseek_v4 model: every layer attends a sliding window of raw K=V (shared-KV MQA: one",
        "vector per token); compressed sparse attention (CSA) layers add compressed entries",
        "chosen by a lightning indexer, heavily compressed attention (HCA) layers add entries of",
        "longer windows.",
        f"  sliding      all {len(layers)} layers: the last sliding_window - 1 = {window - 1}"
        f" tokens of K=V, so window = {window}.",
    ]
    if csa:
        rate = reader.rate(_CSA)
        size = math.lcm(block_size, rate)
        entries = size // rate
        sub_blocks = math.gcd(entries, _MAX_SUB_BLOCKS)
        interval = _interval(checkpoint_interval, size, "csa_overlap")
        overlap = sum(math.prod(shape) for _, shape in deepseek_v4_overlap_shapes(reader.config))
        index_dim = reader.integer("index_head_dim")
        groups += [
            _Group("csa", "compressed", "compressed", size, (len(csa), entries, head_dim),
                   ("layer", "entry", "dim"), (("sub_blocks", sub_blocks),)),
            _Group("csa_index", "compressed", "compressed", size, (len(csa), entries, index_dim),
                   ("layer", "entry", "dim"), (("sub_blocks", sub_blocks),)),
            _Group("csa_overlap", "recurrent", "recurrent", size, (overlap,), ("state",),
                   (("checkpoint_interval", interval),)),
        ]
        notes += [
            f"  csa          CSA layers {_listed(csa)}: compressed entries (compressed_kv"
            f'["compressor"]), one',
            f"               per {rate} tokens; a block of {size} tokens holds {entries}, written"
            f" in {sub_blocks} sub-blocks.",
            '  csa_index    the same layers\' indexer keys (compressed_kv["indexer"]), same'
            " windows.",
            "  csa_overlap  their overlap state at the block boundary, which the next entry mixes"
            " in:",
            "               per CSA layer overlap_kv, overlap_gate of the compressor, then of the"
            " indexer,",
            "               each without the batch dimension, flattened row-major:",
            "               kvfsm.serve.deepseek_v4_overlap_shapes(config).",
        ]
    if hca:
        rate = reader.rate(_HCA)
        size = math.lcm(block_size, rate)
        entries = size // rate
        groups.append(
            _Group("hca", "compressed", "compressed", size, (len(hca), entries, head_dim),
                   ("layer", "entry", "dim"),
                   (("sub_blocks", math.gcd(entries, _MAX_SUB_BLOCKS)),))
        )
        notes.append(
            f"  hca          HCA layers {_listed(hca)}: compressed entries, one per {rate} tokens."
        )
    notes += [
        "Held by no group: the compressors' buffers (buffer_kv / buffer_gate, the tokens since",
        "the last window boundary: empty at every block boundary), the entry counters (L // rate),",
        "and no sparse_index group: transformers caches no top-k choices, the indexer re-scores",
        "its keys at every step. See docs/models.md.",
    ]
    description = (
        f"deepseek_v4 from its config: {_count(layers, 'layer')} with a {window}-token sliding "
        f"window, of which {len(csa)} compressed sparse attention (CSA) and {len(hca)} heavily "
        "compressed attention (HCA)."
    )
    return _Plan(description, tuple(notes), tuple(groups))


# ------------------------------------------------------------------------------ helpers


class _Reader:
    """Reads a config's attributes, each problem a :class:`KvfsmError` naming the key."""

    def __init__(self, config: Any, model_type: str) -> None:
        found = getattr(config, "model_type", None)
        if found != model_type:
            raise KvfsmError(f"expected a {model_type} config, got model_type {found!r}")
        self.config = config
        self.model_type = model_type

    def integer(self, key: str) -> int:
        value = getattr(self.config, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvfsmError(f"{self.model_type} config: {key!r} must be an int >= 1, "
                             f"got {value!r}")
        return value

    def layer_types(self) -> list[str]:
        value = getattr(self.config, "layer_types", None)
        if not isinstance(value, list | tuple) or not value:
            raise KvfsmError(f"{self.model_type} config: 'layer_types' must be a non-empty list, "
                             f"got {value!r}")
        return [str(v) for v in value]

    def only_layer_types(self, allowed: Sequence[str]) -> None:
        unknown = sorted(set(self.layer_types()) - set(allowed))
        if unknown:
            raise KvfsmError(
                f"{self.model_type} config: layer_types {unknown} not declarable; "
                f"expected {list(allowed)}"
            )

    def layers_of(self, layer_type: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types()) if t == layer_type]

    def rate(self, layer_type: str) -> int:
        rates = getattr(self.config, "compress_rates", None)
        value = rates.get(layer_type) if isinstance(rates, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvfsmError(f"{self.model_type} config: compress_rates[{layer_type!r}] must be "
                             f"an int >= 1, got {value!r}")
        return value


def _positive(key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KvfsmError(f"{key} must be an int >= 1, got {value!r}")


def _interval(interval: int | None, block_size: int, group: str) -> int:
    if interval is None:
        return block_size
    if interval % block_size:
        raise KvfsmError(
            f"checkpoint_interval {interval} is not a multiple of {block_size}, the block size "
            f"of group {group!r}: a snapshot must fall on a block boundary"
        )
    return interval


def _count(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _listed(layers: Sequence[int]) -> str:
    return ", ".join(str(i) for i in layers)


def _render(model_type: str, name: str, plan: _Plan, generated_by: str | None) -> str:
    lines = []
    if generated_by is not None:
        lines += [
            f"# Generated by `{generated_by}`.",
            "# Do not edit by hand: regenerate it with that command.",
        ]
    else:
        lines.append(f"# Generated by kvfsm.serve.declaration_toml from a {model_type} config.")
    lines += ["#", *(f"# {note}".rstrip() for note in plan.notes), ""]
    lines += [
        "[model]",
        f"name = {_string(name)}",
        f"description = {_string(plan.description)}",
        "layout_version = 1",
    ]
    for group in plan.groups:
        lines += [
            "",
            "[[groups]]",
            f"name = {_string(group.name)}",
            f"kind = {_string(group.kind)}",
            f"lifecycle = {_string(group.lifecycle)}",
            f"block_size = {group.block_size}",
            f"shape = {_ints(group.shape)}  # {', '.join(group.dims)}",
            'dtype = "float32"',
            *(f"{key} = {value}" for key, value in group.extra),
            "",
            "[groups.layout]",
            f"dim_order = [{', '.join(_string(d) for d in ('block', *group.dims))}]",
            f"alignment = {ALIGNMENT}",
            "padding = 0",
        ]
    return "\n".join(lines) + "\n"


def _string(text: str) -> str:
    # A JSON string with ASCII escapes is a valid TOML basic string.
    return json.dumps(text)


def _ints(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"
