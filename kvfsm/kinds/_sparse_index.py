"""Sparse routing index: every index block of the prefix, raw, with current references.

Whether each block's references (target block, epoch) still hold is checked by the verdict's
index check; the rule here is the full-attention one plus the reference width.
"""

from __future__ import annotations

import numpy as np

from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import GroupDecl, GroupKind


class SparseIndexRule(KindRule):
    kind = GroupKind.SPARSE_INDEX
    has_targets = True

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        start = np.zeros_like(lengths)
        return Needed(start, start, self.blocks_at(decl, lengths))

    def index_width(self, decl: GroupDecl) -> int:
        return decl.top_k or 0
