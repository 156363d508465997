"""Lookups whose verdict depends on what a group's statics read (a device profile, recorded
layouts), prompts without blocks, and full hits asked for more than the passes say: the
compiled lookup gives the NumPy reference's verdict."""

from __future__ import annotations

import contextlib
import itertools
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from kvfsm._jit import settings as jit
from kvfsm.lookup import DeviceProfile, Level, Reason
from kvfsm.spec import Layout, ModelDecl
from tests.lookup_models import (
    DENSE,
    GPT_OSS,
    PROMPTS,
    TWO_SIZES,
    engine,
    group,
    model,
)

needs_numba = pytest.mark.skipif(not jit.available, reason="numba is not installed")
#: Write layouts a test records beyond the declared one.
FOREIGN_LAYOUTS = 8


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Lookups in the body run the NumPy reference pass (the compiled one's oracle)."""
    with jit.using(False):
        yield


@needs_numba
def test_a_prompt_without_blocks_is_usable_at_0_with_no_reason() -> None:
    """A prompt of one token (no candidate length past 0) is usable at 0, with no reason."""
    eng = engine(GPT_OSS)
    with jit.using(True):
        verdict = eng.lookup(eng.prompt(np.array([7])), level=Level.STANDARD)
    assert (verdict.hit_tokens, verdict.usable_tokens, verdict.reasons) == (0, 0, ())


@needs_numba
@pytest.mark.parametrize("level", [Level.STANDARD, Level.FAST])
def test_a_stricter_device_profile_is_checked_slot_by_slot(level: Level) -> None:
    """A prefix whose checksums were verified, looked up under a device profile its pool does
    not meet by construction: the slots are checked one by one (at FAST only where restored
    blocks would not land aligned), so the verdict is the reference's and not the whole
    prompt."""
    eng = engine(GPT_OSS)
    prompt = eng.prompt(PROMPTS[0])
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    with jit.using(True):
        got = eng.lookup(prompt, level=level)
        with reference():
            want = eng.lookup(prompt, level=level)
    assert got == want
    assert got.usable_tokens < (PROMPTS[0].size - 1) // 16 * 16


@needs_numba
@pytest.mark.parametrize("change", ["layout", "profile"])
def test_what_a_lookup_read_last_is_read_again_after_it_changes(change: str) -> None:
    """The statics a group's lookups keep between them are made again when what they were
    made from changes: a new write layout recorded by the group (its blocks written
    under it are not the reading kernel's: LAYOUT_MISMATCH from the first), or another device
    profile (the slots are checked against it), though a lookup just made them."""
    eng = engine(DENSE)
    kept, written = eng.prompt(PROMPTS[0]), eng.prompt(PROMPTS[1])
    eng.commit(kept)
    eng.lookup(kept, level=Level.FULL)
    with jit.using(True):
        before = eng.lookup(kept, level=Level.STANDARD)  # the group's statics made
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
        with reference():
            assert verdict == eng.lookup(written if change == "layout" else kept,
                                         level=Level.STANDARD)


def test_a_level_hashes_as_it_compares() -> None:
    """Levels are dictionary keys: each hashes as it compares, equal to itself only, and is
    the same object after a round trip through its value or pickling."""
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
    chains reach past the candidates): the reference's verdict, reason included."""
    eng = engine(decl)
    prompt = eng.prompt(PROMPTS[0][:tokens])
    eng.commit(prompt)
    eng.lookup(prompt, level=Level.FULL)
    with jit.using(True):
        got = eng.lookup(prompt, level=Level.STANDARD, drop_last_block=drop_last_block)
        with reference():
            want = eng.lookup(prompt, level=Level.STANDARD, drop_last_block=drop_last_block)
    assert got == want
    assert reason in got.reason_set


def test_full_hits_of_models_sharing_a_group_name_report_their_own_groups() -> None:
    """Two models whose groups share a name but not a kind or a block size: each full hit's
    per-group verdicts are its own model's, however the lookups interleave."""
    wide = model("t_wide_attn", group("attn", "full", "full_kv", 32))
    window = model("t_window_attn", group("attn", "sliding_window", "sliding_window", 16,
                                          "window = 64"))
    engines = [engine(DENSE), engine(wide), engine(window)]
    text = PROMPTS[0][:257]
    prompts = [eng.prompt(text) for eng in engines]
    for eng, prompt in zip(engines, prompts, strict=True):
        eng.commit(prompt)
    for _ in range(2):
        for eng, prompt in zip(engines, prompts, strict=True):
            verdict = eng.lookup(prompt, level=Level.STANDARD)
            (attn,) = verdict.groups
            decl = eng.core.group("attn").decl
            assert (attn.kind, attn.block_size) == (decl.kind, decl.block_size)
            assert attn.usable_tokens == verdict.usable_tokens == 256 - 256 % decl.block_size
            assert attn.stop is None
