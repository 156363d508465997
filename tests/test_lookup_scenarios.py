"""Per-kind semantics the leading engines agree on, pinned from scratch on kvfsm's verdict."""

from __future__ import annotations

import pytest

from kvfsm.lookup import Reason
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    FOUR,
    GPT_OSS,
    QWEN,
    SWA_ONLY,
    TWO_SIZES,
    block_id,
    engine,
    tokens,
)

#: Every test runs with compiled kernels and with their NumPy twins.
pytestmark = pytest.mark.usefixtures("jit_backend")


def test_full_attention_stops_at_the_first_missing_block() -> None:
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    assert eng.lookup(text).usable_tokens == 160
    eng.core.fire("attn", [block_id(eng, "attn", text, 3)], "evict")
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == verdict.hit_tokens == 48
    assert verdict.group("attn").stop is Reason.NOT_CACHED


def test_sliding_window_needs_only_the_last_blocks_of_its_window() -> None:
    """W=64, B=16: the next token reads tokens [L-63, L), i.e. ceil(63/16) = 4 blocks."""
    eng = engine(SWA_ONLY)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    for index in range(6):  # blocks 0..5 are outside the window at L=160
        eng.core.fire("swa", [block_id(eng, "swa", text, index)], "evict")
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == verdict.hit_tokens == 160


def test_a_window_hole_is_exact_not_a_shrinking_spiral() -> None:
    """With block 7 gone, no shorter length helps either (every window from 112 to 160
    touches block 7; shorter ones touch evicted blocks), so the answer is 0 in one pass."""
    eng = engine(SWA_ONLY)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    for index in (0, 1, 2, 3, 4, 5, 7):
        eng.core.fire("swa", [block_id(eng, "swa", text, index)], "evict")
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == 0
    assert Reason.WINDOW_MISMATCH in verdict.reason_set


def test_sliding_window_reuse_is_not_downward_closed() -> None:
    """Usable at 160 but not at 144: the window at 144 needs evicted block 5."""
    eng = engine(SWA_ONLY)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    for index in range(6):
        eng.core.fire("swa", [block_id(eng, "swa", text, index)], "evict")
    assert eng.lookup(text).usable_tokens == 160
    assert eng.lookup(text[:146]).usable_tokens == 0


def test_evicting_the_first_full_block_makes_a_hybrid_request_a_miss() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    assert eng.lookup(text).usable_tokens == 160
    eng.core.fire("attn", [block_id(eng, "attn", text, 0)], "evict")
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == verdict.hit_tokens == 0


def test_groups_with_different_block_sizes_hit_only_at_multiples_of_the_lcm() -> None:
    eng = engine(TWO_SIZES)  # 16 and 24: LCM 48
    text = tokens(90)
    eng.commit(eng.prompt(text))
    verdict = eng.lookup(text)
    # The 16-token chain reaches 80 and the 24-token chain 72, but they meet only at 48.
    assert verdict.usable_tokens == verdict.hit_tokens == 48
    assert Reason.BLOCK_BOUNDARY in verdict.reason_set
    longer = tokens(200)
    eng.commit(eng.prompt(longer))
    assert eng.lookup(longer).usable_tokens == 192


def test_recurrent_state_hits_only_at_a_checkpoint() -> None:
    eng = engine(QWEN)  # snapshots every 64 tokens
    text = tokens(161)
    eng.commit(eng.prompt(text))
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == 128
    assert verdict.group("attn").usable_tokens == 160
    assert verdict.group("delta").usable_tokens == 128


def test_two_three_and_four_group_mixes_serve_a_committed_prompt() -> None:
    for decl, expected in ((GPT_OSS, 192), (DEEPSEEK, 192), (FOUR, 192)):
        eng = engine(decl)
        text = tokens(200)
        eng.commit(eng.prompt(text))
        verdict = eng.lookup(text)
        assert verdict.usable_tokens == expected, (decl.name, verdict)
        assert verdict.hit_tokens == expected
        assert not verdict.plan


def test_compressed_history_is_usable_at_every_boundary() -> None:
    """A prefill compresses every complete history block; a prefix is usable at each
    compression boundary, with nothing raw needed there (shorter prompts sharing the blocks
    included)."""
    eng = engine(DEEPSEEK)
    text = tokens(257)
    eng.commit(eng.prompt(text))
    states = [eng.core.describe("history", int(b)).state
              for b in eng.core.lookup_words("history", *eng.prompt(text).words(64))]
    assert states == ["compressed"] * 4
    assert eng.lookup(text).usable_tokens == 256
    for length, usable in ((193, 192), (129, 128), (65, 64)):
        shorter = eng.lookup(text[:length])
        assert shorter.hit_tokens == shorter.usable_tokens == usable


def test_a_shorter_commit_then_a_longer_one_keeps_the_shorter_usable() -> None:
    """Commit 200 then 300 tokens: the 200-token prompt is still usable at 192."""
    eng = engine(DEEPSEEK)
    text = tokens(300)
    eng.commit(eng.prompt(text[:200]))
    eng.commit(eng.prompt(text))
    assert eng.lookup(text[:200]).usable_tokens == 192
    assert eng.lookup(text).usable_tokens == 256
    assert eng.core.check_invariants() == []


def test_spill_then_restore_plan_recovers_everything() -> None:
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    ids = [block_id(eng, "attn", text, i) for i in (2, 5)]
    eng.core.fire("attn", ids, "spill_begin")
    eng.core.fire("attn", ids, "spill_done")
    verdict = eng.lookup(text)
    assert verdict.hit_tokens == 160
    assert verdict.usable_tokens == 32
    assert verdict.restorable_tokens == 160
    assert [(s.block_index, [e.spec_name for e in s.path]) for s in verdict.plan] == [
        (2, ["restore_begin", "restore_done"]), (5, ["restore_begin", "restore_done"])]
    for step in verdict.plan:
        for event in step.path:
            eng.core.fire(step.group, [step.block_id], event)
    assert eng.lookup(text).usable_tokens == 160
