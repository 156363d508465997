"""The reference rule of why one block is not usable (the oracle :meth:`PassOutput.reason_codes`
is held to): the first check it fails, in layer order, one block at a time."""

from __future__ import annotations

from kvfsm.fsm import FORM_COMPRESSED as COMPRESSED
from kvfsm.fsm import FORM_RAW as RAW
from kvfsm.lookup import Reason
from kvfsm.lookup._block_facts import FOUND, LAYOUT, PLACED, READABLE, WHOLE
from kvfsm.lookup._pass_output import PassOutput
from kvfsm.spec import Tier


def block_reason(e: PassOutput, index: int, compressed: bool) -> Reason | None:
    """Why prompt block ``index`` of ``e``'s group is not usable now, needed compressed or
    raw (None when it is)."""
    if index >= e.n:
        return e.missing_reason()
    facts = int(e.facts[index])
    if not facts & FOUND:
        return e.missing_reason()
    if not facts & PLACED:
        return Reason.POSITION_CONFLICT
    if not facts & WHOLE:
        return Reason.SUB_BLOCKS_MISSING
    frozen = e.frozen()
    fit = e.fit
    if frozen.stale is not None and fit is not None and not fit[index]:
        return Reason.INDEX_STALE if frozen.stale[index] else Reason.GROUP_GAP
    table = frozen.table
    state = int(frozen.states[index])
    in_flight = bool(table.in_flight[state])
    if not facts & READABLE:
        if in_flight:
            return Reason.RESTORE_IN_FLIGHT
        resident_elsewhere = int(table.residency[state]) > int(Tier.DEVICE)
        return Reason.NOT_RESIDENT if resident_elsewhere else Reason.NOT_CACHED
    form = int(e.paths.form[state])
    if compressed and form != COMPRESSED:
        return Reason.MID_COMPRESSION if in_flight else Reason.COMPRESSED_INCOMPLETE
    if not compressed and form != RAW:
        return Reason.TAIL_MISSING
    if not facts & LAYOUT:
        return Reason.LAYOUT_MISMATCH
    if e.align_ok is not None and not e.align_ok[index]:
        return Reason.MISALIGNED
    if e.checksum_ok is not None and not e.checksum_ok[index]:
        return Reason.CHECKSUM_MISMATCH
    if frozen.failed_checks is not None and frozen.failed_checks[index]:
        return Reason.CHECKSUM_MISMATCH  # seen failing by an earlier lookup
    return None
