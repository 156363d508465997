"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".

Every fact is an array over the prompt's blocks of this group, computed in one compiled pass
(:mod:`kvfsm.verify._group_pass`); "usable at L" is computed for every candidate length at once
with prefix sums, so non-monotone kinds (sliding window, compressed tail, recurrent
checkpoints) are exact and there is no shrinking loop. Reasons and plans read the same arrays
afterwards, only for the lengths a verdict explains.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.fsm import FORM_COMPRESSED as COMPRESSED
from kvfsm.fsm import FORM_RAW as RAW
from kvfsm.kinds import Needed
from kvfsm.memory import SlotPool
from kvfsm.memory._backend import data_ptr
from kvfsm.spec import Form, Layout, Tier
from kvfsm.state import FAILED, UNCHECKED, GroupState, StateCore
from kvfsm.verify._block_facts import FOUND, LAYOUT, PLACED, READABLE, WHOLE
from kvfsm.verify._group_pass import (
    AFTER,
    AFTER_CMP,
    AFTER_RAW,
    ALL_SETTLED,
    ASKED_KEPT,
    CHAIN_BLOCKS,
    CHECKS_IGNORED,
    CHECKS_RECORDED,
    FIT,
    HIT,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    N_PARAMS,
    N_PER_BLOCK,
    N_PER_LENGTH,
    N_SCALARS,
    NEEDS_CHECKSUMS,
    NOW,
    NOW_CMP,
    NOW_RAW,
    P_ALIGNED,
    P_ALL_SETTLED,
    P_BUDGET,
    P_CAPPED,
    P_CHECK_MODE,
    P_FULL_SUB_MASK,
    P_HAS_INDEX,
    P_OWN_SIZE,
    P_SETTLED_FORM,
    P_TARGET_SIZE,
    P_USE_CHECKED_OK,
    group_pass,
    usable_over,
)
from kvfsm.verify._index_check import IndexCheck
from kvfsm.verify._paths import restore_paths
from kvfsm.verify._types import DeviceProfile, Level

Bools = NDArray[np.bool_]

# Stand-ins for a group without an index (the pass reads none of them; read-only like the
# core's arrays, so the call compiles to the same version).
_NO_INDEX = (np.full((1, 1), -1, dtype=np.int32), np.zeros((1, 1), dtype=np.uint32),
             np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint8),
             np.ones(1, dtype=np.bool_), np.full(1, -1, dtype=np.int32),
             np.full(1, -1, dtype=np.intp), np.zeros(1, dtype=np.bool_))
for _stand_in in _NO_INDEX[:6]:
    _stand_in.flags.writeable = False

#: Per group: read-only views of its metadata arrays the pass reads (fixed buffers, made once
#: per group), the pass's parameters that never change for it, and (an index) its references
#: and the target group's arrays.
_ARRAYS: weakref.WeakKeyDictionary[
    GroupState, tuple[tuple[NDArray[Any], ...], NDArray[np.int64], tuple[NDArray[Any], ...]]
] = weakref.WeakKeyDictionary()


def _group_arrays(group: GroupState
                  ) -> tuple[tuple[NDArray[Any], ...], NDArray[np.int64], tuple[NDArray[Any], ...]]:
    known = _ARRAYS.get(group)
    if known is None:
        template = np.ones(N_PARAMS, dtype=np.int64)  # sizes and flags of a non-index group
        template[P_FULL_SUB_MASK] = group.full_sub_mask
        template[P_SETTLED_FORM] = group.rule.settled_form is Form.COMPRESSED
        target = group.target
        index: tuple[NDArray[Any], ...] = ()
        if target is not None:
            template[P_TARGET_SIZE] = target.decl.block_size
            template[P_OWN_SIZE] = group.decl.block_size
            index = (group.refs_target, group.refs_epoch, target.epoch, target.states,
                     target.table.hashed, target.position)
        known = _ARRAYS[group] = ((group.states, group.epoch, group.position, group.sub_blocks,
                                   group.layout_id), template, index)
    return known


#: All-True masks by length, shared read-only (the pass reads ``checked_ok`` only when asked).
_TRUE: dict[int, Bools] = {}


def _all_true(n: int) -> Bools:
    mask = _TRUE.get(n)
    if mask is None:
        if len(_TRUE) > 64:
            _TRUE.clear()
        mask = _TRUE[n] = np.ones(n, dtype=np.bool_)
    return mask


#: What a lookup needs of a group, a reading layout and a device profile that does not change
#: between lookups: per group (weakly), by the ids of the layout and profile (kept with the
#: answer, so a reused id is never mistaken).
_STATICS: weakref.WeakKeyDictionary[
    GroupState, dict[tuple[int, int], tuple[object, object, int, tuple[Bools, bool, bool]]]
] = weakref.WeakKeyDictionary()


def _statics(group: GroupState, reads: Layout, profile: DeviceProfile
             ) -> tuple[Bools, bool, bool]:
    """Per layout id of ``group``, whether the reading kernel's layout ``reads`` accepts it;
    whether restored blocks land aligned for ``profile``; whether every device slot already
    meets it. Cached: recomputed only when the group records a new layout."""
    known_here = _STATICS.get(group)
    if known_here is None:
        known_here = _STATICS[group] = {}
    key = (id(reads), id(profile))
    known = known_here.get(key)
    layouts = group.layouts
    if known is not None and known[0] is reads and known[1] is profile and \
            known[2] == len(layouts):
        return known[3]
    if len(known_here) >= _MAX_SPANS:
        known_here.clear()
    pool = group.pools[Tier.DEVICE]
    layout_ok = np.array([layout == reads for layout in layouts], dtype=np.bool_)
    layout_ok.setflags(write=False)
    answer = (layout_ok, alignment_guaranteed(pool, profile),
              _aligned_by_construction(pool, profile))
    known_here[key] = (reads, profile, len(layouts), answer)
    return answer


def _aligned_by_construction(pool: SlotPool, profile: DeviceProfile) -> bool:
    """Every slot of ``pool`` meets ``profile``: its base and stride are multiples of the
    base alignment and its stride of the size alignment (layer 4 then has nothing to check)."""
    return data_ptr(pool.data) % profile.base_alignment == 0 and \
        pool.stride % profile.base_alignment == 0 and pool.stride % profile.size_alignment == 0


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
        #: ``lo``, ``cut`` and ``hi`` as one read-only ``[3, lengths]`` array.
        self.bounds = np.stack([self.lo, self.cut, self.hi]).astype(np.int64)
        self.bounds.setflags(write=False)


#: Spans by (group declaration, prompt blocks, candidate count, step), shared: a kind's rule
#: is a function of these alone, and a serving load repeats prompt lengths.
_SPANS: dict[tuple[int, int, int, int], tuple[object, Spans]] = {}
_MAX_SPANS = 4096


def spans_for(group: GroupState, n: int, lengths: NDArray[np.int64], step: int) -> Spans:
    """The group's spans over ``lengths`` (``[0, step, ...]``) for a prompt of ``n`` blocks."""
    decl = group.decl
    key = (id(decl), n, lengths.size, step)
    known = _SPANS.get(key)
    if known is not None and known[0] is decl:
        return known[1]
    if len(_SPANS) >= _MAX_SPANS:
        _SPANS.clear()
    spans = Spans(group.rule.needed(decl, lengths), n)
    for array in (spans.lo, spans.cut, spans.hi):
        array.setflags(write=False)
    _SPANS[key] = (decl, spans)
    return spans


def usable_at(spans: Spans, ok_raw: Bools, ok_cmp: Bools) -> Bools:
    """Per candidate length: every block the kind needs there is ok in its form: ``ok_cmp``
    over ``[lo, cut)``, ``ok_raw`` over ``[cut, hi)``. O(n + lengths) with prefix sums, exact
    for kinds whose needed blocks are not a prefix (the pass's NumPy twin, for one vector)."""
    return usable_over(spans.lo, spans.cut, spans.hi, spans.base, ok_raw, ok_cmp)


class GroupEval:
    """Facts about the prompt's blocks of one group, and its usable vectors (one
    :func:`~kvfsm.verify._group_pass.group_pass` call; a second only where the device checks
    must be computed here: data checksums at FULL level or of blocks never checked at their
    epoch, or alignment the pools do not guarantee)."""

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
        spans: Spans | None = None,
    ) -> None:
        self.group = group
        self.decl = decl = group.decl
        self.rule = group.rule
        self.lengths = lengths
        # Every complete block of the prompt: candidates use the first lengths[-1] // size, the
        # rest tells how far this group's chain reaches.
        self.n = n = int(high.size)
        #: The prompt's hash words of this group's blocks.
        self.words = (high, low)
        self.ids = group.hash_map.lookup(high[:n], low[:n]) if n else \
            np.zeros(0, dtype=np.intp)
        self.paths = restore_paths(group.table)
        self.spans = spans if spans is not None else Spans(self.rule.needed(decl, lengths), n)
        self._history = history
        pool = group.pools[Tier.DEVICE]
        layout_ok, self.restore_aligned, aligned = _statics(group, kernel_layout or decl.layout,
                                                            profile)
        self.align_ok: Bools | None = None
        self.checksum_ok: Bools | None = None
        #: The checksums this lookup computed: block ids and whether each passed.
        self.checked: tuple[NDArray[np.intp], Bools] = (np.zeros(0, dtype=np.intp),
                                                       np.zeros(0, dtype=np.bool_))
        # Layers 2 (recorded layout vs the kernel's; the group's declared layout when the
        # caller names none), 1, 3 and 4, and what each block's state allows, in one pass.
        check_alignment = not (level is Level.FAST and self.restore_aligned) and not aligned
        computes_checksums = checksums and level is Level.FULL
        #: Data checks read from the core's records (a block seen failing stays failed).
        self._recorded_checks = checksums
        self._pass(layout_ok, None, CHECKS_RECORDED if checksums else CHECKS_IGNORED)
        if check_alignment or computes_checksums or self._scalars[NEEDS_CHECKSUMS]:
            # Device checks computed here over the readable blocks' slots, then the pass again
            # with their answers.
            readable = (self.facts & READABLE) != 0
            if readable.any():
                readable_ids = self.ids[readable]
                slots = group.slot[Tier.DEVICE][readable_ids]
                if check_alignment:
                    self.align_ok = _aligned(pool, profile, slots, readable)
                if checksums:
                    self.checksum_ok, made, passed = _checksums(group, pool, level, slots,
                                                                readable_ids, readable)
                    self.checked = (made, passed)
            checked_ok = _both(self.align_ok, self.checksum_ok)
            self._recorded_checks = False
            self._pass(layout_ok, checked_ok, CHECKS_IGNORED)
        self.chain_tokens = int(self._scalars[CHAIN_BLOCKS]) * decl.block_size
        #: Per candidate length: restores the plan for it begins (kept only where the core-wide
        #: restore budget has caps and the plan restores something; else None).
        self.restores_asked: NDArray[np.int64] | None = \
            self._asked if self._scalars[ASKED_KEPT] else None
        #: Last candidate index where the hit / usable now / usable after the plan holds.
        self.largest_hit = int(self._scalars[LARGEST_HIT])
        self.largest_now = int(self._scalars[LARGEST_NOW])
        self.largest_after = int(self._scalars[LARGEST_AFTER])

    def _pass(self, layout_ok: Bools, checked_ok: Bools | None, check_mode: int) -> None:
        group, n = self.group, self.n
        history = self._history
        arrays, template, index = _group_arrays(group)
        has_index = group.target is not None and history is not None and n > 0
        params = template.copy()
        params[P_CHECK_MODE] = check_mode
        params[P_USE_CHECKED_OK] = checked_ok is not None
        params[P_ALIGNED] = self.restore_aligned
        params[P_HAS_INDEX] = has_index
        params[P_BUDGET] = group.restore_budget()
        params[P_CAPPED] = group.budget.capped
        if has_index:
            assert history is not None
            params[P_ALL_SETTLED] = history.all_settled
            index_arrays = (*index, history.ids, history.settled)
        else:
            index_arrays = _NO_INDEX
        self.facts = np.empty(n, dtype=np.uint8)
        #: Each block's epoch as this lookup saw it (0 where missing).
        self.epochs = np.empty(n, dtype=np.uint32)
        self._per_block = per_block = np.empty((N_PER_BLOCK, n), dtype=np.bool_)
        count = self.lengths.size
        self._per_length = per_length = np.empty((N_PER_LENGTH, count), dtype=np.bool_)
        self._asked = np.empty(count, dtype=np.int64)
        self._scalars = np.empty(N_SCALARS, dtype=np.int64)
        spans, paths = self.spans, self.paths
        group_pass(
            self.ids, *arrays, layout_ok, paths.code, group.check,
            checked_ok if checked_ok is not None else _all_true(n), *index_arrays,
            spans.bounds, spans.base, paths.restores_by_form, params,
            self.facts, self.epochs, per_block, per_length, self._asked, self._scalars)
        self.now_raw, self.now_cmp = per_block[NOW_RAW], per_block[NOW_CMP]
        self.after_raw, self.after_cmp = per_block[AFTER_RAW], per_block[AFTER_CMP]
        self.hit, self.now, self.after = per_length[HIT], per_length[NOW], per_length[AFTER]
        self._has_index = has_index

    @property
    def found(self) -> Bools:
        """Per block: its hash is in the map."""
        found: Bools = self.facts != 0
        return found

    @property
    def index(self) -> IndexCheck | None:
        """The index's reference checks (sparse-index groups; None otherwise), for reasons."""
        if not self._has_index or self._history is None:
            return None
        safe = np.where(self.ids >= 0, self.ids, 0)
        return IndexCheck(self.group, safe, self._history.ids, fit=self._per_block[FIT])

    @property
    def all_settled(self) -> bool:
        """Every block of the prompt is usable now in the form its kind settles in."""
        return bool(self._scalars[ALL_SETTLED])

    @property
    def settled(self) -> Bools:
        """Per block: usable now in the form its kind settles in (no plan step will touch it)."""
        settled: Bools = self.now_cmp if self.rule.settled_form is Form.COMPRESSED \
            else self.now_raw
        return settled

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
        if self.checksum_ok is None and self._recorded_checks and \
                int(self.group.check[self.ids[index]]) == FAILED:
            return Reason.CHECKSUM_MISMATCH  # seen failing by an earlier lookup
        return None
