"""A verdict with nothing to explain: its groups' figures are its own."""

from __future__ import annotations

import contextlib

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
