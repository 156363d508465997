"""One group's part of a lookup: per-block facts, the four layers, and "usable at length L".

Every fact is an array over the prompt's blocks of this group, computed in one compiled pass
(:mod:`kvfsm.verify._group_pass`); "usable at L" is computed for every candidate length at once
with prefix sums, so non-monotone kinds (sliding window, compressed tail, recurrent
checkpoints) are exact and there is no shrinking loop. Reasons and plans read the same arrays
afterwards, only for the lengths a verdict explains.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import settings as jit_settings
from kvfsm._reasons import Reason
from kvfsm.fsm import FORM_COMPRESSED as COMPRESSED
from kvfsm.fsm import FORM_RAW as RAW
from kvfsm.fsm import CompiledTable
from kvfsm.kinds import KindRule
from kvfsm.memory import SlotPool
from kvfsm.spec import Layout, Tier
from kvfsm.state import FAILED, UNCHECKED, GroupState, StateCore
from kvfsm.verify._block_facts import FOUND, LAYOUT, PLACED, READABLE, WHOLE
from kvfsm.verify._group_pass import (
    AFTER,
    AFTER_CMP,
    AFTER_RAW,
    ALL_SETTLED,
    ASKED_KEPT,
    BUDGET_UNKNOWN,
    CHAIN_BLOCKS,
    CHECKS_IGNORED,
    CHECKS_RECORDED,
    FIT,
    HIT,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    N_PER_BLOCK,
    N_SCALARS,
    NEEDS_CHECKSUMS,
    NOW,
    NOW_CMP,
    NOW_RAW,
    ONE_RUN_BLOCKS,
    PLAN_CHANGES,
    RESTORES_TOTAL,
    SNAPSHOT_FAILED,
    SNAPSHOT_ROWS,
    SNAPSHOT_STATE,
    group_pass,
    group_pass_fixed,
    snapshot_at,
)
from kvfsm.verify._index_check import IndexCheck
from kvfsm.verify._paths import RestorePaths
from kvfsm.verify._snapshot import take_snapshot
from kvfsm.verify._spans import Spans
from kvfsm.verify._statics import Statics, slots_aligned, statics_for
from kvfsm.verify._types import DeviceProfile, GroupVerdict, Level
from kvfsm.verify._why import Codes, reason_codes

Bools = NDArray[np.bool_]

#: The ``history`` of a group without an index (a pass output of no blocks; never read).
_NO_HISTORY = np.zeros(N_SCALARS + 1, dtype=np.int64)
#: ``checked_ok`` when the pass is not asked to read it (it then reads none of it).
_NO_CHECKED = np.ones(0, dtype=np.bool_)
#: The pass's scalars in the order :class:`GroupEval` unpacks them (all at once: cheaper than
#: indexing each on every lookup).
_SCALAR_ORDER = (CHAIN_BLOCKS, NEEDS_CHECKSUMS, PLAN_CHANGES, ASKED_KEPT, LARGEST_HIT,
                 LARGEST_NOW, LARGEST_AFTER, ALL_SETTLED, RESTORES_TOTAL, ONE_RUN_BLOCKS)
assert tuple(range(N_SCALARS)) == _SCALAR_ORDER, "GroupEval unpacks the scalars in this order"
#: The levels the evaluation compares against (a module global reads faster than an enum's
#: member on every lookup).
_FULL, _FAST = Level.FULL, Level.FAST




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




class Frozen(NamedTuple):
    """What explaining a group's verdict reads of the core, as it was when the verdict was
    made (:meth:`GroupEval.freeze`): the group's table, each prompt block's lifecycle state
    (0 where missing), whether its recorded data check failed (None: not read), and for a
    sparse index whether each row that fails its reference check has a stale or dead
    reference (None: the group has no index). A later change to the core cannot alter an
    explanation made from it."""

    table: CompiledTable
    states: NDArray[np.uint8]
    failed_checks: Bools | None
    stale: Bools | None


class GroupEval:
    """Facts about the prompt's blocks of one group, and its usable vectors (one
    :func:`~kvfsm.verify._group_pass.group_pass` call, which probes the hash table too; a
    second only where the device checks must be computed here: data checksums at FULL level
    or of blocks never checked at their epoch, or alignment the pools do not guarantee).
    Everything the pass wrote lies in one array; its per-block and per-length parts are views
    made when first read: a lookup reads few of them."""

    #: Everything the last pass wrote (:func:`~kvfsm.verify._group_pass.out_offsets`).
    _out: NDArray[np.int64]
    #: Its byte part (facts, then the flag rows) as a view, made on first read (None until).
    _raw: NDArray[np.uint8] | None
    _has_index: bool
    # Absent unless this lookup computed them (class defaults: most lookups never do).
    #: Layer 4 per block, where the pools do not guarantee alignment.
    align_ok: Bools | None = None
    #: Layer 1 per block, where this lookup computed data checksums.
    checksum_ok: Bools | None = None
    #: The checksums this lookup computed: block ids and whether each passed (None: none).
    checked: tuple[NDArray[np.intp], Bools] | None = None
    #: Per candidate length: restores the plan for it begins (kept only where the core-wide
    #: restore budget has caps and the plan restores something; else None).
    restores_asked: NDArray[np.int64] | None = None
    #: What the kind needs at each length a verdict asked about (:meth:`_need`; None until).
    _needs: dict[int, tuple[int, int, int, bool]] | None = None
    #: What the snapshot adds to the pass's output: the group's table and an index's stale
    #: rows (:meth:`freeze`; None until).
    _snapshot: tuple[CompiledTable, Bools | None] | None = None
    #: The snapshot as explanations read it (:meth:`frozen`; None until).
    _frozen: Frozen | None = None

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
        if spans is None or spans.n != high.size or spans.lo.size != lengths.size:
            spans = Spans(group.rule.needed(group.decl, lengths), high.size)
        self._evaluate(group, high, low, lengths, level, profile, history, checksums, spans,
                       statics, group.budget.capped if capped is None else capped)

    def _evaluate(self, group: GroupState, high: NDArray[np.uint64], low: NDArray[np.uint64],
                  lengths: NDArray[np.int64], level: Level, profile: DeviceProfile,
                  history: GroupEval | None, checksums: bool, spans: Spans, statics: Statics,
                  capped: bool) -> None:
        """The evaluation itself, from arguments already checked (:func:`evaluate` calls it
        directly: a lookup makes one per group, and every keyword costs on that path)."""
        self.group = group
        self.decl = decl = group.decl
        self.lengths = lengths
        # Every complete block of the prompt: candidates use the first lengths[-1] // size, the
        # rest tells how far this group's chain reaches.
        self.n = high.size
        #: The prompt's hash words of this group's blocks.
        self.words = (high, low)
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
        check_alignment = not statics.aligned and \
            not (level is _FAST and statics.restore_aligned)
        if check_alignment or scalars[NEEDS_CHECKSUMS] or (checksums and level is _FULL):
            # Device checks computed here over the readable blocks' slots, then the pass again
            # with their answers.
            ids = self.ids
            readable = (self.facts & READABLE) != 0
            if readable.any():
                readable_ids = ids[readable]
                slots = group.slot[Tier.DEVICE][readable_ids]
                if check_alignment:
                    self.align_ok = slots_aligned(statics.pool, profile, slots, readable)
                if checksums:
                    self.checksum_ok, made, passed = _checksums(group, statics.pool, level,
                                                                slots, readable_ids, readable)
                    if made.size:
                        self.checked = (made, passed)
            checked_ok = _both(self.align_ok, self.checksum_ok)
            self._recorded_checks = False
            scalars = self._pass(checked_ok, CHECKS_IGNORED)
        # The scalars in their order (_SCALAR_ORDER), unpacked at once.
        chain, _, _, asked_kept, largest_hit, largest_now, largest_after, all_settled, _, _ = \
            scalars
        self.chain_tokens: int = chain * decl.block_size
        if asked_kept:
            self.restores_asked = self._out[N_SCALARS : N_SCALARS + lengths.size]
        #: Last candidate index where the hit / usable now / usable after the plan holds, by
        #: per-length row (HIT, NOW, AFTER).
        self.largest: tuple[int, int, int] = (largest_hit, largest_now, largest_after)
        self.all_settled = all_settled != 0

    @property
    def rule(self) -> KindRule:
        """The rule of the group's kind."""
        return self.group.rule

    @property
    def verdicts(self) -> dict[tuple[int, int, int, Reason | None], GroupVerdict]:
        """The group's figures by (hit, usable, restorable, stop), shared between verdicts."""
        return self._statics.verdicts

    @property
    def paths(self) -> RestorePaths:
        """The restore paths of the group's table (as this lookup used them)."""
        return self._statics.paths

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
                raise ValueError(f"group {self.group.name!r}: its history was evaluated over "
                                 f"{history.lengths.size} lengths, not {self.lengths.size}")
            history_out, n_history, all_settled = history._out, history.n, history.all_settled
        else:
            self._has_index = False
            history_out, n_history, all_settled = _NO_HISTORY, 0, True
        spans = self.spans
        # Sized by the spans (made for these n blocks and lengths): the kernel writes by them.
        self._out = out = np.empty(spans.out_size, dtype=np.int64)
        self._raw = None
        high, low = self.words
        statics = self._statics
        # The kernel's version chosen here, not in Kernel.__call__: one frame and one repacking
        # of its ~30 arguments fewer on every lookup. A first pass calls the statics' entry
        # point, with the group's fixed arrays as one address table where they are laid out
        # as the pass views them (numba unboxes each array argument on every call): every
        # array but the statics' own is made the same way on every lookup (the prompt's
        # words are uint64 views of its chain, a history's output and this one are fresh
        # int64 arrays, the spans' rows a read-only int64 array), so numba's matching of
        # their types is skipped; a second pass, with checks computed here, is matched.
        if checked_ok is None and jit_settings.enabled:
            fixed = statics.fixed
            if fixed is not None:
                args: tuple[Any, ...] = (
                    high, low, fixed, history_out, n_history, _NO_CHECKED, spans.rows,
                    spans.prefix_step, check_mode, False, self._has_index, all_settled,
                    self._budget, self._capped, out)
                kernel = group_pass_fixed
            else:
                args = (high, low, *statics.arrays, history_out, n_history, _NO_CHECKED,
                        spans.rows, spans.prefix_step, check_mode, False, self._has_index,
                        all_settled, self._budget, self._capped, out)
                kernel = group_pass
            run = statics.entry
            if run is None:
                run = statics.entry = kernel.entry(*args)
            run(*args)
        else:
            args = (high, low, *statics.arrays, history_out, n_history,
                    _NO_CHECKED if checked_ok is None else checked_ok, spans.rows,
                    spans.prefix_step, check_mode, checked_ok is not None, self._has_index,
                    all_settled, self._budget, self._capped, out)
            if jit_settings.enabled:
                group_pass.compiled(*args)
            else:
                group_pass.twin(*args)
        scalars: list[int] = out[:N_SCALARS].tolist()
        total = scalars[RESTORES_TOTAL]
        if total and self._budget == BUDGET_UNKNOWN:
            # The plan restores something: its total against the budget (asked once).
            self._budget = self.group.restore_budget()
            if total > self._budget:
                return self._pass(checked_ok, check_mode)  # again, filtered by the budget
        return scalars

    # -- the pass's output, as views made when read (out_offsets' layout) -------------------

    def _bytes(self) -> NDArray[np.uint8]:
        """The byte part of the output: a fact byte per block, then the flag rows."""
        raw = self._raw
        if raw is None:
            raw = self._raw = self._out[self.spans.out_at[2]:].view(np.uint8)
        return raw

    def _flag_row(self, row: int, length: int) -> Bools:
        """Flag row ``row`` (of N_FLAGS), its first ``length`` entries."""
        n = self.n
        start = n + row * max(n, self.lengths.size)
        flags: Bools = self._bytes()[start : start + length].view(np.bool_)
        return flags

    @property
    def ids(self) -> NDArray[np.intp]:
        """Per block: its id in the group, -1 where its hash is not in the map."""
        ids_at, epochs_at, _, _ = self.spans.out_at
        return self._out[ids_at:epochs_at].view(np.intp)

    @property
    def epochs(self) -> NDArray[np.uint32]:
        """Each block's epoch as this lookup saw it (0 where missing)."""
        _, epochs_at, bytes_at, _ = self.spans.out_at
        epochs: NDArray[np.uint32] = self._out[epochs_at:bytes_at].view(np.uint32)[: self.n]
        return epochs

    @property
    def facts(self) -> NDArray[np.uint8]:
        """Per block: its fact bits (:mod:`kvfsm.verify._block_facts`)."""
        return self._bytes()[: self.n]

    @property
    def now_raw(self) -> Bools:
        """Per block: usable now, read raw."""
        return self._flag_row(NOW_RAW, self.n)

    @property
    def now_cmp(self) -> Bools:
        """Per block: usable now, read compressed."""
        return self._flag_row(NOW_CMP, self.n)

    @property
    def after_raw(self) -> Bools:
        """Per block: usable raw after the plan."""
        return self._flag_row(AFTER_RAW, self.n)

    @property
    def after_cmp(self) -> Bools:
        """Per block: usable compressed after the plan."""
        return self._flag_row(AFTER_CMP, self.n)

    @property
    def hit(self) -> Bools:
        """Per candidate length: every block the kind needs there is found by hash."""
        return self.row(HIT)

    @property
    def now(self) -> Bools:
        """Per candidate length: usable now."""
        return self.row(NOW)

    @property
    def after(self) -> Bools:
        """Per candidate length: usable after the plan."""
        return self.row(AFTER)

    def row(self, row: int) -> Bools:
        """Per-length row ``row`` (HIT, NOW, AFTER)."""
        return self._flag_row(N_PER_BLOCK + row, self.lengths.size)

    def holds(self, row: int, at: int) -> bool:
        """Per-length row ``row`` (HIT, NOW, AFTER) at candidate index ``at``."""
        n = self.n
        return bool(self._bytes()[n + (N_PER_BLOCK + row) * max(n, self.lengths.size) + at])

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
        return IndexCheck(self.group, safe, self._flag_row(FIT, self.n))

    # -- reasons ---------------------------------------------------------------------------

    def _need(self, length: int) -> tuple[int, int, int, bool]:
        """Blocks ``[lo, hi)`` needed at ``length`` (not clipped to the prompt's), those before
        ``cut`` compressed, and whether the kind can serve ``length`` at all: read off the
        spans at a candidate length, else asked of the kind's rule (kept per length: a
        verdict asks of the same few lengths several times)."""
        needs = self._needs
        if needs is None:
            needs = self._needs = {}
        known = needs.get(length)
        if known is not None:
            return known
        lengths = self.lengths
        at = int(lengths.searchsorted(length))
        if at < lengths.size and lengths[at] == length:
            lo, cut, hi = self.spans.needed[:, at].tolist()
            servable = self.spans.servable
            known = lo, cut, hi, servable is None or bool(servable[at])
        else:
            need = self.rule.needed(self.decl, np.array([length], dtype=np.int64))
            known = int(need.lo[0]), int(need.cut[0]), int(need.hi[0]), \
                need.servable is None or bool(need.servable[0])
        needs[length] = known
        return known

    def servable(self, length: int) -> bool:
        """The kind can serve ``length`` at all (whatever its blocks)."""
        return self._need(length)[3]

    def _forms(self, length: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The blocks needed at ``length`` by form, in order: ``(start, end, flag row)`` for
        the compressed ones, then the raw ones."""
        lo, cut, hi, _ = self._need(length)
        cut = min(max(cut, lo), hi)
        return (lo, cut, NOW_CMP), (cut, hi, NOW_RAW)

    def failing(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """The needed blocks at ``length`` that are not usable now, in order, and their needed
        form: slices of the usable-now rows (a block from the prompt's last on is missing)."""
        n = self.n
        parts = []
        forms = self._forms(length)
        for start, end, row in forms:
            inside_end = min(end, n)
            if start < inside_end:
                usable = self._flag_row(row, inside_end)[start:]
                parts.append(start + np.flatnonzero(~usable))
            if max(start, n) < end:
                parts.append(np.arange(max(start, n), end))
        if not parts:
            index = np.zeros(0, dtype=np.int64)
        else:
            index = (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(
                np.int64, copy=False)
        return index, index < forms[0][1]  # before the compressed blocks' end

    def first_failing(self, length: int) -> tuple[int, bool] | None:
        """The first of :meth:`failing` (its index and needed form), found without listing
        the others; None where every needed block is usable now."""
        n = self.n
        for start, end, row in self._forms(length):
            inside_end = min(end, n)
            if start < inside_end:
                usable = self._flag_row(row, inside_end)
                first = start + int(usable[start:].argmin())  # the first False
                if not usable[first]:
                    return first, row == NOW_CMP
            if max(start, n) < end:
                return max(start, n), row == NOW_CMP
        return None

    def freeze(self) -> None:
        """Take the snapshot every explanation of this evaluation reads (:meth:`frozen`):
        what :meth:`reason` and :meth:`reason_codes` read of the core. A lookup takes it
        before it returns, so a verdict's reasons and plan, made when first read, say what
        was so at the lookup: the blocks' states and recorded checks copied into the pass
        output's snapshot rows (one compiled call), the group's table and, for a sparse
        index with rows whose references failed, whether each is stale."""
        if self._snapshot is not None:
            return
        group = self.group
        record_failed = self.checksum_ok is None and self._recorded_checks
        take_snapshot(self._out, self.n, self.lengths.size, group.states, group.check,
                      record_failed)
        stale = None
        if self._has_index and self._history is not None:
            stale = np.zeros(self.n, dtype=np.bool_)
            ids = self.ids
            rows = np.flatnonzero(~self._flag_row(FIT, self.n))
            rows = rows[ids[rows] >= 0]  # found rows whose references failed
            if rows.size:
                index_check = self.index
                assert index_check is not None
                stale[rows] = index_check.stale_rows(rows)
        self._snapshot = (group.table, stale)

    def frozen(self) -> Frozen:
        """The snapshot (:meth:`freeze`, taken on the first call where the lookup did not)."""
        frozen = self._frozen
        if frozen is not None:
            return frozen
        self.freeze()
        assert self._snapshot is not None
        table, stale = self._snapshot
        n = self.n
        at = snapshot_at(n, self.lengths.size)
        rows = self._bytes()[at : at + SNAPSHOT_ROWS * n].reshape(SNAPSHOT_ROWS, n)
        failed = None
        if self.checksum_ok is None and self._recorded_checks:
            failed = rows[SNAPSHOT_FAILED].view(np.bool_)
        frozen = self._frozen = Frozen(table, rows[SNAPSHOT_STATE], failed, stale)
        return frozen

    def detach(self) -> None:
        """Let go of the group's live state and of its statics' arrays and pool, after
        :meth:`freeze` has read what explaining needs of them: an evaluation a verdict keeps
        to explain itself later holds the pass's output and the snapshot, not the core."""
        self.freeze()
        kept = self._statics.kept
        # Read afterwards only through the names the group and the statics share with it.
        self.group = cast(GroupState, kept)
        self._statics = cast(Statics, kept)
        self._history = None

    def reason_codes(self, index: NDArray[np.int64], compressed: Bools) -> Codes:
        """Why each block ``index[i]`` is not usable now in its needed form, as codes
        (:data:`~kvfsm.verify._why.BY_CODE`; 0 where it is): :meth:`reason` of many blocks
        at once, for listing them."""
        frozen = self.frozen()
        return reason_codes(
            index, compressed, n=self.n, facts=self.facts, states=frozen.states,
            table=frozen.table, paths=self.paths, missing=self.rule.missing,
            fit=self._flag_row(FIT, self.n) if frozen.stale is not None else None,
            stale=frozen.stale, align_ok=self.align_ok, checksum_ok=self.checksum_ok,
            failed_checks=frozen.failed_checks)

    def reason(self, index: int, compressed: bool) -> Reason | None:
        """Why block ``index`` is not usable now in the needed form (None when it is): the
        first check it fails, in the order the layers apply. One block, read as the rule
        states it (a verdict's per-group stop); :meth:`reason_codes` answers the same for
        many blocks in array operations, and a test holds the two to each other."""
        if index >= self.n:
            return self.rule.missing
        facts = int(self.facts[index])
        if not facts & FOUND:
            return self.rule.missing
        if not facts & PLACED:
            return Reason.POSITION_CONFLICT
        if not facts & WHOLE:
            return Reason.SUB_BLOCKS_MISSING
        frozen = self.frozen()
        if frozen.stale is not None and not self._flag_row(FIT, self.n)[index]:
            return Reason.INDEX_STALE if frozen.stale[index] else Reason.GROUP_GAP
        table = frozen.table
        state = int(frozen.states[index])
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
        if frozen.failed_checks is not None and frozen.failed_checks[index]:
            return Reason.CHECKSUM_MISMATCH  # seen failing by an earlier lookup
        return None


def evaluate(group: GroupState, high: NDArray[np.uint64], low: NDArray[np.uint64],
             lengths: NDArray[np.int64], level: Level, profile: DeviceProfile,
             history: GroupEval | None, checksums: bool, spans: Spans, statics: Statics,
             capped: bool) -> GroupEval:
    """A :class:`GroupEval` from arguments a lookup has already made and checked: ``spans``
    for these ``high.size`` blocks and ``lengths``, ``statics`` the group's for the layout
    read and ``profile`` (what the constructor checks and fills in, skipped)."""
    evaluation = _new_eval(GroupEval)
    evaluation._evaluate(group, high, low, lengths, level, profile, history, checksums, spans,
                         statics, capped)
    return evaluation


_new_eval = object.__new__
