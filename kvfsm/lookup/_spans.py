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
    prompt has, with what every "usable at L" evaluation of the group shares computed once."""

    def __init__(self, need: Needed, n: int) -> None:
        #: The prompt's blocks the spans are clipped to.
        self.n = n
        #: ``lo``, ``cut`` and ``hi`` as the kind needs them, not clipped (a block from ``n``
        #: on is missing), as one read-only ``[3, lengths]`` array, and per length whether
        #: the kind can serve it at all (None: every length): what reasons read.
        self.needed = np.stack([need.lo, need.cut, need.hi]).astype(np.int64)
        self.needed.setflags(write=False)
        self.servable = None if need.servable is None else need.servable.astype(np.bool_)
        if self.servable is not None:
            self.servable.setflags(write=False)
        self.hi = np.minimum(need.hi, n)
        self.cut = np.minimum(need.cut, self.hi)
        self.lo = np.minimum(need.lo, self.cut)
        #: Every needed block exists in the prompt (an empty span needs none), and the kind
        #: can serve the length at all.
        inside = (need.hi <= n) | (need.lo >= need.hi)
        self.base: Bools = inside if need.servable is None else inside & need.servable
        self.base.setflags(write=False)
        self.reads_compressed = bool((self.lo < self.cut).any())
        #: ``lo``, ``cut``, ``hi`` and ``base`` (0 or 1) as one read-only ``[4, lengths]``
        #: array: the pass's ``spans`` (rows SPAN_*).
        self.rows = np.stack([self.lo, self.cut, self.hi, self.base]).astype(np.int64)
        self.rows.setflags(write=False)
        # Always so (a fresh stack cast to int64), checked once here: the lookup's first group
        # pass reads the rows through an entry point compiled for this type alone
        # (GroupEval._pass).
        if not (self.rows.ndim == 2 and self.rows.flags.c_contiguous):
            raise AssertionError(f"spans rows of another layout: {self.rows.flags}")
        #: Above 0 where the spans are a raw prefix's (every length served, nothing before
        #: its first block or compressed, ``hi`` this step times the length's index): the
        #: pass computes them instead of reading them.
        self.prefix_step = _prefix_step(self.rows)
        #: ``lo``, ``cut`` and ``hi`` as one read-only ``[3, lengths]`` array.
        self.bounds = self.rows[:3]
        #: Where the group pass's output over these spans puts the block ids, the epochs and
        #: the bytes, and its size (out_offsets).
        self.out_at = out_offsets(n, self.lo.size)
        self.out_size = self.out_at[3]
        #: Where the block ids and the epochs start, and the word counting the blocks from
        #: the first that are one run at one epoch, as an array (a lease's one compiled pass
        #: over every group reads them there).
        self.out_words = np.array((*self.out_at[:2], ONE_RUN_BLOCKS), dtype=np.int64)
        self.out_words.setflags(write=False)


def _prefix_step(rows: NDArray[np.int64]) -> int:
    """The step of ``hi`` where the spans ``rows`` are a raw prefix's (see
    :attr:`Spans.prefix_step`), else 0."""
    lo, cut, hi, base = rows
    if hi.size < 2 or lo.any() or cut.any() or not base.all():
        return 0
    step = int(hi[1])
    if step <= 0 or not np.array_equal(hi, np.arange(hi.size, dtype=np.int64) * step):
        return 0
    return step


def spans_for(group: GroupState, n: int, lengths: NDArray[np.int64], step: int) -> Spans:
    """The group's spans over ``lengths`` (``[0, step, ...]``) for a prompt of ``n`` blocks
    (read-only; a lookup keeps them per prompt length: :meth:`LookupLayout.spans_at`)."""
    spans = Spans(group.rule.needed(group.decl, lengths), n)
    for array in (spans.lo, spans.cut, spans.hi):
        array.setflags(write=False)
    return spans


def usable_at(spans: Spans, ok_raw: Bools, ok_cmp: Bools) -> Bools:
    """Per candidate length: every block the kind needs there is ok in its form: ``ok_cmp``
    over ``[lo, cut)``, ``ok_raw`` over ``[cut, hi)``. O(n + lengths) with prefix sums, exact
    for kinds whose needed blocks are not a prefix (the pass's NumPy twin, for one vector)."""
    return usable_over(spans.lo, spans.cut, spans.hi, spans.base, ok_raw, ok_cmp)
