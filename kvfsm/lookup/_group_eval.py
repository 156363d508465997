"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".
Facts come from one compiled pass (``_group_pass``); "usable at L" holds for every candidate
length at once, by prefix sums, so non-monotone kinds are exact without a shrinking loop."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm.lookup._block_facts import READABLE
from kvfsm.lookup._buffers import (
    ALL_SETTLED,
    ASKED_KEPT,
    CHAIN_BLOCKS,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    N_SCALARS,
    NEEDS_CHECKSUMS,
    RESTORES_TOTAL,
)
from kvfsm.lookup._group_pass import (
    BUDGET_UNKNOWN,
    CHECKS_IGNORED,
    CHECKS_RECORDED,
    group_pass,
)
from kvfsm.lookup._pass_output import PassOutput
from kvfsm.lookup._spans import Spans
from kvfsm.lookup._statics import Statics, slots_aligned
from kvfsm.lookup._types import DeviceProfile, Level
from kvfsm.memory import SlotPool
from kvfsm.spec import Tier
from kvfsm.state import FAILED, UNCHECKED, GroupState

Bools = NDArray[np.bool_]

#: The ``history`` of a group without an index (a pass output of no blocks; never read).
_NO_HISTORY = np.zeros(N_SCALARS + 1, dtype=np.int64)
#: ``checked_ok`` when the pass is not asked to read it.
_NO_CHECKED = np.ones(0, dtype=np.bool_)
_FULL, _FAST = Level.FULL, Level.FAST
_INT64 = np.dtype(np.int64)


def _checksums(group: GroupState, pool: SlotPool, level: Level, slots: NDArray[np.int32],
               readable_ids: NDArray[np.intp], readable: Bools
               ) -> tuple[Bools | None, NDArray[np.intp], Bools]:
    """Layer 1 per prompt block: readable blocks' bytes match their checksums (None: all do),
    and the checks made (ids, passed) for the caller to record. FULL recomputes all, other levels
    those unchecked at their epoch; one any lookup saw fail stays failed until its epoch moves."""
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
    """One group's block facts and usable vectors, from one ``group_pass`` (two where device
    checks, of checksums or alignment the pools do not guarantee, must run here). Its parts are
    views of the one output, made when first read."""

    _history: GroupEval | None
    #: The checksums this lookup computed: block ids and whether each passed (None: none).
    checked: tuple[NDArray[np.intp], Bools] | None = None
    #: Per candidate length: restores its plan begins (only where capped and some plan restores).
    restores_asked: NDArray[np.int64] | None = None

    def _evaluate(self, group: GroupState, words: tuple[NDArray[np.uint64], NDArray[np.uint64]],
                  lengths: NDArray[np.int64], level: Level, profile: DeviceProfile,
                  history: GroupEval | None, checksums: bool, spans: Spans, statics: Statics,
                  capped: bool) -> None:
        """The evaluation, on an instance made by ``_new_eval``: ``words`` C-contiguous,
        writable native uint64, ``spans`` made for the blocks they hold."""
        self.group = group
        self.decl = group.decl
        self.lengths = lengths
        self.n = spans.n  # all complete blocks (past the last candidate too: the chain's reach)
        self.words = words
        self._statics = statics
        self.spans = spans
        self._history = history
        self._capped = capped
        # Asked now where caps make every plan count; else once a plan restores something.
        self._budget = group.restore_budget() if capped else BUDGET_UNKNOWN
        self._recorded_checks = checksums
        scalars = self._pass(None, CHECKS_RECORDED if checksums else CHECKS_IGNORED)
        if (checksums and level is _FULL) or scalars[NEEDS_CHECKSUMS] or \
                not (statics.aligned or (level is _FAST and statics.restore_aligned)):
            scalars = self._checked_pass(level, profile, checksums)
        if scalars[ASKED_KEPT]:
            self.restores_asked = self._out[N_SCALARS : spans.out_at[0]]
        #: Last candidate index where HIT / NOW / AFTER holds.
        self.largest: tuple[int, int, int] = (scalars[LARGEST_HIT], scalars[LARGEST_NOW],
                                              scalars[LARGEST_AFTER])

    def _checked_pass(self, level: Level, profile: DeviceProfile, checksums: bool) -> list[int]:
        """Device checks (alignment, checksums) of readable blocks, then the pass on the answers."""
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

    def _pass(self, checked_ok: Bools | None, check_mode: int) -> list[int]:
        """One group pass (the probe included) into a fresh array; returns its scalars."""
        history = self._history
        if history is not None and self.n > 0 and self.group.target is not None:
            self._has_index = True
            if history.lengths.size != self.lengths.size:  # its output is laid out by its lengths
                raise ValueError(f"group {self.group.name!r}: its history was evaluated "
                                 f"over {history.lengths.size} lengths, not "
                                 f"{self.lengths.size}")
            history_out, n_history, all_settled = history._out, history.n, history.all_settled
        else:
            self._has_index = False
            history_out, n_history, all_settled = _NO_HISTORY, 0, True
        spans = self.spans
        self._out = out = np.empty(spans.out_size, _INT64)  # the kernel writes by the spans
        self._raw = None
        high, low = self.words
        given = _NO_CHECKED if checked_ok is None else checked_ok
        group_pass.run(high, low, self._statics.fixed, history_out, n_history, given, spans.rows,
                       spans.prefix_step, check_mode, checked_ok is not None, self._has_index,
                       all_settled, self._budget, self._capped, out)
        scalars: list[int] = out[:N_SCALARS].tolist()
        total = scalars[RESTORES_TOTAL]
        if total and self._budget == BUDGET_UNKNOWN:
            self._budget = self.group.restore_budget()
            if total > self._budget:
                return self._pass(checked_ok, check_mode)  # again, filtered by the budget
        return scalars


#: Makes a bare evaluation, for :meth:`GroupEval._evaluate` to fill.
_new_eval = object.__new__
