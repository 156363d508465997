"""The Engine: the verification policy, lookups of prompts in any form, and commit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm import Engine, VerifyPolicy
from kvfsm.spec import Form, GroupKind, ModelDecl, shipped_models
from kvfsm.state import NO_TARGET, CoreConfig
from kvfsm.verify import Level, Reason
from tests.verify_models import DEEPSEEK, DENSE, FOUR, GPT_OSS, QWEN, block_id, engine, tokens

#: Verification strength, weakest first.
STRENGTH = {Level.FAST: 0, Level.STANDARD: 1, Level.FULL: 2}


def _state(eng: Engine, group: str, block: int) -> str:
    return eng.core.group(group).machine.state_of(int(block))


# -- VerifyPolicy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "level"),
    [(-100, Level.FAST), (-1, Level.FAST), (0, Level.STANDARD), (9, Level.STANDARD),
     (10, Level.FULL), (1000, Level.FULL)],
)
def test_default_policy_thresholds(priority: int, level: Level) -> None:
    assert VerifyPolicy().level_for(priority) is level


@pytest.mark.parametrize(
    ("priority", "level"),
    [(0, Level.FAST), (1, Level.STANDARD), (4, Level.STANDARD), (5, Level.FULL)],
)
def test_custom_policy_thresholds(priority: int, level: Level) -> None:
    assert VerifyPolicy(full_at_or_above=5, fast_below=1).level_for(priority) is level


@given(full=st.integers(-50, 50), fast=st.integers(-50, 50), low=st.integers(-100, 100),
       high=st.integers(-100, 100))
def test_policy_levels_follow_the_thresholds(full: int, fast: int, low: int, high: int) -> None:
    """FULL at or above ``full_at_or_above`` (winning where the thresholds overlap), FAST below
    ``fast_below``, STANDARD between; a higher priority never gets weaker verification."""
    policy = VerifyPolicy(full_at_or_above=full, fast_below=fast)
    for priority in (low, high):
        level = policy.level_for(priority)
        if priority >= full:
            assert level is Level.FULL
        elif priority < fast:
            assert level is Level.FAST
        else:
            assert level is Level.STANDARD
    low, high = sorted((low, high))
    assert STRENGTH[policy.level_for(low)] <= STRENGTH[policy.level_for(high)]


# -- lookup -------------------------------------------------------------------------------------


def test_lookup_uses_the_policy_level_for_the_priority() -> None:
    policy = VerifyPolicy(full_at_or_above=5, fast_below=1)
    eng = Engine(DENSE, CoreConfig(device_blocks=32, host_blocks=0, backend="numpy"),
                 policy=policy)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    for priority in (-3, 0, 1, 4, 5, 50):
        verdict = eng.lookup(text, priority=priority)
        assert verdict.level is policy.level_for(priority)
        assert verdict.usable_tokens == 160
    assert eng.lookup(text).level is Level.FAST  # priority 0 is below fast_below=1
    # An explicit level wins over the priority.
    assert eng.lookup(text, priority=50, level=Level.FAST).level is Level.FAST
    assert eng.lookup(text, priority=-3, level=Level.FULL).level is Level.FULL


@pytest.mark.parametrize("decl", [DENSE, GPT_OSS, QWEN, DEEPSEEK], ids=lambda d: d.name)
def test_lookup_accepts_token_lists_arrays_and_prompts_alike(decl: ModelDecl) -> None:
    eng = engine(decl)
    text = tokens(333, seed=4)
    eng.commit(eng.prompt(text[:300]))
    expected = eng.lookup(eng.prompt(text))
    assert eng.lookup(text.tolist()) == expected
    assert eng.lookup(text) == expected
    assert eng.lookup(tuple(text.tolist())) == expected
    assert expected.prompt_tokens == 333


# -- commit -------------------------------------------------------------------------------------


@pytest.mark.parametrize("decl", [DENSE, GPT_OSS, QWEN, DEEPSEEK, FOUR], ids=lambda d: d.name)
def test_commit_is_idempotent(decl: ModelDecl) -> None:
    eng = engine(decl)
    prompt = eng.prompt(tokens(321))
    first = eng.commit(prompt)
    assert set(first) == set(eng.core.groups)
    assert all(ids.size for ids in first.values())
    states = {name: g.states.copy() for name, g in eng.core.groups.items()}
    free = {name: g.free_top for name, g in eng.core.groups.items()}
    verdict = eng.lookup(prompt)
    again = eng.commit(eng.prompt(tokens(321)))
    assert all(ids.size == 0 for ids in again.values()), again
    for name, group in eng.core.groups.items():
        assert np.array_equal(group.states, states[name]), name
        assert group.free_top == free[name], name
    assert eng.lookup(prompt) == verdict
    assert eng.core.check_invariants() == []


def test_commit_of_a_longer_prompt_adds_only_the_new_blocks() -> None:
    eng = engine(GPT_OSS)
    text = tokens(200)
    first = eng.commit(eng.prompt(text[:100]))
    assert first["attn"].size == first["swa"].size == 6
    second = eng.commit(eng.prompt(text))
    assert second["attn"].size == second["swa"].size == 12 - 6
    assert not set(first["attn"].tolist()) & set(second["attn"].tolist())
    assert eng.lookup(text).usable_tokens == 192


def test_commit_restricted_to_some_groups_leaves_the_others_alone() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    out = eng.commit(eng.prompt(text), groups=["swa"])
    assert set(out) == {"swa"}
    assert eng.core.group("attn").free_top == eng.core.group("attn").n_blocks
    assert Reason.NOT_CACHED in eng.lookup(text).reason_set


@pytest.mark.parametrize(
    ("decl", "length"),
    [(QWEN, 15), (QWEN, 63), (QWEN, 64), (QWEN, 161), (QWEN, 320),
     (shipped_models()["qwen3_next_like"], 600), (shipped_models()["qwen3_next_like"], 1024)],
)
def test_commit_keeps_recurrent_snapshots_only_at_checkpoints(decl: ModelDecl,
                                                              length: int) -> None:
    eng = engine(decl)
    text = tokens(length)
    (name,) = [g.name for g in decl.groups if g.kind is GroupKind.RECURRENT]
    delta = decl.group(name)
    interval = delta.checkpoint_interval or delta.block_size
    out = eng.commit(eng.prompt(text))
    high, low = eng.prompt(text).words(delta.block_size)
    found = eng.core.lookup_words(name, high, low)
    cached = np.flatnonzero(found >= 0).tolist()
    # Block i ends at token (i + 1) * block_size: a snapshot exactly where that is a checkpoint.
    assert cached == [i for i in range(length // delta.block_size)
                      if (i + 1) * delta.block_size % interval == 0]
    assert out[name].size == len(cached)
    assert sorted(found[cached].tolist()) == sorted(out[name].tolist())


@pytest.mark.parametrize("length", [63, 64, 127, 128, 129, 200, 256, 320, 321, 400, 700])
def test_commit_compresses_history_older_than_the_tail(length: int) -> None:
    """A history block is compressed exactly when it ends at or before the raw tail starts
    (``tail_tokens`` before the prompt's end); the tail stays raw."""
    eng = engine(DEEPSEEK)
    text = tokens(length)
    eng.commit(eng.prompt(text))
    decl = eng.core.group("history").decl
    tail = decl.tail_tokens or 0
    for index in range(length // decl.block_size):
        block = block_id(eng, "history", text, index)
        old = (index + 1) * decl.block_size <= length - tail
        assert _state(eng, "history", block) == ("compressed" if old else "raw"), index
        form = Form.COMPRESSED if old else Form.RAW
        assert eng.core.read("history", [block], form=form).shape == (1, decl.payload_bytes)
    assert eng.core.check_invariants() == []


def test_commit_of_an_extended_prompt_compresses_the_old_tail() -> None:
    text = tokens(400)
    eng = engine(DEEPSEEK)
    eng.commit(eng.prompt(text[:200]))  # history blocks 0, 1 compressed; block 2 the raw tail
    eng.commit(eng.prompt(text))  # the tail is now block 5: blocks 0..4 are older
    for index in range(5):
        assert _state(eng, "history", block_id(eng, "history", text, index)) == "compressed"
    fresh = engine(DEEPSEEK)
    fresh.commit(fresh.prompt(text))
    assert eng.lookup(text).usable_tokens == fresh.lookup(text).usable_tokens == 384


@pytest.mark.parametrize("length", [40, 64, 200, 321])
def test_commit_points_index_blocks_at_history_complete_before_them(length: int) -> None:
    """Each index block points at the most recent ``top_k`` history blocks that end at or before
    the index block's end, and at nothing later."""
    eng = engine(DEEPSEEK)
    text = tokens(length)
    eng.commit(eng.prompt(text))
    index_group, history = eng.core.group("index"), eng.core.group("history")
    top_k = index_group.refs_target.shape[1]
    history_ids = [block_id(eng, "history", text, j)
                   for j in range(length // history.decl.block_size)]
    for i in range(length // index_group.decl.block_size):
        block = block_id(eng, "index", text, i)
        refs = index_group.refs_target[block]
        targets = refs[refs != NO_TARGET].tolist()
        end = (i + 1) * index_group.decl.block_size
        complete = [j for j, _ in enumerate(history_ids)
                    if (j + 1) * history.decl.block_size <= end]
        assert sorted(targets) == sorted(history_ids[j] for j in complete[-top_k:]), i
    assert eng.core.check_invariants() == []
    assert eng.lookup(text).usable_tokens == (length - 1) // 64 * 64
