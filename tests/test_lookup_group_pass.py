"""The group pass: the fact bits of a real group's blocks, and hand-made index rows where
neighbouring rows hold the same references (the compiled pass reuses the previous row's
answer) getting the answers a full check gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm import Engine
from kvfsm._jit import settings as jit
from kvfsm.lookup import DeviceProfile, Level, lookup
from kvfsm.lookup._block_facts import (
    CODE_SHIFT,
    FOUND,
    LAYOUT,
    PLACED,
    READ_RAW,
    TO_RAW,
    WHOLE,
)
from kvfsm.lookup._buffers import (
    FIT,
    ONE_RUN_BLOCKS,
    SETTLED_OK,
    out_offsets,
    pack_consts,
)
from kvfsm.lookup._group_eval import GroupEval
from kvfsm.lookup._group_pass import CHECKS_IGNORED, group_pass
from kvfsm.lookup._paths import restore_paths
from kvfsm.lookup._spans import _prefix_step
from kvfsm.spec import Event, Layout
from kvfsm.state import CoreConfig
from kvfsm.state._hashtable import BlockHashTable
from tests.kernel_inputs import fixed_args, history_of
from tests.kernel_twins import out_views
from tests.lookup_models import DENSE, engine, group_eval, tokens

#: Every state readable raw (the restore-path code's low bit).
_READ_RAW = 1


def _rows_of(refs: list[list[int]], ids: list[int], history_settled: list[bool]
             ) -> tuple[Any, ...]:
    """Arguments of one index group over four history blocks (one per position, at epoch 0,
    alive): its blocks' references ``refs`` (by block id), the prompt rows finding blocks
    ``ids`` (each block's words mapped in a hash table) and which history positions are
    settled. Target and index blocks are the same size, so history position ``p`` may be
    pointed at from row ``p`` on."""
    n_blocks, n = len(refs), len(ids)
    table = BlockHashTable(n_blocks)
    table.block_high[:] = np.arange(n_blocks, dtype=np.uint64) + np.uint64(1 << 40)
    table.block_low[:] = np.arange(n_blocks, dtype=np.uint64) * np.uint64(7919)
    table.insert_first(table.block_high, table.block_low, np.arange(n_blocks))
    consts = pack_consts(1, False, 16, 16, False, np.ones(1, np.bool_),
                         np.full(1, _READ_RAW, np.uint8), np.zeros((2, 1), np.bool_),
                         np.ones(1, np.bool_))
    return (
        table.block_high[ids], table.block_low[ids], table.slots, table.block_high,
        table.block_low, table.mapped, np.zeros(n_blocks, np.uint8),
        np.zeros(n_blocks, np.uint32),
        np.array([ids.index(b) if b in ids else -1 for b in range(n_blocks)], np.int32),
        np.ones(n_blocks, np.uint16), np.zeros(n_blocks, np.uint8), np.zeros(n_blocks, np.uint8),
        np.array(refs, dtype=np.int32), np.zeros((n_blocks, len(refs[0])), np.uint32),
        np.zeros(4, np.uint32), np.zeros(4, np.uint8), np.arange(4, dtype=np.int32), consts,
        history_of(np.arange(4, dtype=np.intp), np.array(history_settled, dtype=np.bool_), 1),
        4, np.ones(0, np.bool_), np.array([[0], [0], [n], [1]], dtype=np.int64), 0,
        CHECKS_IGNORED, False, True, all(history_settled), 0, False,
        np.empty(out_offsets(n, 1)[3], np.int64))


@pytest.mark.parametrize("compiled", [False, True])
def test_repeated_references_get_the_answers_of_a_full_check(compiled: bool) -> None:
    """Rows 1-4 hold the references of the row before them (block 1 twice, then block 0 with
    the same references); position 1 is not settled. Row 0 fails (position 1 is allowed from
    row 1 on) and every later row fits, none settled; block 2 points at settled positions
    only."""
    if compiled and not jit.available:
        pytest.skip("numba is not installed")
    refs = [[0, 1], [0, 1], [0, 2]]
    args = _rows_of(refs, [0, 1, 1, 1, 0, 2], [True, False, True, True])
    with jit.using(compiled):
        group_pass(*fixed_args(args))
    _, _, found, _, _, flags = out_views(args[-1], 6, 1)
    assert found.tolist() == [0, 1, 1, 1, 0, 2]
    assert flags[FIT].tolist() == [False, True, True, True, True, True]
    assert flags[SETTLED_OK].tolist() == [False] * 5 + [True]


@pytest.mark.usefixtures("jit_backend")
def test_each_fact_of_a_real_group() -> None:
    """A committed dense prompt: blocks present, placed, whole and readable raw; then one block
    spilled (reachable raw, not readable), two found at each other's positions (the prompt's
    hashes swapped), a hash that is not cached, and every block read under a layout it was not
    written in."""
    eng = engine(DENSE)
    text = tokens(161)
    prompt = eng.prompt(text)
    eng.commit(prompt)
    core = eng.core
    group = core.group("attn")
    high, low = (words[:10].copy() for words in prompt.words(16))
    ids = core.lookup_words("attn", high, low)
    core.fire("attn", [int(ids[3])], Event.SPILL_BEGIN)
    core.fire("attn", [int(ids[3])], Event.SPILL_DONE)
    for words in (high, low):
        words[[5, 6]] = words[[6, 5]]  # positions 5 and 6 find each other's blocks
    high[9] ^= np.uint64(1)  # a hash no block has

    def facts(reads: Layout | None) -> np.ndarray:
        return group_eval(group, high, low, np.zeros(1, dtype=np.int64),
                          level=Level.FULL, kernel_layout=reads, profile=DeviceProfile(),
                          checksums=False).facts

    written = facts(None)
    everything = FOUND | PLACED | WHOLE | LAYOUT | READ_RAW | TO_RAW
    assert written[0] == everything
    assert written[3] & (FOUND | READ_RAW | TO_RAW) == FOUND | TO_RAW
    assert not written[5] & PLACED and not written[6] & PLACED and written[7] & PLACED
    assert written[9] == 0
    code = restore_paths(group.table).code
    assert int(written[0]) >> CODE_SHIFT == int(code[group.states[ids[0]]])
    other = Layout(dim_order=("block", "dim", "token"), alignment=256, padding=0)
    assert (facts(other) & LAYOUT == 0).all()


@pytest.mark.usefixtures("jit_backend")
def test_the_pass_finds_the_ids_the_hash_table_finds() -> None:
    """The pass probes the group's table itself: for found keys, a key with one word changed
    (same fingerprint), one with another fingerprint and an absent one, its ids are the
    table's own answers."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    core = eng.core
    group = core.group("attn")
    high, low = (words.copy() for words in prompt.words(16))
    low[2] ^= np.uint64(1)  # the fingerprint comes from the high word: unchanged
    high[4] ^= np.uint64(1 << 63)
    high[7], low[7] = np.uint64(12345), np.uint64(678)
    lengths = np.array([0, 64, 160], dtype=np.int64)
    evaluation = group_eval(group, high, low, lengths, level=Level.FULL, kernel_layout=None,
                            profile=DeviceProfile(), checksums=False)
    expected = core.lookup_words("attn", high, low)
    assert evaluation.ids.tolist() == expected.tolist()
    assert [i for i, block in enumerate(evaluation.ids.tolist()) if block < 0] == [2, 4, 7]
    assert evaluation.now.tolist() == [True, False, False]


def test_a_verdict_keeps_its_own_arrays_after_later_lookups() -> None:
    """Each lookup writes fresh arrays: a verdict's probed ids and epochs stay as that lookup
    saw them after the blocks move and the prompt is looked up again."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    first = eng.lookup(prompt)
    assert first.probe is not None
    probed = first.probe.groups[0]
    ids, epochs = probed.ids.copy(), probed.epochs.copy()
    eng.core.fire("attn", [int(ids[0])], Event.SPILL_BEGIN)
    eng.core.fire("attn", [int(ids[0])], Event.SPILL_DONE)
    second = eng.lookup(prompt)
    assert second.usable_tokens < first.usable_tokens
    assert second.probe is not None
    later = second.probe.groups[0]
    assert probed.ids.tolist() == ids.tolist() and probed.epochs.tolist() == epochs.tolist()
    assert not np.shares_memory(probed.ids, later.ids)


@pytest.mark.usefixtures("jit_backend")
@pytest.mark.parametrize(("cap", "restorable"), [(0, 16), (2, 80), (3, 112), (4, 160)])
def test_a_plan_over_the_groups_restore_cap_stops_where_the_cap_does(
        cap: int, restorable: int) -> None:
    """Blocks 1, 3, 5 and 7 of ten spilled, no core-wide caps: the plan may begin at most
    ``cap`` restores, so it reaches as far as the blocks before the next spilled one (the
    pass learns the group's budget only when its plan restores more than nothing)."""
    eng = Engine(DENSE, CoreConfig(device_blocks=64, host_blocks=16, backend="numpy",
                                   max_restores_in_flight=cap))
    text = tokens(161)
    prompt = eng.prompt(text)
    eng.commit(prompt)
    ids = eng.core.lookup_words("attn", *prompt.words(16))[[1, 3, 5, 7]]
    eng.core.fire("attn", ids, Event.SPILL_BEGIN)
    eng.core.fire("attn", ids, Event.SPILL_DONE)
    verdict = lookup(eng.core, prompt, checksums=False)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (16, restorable)
    assert len(verdict.plan) == min(cap, 4)


@pytest.mark.usefixtures("jit_backend")
def test_a_run_broken_by_a_recommitted_block_finds_the_block_the_table_maps() -> None:
    """The pass takes the block after the previous one found where that block is mapped under
    the next key; a block evicted from the middle of a prompt and committed again lands
    elsewhere, and the one after its old neighbour (still holding those words, no longer
    mapped) must not be taken for it: the ids are the table's own answer, every block."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    core = eng.core
    high, low = prompt.words(16)
    ids = core.lookup_words("attn", high, low)
    assert (np.diff(ids) == 1).all()  # one run, as a commit allocates
    other = eng.prompt(tokens(17, seed=9))
    eng.commit(other)
    other_high, other_low = other.words(16)
    # Freed last, so the other prompt's block is allocated first: block 4 again, elsewhere.
    core.fire("attn", [int(ids[4])], Event.EVICT)
    core.fire("attn", core.lookup_words("attn", other_high, other_low), Event.EVICT)
    eng.commit(prompt)
    again = core.lookup_words("attn", high, low)
    assert again[4] != ids[4] and (np.delete(again, 4) == np.delete(ids, 4)).all()
    # The old block keeps the words of block 4, unmapped: only its flag tells it apart.
    assert core.group("attn").hash_low[ids[4]] == low[4]
    assert not core.group("attn").hash_map.mapped[ids[4]]
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert verdict.hit_tokens == 160
    (found,) = (group.ids for group in verdict.probe.groups)  # type: ignore[union-attr]
    assert found.tolist() == again.tolist()


def test_a_raw_prefix_spans_are_known_by_their_step_and_no_others_are() -> None:
    """Full attention needs every block before a length's end, raw: its spans are
    ``0, 0, k * step, served`` and the pass computes them from the step. A window past its
    width starts after block 0 and is read as it is; so are spans with any length unserved."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    ((_, spans, _, _, _),) = verdict.probe.passes  # type: ignore[union-attr]
    assert spans.prefix_step == 1
    assert spans.lo.tolist() == [0] * 11 and spans.hi.tolist() == list(range(11))
    rows = np.array(spans.rows)
    assert _prefix_step(rows) == 1
    for row, value in ((0, 1), (1, 1), (3, 0)):
        changed = rows.copy()
        changed[row, 5] = value
        assert _prefix_step(changed) == 0
    assert _prefix_step(np.stack([np.zeros(4), np.zeros(4), np.arange(4) * 3,
                                  np.ones(4)]).astype(np.int64)) == 3


@pytest.mark.usefixtures("jit_backend")
def test_one_run_blocks_counts_the_chain_where_it_is_one_run_at_one_epoch() -> None:
    """ONE_RUN_BLOCKS (what a lease over the lookup's blocks trusts instead of reading their
    ids and epochs again): the blocks the chain found up to its first miss, where they are
    consecutive ids all at the first one's epoch; 0 where any is another id or epoch."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)  # ten blocks allocated in one batch: consecutive ids
    core = eng.core
    group = core.group("attn")

    def counted(high: np.ndarray, low: np.ndarray) -> int:
        evaluated = group_eval(group, high, low, np.zeros(1, dtype=np.int64),
                               level=Level.FULL, kernel_layout=None, profile=DeviceProfile(),
                               checksums=False)
        return int(evaluated._out[ONE_RUN_BLOCKS])

    high, low = (words[:10].copy() for words in prompt.words(16))
    ids = core.lookup_words("attn", high, low)
    assert ids.tolist() == list(range(int(ids[0]), int(ids[0]) + 10))
    assert counted(high, low) == 10
    missing = high.copy()
    missing[7] ^= np.uint64(1)  # the chain ends at block 7: the run before it still counts
    assert counted(missing, low) == 7
    swapped_high, swapped_low = high.copy(), low.copy()
    for words in (swapped_high, swapped_low):
        words[[5, 6]] = words[[6, 5]]  # found, but not in id order
    assert counted(swapped_high, swapped_low) == 0
    core.fire("attn", [int(ids[3])], Event.SPILL_BEGIN)
    core.fire("attn", [int(ids[3])], Event.SPILL_DONE)  # block 3 moved: another epoch
    assert int(group.epoch[ids[3]]) != int(group.epoch[ids[0]])
    assert counted(high, low) == 0


@pytest.mark.usefixtures("jit_backend")
def test_words_of_another_layout_find_what_the_prompts_own_find() -> None:
    """Words given strided, read-only or as another integer type are read as their values:
    the same ids and usable lengths as the prompt's own words."""
    eng = engine(DENSE)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    group = eng.core.group("attn")
    lengths = np.array([0, 64, 160], dtype=np.int64)

    def evaluated(high: np.ndarray, low: np.ndarray) -> GroupEval:
        return group_eval(group, high, low, lengths, level=Level.FULL, kernel_layout=None,
                          profile=DeviceProfile(), checksums=False)

    own = evaluated(*prompt.words(16))
    strided = [np.repeat(words, 2)[::2] for words in prompt.words(16)]
    read_only = [words.copy() for words in prompt.words(16)]
    for words in read_only:
        words.flags.writeable = False
    signed = [words.view(np.int64) for words in prompt.words(16)]
    for high, low in (strided, read_only, signed):
        other = evaluated(high, low)
        assert other.ids.tolist() == own.ids.tolist()
        assert other.now.tolist() == own.now.tolist() == [True, True, True]
