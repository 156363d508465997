"""Tiered verification: a reduced level never says "usable" where FULL would not."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm.spec import Event, Tier
from kvfsm.verify import DeviceProfile, Level
from tests.verify_models import DEEPSEEK, GPT_OSS, engine, tokens

PROMPTS = [tokens(321, seed=s) for s in range(3)]
EVENTS = [Event.EVICT, Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN,
          Event.RESTORE_DONE, Event.RESTORE_FAIL, Event.COMPRESS_BEGIN, Event.INVALIDATE]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, GPT_OSS]))
def test_reduced_levels_never_report_more_than_full(data: st.DataObject, decl: object) -> None:
    """For any state the core's API can reach (including host copies corrupted on purpose and
    device profiles stricter than the pools), FAST <= STANDARD <= FULL in usable and
    restorable tokens, whether the reduced lookups run before or after a FULL one."""
    eng = engine(decl, device=24, host=6)  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        op = data.draw(st.sampled_from(["commit", "event", "corrupt", "profile"]), label="op")
        if op == "commit":
            text = data.draw(st.sampled_from(PROMPTS), label="prompt")
            cut = data.draw(st.integers(1, text.size), label="cut")
            # Pools may fill up: the groups committed before the refusal stay, consistently.
            with contextlib.suppress(KvfsmError):
                eng.commit(eng.prompt(text[:cut]))
        elif op == "event":
            name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
            group = eng.core.group(name)
            live = np.flatnonzero(group.states != group.table.initial)
            if live.size:
                block = int(data.draw(st.sampled_from(live.tolist()), label="block"))
                with contextlib.suppress(KvfsmError):
                    eng.core.fire(name, [block], data.draw(st.sampled_from(EVENTS)))
        elif op == "corrupt":
            name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
            group = eng.core.group(name)
            held = np.flatnonzero(group.slot[Tier.HOST] != -1) if Tier.HOST in group.slot \
                else np.zeros(0, dtype=np.intp)
            if held.size:
                block = int(data.draw(st.sampled_from(held.tolist()), label="block"))
                group.pools[Tier.HOST].data[int(group.slot[Tier.HOST][block]), 0] ^= 0xFF
        else:
            eng.profile = DeviceProfile(
                "drawn", base_alignment=data.draw(st.sampled_from([64, 256, 4096, 1 << 16])),
                size_alignment=data.draw(st.sampled_from([1, 16, 512])))
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
    assert eng.core.check_invariants() == []


def test_fast_skips_alignment_only_where_the_pools_guarantee_it() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    assert eng.lookup(text, level=Level.FAST).usable_tokens == \
        eng.lookup(text, level=Level.FULL).usable_tokens < 160
