"""Why blocks are not usable: the reasons of many failing blocks of one group at once. Each
block's reason is the first check it fails, in layer order (found, placed, whole, the index's
references, what its state allows in the needed form, layout, alignment, checksum); a verdict
lists, per group and reason, the first :data:`MAX_LISTED`."""

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
    at = np.minimum(index, n - 1)  # from ``n`` on: the last block's facts (missing anyway)
    block_facts = facts[at]
    missing_now = (index >= n) | (block_facts & FOUND == 0)
    codes = np.where(missing_now, CODE[missing], 0).astype(np.int16)
    block_states = states[at]  # 0 where missing: read only for found blocks
    in_flight = table.in_flight[block_states]
    unreadable = block_facts & READABLE == 0
    form = paths.form[block_states]
    not_compressed = compressed & (form != COMPRESSED)
    checks: list[tuple[Bools, Reason]] = [
        (block_facts & PLACED == 0, Reason.POSITION_CONFLICT),
        (block_facts & WHOLE == 0, Reason.SUB_BLOCKS_MISSING)]
    if fit is not None and stale is not None:
        checks += [(~fit[at] & stale[at], Reason.INDEX_STALE), (~fit[at], Reason.GROUP_GAP)]
    checks += [
        (unreadable & in_flight, Reason.RESTORE_IN_FLIGHT),
        (unreadable & (table.residency[block_states] > int(Tier.DEVICE)), Reason.NOT_RESIDENT),
        (unreadable, Reason.NOT_CACHED),
        (not_compressed & in_flight, Reason.MID_COMPRESSION),
        (not_compressed, Reason.COMPRESSED_INCOMPLETE),
        (~compressed & (form != RAW), Reason.TAIL_MISSING),
        (block_facts & LAYOUT == 0, Reason.LAYOUT_MISMATCH)]
    if align_ok is not None:
        checks.append((~align_ok[at], Reason.MISALIGNED))
    if checksum_ok is not None:
        checks.append((~checksum_ok[at], Reason.CHECKSUM_MISMATCH))
    elif failed_checks is not None:  # seen failing before
        checks.append((failed_checks[at], Reason.CHECKSUM_MISMATCH))
    pending = ~missing_now  # blocks no check has named yet: each keeps its first
    for fails, reason in checks:
        named = pending & fails
        codes[named] = CODE[reason]
        pending &= ~named
    return codes


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
