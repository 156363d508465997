"""One byte of facts per block of a prompt, read from the group's metadata in one pass.

The per-block checks that need only the block's own metadata (found by hash, recorded at this
position, every sub-block written, written under the layout the kernel reads) and what its
lifecycle state allows (readable raw or compressed now, reachable in either form by a restore
path) are packed into the bits below, so a lookup gathers each metadata array once and derives
its usable masks from one array with one or two operations each.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.state import GroupState
from kvfsm.verify._paths import (
    REACHES_COMPRESSED,
    REACHES_RAW,
    READABLE_COMPRESSED,
    READABLE_RAW,
)

Facts = NDArray[np.uint8]
IdArray = NDArray[np.intp]

#: The block's hash is in the map (every other bit is clear without it).
FOUND = 1
#: Layer 3, position: the block found by hash is recorded at the position this prompt needs.
PLACED = 2
#: Layer 1, integrity: every sub-block is written.
WHOLE = 4
#: Layer 2, kernel interface: written under the layout the reading kernel declares.
LAYOUT = 8
#: The restore-path code of the block's state (``RestorePaths.code``), shifted above.
CODE_SHIFT = 4
READ_RAW = READABLE_RAW << CODE_SHIFT
READ_COMPRESSED = READABLE_COMPRESSED << CODE_SHIFT
TO_RAW = REACHES_RAW << CODE_SHIFT
TO_COMPRESSED = REACHES_COMPRESSED << CODE_SHIFT
READABLE = READ_RAW | READ_COMPRESSED
#: Every metadata check passed (the state's form is checked separately).
SOUND = FOUND | PLACED | WHOLE | LAYOUT


def _facts_example() -> tuple[object, ...]:
    # The machine's state view and the group's metadata arrays are read-only views.
    states, position = read_only(np.zeros(1, dtype=np.uint8)), read_only(np.zeros(1, np.int32))
    sub_blocks, layout_id = read_only(np.zeros(1, np.uint16)), read_only(np.zeros(1, np.uint8))
    return (np.full(1, -1, dtype=np.intp), states, position, sub_blocks, 1, layout_id,
            np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.uint8), np.empty(1, dtype=np.uint8))


def _facts_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Metadata of a small group drawn freely (positions, sub-block masks and layout ids that
    match and that do not), prompt ids with missing blocks (-1), and random per-layout verdicts
    and per-state restore codes."""
    n_blocks, n_states, n_layouts = (int(rng.integers(1, high)) for high in (13, 6, 4))
    n = int(rng.integers(0, 11))
    return (rng.integers(-1, n_blocks, n).astype(np.intp),
            read_only(rng.integers(0, n_states, n_blocks).astype(np.uint8)),
            read_only(rng.integers(-1, 9, n_blocks).astype(np.int32)),
            read_only(rng.integers(0, 4, n_blocks).astype(np.uint16)), int(rng.choice([1, 3])),
            read_only(rng.integers(0, n_layouts, n_blocks).astype(np.uint8)),
            rng.random(n_layouts) < 0.5, rng.integers(0, 16, n_states).astype(np.uint8),
            np.full(n, 0xAA, dtype=np.uint8))


def _facts_twin(ids: IdArray, states: NDArray[np.uint8], position: NDArray[np.int32],
                sub_blocks: NDArray[np.uint16], full_sub_mask: int,
                layout_id: NDArray[np.uint8], layout_ok: NDArray[np.bool_],
                code: NDArray[np.uint8], out: Facts) -> None:
    """:func:`block_facts_kernel` as array operations over every block at once."""
    found = ids >= 0
    safe = np.where(found, ids, 0)
    out[:] = code[states[safe]] << CODE_SHIFT
    out |= FOUND
    out[position[safe] == np.arange(ids.size)] |= PLACED
    out[sub_blocks[safe] == full_sub_mask] |= WHOLE
    out[layout_ok[layout_id[safe]]] |= LAYOUT
    out[~found] = 0


@kernel(example=_facts_example, twin=_facts_twin, inputs=_facts_inputs)
def block_facts_kernel(ids: IdArray, states: NDArray[np.uint8], position: NDArray[np.int32],
                       sub_blocks: NDArray[np.uint16], full_sub_mask: int,
                       layout_id: NDArray[np.uint8], layout_ok: NDArray[np.bool_],
                       code: NDArray[np.uint8], out: Facts) -> None:
    """``out[i]``: the fact bits of block ``ids[i]`` at prompt position ``i`` (0 when -1)."""
    for i in range(ids.size):
        block = ids[i]
        if block < 0:
            out[i] = 0
            continue
        facts = FOUND | (code[states[block]] << CODE_SHIFT)
        if position[block] == i:
            facts |= PLACED
        if sub_blocks[block] == full_sub_mask:
            facts |= WHOLE
        if layout_ok[layout_id[block]]:
            facts |= LAYOUT
        out[i] = facts


def block_facts(group: GroupState, ids: IdArray, layout_ok: NDArray[np.bool_],
                code: NDArray[np.uint8]) -> Facts:
    """The fact bits of each block ``ids[i]`` (-1: not found) at prompt position ``i``, given
    per layout id whether the reading kernel accepts it and per state its restore-path code."""
    out = np.empty(ids.size, dtype=np.uint8)
    block_facts_kernel(ids, group.states, group.position, group.sub_blocks,
                       group.full_sub_mask, group.layout_id, layout_ok, code, out)
    return out
