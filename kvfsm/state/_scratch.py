"""Working arrays for set operations on block ids in O(ids), with no sort.

Pinning a batch of index blocks pins their targets once per reference, and the targets of
neighbouring index blocks overlap almost entirely (each points at the recent history): a
131 072-token prompt pins some 65 000 references onto 2 000 history blocks. Distinct ids, counts
of repeats and set differences over such batches are a scatter and a gather into an array of
one entry per block, instead of a sort. These arrays are working memory, not metadata: nothing
is kept in them between calls, one set serves every group of a core (sized for the largest),
and they are allocated on first use, so a core that never pins repeated ids never pays for
them. Callers hold the engine's lock (one operation at a time).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

IdArray = NDArray[np.intp]


class Scratch:
    """Scratch arrays for ids in ``[0, n)``: positions, counts (all zero between calls) and
    marks (all False between calls)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._at: NDArray[np.int32] | None = None
        self._count: NDArray[np.int32] | None = None
        self._mark: NDArray[np.bool_] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated so far (0 until first used)."""
        return sum(a.nbytes for a in (self._at, self._count, self._mark) if a is not None)

    def distinct(self, ids: IdArray) -> IdArray:
        """``ids`` without repeats, each kept at its last occurrence."""
        if ids.size < 2:
            return ids
        if self._at is None:
            self._at = np.zeros(self.n, dtype=np.int32)
        order = np.arange(ids.size, dtype=np.int32)
        self._at[ids] = order  # the last write of each id wins
        kept: IdArray = ids[self._at[ids] == order]
        return kept

    def repeats(self, ids: IdArray) -> tuple[IdArray, NDArray[np.int32]]:
        """The distinct ``ids`` and how often each occurs."""
        touched = self.distinct(ids)
        if self._count is None:
            self._count = np.zeros(self.n, dtype=np.int32)
        np.add.at(self._count, ids, np.int32(1))  # same dtype: numpy's fast path
        held = self._count[touched].copy()
        self._count[touched] = 0
        return touched, held

    def marks(self) -> NDArray[np.bool_]:
        """The marks array (all False): a caller sets entries, uses them and clears exactly
        those before it returns (holding the engine's lock)."""
        if self._mark is None:
            self._mark = np.zeros(self.n, dtype=np.bool_)
        return self._mark

    def without(self, ids: IdArray, drop: IdArray) -> IdArray:
        """``ids`` less those in ``drop``."""
        if self._mark is None:
            self._mark = np.zeros(self.n, dtype=np.bool_)
        self._mark[drop] = True
        kept: IdArray = ids[~self._mark[ids]]
        self._mark[drop] = False
        return kept
