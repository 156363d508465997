"""Random valid inputs of the lookup's and the lease's compiled kernels, for the differential test
(``tests/test_jit.py``: each kernel compiled, as its NumPy twin and as plain Python, on the
same draws), and hand-made pass outputs for the group pass's tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import AddressTable
from kvfsm._jit import read_only
from kvfsm.lookup._buffers import (
    ANSWER_COLUMNS,
    FIXED_COLUMNS,
    HI,
    LEASE_KINDS,
    LO,
    N_SCALARS,
    NOW_CMP,
    NOW_RAW,
    PINNED_AS,
    TARGET,
    out_offsets,
    pack_consts,
)
from kvfsm.lookup._group_pass import BUDGET_UNKNOWN, FIXED_KINDS, pack_fixed
from kvfsm.lookup._lease_pass import lease_table as _lease_table
from kvfsm.state import NO_TARGET
from kvfsm.state._hashtable import (
    EMPTY_SLOT,
    SLOT_BLOCK,
    SLOT_FINGERPRINT,
    TOMBSTONE,
    probe_twin,
    slot_words,
)
from kvfsm.state._recency import random_lists, relink_loop
from kvfsm.state._touch import (
    NO_PINNING,
    ONE_BY_ONE,
    ONE_RUN,
    RUN_COUNT,
    RUN_FIRST,
    RUNS,
    no_linked_run,
    run_chunks,
)
from tests.kernel_twins import one_run_blocks, out_views

Words = NDArray[np.uint64]
Bools = NDArray[np.bool_]
IdArray = NDArray[np.intp]


def probe_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A valid table (no key twice, none past an empty slot of its chain: keys inserted at the
    first empty slot, some then removed to tombstones; now and then no empty slot at all) over
    blocks whose words share fingerprints, words and home slots, now and then a slot naming a
    block beyond the words (corrupt), and keys to find: stored ones, the words of blocks not
    mapped, and others sharing a word with them."""
    capacity = 1 << int(rng.integers(3, 7))
    n_blocks = int(rng.integers(1, 2 * capacity))
    # Few distinct high words (fingerprints: 0 and the top bit) and low words in a few
    # multiples of the capacity: long chains, equal fingerprints, keys equal in one word only.
    highs = np.array([0, 1, 1 << 63, (1 << 63) | 1], dtype=np.uint64)
    block_high = rng.choice(highs, n_blocks).astype(np.uint64)
    block_low = rng.integers(0, 4 * capacity, n_blocks).astype(np.uint64)
    slots = np.full(capacity, EMPTY_SLOT, dtype=np.uint64)
    stored: set[tuple[int, int]] = set()
    full = rng.random() < 0.1
    wanted = capacity if full else int(rng.integers(0, capacity // 2 + 1))
    mask = capacity - 1
    for block in rng.permutation(n_blocks).tolist():
        key = (int(block_high[block]), int(block_low[block]))
        if len(stored) == wanted:
            break
        if key in stored:
            continue  # a block with the same content as a mapped one: not mapped
        stored.add(key)
        pos = key[1] & mask
        while (slots[pos] & SLOT_BLOCK) != EMPTY_SLOT:
            pos = (pos + 1) & mask
        slots[pos] = slot_words(block_high[block : block + 1], np.array([block]))[0]
    live = (slots & SLOT_BLOCK) < np.uint64(n_blocks)
    stray = live & (rng.random(capacity) < 0.05)
    slots[stray] = (slots[stray] & SLOT_FINGERPRINT) | np.uint64(n_blocks)  # beyond the words
    tomb = live & ~stray & (rng.random(capacity) < 0.3)
    slots[tomb] = (slots[tomb] & SLOT_FINGERPRINT) | np.uint64(TOMBSTONE & ((1 << 32) - 1))
    n = int(rng.integers(0, 2 * capacity))
    pick = rng.integers(0, n_blocks, n)
    high, low = block_high[pick], block_low[pick]
    mixed = rng.random(n) < 0.3
    high[mixed] = rng.choice(highs, int(mixed.sum()))
    return (slots, block_high, block_low, high.astype(np.uint64), low.astype(np.uint64),
            np.full(n, -7, dtype=np.intp), bool(rng.integers(0, 2)))


def history_of(ids: IdArray, settled: Bools, count: int, settled_row: int = NOW_RAW
               ) -> NDArray[np.int64]:
    """A pass output holding ``ids`` and the settled row ``settled`` (at ``settled_row``)
    of a target group over ``count`` candidate lengths, everything else zero: the
    ``history`` argument for hand-made index inputs."""
    out = np.zeros(out_offsets(ids.size, count)[3], dtype=np.int64)
    _, _, held, _, _, flags = out_views(out, ids.size, count)
    held[:] = ids
    flags[settled_row, : ids.size] = settled
    return out


def arrays_pass_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """The group pass's arguments with its fixed arrays one by one (as
    :func:`~tests.kernel_twins.arrays_pass_twin` takes them), for a small group drawn freely: a hash
    table and prompt words as the probe's differential test draws them (shared fingerprints,
    tombstones, stray slots, keys equal in one word, misses), now and then reordered so neighbouring
    rows find the same block; metadata that matches its position, layout and sub-blocks or not,
    random per-state codes and checks, an index (sometimes) whose references into a small target
    group are right, stale, out of order or out of range, a history partly settled, random spans per
    length (some lengths unservable), and a budget from none to plenty."""
    slots, block_high, block_low, high, low = cast(tuple[Words, ...], probe_inputs(rng)[:5])
    n_blocks = block_high.size
    # Which blocks the table maps (under their own words), as the table keeps them.
    found = np.empty(n_blocks, dtype=np.intp)
    probe_twin(slots, block_high, block_low, block_high, block_low, found, True)
    mapped = found == np.arange(n_blocks)
    if rng.random() < 0.4:
        # A prompt's keys as they usually are: the words of consecutive blocks (mapped or
        # not, some sharing words with a mapped block), now and then one key changed.
        first = int(rng.integers(0, n_blocks))
        run = np.arange(first, min(n_blocks, first + int(rng.integers(1, 24))))
        high, low = block_high[run].copy(), block_low[run].copy()
        if rng.random() < 0.3:
            low[int(rng.integers(0, run.size))] ^= np.uint64(1)
    n = high.size
    ids = np.empty(n, dtype=np.intp)
    probe_twin(slots, block_high, block_low, high, low, ids, True)
    if rng.random() < 0.3:
        order = np.argsort(ids, kind="stable")  # runs of one block: rows of equal references
        high, low, ids = high[order], low[order], ids[order]
    n_states, n_layouts = (int(rng.integers(1, top)) for top in (6, 4))
    n_lengths = int(rng.integers(1, 8))
    position = rng.integers(-1, 9, n_blocks).astype(np.int32)
    for i, block in enumerate(ids.tolist()):
        if block >= 0 and rng.random() < 0.7:
            position[block] = i
    full_sub_mask = int(rng.choice([1, 3]))
    sub_blocks = np.where(rng.random(n_blocks) < 0.8, full_sub_mask,
                          rng.integers(0, 4, n_blocks)).astype(np.uint16)
    layout_ok = rng.random(n_layouts) < 0.7
    has_index = bool(rng.random() < 0.5)
    n_targets, top_k, n_history = (int(rng.integers(1, top)) for top in (9, 4, 9))
    refs_target = rng.integers(-3, n_targets + 2, (n_blocks, top_k)).astype(np.int32)
    refs_target[rng.random((n_blocks, top_k)) < 0.3] = NO_TARGET
    target_epoch = rng.integers(0, 2, n_targets).astype(np.uint32)
    refs_epoch = target_epoch[np.clip(refs_target, 0, n_targets - 1)]
    refs_epoch[refs_target == NO_TARGET] = 0
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
    base = rng.random(n_lengths) < 0.9
    prefix_step = 0
    if rng.random() < 0.3:
        # A raw prefix's spans (full attention): every block before length k's end, raw.
        prefix_step = int(rng.integers(1, 3))
        n_lengths = min(n_lengths, n // prefix_step + 1)
        hi = np.arange(n_lengths, dtype=np.int64) * prefix_step
        cut, lo = np.zeros_like(hi), np.zeros_like(hi)
        base = np.ones(n_lengths, dtype=np.bool_)
    target_settled_compressed = bool(rng.random() < 0.5)
    consts = pack_consts(
        full_sub_mask, bool(rng.random() < 0.8), int(rng.choice([16, 64])),
        int(rng.choice([16, 64])), bool(rng.random() < 0.5), layout_ok,
        rng.integers(0, 16, n_states).astype(np.uint8),
        np.stack([rng.random(n_states) < 0.5, rng.random(n_states) < 0.5]),
        rng.random(n_states) < 0.8, target_settled_compressed)
    # The target group's pass output: its ids and settled row; other rows hold noise.
    history = history_of(history_ids, history_settled, n_lengths,
                         NOW_CMP if target_settled_compressed else NOW_RAW)
    _, _, _, _, _, history_flags = out_views(history, n_history, n_lengths)
    other = NOW_RAW if target_settled_compressed else NOW_CMP
    history_flags[other, :n_history] = rng.random(n_history) < 0.5
    return (
        high, low, slots, block_high, block_low, read_only(mapped),
        read_only(rng.integers(0, n_states, n_blocks).astype(np.uint8)),
        read_only(rng.integers(0, 5, n_blocks).astype(np.uint32)), read_only(position),
        read_only(sub_blocks), read_only(rng.integers(0, n_layouts, n_blocks).astype(np.uint8)),
        read_only(rng.integers(0, 3, n_blocks).astype(np.uint8)),
        read_only(refs_target), read_only(refs_epoch), read_only(target_epoch),
        read_only(rng.integers(0, n_states, n_targets).astype(np.uint8)),
        read_only(target_position), consts, history, n_history,
        rng.random(n) < 0.8, read_only(np.stack([lo, cut, hi, base]).astype(np.int64)),
        prefix_step, int(rng.integers(0, 2)), bool(rng.random() < 0.3), has_index,
        bool(history_settled.all()), int(rng.integers(BUDGET_UNKNOWN, 6)),
        bool(rng.random() < 0.5),
        np.empty(out_offsets(n, n_lengths)[3], dtype=np.int64))


def take_snapshot_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A pass output of a few blocks over a few lengths (its other words noise), some ids
    missing, over a group of random states and checks (every check state, FAILED often)."""
    n, count = int(rng.integers(0, 9)), int(rng.integers(1, 6))
    n_blocks = int(rng.integers(1, 12))
    out = rng.integers(-(2**40), 2**40, out_offsets(n, count)[3]).astype(np.int64)
    ids = rng.integers(-1, n_blocks, n)
    out[N_SCALARS + count : N_SCALARS + count + n] = ids
    return (out, n, count, read_only(rng.integers(0, 256, n_blocks).astype(np.uint8)),
            read_only(rng.integers(0, 3, n_blocks).astype(np.uint8)), bool(rng.random() < 0.7))


def fixed_args(args: tuple[object, ...]) -> tuple[object, ...]:
    """The group pass's arguments with the fixed arrays one by one (``args[2:18]``), as
    :func:`~kvfsm.lookup._group_pass.group_pass` takes them: one address table."""
    end = 2 + len(FIXED_KINDS)
    fixed = pack_fixed(cast(tuple[NDArray[Any], ...],
                            tuple(np.ascontiguousarray(a) for a in args[2:end])))
    return (*args[:2], fixed, *args[end:])


def group_pass_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """:func:`arrays_pass_inputs` as :func:`~kvfsm.lookup._group_pass.group_pass` takes them."""
    return fixed_args(arrays_pass_inputs(rng))


# The lease's and touch's kernels (kvfsm/state/_touch.py, kvfsm/lookup/_lease_pass.py).

def chunk_bounds(first: int, count: int, shift: int) -> tuple[int, int]:
    """The whole chunks (of ``1 << shift`` ids) inside the ids ``[first, first + count)``,
    as ``[lo_chunk, hi_chunk)`` (empty when ``hi_chunk <= lo_chunk``)."""
    return (first + (1 << shift) - 1) >> shift, (first + count) >> shift


def run_ids(rng: np.random.Generator, n_blocks: int) -> IdArray:
    """Distinct ids, often one run of consecutive ids (a lease's usual blocks, spanning
    whole pin chunks where it is long enough), or a few runs in any order (a commit that
    made room), else a random set."""
    draw = rng.random()
    if draw < 0.45:
        first = int(rng.integers(0, n_blocks))
        return np.arange(first, int(rng.integers(first, n_blocks + 1)), dtype=np.intp)
    if draw < 0.75:
        cuts = np.sort(rng.choice(n_blocks + 1, size=min(n_blocks + 1, 5), replace=False))
        runs = [np.arange(a, int(rng.integers(a, b + 1)), dtype=np.intp)
                for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)]
        order = rng.permutation(len(runs))
        return np.concatenate([runs[i] for i in order] or [np.zeros(0, dtype=np.intp)])
    return rng.permutation(n_blocks)[: int(rng.integers(0, n_blocks + 1))].astype(np.intp)


def touch_kernel_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """:func:`touch_inputs`, half the time a lease's pinning touch."""
    return (*touch_inputs(rng, int(rng.integers(1, 4)) if rng.random() < 0.5 else NO_PINNING),
            False)


def touch_inputs(rng: np.random.Generator, limit: int) -> tuple[object, ...]:
    """Sound lists, states consistent with them (state ``s`` maps to list ``s - 1``), and ids
    with repeats, now and then one outside the blocks, or (a third of the time) a run of one
    list in list order, from anywhere in it to anywhere after (the splice path). With a pin
    ``limit`` above 0, a lease's pinning touch instead: distinct ids (often one run over
    whole chunks), a few pins on them and their chunks, now and then one at the limit.
    Half the time some consecutive ids are linked in order on one list and the record of a
    linked run names some of them (a truthful record), and then the ids are often inside
    it, or overlap it."""
    prev, next_, head, tail, member = random_lists(rng)
    n = prev.size
    linked_run = no_linked_run()
    in_order: NDArray[np.intp] | None = None
    if rng.random() < 0.5:
        # Consecutive ids appended to one list's tail in order: linked so.
        first = int(rng.integers(0, n))
        in_order = np.arange(first, int(rng.integers(first + 1, n + 1)), dtype=np.intp)
        listed = int(rng.integers(0, head.size))
        relink_loop(prev, next_, head, tail, in_order, member[in_order],
                    np.full(in_order.size, listed, dtype=np.int8), no_linked_run())
        member[in_order] = listed
        known = int(rng.integers(first, int(in_order[-1]) + 1))
        linked_run[:] = (known, int(rng.integers(1, int(in_order[-1]) + 2 - known)), listed)
    list_of_state = np.arange(-1, head.size, dtype=np.int8)
    states = read_only((member + 1).astype(np.uint8))
    shift = int(rng.integers(1, 3))
    ids = rng.integers(0, n, int(rng.integers(0, 10))).astype(np.intp)
    if limit > 0:
        ids = run_ids(rng, n)
    if in_order is not None and rng.random() < 0.5:
        # Inside the record (no link read), or from inside it to past it.
        start = int(rng.integers(linked_run[RUN_FIRST], linked_run[RUN_FIRST]
                                 + linked_run[RUN_COUNT]))
        end = int(rng.integers(start + 1, n + 1)) if rng.random() < 0.3 else \
            int(rng.integers(start + 1, linked_run[RUN_FIRST] + linked_run[RUN_COUNT] + 1))
        ids = np.arange(start, end, dtype=np.intp)
    elif limit <= 0 and rng.random() < 1 / 3 and (member >= 0).any():
        block = int(rng.choice(np.flatnonzero(member >= 0)))
        run: list[int] = []
        while block >= 0 and len(run) < int(rng.integers(1, 8)):
            run.append(block)
            block = int(next_[block])
        ids = np.array(run, dtype=np.intp)
    if ids.size and rng.random() < 0.2:
        ids[int(rng.integers(0, ids.size))] = rng.choice([-1, n])
    seen = np.full(ids.size, int(rng.integers(0, 3)), dtype=np.uint32)
    if ids.size and rng.random() < 0.3:
        seen[int(rng.integers(0, ids.size))] += np.uint32(1)
    pins = rng.integers(0, max(limit, 1) + 1, n).astype(np.uint16)
    chunk_pins = rng.integers(0, max(limit, 1) + 1, (n >> shift) + 1).astype(np.uint16)
    last_use = rng.integers(0, 5, n).astype(np.uint32)
    return (ids, states, list_of_state, last_use, int(rng.integers(5, 9)), prev, next_, head,
            tail, seen, pins, chunk_pins, shift, limit, linked_run,
            np.full(4, -7, dtype=np.int64))



def moved_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Blocks mostly at the epochs recorded, readable and unchecked or verified, some moved,
    unreadable or seen failing a checksum."""
    n_blocks, n_states = int(rng.integers(1, 12)), int(rng.integers(1, 5))
    ids = rng.integers(0, n_blocks, int(rng.integers(0, 10))).astype(np.intp)
    epoch = rng.integers(0, 3, n_blocks).astype(np.uint32)
    recorded = epoch[ids].copy()
    recorded[rng.random(ids.size) < 0.1] += 1
    return (ids, recorded, read_only(rng.integers(0, n_states, n_blocks).astype(np.uint8)),
            read_only(epoch), read_only(rng.random(n_states) < 0.9),
            read_only(np.where(rng.random(n_blocks) < 0.9, 0, rng.integers(0, 3, n_blocks))
                      .astype(np.uint8)),
            np.empty(1, dtype=np.int64))



def pins_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Distinct blocks with pins to give (some at 0), some moved off their recorded epoch,
    given back as a pinning touch took them: one run over whole chunks, or several runs
    some of which span whole chunks (their ends one by one, their chunks whole), or every
    block alone."""
    n_blocks, shift = int(rng.integers(1, 24)), int(rng.integers(1, 3))
    ids = run_ids(rng, n_blocks)
    epoch = rng.integers(0, 3, n_blocks).astype(np.uint32)
    recorded = epoch[ids].copy()
    recorded[rng.random(ids.size) < 0.2] += 1
    lo_chunk, hi_chunk = chunk_bounds(int(ids[0]), ids.size, shift) if ids.size else (0, 0)
    run = ONE_BY_ONE
    if bool(ids.size) and bool((np.diff(ids) == 1).all()) and hi_chunk > lo_chunk:
        run = ONE_RUN
    elif run_chunks(ids, shift)[1].size and rng.random() < 0.8:
        run = RUNS
    return (ids, recorded, read_only(epoch), rng.integers(0, 3, n_blocks).astype(np.uint16),
            rng.integers(0, 3, (n_blocks >> shift) + 1).astype(np.uint16), shift, run)



def lease_outputs(groups: Sequence[tuple[Any, Any]], at: int,
             rng: np.random.Generator | None
             ) -> tuple[tuple[NDArray[np.int64], ...], NDArray[np.int64], NDArray[np.int64]]:
    """Made-up pass outputs holding each group's ``(ids, epochs)`` at candidate ``at``, with
    bounds and offsets as a lookup gathers them; ``rng`` randomises where the blocks start
    and whether the one-run word is offered."""
    outs = []
    bounds = np.zeros((len(groups), 2, at + 1), dtype=np.int64)
    offsets = np.zeros((len(groups), 3), dtype=np.int64)
    for g, (ids, epochs) in enumerate(groups):
        lo = 0 if rng is None else int(rng.integers(0, 3))
        n = lo + ids.size + (0 if rng is None else int(rng.integers(0, 2)))
        at_ids = 2 + (0 if rng is None else int(rng.integers(0, 3)))
        at_epochs = at_ids + n
        out = np.zeros(at_epochs + (n + 1) // 2 + 1, dtype=np.int64)
        out[at_ids + lo:at_ids + lo + ids.size] = ids
        out[at_epochs:].view(np.uint32)[lo:lo + ids.size] = epochs
        out[0] = one_run_blocks(out[at_ids:at_epochs], out[at_epochs:].view(np.uint32)[:n])
        bounds[g, 0, at], bounds[g, 1, at] = lo, lo + ids.size
        offsets[g] = (at_ids, at_epochs, 0 if rng is None or rng.random() < 0.7 else -1)
        outs.append(out)
    return tuple(outs), read_only(bounds), read_only(offsets)


def lease_table(groups: Sequence[Sequence[NDArray[Any]]]) -> AddressTable:
    """:func:`kvfsm.lookup._lease_pass.lease_table` of made-up arrays, converted first."""
    return _lease_table([[np.ascontiguousarray(array, dtype=dtype)
                          for array, (dtype, _) in zip(arrays, LEASE_KINDS, strict=True)]
                         for arrays in groups])


def unpin_tables(groups: Sequence[tuple[NDArray[Any], NDArray[Any], NDArray[Any]]]
                  ) -> AddressTable:
    """A lease's address table of each group's ``(epoch, pins, chunk_pins)``, stand-ins for
    the rest."""
    def stand_in(dtype: type[np.generic]) -> NDArray[Any]:
        return np.zeros(1, dtype=dtype)

    return lease_table([(stand_in(np.uint8), stand_in(np.int8), stand_in(np.uint32),
                         stand_in(np.int32), stand_in(np.int32), stand_in(np.int32),
                         stand_in(np.int32), pins, chunk_pins, epoch, no_linked_run())
                        for epoch, pins, chunk_pins in groups])


def take_probed_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """One to three groups, each a lease's pinning touch as :func:`~tests.kernel_twins.touch_twin`'s
    inputs make them (sound lists, distinct ids often one run over whole chunks, now and then an id
    outside the group or a block at the limit), their ids and epochs in pass outputs; sometimes an
    index group pointing into another, reaching past what is held of it."""
    count = int(rng.integers(1, 4))
    limit = int(rng.integers(1, 4))
    made: list[tuple[Any, ...]] = [touch_inputs(rng, limit) for _ in range(count)]
    at = int(rng.integers(0, 2))
    outs, bounds, offsets = lease_outputs([(each[0], each[9]) for each in made], at, rng)
    fixed = np.zeros((count, FIXED_COLUMNS), dtype=np.int64)
    for g, each in enumerate(made):
        fixed[g] = (each[12], -1, 16, 16)
    if count > 1 and rng.random() < 0.5:
        # The last group points into the first: held where the first starts at its block 0 and
        # reaches ``hi * BLOCK // TARGET_BLOCK`` blocks.
        fixed[-1, TARGET:] = (0, int(rng.choice([16, 64])), 16)
    # Per group STATES ... LINKED_RUN (the take reads no epoch: zeros stand in).
    arrays = lease_table([(each[1], each[2], each[3], each[5], each[6], each[7], each[8],
                           each[10], each[11], np.zeros(each[3].size, dtype=np.uint32),
                           each[14]) for each in made])
    return (outs, bounds, offsets, at, fixed, arrays, int(rng.integers(5, 9)), limit,
            np.full((count, ANSWER_COLUMNS), -7, dtype=np.int64))



def unpin_probed_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """One to three groups given back as :func:`~tests.kernel_twins.unpin_twin`'s inputs make them
    (pins to give, some moved off their epochs, by chunks or alone), their ids and epochs in pass
    outputs; all of them or only those before the one a take stopped at."""
    count = int(rng.integers(1, 4))
    made: list[tuple[Any, ...]] = [pins_inputs(rng) for _ in range(count)]
    outs, bounds, offsets = lease_outputs([(each[0], each[1]) for each in made], 0, rng)
    answers = np.zeros((count, ANSWER_COLUMNS), dtype=np.int64)
    fixed = np.zeros((count, FIXED_COLUMNS), dtype=np.int64)
    for g, each in enumerate(made):
        answers[g, LO], answers[g, HI], answers[g, PINNED_AS] = bounds[g, 0, 0], \
            bounds[g, 1, 0], each[6]
        fixed[g] = (each[5], -1, 16, 16)
    arrays = unpin_tables([(each[2], each[3], each[4]) for each in made])
    return (outs, offsets, fixed, arrays, answers, int(rng.integers(0, count + 1)))
