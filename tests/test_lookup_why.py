"""The reasons of many failing blocks at once (``kvfsm.lookup._why``) against the one-block
rule, and the verdict's listing of them: the first few blocks of each reason, in order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import Engine
from kvfsm.lookup import Level, Reason
from kvfsm.lookup._buffers import NOW_CMP, NOW_RAW
from kvfsm.lookup._group_eval import GroupEval
from kvfsm.lookup._why import BY_CODE, MAX_LISTED, listed
from kvfsm.spec import ModelDecl
from tests.block_reason import block_reason
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    FOUR,
    GPT_OSS,
    HISTORY_SWA,
    QWEN,
    SWA_ONLY,
    TWO_SIZES,
    block_id,
    engine,
    group_eval,
    reached,
    spilled_miss,
    tokens,
)

MODELS = [DENSE, SWA_ONLY, GPT_OSS, TWO_SIZES, QWEN, DEEPSEEK, HISTORY_SWA, FOUR]


def evaluations(eng: Engine, text: np.ndarray, level: Level
                ) -> tuple[np.ndarray, list[GroupEval]]:
    """The candidate lengths of a lookup of ``text`` and each group's evaluation over them
    (a group pointing into another after that one, reading its evaluation)."""
    core = eng.core
    prompt = eng.prompt(text)
    step = core.model.lcm_block_size
    lengths = np.arange((max(prompt.n_tokens - 1, 0)) // step + 1, dtype=np.int64) * step
    made: dict[str, GroupEval] = {}
    for group in sorted(core.groups.values(), key=lambda g: g.rule.has_targets):
        high, low = prompt.words(group.decl.block_size)
        target = group.decl.target_group
        made[group.decl.name] = group_eval(
            group, high, low, lengths, level=level, kernel_layout=None,
            profile=eng.profile, history=made[target] if target else None)
    return lengths, list(made.values())


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS),
       level=st.sampled_from([Level.FULL, Level.STANDARD, Level.FAST]))
def test_the_batch_names_each_block_as_the_one_block_rule_does(
        data: st.DataObject, decl: ModelDecl, level: Level) -> None:
    """On any state the core's API can reach (random commits, lifecycle events, corrupted
    copies and bytes, stricter device profiles, scrambled index references), at every
    candidate length and at lengths between them: the blocks ``failing`` returns are exactly
    the needed blocks not usable now in their form, in block order, and the batch's reason
    of each needed block (failing or not) is the one-block rule's, None for a usable one."""
    eng, text = reached(data, decl)
    lengths, made = evaluations(eng, text, level)
    between = data.draw(st.lists(st.integers(0, text.size), max_size=3), label="between")
    for e in made:
        for length in [*lengths.tolist(), *between]:
            need = e.rule.needed(e.decl, np.array([length], dtype=np.int64))
            needed = np.arange(int(need.lo[0]), int(need.hi[0]), dtype=np.int64)
            compressed = needed < int(need.cut[0])
            usable = np.array([i < e.n and bool(e._flag_row(NOW_CMP if c else NOW_RAW, e.n)[i])
                               for i, c in zip(needed.tolist(), compressed.tolist(),
                                               strict=True)], dtype=np.bool_)
            index, form = e.failing(length)
            assert index.tolist() == needed[~usable].tolist(), (e.decl.name, length)
            assert form.tolist() == compressed[~usable].tolist(), (e.decl.name, length)
            assert e.servable(length) == (need.servable is None or bool(need.servable[0]))
            codes = e.reason_codes(needed, compressed)
            assert [BY_CODE[code] for code in codes.tolist()] == [
                block_reason(e, i, c) for i, c in zip(needed.tolist(), compressed.tolist(),
                                               strict=True)], (e.decl.name, length)


@settings(deadline=None)
@given(codes=st.lists(st.integers(0, 4), max_size=80), limit=st.integers(1, 5))
def test_listed_keeps_the_first_few_of_each_reason_in_block_order(codes: list[int],
                                                                   limit: int) -> None:
    """``listed`` keeps, in order, exactly the positions whose reason (code above 0) occurred
    fewer than ``limit`` times before them."""
    seen: dict[int, int] = {}
    expected = []
    for position, code in enumerate(codes):
        if code and seen.get(code, 0) < limit:
            expected.append(position)
        seen[code] = seen.get(code, 0) + 1
    assert listed(np.array(codes, dtype=np.int16), limit).tolist() == expected


def test_a_long_miss_lists_the_first_blocks_of_each_reason_in_order() -> None:
    """A prompt whose cached blocks were spilled to host and whose second half was never
    cached: the verdict lists the first MAX_LISTED spilled blocks (not resident) and the
    first MAX_LISTED missing ones (not cached), in block order, each once, with their ids."""
    _, verdict, spilled = spilled_miss()
    assert (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens) == (
        480, 80, 480)
    blocks = [(s.reason, s.block_index, s.block_id) for s in verdict.reasons
              if s.group == "attn"]
    assert blocks == [(Reason.NOT_RESIDENT, 5 + i, spilled[i]) for i in range(MAX_LISTED)] + \
        [(Reason.NOT_CACHED, 30 + i, -1) for i in range(MAX_LISTED)]


@pytest.mark.parametrize("decl", [DEEPSEEK, FOUR], ids=lambda decl: decl.name)
def test_an_index_row_is_stale_or_a_group_gap_in_the_batch_as_alone(decl: ModelDecl) -> None:
    """Index rows whose references disagree with their targets' epochs and rows that are
    fine are named alike by the batch and by the one-row rule."""
    eng = engine(decl)
    text = tokens(321)
    eng.commit(eng.prompt(text))
    for row in (10, 12):
        eng.core.group("index")._blocks.refs_epoch[block_id(eng, "index", text, row), 0] += 1
    _, made = evaluations(eng, text, Level.STANDARD)
    index_eval = next(e for e in made if e.decl.name == "index")
    rows = np.arange(index_eval.n, dtype=np.int64)
    raw = np.zeros(rows.size, dtype=np.bool_)
    named = [BY_CODE[code] for code in index_eval.reason_codes(rows, raw).tolist()]
    assert named == [block_reason(index_eval, i, False) for i in rows.tolist()]
    assert [i for i, why in enumerate(named) if why is Reason.INDEX_STALE] == [10, 12]
