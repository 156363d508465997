"""Compressed history: compressed entries of ``[0, ⌊L/C⌋·C)`` and raw tokens of the rest.

One block covers ``C`` tokens (the compression ratio). At length ``L`` the layer reads the
compressed entries of every full block before ``L`` and the raw tokens since the last
compression boundary, nothing raw at a boundary: exactly what transformers'
``DeepseekV4HCACache`` / ``CSACache`` hold (compressed entries plus the buffer of tokens since
the last full window). The recent raw tokens a layer also attends are its sliding-window
group's, not this group's. A prefill compresses every complete block at once, as the model does.
"""

from __future__ import annotations

import numpy as np

from kvfsm.kinds._rule import KindRule, Lengths, Needed
from kvfsm.spec import Event, Form, GroupDecl, GroupKind


class CompressedRule(KindRule):
    kind = GroupKind.COMPRESSED
    settled_form = Form.COMPRESSED
    settle_events = (Event.COMPRESS_BEGIN, Event.COMPRESS_DONE)

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        size = decl.block_size
        boundary = lengths // size
        # The raw tokens after the last boundary live in the block that starts there, which a
        # prompt reaches only complete (a block is hashed whole).
        tail_end = -(-lengths // size)
        return Needed(np.zeros_like(lengths), boundary, tail_end)
