"""A kind's needed block spans at every candidate length of a prompt (:class:`Spans`), shared
between lookups of the same prompt length (:func:`spans_for`), and "usable at L" over them.
"""
from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm.kinds import Needed
from kvfsm.lookup._buffers import ONE_RUN_BLOCKS, out_offsets
from kvfsm.lookup._group_pass import usable_over
from kvfsm.state import GroupState

Bools = NDArray[np.bool_]


class Spans:
    """A kind's needed block spans at every candidate length, clipped to the ``n`` blocks the
    prompt has; read-only, shared by every lookup of the prompt length."""

    def __init__(self, need: Needed, n: int) -> None:
        self.n = n
        #: ``lo``, ``cut`` and ``hi`` unclipped (a block from ``n`` on is missing), and per
        #: length whether the kind can serve it (None: every length): what reasons read.
        self.needed = np.stack([need.lo, need.cut, need.hi]).astype(np.int64)
        self.needed.setflags(write=False)
        self.servable = None if need.servable is None else need.servable.astype(np.bool_)
        if self.servable is not None:
            self.servable.setflags(write=False)
        self.hi = np.minimum(need.hi, n)
        self.cut = np.minimum(need.cut, self.hi)
        self.lo = np.minimum(need.lo, self.cut)
        #: Every needed block exists in the prompt, and the kind can serve the length.
        inside = (need.hi <= n) | (need.lo >= need.hi)
        self.base: Bools = inside if need.servable is None else inside & need.servable
        self.base.setflags(write=False)
        self.reads_compressed = bool((self.lo < self.cut).any())
        #: The pass's ``spans`` (rows SPAN_*).
        self.rows = np.stack([self.lo, self.cut, self.hi, self.base]).astype(np.int64)
        self.rows.setflags(write=False)
        # The group pass reads the rows through an entry point compiled for this layout alone.
        if not (self.rows.ndim == 2 and self.rows.flags.c_contiguous):
            raise AssertionError(f"spans rows of another layout: {self.rows.flags}")
        #: Above 0 where the spans are a raw prefix's (``hi`` this step times the length's
        #: index): the pass computes them.
        self.prefix_step = _prefix_step(self.rows)
        self.bounds = self.rows[:3]
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


def spans_for(group: GroupState, n: int, lengths: NDArray[np.int64], step: int) -> Spans:
    """The group's read-only spans over ``lengths`` for a prompt of ``n`` blocks."""
    spans = Spans(group.rule.needed(group.decl, lengths), n)
    for array in (spans.lo, spans.cut, spans.hi):
        array.setflags(write=False)
    return spans


def usable_at(spans: Spans, ok_raw: Bools, ok_cmp: Bools) -> Bools:
    """Per candidate length: every block the kind needs there is ok in its form: ``ok_cmp``
    over ``[lo, cut)``, ``ok_raw`` over ``[cut, hi)``."""
    return usable_over(spans.lo, spans.cut, spans.hi, spans.base, ok_raw, ok_cmp)
