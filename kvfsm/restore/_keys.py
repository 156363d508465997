"""The stored-tier key of a cache block, from what the core records about it.

A key names the model (declaration and cache namespace), the group, the layout the content was
written under and the chained hash of every token up to the block's end, so a copy written by
another model, another layout or another prefix is never served for this block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from kvfsm.state import GroupState, StateCore
from kvfsm.tiers import BlockKey, group_hash, layout_hash, model_digest


class KeyMaker:
    """Keys of one core's blocks (cached per group and layout: a key is a few words)."""

    def __init__(self, core: StateCore) -> None:
        self.core = core
        self.model = model_digest(core.model, core.seed)
        self._groups = {name: group_hash(name) for name in core.groups}
        #: group hash -> group name, to map keys a tier reports back to groups.
        self.group_of = {value: name for name, value in self._groups.items()}

    def layout_of(self, group: GroupState, layout_id: int) -> int:
        return layout_hash(group.decl, group.layouts[layout_id])

    def keys(self, group: str, ids: NDArray[np.intp]) -> list[BlockKey]:
        """The key of each block ``ids`` of ``group`` (their identities and layouts)."""
        state = self.core.group(group)
        named = self._groups[group]
        size = state.decl.block_size
        layouts = [self.layout_of(state, i) for i in range(len(state.layouts))]
        return [BlockKey(self.model, named, layouts[lay], high, low, pos * size, (pos + 1) * size)
                for high, low, pos, lay in zip(
                    state.hash_high[ids].tolist(), state.hash_low[ids].tolist(),
                    state.position[ids].tolist(), state.layout_id[ids].tolist(), strict=True)]

    def prompt_keys(self, group: str, high: NDArray[np.uint64], low: NDArray[np.uint64],
                    positions: Sequence[int] | NDArray[np.int64]) -> list[BlockKey]:
        """Keys of a prompt's blocks at ``positions`` under the group's current write layout
        (what a lookup asks stored tiers for)."""
        state = self.core.group(group)
        layout = self.layout_of(state, state.write_layout)
        size = state.decl.block_size
        named = self._groups[group]
        return [BlockKey(self.model, named, layout, int(high[p]), int(low[p]), int(p) * size,
                         (int(p) + 1) * size) for p in positions]
