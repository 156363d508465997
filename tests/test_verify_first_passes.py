"""A lookup told by its groups' first passes alone is the general lookup's verdict, and the
usual full hit of a model without an index is told so."""

from __future__ import annotations

import contextlib
import itertools
import pickle
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm._jit import settings as jit
from kvfsm.spec import Layout, ModelDecl
from kvfsm.state import StateCore
from kvfsm.verify import DeviceProfile, Level, Reason, Verdict, lookup
from kvfsm.verify._group_eval import GroupEval
from kvfsm.verify._lookup_layout import layout_of
from kvfsm.verify._types import full_fields, full_verdict
from tests.verify_models import (
    DEEPSEEK,
    DENSE,
    GPT_OSS,
    HISTORY_SWA,
    PROMPTS,
    QWEN,
    SWA_ONLY,
    TWO_SIZES,
    drive,
    engine,
    reached,
)

needs_numba = pytest.mark.skipif(not jit.available, reason="numba is not installed")
#: Write layouts a test records beyond the declared one.
FOREIGN_LAYOUTS = 8

#: Models without a sparse index (every group's first pass may run first); TWO_SIZES' chains
#: reach past its candidate lengths (a block-boundary reason to find).
PLAIN = [DENSE, SWA_ONLY, GPT_OSS, TWO_SIZES, QWEN, HISTORY_SWA]


@contextlib.contextmanager
def general_lookup(core: StateCore) -> Iterator[None]:
    """Lookups of ``core`` run every group's evaluation (the reference), as for an index."""
    layout = layout_of(core)
    layout.plain = False
    try:
        yield
    finally:
        layout.plain = True


def held(verdict: Verdict) -> list[tuple[str, int, int, int, list[int], list[int]]]:
    """What a lease of ``verdict`` would read, per group: its spans and blocks at the usable
    length, as the lookup found them."""
    assert verdict.probe is not None
    return [(group.group, group.lo, group.cut, group.hi, group.ids.tolist(),
             group.epochs.tolist()) for group in verdict.probe.groups]


def checks(verdict: Verdict) -> list[tuple[str, list[int], list[bool]]]:
    return [(each.group, each.block_ids.tolist(), each.passed.tolist())
            for each in verdict.checks]


@needs_numba
@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(PLAIN),
       level=st.sampled_from(list(Level)), checksums=st.booleans(),
       drop_last_block=st.booleans())
def test_a_lookup_told_by_first_passes_is_the_general_lookups_verdict(
        data: st.DataObject, decl: ModelDecl, level: Level, checksums: bool,
        drop_last_block: bool) -> None:
    """On any state the core's API can reach (spills, evictions, corrupt copies, flipped
    device bytes, stricter device profiles, legal events), at every level, with and without
    checksums and a speculative drop: the verdict of a model without an index, whose groups'
    first passes run before the lookup looks at any, is the general lookup's (every group
    evaluated) in every figure, reason and plan step, the checksums it computed and the
    blocks a lease of it reads."""
    eng, text = reached(data, decl, steps=6, legal=6)
    prompt = eng.prompt(text)
    if data.draw(st.booleans(), label="whole prompt committed"):
        with contextlib.suppress(KvfsmError):  # a pool may be full
            eng.commit(prompt)
    if data.draw(st.booleans(), label="checksums recorded"):
        # A lookup through the engine records what it checked: later lookups below FULL trust
        # it (the usual state of a served prefix), and what happens next may break that trust.
        eng.lookup(prompt, level=Level.FULL)
        drive(eng, data, data.draw(st.integers(0, 2), label="steps after"),
              ops=("flip", "profile", "event", "offload"))
    with jit.using(True):
        got = lookup(eng.core, prompt, level=level, checksums=checksums,
                     profile=eng.profile, drop_last_block=drop_last_block)
        with general_lookup(eng.core):
            want = lookup(eng.core, prompt, level=level, checksums=checksums,
                          profile=eng.profile, drop_last_block=drop_last_block)
    last = (prompt.n_tokens - 1) // eng.core.model.lcm_block_size * \
        eng.core.model.lcm_block_size
    event("usable to the last candidate" if want.usable_tokens == last and not want.plan
          else "other")
    assert got == want
    assert checks(got) == checks(want)
    assert held(got) == held(want)


@needs_numba
@pytest.mark.parametrize("decl", [DENSE, GPT_OSS, QWEN, HISTORY_SWA], ids=lambda d: d.name)
def test_a_full_hit_of_a_model_without_an_index_evaluates_no_group(
        decl: ModelDecl, monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual lookup of a scheduler (a committed prompt, usable to its last candidate
    length, checksums verified) is told by the groups' first passes: no per-group evaluation
    is made, and the verdict is the full one, with its probe."""
    eng = engine(decl)
    prompt = eng.prompt(PROMPTS[0])
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)  # the checksums verified
    expected = eng.lookup(prompt, level=Level.STANDARD)

    def refuse(*_: object) -> None:
        raise AssertionError("a group was evaluated")

    monkeypatch.setattr(GroupEval, "_evaluate", refuse)
    with jit.using(True):
        verdict = eng.lookup(prompt, level=Level.STANDARD)
    step = eng.core.model.lcm_block_size
    assert verdict.usable_tokens == (PROMPTS[0].size - 1) // step * step
    assert verdict == expected and held(verdict) == held(expected)


@needs_numba
def test_a_model_with_an_index_and_a_partial_hit_take_the_general_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the first passes do not say it all (a partial hit, an index) the groups are
    evaluated, and each group's pass runs once: the first one's output is the evaluation's."""
    evaluated: list[bool] = []
    original = GroupEval._evaluate

    def counted(self: GroupEval, *args: object) -> None:
        evaluated.append(len(args) > 11 and args[11] is not None)  # given its first pass
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(GroupEval, "_evaluate", counted)
    with jit.using(True):
        dense = engine(DENSE)
        dense.commit(dense.prompt(PROMPTS[0][:100]))
        partial = dense.lookup(dense.prompt(PROMPTS[0]), level=Level.STANDARD)
        assert 0 < partial.usable_tokens < PROMPTS[0].size - 16
        assert evaluated == [True]
        evaluated.clear()
        indexed = engine(DEEPSEEK)
        indexed.commit(indexed.prompt(PROMPTS[0]))
        indexed.lookup(indexed.prompt(PROMPTS[0]), level=Level.STANDARD)
        assert evaluated == [False, False, False]


@needs_numba
def test_the_first_pass_of_a_group_of_a_prompt_without_blocks_says_it_all() -> None:
    """A prompt of one token (no candidate length past 0) is usable at 0, with no reason."""
    eng = engine(GPT_OSS)
    with jit.using(True):
        verdict = eng.lookup(eng.prompt(np.array([7])), level=Level.STANDARD)
    assert (verdict.hit_tokens, verdict.usable_tokens, verdict.reasons) == (0, 0, ())


@needs_numba
@pytest.mark.parametrize("level", [Level.STANDARD, Level.FAST])
def test_a_stricter_device_profile_is_checked_after_the_first_passes(level: Level) -> None:
    """A prefix whose checksums were verified, looked up under a device profile its pool does
    not meet by construction: the slots are checked one by one (at FAST only where restored
    blocks would not land aligned), so the verdict is the general lookup's and not the
    whole prompt."""
    eng = engine(GPT_OSS)
    prompt = eng.prompt(PROMPTS[0])
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    with jit.using(True):
        got = eng.lookup(prompt, level=level)
        with general_lookup(eng.core):
            want = eng.lookup(prompt, level=level)
    assert got == want
    assert got.usable_tokens < (PROMPTS[0].size - 1) // 16 * 16


@needs_numba
@pytest.mark.parametrize("change", ["layout", "profile"])
def test_what_a_first_pass_read_last_is_read_again_after_it_changes(change: str) -> None:
    """The statics a group's first passes keep between lookups are made again when what they
    were made from changes: a new write layout recorded by the group (its blocks written
    under it are not the reading kernel's: LAYOUT_MISMATCH from the first), or another device
    profile (the slots are checked against it), though a lookup just made them."""
    eng = engine(DENSE)
    kept, written = eng.prompt(PROMPTS[0]), eng.prompt(PROMPTS[1])
    eng.commit(kept)
    eng.lookup(kept, level=Level.FULL)
    with jit.using(True):
        before = eng.lookup(kept, level=Level.STANDARD)  # the first passes' statics made
        assert before.usable_tokens == (PROMPTS[0].size - 1) // 16 * 16
        if change == "layout":
            # Foreign layouts recorded, the blocks written under the last (a stale table of
            # the layouts the kernel accepts would read past its end for them, into other
            # per-state facts, some not 0).
            declared = eng.core.group("attn").decl.layout
            orders = [order for order in itertools.permutations(declared.dim_order)
                      if order != declared.dim_order][:FOREIGN_LAYOUTS]
            for order in orders:
                eng.core.set_write_layout("attn", Layout(order, declared.alignment,
                                                         declared.padding))
            eng.commit(written)
            eng.lookup(written, level=Level.FULL)  # checksums verified: only the layout fails
            verdict = eng.lookup(written, level=Level.STANDARD)
            # The prompts share their first 64 tokens: those blocks are the kept prompt's,
            # written under the declared layout; every later block is the new layout's.
            assert verdict.hit_tokens == before.usable_tokens and verdict.usable_tokens == 64
            assert verdict.reasons_of(Reason.LAYOUT_MISMATCH)[0].block_index == 64 // 16
        else:
            eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
            verdict = eng.lookup(kept, level=Level.STANDARD)
            assert verdict.usable_tokens < before.usable_tokens
        with general_lookup(eng.core):
            assert verdict == eng.lookup(written if change == "layout" else kept,
                                         level=Level.STANDARD)


def test_a_full_verdict_made_by_its_fields_is_the_constructors() -> None:
    """``full_verdict`` of ``full_fields`` holds exactly Verdict's fields: equal to the
    constructor's verdict, field for field, probe included; and the template it copies is
    left as it was, so the next verdict made from it has its own fields."""
    eng = engine(DENSE)
    verdict = eng.lookup(eng.prompt(PROMPTS[0]))
    fields = full_fields(48, Level.FAST, verdict.groups, verdict.reasons)
    template = dict(fields)
    made = full_verdict(verdict.prompt_tokens, fields, verdict.probe)  # type: ignore[arg-type]
    expected = Verdict(verdict.prompt_tokens, 48, 48, 48, 48, Level.FAST, verdict.groups,
                       verdict.reasons, (), (), verdict.probe)
    assert made == expected
    assert vars(made) == vars(expected)
    assert list(vars(made)) == [field.name for field in attrs.fields(Verdict)]
    assert fields == template
    other = full_verdict(7, fields, None)  # type: ignore[arg-type]
    assert (other.prompt_tokens, other.probe, made.prompt_tokens) == \
        (7, None, verdict.prompt_tokens)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.usable_tokens = 0  # type: ignore[misc]


def test_a_level_hashes_as_it_compares() -> None:
    """Levels are keys of the lookup's caches: each hashes by identity, equal to itself
    only, and is the same object after a round trip through its value or pickling."""
    assert len({hash(level) for level in Level}) == len(Level)
    for level in Level:
        assert Level(level.value) is level
        assert pickle.loads(pickle.dumps(level)) is level
        assert {level: 1}[Level(level.value)] == 1


@needs_numba
@pytest.mark.parametrize(("decl", "tokens", "drop_last_block", "reason"), [
    (DENSE, 321, True, Reason.SPEC_DECODE_DROP),
    # 16- and 24-token blocks: candidates every 48 tokens, chains reaching 112 of 120.
    (TWO_SIZES, 120, False, Reason.BLOCK_BOUNDARY),
], ids=["speculative drop", "block boundary"])
def test_a_full_hit_asked_for_more_than_its_passes_say_is_explained(
        decl: ModelDecl, tokens: int, drop_last_block: bool, reason: Reason) -> None:
    """A committed prompt whose every group holds to the last candidate length, but whose
    verdict says more than the passes do (a speculative drop recomputes the last block; the
    chains reach past the candidates): the general lookup's verdict, reason included."""
    eng = engine(decl)
    prompt = eng.prompt(PROMPTS[0][:tokens])
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)
    with jit.using(True):
        got = eng.lookup(prompt, level=Level.STANDARD, drop_last_block=drop_last_block)
        with general_lookup(eng.core):
            want = eng.lookup(prompt, level=Level.STANDARD, drop_last_block=drop_last_block)
    assert got == want
    assert reason in got.reason_set
