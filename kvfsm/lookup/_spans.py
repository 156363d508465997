"""A kind's needed block spans at every candidate length, shared by lookups of one prompt length."""
from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm.kinds import Needed
from kvfsm.lookup._buffers import ONE_RUN_BLOCKS, out_offsets
from kvfsm.state import GroupState

Bools = NDArray[np.bool_]


class Spans:
    """The spans clipped to the prompt's ``n`` blocks; read-only."""

    def __init__(self, need: Needed, n: int) -> None:
        self.n = n
        #: ``lo``, ``cut`` and ``hi`` unclipped (a block from ``n`` on is missing), and per
        #: length whether the kind can serve it (None: every length): what reasons read.
        self.needed = np.stack([need.lo, need.cut, need.hi]).astype(np.int64)
        self.needed.setflags(write=False)
        self.servable = None if need.servable is None else need.servable.astype(np.bool_)
        if self.servable is not None:
            self.servable.setflags(write=False)
        hi = np.minimum(need.hi, n)
        cut = np.minimum(need.cut, hi)
        #: Every needed block exists in the prompt, and the kind can serve the length.
        inside = (need.hi <= n) | (need.lo >= need.hi)
        self.base: Bools = inside if need.servable is None else inside & need.servable
        self.base.setflags(write=False)
        #: The pass's ``spans`` (rows SPAN_*); ``lo``, ``cut`` and ``hi`` are its first rows.
        self.rows = np.stack([np.minimum(need.lo, cut), cut, hi, self.base]).astype(np.int64)
        self.rows.setflags(write=False)
        self.lo, self.cut, self.hi = self.bounds = self.rows[:3]
        #: ``step`` where ``hi[k] == k * step`` (a raw prefix: the pass derives the rows), else 0.
        self.prefix_step = _prefix_step(self.rows)
        self.out_at = out_offsets(n, self.lo.size)
        self.out_size = self.out_at[3]
        #: The word offsets of the ids, the epochs and ONE_RUN_BLOCKS, for a lease's take.
        self.out_words = np.array((*self.out_at[:2], ONE_RUN_BLOCKS), dtype=np.int64)
        self.out_words.setflags(write=False)


def _prefix_step(rows: NDArray[np.int64]) -> int:
    """:attr:`Spans.prefix_step` of ``rows``."""
    lo, cut, hi, base = rows
    if hi.size < 2 or lo.any() or cut.any() or not base.all():
        return 0
    step = int(hi[1])
    if step <= 0 or not np.array_equal(hi, np.arange(hi.size, dtype=np.int64) * step):
        return 0
    return step


def spans_for(group: GroupState, n: int, lengths: NDArray[np.int64]) -> Spans:
    """The group's read-only spans over ``lengths`` for a prompt of ``n`` blocks."""
    return Spans(group.rule.needed(group.decl, lengths), n)
