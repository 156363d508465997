"""The Engine: the verification policy, lookups of prompts in any form, and commit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvfsm import Engine, ForeignPromptError, KvfsmError, StateCore, TokenError, VerifyPolicy
from kvfsm.lookup import Level, Reason
from kvfsm.spec import (
    Event,
    Form,
    GroupKind,
    Layout,
    ModelDecl,
    Tier,
    parse_model,
    shipped_lifecycles,
    shipped_models,
)
from kvfsm.state import NO_TARGET, CoreConfig, Prompt, StateError
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    FOUR,
    FULL,
    GPT_OSS,
    PROMPTS,
    QWEN,
    block_id,
    drive,
    engine,
    group,
    history_by_hand,
    model,
    tokens,
)

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



@pytest.mark.parametrize("field", ["full_at_or_above", "fast_below"])
@pytest.mark.parametrize("value", ["10", 1.5, None, True])
def test_a_policy_threshold_that_is_not_an_int_is_named(field: str, value: object) -> None:
    """A threshold compared with every request's priority must be an int priority: a string
    would make every lookup raise a TypeError, a float or bool would be read as a number."""
    with pytest.raises(KvfsmError, match=f"VerifyPolicy.{field}"):
        VerifyPolicy(**{field: value})  # type: ignore[arg-type]

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
    for name, each in eng.core.groups.items():
        assert np.array_equal(each.states, states[name]), name
        assert each.free_top == free[name], name
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
def test_commit_compresses_every_complete_history_block(length: int) -> None:
    """As the model does, a prefill compresses every complete window of history: every cached
    history block is compressed and read only as compressed."""
    eng = engine(DEEPSEEK)
    text = tokens(length)
    eng.commit(eng.prompt(text))
    decl = eng.core.group("history").decl
    for index in range(length // decl.block_size):
        block = block_id(eng, "history", text, index)
        assert _state(eng, "history", block) == "compressed", index
        form = Form.COMPRESSED
        assert eng.core.read("history", [block], form=form).shape == (1, decl.payload_bytes)
    assert eng.core.check_invariants() == []


@pytest.mark.parametrize("length", [320, 321, 384, 1024])
def test_a_committed_prompt_is_usable_up_to_its_last_boundary(length: int) -> None:
    """Regression: commit then look up the same tokens on deepseek_v4_like gave usable 0
    (``tail_missing``) at 320, 384 and 1024 tokens."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=128, host_blocks=16,
                                                backend="numpy"))
    prompt = eng.prompt(tokens(length))
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    assert verdict.usable_tokens == verdict.hit_tokens == (length - 1) // 64 * 64
    assert eng.core.check_invariants() == []


def test_commit_of_an_extended_prompt_keeps_the_shorter_one_usable() -> None:
    text = tokens(400)
    eng = engine(DEEPSEEK)
    eng.commit(eng.prompt(text[:200]))
    eng.commit(eng.prompt(text))
    for index in range(6):
        assert _state(eng, "history", block_id(eng, "history", text, index)) == "compressed"
    fresh = engine(DEEPSEEK)
    fresh.commit(fresh.prompt(text))
    assert eng.lookup(text).usable_tokens == fresh.lookup(text).usable_tokens == 384
    assert eng.lookup(text[:200]).usable_tokens == 192


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


# -- regressions: what an engine must refuse or get right ----------------------------------------


def test_an_engine_loads_a_shipped_model_by_name() -> None:
    eng = Engine("dense", CoreConfig(device_blocks=16, backend="numpy"))
    assert eng.model.name == "dense"
    with pytest.raises(KvfsmError, match="no shipped model 'nope'"):
        Engine("nope")


def test_an_engine_runs_a_custom_lifecycle() -> None:
    lifecycles = dict(shipped_lifecycles())
    custom = attrs.evolve(lifecycles["full_kv"], name="my_kv")
    model = parse_model(
        '[model]\nname = "m"\ndescription = "d"\nlayout_version = 1\n'
        + group("attn", "full", "my_kv", 16), lifecycles={**lifecycles, "my_kv": custom})
    with pytest.raises(KvfsmError, match="my_kv"):
        Engine(model)  # not given: a clear error, not a KeyError
    eng = Engine(model, CoreConfig(device_blocks=16, backend="numpy"),
                 lifecycles={"my_kv": custom})
    text = tokens(33)
    eng.commit(text.tolist())  # a list commits as it looks up
    assert eng.lookup(text.tolist()).usable_tokens == 32


def test_a_core_without_the_lifecycles_it_needs_says_which() -> None:
    with pytest.raises(KvfsmError, match=r"lifecycles \['full_kv'\]"):
        StateCore(DENSE, lifecycles={})


def test_unknown_events_are_named() -> None:
    eng = engine(DENSE)
    with pytest.raises(KvfsmError, match="unknown event 'no_such_event'"):
        eng.core.fire("attn", [0], "no_such_event")


def test_restorable_honours_the_speculative_drop_when_nothing_is_usable() -> None:
    """Regression: dense, 321 tokens, blocks 0-15 spilled: restorable was 320 with the drop."""
    eng = engine(DENSE, device=32, host=32)
    text = tokens(321)
    eng.commit(text)
    ids = [block_id(eng, "attn", text, i) for i in range(16)]
    eng.core.fire("attn", ids, "spill_begin")
    eng.core.fire("attn", ids, "spill_done")
    assert eng.lookup(text).restorable_tokens == 320
    dropped = eng.lookup(text, drop_last_block=True)
    assert (dropped.usable_tokens, dropped.restorable_tokens) == (0, 304)
    assert Reason.SPEC_DECODE_DROP in dropped.reason_set


def test_a_prefix_written_under_two_layouts_is_never_usable_as_a_whole() -> None:
    """Without ``kernel_layouts`` each group reads its declared layout."""
    eng = engine(DENSE)
    text = tokens(321)
    eng.commit(text[:161])
    decl = eng.core.group("attn").decl
    eng.core.set_write_layout("attn", Layout(("block", "dim", "token"), decl.layout.alignment,
                                             decl.layout.padding))
    eng.commit(text)
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == 160
    assert Reason.LAYOUT_MISMATCH in verdict.reason_set


def test_unknown_groups_are_refused_not_ignored() -> None:
    eng = engine(DENSE)
    text = tokens(40)
    with pytest.raises(KvfsmError, match="no group 'typo'"):
        eng.lookup(text, kernel_layouts={"typo": eng.core.group("attn").decl.layout})
    with pytest.raises(KvfsmError, match="no group 'typo'"):
        eng.commit(text, groups=["typo"])
    assert eng.core.group("attn").free_top == eng.core.group("attn").n_blocks


def test_a_prompt_is_bound_to_its_engine() -> None:
    """Regression: another engine's prompt committed under the wrong identity, another
    cache_salt was accepted, other block sizes crashed with a bare KeyError."""
    text = tokens(100)
    same_sizes = model("t_dense_twin", FULL)
    for other in (engine(same_sizes),
                  Engine(DENSE, CoreConfig(device_blocks=16, cache_salt="tenant-b",
                                           backend="numpy")),
                  engine(QWEN), engine(DEEPSEEK)):
        foreign = other.prompt(text)
        eng = engine(DENSE)
        for call in (eng.lookup, eng.commit):
            with pytest.raises(ForeignPromptError):
                call(foreign)
        assert eng.core.group("attn").free_top == eng.core.group("attn").n_blocks


def test_a_prompt_one_engine_checked_is_still_checked_by_another() -> None:
    """An engine remembers the prompts it checked (to skip the check on the next lookup); a
    prompt its twin checked, one of another cache_salt, or one of other block sizes is still
    refused by it after the other engine's lookups accepted it, and its own stay accepted."""
    text = tokens(100)
    eng = engine(DENSE)
    own = eng.prompt(text)
    eng.lookup(own)
    for other in (engine(model("t_dense_twin", FULL)),
                  Engine(DENSE, CoreConfig(device_blocks=16, cache_salt="tenant-b",
                                           backend="numpy")),
                  engine(QWEN)):
        foreign = other.prompt(text)
        other.lookup(foreign)
        other.lookup(foreign)  # checked and remembered by the other engine
        with pytest.raises(ForeignPromptError):
            eng.lookup(foreign)
        with pytest.raises(ForeignPromptError):
            other.lookup(own)
    assert eng.lookup(own).prompt_tokens == 100


@pytest.mark.parametrize("level", ["FULL", "full", Level.FULL])
def test_a_level_named_by_string_runs_its_checks(level: object) -> None:
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(text)
    group = eng.core.group("attn")
    block = block_id(eng, "attn", text, 5)
    group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), 3] ^= 0x01
    verdict = eng.lookup(text, level=level)  # type: ignore[arg-type]
    assert verdict.level is Level.FULL
    assert verdict.usable_tokens == 80


def test_an_unknown_level_is_refused() -> None:
    with pytest.raises(KvfsmError, match="unknown verification level 'MAX'"):
        engine(DENSE).lookup(tokens(40), level="MAX")


@pytest.mark.parametrize("bad", [[0.5] * 321, np.arange(321) + 0.9, [-1] * 40,
                                 np.full(40, 2**63, dtype=np.uint64)])
def test_token_ids_must_be_non_negative_integers(bad: object) -> None:
    """Regression: floats hit the cache of their truncation, negative ids were accepted and
    uint64 ids at or above 2**63 wrapped."""
    eng = engine(DENSE)
    eng.commit(np.zeros(321, dtype=np.int64))
    with pytest.raises(TokenError):
        eng.lookup(bad)  # type: ignore[arg-type]
    with pytest.raises(TokenError):
        eng.commit(bad)  # type: ignore[arg-type]


def test_commit_is_all_or_nothing_across_groups() -> None:
    """Regression: device_blocks=100, 1700 tokens: the window group raised and 26 history
    blocks stayed allocated."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=100, backend="numpy"))
    before = {name: g.states.copy() for name, g in eng.core.groups.items()}
    with pytest.raises(StateError, match="commit needs"):
        eng.commit(tokens(1700))
    for name, each in eng.core.groups.items():
        assert np.array_equal(each.states, before[name]), name
    assert eng.core.check_invariants() == []


def test_commit_makes_room_by_giving_back_the_least_recently_used() -> None:
    eng = engine(DENSE, device=20, host=0)
    old, newer, fresh = tokens(161, seed=1), tokens(81, seed=2), tokens(161, seed=3)
    eng.commit(old)
    eng.commit(newer)  # 10 + 5 of 20 device blocks
    eng.lookup(newer)
    eng.commit(fresh)  # 10 more: 5 must go, the oldest (the first prompt's)
    assert eng.lookup(fresh).usable_tokens == 160
    assert eng.lookup(newer).usable_tokens == 80
    assert eng.lookup(old).usable_tokens < 160
    assert eng.core.check_invariants() == []


def test_commit_spills_where_a_tier_has_room() -> None:
    eng = engine(DENSE, device=20, host=8)
    old, fresh = tokens(161, seed=1), tokens(321, seed=3)
    eng.commit(old)
    eng.commit(fresh)
    verdict = eng.lookup(old)
    assert verdict.hit_tokens > 0  # some of the old prompt went to host, still a hit
    assert Reason.NOT_RESIDENT in verdict.reason_set
    assert verdict.restorable_tokens > verdict.usable_tokens
    assert eng.core.check_invariants() == []


def test_pinned_blocks_are_never_given_back() -> None:
    eng = engine(DENSE, device=20, host=0)
    old = tokens(161, seed=1)
    eng.commit(old)
    ids = [block_id(eng, "attn", old, i) for i in range(10)]
    eng.core.pin("attn", ids)
    with pytest.raises(StateError, match="pinned"):
        eng.commit(tokens(321, seed=3))
    assert eng.lookup(old).usable_tokens == 160


def test_index_blocks_left_invalid_give_their_slots_back() -> None:
    """Regression: index blocks invalidated with their history kept their device slot
    forever; eviction never offered them."""
    eng = engine(DEEPSEEK, device=40, host=0)
    first = tokens(321, seed=1)
    eng.commit(first)
    history = block_id(eng, "history", first, 0)
    eng.core.fire("history", [history], "evict")
    stuck = eng.core.blocks_in("index", "invalid")
    assert stuck.size > 0
    assert set(eng.core.reclaimable("index").tolist()) == set(stuck.tolist())
    assert eng.core.eviction_candidates("index", stuck.size).tolist() == sorted(
        stuck.tolist(), key=lambda b: int(eng.core.group("index").last_use[b]))
    for seed in range(2, 7):  # growing prompts of other users under pressure
        eng.commit(tokens(321, seed=seed))
        assert eng.core.check_invariants() == []
    assert eng.core.blocks_in("index", "invalid").size <= stuck.size


def test_a_verdict_never_offers_restores_the_gate_would_refuse() -> None:
    """Regression: max_restores_in_flight=0 gave restorable 320 and a plan whose first step
    raised GuardRejected."""
    for budget, restorable in ((0, 32), (1, 80), (3, 192)):
        eng = Engine(DENSE, CoreConfig(device_blocks=32, host_blocks=32,
                                       max_restores_in_flight=budget, backend="numpy"))
        text = tokens(321)
        eng.commit(text)
        ids = [block_id(eng, "attn", text, i) for i in (2, 5, 9, 12)]
        eng.core.fire("attn", ids, "spill_begin")
        eng.core.fire("attn", ids, "spill_done")
        verdict = eng.lookup(text)
        restores = [s for s in verdict.plan if Event.RESTORE_BEGIN in s.path]
        assert len(restores) <= budget
        assert verdict.restorable_tokens == restorable
        for step in verdict.plan:
            for fired in step.path:
                eng.core.fire(step.group, [step.block_id], fired)
        assert eng.lookup(text).usable_tokens >= verdict.restorable_tokens


def test_verdict_summary_is_short() -> None:
    eng = engine(DEEPSEEK)
    text = tokens(1025)
    eng.commit(text)
    eng.core.fire("history", [block_id(eng, "history", text, 2)], "evict")
    verdict = eng.lookup(text)
    shown = str(verdict)
    assert shown.startswith("Verdict(STANDARD): 1025 prompt tokens, hit ")
    assert len(shown.splitlines()) <= 4
    assert "not_cached (history)" in shown


def test_verdict_summary_says_where_a_reason_was_listed_only_in_part() -> None:
    """A verdict lists the first 16 blocks per group and reason: a miss of 40 blocks shows as
    "16+ blocks", never as a count of 16."""
    eng = Engine(DENSE, CoreConfig(device_blocks=64, host_blocks=64, backend="numpy"))
    text = tokens(50 * 16 + 1)
    eng.commit(text)
    ids = [block_id(eng, "attn", text, i) for i in range(10, 50)]
    eng.core.fire("attn", ids, "spill_begin")
    eng.core.fire("attn", ids, "spill_done")
    shown = str(eng.lookup(text))
    assert "not_resident (attn) (16+ blocks, the first 16 listed)" in shown
    assert "x16" not in shown


def test_commit_settles_cached_history_before_indexing_it() -> None:
    """Index rows cached over a history block that was left raw (a prefill interrupted before
    compressing) are rewritten by the next commit of the prompt: it compresses the block
    first, which invalidates them, and only then plans what to write."""
    eng = engine(DEEPSEEK)
    text = tokens(321)
    prompt = eng.prompt(text)
    history_by_hand(eng, text, {1: "raw"})  # index rows point at the raw block 1
    assert eng.lookup(prompt).usable_tokens == 64
    eng.commit(prompt)
    assert _state(eng, "history", block_id(eng, "history", text, 1)) == "compressed"
    assert eng.lookup(prompt).usable_tokens == 320
    assert eng.core.check_invariants() == []


def test_a_speculative_drop_on_compressed_history_lands_on_the_previous_boundary() -> None:
    """Regression: with the raw tail rule every drop landed on 0."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=128, host_blocks=16,
                                                backend="numpy"))
    prompt = eng.prompt(tokens(321))
    eng.commit(prompt)
    verdict = eng.lookup(prompt, drop_last_block=True)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (256, 256)


def _snapshot(eng: Engine) -> dict[str, list[list[int]]]:
    """Every group's states, epochs, pins and device slots, and the admission's prefill rate."""
    out = {name: [state.states.tolist(), state.epoch.tolist(), state.pins.tolist(),
                  state.slot[Tier.DEVICE].tolist()] for name, state in eng.core.groups.items()}
    out["admission"] = [[int(eng.admission.measured_prefills)]]
    return out


@pytest.mark.parametrize(("call", "named"), [
    (lambda eng, prompt: eng.lookup(prompt, priority="high"), "priority"),
    (lambda eng, prompt: eng.lookup(prompt, priority=None), "priority"),
    (lambda eng, prompt: eng.lookup(prompt, priority=1.5), "priority"),
    (lambda eng, prompt: eng.plan(prompt, priority=True), "priority"),
    (lambda eng, prompt: eng.lookup(prompt, drop_last_block="yes"), "drop_last_block"),
    (lambda eng, prompt: eng.give_back("attn", -1), "count"),
    (lambda eng, prompt: eng.give_back("attn", 2.0), "count"),
    (lambda eng, prompt: eng.spill_down("attn", Tier.HOST, -3), "count"),
    (lambda eng, prompt: eng.spill_down("attn", "moon", 1), "tier"),
    (lambda eng, prompt: eng.spill_down("attn", 7, 1), "tier"),
    (lambda eng, prompt: eng.record_prefill(-5, 1.0), "tokens"),
    (lambda eng, prompt: eng.record_prefill(5, float("nan")), "seconds"),
    (lambda eng, prompt: eng.record_prefill(5, -1.0), "seconds"),
    (lambda eng, prompt: eng.restore("a verdict", prompt), "Verdict"),
    (lambda eng, prompt: eng.lease("a verdict", prompt), "Verdict"),
    (lambda eng, prompt: eng.lease(None, prompt), "Verdict"),
    (lambda eng, prompt: eng.lookup(prompt, kernel_layouts=["attn"]), "kernel_layouts"),
    (lambda eng, prompt: eng.core.fire("attn", [0], "evict", masked="yes"), "masked"),
])
def test_a_bad_argument_is_a_kvfsm_error_naming_it_and_changes_nothing(
        call: Callable[[Engine, Prompt], object], named: str) -> None:
    """Counts, tiers, flags, priorities and measurements of the wrong type or range are a
    KvfsmError that names the argument, raised before anything moves."""
    eng = engine(DENSE, host=8)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    before = _snapshot(eng)
    with pytest.raises(KvfsmError, match=named):
        call(eng, prompt)
    assert _snapshot(eng) == before


def test_plain_arguments_take_their_usual_spellings() -> None:
    """NumPy integers serve as counts and priorities, tier names as tiers (any case), and a
    measurement of no tokens or no time is ignored."""
    eng = engine(DENSE, host=8)
    prompt = eng.prompt(tokens(161))
    eng.commit(prompt)
    assert eng.lookup(prompt, priority=np.int64(20)).level is Level.FULL
    assert eng.give_back("attn", np.int32(2)) == 2
    assert eng.spill_down("attn", "HOST", np.int64(0)) == 0
    eng.record_prefill(0, 0.0)
    assert eng.admission.measured_prefills == 0


def test_restoring_another_engines_verdict_is_refused() -> None:
    """A verdict's plan names its own engine's block ids: restored on another engine it would
    move that engine's unrelated blocks, so it is a KvfsmError and nothing moves."""
    first, second = engine(DENSE, host=8), engine(DENSE, host=8)
    text = tokens(161)
    for eng in (first, second):
        prompt = eng.prompt(text)
        eng.commit(prompt)
        eng.give_back("attn", 10)  # device -> host: the next verdicts plan restores
    verdict = first.lookup(first.prompt(text))
    assert verdict.plan
    before = _snapshot(second)
    with pytest.raises(KvfsmError, match="another engine"):
        second.restore(verdict, second.prompt(text))
    assert _snapshot(second) == before
    assert verdict.restorable_tokens > verdict.usable_tokens
    first.restore(verdict, first.prompt(text)).wait()
    assert first.lookup(first.prompt(text)).usable_tokens == verdict.restorable_tokens


@pytest.mark.parametrize(("options", "named"), [
    ({"profile": "h100"}, "profile"),
    ({"policy": {"0": "FULL"}}, "policy"),
    ({"metrics": object()}, "metrics"),
    ({"event_log": "events.jsonl"}, "event_log"),
    ({"admission": {"max_ops": 4}}, "admission"),
    ({"tiers": ["disk"]}, "tiers"),
    ({"workers": 0}, "workers"),
    ({"workers": "2"}, "workers"),
    ({"workers": True}, "workers"),
])
def test_an_engine_option_of_the_wrong_kind_is_named_before_anything_starts(
        options: dict[str, object], named: str) -> None:
    """Each option that is not what it must be is a KvfsmError naming it, raised before the
    engine makes anything (no restore worker thread is left behind)."""
    threads = threading.active_count()
    with pytest.raises(KvfsmError, match=rf"Engine\({named}="):
        Engine("dense", CoreConfig(device_blocks=8, backend="numpy"),
               **options)  # type: ignore[arg-type]
    assert threading.active_count() == threads


@pytest.mark.parametrize(("model", "config", "named"), [
    ("dense", {"device_blocks": 4}, "CoreConfig"),
    ({"name": "dense"}, None, "ModelDecl"),
])
def test_an_engine_of_the_wrong_kind_of_model_or_config_is_a_kvfsm_error(
        model: object, config: object, named: str) -> None:
    with pytest.raises(KvfsmError, match=named):
        Engine(model, config)  # type: ignore[arg-type]


def test_a_closed_engine_that_served_lookups_is_freed_once_dropped() -> None:
    """Lookups keep a per-core view of the groups: with the core, not in a module-level map
    whose values would hold every core ever looked up (and its pools) alive."""
    import gc
    import weakref

    from tests.lookup_models import DENSE, engine, tokens

    def served() -> weakref.ref[object]:
        eng = engine(DENSE)
        text = tokens(100)
        eng.commit(eng.prompt(text))
        assert eng.lookup(text).usable_tokens == 96
        core = weakref.ref(eng.core)
        eng.close()
        return core

    first = served()
    second = served()  # the lookup module's last-used core is now this one
    gc.collect()
    assert first() is None and second() is None


# -- the plan's promise ---------------------------------------------------------------------


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from([DENSE, GPT_OSS, QWEN, DEEPSEEK, FOUR]))
def test_restoring_a_verdicts_plan_makes_its_restorable_prefix_usable(
        data: st.DataObject, decl: ModelDecl) -> None:
    """On any state the core's API can reach (blocks spilled, restoring, evicted, compressed,
    invalidated; prompts committed over each other in pools that fill up), restoring a FULL
    verdict's plan and settling it makes exactly its ``restorable_tokens`` usable: never
    more (the verdict promised less than it could serve: a needless recompute), never less
    (it promised what the plan cannot make) unless a copy failed its check on the way (a
    host copy corrupted on purpose), and never less than it was usable before."""
    eng = engine(decl, device=data.draw(st.sampled_from([16, 64]), label="device blocks"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    text = text[: data.draw(st.integers(1, text.size), label="cut")]
    with contextlib.suppress(KvfsmError):
        eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
    drawn = drive(eng, data, data.draw(st.integers(0, 10), label="steps"),
                  ops=("commit", "event", "corrupt"))
    # Last, some device blocks given back to host (a hit to restore).
    drive(eng, data, data.draw(st.integers(0, 3), label="offloads"), ops=("offload",))
    prompt = eng.prompt(text)
    verdict = eng.lookup(prompt, level=Level.FULL)
    event("a plan" if verdict.plan else "no plan")
    eng.restore(verdict, prompt).wait(timeout=30)
    after = eng.lookup(prompt, level=Level.FULL)
    assert after.usable_tokens >= verdict.usable_tokens, (verdict.plan, after.reasons)
    assert after.usable_tokens <= verdict.restorable_tokens, (verdict.plan, after.reasons)
    if "corrupt" not in drawn:
        assert after.usable_tokens == verdict.restorable_tokens, (verdict.plan, after.reasons)
    assert eng.core.check_invariants() == []


def test_a_prefix_longer_than_the_device_pool_restores_what_fits_and_no_more() -> None:
    """The verdict counts restores against the admission budget, not device slots (see
    docs/gates.md): a six-block prefix, three blocks of it on host, in a four-slot device
    pool is called restorable whole. Restoring it fills the one free slot (every resident
    block is the prefix's own, so none is given back); the other restores fail their room
    guard and change nothing. The prefix is then usable exactly up to the first block still
    on host, a lease on it validates, and the rest stays restorable from host."""
    eng = Engine(DENSE, CoreConfig(device_blocks=4, host_blocks=8, backend="numpy"))
    text = tokens(6 * 16 + 1)
    head = eng.prompt(text[:4 * 16])
    eng.commit(head)
    eng.offload("attn", [block_id(eng, "attn", text, i) for i in range(3)])
    prompt = eng.prompt(text)
    # The prefill reused the head: blocks 3, 4 and 5 on device, 0, 1 and 2 on host.
    eng.commit(prompt, computed_from=4 * 16)
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert (verdict.usable_tokens, verdict.restorable_tokens, len(verdict.plan)) == (0, 96, 3)
    eng.restore(verdict, prompt).wait(timeout=30)
    after = eng.lookup(prompt, level=Level.FULL)
    assert (after.usable_tokens, after.restorable_tokens) == (16, 96)
    assert eng.core.group("attn").pools[Tier.DEVICE].free == 0
    with eng.lease(after, prompt) as lease:
        assert lease.blocks("attn").tolist() == [block_id(eng, "attn", text, 0)]
        lease.validate()
    assert eng.core.check_invariants() == []


# -- what besides the token ids decides the KV ---------------------------------------------------

#: Tokens per block of the test models' finest groups (every kind's blocks are whole ones).
FULL_BLOCK = 16


def _namespace_bytes(namespace: str | bytes | None) -> bytes:
    return namespace.encode() if isinstance(namespace, str) else namespace or b""


#: A few content keys (ranges of the first 120 tokens, two contents) requests draw from.
_CONTENT = st.lists(st.tuples(st.integers(0, 110), st.integers(1, 30),
                              st.sampled_from(("image-1", "image-2"))).map(
    lambda k: (k[0], k[0] + k[1], k[2])), max_size=3, unique=True)


@settings(max_examples=100, deadline=None)
@given(decl=st.sampled_from([DENSE, GPT_OSS, QWEN, DEEPSEEK]), data=st.data())
def test_a_prefix_is_never_usable_past_where_two_requests_kv_agree(
        decl: ModelDecl, data: st.DataObject) -> None:
    """Request A is committed, request B looked up. B's hit (so its usable prefix too) never
    reaches past where the two requests' KV agree, in whole blocks: nowhere across two
    namespaces; else not past the first token where their ids differ, nor past the first
    token of a content key one of them has and the other not. With one full-attention group
    the usable prefix is exactly that point in whole blocks (below B's last token)."""
    text = tokens(data.draw(st.integers(2, 150), label="A tokens"), seed=3)
    # B is A with some of: another namespace, other content keys, a changed token, a cut,
    # a tail of its own.
    namespaces = st.sampled_from((None, "", "lora:x", b"lora:y"))
    ns_a = data.draw(namespaces, label="A namespace")
    mostly_same = st.sampled_from((True, True, True, False))
    ns_b = ns_a if data.draw(mostly_same, label="same namespace") else \
        data.draw(namespaces, label="B namespace")
    keys_a = data.draw(_CONTENT, label="A keys")
    keys_b = keys_a if data.draw(mostly_same, label="same keys") else \
        data.draw(_CONTENT, label="B keys")
    other = text.copy()
    if data.draw(st.booleans(), label="B changes a token"):
        other[data.draw(st.integers(0, text.size - 1), label="at")] += 1
    keeps = st.one_of(st.just(text.size), st.integers(2, text.size))
    other = np.concatenate([other[: data.draw(keeps, label="B keeps")],
                            tokens(data.draw(st.integers(0, 40), label="B adds"), seed=9)])
    eng = engine(decl)
    eng.commit(eng.prompt(text, namespace=ns_a, content_keys=keys_a))
    verdict = eng.lookup(eng.prompt(other, namespace=ns_b, content_keys=keys_b))
    same = np.flatnonzero(text[: other.size] != other[: text.size])
    agree = int(same[0]) if same.size else min(text.size, other.size)
    as_bytes = {(s, e, k.encode()) for s, e, k in keys_a} ^ \
        {(s, e, k.encode()) for s, e, k in keys_b}
    agree = min([agree, *(start for start, _, _ in as_bytes)])
    if _namespace_bytes(ns_a) != _namespace_bytes(ns_b):
        agree = 0
    event(f"agree in blocks: {min(agree // FULL_BLOCK, 4)}")
    assert verdict.usable_tokens <= verdict.hit_tokens <= agree // FULL_BLOCK * FULL_BLOCK
    if decl is DENSE:
        assert verdict.usable_tokens == min(agree, other.size - 1) // FULL_BLOCK * FULL_BLOCK


@pytest.mark.parametrize("how", ["float32", "transposed", "flat", "list"])
def test_a_payload_of_the_wrong_type_or_shape_is_refused_and_nothing_cached(how: str) -> None:
    """The payload is the blocks' bytes: a float array of the right byte count would be cached
    as its rounded values, a transposed one scrambled. Both are refused, naming the group and
    the shape expected, and nothing is cached."""
    eng = Engine(DENSE, CoreConfig(device_blocks=16, backend="numpy"))
    text = tokens(4 * 16 + 1)
    width = eng.core.group("attn").decl.payload_bytes

    def payload(group: Any, index: Any) -> Any:
        good = np.zeros((index.size, width), dtype=np.uint8)
        return {"float32": good.view(np.float32), "transposed": good.T, "flat": good.ravel(),
                "list": good.tolist()}[how]

    with pytest.raises(KvfsmError, match=r"attn: the payload of 4 blocks must be a uint8 array "
                                         r"of shape \[4, "):
        eng.commit(text, payload=payload)
    assert eng.lookup(text).hit_tokens == 0
    assert eng.core.check_invariants() == []


#: Values no argument of the public calls below accepts in that place (some are good
#: elsewhere: a call taking one is simply not refused).
BAD_ARGUMENTS = [None, -1, 1.5, "x", [[1, 2]], [1 << 70], float("inf"), float("nan"),
                 {"a": 1}, object(), b"xx", True, 2**63, [-1], np.array([[1]]), ()]


def _fingerprint(eng: Engine) -> tuple[bytes, ...]:
    return tuple(array.tobytes() for group in eng.core.groups.values()
                 for array in (group.states, group.epoch, group.block_pins, group.check))


def test_bad_arguments_of_every_public_call_are_a_kvfsm_error_and_change_nothing() -> None:
    """A seeded sweep of bad values through every argument of the public calls: each is
    accepted (where it is a good value there) or refused with a KvfsmError, never a bare
    TypeError / ValueError / OverflowError, and a refused call leaves every block as it was
    (its state, epoch, pins and checksum record)."""
    eng = Engine(DENSE, CoreConfig(device_blocks=16, host_blocks=8, backend="numpy"))
    prompt = eng.prompt(tokens(65))
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    calls: dict[str, Callable[[Any], object]] = {
        "lookup(level)": lambda b: eng.lookup(prompt, level=b),
        "lookup(priority)": lambda b: eng.lookup(prompt, priority=b),
        "lookup(drop_last_block)": lambda b: eng.lookup(prompt, drop_last_block=b),
        "lookup(kernel_layouts)": lambda b: eng.lookup(prompt, kernel_layouts=b),
        "lookup(prompt)": lambda b: eng.lookup(b),
        "commit(groups)": lambda b: eng.commit(prompt, groups=b),
        "commit(computed_from)": lambda b: eng.commit(prompt, computed_from=b),
        "commit(unavailable)": lambda b: eng.commit(prompt, unavailable=b),
        "commit(payload)": lambda b: eng.commit(prompt, payload=b),
        "give_back(group)": lambda b: eng.give_back(b, 1),
        "give_back(count)": lambda b: eng.give_back("attn", b),
        "give_back(keep)": lambda b: eng.give_back("attn", 1, keep=b),
        "offload(group)": lambda b: eng.offload(b, [0]),
        "offload(ids)": lambda b: eng.offload("attn", b),
        "spill_down(tier)": lambda b: eng.spill_down("attn", b, 1),
        "spill_down(count)": lambda b: eng.spill_down("attn", "host", b),
        "restore(verdict)": lambda b: eng.restore(b),
        "restore(prompt)": lambda b: eng.restore(verdict, b),
        "lease(ttl_s)": lambda b: eng.lease(verdict, prompt, ttl_s=b),
        "lease(verdict)": lambda b: eng.lease(b, prompt),
        "lease(prompt)": lambda b: eng.lease(verdict, b),
        "plan(priority)": lambda b: eng.plan(prompt, priority=b),
        "record_prefill(tokens)": lambda b: eng.record_prefill(b, 1.0),
        "record_prefill(seconds)": lambda b: eng.record_prefill(10, b),
        "prompt(namespace)": lambda b: eng.prompt([1, 2, 3], namespace=b),
        "prompt(content_keys)": lambda b: eng.prompt([1, 2, 3], content_keys=b),
        "discover(prompt)": lambda b: eng.discover(b),
        "register_graph": lambda b: eng.register_graph(b),
        "activate_graph": lambda b: eng.activate_graph(b),
        "wait(group)": lambda b: eng.restore(verdict, prompt).wait(b),
        "wait(timeout)": lambda b: eng.restore(verdict, prompt).wait(timeout=b),
    }
    for name, call in calls.items():
        for bad in BAD_ARGUMENTS:
            before = _fingerprint(eng)
            try:
                with eng.lock:  # nothing else moves meanwhile
                    call(bad)
            except KvfsmError:
                assert _fingerprint(eng) == before, (name, bad)
    assert eng.core.check_invariants() == []


def test_a_closed_engine_refuses_every_call_and_leaves_nothing_in_flight(tmp_path: Any) -> None:
    """After close() every call is an EngineClosed (a KvfsmError) and moves no block; close
    settles what was in flight, so no block is left restoring or spilling; a second close does
    nothing."""
    from kvfsm import EngineClosed
    from kvfsm.tiers import DiskTier

    eng = Engine(DENSE, CoreConfig(device_blocks=16, host_blocks=8, disk_blocks=16,
                                   backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path, capacity_bytes=1 << 30, fsync=False)})
    prompt = eng.prompt(tokens(65))
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    eng.offload("attn", [0, 1])
    eng.close()
    eng.close()
    in_flight = eng.core.group("attn").table.in_flight
    before = _fingerprint(eng)
    for call in (lambda: eng.lookup(prompt), lambda: eng.commit(prompt),
                 lambda: eng.restore(verdict, prompt), lambda: eng.offload("attn", [2]),
                 lambda: eng.give_back("attn", 1), lambda: eng.spill_down("attn", "host", 1),
                 lambda: eng.lease(verdict, prompt), lambda: eng.lookup_and_lease(prompt),
                 lambda: eng.discover(prompt), lambda: eng.plan(prompt),
                 lambda: eng.prompt([1, 2])):
        with pytest.raises(EngineClosed, match="closed"):
            call()
    assert _fingerprint(eng) == before
    assert not in_flight[eng.core.group("attn").states].any()
    assert eng.core.check_invariants() == []


def test_restore_refuses_a_prompt_other_than_the_one_its_verdict_looked_up() -> None:
    """The plan of one prompt is never run for another: a prompt of the same length but other
    tokens (or another length) is a KvfsmError, and nothing is restored; an equal prompt made
    anew is the same prompt."""
    eng = Engine(DENSE, CoreConfig(device_blocks=16, host_blocks=16, backend="numpy"))
    text = tokens(65)
    prompt = eng.prompt(text)
    eng.commit(prompt)
    eng.offload("attn", [block_id(eng, "attn", text, i) for i in range(4)])
    verdict = eng.lookup(prompt)
    assert verdict.plan
    other = eng.prompt(text + 1)
    before = _fingerprint(eng)
    with pytest.raises(KvfsmError, match="another prompt"):
        eng.restore(verdict, other)
    with pytest.raises(KvfsmError, match="another prompt"):
        eng.restore(verdict, eng.prompt(text[:33]))
    assert _fingerprint(eng) == before
    eng.restore(verdict, eng.prompt(text)).wait(timeout=30)
    assert eng.lookup(prompt).usable_tokens == 64
