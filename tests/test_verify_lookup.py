"""The lookup's shortcut for the usual full hit gives the verdict its general path gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm.spec import ModelDecl
from kvfsm.verify import Level, Verdict, lookup
from kvfsm.verify import _lookup as lookup_module
from tests.verify_models import DEEPSEEK, DENSE, FOUR, GPT_OSS, PROMPTS, QWEN, drive, engine

MODELS = [DENSE, GPT_OSS, QWEN, DEEPSEEK, FOUR]


@contextlib.contextmanager
def general_path_only() -> Iterator[None]:
    """Lookups made inside go the general way: the full-hit shortcut declines every verdict."""
    shortcut = lookup_module._straight_verdict
    lookup_module._straight_verdict = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        lookup_module._straight_verdict = shortcut


def fields(verdict: Verdict) -> tuple[object, ...]:
    """Everything a verdict says, its computed checksums and what a lease reads of it."""
    probe = verdict.probe
    assert probe is not None
    checks = [(c.group, c.block_ids.tolist(), c.passed.tolist()) for c in verdict.checks]
    held = [(group.group, group.lo, group.cut, group.hi, group.ids.tolist(),
             group.epochs.tolist(), group.last_words, group.changes) for group in probe.groups]
    return (verdict.prompt_tokens, verdict.hit_tokens, verdict.usable_tokens,
            verdict.restorable_tokens, verdict.recompute_from, verdict.level, verdict.groups,
            verdict.reasons, verdict.plan, checks, probe.tokens, probe.at, held)


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS),
       level=st.sampled_from([Level.FULL, Level.STANDARD, Level.FAST]),
       checksums=st.booleans())
def test_a_full_hit_made_straight_is_the_verdict_of_the_general_path(
        data: st.DataObject, decl: ModelDecl, level: Level, checksums: bool) -> None:
    """On any state the core's API can reach, at every level, a lookup gives exactly the
    verdict (figures, groups, reasons, plan, the checksums it computed, the blocks a lease
    reads) that the general path gives: the shortcut for a full hit changes no answer."""
    eng = engine(decl, device=data.draw(st.sampled_from([16, 64]), label="device blocks"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    text = text[: data.draw(st.integers(1, text.size), label="cut")]
    with contextlib.suppress(KvfsmError):
        eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
    drive(eng, data, data.draw(st.integers(0, 6), label="steps"))
    prompt = eng.prompt(text)
    # A lookup records nothing: the two see the same state.
    made = lookup(eng.core, prompt, level=level, checksums=checksums)
    with general_path_only():
        general = lookup(eng.core, prompt, level=level, checksums=checksums)
    event("full hit" if made.usable_tokens == made.hit_tokens == (text.size - 1) // 16 * 16
          else "other")
    assert fields(made) == fields(general)


def test_a_full_hit_takes_the_shortcut_and_a_partial_one_does_not() -> None:
    """The shortcut serves the usual full hit (else the property above compares the general
    path with itself), never a verdict with something to explain."""
    eng = engine(DEEPSEEK)
    text = PROMPTS[0]
    eng.commit(eng.prompt(text))
    taken: list[bool] = []
    shortcut = lookup_module._straight_verdict

    def watched(*args: object) -> Verdict | None:
        verdict = shortcut(*args)  # type: ignore[arg-type]
        taken.append(verdict is not None)
        return verdict

    lookup_module._straight_verdict = watched  # type: ignore[assignment]
    try:
        full = lookup(eng.core, eng.prompt(text), level=Level.STANDARD)
        partial = lookup(eng.core, eng.prompt(np.concatenate([text, text])),
                         level=Level.STANDARD)
    finally:
        lookup_module._straight_verdict = shortcut
    assert taken[0] and not any(taken[1:])  # the partial hit never made by it
    assert full.usable_tokens == full.hit_tokens > 0 and not full.plan
    assert partial.usable_tokens < partial.prompt_tokens - 64


@pytest.mark.parametrize("decl", MODELS, ids=lambda decl: decl.name)
def test_a_lookup_without_the_shortcut_is_still_right(decl: ModelDecl) -> None:
    """The general path alone gives a full hit's figures (the property's reference is sound
    on the plainest state)."""
    eng = engine(decl)
    text = PROMPTS[1]
    eng.commit(eng.prompt(text))
    prompt = eng.prompt(text)
    made = lookup(eng.core, prompt, level=Level.STANDARD)
    with general_path_only():
        general = lookup(eng.core, prompt, level=Level.STANDARD)
    assert fields(made) == fields(general)
    assert general.usable_tokens == made.usable_tokens > 0
