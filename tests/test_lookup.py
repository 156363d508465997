"""A verdict with nothing to explain: its groups' figures are its own."""

from __future__ import annotations

import contextlib

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm.lookup import Level, lookup
from kvfsm.spec import ModelDecl
from tests.lookup_models import DEEPSEEK, DENSE, FOUR, GPT_OSS, PROMPTS, QWEN, drive, engine

MODELS = [DENSE, GPT_OSS, QWEN, DEEPSEEK, FOUR]


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS),
       level=st.sampled_from([Level.FULL, Level.STANDARD, Level.FAST]),
       checksums=st.booleans())
def test_a_verdict_with_nothing_to_explain_gives_every_group_its_own_figures(
        data: st.DataObject, decl: ModelDecl, level: Level, checksums: bool) -> None:
    """On any state the core's API can reach, at every level: where a verdict is usable up
    to the prompt's last candidate with no plan (the usual full hit, whose group figures are
    made without each group's stop check), every group's hit, usable and restorable tokens
    are the verdict's and no group names a stop; anywhere else every group's usable length
    is at least the verdict's (the verdict is their AND)."""
    eng = engine(decl, device=data.draw(st.sampled_from([16, 64]), label="device blocks"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    text = text[: data.draw(st.integers(1, text.size), label="cut")]
    with contextlib.suppress(KvfsmError):
        eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
    drive(eng, data, data.draw(st.integers(0, 6), label="steps"))
    verdict = lookup(eng.core, eng.prompt(text), level=level, checksums=checksums)
    step = eng.core.model.lcm_block_size
    last = (max(text.size - 1, 0)) // step * step
    plain = verdict.usable_tokens == verdict.restorable_tokens == last and not verdict.plan
    event("nothing to explain" if plain else "other")
    for group in verdict.groups:
        if plain:
            assert (group.hit_tokens, group.usable_tokens, group.restorable_tokens,
                    group.stop) == (last, last, last, None), group
        else:
            assert group.usable_tokens >= verdict.usable_tokens, group


@pytest.mark.parametrize("decl", [DENSE, GPT_OSS, DEEPSEEK, QWEN], ids=lambda decl: decl.name)
def test_max_tokens_caps_the_candidate_lengths(decl: ModelDecl) -> None:
    """``max_tokens`` stops the candidate lengths there: the verdict is usable, hit and
    restorable to at most the cap, its probe holds the blocks of its usable tokens, a cap at
    or past what is usable changes nothing of that, and a capped lookup leaves the next
    uncapped one of the same prompt as it was (the lookup's per-length cache untouched)."""
    eng = engine(decl, device=64, host=8)
    prompt = eng.prompt(PROMPTS[0][:321])
    eng.commit(prompt)
    whole = lookup(eng.core, prompt)
    assert whole.usable_tokens > 0
    for cap in (0, 1, whole.usable_tokens // 2, whole.usable_tokens - 1, whole.usable_tokens,
                whole.usable_tokens + 1, 10_000):
        capped = lookup(eng.core, prompt, max_tokens=cap)
        assert max(capped.usable_tokens, capped.hit_tokens, capped.restorable_tokens) <= cap
        assert capped.probe is not None and capped.probe.tokens == capped.usable_tokens
        if cap >= whole.usable_tokens:
            assert capped.usable_tokens == whole.usable_tokens
        assert attrs.evolve(lookup(eng.core, prompt), probe=None) == \
            attrs.evolve(whole, probe=None)
    with pytest.raises(KvfsmError, match="max_tokens"):
        lookup(eng.core, prompt, max_tokens=-1)
    with pytest.raises(KvfsmError, match="max_tokens"):
        lookup(eng.core, prompt, max_tokens=1.5)  # type: ignore[arg-type]


def test_max_tokens_stops_a_lookup_where_a_longer_prefix_would_be_usable() -> None:
    """A dense prompt usable to 320 tokens, capped at 100: the candidates are multiples of
    16 up to 96, so the verdict is usable to 96, with the blocks its probe holds exactly
    those six."""
    eng = engine(DENSE, device=64, host=8)
    prompt = eng.prompt(PROMPTS[0][:321])
    eng.commit(prompt)
    assert lookup(eng.core, prompt).usable_tokens == 320
    capped = lookup(eng.core, prompt, max_tokens=100)
    assert (capped.usable_tokens, capped.hit_tokens) == (96, 96)
    assert capped.probe is not None
    assert [group.hi - group.lo for group in capped.probe.groups] == [6]
