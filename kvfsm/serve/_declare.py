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

``llama``, ``mistral``, ``qwen3``, ``gemma2``, ``gemma3_text``
    ``full`` and ``sliding`` exactly as gpt_oss's: the layers transformers' cache keeps whole
    (``DynamicLayer``, ``full_attention``) and those it keeps a window of
    (``DynamicSlidingWindowLayer``, ``sliding_attention``), ``window = config.sliding_window``.
    Layer types are ``config.layer_types`` (Qwen3 derives them from ``use_sliding_window`` and
    ``max_window_layers``, Gemma 2 alternates, Gemma 3 follows ``sliding_window_pattern``).
    Llama and Mistral configs have none, and their cache infers them as :func:`layer_types`
    does: every layer full (Llama; Mistral with ``sliding_window`` null) or every layer a window
    (Mistral with ``sliding_window`` set); a ``layer_types`` that says otherwise is refused,
    since their attention ignores it. ``head_dim`` is the config's (Llama, Mistral: ``hidden_size
    / num_attention_heads`` when null); ``num_key_value_heads`` null (Llama, Mistral, Qwen3) is
    ``num_attention_heads``. A config with ``use_bidirectional_attention`` (Gemma embedding
    models) is refused: every token attends those after it, so no prefix's cache is reusable.

Keys (:func:`check_config_keys`, run by ``kvfsm model from-config`` on a ``config.json`` before
transformers builds the config, which would fill a missing key with the default of some other
model size): every key that sets the cache's shape must be present, and every numeric key is an
int in range (or null where the architecture gives null a meaning), each error naming the key,
the model type and the file.

Sizes: the header comment states each group's bytes per block and per token of prefix, and for a
recurrent group the bytes of one snapshot and how to choose ``checkpoint_interval``;
:func:`snapshot_notes` says the same in one line per recurrent group (the command prints it on
stderr).
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Final

import attrs

from kvfsm._errors import KvfsmError
from kvfsm.serve._tiny import check_model_type
from kvfsm.spec import GroupKind, ModelDecl, parse_model

#: Every generated layout: the block's base aligned to 256 bytes, nothing appended.
ALIGNMENT: Final = 256
#: A compressed block's written sub-blocks are tracked in a 16-bit mask.
_MAX_SUB_BLOCKS: Final = 16
#: Bytes of one element: every generated payload is float32 (numpy has no bfloat16).
_FLOAT32_BYTES: Final = 4
#: Header comment lines are wrapped to fit 100 columns with their "# " and indent.
_NOTE_WIDTH: Final = 94

_FULL = "full_attention"
_SLIDING = "sliding_attention"
_LINEAR = "linear_attention"
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"

#: Families whose config has no layer_types: their cache infers one type for every layer.
_INFERRED_LAYER_TYPES: Final = ("llama", "mistral")
#: Families whose null num_key_value_heads means num_attention_heads (multi-head attention).
_NULL_KV_HEADS: Final = ("llama", "mistral", "qwen3")
#: Families whose null head_dim means hidden_size / num_attention_heads.
_NULL_HEAD_DIM: Final = ("llama", "mistral")


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
    if model_type == "qwen3_next":
        plan = _qwen3_next(reader, block_size, checkpoint_interval)
    elif model_type == "deepseek_v4":
        plan = _deepseek_v4(reader, block_size, checkpoint_interval)
    else:
        plan = _attention(reader, block_size, checkpoint_interval)
    return _render(model_type, name or model_type, plan, generated_by)


def layer_types(config: Any) -> list[str]:
    """The type of each layer of ``config``'s model as its cache sees it: ``config.layer_types``,
    or, for Llama and Mistral (whose configs have none), what transformers' cache infers: every
    layer ``sliding_attention`` when ``sliding_window`` is set, else ``full_attention``."""
    model_type = check_model_type(getattr(config, "model_type", None))
    return _Reader(config, model_type).layer_types()


def snapshot_notes(model: ModelDecl) -> list[str]:
    """One line per recurrent group of ``model`` whose snapshots store more bytes per token of
    prefix than the other groups together (or that is the only kind of group): the bytes of one
    snapshot, how often one is taken, what that costs per token, and the
    ``checkpoint_interval`` at which snapshots cost no more per token than the other groups."""
    costs = [_Cost(g.name, g.kind is GroupKind.RECURRENT, g.block_size, g.payload_bytes,
                   g.checkpoint_interval or g.block_size) for g in model.groups]
    other = _per_token(costs)
    lines = []
    for cost in costs:
        if not cost.recurrent or (other and Fraction(cost.payload_bytes, cost.interval) <= other):
            continue
        line = (f"{model.name}: group {cost.name!r} stores a snapshot of "
                f"{_bytes(cost.payload_bytes)} every {cost.interval} tokens, "
                f"{_amount(Fraction(cost.payload_bytes, cost.interval))} bytes per token of "
                "prefix")
        if other:
            line += (f" (the other groups: {_amount(other)}); --checkpoint-interval "
                     f"{_even_interval(cost, other)} or more stores no more per token than they "
                     "do, at the cost of recomputing up to that many tokens of a prompt")
        lines.append(line + "; the declaration's header says how to choose")
    return lines


# ------------------------------------------------------------------------------ config keys


@attrs.frozen
class _Keys:
    """What a family's ``config.json`` must hold before transformers fills in defaults.

    ``required``: one entry per requirement, ``|`` between alternatives, ``+`` between keys an
    alternative needs together; a key must be present and not null unless it ends in ``?``.
    ``minimum``: the least value of each numeric key the family adds to :data:`_MINIMUM`.
    ``nullable``: numeric keys whose null the architecture gives a meaning. ``when``: a flag key
    and the requirements that apply when it is true."""

    required: tuple[str, ...]
    minimum: Mapping[str, int] = MappingProxyType({})
    nullable: frozenset[str] = frozenset({"sliding_window"})
    when: tuple[tuple[str, tuple[str, ...]], ...] = ()


#: Numeric keys every family's cache shape reads, when present: at least 1 (a count or a size).
_MINIMUM: Final[Mapping[str, int]] = MappingProxyType({
    key: 1 for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "hidden_size", "head_dim", "sliding_window")
})
_LINEAR_KEYS: Final = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                       "linear_num_key_heads", "linear_num_value_heads")
_KEYS: Final[Mapping[str, _Keys]] = MappingProxyType({
    "gpt_oss": _Keys(("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window")),
    "qwen3_next": _Keys(
        ("num_hidden_layers", "num_key_value_heads", "head_dim", *_LINEAR_KEYS,
         "layer_types|full_attention_interval"),
        MappingProxyType({**dict.fromkeys(_LINEAR_KEYS, 1), "full_attention_interval": 1})),
    "deepseek_v4": _Keys(
        ("num_hidden_layers", "head_dim", "index_head_dim", "sliding_window",
         "layer_types|compress_ratios",
         # compress_ratios (per layer: 0, or the layer's rate) names the rates it uses.
         "compress_rates|compress_rate_csa+compress_rate_hca|compress_ratios"),
        MappingProxyType({"index_head_dim": 1, "compress_rate_csa": 1, "compress_rate_hca": 1}),
        frozenset()),
    # Llama's missing num_key_value_heads is multi-head attention (num_attention_heads), the
    # architecture's own rule, not another size's value.
    "llama": _Keys(("num_hidden_layers", "num_attention_heads", "head_dim|hidden_size"),
                   nullable=frozenset({"num_key_value_heads", "head_dim"})),
    "mistral": _Keys(
        ("num_hidden_layers", "num_attention_heads", "num_key_value_heads?",
         "head_dim|hidden_size", "sliding_window?"),
        nullable=frozenset({"num_key_value_heads", "head_dim", "sliding_window"})),
    "qwen3": _Keys(
        ("num_hidden_layers", "num_key_value_heads?", "head_dim"),
        MappingProxyType({"max_window_layers": 0}),
        frozenset({"num_key_value_heads", "sliding_window"}),
        (("use_sliding_window", ("layer_types|sliding_window+max_window_layers",)),)),
    "gemma2": _Keys(("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window")),
    "gemma3_text": _Keys(
        ("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window",
         "layer_types|sliding_window_pattern"),
        MappingProxyType({"sliding_window_pattern": 1})),
})


def check_config_keys(model_type: str, settings: Mapping[str, Any], *, source: str,
                      required: bool = True) -> None:
    """Check the raw keys of a ``model_type`` config (a ``config.json``'s object, ``source``
    naming it) before transformers builds the config: with ``required``, that every key setting
    the cache's shape is present (transformers would fill a missing one with the default of some
    other model size); always, that every numeric key present is an int in range, or null where
    the architecture allows it, and that ``layer_types`` is a list of strings, one per layer.
    Raises :class:`KvfsmError` naming each bad key, the model type and ``source``."""
    keys = _KEYS[check_model_type(model_type)]
    label = f"{model_type} config {source}"
    problems = []
    if required:
        needs = list(keys.required)
        for flag, more in keys.when:
            if settings.get(flag) is True:
                needs += more
        for need in needs:
            if any(all(_given(settings, key) for key in option.split("+"))
                   for option in need.split("|")):
                continue
            if "|" not in need and "+" not in need and need in settings:
                problems.append(f"missing {need!r}: it is null")
            else:
                problems.append(f"missing {_said(need)}")
    for key, least in {**_MINIMUM, **keys.minimum}.items():
        if key in settings:
            problems += _integer_problem(repr(key), settings[key], least, key in keys.nullable)
    problems += _list_problems(settings)
    if problems:
        missing = any(problem.startswith("missing") for problem in problems)
        why = ("; a key setting the cache's shape must be given: transformers would fill in the "
               "default of another model size") if missing else ""
        raise KvfsmError(f"{label}: {'; '.join(problems)}{why}")


def shape_keys(model_type: str) -> frozenset[str]:
    """The config keys :func:`check_config_keys` reads for ``model_type``, including those
    transformers takes as arguments without keeping them (``full_attention_interval``,
    ``sliding_window_pattern``, ``compress_ratios``, ...)."""
    keys = _KEYS[check_model_type(model_type)]
    needs = [*keys.required, *(need for _flag, more in keys.when for need in more)]
    named = {key.rstrip("?") for need in needs for option in need.split("|")
             for key in option.split("+")}
    return frozenset(named | set(keys.minimum) | {flag for flag, _more in keys.when})


def _given(settings: Mapping[str, Any], key: str) -> bool:
    name = key.rstrip("?")
    return name in settings and (key.endswith("?") or settings[name] is not None)


def _said(need: str) -> str:
    options = [" and ".join(repr(key.rstrip("?")) for key in option.split("+"))
               for option in need.split("|")]
    return " or ".join(options)


def _integer_problem(name: str, value: object, least: int, nullable: bool) -> list[str]:
    """The problem with numeric key ``name`` (as written in the message) holding ``value``."""
    if value is None and nullable:
        return []
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return []
    return [f"{name} must be an int >= {least}{' or null' if nullable else ''}, got {value!r}"]


def _list_problems(settings: Mapping[str, Any]) -> list[str]:
    problems = []
    layers = settings.get("num_hidden_layers")
    types = settings.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
            problems.append(f"'layer_types' must be a non-empty list of strings, got {types!r}")
        elif not _integer_problem("", layers, 1, False) and len(types) != layers:
            problems.append(f"'layer_types' has {len(types)} entries but 'num_hidden_layers' is "
                            f"{layers}: one per layer")
    rates = settings.get("compress_rates")
    if rates is not None:
        if not isinstance(rates, dict):
            problems.append(f"'compress_rates' must be an object of ints, got {rates!r}")
        else:
            for layer_type, rate in rates.items():
                problems += _integer_problem(f"compress_rates[{layer_type!r}]", rate, 1, False)
    ratios = settings.get("compress_ratios")
    if ratios is not None and (not isinstance(ratios, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios)):
        problems.append(f"'compress_ratios' must be a list of ints >= 0, got {ratios!r}")
    return problems


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
    heads = reader.kv_heads()
    head_dim = reader.head_dim()
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


#: What each attention-only family's layers are, for the header comment.
_ATTENTION: Final[Mapping[str, str]] = MappingProxyType({
    "gpt_oss": "full causal attention and sliding-window attention layers",
    "llama": "full causal attention in every layer",
    "mistral": "sliding-window attention in every layer when sliding_window is set, else full "
               "causal attention",
    "qwen3": "full causal attention, and sliding-window attention from layer max_window_layers "
             "on when use_sliding_window is set",
    "gemma2": "alternating sliding-window and full causal attention layers",
    "gemma3_text": "sliding-window and full causal attention layers (layer_types, or "
                   "sliding_window_pattern: every n-th layer full)",
})


def _attention(reader: _Reader, block_size: int, checkpoint_interval: int | None) -> _Plan:
    """gpt_oss and the dense families: K/V per token, ``full`` and ``sliding`` groups."""
    model_type = reader.model_type
    if getattr(reader.config, "use_bidirectional_attention", None):
        raise KvfsmError(
            f"{reader.label}: 'use_bidirectional_attention' is set: every token attends the "
            "tokens after it, so no prefix's cache can be reused")
    reader.only_layer_types((_FULL, _SLIDING))
    if checkpoint_interval is not None:
        raise KvfsmError(f"{model_type} keeps no recurrent state: checkpoint_interval does "
                         "not apply")
    full, sliding = reader.layers_of(_FULL), reader.layers_of(_SLIDING)
    groups = _kv_groups(reader, block_size, full, sliding)
    notes = _wrap(
        f"A {model_type} model: {_ATTENTION[model_type]}, each keeping K and V per token and KV "
        "head (transformers' DynamicLayer and DynamicSlidingWindowLayer keys / values, [batch, "
        "head, token, dim] per layer).")
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
        f"{model_type} from its config: {_count(full, 'full-attention layer')} and "
        f"{_count(sliding, 'sliding-window layer')}, {_count(range(reader.kv_heads()), 'KV head')}"
        f" of {reader.head_dim()}."
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
    """Reads a config's attributes, each problem a :class:`KvfsmError` naming the key and the
    config (its model type, and its ``_name_or_path`` when it has one)."""

    def __init__(self, config: Any, model_type: str) -> None:
        found = getattr(config, "model_type", None)
        if found != model_type:
            raise KvfsmError(f"expected a {model_type} config, got model_type {found!r}")
        self.config = config
        self.model_type = model_type
        path = getattr(config, "_name_or_path", None)
        self.label = f"{model_type} config" + (f" {path!r}" if isinstance(path, str) and path
                                               else "")

    def integer(self, key: str) -> int:
        value = getattr(self.config, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvfsmError(f"{self.label}: {key!r} must be an int >= 1, got {value!r}")
        return value

    def kv_heads(self) -> int:
        """``num_key_value_heads``; where the family makes null mean multi-head attention,
        ``num_attention_heads``."""
        if (getattr(self.config, "num_key_value_heads", None) is None
                and self.model_type in _NULL_KV_HEADS):
            return self.integer("num_attention_heads")
        return self.integer("num_key_value_heads")

    def head_dim(self) -> int:
        """``head_dim``; where the family makes null mean ``hidden_size /
        num_attention_heads``, that."""
        if getattr(self.config, "head_dim", None) is None and self.model_type in _NULL_HEAD_DIM:
            hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
            if hidden % heads:
                raise KvfsmError(f"{self.label}: 'head_dim' is null and 'hidden_size' {hidden} "
                                 f"is not a multiple of 'num_attention_heads' {heads}")
            return hidden // heads
        return self.integer("head_dim")

    def layer_types(self) -> list[str]:
        if self.model_type in _INFERRED_LAYER_TYPES:
            return self._inferred_layer_types()
        value = getattr(self.config, "layer_types", None)
        if not isinstance(value, list | tuple) or not value:
            raise KvfsmError(f"{self.label}: 'layer_types' must be a non-empty list, "
                             f"got {value!r}")
        return [str(v) for v in value]

    def _inferred_layer_types(self) -> list[str]:
        """Llama, Mistral: one layer type for every layer, as transformers' cache infers it."""
        windowed = getattr(self.config, "sliding_window", None) is not None
        kind = _SLIDING if windowed else _FULL
        inferred = [kind] * self.integer("num_hidden_layers")
        given = getattr(self.config, "layer_types", None)
        if given is not None and list(given) != inferred:
            rule = ("sliding_window is set: its attention uses it in every layer" if windowed
                    else "its attention is full in every layer")
            raise KvfsmError(
                f"{self.label}: 'layer_types' {sorted({str(t) for t in given})} does not match "
                f"the model: {rule}, so every layer is {kind} (or omit layer_types)")
        return inferred

    def only_layer_types(self, allowed: Sequence[str]) -> None:
        unknown = sorted(set(self.layer_types()) - set(allowed))
        if unknown:
            raise KvfsmError(
                f"{self.label}: layer_types {unknown} not declarable; "
                f"expected {list(allowed)}"
            )

    def layers_of(self, layer_type: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types()) if t == layer_type]

    def rate(self, layer_type: str) -> int:
        rates = getattr(self.config, "compress_rates", None)
        value = rates.get(layer_type) if isinstance(rates, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvfsmError(f"{self.label}: compress_rates[{layer_type!r}] must be "
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


@attrs.frozen
class _Cost:
    """One group's storage: ``payload_bytes`` per block, one block per ``interval`` tokens
    (the checkpoint interval of a recurrent group, the block size of any other)."""

    name: str
    recurrent: bool
    block_size: int
    payload_bytes: int
    interval: int


def _per_token(costs: Sequence[_Cost]) -> Fraction:
    """Bytes the non-recurrent groups store per token of prefix."""
    return sum((Fraction(c.payload_bytes, c.interval) for c in costs if not c.recurrent),
               Fraction(0))


def _even_interval(cost: _Cost, other: Fraction) -> int:
    """The least checkpoint interval (a multiple of the group's block size) at which ``cost``'s
    snapshots store no more bytes per token than ``other``."""
    blocks = math.ceil(Fraction(cost.payload_bytes) / (other * cost.block_size))
    return max(blocks, 1) * cost.block_size


def _size_notes(costs: Sequence[_Cost]) -> list[str]:
    width = max(len(c.name) for c in costs)
    notes = [f"Sizes (float32; a pool slot is a block rounded up to {ALIGNMENT} bytes):"]
    for c in costs:
        head = f"  {c.name:<{width}}  "
        if c.recurrent:
            text = (f"{_bytes(c.payload_bytes)} per snapshot, one every {c.interval} tokens: "
                    f"{_amount(Fraction(c.payload_bytes, c.interval))} bytes per token of prefix.")
        else:
            text = (f"{_bytes(c.payload_bytes)} per block of {c.block_size} tokens: "
                    f"{_amount(Fraction(c.payload_bytes, c.block_size))} bytes per token of "
                    "prefix.")
        notes += _wrap(text, head)
    other = _per_token(costs)
    for c in (c for c in costs if c.recurrent):
        text = (f"Choosing {c.name}'s checkpoint_interval (--checkpoint-interval N, a multiple of "
                f"{c.block_size}): a snapshot every N tokens stores {c.payload_bytes:,} / N bytes "
                "per token of prefix, and a prompt resumes only where a snapshot was taken, so up "
                f"to N of its tokens are recomputed (N = {c.block_size}: at most one block).")
        if other:
            text += (f" An interval of {_even_interval(c, other)} or more stores no more per token "
                     f"than the other groups' {_amount(other)} bytes.")
        notes += _wrap(text)
    return notes


def _bytes(n: int) -> str:
    """``n`` bytes in words: exact, with binary units past a KiB."""
    units = ("KiB", "MiB", "GiB")
    size, unit = float(n), ""
    for name in units:
        if size < 1024:
            break
        size, unit = size / 1024, name
    return f"{n:,} bytes" + (f" ({size:.1f} {unit})" if unit else "")


def _amount(value: Fraction) -> str:
    return f"{int(value):,}" if value.denominator == 1 else f"{float(value):,.1f}"


def _wrap(text: str, head: str = "") -> list[str]:
    return textwrap.wrap(text, _NOTE_WIDTH, initial_indent=head,
                         subsequent_indent=" " * len(head), break_on_hyphens=False)


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
    costs = [_Cost(g.name, g.kind == "recurrent", g.block_size,
                   math.prod(g.shape) * _FLOAT32_BYTES, dict(g.extra).get("checkpoint_interval",
                                                                           g.block_size))
             for g in plan.groups]
    notes = [*plan.notes, "", *_size_notes(costs)]
    lines += ["#", *(f"# {note}".rstrip() for note in notes), ""]
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
