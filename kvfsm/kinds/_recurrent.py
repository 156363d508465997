"""Recurrent state: one snapshot taken exactly at ``L``, only at checkpoint lengths.

A recurrent layer's state after ``L`` tokens summarizes all of them; a snapshot of any other
length continues into wrong outputs, so only the block ending at ``L`` is needed, and only at
multiples of the checkpoint interval (SGLang keeps Mamba state at checkpoints the same way).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import GroupDecl, GroupKind


class RecurrentRule(KindRule):
    kind = GroupKind.RECURRENT
    unservable = Reason.NO_CHECKPOINT
    prefix_hit = False

    @staticmethod
    def interval(decl: GroupDecl) -> int:
        return decl.checkpoint_interval or decl.block_size

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        end = self.blocks_at(decl, lengths)
        last = np.maximum(end - 1, 0)
        return Needed(last, last, end, servable=lengths % self.interval(decl) == 0)

    def unservable_detail(self, decl: GroupDecl, length: int) -> str:
        return f"snapshots every {self.interval(decl)} tokens; none at {length}"

    def commit_blocks(self, decl: GroupDecl, n_blocks: int) -> NDArray[np.int64]:
        index = np.arange(n_blocks, dtype=np.int64)
        kept: NDArray[np.int64] = index[(index + 1) * decl.block_size % self.interval(decl) == 0]
        return kept
