"""Why blocks are not usable: the reasons of many failing blocks of one group at once.

Each block's reason is the first check it fails, in layer order (found, placed, whole, the
index's references, what its state allows in the needed form, layout, alignment, checksum),
applied here to every failing block together; a verdict lists, per group and reason, the
first :data:`MAX_LISTED`.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import MAX_LISTED as MAX_LISTED
from kvfsm._reasons import Reason
from kvfsm.fsm import FORM_COMPRESSED as COMPRESSED
from kvfsm.fsm import FORM_RAW as RAW
from kvfsm.fsm import CompiledTable
from kvfsm.lookup._block_facts import FOUND, LAYOUT, PLACED, READABLE, WHOLE
from kvfsm.lookup._paths import RestorePaths
from kvfsm.spec import Tier

Bools = NDArray[np.bool_]
Codes = NDArray[np.int16]


#: A reason's code is its position here; code 0: the block is usable in the needed form.
BY_CODE: Final[tuple[Reason | None, ...]] = (None, *Reason)
CODE: Final[dict[Reason | None, int]] = {reason: code for code, reason in enumerate(BY_CODE)}


class _Classes:
    """Codes of one batch of blocks, filled check by check: a block keeps the code of the
    first check it fails (``pending``: not named by any check yet)."""

    __slots__ = ("codes", "pending")

    def __init__(self, codes: Codes, pending: Bools) -> None:
        self.codes = codes
        self.pending = pending

    def name(self, fails: Bools, reason: Reason | None) -> bool:
        """Blocks still pending that fail ``fails`` get ``reason``; whether any is left."""
        named = self.pending & fails
        self.codes[named] = CODE[reason]
        self.pending &= ~named
        return bool(self.pending.any())


def reason_codes(
    index: NDArray[np.int64],
    compressed: Bools,
    *,
    n: int,
    facts: NDArray[np.uint8],
    states: NDArray[np.uint8],
    table: CompiledTable,
    paths: RestorePaths,
    missing: Reason | None,
    fit: Bools | None,
    stale: Bools | None,
    align_ok: Bools | None,
    checksum_ok: Bools | None,
    failed_checks: Bools | None,
) -> Codes:
    """Per block ``index[i]`` of the prompt (needed compressed where ``compressed[i]``), the
    code (:data:`BY_CODE`) of the first check it fails, 0 where it passes every one. An index
    from ``n`` on is missing; None for ``fit``/``stale`` (no index), ``align_ok``,
    ``checksum_ok`` or ``failed_checks`` skips that check."""
    if not index.size or not n:  # none, or every one missing
        return np.full(index.size, CODE[missing], dtype=np.int16)
    # A block from ``n`` on reads the last block's facts, and is missing anyway.
    at = np.minimum(index, n - 1)
    block_facts = facts[at]
    missing_now = (index >= n) | (block_facts & FOUND == 0)
    classes = _Classes(np.where(missing_now, CODE[missing], 0).astype(np.int16), ~missing_now)
    if not classes.pending.any():
        return classes.codes
    if not classes.name(block_facts & PLACED == 0, Reason.POSITION_CONFLICT):
        return classes.codes
    if not classes.name(block_facts & WHOLE == 0, Reason.SUB_BLOCKS_MISSING):
        return classes.codes
    if fit is not None and stale is not None:
        unfit = ~fit[at]
        classes.name(unfit & stale[at], Reason.INDEX_STALE)
        if not classes.name(unfit, Reason.GROUP_GAP):
            return classes.codes
    # Only found blocks are left: their states are real.
    block_states = states[at]
    in_flight = table.in_flight[block_states]
    unreadable = block_facts & READABLE == 0
    if not (classes.name(unreadable & in_flight, Reason.RESTORE_IN_FLIGHT)
            and classes.name(unreadable & (table.residency[block_states] > int(Tier.DEVICE)),
                             Reason.NOT_RESIDENT)
            and classes.name(unreadable, Reason.NOT_CACHED)):
        return classes.codes
    form = paths.form[block_states]
    not_compressed = compressed & (form != COMPRESSED)
    if not (classes.name(not_compressed & in_flight, Reason.MID_COMPRESSION)
            and classes.name(not_compressed, Reason.COMPRESSED_INCOMPLETE)
            and classes.name(~compressed & (form != RAW), Reason.TAIL_MISSING)
            and classes.name(block_facts & LAYOUT == 0, Reason.LAYOUT_MISMATCH)):
        return classes.codes
    if align_ok is not None and not classes.name(~align_ok[at], Reason.MISALIGNED):
        return classes.codes
    if checksum_ok is not None:
        classes.name(~checksum_ok[at], Reason.CHECKSUM_MISMATCH)
    elif failed_checks is not None:
        classes.name(failed_checks[at], Reason.CHECKSUM_MISMATCH)  # seen failing before
    return classes.codes


def listed(codes: Codes, limit: int = MAX_LISTED) -> NDArray[np.intp]:
    """Positions, in order, of the first ``limit`` blocks of each reason (code 0 never)."""
    size = codes.size
    if not size or bool((codes == codes[0]).all()):  # one reason (a miss): no sort
        return np.arange(min(size, limit) if size and codes[0] else 0)
    order = np.argsort(codes, kind="stable")  # by reason, each in block order
    by_reason = codes[order]
    starts = np.flatnonzero(np.concatenate(([True], by_reason[1:] != by_reason[:-1])))
    rank = np.arange(size) - np.repeat(starts, np.diff(np.append(starts, size)))
    return np.sort(order[(rank < limit) & (by_reason != 0)])
