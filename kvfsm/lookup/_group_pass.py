"""One group's part of a lookup, in one pass: block facts, checks, index references, "usable
at L" now and after the plan, and the restores the plan asks for.

:func:`group_pass` (compiled; uncompiled its source runs, ``tests/kernel_twins.py`` is the NumPy
reference) probes the hash table and writes all the verdict reads into one output
(:func:`out_offsets`). A block is *sound* when found, placed, whole, under the kernel's layout and
(an index) every reference holds; *usable now* in a form when sound, readable so and its checks
pass; *usable after the plan* when a content-preserving path reaches the form and an index's
targets already sit settled (moving a target bumps its epoch). See ``docs/verdict.md``."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import AddressTable, address_table, unowned
from kvfsm._jit import inlined, kernel, read_only
from kvfsm.kinds._sparse_index import (
    history_positions,
    index_rows,
    row_references,
    same_references,
)
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
    CHAIN_BLOCKS,
    FIT,
    FIXED_KINDS,
    HIT,
    LARGEST_AFTER,
    LARGEST_HIT,
    LARGEST_NOW,
    N_PER_BLOCK,
    N_SCALARS,
    N_SPAN_ROWS,
    NEEDS_CHECKSUMS,
    NOW,
    NOW_CMP,
    NOW_RAW,
    ONE_RUN_BLOCKS,
    P_ALIGNED,
    P_CODE_AT,
    P_FULL_SUB_MASK,
    P_HASHED_AT,
    P_LAYOUT_OK_AT,
    P_OWN_SIZE,
    P_RESTORES_CMP_AT,
    P_RESTORES_RAW_AT,
    P_SETTLED_FORM,
    P_TARGET_SIZE,
    PLAN_CHANGES,
    RESTORES_TOTAL,
    SETTLED_OK,
    SPAN_BASE,
    SPAN_CUT,
    SPAN_HI,
    SPAN_LO,
    fixed_arrays,
    flag_row,
    flag_start,
    history_parts,
    out_offsets,
    out_parts,
    pack_consts,
    snapshot_at,
)
from kvfsm.state import FAILED, UNCHECKED
from kvfsm.state._hashtable import (
    EMPTY_SLOT,
    READ_AHEAD,
    probe_keys,
)

Bools = NDArray[np.bool_]
Words = NDArray[np.uint64]

#: ``check_mode``: checksums ignored (``checksums=False``).
CHECKS_IGNORED: Final = 0
#: ``check_mode``: trust recorded checks: a readable block that failed one is bad; one unchecked
#: at its epoch sets NEEDS_CHECKSUMS (the caller calls again with ``checked_ok``).
CHECKS_RECORDED: Final = 1

#: ``budget`` unknown: nothing filtered; the caller passes it where RESTORES_TOTAL exceeds it.
BUDGET_UNKNOWN: Final = -1


def _group_pass_example() -> tuple[object, ...]:
    """Arguments of exactly the call site's types: words writable; fixed arrays (hash table
    writable, the rest read-only) as an address table; spans read-only; the rest fresh."""
    one_u8, one_i32 = read_only(np.zeros(1, dtype=np.uint8)), read_only(np.zeros(1, np.int32))
    one_u32 = read_only(np.zeros(1, np.uint32))
    words = np.zeros(1, dtype=np.uint64)
    consts = pack_consts(1, True, 1, 1, False, np.ones(1, np.bool_), np.zeros(1, np.uint8),
                         np.zeros((2, 1), np.bool_), np.ones(1, np.bool_))
    fixed = pack_fixed((
        np.full(8, EMPTY_SLOT, dtype=np.uint64), words.copy(), words.copy(),
        read_only(np.zeros(1, np.bool_)), one_u8, one_u32, one_i32,
        read_only(np.zeros(1, np.uint16)), one_u8, one_u8,
        read_only(np.full((1, 1), -1, dtype=np.int32)), read_only(np.zeros((1, 1), np.uint32)),
        one_u32, one_u8, one_i32, consts))
    return (
        words, words.copy(), fixed, np.zeros(out_offsets(0, 1)[3], np.int64), 0,
        np.ones(1, dtype=np.bool_), read_only(np.zeros((N_SPAN_ROWS, 1), np.int64)), 0,
        CHECKS_RECORDED, False, False, True, 0, False,
        # Zeros: the padding past the last row is never written; two runs are compared whole.
        np.zeros(out_offsets(1, 1)[3], np.int64))


def _plan_pass(ids: NDArray[np.int64], states: NDArray[np.uint8], consts: NDArray[np.int64],
               spans: NDArray[np.int64], now_raw: Bools, now_cmp: Bools, after_raw: Bools,
               after_cmp: Bools, after: Bools, asked: NDArray[np.int64],
               scalars: NDArray[np.int64], budget: int, capped: bool) -> None:
    """Where the plan changes a block: RESTORES_TOTAL, per length ``after`` and (kept) ``asked``."""
    n, count = ids.size, spans.shape[1]
    lo, cut, hi, base = spans[SPAN_LO], spans[SPAN_CUT], spans[SPAN_HI], spans[SPAN_BASE]
    restores_raw_at, restores_cmp_at = consts[P_RESTORES_RAW_AT], consts[P_RESTORES_CMP_AT]
    raw_after_bad = np.zeros(n + 1, dtype=np.int32)
    cmp_after_bad = np.zeros(n + 1, dtype=np.int32)
    raw_asked = np.zeros(n + 1, dtype=np.int32)
    cmp_asked = np.zeros(n + 1, dtype=np.int32)
    for i in range(n):
        block = ids[i]
        to_raw, to_cmp = after_raw[i], after_cmp[i]
        raw_after_bad[i + 1] = raw_after_bad[i] + (not to_raw)
        cmp_after_bad[i + 1] = cmp_after_bad[i] + (not to_cmp)
        restoring_raw = to_raw and not now_raw[i] and block >= 0 and \
            consts[restores_raw_at + states[block]] != 0
        restoring_cmp = to_cmp and not now_cmp[i] and block >= 0 and \
            consts[restores_cmp_at + states[block]] != 0
        raw_asked[i + 1] = raw_asked[i] + restoring_raw
        cmp_asked[i + 1] = cmp_asked[i] + restoring_cmp
    total = raw_asked[n] + cmp_asked[n]
    scalars[RESTORES_TOTAL] = total
    known = budget != BUDGET_UNKNOWN
    keep_asked = total > 0 and (capped or (known and total > budget))
    scalars[ASKED_KEPT] = keep_asked
    for k in range(count):
        start, middle, end = lo[k], cut[k], hi[k]
        after[k] = base[k] != 0 and raw_after_bad[end] == raw_after_bad[middle] and \
            cmp_after_bad[middle] == cmp_after_bad[start]
        if keep_asked:
            asked[k] = raw_asked[end] - raw_asked[middle] + cmp_asked[middle] - \
                cmp_asked[start]
            if known and asked[k] > budget:
                after[k] = False
    scalars[LARGEST_AFTER] = 0
    for k in range(count):
        if after[k]:
            scalars[LARGEST_AFTER] = k


def _pass_loop(
    high: Words, low: Words, slots: Words, block_high: Words, block_low: Words, mapped: Bools,
    states: NDArray[np.uint8], epoch: NDArray[np.uint32], position: NDArray[np.int32],
    sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8], check: NDArray[np.uint8],
    refs_target: NDArray[np.int32], refs_epoch: NDArray[np.uint32],
    target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8],
    target_position: NDArray[np.int32], consts: NDArray[np.int64], history: NDArray[np.int64],
    n_history: int, checked_ok: Bools, spans: NDArray[np.int64], prefix_step: int,
    check_mode: int, use_checked_ok: bool, has_index: bool, history_all_settled: bool,
    budget: int, capped: bool, out: NDArray[np.int64],
) -> None:
    """As :func:`group_pass`; ``checked_ok`` replaces ``check_mode`` where ``use_checked_ok``;
    ``history``: the index's target group's pass output (``history_all_settled``: no plan
    step moves a target); ``budget``: restores the gate lets begin now, or BUDGET_UNKNOWN. An
    index group's rows are checked first (:func:`index_rows`): the loop reads their answers."""
    n_history = n_history if has_index else 0
    n, count = high.size, spans.shape[1]
    scalars, asked, ids, epochs, facts, rows, width = out_parts(out, n, count)
    now_raw, now_cmp = flag_row(rows, NOW_RAW, width), flag_row(rows, NOW_CMP, width)
    after_raw, after_cmp = flag_row(rows, AFTER_RAW, width), flag_row(rows, AFTER_CMP, width)
    fit, settled_ok = flag_row(rows, FIT, width), flag_row(rows, SETTLED_OK, width)
    full_sub_mask, restore_aligned = consts[P_FULL_SUB_MASK], consts[P_ALIGNED] != 0
    code_at, layout_ok_at = consts[P_CODE_AT], consts[P_LAYOUT_OK_AT]
    home_words, raw_bad, cmp_bad, missing, epoch_at, first_row_at = _scratch(n, n_history)
    _probe_prompt(high, low, slots, block_high, block_low, mapped, ids, home_words)
    history_ids, history_settled = history_parts(history, n_history, count, consts)
    if has_index:
        history_positions(history_ids, target_states, target_epoch,
                          consts[consts[P_HASHED_AT]:], consts[P_TARGET_SIZE],
                          consts[P_OWN_SIZE], n, epoch_at, first_row_at)
        index_rows(ids, refs_target, refs_epoch, target_position, history_ids, history_settled,
                   history_all_settled, epoch_at, first_row_at, fit, settled_ok)
    else:
        fit[:n] = True
        settled_ok[:n] = True
    for i in range(N_SCALARS):
        scalars[i] = 0
    changes = needs_checksums = False
    raw_count = cmp_count = missing_count = first_raw_bad = 0
    chain_blocks = n
    for i in range(n):
        block = ids[i]
        if block < 0:
            block_facts = 0
            epochs[i] = 0
            if chain_blocks == n:
                chain_blocks = i
        else:
            epochs[i] = epoch[block]
            block_facts = _facts_of(block, i, states, position, sub_blocks, layout_id,
                                    consts, code_at, layout_ok_at, full_sub_mask)
        facts[i] = block_facts
        sound = (block_facts & SOUND) == SOUND and fit[i]
        ok = True
        if use_checked_ok:
            ok = checked_ok[i]
        elif check_mode == CHECKS_RECORDED and (block_facts & READABLE) != 0:
            ok = check[block] != FAILED
            needs_checksums |= check[block] == UNCHECKED
        is_raw, is_cmp, to_raw, to_cmp = _forms(block_facts, sound, ok, settled_ok[i],
                                                restore_aligned)
        if to_raw != is_raw or to_cmp != is_cmp:
            changes = True
        now_raw[i], now_cmp[i], after_raw[i], after_cmp[i] = is_raw, is_cmp, to_raw, to_cmp
        raw_count += not is_raw
        cmp_count += not is_cmp
        missing_count += block < 0
        first_raw_bad += raw_count == 0
        if not prefix_step:
            raw_bad[i + 1] = raw_count
            cmp_bad[i + 1] = cmp_count
            missing[i + 1] = missing_count
    scalars[CHAIN_BLOCKS], scalars[NEEDS_CHECKSUMS] = chain_blocks, needs_checksums
    scalars[ONE_RUN_BLOCKS] = _one_run(ids, epochs, chain_blocks)
    scalars[ALL_SETTLED] = (cmp_count if consts[P_SETTLED_FORM] != 0 else raw_count) == 0
    hit, now, after = flag_row(rows, N_PER_BLOCK + HIT, width), \
        flag_row(rows, N_PER_BLOCK + NOW, width), flag_row(rows, N_PER_BLOCK + AFTER, width)
    largest_hit, largest_now = _length_rows(spans, prefix_step, chain_blocks, first_raw_bad,
                                            missing, raw_bad, cmp_bad, hit, now, after)
    scalars[LARGEST_HIT], scalars[LARGEST_NOW] = largest_hit, largest_now
    scalars[LARGEST_AFTER] = largest_now
    scalars[PLAN_CHANGES] = changes
    if changes:
        _plan_pass(ids, states, consts, spans, now_raw, now_cmp, after_raw, after_cmp, after,
                   asked, scalars, budget, capped)


@inlined
def _scratch(n: int, n_history: int) -> tuple[Words, NDArray[np.int32], NDArray[np.int32],
                                              NDArray[np.int32], NDArray[np.uint32],
                                              NDArray[np.int64]]:
    """The pass's scratch, one allocation: the probe's read-ahead home slots; prefix counts of
    bad raw, bad compressed and missing blocks (entries past the first written before read);
    per history position its block's epoch (zeroed) and the first row allowed to point at it."""
    counts_at = n_history + min(READ_AHEAD, n)
    epochs_at = counts_at + (3 * (n + 1) + 1) // 2
    scratch = np.empty(epochs_at + (n_history + 1) // 2, dtype=np.int64)
    counts = scratch[counts_at:epochs_at].view(np.int32)
    raw_bad, cmp_bad, missing = counts[: n + 1], counts[n + 1 : 2 * n + 2], \
        counts[2 * n + 2 : 3 * n + 3]
    raw_bad[0] = cmp_bad[0] = missing[0] = 0
    epoch_at = scratch[epochs_at:].view(np.uint32)[:n_history]
    epoch_at[:] = 0
    return scratch[n_history:counts_at].view(np.uint64), raw_bad, cmp_bad, missing, epoch_at, \
        scratch[:n_history]


@inlined
def _probe_prompt(high: Words, low: Words, slots: Words, block_high: Words, block_low: Words,
                  mapped: Bools, ids: NDArray[np.int64], home_words: Words) -> None:
    """The prompt's block ids (-1: not found) into ``ids``. The block after the last found, if
    mapped under the next key's words, is that key's (a key maps once, a block under its own
    words): no table read. Else :func:`probe_keys`, up to READ_AHEAD home slots ahead."""
    n, n_blocks = high.size, block_high.size
    previous = -1
    i = 0
    while i < n:
        if previous >= 0:
            following = previous + 1
            if following < n_blocks and mapped[following] and \
                    block_low[following] == low[i] and block_high[following] == high[i]:
                ids[i] = following
                previous = following
                i += 1
                continue
        i = probe_keys(slots, block_high, block_low, high, low, ids, i,
                       min(i + (1 if previous >= 0 or i == 0 else READ_AHEAD), n), home_words,
                       True, True)
        previous = ids[i - 1]


@inlined
def _facts_of(block: int, i: int, states: NDArray[np.uint8], position: NDArray[np.int32],
              sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8],
              consts: NDArray[np.int64], code_at: int, layout_ok_at: int, full_sub_mask: int
              ) -> int:
    """The fact byte (:mod:`kvfsm.lookup._block_facts`) of ``block``, at prompt block ``i``."""
    facts = FOUND | (consts[code_at + states[block]] << CODE_SHIFT)
    if position[block] == i:
        facts |= PLACED
    if sub_blocks[block] == full_sub_mask:
        facts |= WHOLE
    if consts[layout_ok_at + layout_id[block]]:
        facts |= LAYOUT
    return int(facts)


@inlined
def _forms(facts: int, sound: bool, ok: bool, settled: bool, restore_aligned: bool
           ) -> tuple[bool, bool, bool, bool]:
    """Usable now and after the plan, raw and compressed (``settled``: its targets stay put)."""
    good = sound and ok
    is_raw = good and (facts & READ_RAW) != 0
    is_cmp = good and (facts & READ_COMPRESSED) != 0
    movable = restore_aligned and sound and not ((facts & READABLE) != 0 and not ok)
    to_raw = (is_raw or (movable and (facts & TO_RAW) != 0)) and settled
    to_cmp = (is_cmp or (movable and (facts & TO_COMPRESSED) != 0)) and settled
    return is_raw, is_cmp, to_raw, to_cmp


@inlined
def _one_run(ids: NDArray[np.int64], epochs: NDArray[np.uint32], chain_blocks: int) -> int:
    """:data:`ONE_RUN_BLOCKS`: ``chain_blocks`` where they are one run at one epoch, else 0."""
    if chain_blocks <= 0:
        return chain_blocks
    differ = 0
    run_first, run_epoch = ids[0], epochs[0]
    for i in range(chain_blocks):
        differ |= (ids[i] - (run_first + i)) | (epochs[i] ^ run_epoch)
    return chain_blocks if differ == 0 else 0


@inlined
def _length_rows(spans: NDArray[np.int64], prefix_step: int, chain_blocks: int,
                 first_raw_bad: int, missing: NDArray[np.int32], raw_bad: NDArray[np.int32],
                 cmp_bad: NDArray[np.int32], hit: Bools, now: Bools, after: Bools
                 ) -> tuple[int, int]:
    """Per length: hit, usable now and (until a plan says otherwise) after; returns the largest
    hit and usable. A raw prefix's rows (``prefix_step`` > 0) are true up to a point, then false."""
    count = spans.shape[1]
    largest_hit = largest_now = 0
    if prefix_step and count:
        largest_hit = min(count - 1, chain_blocks // prefix_step)
        largest_now = min(count - 1, first_raw_bad // prefix_step)
        hit[:largest_hit + 1] = True
        hit[largest_hit + 1:count] = False
        now[:largest_now + 1] = True
        now[largest_now + 1:count] = False
        after[:largest_now + 1] = True
        after[largest_now + 1:count] = False
        return largest_hit, largest_now
    lo, cut, hi, base = spans[SPAN_LO], spans[SPAN_CUT], spans[SPAN_HI], spans[SPAN_BASE]
    for k in range(count):
        start, middle, end = lo[k], cut[k], hi[k]
        served = base[k] != 0
        hit_here = served and missing[end] == missing[start]
        now_here = served and raw_bad[end] == raw_bad[middle] and \
            cmp_bad[middle] == cmp_bad[start]
        hit[k] = hit_here
        now[k] = now_here
        after[k] = now_here
        if hit_here:
            largest_hit = k
        if now_here:
            largest_now = k
    return largest_hit, largest_now


_PASS_CALLS: Final = (_plan_pass, probe_keys, fixed_arrays, out_offsets, snapshot_at, flag_start,
                      out_parts, flag_row, history_parts, _scratch, _probe_prompt, _facts_of,
                      _forms, _one_run, _length_rows, history_positions, index_rows,
                      row_references, same_references)


def pack_fixed(arrays: tuple[NDArray[Any], ...]) -> AddressTable:
    """The fixed arrays as one table; TypeError unless laid out as FIXED_KINDS (the core's are)."""
    table = address_table(arrays, FIXED_KINDS)
    if table is None:
        raise TypeError("the group pass takes its fixed arrays as FIXED_KINDS lays them out, "
                        f"got {[(a.dtype.name, a.ndim, a.flags.c_contiguous) for a in arrays]}")
    return table


@kernel(example=_group_pass_example, calls=(*_PASS_CALLS, _pass_loop))
def group_pass(
    high: Words, low: Words, fixed: NDArray[np.int64], history: NDArray[np.int64],
    n_history: int, checked_ok: Bools, spans: NDArray[np.int64], prefix_step: int,
    check_mode: int, use_checked_ok: bool, has_index: bool, history_all_settled: bool,
    budget: int, capped: bool, out: NDArray[np.int64],
) -> None:
    """Everything one group contributes to a verdict, into ``out``; fixed arrays as one address
    table (:func:`pack_fixed`). The caller holds the arrays for the call: views go unowned."""
    high, low, fixed, history, checked_ok, spans, out = unowned(high), unowned(low), \
        unowned(fixed), unowned(history), unowned(checked_ok), unowned(spans), unowned(out)
    slots, block_high, block_low, mapped, states, epoch, position, sub_blocks, layout_id, \
        check, refs_target, refs_epoch, target_epoch, target_states, target_position, \
        consts = fixed_arrays(fixed)
    _pass_loop(high, low, slots, block_high, block_low, mapped, states, epoch, position,
               sub_blocks, layout_id, check, refs_target, refs_epoch, target_epoch, target_states,
               target_position, consts, history, n_history, checked_ok, spans, prefix_step,
               check_mode, use_checked_ok, has_index, history_all_settled, budget, capped, out)
