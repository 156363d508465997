"""The NumPy reference of the lookup's and the lease's compiled kernels: the same rules as
array operations, one line per rule where the kernels loop. The test suite runs them as the
kernels' uncompiled path (:func:`install`, from ``tests/conftest.py``), so every test with
compiled kernels turned off checks the lookup against this second implementation, and the
differential test (``tests/test_jit.py``) compares each kernel compiled, as plain Python and
as its twin here. The package itself falls back to the kernels' plain-Python source."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import views
from kvfsm._jit import Kernel
from kvfsm.kinds._sparse_index import references_hold
from kvfsm.lookup import _group_pass, _lease_pass, _snapshot
from kvfsm.lookup._block_facts import (
    CODE_SHIFT,
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
)
from kvfsm.lookup._buffers import (
    AFTER,
    AFTER_CMP,
    AFTER_RAW,
    ALL_SETTLED,
    ASKED_KEPT,
    BLOCK,
    CHAIN_BLOCKS,
    CHUNK_PINS,
    EPOCH,
    FIRST_EPOCH,
    FIRST_ID,
    FIT,
    FULL,
    HEAD,
    HI,
    HIT,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    LAST_USE,
    LEASE_KINDS,
    LINKED_RUN,
    LIST_OF_STATE,
    LO,
    N_FLAGS,
    N_LEASE_ARRAYS,
    N_PER_BLOCK,
    NEEDS_CHECKSUMS,
    NEXT,
    NOW,
    NOW_CMP,
    NOW_RAW,
    ONE_READ,
    ONE_RUN_BLOCKS,
    OUTSIDE,
    P_ALIGNED,
    P_FULL_SUB_MASK,
    P_HASHED_AT,
    P_LAYOUT_OK_AT,
    P_OWN_SIZE,
    P_SETTLED_FORM,
    P_TARGET_SIZE,
    PINNED_AS,
    PINS,
    PLAN_CHANGES,
    PREV,
    RESTORES_TOTAL,
    SETTLED_OK,
    SHIFT,
    SNAPSHOT_FAILED,
    SNAPSHOT_STATE,
    SPAN_BASE,
    SPAN_CUT,
    SPAN_HI,
    SPAN_LO,
    STATES,
    TAIL,
    TAKEN,
    TARGET,
    TARGET_BLOCK,
    history_parts,
    out_parts,
    probed_ids,
    snapshot_rows,
)
from kvfsm.lookup._group_pass import BUDGET_UNKNOWN, CHECKS_RECORDED, FIXED_KINDS
from kvfsm.lookup._spans import Spans
from kvfsm.state import FAILED, NO_TARGET, UNCHECKED, _touch
from kvfsm.state._hashtable import probe_twin
from kvfsm.state._touch import (
    NO_LIST,
    ONE_BY_ONE,
    ONE_RUN,
    RUN_COUNT,
    RUN_FIRST,
    RUNS,
    no_linked_run,
    run_chunks,
)

Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]
Words = NDArray[np.uint64]
Lengths = NDArray[np.int64]



def prefix_counts(bad: Bools) -> NDArray[np.int64]:
    """``P[m]`` = number of set entries among the first ``m``."""
    out = np.zeros(bad.size + 1, dtype=np.int64)
    np.cumsum(bad, out=out[1:])
    return out


def usable_over(lo: Lengths, cut: Lengths, hi: Lengths, base: Bools, ok_raw: Bools,
                ok_cmp: Bools) -> Bools:
    """Per length: ``base`` and every block ok in its form over ``[lo, cut)`` / ``[cut, hi)``."""
    raw_bad, cmp_bad = prefix_counts(~ok_raw), prefix_counts(~ok_cmp)
    usable: Bools = base & (raw_bad[hi] == raw_bad[cut]) & (cmp_bad[cut] == cmp_bad[lo])
    return usable


def _last(vector: Bools) -> int:
    hits = np.flatnonzero(vector)
    return int(hits[-1]) if hits.size else 0


def arrays_pass_twin(
    high: Words, low: Words, slots: Words, block_high: Words, block_low: Words,
    mapped: Bools, states: NDArray[np.uint8], epoch: NDArray[np.uint32],
    position: NDArray[np.int32],
    sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8], check: NDArray[np.uint8],
    refs_target: NDArray[np.int32], refs_epoch: NDArray[np.uint32],
    target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8],
    target_position: NDArray[np.int32], consts: NDArray[np.int64],
    history: NDArray[np.int64], n_history: int, checked_ok: Bools, spans: NDArray[np.int64],
    prefix_step: int, check_mode: int,
    use_checked_ok: bool, has_index: bool, history_all_settled: bool, budget: int,
    capped: bool, out: NDArray[np.int64],
) -> None:
    """:func:`group_pass` as array operations (the reference)."""
    n, count = high.size, spans.shape[1]
    scalars, asked, ids, epochs, facts, flags = out_views(out, n, count)
    probe_twin(slots, block_high, block_low, high, low, ids, True)
    per_block, per_length = flags[:N_PER_BLOCK, :n], flags[N_PER_BLOCK:, :count]
    full_sub_mask, restore_aligned = consts[P_FULL_SUB_MASK], consts[P_ALIGNED] != 0
    target_size, own_size = consts[P_TARGET_SIZE], consts[P_OWN_SIZE]
    layout_ok, code, restores_raw, restores_cmp, hashed = consts_tables(consts)
    layout_ok, restores_raw, restores_cmp = (table != 0 for table in (
        layout_ok, restores_raw, restores_cmp))
    hashed = hashed != 0
    lo, cut, hi, base = spans[SPAN_LO], spans[SPAN_CUT], spans[SPAN_HI], spans[SPAN_BASE] != 0
    now_raw, now_cmp, after_raw = per_block[NOW_RAW], per_block[NOW_CMP], per_block[AFTER_RAW]
    after_cmp, fit, settled_ok = per_block[AFTER_CMP], per_block[FIT], per_block[SETTLED_OK]
    hit, now, after = per_length[HIT], per_length[NOW], per_length[AFTER]
    found = ids >= 0
    safe = np.where(found, ids, 0)
    facts[:] = code[states[safe]].astype(np.uint8) << CODE_SHIFT
    facts |= FOUND
    facts[position[safe] == np.arange(n)] |= PLACED
    facts[sub_blocks[safe] == full_sub_mask] |= WHOLE
    facts[layout_ok[layout_id[safe]]] |= LAYOUT
    facts[~found] = 0
    epochs[:] = np.where(found, epoch[safe], 0)
    readable = (facts & READABLE) != 0
    sound = (facts & SOUND) == SOUND
    scalars[:] = 0
    scalars[CHAIN_BLOCKS] = int(np.argmin(found)) if not found.all() else n
    scalars[ONE_RUN_BLOCKS] = one_run_blocks(ids, epochs)
    if use_checked_ok:
        ok = checked_ok.copy()
    elif check_mode == CHECKS_RECORDED:
        recorded = check[safe]
        ok = ~(readable & (recorded == FAILED))
        scalars[NEEDS_CHECKSUMS] = int(bool((readable & (recorded == UNCHECKED)).any()))
    else:
        ok = np.ones(n, dtype=np.bool_)
    # The index's references: current, of this prompt's history, complete before the row ends.
    fit[:] = True
    settled_ok[:] = True
    if has_index and n:
        history_ids, history_settled = history_parts(history, n_history, count, consts)
        refs = references_hold(
            refs_target[safe], refs_epoch[safe], np.arange(n, dtype=np.int64),
            target_epoch=target_epoch, target_states=target_states, hashed=hashed,
            target_position=target_position, history_ids=history_ids[:n_history],
            target_size=int(target_size), own_size=int(own_size))
        used, ours, at = refs.used, refs.ours, refs.at
        fit[:] = refs.fit
        if not history_all_settled:
            settled = ours & (history_settled[at] if n_history else np.zeros_like(ours))
            settled_ok[:] = ~((used & ~settled) | (refs_target[safe] < NO_TARGET)).any(axis=1)
        fit &= found
        settled_ok[~found] = True
        sound &= fit
    good_now = sound & ok
    now_raw[:] = good_now & ((facts & READ_RAW) != 0)
    now_cmp[:] = good_now & ((facts & READ_COMPRESSED) != 0)
    movable = sound & ~(readable & ~ok) if restore_aligned else np.zeros(n, dtype=np.bool_)
    after_raw[:] = (now_raw | (movable & ((facts & TO_RAW) != 0))) & settled_ok
    after_cmp[:] = (now_cmp | (movable & ((facts & TO_COMPRESSED) != 0))) & settled_ok
    hit[:] = usable_over(lo, cut, hi, base, found, found)
    now[:] = usable_over(lo, cut, hi, base, now_raw, now_cmp)
    if np.array_equal(after_raw, now_raw) and np.array_equal(after_cmp, now_cmp):
        after[:] = now
    else:
        scalars[PLAN_CHANGES] = 1
        state = states[safe]
        raw_restores = ~now_raw & after_raw & restores_raw[state]
        cmp_restores = ~now_cmp & after_cmp & restores_cmp[state]
        total = int(raw_restores.sum()) + int(cmp_restores.sum())
        after[:] = usable_over(lo, cut, hi, base, after_raw, after_cmp)
        scalars[RESTORES_TOTAL] = total
        known = budget != BUDGET_UNKNOWN
        if total and (capped or (known and total > budget)):
            raw_count, cmp_count = prefix_counts(raw_restores), prefix_counts(cmp_restores)
            asked[:] = raw_count[hi] - raw_count[cut] + cmp_count[cut] - cmp_count[lo]
            scalars[ASKED_KEPT] = 1
            if known:
                after &= asked <= budget
    scalars[LARGEST_HIT], scalars[LARGEST_NOW] = _last(hit), _last(now)
    scalars[LARGEST_AFTER] = _last(after)
    settled = now_cmp if consts[P_SETTLED_FORM] else now_raw
    scalars[ALL_SETTLED] = int(bool(settled.all()))


def group_pass_twin(
    high: Words, low: Words, fixed: NDArray[np.int64], history: NDArray[np.int64],
    n_history: int, checked_ok: Bools, spans: NDArray[np.int64], prefix_step: int,
    check_mode: int,
    use_checked_ok: bool, has_index: bool, history_all_settled: bool, budget: int,
    capped: bool, out: NDArray[np.int64],
) -> None:
    """:func:`group_pass_fixed` in NumPy."""
    twin: Any = arrays_pass_twin  # the arrays come as one tuple, typed loosely
    twin(high, low, *views(fixed, FIXED_KINDS), history, n_history, checked_ok, spans,
         prefix_step, check_mode,
         use_checked_ok, has_index, history_all_settled, budget, capped, out)


def consts_tables(consts: NDArray[np.int64]) -> tuple[NDArray[np.int64], ...]:
    """The tables of ``consts``: layout_ok, code, restores raw, restores compressed, hashed."""
    bounds = [*consts[P_LAYOUT_OK_AT : P_HASHED_AT + 1].tolist(), consts.size]
    return tuple(consts[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1))


def out_views(out: NDArray[np.int64], n: int, count: int
              ) -> tuple[NDArray[np.int64], NDArray[np.int64], IdArray, NDArray[np.uint32],
                         NDArray[np.uint8], Bools]:
    """Views of ``out``: scalars, asked, ids, epochs, facts, flags ``[N_FLAGS, width]``
    (:func:`out_parts`, shaped for array operations)."""
    scalars, asked, ids, epochs, facts, rows, width = out_parts(out, n, count)
    return scalars, asked, ids.view(np.intp), epochs[:n], facts, rows.reshape(N_FLAGS, width)


def one_run_blocks(ids: NDArray[np.int64], epochs: NDArray[np.uint32]) -> int:
    """:data:`ONE_RUN_BLOCKS` of ``ids`` (-1 where missing) and ``epochs``, in NumPy."""
    found = ids >= 0
    chain = ids.size if found.all() else int(np.argmin(found))
    if chain == 0:
        return 0
    run = (ids[:chain] == ids[0] + np.arange(chain)) & (epochs[:chain] == epochs[0])
    return chain if run.all() else 0


def leased_arrays(arrays: NDArray[np.int64], g: int) -> tuple[NDArray[Any], ...]:
    """Group ``g``'s arrays of a lease's address table, as views (for the twins)."""
    return views(arrays, LEASE_KINDS, g * N_LEASE_ARRAYS)


def take_twin(outs: tuple[NDArray[np.int64], ...], bounds: NDArray[np.int64],
               offsets: NDArray[np.int64], at: int, fixed: NDArray[np.int64],
               arrays: NDArray[np.int64], tick: int, max_pins: int, answers: NDArray[np.int64]
               ) -> tuple[int, int, int, int]:
    """:func:`take_probed_loop` with each group's touch as :func:`touch_twin`."""
    spans = bounds[:, :, at].reshape(-1, 2)
    outside, one_runs = 0, 0
    for g, (lo, hi) in enumerate(spans.tolist()):
        target = int(fixed[g, TARGET])
        if target >= 0 and hi > lo:
            reach = hi * int(fixed[g, BLOCK]) // int(fixed[g, TARGET_BLOCK])
            if spans[target, 0] != 0 or spans[target, 1] < reach:
                outside = 1
    touched = 0
    for g, (lo, hi) in enumerate(spans.tolist()):
        answers[g] = (-1, -1, 0, 0, -1, 0, lo, hi)
        if hi <= lo:
            continue
        ids, seen = probed_ids(outs[g], int(offsets[g][0]), int(offsets[g][1]), lo, hi)
        views = leased_arrays(arrays, g)
        touch_twin(ids, views[STATES], views[LIST_OF_STATE], views[LAST_USE], tick + touched,
                    views[PREV], views[NEXT], views[HEAD], views[TAIL], seen, views[PINS],
                    views[CHUNK_PINS], int(fixed[g, SHIFT]), max_pins, views[LINKED_RUN],
                    answers[g])
        if answers[g, OUTSIDE] >= 0 or answers[g, FULL] >= 0:
            return g, touched, one_runs, outside
        answers[g, FIRST_ID], answers[g, FIRST_EPOCH] = ids[0], seen[0]
        touched += 1
        one_runs += int(answers[g, ONE_READ])
    return TAKEN, touched, one_runs, outside


def unpin_probed_twin(outs: tuple[NDArray[np.int64], ...],
                       offsets: NDArray[np.int64], fixed: NDArray[np.int64],
                       arrays: NDArray[np.int64], answers: NDArray[np.int64],
                       groups: int) -> None:
    """:func:`unpin_probed_loop` with each group's unpin as its NumPy twin."""
    for g in range(groups):
        lo, hi = int(answers[g, LO]), int(answers[g, HI])
        if hi > lo:
            ids, seen = probed_ids(outs[g], int(offsets[g][0]), int(offsets[g][1]), lo, hi)
            views = leased_arrays(arrays, g)
            unpin_twin(ids, seen, views[EPOCH], views[PINS], views[CHUNK_PINS],
                        int(fixed[g, SHIFT]), int(answers[g, PINNED_AS]))


def first_moved_twin(ids: IdArray, recorded: NDArray[np.uint32], states: NDArray[np.uint8],
                      epoch: NDArray[np.uint32], readable: NDArray[np.bool_],
                      check: NDArray[np.uint8], out: NDArray[np.int64]) -> None:
    bad = np.flatnonzero((epoch[ids] != recorded) | ~readable[states[ids]]
                         | (check[ids] == FAILED))
    out[0] = int(bad[0]) if bad.size else -1


def take_snapshot_twin(out: NDArray[np.int64], n: int, count: int,
                        states: NDArray[np.uint8], check: NDArray[np.uint8],
                        record_failed: bool) -> None:
    """:func:`take_snapshot` as array operations (the reference)."""
    _, _, ids, _, _, _ = out_views(out, n, count)
    rows = snapshot_rows(out, n, count)
    found = ids >= 0
    safe = np.where(found, ids, 0)
    rows[SNAPSHOT_STATE] = np.where(found, states[safe], 0)
    rows[SNAPSHOT_FAILED] = found & (check[safe] == FAILED) if record_failed else 0


def unpin_twin(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
                pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
                run: int) -> None:
    """:func:`unpin_loop` as array operations."""
    if run != ONE_BY_ONE:
        inside, chunks = run_chunks(ids, shift)
        chunks = chunks[chunk_pins[chunks] > 0]
        chunk_pins[chunks] -= np.uint16(1)
        ids, recorded = ids[~inside], recorded[~inside]
    unmoved = ids[epoch[ids] == recorded]
    held = unmoved[pins[unmoved] > 0]
    pins[held] -= np.uint16(1)


def touch_twin(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                linked_run: NDArray[np.int64], out: NDArray[np.int64], one_run: bool = False
                ) -> None:
    """:func:`~kvfsm.state._touch._touch_known` in NumPy (the reference), every link read
    (``one_run`` only tells what the ids are)."""
    # Imported here: the recency lists' module uses this one's kernel.
    from kvfsm.state._recency import relink_loop

    out[:4] = (-1, -1, 0, 0)
    outside = np.flatnonzero((ids < 0) | (ids >= last_use.size))
    if outside.size:
        out[0] = outside[0]
        return
    count = ids.size
    known_first, known_count = int(linked_run[RUN_FIRST]), int(linked_run[RUN_COUNT])
    overlaps = bool(((ids >= known_first) & (ids < known_first + known_count)).any())
    consecutive = count > 0 and bool((ids == ids[0] + np.arange(count)).all())
    listed_first = int(list_of_state[states[ids[0]]]) if count else NO_LIST
    in_order = count > 1 and listed_first != NO_LIST and consecutive and \
        bool((next_[ids[:-1]] == ids[1:]).all())
    if max_pins > 0 and count:
        out[3] = consecutive and bool((seen == seen[0]).all())
        inside, chunks = run_chunks(ids, shift)
        ends = ~inside
        full = np.flatnonzero(inside & (chunk_pins[ids >> shift] >= max_pins)
                              | ends & (pins[ids] >= max_pins))
        if full.size:
            out[1] = full[0]
            return
        if chunks.size:
            chunk_pins[chunks] += np.uint16(1)
            out[2] = ONE_RUN if consecutive else RUNS
        pins[ids[ends]] += np.uint16(1)
    if in_order:
        linked_run[:] = (ids[0], count, listed_first)
    elif overlaps:
        linked_run[:] = (0, 0, NO_LIST)
    last_use[ids] = tick
    lists = list_of_state[states[ids]]
    on = np.flatnonzero(lists != NO_LIST)
    # The record is this touch's own (set above): the relinks are not to forget it.
    relink_loop(prev, next_, head, tail, ids[on], lists[on], lists[on], no_linked_run())


def usable_at(spans: Spans, ok_raw: Bools, ok_cmp: Bools) -> Bools:
    """Per candidate length: every block the kind needs there is ok in its form: ``ok_cmp``
    over ``[lo, cut)``, ``ok_raw`` over ``[cut, hi)``."""
    return usable_over(spans.lo, spans.cut, spans.hi, spans.base, ok_raw, ok_cmp)


#: Each kernel of the lookup and the lease, and its NumPy twin.
TWINS: dict[Kernel, Any] = {
    _group_pass.group_pass: group_pass_twin,
    _snapshot.take_snapshot: take_snapshot_twin,
    _lease_pass.take_probed_kernel: take_twin,
    _lease_pass.unpin_probed_kernel: unpin_probed_twin,
    _lease_pass.first_moved_kernel: first_moved_twin,
    _touch.touch_kernel: touch_twin,
}


def install() -> None:
    """Make each kernel's twin its reference here: what runs with compiled kernels off."""
    for each, twin in TWINS.items():
        each.twin = twin
