"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".

Everything is a NumPy array over the prompt's blocks of this group; "usable at L" is computed
for every candidate length at once with prefix sums, so non-monotone kinds (sliding window,
compressed tail, recurrent checkpoints) are exact and there is no shrinking loop.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.fsm import FORM_COMPRESSED as COMPRESSED
from kvfsm.fsm import FORM_RAW as RAW
from kvfsm.kinds import Needed
from kvfsm.memory import SlotPool
from kvfsm.memory._backend import data_ptr
from kvfsm.spec import Form, Layout, Tier
from kvfsm.state import FAILED, NO_TARGET, UNCHECKED, GroupState, StateCore
from kvfsm.verify._block_facts import (
    FOUND,
    LAYOUT,
    PLACED,
    READ_COMPRESSED,
    READ_RAW,
    READABLE,
    SOUND,
    TO_COMPRESSED,
    TO_RAW,
    WHOLE,
    block_facts,
)
from kvfsm.verify._index_check import IndexCheck
from kvfsm.verify._paths import (
    restore_paths,
)
from kvfsm.verify._types import DeviceProfile, Level

Bools = NDArray[np.bool_]


def _prefix(bad: Bools) -> NDArray[np.int64]:
    """``P[m]`` = number of bad blocks among the first ``m``."""
    out = np.zeros(bad.size + 1, dtype=np.int64)
    np.cumsum(bad, out=out[1:])
    return out


def alignment_guaranteed(pool: SlotPool, profile: DeviceProfile) -> bool:
    """The pool's construction already satisfies the profile for every slot."""
    return pool.alignment % profile.base_alignment == 0 and \
        pool.stride % profile.size_alignment == 0


def _aligned(pool: SlotPool, profile: DeviceProfile, slots: NDArray[np.int32],
             readable: Bools) -> Bools | None:
    """Layer 4 per prompt block: the device address and size of each readable block meet the
    profile (None: all do). address = base + slot * stride: when base and stride are both
    multiples of the required alignment every slot is aligned, exactly; else check each."""
    base = data_ptr(pool.data)
    sized = pool.stride % profile.size_alignment == 0
    if base % profile.base_alignment == 0 and pool.stride % profile.base_alignment == 0:
        return None if sized else ~readable
    address = np.int64(base) + pool.offsets(slots)
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[readable] = (address % profile.base_alignment == 0) & sized
    return ok


def _checksums(group: GroupState, pool: SlotPool, level: Level, slots: NDArray[np.int32],
               readable_ids: NDArray[np.intp], readable: Bools
               ) -> tuple[Bools | None, NDArray[np.intp], Bools]:
    """Layer 1 per prompt block: the readable blocks' bytes match their checksums (None: all
    do), and the checks made (block ids, passed) for the caller to record.

    FULL recomputes every block; reduced levels recompute only blocks not checked since their
    epoch last moved and trust earlier passes. A block any lookup saw fail stays failed at
    every level until its epoch moves: no level calls it usable again.
    """
    check = group.check[readable_ids]
    failed_before = check == FAILED
    todo = np.ones(slots.size, dtype=np.bool_) if level is Level.FULL else check == UNCHECKED
    passed = pool.verify_checksum(slots[todo]) if todo.any() else np.zeros(0, dtype=np.bool_)
    made = readable_ids[todo]
    if passed.all() and not failed_before.any():
        return None, made, passed
    good = ~failed_before
    good[todo] &= passed
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[readable] = good
    return ok, made, passed


def _both(first: Bools | None, second: Bools | None) -> Bools | None:
    """``first & second`` where None means "all pass"."""
    if first is None or second is None:
        return second if first is None else first
    return first & second


class Spans:
    """A kind's needed block spans at every candidate length, clipped to the ``n`` blocks the
    prompt has, with what every "usable at L" evaluation of the group shares computed once."""

    def __init__(self, need: Needed, n: int) -> None:
        self.hi = np.minimum(need.hi, n)
        self.cut = np.minimum(need.cut, self.hi)
        self.lo = np.minimum(need.lo, self.cut)
        #: Every needed block exists in the prompt (an empty span needs none), and the kind
        #: can serve the length at all.
        inside = (need.hi <= n) | (need.lo >= need.hi)
        self.base: Bools = inside if need.servable is None else inside & need.servable
        self.base.setflags(write=False)
        self.reads_compressed = bool((self.lo < self.cut).any())


def usable_at(spans: Spans, ok_raw: Bools, ok_cmp: Bools) -> Bools:
    """Per candidate length: every block the kind needs there is ok in its form: ``ok_cmp``
    over ``[lo, cut)``, ``ok_raw`` over ``[cut, hi)``. O(n + lengths) with prefix sums, exact
    for kinds whose needed blocks are not a prefix."""
    if not spans.reads_compressed and bool(ok_raw.all()):
        return spans.base  # every raw block passes and none is needed compressed
    raw_bad = _prefix(~ok_raw)
    usable: Bools = spans.base & (raw_bad[spans.hi] - raw_bad[spans.cut] == 0)
    if spans.reads_compressed:
        cmp_bad = _prefix(~ok_cmp)
        usable &= cmp_bad[spans.cut] - cmp_bad[spans.lo] == 0
    return usable


def _targets_settled(group: GroupState, rows: NDArray[np.intp], history: GroupEval) -> Bools:
    """Per index row: every target it references is the prompt's history block at the target's
    position and is settled there (see :attr:`GroupEval.settled`)."""
    target = group.target
    assert target is not None, f"group {group.name!r} has no target group"
    refs = group.refs_target[rows]
    used = refs != NO_TARGET
    in_range = (refs >= 0) & (refs < target.n_blocks)
    held = np.where(in_range, refs, 0)
    position = target.position[held]
    placed = (position >= 0) & (position < history.n)
    at = np.where(placed, position, 0)
    settled = placed & history.settled[at] & (history.ids[at] == held)
    bad = (used & ~(in_range & settled)) | (refs < NO_TARGET)
    result: Bools = ~bad.any(axis=1)
    return result


class GroupEval:
    """Facts about the prompt's blocks of one group, and its usable vectors."""

    def __init__(
        self,
        core: StateCore,
        group: GroupState,
        high: NDArray[np.uint64],
        low: NDArray[np.uint64],
        lengths: NDArray[np.int64],
        *,
        level: Level,
        kernel_layout: Layout | None,
        profile: DeviceProfile,
        history: GroupEval | None = None,
        checksums: bool = True,
    ) -> None:
        self.group = group
        self.decl = group.decl
        self.rule = group.rule
        self.lengths = lengths
        size = self.decl.block_size
        # Every complete block of the prompt: candidates use the first lengths[-1] // size, the
        # rest tells how far this group's chain reaches.
        self.n = n = int(high.size)
        self.ids = core.lookup_words(group.name, high[:n], low[:n]) if n else \
            np.zeros(0, dtype=np.intp)
        self.paths = paths = restore_paths(group.table)
        # Layers 1 (sub-blocks), 2 (recorded layout vs the kernel's; the group's declared
        # layout when the caller names none) and 3 (position), and what each block's state
        # allows: one byte per block, in one pass over the metadata.
        reads = kernel_layout or self.decl.layout
        layout_ok = np.array([layout == reads for layout in group.layouts], dtype=np.bool_)
        self.facts = facts = block_facts(group, self.ids, layout_ok, paths.code)
        self.found = found = facts != 0
        readable = (facts & READABLE) != 0
        safe = np.where(found, self.ids, 0)

        # Layers 4 (alignment) and 1 (checksums) over the readable blocks' device slots; None
        # where every block passes (the common case costs no array).
        pool = group.pools[Tier.DEVICE]
        self.restore_aligned = alignment_guaranteed(pool, profile)
        self.align_ok: Bools | None = None
        self.checksum_ok: Bools | None = None
        #: The checksums this lookup computed: block ids and whether each passed.
        self.checked: tuple[NDArray[np.intp], Bools] = (np.zeros(0, dtype=np.intp),
                                                       np.zeros(0, dtype=np.bool_))
        check_alignment = not (level is Level.FAST and self.restore_aligned)
        if (check_alignment or checksums) and readable.any():
            readable_ids = safe[readable]
            slots = group.slot[Tier.DEVICE][readable_ids]
            if check_alignment:
                self.align_ok = _aligned(pool, profile, slots, readable)
            if checksums:
                self.checksum_ok, made, passed = _checksums(group, pool, level, slots,
                                                            readable_ids, readable)
                self.checked = (made, passed)
        checked_ok = _both(self.align_ok, self.checksum_ok)
        # Sparse index: targets current (epochs) and inside this prompt's history (layer 3).
        self.index: IndexCheck | None = None
        sound = (facts & SOUND) == SOUND
        if group.target is not None and n:
            self.index = IndexCheck(group, safe, history.ids if history else None)
            sound &= self.index.fit
        good = sound if checked_ok is None else sound & checked_ok
        self.now_raw = good & ((facts & READ_RAW) != 0)
        self.now_cmp = good & ((facts & READ_COMPRESSED) != 0)
        # After the plan: blocks reaching the form by a content-preserving path; readable
        # blocks that failed a check stay bad (restoring cannot repair their bytes).
        if not self.restore_aligned:
            movable = np.zeros(n, dtype=np.bool_)
        else:
            movable = sound if checked_ok is None else sound & ~(readable & ~checked_ok)
        self.after_raw = self.now_raw | (movable & ((facts & TO_RAW) != 0))
        self.after_cmp = self.now_cmp | (movable & ((facts & TO_COMPRESSED) != 0))
        if self.index is not None and history is not None and \
                not bool(history.settled.all()):
            # Every step of a plan on a target (a restore, a compression) bumps its epoch and
            # invalidates the index rows pointing at it: after the plan a row still counts
            # only if each of its targets already sits, usable, in its settled form.
            stays = _targets_settled(group, safe, history)
            self.after_raw = self.after_raw & stays
            self.after_cmp = self.after_cmp & stays
        self.chain_tokens = (int(np.argmin(found)) if not found.all() else n) * size
        self.spans = Spans(self.rule.needed(self.decl, lengths), n)
        # The classic hit: hash presence only, under the kind's own rule (a sliding window
        # needs only its window, a recurrent group a snapshot at exactly L).
        self.hit = self._usable(found, found)
        #: Per candidate length: restores the plan for it begins (kept only where the core-wide
        #: restore budget has caps and the plan restores something; else None).
        self.restores_asked: NDArray[np.int64] | None = None
        self.now = self._usable(self.now_raw, self.now_cmp)
        plan_changes_nothing = bool(np.array_equal(self.after_raw, self.now_raw)) and \
            bool(np.array_equal(self.after_cmp, self.now_cmp))
        #: Per candidate length: usable once the plan for that length has run (which may
        #: also break what is usable now, e.g. index rows over a target the plan moves).
        self.after: Bools = self.now if plan_changes_nothing else \
            self._usable(self.after_raw, self.after_cmp) & self._admitted()

    @property
    def settled(self) -> Bools:
        """Per block: usable now in the form its kind settles in (no plan step will touch it)."""
        settled: Bools = self.now_cmp if self.rule.settled_form is Form.COMPRESSED \
            else self.now_raw
        return settled

    # -- usable at every candidate length ----------------------------------------------------

    def _usable(self, ok_raw: Bools, ok_cmp: Bools) -> Bools:
        return usable_at(self.spans, ok_raw, ok_cmp)

    def _admitted(self) -> Bools:
        """Per candidate length: the restores the plan needs there fit the group's admission
        budget, so the verdict never offers a plan the gate would refuse. Where the core-wide
        budget has caps, also keeps the restores asked per length (``restores_asked``) for the
        lookup to add up over groups."""
        budget = self.group.restore_budget()
        states = np.where(self.found, self.group.states[np.where(self.found, self.ids, 0)], 0)
        restores_raw = ~self.now_raw & self.after_raw & self.paths.restores[Form.RAW][states]
        restores_cmp = ~self.now_cmp & self.after_cmp & \
            self.paths.restores[Form.COMPRESSED][states]
        total = int(restores_raw.sum()) + int(restores_cmp.sum())
        if total == 0 or (total <= budget and not self.group.budget.capped):
            return np.ones(self.lengths.size, dtype=np.bool_)
        lo, cut, hi = self.spans.lo, self.spans.cut, self.spans.hi
        raw_count, cmp_count = _prefix(restores_raw), _prefix(restores_cmp)
        asked = raw_count[hi] - raw_count[cut] + cmp_count[cut] - cmp_count[lo]
        self.restores_asked = asked
        admitted: Bools = asked <= budget
        return admitted

    # -- reasons ---------------------------------------------------------------------------

    def needed(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Block indices needed at ``length`` and, per block, whether it must be compressed."""
        need = self.rule.needed(self.decl, np.array([length], dtype=np.int64))
        index = np.arange(int(need.lo[0]), int(need.hi[0]), dtype=np.int64)
        return index, index < int(need.cut[0])

    def servable(self, length: int) -> bool:
        """The kind can serve ``length`` at all (whatever its blocks)."""
        need = self.rule.needed(self.decl, np.array([length], dtype=np.int64))
        return need.servable is None or bool(need.servable[0])

    def failing(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """The needed blocks at ``length`` that are not usable now, and their needed form."""
        index, compressed = self.needed(length)
        index_in = index < self.n
        ok = np.zeros(index.size, dtype=np.bool_)
        inside = index[index_in]
        ok[index_in] = np.where(compressed[index_in], self.now_cmp[inside], self.now_raw[inside])
        return index[~ok], compressed[~ok]

    def state(self, index: int) -> int:
        """The lifecycle state of the prompt's block ``index`` (found blocks only)."""
        return int(self.group.states[self.ids[index]])

    def reason(self, index: int, compressed: bool) -> Reason | None:
        """Why block ``index`` is not usable now in the needed form (None when it is)."""
        if index >= self.n:
            return self.rule.missing
        facts = int(self.facts[index])
        if not facts & FOUND:
            return self.rule.missing
        if not facts & PLACED:
            return Reason.POSITION_CONFLICT
        if not facts & WHOLE:
            return Reason.SUB_BLOCKS_MISSING
        if self.index is not None and not self.index.fit[index]:
            return self.index.reason(index)
        table = self.group.table
        state = self.state(index)
        in_flight = bool(table.in_flight[state])
        if not facts & READABLE:
            if in_flight:
                return Reason.RESTORE_IN_FLIGHT
            resident_elsewhere = int(table.residency[state]) > int(Tier.DEVICE)
            return Reason.NOT_RESIDENT if resident_elsewhere else Reason.NOT_CACHED
        form = int(self.paths.form[state])
        if compressed and form != COMPRESSED:
            return Reason.MID_COMPRESSION if in_flight else Reason.COMPRESSED_INCOMPLETE
        if not compressed and form != RAW:
            return Reason.TAIL_MISSING
        if not facts & LAYOUT:
            return Reason.LAYOUT_MISMATCH
        if self.align_ok is not None and not self.align_ok[index]:
            return Reason.MISALIGNED
        if self.checksum_ok is not None and not self.checksum_ok[index]:
            return Reason.CHECKSUM_MISMATCH
        return None
