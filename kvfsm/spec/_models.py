"""Model declarations: the cache groups a model has, how each block is laid out in memory, and
which lifecycle each group's blocks follow.

This is the unified state-description interface: a model declares its groups in a TOML file under
``specs/models/`` and the library hard-codes none of them. ``_models_loader`` reads and validates
the declarations into these frozen values.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Final

import attrs

# GroupKind lives in the vocabulary because lifecycles carry one too; re-exported for old imports.
from kvfsm.spec._vocabulary import GroupKind as GroupKind

#: Element types a block may hold, with their bytes. Pools hold a block's bytes, never typed
#: elements, so types numpy has no dtype for (bfloat16, the float8 KV cache types) are fine:
#: the dtype names the layout (it is part of every stored copy's layout hash) and sizes it.
ITEMSIZE: Final = MappingProxyType({
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int32": 4, "int8": 1, "uint8": 1,
})
DTYPES: Final = tuple(ITEMSIZE)

#: A compressed block's written sub-blocks are tracked in a 16-bit mask.
MAX_SUB_BLOCKS: Final = 16

#: The largest block (payload plus padding, rounded up to the alignment) a declaration may ask
#: for. Pools allocate whole blocks; a bigger one is a typo in ``shape``, not a cache layout.
MAX_BLOCK_BYTES: Final = 1 << 30


@attrs.frozen
class Layout:
    """How one block sits in memory: the kernel reading it must agree on all three."""

    #: Dimension names, outermost first, including the ``block`` dimension
    #: (``("block", "token", "kv", "head", "dim")`` is block-first, K/V interleaved per token).
    dim_order: tuple[str, ...]
    #: Byte alignment of each block's base address; a power of two.
    alignment: int
    #: Bytes appended after each block's tensor (before rounding up to ``alignment``).
    padding: int


@attrs.frozen
class GroupDecl:
    """One cache group of a model: its kind, lifecycle, block geometry and layout.

    ``shape`` is one block's tensor shape *without* the block dimension. The kind-specific fields
    are None on every other kind.
    """

    name: str
    kind: GroupKind
    #: Name of the lifecycle spec this group's blocks follow.
    lifecycle: str
    #: Tokens one block covers.
    block_size: int
    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    #: sliding_window: tokens of history a query attends to.
    window: int | None = None
    #: compressed: how many sub-blocks one block is written in.
    sub_blocks: int | None = None
    #: sparse_index: the group whose blocks the index points at.
    target_group: str | None = None
    #: sparse_index: pointers stored per query position.
    top_k: int | None = None
    #: recurrent: tokens between snapshots; a multiple of ``block_size``.
    checkpoint_interval: int | None = None

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def payload_bytes(self) -> int:
        """The block's tensor bytes plus its padding."""
        return math.prod(self.shape) * self.itemsize + self.layout.padding

    @property
    def block_bytes(self) -> int:
        """The stride between blocks: the payload rounded up to the alignment, so every block's
        base address stays aligned when blocks sit back to back."""
        return -(-self.payload_bytes // self.layout.alignment) * self.layout.alignment


@attrs.frozen
class ModelDecl:
    """A validated model declaration: its cache groups, in declaration order."""

    name: str
    description: str
    #: Bumped whenever a group's layout changes; stored blocks of another version are not reused.
    layout_version: int
    groups: tuple[GroupDecl, ...]
    #: Where the declaration was read from (a path, or ``<string>``).
    source: str
    #: SHA-256 of the declaration's text.
    spec_hash: str

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(group.name for group in self.groups)

    def group(self, name: str) -> GroupDecl:
        """The group called ``name``; raises ``KeyError`` when there is none."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"{self.name}: no group {name!r}")

    @property
    def lcm_block_size(self) -> int:
        """The least common multiple of the groups' block sizes: a prefix length every group can
        cut at a block boundary."""
        return math.lcm(*(group.block_size for group in self.groups))
