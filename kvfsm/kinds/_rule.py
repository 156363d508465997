"""What one kind of cache object needs at a prefix length, as data a lookup and a commit use.

A kind's whole rule is which of the prompt's blocks must be readable, and in which form, for the
prefix ``[0, L)`` to be reusable, for every candidate ``L`` at once: the blocks ``[lo, cut)`` in
compressed form and ``[cut, hi)`` in raw form, at lengths the kind can serve at all. Everything
else (the AND across groups, reasons, restore plans) is generic and lives in the verdict.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.spec import Event, Form, GroupDecl, GroupKind

Lengths = NDArray[np.int64]


@attrs.frozen
class Needed:
    """Per candidate length ``L``: blocks ``[lo, cut)`` needed compressed, ``[cut, hi)`` raw.

    ``servable`` is False at lengths the kind cannot serve whatever its blocks (a recurrent
    group between snapshots); None means every length.
    """

    lo: Lengths
    cut: Lengths
    hi: Lengths
    servable: NDArray[np.bool_] | None = None


class KindRule:
    """The rule of one kind. Subclasses set the class attributes and override :meth:`needed`."""

    kind: ClassVar[GroupKind]
    #: Why a needed block that is not in the hash map fails.
    missing: ClassVar[Reason] = Reason.NOT_CACHED
    #: Why a length the kind cannot serve fails (only kinds with ``servable``).
    unservable: ClassVar[Reason | None] = None
    #: The hit is a contiguous prefix of blocks (what the LCM cut of lengths explains).
    prefix_hit: ClassVar[bool] = True
    #: The form a complete block of this kind settles in; an index pointing at a block that
    #: must still move to it (an epoch bump) will go stale.
    settled_form: ClassVar[Form] = Form.RAW
    #: Events a prefill fires, in order, on the prompt's complete blocks after writing them
    #: (on those whose state has a row for the event).
    settle_events: ClassVar[tuple[Event, ...]] = ()
    #: Blocks of this kind point at blocks of another group (``decl.target_group``).
    has_targets: ClassVar[bool] = False

    def needed(self, decl: GroupDecl, lengths: Lengths) -> Needed:
        """Which blocks each candidate length needs, in which form."""
        raise NotImplementedError

    def unservable_detail(self, decl: GroupDecl, length: int) -> str:
        """Why ``length`` cannot be served whatever the blocks (kinds with ``servable``)."""
        return ""

    def commit_blocks(self, decl: GroupDecl, n_blocks: int) -> NDArray[np.int64]:
        """Indices of the prompt's complete blocks a prefill keeps (all, by default)."""
        return np.arange(n_blocks, dtype=np.int64)

    def index_width(self, decl: GroupDecl) -> int:
        """References per block to another group's blocks (0: none)."""
        return 0

    def blocks_at(self, decl: GroupDecl, lengths: Lengths) -> Lengths:
        """Complete blocks inside each length."""
        out: Lengths = lengths // decl.block_size
        return out
