"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".

Everything is a NumPy array over the prompt's blocks of this group; "usable at L" is computed
for every candidate length at once with prefix sums, so non-monotone kinds (sliding window,
compressed tail, recurrent checkpoints) are exact and there is no shrinking loop.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm.memory import SlotPool
from kvfsm.memory._backend import data_ptr
from kvfsm.spec import Form, GroupKind, Layout, Tier
from kvfsm.state import GroupState, StateCore
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
    FORM_CODES,
    restore_paths,
)
from kvfsm.verify._types import DeviceProfile, Level, Reason

Bools = NDArray[np.bool_]
RAW, COMPRESSED = FORM_CODES[Form.RAW], FORM_CODES[Form.COMPRESSED]


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


def _checksums_pass(group: GroupState, pool: SlotPool, level: Level, slots: NDArray[np.int32],
                    readable_ids: NDArray[np.intp], readable: Bools) -> Bools | None:
    """Layer 1 per prompt block: the readable blocks' bytes match their checksums (None: all
    do). FULL recomputes all; reduced levels trust a verification made at the block's current
    epoch (every epoch bump clears it), and record the ones they make."""
    todo = np.ones(slots.size, dtype=np.bool_) if level is Level.FULL else \
        ~group.verified[readable_ids]
    if not todo.any():
        return None
    passed = pool.verify_checksum(slots[todo])
    group.verified[readable_ids[todo][passed]] = True
    if passed.all():
        return None
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[np.flatnonzero(readable)[todo]] = passed
    return ok


def _both(first: Bools | None, second: Bools | None) -> Bools | None:
    """``first & second`` where None means "all pass"."""
    if first is None or second is None:
        return second if first is None else first
    return first & second


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
        self.lengths = lengths
        size = self.decl.block_size
        # Every complete block of the prompt: candidates use the first lengths[-1] // size, the
        # rest tells how far this group's chain reaches.
        self.n = int(high.size)
        n = self.n
        self.ids = core.lookup_words(group.name, high[:n], low[:n]) if n else \
            np.zeros(0, dtype=np.intp)
        self.paths = paths = restore_paths(group.table)
        # Layers 1 (sub-blocks), 2 (recorded layout vs the kernel's) and 3 (position), and what
        # each block's state allows: one byte per block, in one pass over the metadata.
        layout_ok = np.ones(len(group.layouts), dtype=np.bool_) if kernel_layout is None else \
            np.array([layout == kernel_layout for layout in group.layouts], dtype=np.bool_)
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
        check_alignment = not (level is Level.FAST and self.restore_aligned)
        if (check_alignment or checksums) and readable.any():
            readable_ids = safe[readable]
            slots = group.slot[Tier.DEVICE][readable_ids]
            if check_alignment:
                self.align_ok = _aligned(pool, profile, slots, readable)
            if checksums:
                self.checksum_ok = _checksums_pass(group, pool, level, slots, readable_ids,
                                                   readable)
        checked = _both(self.align_ok, self.checksum_ok)
        # Sparse index: targets current (epochs) and inside this prompt's history (layer 3).
        self.index: IndexCheck | None = None
        sound = (facts & SOUND) == SOUND
        if group.target is not None and n:
            self.index = IndexCheck(group, safe, history.ids if history else None)
            sound &= self.index.fit
        good = sound if checked is None else sound & checked
        self.now_raw = good & ((facts & READ_RAW) != 0)
        self.now_cmp = good & ((facts & READ_COMPRESSED) != 0)
        # After the plan: blocks reaching the form by a content-preserving path; readable
        # blocks that failed a check stay bad (restoring cannot repair their bytes).
        if not self.restore_aligned:
            movable = np.zeros(n, dtype=np.bool_)
        else:
            movable = sound if checked is None else sound & ~(readable & ~checked)
            if self.index is not None and not self.now_raw.all():
                movable = movable & self.index.targets_resident()  # a restore bumps epochs
        self.after_raw = self.now_raw | (movable & ((facts & TO_RAW) != 0))
        self.after_cmp = self.now_cmp | (movable & ((facts & TO_COMPRESSED) != 0))
        self.chain_tokens = (int(np.argmin(found)) if not found.all() else n) * size
        # The classic hit: hash presence only, under the kind's own rule (a sliding window
        # needs only its window, a recurrent group a snapshot at exactly L).
        self.hit = self._usable(found, found)
        self.now = self._usable(self.now_raw, self.now_cmp)
        plan_changes_nothing = bool(np.array_equal(self.after_raw, self.now_raw)) and \
            bool(np.array_equal(self.after_cmp, self.now_cmp))
        self.after: Bools = self.now if plan_changes_nothing else \
            self._usable(self.after_raw, self.after_cmp) | self.now

    # -- usable at every candidate length ----------------------------------------------------

    def blocks_at(self, length: NDArray[np.int64]) -> NDArray[np.int64]:
        return length // self.decl.block_size

    def tail_start(self, length: NDArray[np.int64]) -> NDArray[np.int64]:
        """First block that must be raw at ``length`` (compressed kind)."""
        tail = self.decl.tail_tokens or 0
        return np.maximum(length - tail, 0) // self.decl.block_size

    def window_start(self, length: NDArray[np.int64]) -> NDArray[np.int64]:
        """First block the next token's window reads: tokens ``[L-(W-1), L)``."""
        window = self.decl.window or 1
        return np.maximum(length - (window - 1), 0) // self.decl.block_size

    def _usable(self, ok_raw: Bools, ok_cmp: Bools) -> Bools:
        lengths = self.lengths
        kind = self.decl.kind
        if kind in (GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.SPARSE_INDEX) and \
                bool(ok_raw.all()):
            return np.ones(lengths.size, dtype=np.bool_)  # every block passes: every length
        blocks = self.blocks_at(lengths)
        if kind is GroupKind.RECURRENT:
            interval = self.decl.checkpoint_interval or self.decl.block_size
            last = np.maximum(blocks - 1, 0)
            has = np.where(blocks > 0, ok_raw[last] if ok_raw.size else False, True)
            return np.asarray((lengths % interval == 0) & has)
        raw_bad = _prefix(~ok_raw)
        if kind is GroupKind.SLIDING_WINDOW:
            start = self.window_start(lengths)
            return np.asarray(raw_bad[blocks] - raw_bad[start] == 0)
        if kind is GroupKind.COMPRESSED:
            cmp_bad = _prefix(~ok_cmp)
            start = self.tail_start(lengths)
            return np.asarray((cmp_bad[start] == 0) & (raw_bad[blocks] - raw_bad[start] == 0))
        return np.asarray(raw_bad[blocks] == 0)

    # -- reasons ---------------------------------------------------------------------------

    def needed(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Block indices needed at ``length`` and, per block, whether it must be compressed."""
        at = np.array([length], dtype=np.int64)
        end = int(self.blocks_at(at)[0])
        kind = self.decl.kind
        if kind is GroupKind.RECURRENT:
            index = np.arange(end - 1, end) if end else np.zeros(0, dtype=np.int64)
        elif kind is GroupKind.SLIDING_WINDOW:
            index = np.arange(int(self.window_start(at)[0]), end)
        else:
            index = np.arange(end)
        compressed = np.zeros(index.size, dtype=np.bool_)
        if kind is GroupKind.COMPRESSED:
            compressed = index < int(self.tail_start(at)[0])
        return index, compressed

    def failing(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """The needed blocks at ``length`` that are not usable now, and their needed form."""
        index, compressed = self.needed(length)
        index_in = index < self.n
        index, compressed = index[index_in], compressed[index_in]
        ok = np.where(compressed, self.now_cmp[index], self.now_raw[index])
        return index[~ok], compressed[~ok]

    def state(self, index: int) -> int:
        """The lifecycle state of the prompt's block ``index`` (found blocks only)."""
        return int(self.group.states[self.ids[index]])

    def reason(self, index: int, compressed: bool) -> Reason | None:
        """Why block ``index`` is not usable now in the needed form (None when it is)."""
        facts = int(self.facts[index])
        if not facts & FOUND:
            return Reason.WINDOW_MISMATCH if self.decl.kind is GroupKind.SLIDING_WINDOW \
                else Reason.NOT_CACHED
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
