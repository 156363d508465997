"""The stored-tier key of a cache block, from what the core records about it.

A key names the model (declaration and cache namespace), the group, the layout the content was
written under and the chained hash of every token up to the block's end, so a copy written by
another model, another layout or another prefix is never served for this block.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm.state import GroupState, StateCore
from kvfsm.tiers import BlockKey, group_hash, layout_hash, model_digest


@attrs.frozen(eq=False)
class KeyFields:
    """What the keys of a batch of blocks are made of, copied out of the core (so a worker
    thread can build the keys while the core moves on): :meth:`build` makes them."""

    model: bytes
    group: int
    #: Per block: layout hash, chain hash words, first token (``position * block_size``).
    layout: list[int]
    high: list[int]
    low: list[int]
    start: list[int]
    block_size: int

    def __len__(self) -> int:
        return len(self.high)

    def build(self, begin: int = 0, end: int | None = None) -> list[BlockKey]:
        """The keys of blocks ``[begin, end)`` of the batch (any thread)."""
        model, group, size = self.model, self.group, self.block_size
        window = slice(begin, end)
        return [BlockKey(model, group, lay, high, low, start, start + size)
                for lay, high, low, start in zip(self.layout[window], self.high[window],
                                                 self.low[window], self.start[window],
                                                 strict=True)]


class KeyMaker:
    """Keys of one core's blocks (cached per group and layout: a key is a few words)."""

    def __init__(self, core: StateCore) -> None:
        self.core = core
        self.model = model_digest(core.model, core.seed)
        self._groups = {name: group_hash(name) for name in core.groups}
        #: group hash -> group name, to map keys a tier reports back to groups.
        self.group_of = {value: name for name, value in self._groups.items()}
        #: (group, layout id) -> layout hash; a group's layout ids never change meaning (its
        #: layouts only grow).
        self._layouts: dict[tuple[str, int], int] = {}

    def layout_of(self, group: GroupState, layout_id: int) -> int:
        found = self._layouts.get((group.name, layout_id))
        if found is None:
            found = self._layouts[group.name, layout_id] = layout_hash(
                group.decl, group.layouts[layout_id])
        return found

    def fields(self, group: str, ids: NDArray[np.intp]) -> KeyFields:
        """What the keys of blocks ``ids`` of ``group`` are made of, as they are now."""
        state = self.core.group(group)
        size = state.decl.block_size
        layout_ids = state.layout_id[ids]
        if layout_ids.size and int(layout_ids.min()) == int(layout_ids.max()):
            layouts = [self.layout_of(state, int(layout_ids[0]))] * int(ids.size)
        else:
            layouts = [self.layout_of(state, lay) for lay in layout_ids.tolist()]
        return KeyFields(self.model, self._groups[group], layouts, state.hash_high[ids].tolist(),
                         state.hash_low[ids].tolist(),
                         (state.position[ids].astype(np.int64) * size).tolist(), size)

    def keys(self, group: str, ids: NDArray[np.intp]) -> list[BlockKey]:
        """The key of each block ``ids`` of ``group`` (their identities and layouts)."""
        return self.fields(group, ids).build()

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
