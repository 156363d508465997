"""Tiered verification: a reduced level never says "usable" where FULL would not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.verify import DeviceProfile, Level
from tests.verify_models import DEEPSEEK, GPT_OSS, PROMPTS, drive, engine, tokens


@settings(max_examples=60, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, GPT_OSS]))
def test_reduced_levels_never_report_more_than_full(data: st.DataObject, decl: object) -> None:
    """For any state the core's API can reach (including host copies corrupted on purpose,
    device profiles stricter than the pools and scrambled index references), FAST <=
    STANDARD <= FULL in usable and restorable tokens, whether the reduced lookups run before or
    after a FULL one."""
    eng = engine(decl, device=24, host=6)  # type: ignore[arg-type]
    drawn = drive(eng, data, data.draw(st.integers(1, 12), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    fast = eng.lookup(prompt, level=Level.FAST)
    standard = eng.lookup(prompt, level=Level.STANDARD)
    full = eng.lookup(prompt, level=Level.FULL)
    after = [eng.lookup(prompt, level=level) for level in (Level.FAST, Level.STANDARD)]
    for reduced in (fast, standard, *after):
        assert reduced.usable_tokens <= full.usable_tokens
        assert reduced.restorable_tokens <= full.restorable_tokens
        assert reduced.hit_tokens == full.hit_tokens
    # Lookups change no lifecycle state: the core is as consistent as the drive left it.
    assert "scramble" in drawn or eng.core.check_invariants() == []


def test_fast_skips_alignment_only_where_the_pools_guarantee_it() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    assert eng.lookup(text, level=Level.FAST).usable_tokens == \
        eng.lookup(text, level=Level.FULL).usable_tokens < 160
