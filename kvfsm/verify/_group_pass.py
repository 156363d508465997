"""One group's part of a lookup in one pass: block facts, checks, the index's references,
"usable at L" now and after the plan, and the restores the plan asks for.

:func:`group_pass` is a compiled kernel (:mod:`kvfsm._jit`) over plain arrays: the prompt's
block ids in this group (from the hash probe), the group's metadata, its index references and
the prompt's history (for a sparse index), the kind's needed spans per candidate length, and
the admission budget. It writes every per-block and per-length array the verdict reads, plus a
few scalars. Its NumPy twin computes the same arrays with array operations and is the
reference: a differential test runs both on random inputs. One call per group replaces the
thirty-odd NumPy calls per group a lookup used to make, which dominated short prompts.

The layers (see ``docs/verdict.md``): a block is *sound* when found by hash, recorded at this
position, whole, under the layout the kernel reads, and (an index) every reference current and
of this prompt's history; *usable now* in a form when sound, readable in that form, and its
checks (alignment, checksums) pass; *usable after the plan* when a content-preserving path of
the table reaches the form (and, for an index, its targets already sit settled, since moving a
target bumps its epoch). Lengths are usable when every block of the kind's spans is usable in
its form there.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.verify._block_facts import (
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

Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]
Lengths = NDArray[np.int64]

#: ``check_mode``: data checksums are not looked at (``checksums=False``).
CHECKS_IGNORED: Final = 0
#: ``check_mode``: a reduced level trusts earlier passes; a readable block that failed a check
#: is bad, and one never checked at its epoch needs a checksum first (scalar NEEDS_CHECKSUMS:
#: the caller computes them and calls again with ``checked_ok``).
CHECKS_RECORDED: Final = 1

#: Recorded check states (as :mod:`kvfsm.state` keeps them).
_UNCHECKED: Final = 0
_FAILED: Final = 2
#: An unused index reference.
_NO_TARGET: Final = -1

# Indices of the ``longs`` output: these scalars, then ``asked`` (one per candidate length).
#: Blocks from the prompt's start that the hash chain finds, before the first miss.
CHAIN_BLOCKS: Final = 0
#: 1 when a readable block was never checked at its epoch (CHECKS_RECORDED mode only).
NEEDS_CHECKSUMS: Final = 1
#: 1 when the plan changes what is usable somewhere (``after`` differs from ``now`` inputs).
PLAN_CHANGES: Final = 2
#: 1 when ``asked`` holds the restores the plan asks for per length (the caller keeps it).
ASKED_KEPT: Final = 3
#: Last candidate index where ``hit`` / ``now`` / ``after`` is True (0 when none).
LARGEST_HIT: Final = 4
LARGEST_NOW: Final = 5
LARGEST_AFTER: Final = 6
#: 1 when every block of the prompt is usable now in the form ``P_SETTLED_FORM`` names.
ALL_SETTLED: Final = 7
N_SCALARS: Final = 8

# Indices of the ``params`` input: what never changes for a group (integers; flags 0 or 1).
#: The sub-block mask of a whole block.
P_FULL_SUB_MASK: Final = 0
#: The device pool's construction guarantees alignment (restored blocks land aligned).
P_ALIGNED: Final = 1
#: Block sizes of the index's target group and of this group (an index only).
P_TARGET_SIZE: Final = 2
P_OWN_SIZE: Final = 3
#: The form this group's kind settles in: 1 compressed, 0 raw (for ALL_SETTLED).
P_SETTLED_FORM: Final = 4
N_PARAMS: Final = 5

# Rows of ``flags``: first the per-block rows (one column per prompt block), then the
# per-length rows (one column per candidate length), each row as long as the longer of the two.
NOW_RAW, NOW_CMP, AFTER_RAW, AFTER_CMP, FIT, SETTLED_OK = range(6)
N_PER_BLOCK: Final = 6
HIT, NOW, AFTER = range(3)
N_PER_LENGTH: Final = 3
N_FLAGS: Final = N_PER_BLOCK + N_PER_LENGTH


def _group_pass_example() -> tuple[object, ...]:
    """Arguments of exactly the call site's types: metadata, tables and references are
    read-only views of the core's arrays; spans and restore facts are cached read-only;
    everything else of the prompt is a fresh array."""
    one_u8, one_i32 = read_only(np.zeros(1, dtype=np.uint8)), read_only(np.zeros(1, np.int32))
    one_u32 = read_only(np.zeros(1, np.uint32))
    return (
        np.full(1, -1, dtype=np.intp), one_u8, one_u32, one_i32,
        read_only(np.zeros(1, np.uint16)), one_u8, read_only(np.ones(1, dtype=np.bool_)),
        np.zeros(1, np.uint8), one_u8,
        read_only(np.full((1, 1), -1, dtype=np.int32)), read_only(np.zeros((1, 1), np.uint32)),
        one_u32, one_u8, read_only(np.ones(1, dtype=np.bool_)), one_i32,
        read_only(np.zeros((2, 1), dtype=np.bool_)), read_only(np.ones(N_PARAMS, np.int64)),
        np.full(1, -1, np.intp), np.zeros(1, dtype=np.bool_), np.ones(1, dtype=np.bool_),
        read_only(np.zeros((3, 1), np.int64)), read_only(np.ones(1, dtype=np.bool_)),
        CHECKS_RECORDED, False, False, True, 0, False,
        np.empty(1, np.uint8), np.empty(1, np.uint32), np.empty((N_FLAGS, 1), np.bool_),
        np.empty(N_SCALARS + 1, np.int64))


def _group_pass_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A small group drawn freely: prompt ids with misses, metadata that matches its position,
    layout and sub-blocks or not, random per-state codes and checks, an index (sometimes) whose
    references into a small target group are right, stale, out of order or out of range, a
    history partly settled, random spans per length (some lengths unservable), and a budget
    from none to plenty."""
    n_blocks, n_states, n_layouts = (int(rng.integers(1, high)) for high in (13, 6, 4))
    n, n_lengths = int(rng.integers(0, 11)), int(rng.integers(1, 8))
    ids = rng.integers(-1, n_blocks, n).astype(np.intp)
    if rng.random() < 0.3:
        ids = np.sort(ids)  # runs of one block: neighbouring rows with the same references
    position = rng.integers(-1, 9, n_blocks).astype(np.int32)
    for i, block in enumerate(ids.tolist()):
        if block >= 0 and rng.random() < 0.7:
            position[block] = i
    full_sub_mask = int(rng.choice([1, 3]))
    sub_blocks = np.where(rng.random(n_blocks) < 0.8, full_sub_mask,
                          rng.integers(0, 4, n_blocks)).astype(np.uint16)
    layout_ok = rng.random(n_layouts) < 0.7
    has_index = bool(rng.random() < 0.5)
    n_targets, top_k, n_history = (int(rng.integers(1, high)) for high in (9, 4, 9))
    refs_target = rng.integers(-3, n_targets + 2, (n_blocks, top_k)).astype(np.int32)
    refs_target[rng.random((n_blocks, top_k)) < 0.3] = _NO_TARGET
    target_epoch = rng.integers(0, 2, n_targets).astype(np.uint32)
    refs_epoch = target_epoch[np.clip(refs_target, 0, n_targets - 1)]
    refs_epoch[refs_target == _NO_TARGET] = 0
    refs_epoch[rng.random((n_blocks, top_k)) < 0.1] ^= 1
    # Blocks holding another's references (neighbouring index rows usually do).
    copied = rng.random(n_blocks) < 0.4
    source = rng.integers(0, n_blocks, int(copied.sum()))
    refs_target[copied], refs_epoch[copied] = refs_target[source], refs_epoch[source]
    history_ids = rng.permutation(max(n_targets, n_history))[:n_history].astype(np.intp)
    history_ids[(history_ids >= n_targets) | (rng.random(n_history) < 0.15)] = -1
    target_position = np.full(n_targets, -1, dtype=np.int32)
    held = np.flatnonzero(history_ids >= 0)
    target_position[history_ids[held]] = held
    wrong = rng.random(n_targets) < 0.15
    target_position[wrong] = rng.integers(-1, n_history + 2, int(wrong.sum()))
    history_settled = rng.random(n_history) < rng.choice([0.5, 0.9])
    hi = rng.integers(0, n + 1, n_lengths)
    cut = np.minimum(rng.integers(0, n + 1, n_lengths), hi)
    lo = np.minimum(rng.integers(0, n + 1, n_lengths), cut)
    restores = np.stack([rng.random(n_states) < 0.5, rng.random(n_states) < 0.5])
    params = np.zeros(N_PARAMS, dtype=np.int64)
    params[P_FULL_SUB_MASK], params[P_ALIGNED] = full_sub_mask, rng.random() < 0.8
    params[P_TARGET_SIZE], params[P_OWN_SIZE] = rng.choice([16, 64]), rng.choice([16, 64])
    params[P_SETTLED_FORM] = rng.random() < 0.5
    return (
        ids, read_only(rng.integers(0, n_states, n_blocks).astype(np.uint8)),
        read_only(rng.integers(0, 5, n_blocks).astype(np.uint32)), read_only(position),
        read_only(sub_blocks), read_only(rng.integers(0, n_layouts, n_blocks).astype(np.uint8)),
        read_only(layout_ok), rng.integers(0, 16, n_states).astype(np.uint8),
        read_only(rng.integers(0, 3, n_blocks).astype(np.uint8)),
        read_only(refs_target), read_only(refs_epoch), read_only(target_epoch),
        read_only(rng.integers(0, n_states, n_targets).astype(np.uint8)),
        read_only(rng.random(n_states) < 0.8), read_only(target_position), read_only(restores),
        read_only(params), history_ids, history_settled, rng.random(n) < 0.8,
        read_only(np.stack([lo, cut, hi]).astype(np.int64)),
        read_only(rng.random(n_lengths) < 0.9), int(rng.integers(0, 2)),
        bool(rng.random() < 0.3), has_index, bool(history_settled.all()),
        int(rng.integers(0, 6)), bool(rng.random() < 0.5),
        np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint32),
        np.empty((N_FLAGS, max(n, n_lengths)), dtype=np.bool_),
        np.empty(N_SCALARS + n_lengths, dtype=np.int64))


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


def _group_pass_twin(
    ids: IdArray, states: NDArray[np.uint8], epoch: NDArray[np.uint32],
    position: NDArray[np.int32], sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8],
    layout_ok: Bools, code: NDArray[np.uint8], check: NDArray[np.uint8],
    refs_target: NDArray[np.int32], refs_epoch: NDArray[np.uint32],
    target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8], hashed: Bools,
    target_position: NDArray[np.int32], restores: Bools, params: NDArray[np.int64],
    history_ids: IdArray, history_settled: Bools, checked_ok: Bools,
    spans: NDArray[np.int64], base: Bools, check_mode: int, use_checked_ok: bool,
    has_index: bool, history_all_settled: bool, budget: int, capped: bool,
    facts: NDArray[np.uint8], epochs: NDArray[np.uint32], flags: Bools,
    longs: NDArray[np.int64],
) -> None:
    """:func:`group_pass` as array operations (the reference)."""
    n, count = ids.size, spans.shape[1]
    scalars, asked = longs[:N_SCALARS], longs[N_SCALARS:]
    per_block, per_length = flags[:N_PER_BLOCK, :n], flags[N_PER_BLOCK:, :count]
    full_sub_mask, restore_aligned = params[P_FULL_SUB_MASK], params[P_ALIGNED] != 0
    target_size, own_size = params[P_TARGET_SIZE], params[P_OWN_SIZE]
    lo, cut, hi = spans[0], spans[1], spans[2]
    restores_raw, restores_cmp = restores[0], restores[1]
    now_raw, now_cmp, after_raw = per_block[NOW_RAW], per_block[NOW_CMP], per_block[AFTER_RAW]
    after_cmp, fit, settled_ok = per_block[AFTER_CMP], per_block[FIT], per_block[SETTLED_OK]
    hit, now, after = per_length[HIT], per_length[NOW], per_length[AFTER]
    found = ids >= 0
    safe = np.where(found, ids, 0)
    facts[:] = code[states[safe]] << CODE_SHIFT
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
    # Layers 1 and 4: the caller's combined checks, or the recorded checks.
    if use_checked_ok:
        ok = checked_ok.copy()
    elif check_mode == CHECKS_RECORDED:
        recorded = check[safe]
        ok = ~(readable & (recorded == _FAILED))
        scalars[NEEDS_CHECKSUMS] = int(bool((readable & (recorded == _UNCHECKED)).any()))
    else:
        ok = np.ones(n, dtype=np.bool_)
    # The index's references: current, of this prompt's history, complete before the row ends.
    fit[:] = True
    settled_ok[:] = True
    if has_index and n:
        refs = refs_target[safe]
        epochs = refs_epoch[safe]
        n_targets, n_history = target_epoch.size, history_ids.size
        used = refs != _NO_TARGET
        in_range = (refs >= 0) & (refs < n_targets)
        held = np.where(in_range, refs, 0)
        at = target_position[held]
        placed = in_range & (at >= 0) & (at < n_history)
        at = np.where(placed, at, 0)
        ours = placed & (history_ids[at] == held) if n_history else np.zeros_like(placed)
        alive = hashed[target_states[held]]
        first_row = ((at.astype(np.int64) + 1) * target_size + own_size - 1) // own_size - 1
        rows = np.arange(n)[:, None]
        good = ours & alive & (target_epoch[held] == epochs) & (first_row <= rows)
        bad = np.where(used, ~good, epochs != 0)
        fit[:] = ~bad.any(axis=1)
        if not history_all_settled:
            settled = ours & (history_settled[at] if n_history else np.zeros_like(placed))
            settled_ok[:] = ~((used & ~settled) | (refs < _NO_TARGET)).any(axis=1)
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
    asked[:] = 0
    if np.array_equal(after_raw, now_raw) and np.array_equal(after_cmp, now_cmp):
        after[:] = now
    else:
        scalars[PLAN_CHANGES] = 1
        state = states[safe]
        raw_restores = ~now_raw & after_raw & restores_raw[state]
        cmp_restores = ~now_cmp & after_cmp & restores_cmp[state]
        total = int(raw_restores.sum()) + int(cmp_restores.sum())
        after[:] = usable_over(lo, cut, hi, base, after_raw, after_cmp)
        if total and (total > budget or capped):
            raw_count, cmp_count = prefix_counts(raw_restores), prefix_counts(cmp_restores)
            asked[:] = raw_count[hi] - raw_count[cut] + cmp_count[cut] - cmp_count[lo]
            scalars[ASKED_KEPT] = 1
            after &= asked <= budget
    scalars[LARGEST_HIT], scalars[LARGEST_NOW] = _last(hit), _last(now)
    scalars[LARGEST_AFTER] = _last(after)
    settled = now_cmp if params[P_SETTLED_FORM] else now_raw
    scalars[ALL_SETTLED] = int(bool(settled.all()))


@kernel(example=_group_pass_example, twin=_group_pass_twin, inputs=_group_pass_inputs)
def group_pass(
    ids: IdArray, states: NDArray[np.uint8], epoch: NDArray[np.uint32],
    position: NDArray[np.int32], sub_blocks: NDArray[np.uint16], layout_id: NDArray[np.uint8],
    layout_ok: Bools, code: NDArray[np.uint8], check: NDArray[np.uint8],
    refs_target: NDArray[np.int32], refs_epoch: NDArray[np.uint32],
    target_epoch: NDArray[np.uint32], target_states: NDArray[np.uint8], hashed: Bools,
    target_position: NDArray[np.int32], restores: Bools, params: NDArray[np.int64],
    history_ids: IdArray, history_settled: Bools, checked_ok: Bools,
    spans: NDArray[np.int64], base: Bools, check_mode: int, use_checked_ok: bool,
    has_index: bool, history_all_settled: bool, budget: int, capped: bool,
    facts: NDArray[np.uint8], epochs: NDArray[np.uint32], flags: Bools,
    longs: NDArray[np.int64],
) -> None:
    """Everything one group contributes to a verdict, in one pass over the prompt's blocks
    and one over the candidate lengths (see the module docstring; ``settled_ok[i]``: every
    target of index row ``i`` already sits settled in this prompt's history).

    What changes between lookups comes as scalars: ``check_mode`` (CHECKS_*);
    ``use_checked_ok``, ``checked_ok`` holds the caller's alignment and checksum answers (else
    the mode decides); ``has_index``, the group is a sparse index with the prompt's history
    (``history_ids``, ``history_settled``) evaluated before it; ``history_all_settled``, every
    history block of the prompt is settled (no plan step will move an index target);
    ``budget`` and ``capped``, the restores the admission gate lets begin now and whether the
    core-wide budget has caps."""
    n, count = ids.size, spans.shape[1]
    scalars, asked = longs[:N_SCALARS], longs[N_SCALARS:]
    full_sub_mask, restore_aligned = params[P_FULL_SUB_MASK], params[P_ALIGNED] != 0
    target_size, own_size = params[P_TARGET_SIZE], params[P_OWN_SIZE]
    lo, cut, hi = spans[0], spans[1], spans[2]
    restores_raw, restores_cmp = restores[0], restores[1]
    # Whole rows (as long as the longer of n and count): the loops read the first n or count.
    now_raw, now_cmp, after_raw = flags[NOW_RAW], flags[NOW_CMP], flags[AFTER_RAW]
    after_cmp, fit, settled_ok = flags[AFTER_CMP], flags[FIT], flags[SETTLED_OK]
    hit, now = flags[N_PER_BLOCK + HIT], flags[N_PER_BLOCK + NOW]
    after = flags[N_PER_BLOCK + AFTER]
    n_targets, n_history = target_epoch.size, history_ids.size
    for i in range(N_SCALARS):
        scalars[i] = 0
    scalars[CHAIN_BLOCKS] = n
    changes = False
    # Prefix counts (int32: a prompt has far fewer blocks): bad raw / compressed / missing.
    raw_bad = np.zeros(n + 1, dtype=np.int32)
    cmp_bad = np.zeros(n + 1, dtype=np.int32)
    missing = np.zeros(n + 1, dtype=np.int32)
    # Per position of the prompt's history (small: the prompt's blocks): the epoch of the
    # block there, and the first index row allowed to point at it (the first whose block ends
    # at or after it; never when it is dead), so a reference costs two small lookups.
    epoch_at = np.zeros(n_history if has_index else 0, dtype=np.uint32)
    first_row_at = np.zeros(n_history if has_index else 0, dtype=np.int64)
    if has_index:
        for at in range(n_history):
            held = history_ids[at]
            if held < 0 or not hashed[target_states[held]]:
                first_row_at[at] = n  # no row of this prompt
            else:
                epoch_at[at] = target_epoch[held]
                first_row_at[at] = ((at + 1) * target_size + own_size - 1) // own_size - 1
    # The block of the previous row when it was found and every reference of it passed (an
    # index's neighbouring rows often hold the same references; -1: none).
    fit_block = -1
    for i in range(n):
        block = ids[i]
        row_fit, row_settled = True, True
        if block < 0:
            block_facts = 0
            epochs[i] = 0
            if scalars[CHAIN_BLOCKS] == n:
                scalars[CHAIN_BLOCKS] = i
            row_fit = not has_index
        else:
            state = states[block]
            epochs[i] = epoch[block]
            block_facts = FOUND | (code[state] << CODE_SHIFT)
            if position[block] == i:
                block_facts |= PLACED
            if sub_blocks[block] == full_sub_mask:
                block_facts |= WHOLE
            if layout_ok[layout_id[block]]:
                block_facts |= LAYOUT
            same = has_index and fit_block >= 0
            if same and block != fit_block:
                for j in range(refs_target.shape[1]):
                    if refs_target[block, j] != refs_target[fit_block, j] or \
                            refs_epoch[block, j] != refs_epoch[fit_block, j]:
                        same = False
                        break
            if same:
                # The previous row's references, which all passed: their targets' checks are
                # the same, and a target allowed from a row is allowed from every later one.
                row_settled = settled_ok[i - 1]
            elif has_index:
                for j in range(refs_target.shape[1]):
                    target = refs_target[block, j]
                    ref_epoch = refs_epoch[block, j]
                    if target == _NO_TARGET:
                        if ref_epoch != 0:
                            row_fit = False
                        continue
                    if target < 0 or target >= n_targets:
                        row_fit = False
                        row_settled = history_all_settled
                        break
                    at = target_position[target]
                    ours = 0 <= at < n_history and history_ids[at] == target
                    if not ours:
                        row_fit = False
                        row_settled = history_all_settled
                        break
                    if not history_all_settled and not history_settled[at]:
                        row_settled = False
                    if row_fit:
                        row_fit = epoch_at[at] == ref_epoch and first_row_at[at] <= i
                    if not row_fit and (history_all_settled or not row_settled):
                        break
        facts[i] = block_facts
        readable = (block_facts & READABLE) != 0
        sound = (block_facts & SOUND) == SOUND and row_fit
        if use_checked_ok:
            ok = checked_ok[i]
        elif check_mode == CHECKS_RECORDED and readable:
            ok = check[block] != _FAILED
            if check[block] == _UNCHECKED:
                scalars[NEEDS_CHECKSUMS] = 1
        else:
            ok = True
        good = sound and ok
        is_raw = good and (block_facts & READ_RAW) != 0
        is_cmp = good and (block_facts & READ_COMPRESSED) != 0
        movable = restore_aligned and sound and not (readable and not ok)
        to_raw = (is_raw or (movable and (block_facts & TO_RAW) != 0)) and row_settled
        to_cmp = (is_cmp or (movable and (block_facts & TO_COMPRESSED) != 0)) and row_settled
        if to_raw != is_raw or to_cmp != is_cmp:
            changes = True
        now_raw[i], now_cmp[i], after_raw[i], after_cmp[i] = is_raw, is_cmp, to_raw, to_cmp
        fit[i], settled_ok[i] = row_fit, row_settled
        fit_block = block if row_fit and block >= 0 else -1
        raw_bad[i + 1] = raw_bad[i] + (not is_raw)
        cmp_bad[i + 1] = cmp_bad[i] + (not is_cmp)
        missing[i + 1] = missing[i] + (block < 0)
    settled_form = params[P_SETTLED_FORM] != 0
    all_settled = True
    for i in range(n):
        if not (now_cmp[i] if settled_form else now_raw[i]):
            all_settled = False
            break
    scalars[ALL_SETTLED] = all_settled
    largest_hit = largest_now = 0
    for k in range(count):
        start, middle, end = lo[k], cut[k], hi[k]
        served = base[k]
        hit_here = served and missing[end] == missing[start]
        now_here = served and raw_bad[end] == raw_bad[middle] and \
            cmp_bad[middle] == cmp_bad[start]
        hit[k] = hit_here
        now[k] = now_here
        after[k] = now_here
        asked[k] = 0
        if hit_here:
            largest_hit = k
        if now_here:
            largest_now = k
    scalars[LARGEST_HIT], scalars[LARGEST_NOW] = largest_hit, largest_now
    scalars[LARGEST_AFTER] = largest_now
    scalars[PLAN_CHANGES] = changes
    if changes:
        # The plan makes some blocks usable (or, moving an index's targets, unusable): the
        # same counts after it, and the restores it begins (rare: a second pass).
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
                restores_raw[states[block]]
            restoring_cmp = to_cmp and not now_cmp[i] and block >= 0 and \
                restores_cmp[states[block]]
            raw_asked[i + 1] = raw_asked[i] + restoring_raw
            cmp_asked[i + 1] = cmp_asked[i] + restoring_cmp
        total = raw_asked[n] + cmp_asked[n]
        keep_asked = total > 0 and (total > budget or capped)
        scalars[ASKED_KEPT] = keep_asked
        for k in range(count):
            start, middle, end = lo[k], cut[k], hi[k]
            after[k] = base[k] and raw_after_bad[end] == raw_after_bad[middle] and \
                cmp_after_bad[middle] == cmp_after_bad[start]
            if keep_asked:
                asked[k] = raw_asked[end] - raw_asked[middle] + cmp_asked[middle] - \
                    cmp_asked[start]
                if asked[k] > budget:
                    after[k] = False
        scalars[LARGEST_AFTER] = 0
        for k in range(count):
            if after[k]:
                scalars[LARGEST_AFTER] = k
