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
from kvfsm.verify._index_check import IndexCheck
from kvfsm.verify._paths import (
    FORM_CODES,
    REACHES_COMPRESSED,
    REACHES_RAW,
    READABLE_COMPRESSED,
    READABLE_RAW,
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
        found = self.ids >= 0
        safe = np.where(found, self.ids, 0)
        self.paths = paths = restore_paths(group.table)
        states = group.states[safe]
        self.found, self.states = found, states
        # Every per-state fact in one gather; a missing block has code 0.
        code = paths.code[states] * found
        readable_raw = (code & READABLE_RAW) > 0
        readable_cmp = (code & READABLE_COMPRESSED) > 0
        self.readable = readable_raw | readable_cmp

        # Layer 1, whole-block integrity (sub-blocks here, checksums below) and layer 3's
        # position part: the block found by hash is the one this position needs.
        self.position_ok = group.position[safe] == np.arange(n)
        self.sub_ok = group.sub_blocks[safe] == group.full_sub_mask
        # Layer 2, kernel interface: the layout each block was written under.
        if kernel_layout is None:
            self.layout_ok = np.ones(n, dtype=np.bool_)
        else:
            same = np.array([layout == kernel_layout for layout in group.layouts])
            self.layout_ok = same[group.layout_id[safe]]
        pool = group.pools[Tier.DEVICE]
        readable_ids = safe[self.readable]
        slots = group.slot[Tier.DEVICE][readable_ids]
        # Layer 4, hardware alignment of address and size.
        self.align_ok = np.ones(n, dtype=np.bool_)
        self.restore_aligned = alignment_guaranteed(pool, profile)
        if slots.size and not (level is Level.FAST and self.restore_aligned):
            # address = base + slot * stride: when base and stride are both multiples of the
            # required alignment every slot is aligned, exactly; otherwise check each one.
            base = data_ptr(pool.data)
            sized = pool.stride % profile.size_alignment == 0
            if base % profile.base_alignment == 0 and pool.stride % profile.base_alignment == 0:
                aligned = np.full(slots.size, sized, dtype=np.bool_)
            else:
                address = np.int64(base) + pool.offsets(slots)
                aligned = (address % profile.base_alignment == 0) & sized
            self.align_ok[self.readable] = aligned
        # Layer 1, checksums: FULL recomputes all; reduced levels trust a verification made
        # at the block's current epoch (every epoch bump clears it).
        self.checksum_ok = np.ones(n, dtype=np.bool_)
        if slots.size and checksums:
            todo = np.ones(slots.size, dtype=np.bool_) if level is Level.FULL else \
                ~group.verified[readable_ids]
            if todo.any():
                passed = pool.verify_checksum(slots[todo])
                checked = np.flatnonzero(self.readable)[todo]
                self.checksum_ok[checked] = passed
                group.verified[readable_ids[todo][passed]] = True
        # Sparse index: targets current (epochs) and inside this prompt's history (layer 3).
        self.index: IndexCheck | None = None
        self.targets_fit = np.ones(n, dtype=np.bool_)
        if group.target is not None and n:
            self.index = IndexCheck(group, safe, history.ids if history else None)
            self.targets_fit = self.index.fit

        base = found & self.position_ok
        base &= self.sub_ok
        base &= self.layout_ok
        if group.target is not None:
            base &= self.targets_fit
        checked = self.align_ok & self.checksum_ok
        self.now_raw = base & checked & readable_raw
        self.now_cmp = base & checked & readable_cmp
        # After the plan: blocks reaching the form by a content-preserving path; readable
        # blocks that failed a check stay bad (restoring cannot repair their bytes).
        movable = base & ~(self.readable & ~checked)
        if not self.restore_aligned:
            movable[:] = False
        if self.index is not None and not self.now_raw.all():
            movable &= self.index.targets_resident()  # restoring a target bumps its epoch
        self.after_raw = self.now_raw | (movable & ((code & REACHES_RAW) > 0))
        self.after_cmp = self.now_cmp | (movable & ((code & REACHES_COMPRESSED) > 0))
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

    def reason(self, index: int, compressed: bool) -> Reason | None:
        """Why block ``index`` is not usable now in the needed form (None when it is)."""
        if not self.found[index]:
            return Reason.WINDOW_MISMATCH if self.decl.kind is GroupKind.SLIDING_WINDOW \
                else Reason.NOT_CACHED
        checks: list[tuple[bool, Reason]] = [
            (bool(self.position_ok[index]), Reason.POSITION_CONFLICT),
            (bool(self.sub_ok[index]), Reason.SUB_BLOCKS_MISSING),
        ]
        for ok, why in checks:
            if not ok:
                return why
        if not self.targets_fit[index]:
            assert self.index is not None
            return self.index.reason(index)
        table = self.group.table
        state = int(self.states[index])
        in_flight = bool(table.in_flight[state])
        if not self.readable[index]:
            if in_flight:
                return Reason.RESTORE_IN_FLIGHT
            resident_elsewhere = int(table.residency[state]) > int(Tier.DEVICE)
            return Reason.NOT_RESIDENT if resident_elsewhere else Reason.NOT_CACHED
        form = int(self.paths.form[state])
        if compressed and form != COMPRESSED:
            return Reason.MID_COMPRESSION if in_flight else Reason.COMPRESSED_INCOMPLETE
        if not compressed and form != RAW:
            return Reason.TAIL_MISSING
        for ok, why in ((bool(self.layout_ok[index]), Reason.LAYOUT_MISMATCH),
                        (bool(self.align_ok[index]), Reason.MISALIGNED),
                        (bool(self.checksum_ok[index]), Reason.CHECKSUM_MISMATCH)):
            if not ok:
                return why
        return None
