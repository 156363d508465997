"""A kvfsm model declaration read off vLLM's ``KVCacheConfig``: one kvfsm group per vLLM KV
cache group, of the kind that group's spec says.

Duck-typed on the spec's class name and fields, so this module imports no vLLM. The payload of
a block is the block's page in every layer of the group, one after another in the group's layer
order (each page: token, K/V, head, dim for attention; the state's elements for Mamba): what the
connector's worker side reads out of vLLM's KV tensors after a forward and copies back into
them on a load."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from kvfsm._errors import KvfsmError
from kvfsm.spec import GroupKind, ModelDecl, parse_model
from kvfsm.spec._models import ITEMSIZE

#: Bytes a page is aligned to in kvfsm's pools (the default device profile's base alignment).
PAGE_ALIGNMENT = 256
#: Spec class names read as each kvfsm kind (MLA and chunked-local specs are not mapped yet).
FULL_SPECS = frozenset({"FullAttentionSpec"})
SLIDING_SPECS = frozenset({"SlidingWindowSpec"})
MAMBA_SPECS = frozenset({"MambaSpec"})
#: kvfsm's dtype name of each torch dtype a page may hold.
DTYPE_NAMES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16",
               "torch.float32": "float32"}
#: Lifecycle of each kind in the shipped specs.
LIFECYCLE_OF = {GroupKind.FULL: "full_kv", GroupKind.SLIDING_WINDOW: "sliding_window",
                GroupKind.RECURRENT: "recurrent"}


class UnsupportedSpecError(KvfsmError):
    """A vLLM KV cache group whose spec kvfsm has no kind for."""


@attrs.frozen
class GroupMap:
    """vLLM KV cache group ``index`` is kvfsm group ``name`` of ``kind``."""

    index: int
    name: str
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]


def group_name(index: int) -> str:
    """kvfsm's name of vLLM KV cache group ``index``."""
    return f"g{index}"


def _dtype(value: object, where: str) -> str:
    name = DTYPE_NAMES.get(str(value))
    if name is None:
        raise UnsupportedSpecError(f"{where}: dtype {value} has no kvfsm name "
                                   f"(supported: {sorted(DTYPE_NAMES)})")
    return name


def _group_toml(index: int, spec: Any, layers: int) -> tuple[GroupKind, str]:
    """The kind of vLLM group ``index`` (of ``layers`` layers) and its ``[[groups]]`` TOML."""
    where = f"vLLM KV cache group {index} ({type(spec).__name__})"
    kind_name = type(spec).__name__
    block = int(spec.block_size)
    extra = ""
    if kind_name in FULL_SPECS or kind_name in SLIDING_SPECS:
        kind = GroupKind.FULL if kind_name in FULL_SPECS else GroupKind.SLIDING_WINDOW
        if kind is GroupKind.FULL and getattr(spec, "sliding_window", None):
            raise UnsupportedSpecError(f"{where}: a full-attention spec with a sliding window")
        shape = [layers, block, 2, int(spec.num_kv_heads), int(spec.head_size)]
        dims = '["block", "layer", "token", "kv", "head", "dim"]'
        dtype = _dtype(spec.dtype, where)
        if kind is GroupKind.SLIDING_WINDOW:
            extra = f"window = {int(spec.sliding_window)}\n"
    elif kind_name in MAMBA_SPECS:
        kind = GroupKind.RECURRENT
        dtypes = [_dtype(d, where) for d in spec.dtypes]
        # The states packed one after another, as one vector per checkpoint: of their element
        # type, or of bytes where the states differ (Qwen3-Next on CPU: a bfloat16 conv state,
        # a float32 SSM state).
        dims = '["block", "layer", "state"]'
        if len(set(dtypes)) == 1:
            shape = [layers, sum(math.prod(s) for s in spec.shapes)]
            dtype = dtypes[0]
        else:
            shape = [layers, sum(math.prod(s) * ITEMSIZE[d]
                                 for s, d in zip(spec.shapes, dtypes, strict=True))]
            dtype = "uint8"
        # vLLM's align mode keeps a state at block boundaries: one checkpoint per block.
        extra = f"checkpoint_interval = {block}\n"
    else:
        raise UnsupportedSpecError(f"{where}: no kvfsm kind for this spec (supported: "
                                   f"{sorted(FULL_SPECS | SLIDING_SPECS | MAMBA_SPECS)})")
    text = (f'[[groups]]\nname = "{group_name(index)}"\nkind = "{kind.value}"\n'
            f'lifecycle = "{LIFECYCLE_OF[kind]}"\nblock_size = {block}\n'
            f"shape = {shape}\ndtype = \"{dtype}\"\n{extra}"
            f"[groups.layout]\ndim_order = {dims}\nalignment = {PAGE_ALIGNMENT}\n"
            "padding = 0\n")
    return kind, text


def declare(kv_cache_config: Any, *, name: str = "vllm") -> tuple[ModelDecl, tuple[GroupMap, ...]]:
    """kvfsm's declaration of the model vLLM's ``kv_cache_config`` describes, and how its
    groups map; a spec kvfsm has no kind for is an :class:`UnsupportedSpecError`."""
    parts: list[str] = []
    maps: list[GroupMap] = []
    groups: Sequence[Any] = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedSpecError("vLLM KV cache config has no KV cache groups")
    for index, group in enumerate(groups):
        if not group.layer_names:
            raise UnsupportedSpecError(f"vLLM KV cache group {index} has no layers")
        kind, text = _group_toml(index, group.kv_cache_spec, len(group.layer_names))
        parts.append(text)
        maps.append(GroupMap(index, group_name(index), kind,
                             int(group.kv_cache_spec.block_size), tuple(group.layer_names)))
    header = (f'[model]\nname = "{name}"\ndescription = "vLLM KV cache groups"\n'
              "layout_version = 1\n")
    decl = parse_model(header + "\n".join(parts), source=f"<vLLM KV cache config of {name}>")
    return decl, tuple(maps)
