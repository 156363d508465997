"""Sliding window of ``W`` tokens: the blocks overlapping ``[L-(W-1), L)``, raw.

The token at ``L`` is the W-th of its window, so the cache must hold the ``W-1`` before it:
vLLM's sliding-window manager and transformers' ``DynamicSlidingWindowLayer`` keep exactly
those. Blocks before the window are not needed, so the hit is not a prefix of blocks.
"""

from __future__ import annotations

import numpy as np

from kvfsm._reasons import Reason
from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import GroupDecl, GroupKind


class SlidingWindowRule(KindRule):
    kind = GroupKind.SLIDING_WINDOW
    missing = Reason.WINDOW_MISMATCH
    prefix_hit = False

    def window_start(self, decl: GroupDecl, lengths: Lengths) -> Lengths:
        """First block holding a token of ``[L-(W-1), L)``."""
        window = decl.window or 1
        start: Lengths = np.maximum(lengths - (window - 1), 0) // decl.block_size
        return start

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        start = self.window_start(decl, lengths)
        return Needed(start, start, self.blocks_at(decl, lengths))
