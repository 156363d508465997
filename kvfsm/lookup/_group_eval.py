"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".

Every fact is an array over the prompt's blocks of this group, computed in one compiled pass
(:mod:`kvfsm.lookup._group_pass`); "usable at L" is computed for every candidate length at once
with prefix sums, so non-monotone kinds (sliding window, compressed tail, recurrent
checkpoints) are exact and there is no shrinking loop. Reasons and plans read the same arrays
afterwards, only for the lengths a verdict explains.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import settings as jit_settings
from kvfsm.lookup._block_facts import READABLE
from kvfsm.lookup._buffers import (
    AFTER,
    ALL_SETTLED,
    ASKED_KEPT,
    CHAIN_BLOCKS,
    HIT,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    N_SCALARS,
    NEEDS_CHECKSUMS,
    NOW,
    RESTORES_TOTAL,
)
from kvfsm.lookup._group_pass import (
    BUDGET_UNKNOWN,
    CHECKS_IGNORED,
    CHECKS_RECORDED,
    group_pass,
    group_pass_fixed,
)
from kvfsm.lookup._pass_output import PassOutput
from kvfsm.lookup._spans import Spans
from kvfsm.lookup._statics import Statics, slots_aligned, statics_for
from kvfsm.lookup._types import DeviceProfile, Level
from kvfsm.memory import SlotPool
from kvfsm.spec import Layout, Tier
from kvfsm.state import FAILED, UNCHECKED, GroupState, StateCore

Bools = NDArray[np.bool_]

#: The ``history`` of a group without an index (a pass output of no blocks; never read).
_NO_HISTORY = np.zeros(N_SCALARS + 1, dtype=np.int64)
#: ``checked_ok`` when the pass is not asked to read it (it then reads none of it).
_NO_CHECKED = np.ones(0, dtype=np.bool_)
#: The pass's scalars in the order :class:`GroupEval` unpacks them (all at once: cheaper than
#: indexing each on every lookup).
#: The levels the evaluation compares against (a module global reads faster than an enum's
#: member on every lookup).
_FULL, _FAST = Level.FULL, Level.FAST
#: The pass output's dtype (an object: ``np.empty`` then parses none).
_INT64 = np.dtype(np.int64)
#: The prompt's hash words' dtype (:meth:`~kvfsm.state._prompt.Prompt.words`).
_WORD = np.dtype(np.uint64)




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




class GroupEval(PassOutput):
    """Facts about the prompt's blocks of one group, and its usable vectors (one
    :func:`~kvfsm.lookup._group_pass.group_pass` call, which probes the hash table too; a
    second only where the device checks must be computed here: data checksums at FULL level
    or of blocks never checked at their epoch, or alignment the pools do not guarantee).
    Everything the pass wrote lies in one array; its per-block and per-length parts are views
    made when first read: a lookup reads few of them."""

    #: The index's target group's evaluation (None: not an index, or detached).
    _history: GroupEval | None
    # Absent unless this lookup computed them (class defaults: most lookups never do).
    #: The checksums this lookup computed: block ids and whether each passed (None: none).
    checked: tuple[NDArray[np.intp], Bools] | None = None
    #: Per candidate length: restores the plan for it begins (kept only where the core-wide
    #: restore budget has caps and the plan restores something; else None).
    restores_asked: NDArray[np.int64] | None = None

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
        statics: Statics | None = None,
        capped: bool | None = None,
    ) -> None:
        if statics is None:
            statics = statics_for(group, kernel_layout or group.decl.layout, profile)
        # The words as a prompt makes them (contiguous native uint64, writable; copied only
        # where given otherwise): the first pass reads them as that type (see _pass).
        high, low = np.require(high, _WORD, ["C", "W"]), np.require(low, _WORD, ["C", "W"])
        if spans is None or spans.n != high.size or spans.lo.size != lengths.size:
            spans = Spans(group.rule.needed(group.decl, lengths), high.size)
        self._evaluate(group, (high, low), lengths, level, profile, history, checksums, spans,
                       statics, group.budget.capped if capped is None else capped)

    def _evaluate(self, group: GroupState, words: tuple[NDArray[np.uint64], NDArray[np.uint64]],
                  lengths: NDArray[np.int64], level: Level, profile: DeviceProfile,
                  history: GroupEval | None, checksums: bool, spans: Spans, statics: Statics,
                  capped: bool) -> None:
        """The evaluation itself, from arguments already checked (a lookup calls it directly on
        an instance made by ``_new_eval``: it makes one per group, and every keyword costs on
        that path). ``spans`` are made for the prompt's blocks ``words`` holds."""
        self.group = group
        self.decl = group.decl
        self.lengths = lengths
        # Every complete block of the prompt: candidates use the first lengths[-1] // size, the
        # rest tells how far this group's chain reaches.
        self.n = spans.n
        #: The prompt's hash words of this group's blocks (the prompt's own tuple).
        self.words = words
        self._statics = statics
        self.spans = spans
        self._history = history
        self._capped = capped
        # The admission budget is asked of the group only where the plan restores something
        # (see BUDGET_UNKNOWN), or where caps make every plan's restores count.
        self._budget = group.restore_budget() if capped else BUDGET_UNKNOWN
        #: Data checks read from the core's records (a block seen failing stays failed).
        self._recorded_checks = checksums
        scalars = self._pass(None, CHECKS_RECORDED if checksums else CHECKS_IGNORED)
        # Layers 2 (recorded layout vs the kernel's; the group's declared layout when the
        # caller names none), 1, 3 and 4, and what each block's state allows, in one pass;
        # a second where device checks must be computed here.
        if (checksums and level is _FULL) or scalars[NEEDS_CHECKSUMS] or \
                not (statics.aligned or (level is _FAST and statics.restore_aligned)):
            scalars = self._checked_pass(level, profile, checksums)
        # The chain's reach and the settled flag are read from the output when asked (few
        # lookups ask).
        if scalars[ASKED_KEPT]:
            self.restores_asked = self._out[N_SCALARS : spans.out_at[0]]
        #: Last candidate index where the hit / usable now / usable after the plan holds, by
        #: per-length row (HIT, NOW, AFTER).
        self.largest: tuple[int, int, int] = (scalars[LARGEST_HIT], scalars[LARGEST_NOW],
                                              scalars[LARGEST_AFTER])

    def _checked_pass(self, level: Level, profile: DeviceProfile, checksums: bool) -> list[int]:
        """Device checks computed here over the readable blocks' slots (alignment the pools
        do not guarantee, data checksums), then the pass again with their answers."""
        group, statics = self.group, self._statics
        check_alignment = not statics.aligned and \
            not (level is _FAST and statics.restore_aligned)
        ids = self.ids
        readable = (self.facts & READABLE) != 0
        if readable.any():
            readable_ids = ids[readable]
            slots = group.slot[Tier.DEVICE][readable_ids]
            if check_alignment:
                self.align_ok = slots_aligned(statics.pool, profile, slots, readable)
            if checksums:
                self.checksum_ok, made, passed = _checksums(group, statics.pool, level, slots,
                                                            readable_ids, readable)
                if made.size:
                    self.checked = (made, passed)
        checked_ok = _both(self.align_ok, self.checksum_ok)
        self._recorded_checks = False
        return self._pass(checked_ok, CHECKS_IGNORED)

    @property
    def chain_tokens(self) -> int:
        """How far the prompt's hash chain in this group reaches, in tokens."""
        return int(self._out[CHAIN_BLOCKS]) * self.decl.block_size

    @property
    def all_settled(self) -> bool:
        """Every block the pass read is settled (what an index's pass reads of its target)."""
        return bool(self._out[ALL_SETTLED])

    @property
    def restore_aligned(self) -> bool:
        """Restored blocks land aligned for the device profile."""
        return self._statics.restore_aligned

    @property
    def largest_hit(self) -> int:
        """Last candidate index where the hit holds (0 when none)."""
        return self.largest[HIT]

    @property
    def largest_now(self) -> int:
        """Last candidate index usable now (0 when none)."""
        return self.largest[NOW]

    @property
    def largest_after(self) -> int:
        """Last candidate index usable after the plan (0 when none)."""
        return self.largest[AFTER]

    def _pass(self, checked_ok: Bools | None, check_mode: int) -> list[int]:
        """One group pass (the probe included) into a fresh array; returns its scalars."""
        history = self._history
        if history is not None and self.n > 0 and self.group.target is not None:
            self._has_index = True
            # The history's own output: the pass reads its ids and settled row there, laid
            # out for the history's lengths (which must be these: the pass reads by them).
            if history.lengths.size != self.lengths.size:
                raise ValueError(f"group {self.group.name!r}: its history was evaluated "
                                 f"over {history.lengths.size} lengths, not "
                                 f"{self.lengths.size}")
            history_out, n_history, all_settled = history._out, history.n, history.all_settled
        else:
            self._has_index = False
            history_out, n_history, all_settled = _NO_HISTORY, 0, True
        spans = self.spans
        # Sized by the spans (made for these n blocks and lengths): the kernel writes by them.
        self._out = out = np.empty(spans.out_size, _INT64)
        self._raw = None
        high, low = self.words
        statics = self._statics
        # Compiled, the group's fixed arrays go as one address table where they are laid out
        # as the pass views them (numba matches each array argument's type on every call,
        # some 40 ns an array).
        fixed = statics.fixed
        use_checked_ok = checked_ok is not None
        given = _NO_CHECKED if checked_ok is None else checked_ok
        if fixed is not None and jit_settings.enabled:
            # Every call through numba's dispatcher, which compiles a version for argument
            # types it has not seen: none is read as another's.
            group_pass_fixed.run(
                high, low, fixed, history_out, n_history, given, spans.rows,
                spans.prefix_step, check_mode, use_checked_ok, self._has_index, all_settled,
                self._budget, self._capped, out)
        else:
            group_pass.run(
                high, low, *statics.arrays, history_out, n_history, given, spans.rows,
                spans.prefix_step, check_mode, use_checked_ok, self._has_index, all_settled,
                self._budget, self._capped, out)
        scalars: list[int] = out[:N_SCALARS].tolist()
        total = scalars[RESTORES_TOTAL]
        if total and self._budget == BUDGET_UNKNOWN:
            # The plan restores something: its total against the budget (asked once).
            self._budget = self.group.restore_budget()
            if total > self._budget:
                return self._pass(checked_ok, check_mode)  # again, filtered by the budget
        return scalars


#: Makes an evaluation without its constructor's checks (a lookup fills it through
#: :meth:`GroupEval._evaluate` from arguments it has already made and checked).
_new_eval = object.__new__
