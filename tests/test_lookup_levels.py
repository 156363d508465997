"""Tiered verification: a reduced level never says "usable" where FULL would not."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from kvfsm import Engine, GuardRejected, KvfsmError
from kvfsm.lookup import DeviceProfile, Level, Reason
from kvfsm.spec import Event, Tier
from kvfsm.state import CoreConfig
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    FOUR,
    GPT_OSS,
    PROMPTS,
    block_id,
    drive,
    engine,
    tokens,
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, GPT_OSS]))
def test_reduced_levels_never_report_more_than_full(data: st.DataObject, decl: object) -> None:
    """For any state the core's API can reach (including host copies corrupted on purpose,
    bits flipped in device memory before and after restores, device profiles stricter than the
    pools and scrambled index references), once a FULL lookup has run, FAST <= STANDARD <=
    FULL in usable and restorable tokens. Before it, the same holds unless device memory was
    corrupted in place after its last verification: that is exactly what reduced levels do
    not re-check."""
    eng = engine(decl, device=24, host=6)  # type: ignore[arg-type]
    drawn = drive(eng, data, data.draw(st.integers(1, 12), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    fast = eng.lookup(prompt, level=Level.FAST)
    standard = eng.lookup(prompt, level=Level.STANDARD)
    full = eng.lookup(prompt, level=Level.FULL)
    later = drive(eng, data, data.draw(st.integers(0, 4), label="more steps")) \
        if data.draw(st.booleans(), label="corrupt after FULL") else set()
    full_again = eng.lookup(prompt, level=Level.FULL) if later else full
    after = [eng.lookup(prompt, level=level) for level in (Level.FAST, Level.STANDARD)]
    before = (fast, standard) if "flip" not in drawn else ()
    for reduced, reference in [(r, full) for r in before] + [(r, full_again) for r in after]:
        assert reduced.usable_tokens <= reference.usable_tokens
        assert reduced.restorable_tokens <= reference.restorable_tokens
        assert reduced.hit_tokens == reference.hit_tokens
    assert fast.hit_tokens == standard.hit_tokens == full.hit_tokens
    # Lookups change no lifecycle state: the core is as consistent as the drive left it.
    assert "scramble" in drawn | later or eng.core.check_invariants() == []


def test_a_block_seen_failing_is_unusable_at_every_level() -> None:
    """Regression: one device byte flipped on a dense model: FULL said usable 80 with
    ``checksum_mismatch``, then STANDARD, FAST and a plain lookup (priority 0) said 160."""
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    assert eng.lookup(text, level=Level.STANDARD).usable_tokens == 160  # verified at write
    group = eng.core.group("attn")
    block = block_id(eng, "attn", text, 5)
    group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), 3] ^= 0x01
    # In-place corruption after verification: a reduced level does not re-check (documented).
    assert eng.lookup(text, level=Level.STANDARD).usable_tokens == 160
    assert eng.lookup(text, level=Level.FULL).usable_tokens == 80
    for level in (Level.FULL, Level.STANDARD, Level.FAST, "full", "STANDARD"):
        verdict = eng.lookup(text, level=level)
        assert verdict.usable_tokens == 80, level
        assert Reason.CHECKSUM_MISMATCH in verdict.reason_set
    assert eng.lookup(text).usable_tokens == 80  # priority 0: STANDARD
    assert eng.core.describe("attn", block).verified is False
    assert eng.core.failed_blocks("attn").tolist() == [block]


def test_the_next_commit_replaces_a_block_seen_failing() -> None:
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    group = eng.core.group("attn")
    block = block_id(eng, "attn", text, 5)
    group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), 3] ^= 0x01
    assert eng.lookup(text, level=Level.FULL).usable_tokens == 80
    out = eng.commit(eng.prompt(text))
    assert out["attn"].size == 1
    assert eng.lookup(text, level=Level.FULL).usable_tokens == 160
    assert eng.core.check_invariants() == []


def test_a_plain_lookup_verifies_nothing_twice() -> None:
    """A reduced level records what it verified, so the next one computes no checksum."""
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    first = eng.lookup(text, level=Level.FULL)
    assert sum(c.block_ids.size for c in first.checks) == 10
    assert eng.lookup(text, level=Level.STANDARD).checks == ()


def test_fast_skips_alignment_only_where_the_pools_guarantee_it() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    assert eng.lookup(text, level=Level.FAST).usable_tokens == \
        eng.lookup(text, level=Level.FULL).usable_tokens < 160


@settings(max_examples=150, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, GPT_OSS, FOUR]),
       budget=st.sampled_from([0, 1, 2, 64]))
def test_executing_the_plan_delivers_what_the_verdict_promised(
        data: st.DataObject, decl: object, budget: int) -> None:
    """For any state the core's API can reach, firing a verdict's plan step by step (after
    making device room as the engine's restore does) never meets a refusal the verdict could
    have known of (only a restore finding its host copy corrupt may fail, and then falls back:
    a copy corrupted on purpose, or one spilled from device bytes flipped since their last
    check, which no lookup reads), never leaves less usable than before, and, when no restore
    failed, leaves at least ``restorable_tokens`` usable."""
    eng = Engine(decl, CoreConfig(device_blocks=24, host_blocks=6,  # type: ignore[arg-type]
                                  max_restores_in_flight=budget, backend="numpy"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    drawn = drive(eng, data, data.draw(st.integers(0, 3), label="steps"))
    assume("scramble" not in drawn)
    with contextlib.suppress(KvfsmError):
        eng.commit(prompt)
    # Move some of the prompt's resident blocks a step away from usable: spilled (restores),
    # mid-way (in flight), or compressing.
    for _ in range(data.draw(st.integers(1, 6), label="moves")):
        name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
        live = eng.core.lookup_words(name, *prompt.words(eng.core.group(name).decl.block_size))
        live = live[live >= 0]
        if not live.size:
            continue
        block = data.draw(st.sampled_from(live.tolist()), label="block")
        path = data.draw(st.sampled_from([
            (Event.SPILL_BEGIN, Event.SPILL_DONE), (Event.SPILL_BEGIN,),
            (Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN),
            (Event.COMPRESS_BEGIN,)]), label="events")
        for move in path:
            if not eng.core.fire(name, [block], move, masked=True).all():
                break
    verdict = eng.lookup(prompt, level=Level.FULL)
    restores = sum(Event.RESTORE_BEGIN in step.path for step in verdict.plan)
    event("a plan with restores" if restores else "a plan" if verdict.plan else "no plan")
    # Device room first, as the engine's restore makes it (unpinned blocks outside the prompt
    # given back): a verdict holds its plan to the admission caps, and a full device is the
    # restore executor's to make room in.
    for name in {step.group for step in verdict.plan}:
        wanted = sum(Event.RESTORE_BEGIN in step.path for step in verdict.plan
                     if step.group == name)
        own = eng.core.lookup_words(name, *prompt.words(eng.core.group(name).decl.block_size))
        eng.give_back(name, max(wanted - eng.core.group(name).pools[Tier.DEVICE].free, 0),
                      own[own >= 0])
    failed_restores = 0
    for step in verdict.plan:
        for fired in step.path:
            try:
                eng.core.fire(step.group, [step.block_id], fired)
            except GuardRejected:
                assert fired is Event.RESTORE_DONE and drawn & {"corrupt", "flip"}, \
                    (step, fired)
                eng.core.fire(step.group, [step.block_id], Event.RESTORE_FAIL)
                failed_restores += 1
                break
    after = eng.lookup(prompt, level=Level.FULL)
    assert after.usable_tokens >= verdict.usable_tokens
    if not failed_restores:
        assert after.usable_tokens >= verdict.restorable_tokens
    assert eng.core.check_invariants() == []


@pytest.mark.parametrize(("field", "value"), [
    ("base_alignment", 0), ("base_alignment", -256), ("base_alignment", True),
    ("size_alignment", 0), ("size_alignment", "16"), ("size_alignment", 1.5),
    ("name", ""), ("name", 5),
])
def test_a_device_profile_no_block_could_be_checked_against_is_named(field: str,
                                                                    value: object) -> None:
    """Alignments are positive ints of bytes: a 0 would divide by zero in the alignment
    layer of every lookup, a string or float would fail there or be read as a number."""
    with pytest.raises(KvfsmError, match=f"DeviceProfile.{field}"):
        DeviceProfile(**{field: value})  # type: ignore[arg-type]
