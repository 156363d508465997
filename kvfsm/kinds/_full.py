"""Full attention: every block of the prefix, raw (vLLM's full-attention manager)."""

from __future__ import annotations

import numpy as np

from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import GroupDecl, GroupKind


class FullRule(KindRule):
    kind = GroupKind.FULL

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        start = np.zeros_like(lengths)
        return Needed(start, start, self.blocks_at(decl, lengths))
