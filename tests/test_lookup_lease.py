"""Leases (kvfsm.gates): what a lease pins per kind, how validate and release behave, expiry,
and that every public Engine method holds the engine's lock."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import (
    CoreConfig,
    Engine,
    ForeignPromptError,
    GuardRejected,
    KvfsmError,
    Lease,
    LeaseLost,
    shipped_lifecycles,
    shipped_models,
)
from kvfsm.lookup import Probe
from kvfsm.spec import Event, Tier
from kvfsm.state import MAX_PINS, Prompt, StateError
from tests.lookup_models import (
    SWA,
    block_id,
    engine,
    group,
    history_by_hand,
    model,
    same_holdings_then_released,
    tokens,
)

#: A prompt of 321 tokens: 320 can be reused (the last one is always computed).
TEXT = tokens(321)
#: Seconds a test thread may take before the test calls it stuck (never reached when sound).
JOIN_S = 30.0


def _engine(name: str) -> Engine:
    return Engine(shipped_models()[name],
                  CoreConfig(device_blocks=64, host_blocks=16, backend="numpy"))


def _committed(name: str) -> tuple[Engine, Lease]:
    eng = _engine(name)
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    return eng, eng.lease(eng.lookup(prompt), prompt)


def _ids(eng: Engine, group: str, indices: range) -> list[int]:
    return [block_id(eng, group, TEXT, i) for i in indices]


def _pins(eng: Engine) -> dict[str, int]:
    return {name: int(state.pins.sum()) for name, state in eng.core.groups.items()}


# -- what a lease pins, per kind -----------------------------------------------------------------


def test_full_attention_leases_every_block_of_the_prefix() -> None:
    eng, lease = _committed("dense")
    assert lease.tokens == 320
    assert lease.blocks("attn").tolist() == _ids(eng, "attn", range(20))
    assert lease.indices("attn").tolist() == list(range(20))
    assert _pins(eng) == {"attn": 20}


def test_sliding_window_leases_only_the_window() -> None:
    """At L = 320 with W = 128 the kernel reads tokens 193..319: blocks 12..19 of 16."""
    eng, lease = _committed("gpt_oss_like")
    assert lease.blocks("swa").tolist() == _ids(eng, "swa", range(12, 20))
    assert lease.blocks("full").tolist() == _ids(eng, "full", range(20))
    assert _pins(eng) == {"full": 20, "swa": 8}


def test_compressed_history_index_and_targets_are_leased() -> None:
    """The compressed history up to the boundary and every index block; every history block
    an index block points at is one the lease holds as a history block (a usable index row
    points only at history ending before it), so each is pinned once, and none can move."""
    eng, lease = _committed("deepseek_v4_like")
    history = _ids(eng, "history", range(5))
    assert lease.blocks("history").tolist() == history
    assert lease.blocks("index").tolist() == _ids(eng, "index", range(20))
    index = eng.core.group("index")
    targets = index.refs_target[lease.blocks("index")]
    assert set(targets[targets >= 0].tolist()) <= set(history)
    expected = np.zeros(eng.core.group("history").n_blocks, dtype=np.int64)
    expected[history] = 1  # the lease's own pin, once per block
    assert eng.core.group("history").pins.tolist() == expected.tolist()
    with pytest.raises(GuardRejected, match="no_pins"):
        eng.core.fire("history", [int(targets[targets >= 0][0])], Event.EVICT)
    lease.release()
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}


def test_a_verdict_without_its_probe_is_looked_up_again_and_leased_as_usual() -> None:
    """A verdict made by hand (no probe) is leased by looking the prompt up again: the index's
    targets are held as history blocks, each pinned once, and all given back."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = attrs.evolve(eng.lookup(prompt), probe=None)
    lease = eng.lease(verdict, prompt)
    assert lease.tokens == verdict.usable_tokens == 320
    history = _ids(eng, "history", range(5))
    expected = np.zeros(eng.core.group("history").n_blocks, dtype=np.int64)
    expected[history] += 1
    assert eng.core.group("history").pins.tolist() == expected.tolist()
    lease.validate()
    lease.release()
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}


@pytest.mark.parametrize("name", ["dense", "gpt_oss_like", "deepseek_v4_like",
                                  "qwen3_next_like"])
def test_a_lease_from_the_probe_holds_what_a_fresh_probe_would(name: str) -> None:
    """Leasing from what the lookup found pins the same blocks, at the same epochs, as
    probing the prompt again (every shipped model); both validate, and both give back every
    pin they took."""
    eng = _engine(name)
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    assert verdict.probe is not None
    fast = eng.lease(verdict, prompt)
    fresh = eng.lease(attrs.evolve(verdict, probe=None), prompt)
    same_holdings_then_released(fast, fresh)
    assert set(_pins(eng).values()) == {0}


@pytest.mark.parametrize("name", ["dense", "gpt_oss_like", "deepseek_v4_like",
                                  "qwen3_next_like"])
def test_lookup_and_lease_is_the_lookup_and_its_lease(name: str) -> None:
    """One step or two, the verdict and the lease are the same (every shipped model): the
    same figures and reasons, the same blocks at the same epochs; both give back every pin
    they took."""
    eng = _engine(name)
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict, lease = eng.lookup_and_lease(prompt, ttl_s=5.0)
    apart = eng.lookup(prompt)
    assert attrs.evolve(verdict, probe=None) == attrs.evolve(apart, probe=None)
    same_holdings_then_released(lease, eng.lease(apart, prompt))
    assert set(_pins(eng).values()) == {0}
    assert eng.leases_open == 0


def test_lookup_and_lease_of_a_lookup_that_saw_a_checksum_fail() -> None:
    """A lookup that records a checksum failure changed its group since it looked: the lease
    is then taken group by group, and holds what the verdict called usable (short of the
    failed block)."""
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    state = eng.core.group("attn")
    block = block_id(eng, "attn", TEXT, 5)
    state.pools[Tier.DEVICE].data[int(state.slot[Tier.DEVICE][block]), 0] ^= 0x10
    before = state.changes
    verdict, lease = eng.lookup_and_lease(prompt, level="full")
    assert state.changes == before + 1  # the failure recorded
    assert verdict.usable_tokens == lease.tokens == 5 * 16
    assert lease.blocks("attn").tolist() == _ids(eng, "attn", range(5))
    lease.validate()
    lease.release()
    assert _pins(eng) == {"attn": 0}


@pytest.mark.parametrize("ttl", [0, -1.0, "1", True])
def test_lookup_and_lease_refuses_a_bad_ttl_before_looking_up(ttl: object) -> None:
    """A bad ttl is refused before the lookup: no checksum recorded, nothing pinned."""
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    check = eng.core.group("attn").check.copy()
    with pytest.raises(KvfsmError, match="ttl_s"):
        eng.lookup_and_lease(prompt, level="full", ttl_s=ttl)  # type: ignore[arg-type]
    assert eng.core.group("attn").check.tolist() == check.tolist()
    assert _pins(eng) == {"attn": 0} and eng.leases_open == 0


def test_lookup_and_lease_of_token_ids_or_a_foreign_prompt() -> None:
    """Token ids are made a prompt of the engine's, as for ``lookup``; a prompt made for
    another engine is refused before anything is pinned."""
    eng = _engine("dense")
    eng.commit(eng.prompt(TEXT))
    verdict, lease = eng.lookup_and_lease(TEXT.tolist())
    with lease:
        assert lease.tokens == verdict.usable_tokens == 320
        lease.validate()
    other = Engine(shipped_models()["dense"],
                   CoreConfig(device_blocks=64, backend="numpy", cache_salt="other"))
    with pytest.raises(ForeignPromptError):
        eng.lookup_and_lease(other.prompt(TEXT))
    assert _pins(eng) == {"attn": 0} and eng.leases_open == 0


def _pin_counts(eng: Engine) -> dict[str, tuple[list[int], list[int]]]:
    return {name: (state.block_pins.tolist(), state.chunk_pins.tolist())
            for name, state in eng.core.groups.items()}


@pytest.mark.parametrize("name", sorted(shipped_models()))
def test_a_lookups_probe_shows_the_blocks_its_lease_pins(name: str) -> None:
    """A lookup's probe makes its per-group view from the lookup's pass outputs when first
    asked, once: per group, the ids and epochs a lease on the verdict pins and records."""
    eng = _engine(name)
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    probe = verdict.probe
    assert isinstance(probe, Probe) and probe.exact and probe.tokens == verdict.usable_tokens
    groups = probe.groups
    assert probe.groups is groups
    assert sorted(group.group for group in groups) == sorted(eng.core.groups)
    with eng.lease(verdict, prompt) as lease:
        for group in groups:
            assert lease.blocks(group.group).tolist() == group.ids.tolist()
            assert lease.epochs(group.group).tolist() == group.epochs.tolist()
            assert lease.indices(group.group).tolist() == list(range(group.lo, group.hi))


def test_a_probe_made_by_hand_is_leased_with_its_arrays_types_matched() -> None:
    """A probe made by hand (strided ids, copied epochs) is not a lookup's own output: its
    lease's passes match its arrays' types (numba's dispatcher, after a lease on a lookup's
    own arrays compiled theirs), and it pins, validates and gives back exactly what a
    lookup's probe does."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    assert verdict.probe is not None and verdict.probe.exact
    with eng.lease(verdict, prompt):  # binds each group's lease passes to a lookup's arrays
        expected = _pin_counts(eng)
    fresh = eng.lookup(prompt)
    assert fresh.probe is not None
    by_hand = tuple(group._replace(ids=np.repeat(group.ids, 2)[::2], epochs=group.epochs.copy())
                    for group in fresh.probe.groups)
    made = attrs.evolve(fresh, probe=Probe(fresh.probe.core, fresh.probe.tokens, by_hand,
                                           prompt))
    assert made.probe is not None and not made.probe.exact
    with eng.lease(made, prompt) as lease:
        lease.validate()
        assert _pin_counts(eng) == expected
        for group in by_hand:
            assert lease.blocks(group.group).tolist() == group.ids.tolist()
    assert set(_pins(eng).values()) == {0}
    assert {name: sum(chunks) for name, (_, chunks) in _pin_counts(eng).items()} == \
        dict.fromkeys(eng.core.groups, 0)


def test_a_block_that_moved_since_the_lookup_refuses_the_lease() -> None:
    """Evicted between the lookup and the lease: the prompt looked up again is usable to
    fewer tokens, so the lease is refused, naming the group and block, and pins nothing.
    Written again (same hash, new epoch), the prefix is usable as the verdict said: the
    stale verdict is leased, holding the blocks as they are now."""
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    block = block_id(eng, "attn", TEXT, 3)
    eng.core.fire("attn", [block], Event.EVICT)
    with pytest.raises(LeaseLost, match="not_cached at prompt block 3; look up again") as lost:
        eng.lease(verdict, prompt)
    assert lost.value.group == "attn" and "only 48" in str(lost.value)
    assert _pins(eng) == {"attn": 0}
    eng.commit(prompt)  # the prefix written again: new epochs, usable as the verdict said
    with eng.lease(verdict, prompt) as lease:
        assert lease.tokens == 320
        assert lease.blocks("attn").tolist() == _ids(eng, "attn", range(20))
        assert lease.epochs("attn").tolist() == \
            eng.core.group("attn").epoch[lease.blocks("attn")].tolist()
        lease.validate()
    assert _pins(eng) == {"attn": 0}


def test_changes_elsewhere_in_the_group_do_not_refuse_the_lease() -> None:
    """Another prompt's blocks of the same groups committed and evicted between the lookup
    and the lease: the lease checks its own blocks again, finds them as the lookup saw them,
    and is granted; validate then passes with the same changes around it."""
    eng = _engine("deepseek_v4_like")
    other_tokens = tokens(100, seed=7)
    prompt, other = eng.prompt(TEXT), eng.prompt(other_tokens)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    before = {name: state.changes for name, state in eng.core.groups.items()}
    eng.commit(other)
    assert all(eng.core.group(name).changes > seen for name, seen in before.items())
    with eng.lease(verdict, prompt) as lease:
        eng.core.fire("index", [block_id(eng, "index", other_tokens, 1)], Event.EVICT)
        lease.validate()
        assert lease.tokens == verdict.usable_tokens == 320
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}


def test_a_probe_of_another_prompt_or_engine_is_not_used() -> None:
    """A verdict leased with a prompt of another prefix, or by another engine, is probed
    afresh: never the first prompt's (or engine's) blocks."""
    eng = _engine("dense")
    prompt, other = eng.prompt(TEXT), eng.prompt(tokens(321, seed=7))
    eng.commit(prompt)
    eng.commit(other)
    verdict = eng.lookup(prompt)
    with eng.lease(verdict, other) as lease:
        assert lease.blocks("attn").tolist() == [block_id(eng, "attn", other.token_ids, i)
                                                 for i in range(20)]
    twin = _engine("dense")
    twin_prompt = twin.prompt(TEXT)
    twin.commit(twin_prompt)
    with twin.lease(verdict, twin_prompt) as lease:
        assert lease.blocks("attn").tolist() == [block_id(twin, "attn", TEXT, i)
                                                 for i in range(20)]
    assert _pins(eng) == {"attn": 0} and _pins(twin) == {"attn": 0}


def test_a_lease_on_the_lookups_own_prompt_grown_since_holds_the_blocks_it_saw() -> None:
    """The prompt a lookup saw, grown by more tokens before the lease, is the same prefix:
    the lease holds exactly the blocks of the verdict's usable tokens, as a lease with a
    fresh prompt of the same tokens does, and as one of another prefix does not."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    prompt.extend(tokens(64, seed=3))
    with eng.lease(verdict, prompt) as grown:
        held = {name: grown.blocks(name).tolist() for name in grown.groups}
        assert grown.tokens == verdict.usable_tokens == 320
    with eng.lease(verdict, eng.prompt(TEXT)) as fresh:
        assert {name: fresh.blocks(name).tolist() for name in fresh.groups} == held
    assert held["history"] == _ids(eng, "history", range(5))
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}
    other = eng.prompt(tokens(321, seed=9))
    with pytest.raises(LeaseLost, match="no longer usable, only 0: not_cached"):
        eng.lease(verdict, other)
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}


@pytest.mark.parametrize("name", ["dense", "deepseek_v4_like"])
def test_validate_refuses_a_block_a_later_lookup_saw_fail_its_checksum(name: str) -> None:
    """Bytes under a leased block change in place (no fire sees it), and a FULL lookup by
    another request recomputes the checksum and records the failure: the lease's next
    validate refuses the read, naming that block, though its epoch never moved."""
    eng, lease = _committed(name)
    lease.validate()
    group = lease.groups[0]
    state = eng.core.group(group)
    block = int(lease.blocks(group)[1])
    state.pools[Tier.DEVICE].data[int(state.slot[Tier.DEVICE][block]), 0] ^= 0x10
    assert lease.valid  # nothing recorded yet: a reduced level trusts the earlier pass
    verdict = eng.lookup(eng.prompt(TEXT), level="full")
    assert verdict.usable_tokens < lease.tokens
    with pytest.raises(LeaseLost, match="checksum") as lost:
        lease.validate()
    assert (lost.value.group, lost.value.block) == (group, block)
    assert lost.value.old_epoch == lost.value.new_epoch
    lease.release()
    assert _pins(eng) == dict.fromkeys(eng.core.groups, 0)


def test_an_engine_refuses_a_lease_clock_it_cannot_call() -> None:
    with pytest.raises(KvfsmError, match="lease_clock"):
        Engine(shipped_models()["dense"], CoreConfig(device_blocks=8, host_blocks=0,
                                                     backend="numpy"),
               lease_clock=1.5)  # type: ignore[arg-type]


def test_index_targets_outside_the_window_are_held_and_checked() -> None:
    """An index pointing into a sliding window: its targets before the window are not read
    as window blocks, but the index reads them, so they are pinned too (once each), and their
    epochs are checked; bypassing those pins and evicting one leaves the pinned index
    readable, and only the target's recorded epoch tells. The release gives back every pin
    the lease still holds (the moved target's went with its content)."""
    eng = engine(model("t_swa_index", SWA, group("index", "sparse_index", "sparse_index", 16,
                                                 'target_group = "swa"\ntop_k = 4')))
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    lease = eng.lease(eng.lookup(prompt), prompt)
    swa, index = eng.core.group("swa"), eng.core.group("index")
    window = _ids(eng, "swa", range(16, 20))
    assert lease.blocks("swa").tolist() == window  # the window
    targets = index.refs_target[lease.blocks("index")]
    expected = np.zeros(swa.n_blocks, dtype=np.int64)
    expected[np.unique(targets[targets >= 0])] = 1  # each target once
    expected[window] = 1
    assert swa.pins.tolist() == expected.tolist()
    outside = block_id(eng, "swa", TEXT, 5)
    assert swa.pins[outside] == 1
    with pytest.raises(GuardRejected, match="no_pins"):
        eng.core.fire("swa", [outside], Event.EVICT)
    swa.add_pins(np.full(int(swa.pins[outside]), outside, dtype=np.intp), -1)  # bypassed
    eng.core.fire("swa", [outside], Event.EVICT)
    assert eng.core.describe("index", block_id(eng, "index", TEXT, 5)).state == "device"
    with pytest.raises(LeaseLost) as lost:
        lease.validate()
    assert (lost.value.group, lost.value.block) == ("swa", outside)
    lease.release()  # gives back every pin it still can, never raises
    assert _pins(eng) == {"swa": 0, "index": 0}
    assert eng.leases_open == 0


def test_recurrent_leases_the_snapshot_at_the_usable_length_only() -> None:
    eng, lease = _committed("qwen3_next_like")
    assert lease.tokens == 256
    assert lease.blocks("delta").tolist() == [block_id(eng, "delta", TEXT, 3)]  # 4 x 64
    assert lease.blocks("attn").tolist() == _ids(eng, "attn", range(16))


def test_nothing_usable_leases_nothing() -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
        assert lease.tokens == 0 and lease.blocks("attn").size == 0
    assert eng.leases_open == 0


# -- the tables' guards keep leased blocks in place ------------------------------------------------


@pytest.mark.parametrize("event", [Event.EVICT, Event.INVALIDATE])
def test_a_leased_block_cannot_be_evicted_or_invalidated(event: Event) -> None:
    eng, lease = _committed("dense")
    block = lease.blocks("attn")[:1]
    with pytest.raises(GuardRejected, match="no_pins"):
        eng.core.fire("attn", block, event)
    assert not eng.core.fire("attn", block, event, masked=True).any()
    lease.validate()
    lease.release()
    eng.core.fire("attn", block, event)


def test_a_leased_block_cannot_finish_a_spill_and_give_back_passes_it_over() -> None:
    eng, lease = _committed("dense")
    block = lease.blocks("attn")[:1]
    eng.core.fire("attn", block, Event.SPILL_BEGIN)  # the copy may start: bytes stay
    with pytest.raises(GuardRejected, match="no_pins"):
        eng.core.fire("attn", block, Event.SPILL_DONE)
    eng.core.fire("attn", block, Event.SPILL_FAIL)
    assert eng.give_back("attn", 64) == 0  # every device block is leased
    lease.validate()


def test_compressing_a_block_outside_the_lease_leaves_it_valid() -> None:
    """History block 4 is still compressing, so the prompt is usable to 256 (blocks 0..3); its
    compression invalidates the index block pointing at it (19, the only one ending after its
    last token), which is not leased."""
    eng = _engine("deepseek_v4_like")
    history_by_hand(eng, TEXT, {4: "compressing"})
    prompt = eng.prompt(TEXT)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        assert lease.tokens == 256
        assert lease.blocks("index").tolist() == _ids(eng, "index", range(16))
        compressing = block_id(eng, "history", TEXT, 4)
        assert compressing not in lease.blocks("history").tolist()
        last = block_id(eng, "index", TEXT, 19)
        eng.core.fire("history", [compressing], Event.COMPRESS_DONE)
        assert eng.core.describe("index", last).state == "invalid"
        lease.validate()
    eng.core.assert_invariants()


def test_every_row_leaving_a_readable_state_and_moving_content_is_pin_guarded() -> None:
    """Leases rely on it: in every shipped lifecycle, a row from a readable state that bumps
    the epoch, returns the device slot or drops the hash has the ``no_pins`` guard."""
    moves = ("bump_epoch", "return_slot:device", "drop_hash")
    for name, lifecycle in shipped_lifecycles().items():
        for row in lifecycle.rows:
            if not lifecycle.state(row.source).readable:
                continue
            if any(str(effect).startswith(moves) for effect in row.effects):
                assert any(str(guard) == "no_pins" for guard in row.guards), (name, row.label)


# -- validate ----------------------------------------------------------------------------------


def test_validate_names_the_block_whose_content_moved() -> None:
    """Pins bypassed by hand (an unbalanced unpin): the block is evicted and its id reused by
    another prompt; validate names the group, block and both epochs, and release leaves the
    new owner's pin alone."""
    eng, lease = _committed("dense")
    blocks = lease.blocks("attn")
    old = int(lease.epochs("attn")[-1])
    eng.core.unpin("attn", blocks[-1:])
    eng.core.fire("attn", blocks[-1:], Event.EVICT)
    other = eng.prompt(tokens(17, seed=5))
    eng.commit(other)
    reused = eng.core.lookup_words("attn", *other.words(16))
    assert reused.tolist() == blocks[-1:].tolist()  # the id went to another prompt's block
    with pytest.raises(LeaseLost) as lost:
        lease.validate()
    assert (lost.value.group, lost.value.block) == ("attn", int(blocks[-1]))
    assert lost.value.old_epoch == old and lost.value.new_epoch != old
    assert not lease.valid
    eng.core.pin("attn", reused)
    lease.release()
    assert eng.core.group("attn").pins[reused].tolist() == [1]
    assert _pins(eng) == {"attn": 1}


def test_validate_catches_a_block_no_longer_readable_in_its_form() -> None:
    eng, lease = _committed("dense")
    block = lease.blocks("attn")[:1]
    eng.core.unpin("attn", block)
    eng.core.fire("attn", block, Event.SPILL_BEGIN)
    eng.core.fire("attn", block, Event.SPILL_DONE)
    with pytest.raises(LeaseLost, match="host"):
        lease.validate()


def _stale(change: Callable[[Engine], None]) -> tuple[Engine, pytest.ExceptionInfo[LeaseLost]]:
    """Lease a deepseek verdict after ``change`` ran between the lookup and the lease."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    change(eng)
    # Every group's recency too: a refused lease marks nothing used (the prompt is looked up
    # again before anything is pinned or marked used).
    before = {name: (group.last_use.copy(), group.recency.next.copy())
              for name, group in eng.core.groups.items()}
    now = eng.core.group("history").clock.now
    with pytest.raises(LeaseLost) as lost:
        eng.lease(verdict, prompt)
    assert eng.leases_open == 0
    assert _pins(eng) == {"history": 0, "swa": 0, "index": 0}
    for name, (used, after) in before.items():
        group = eng.core.group(name)
        assert np.array_equal(group.last_use, used) and np.array_equal(group.recency.next, after)
    assert eng.core.group("history").clock.now == now
    return eng, lost


def test_a_verdict_whose_block_was_evicted_leases_nothing() -> None:
    _, lost = _stale(lambda eng: eng.core.fire("swa", [block_id(eng, "swa", TEXT, 19)],
                                               Event.EVICT))
    assert lost.value.group == "swa" and "at prompt block 19" in str(lost.value)


def test_a_verdict_whose_block_was_spilled_leases_nothing() -> None:
    def spill(eng: Engine) -> None:
        block = [block_id(eng, "swa", TEXT, 19)]
        eng.core.fire("swa", block, Event.SPILL_BEGIN)
        eng.core.fire("swa", block, Event.SPILL_DONE)

    eng, lost = _stale(spill)
    assert (lost.value.group, lost.value.block) == ("swa", block_id(eng, "swa", TEXT, 19))
    assert lost.value.state == "host"


def test_a_history_block_rewritten_raw_is_not_leased_as_compressed() -> None:
    """Evicted and written again under the same hash but not yet compressed: readable, but
    raw, and the kernel reads the history compressed."""

    def rewrite(eng: Engine) -> None:
        eng.core.fire("history", [block_id(eng, "history", TEXT, 0)], Event.EVICT)
        high, low = eng.prompt(TEXT).words(64)
        ids = eng.core.allocate("history", [0], high[:1], low[:1])
        eng.core.fire("history", ids, Event.WRITE_BEGIN)
        eng.core.write("history", ids, np.zeros((1, eng.core.group("history").decl
                                                  .payload_bytes), np.uint8))
        eng.core.fire("history", ids, Event.WRITE_DONE)

    _, lost = _stale(rewrite)
    assert (lost.value.group, lost.value.state) == ("history", "raw")


def test_a_verdict_whose_block_then_failed_its_checksum_leases_nothing() -> None:
    def fail(eng: Engine) -> None:
        eng.core.record_checks("swa", [block_id(eng, "swa", TEXT, 19)], [False])

    _, lost = _stale(fail)
    assert lost.value.group == "swa" and "checksum_mismatch" in str(lost.value)


def test_a_failed_pin_rolls_back_the_groups_pinned_before_it() -> None:
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    last = block_id(eng, "index", TEXT, 19)
    eng.core.group("index").add_pins(np.full(MAX_PINS, last, dtype=np.intp))
    with pytest.raises(StateError, match="pins"):
        eng.lease(verdict, prompt)
    pins = _pins(eng)
    assert (pins["history"], pins["swa"], pins["index"]) == (0, 0, MAX_PINS)
    assert eng.leases_open == 0


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan"), "1", True])
def test_a_bad_ttl_is_refused_and_pins_nothing(ttl: object) -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    with pytest.raises(KvfsmError, match="ttl_s"):
        eng.lease(eng.lookup(prompt), prompt, ttl_s=ttl)  # type: ignore[arg-type]
    assert _pins(eng) == {"attn": 0}


def test_a_verdict_of_another_prompt_is_refused() -> None:
    eng = _engine("dense")
    eng.commit(eng.prompt(TEXT))
    verdict = eng.lookup(TEXT)
    with pytest.raises(KvfsmError, match="not this prompt"):
        eng.lease(verdict, TEXT[:100])
    assert _pins(eng) == {"attn": 0} and eng.leases_open == 0


def test_a_stale_verdict_is_leased_to_exactly_its_tokens() -> None:
    """A verdict whose probe is stale (the core changed since) is leased after looking the
    prompt up again capped at the verdict's tokens: a lease covers exactly
    ``verdict.usable_tokens``, never the more that is usable now (the longer prefix
    committed since, or the last block a speculative-decoding lookup dropped)."""
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(eng.prompt(TEXT[:161]))
    short = eng.lookup(prompt)
    dropped = eng.lookup(prompt, drop_last_block=True)
    assert (short.usable_tokens, dropped.usable_tokens) == (160, 144)
    eng.commit(prompt)  # the whole prompt cached since: usable to 320 now
    assert eng.lookup(prompt).usable_tokens == 320
    for verdict, blocks in ((short, 10), (dropped, 9)):
        with eng.lease(verdict, prompt) as lease:
            assert lease.tokens == verdict.usable_tokens
            assert lease.blocks("attn").tolist() == _ids(eng, "attn", range(blocks))
            lease.validate()
        assert _pins(eng) == {"attn": 0}


def test_a_stale_verdict_whose_tokens_are_no_longer_usable_pins_and_touches_nothing() -> None:
    """The prompt looked up again is usable to fewer tokens than the verdict: LeaseLost, told
    to the refusal observer, with nothing pinned or marked used."""
    eng = _engine("gpt_oss_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    eng.core.fire("full", [block_id(eng, "full", TEXT, 7)], Event.EVICT)
    refused: list[LeaseLost] = []
    eng._leases.on_refusal = refused.append
    used = {name: state.last_use.copy() for name, state in eng.core.groups.items()}
    with pytest.raises(LeaseLost, match="only 112: not_cached at prompt block 7") as lost:
        eng.lease(verdict, prompt)
    assert refused == [lost.value] and lost.value.group == "full"
    assert _pins(eng) == {"full": 0, "swa": 0} and eng.leases_open == 0
    assert all(np.array_equal(state.last_use, used[name])
               for name, state in eng.core.groups.items())


# -- release and expiry --------------------------------------------------------------------------


def test_release_is_idempotent_and_a_released_lease_fails_validate() -> None:
    eng, lease = _committed("dense")
    assert eng.leases_open == 1
    lease.release()
    lease.release()
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0}
    assert lease.released and not lease.valid
    with pytest.raises(LeaseLost, match="released"):
        lease.validate()


def test_the_context_manager_releases_on_an_exception() -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    with pytest.raises(RuntimeError, match="kernel"), eng.lease(eng.lookup(prompt), prompt):
        raise RuntimeError("kernel failed")
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0}


def test_an_expired_lease_is_released_by_the_engines_next_call() -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    lease = eng.lease(eng.lookup(prompt), prompt, ttl_s=1e-3)
    time.sleep(0.01)
    assert lease.expired and _pins(eng) == {"attn": 20}  # nobody called the engine yet
    eng.lookup(prompt)
    assert _pins(eng) == {"attn": 0} and eng.leases_open == 0
    with pytest.raises(LeaseLost, match="expired"):
        lease.validate()
    lease.release()  # still safe
    assert _pins(eng) == {"attn": 0}


def test_validate_of_an_expired_lease_releases_its_pins() -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    lease = eng.lease(eng.lookup(prompt), prompt, ttl_s=1e-3)
    time.sleep(0.01)
    with pytest.raises(LeaseLost, match="expired"):
        lease.validate()
    assert _pins(eng) == {"attn": 0}


@pytest.mark.parametrize("how", ["lease", "lookup_and_lease"])
def test_a_lease_being_read_keeps_its_blocks_past_its_ttl_until_its_reader_calls(
        how: str) -> None:
    """The documented read (validate, then read) is safe as written: a lease validated for a
    read keeps its pins when its ttl runs out during the read, so no call of the engine hands
    its blocks to another prompt under the reader (before, the next call reaped it and a
    commit reused the blocks: 38 reads of 3 997 read another prompt's bytes in a load test).
    The reader's next call on it ends it: ``validate`` raises LeaseLost and gives the pins
    back, as ``release`` does."""
    now = [0.0]
    eng = Engine(shipped_models()["dense"], CoreConfig(device_blocks=20, backend="numpy"),
                 lease_clock=lambda: now[0])
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    if how == "lease":
        lease = eng.lease(eng.lookup(prompt), prompt, ttl_s=0.01)
    else:
        lease = eng.lookup_and_lease(prompt, ttl_s=0.01)[1]
    blocks, epochs = lease.blocks("attn"), lease.epochs("attn")
    lease.validate()  # the read begins
    now[0] += 1.0  # ... and outlives the ttl
    other = eng.prompt(TEXT + 100_000)
    with pytest.raises(StateError, match="given back"):
        eng.commit(other)  # every block is the reader's: none may go
    assert np.array_equal(eng.core.group("attn").epoch[blocks], epochs)
    assert eng.leases_open == 1
    with pytest.raises(LeaseLost, match="expired"):
        lease.validate()  # the reader's next call: the read it guards would be too late
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0}
    eng.commit(other)  # now the blocks may go


def test_a_lease_never_validated_still_expires_at_its_ttl() -> None:
    now = [0.0]
    eng = Engine(shipped_models()["dense"], CoreConfig(device_blocks=20, backend="numpy"),
                 lease_clock=lambda: now[0])
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    lease = eng.lease(eng.lookup(prompt), prompt, ttl_s=0.01)
    now[0] += 1.0
    eng.lookup(prompt)  # any call reaps it
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0} and lease.expired


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), -1.0, 0, "1"])
def test_a_ttl_that_is_not_a_finite_positive_number_is_refused(ttl: object) -> None:
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    with pytest.raises(KvfsmError, match="finite number of seconds"):
        eng.lease(eng.lookup(prompt), prompt, ttl_s=ttl)  # type: ignore[arg-type]
    assert eng.leases_open == 0


def test_close_releases_open_leases() -> None:
    eng, lease = _committed("dense")
    eng.close()
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0}
    assert not lease.valid


def test_leases_outlive_many_readers_and_count_exactly() -> None:
    """Readers of one prompt each pin the same blocks; the counts add and fall back to 0."""
    eng = _engine("dense")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    leases = [eng.lease(verdict, prompt) for _ in range(5)]
    assert eng.leases_open == 5 and _pins(eng) == {"attn": 100}
    for lease in leases:
        lease.validate()
        lease.release()
    assert eng.leases_open == 0 and _pins(eng) == {"attn": 0}


# -- long runs: pinned by whole chunks ------------------------------------------------------------

#: Blocks of the dense model's pool in the long-run tests: room for several long prompts.
RUN_POOL = 1024


def _run_engine(chunk: int = 64) -> Engine:
    return Engine(shipped_models()["dense"],
                  CoreConfig(device_blocks=RUN_POOL, host_blocks=0, backend="numpy",
                             pin_chunk_blocks=chunk))


def _long_prompt(eng: Engine, blocks: int, seed: int) -> tuple[Prompt, np.ndarray]:
    """A committed prompt of ``blocks`` whole blocks of 16 tokens (plus the last token, always
    computed) and its block ids in prompt order."""
    prompt = eng.prompt(tokens(blocks * 16 + 1, seed=seed))
    eng.commit(prompt)
    high, low = prompt.words(16)
    ids = eng.core.lookup_words("attn", high, low).astype(np.intp)
    assert (ids >= 0).all()
    return prompt, ids


def test_a_long_run_is_pinned_by_whole_chunks_and_given_back_exactly() -> None:
    """A lease over 200 consecutive ids pins the whole chunks inside them once each and only
    the ids at the ends one by one; every leased block counts one pin (and no other block
    any), none can be evicted or handed out for eviction, and the release leaves no pin."""
    eng = _run_engine()
    eng.commit(eng.prompt(tokens(5 * 16 + 1, seed=1)))  # the run starts mid-chunk
    prompt, ids = _long_prompt(eng, 200, seed=2)
    group = eng.core.group("attn")
    assert (np.diff(ids) == 1).all()
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()
        held = group.pins
        assert (held[ids] == 1).all() and int(held.sum()) == ids.size
        assert int(group.chunk_pins.sum()) > 0
        assert int(group.block_pins.sum()) < ids.size  # the ends only
        middle = ids[ids.size // 2: ids.size // 2 + 1]
        assert group.block_pins[middle][0] == 0  # held by its chunk alone
        with pytest.raises(GuardRejected, match="no_pins"):
            eng.core.fire("attn", middle, Event.EVICT)
        candidates = eng.core.eviction_candidates("attn", RUN_POOL)
        assert not np.isin(candidates, ids).any() and candidates.size > 0
    assert int(group.pins.sum()) == 0 and int(group.chunk_pins.sum()) == 0
    eng.core.fire("attn", middle, Event.EVICT)
    eng.core.assert_invariants()


def test_a_prompt_committed_into_blocks_given_back_is_leased_by_whole_chunks() -> None:
    """Blocks given back in the order they were used come back in that order: the next
    prompt committed into them holds one ascending run again, so its lease pins whole chunks
    (two chunks and the 32 blocks at the ends of 160) as on a fresh pool, not 160 blocks one
    by one, and gives them all back."""
    eng = Engine(shipped_models()["dense"],
                 CoreConfig(device_blocks=200, host_blocks=0, backend="numpy"))
    eng.commit(eng.prompt(tokens(2561, seed=1)))
    assert eng.give_back("attn", 160) == 160
    second = eng.prompt(tokens(2561, seed=2))
    ids = eng.commit(second)["attn"]
    assert ids.tolist() == list(range(160))
    attn = eng.core.group("attn")
    with eng.lease(eng.lookup(second), second) as lease:
        lease.validate()
        assert int(attn.chunk_pins.sum()) == 2
        assert int(attn.block_pins.sum()) == 32
    assert int(attn.chunk_pins.sum()) == int(attn.block_pins.sum()) == 0


def test_a_prompt_committed_while_making_room_is_leased_by_each_runs_whole_chunks() -> None:
    """A commit that gives back other blocks for room takes those first, then older free
    ids: two runs. The lease pins each run's whole chunks (here blocks 0-63) and every other
    block alone, so each block holds one pin; release gives every counter back."""
    eng = Engine(shipped_models()["dense"],
                 CoreConfig(device_blocks=200, host_blocks=0, backend="numpy"))
    eng.commit(eng.prompt(tokens(1921, seed=1)))  # ids 0-119, the oldest: given back whole
    eng.commit(eng.prompt(tokens(641, seed=3)))  # ids 120-159 stay
    second = eng.prompt(tokens(2561, seed=2))
    ids = eng.commit(second)["attn"]
    assert ids.tolist() == list(range(120)) + list(range(160, 200))
    attn = eng.core.group("attn")
    with eng.lease(eng.lookup(second), second) as lease:
        lease.validate()
        assert attn.chunk_pins.tolist()[:4] == [1, 0, 0, 0]
        assert int(attn.block_pins.sum()) == 160 - 64
        held = attn.block_pins.astype(np.int64) + np.repeat(attn.chunk_pins, 64)[:200]
        assert sorted(np.flatnonzero(held == 1).tolist()) == ids.tolist()
        assert held.max() == 1
    assert int(attn.chunk_pins.sum()) == int(attn.block_pins.sum()) == 0


def test_a_chunk_pinned_to_the_limit_refuses_the_lease_and_pins_nothing() -> None:
    eng = _run_engine()
    prompt, ids = _long_prompt(eng, 200, seed=3)
    group = eng.core.group("attn")
    verdict = eng.lookup(prompt)
    chunk = int(ids[100]) >> 6
    group._blocks.chunk_pins[chunk] = MAX_PINS
    # Pins and recency are one pass: a refusal must leave the recency as it was, too.
    used, after, now = group.last_use.copy(), group.recency.next.copy(), group.clock.now
    with pytest.raises(StateError, match="pins"):
        eng.lease(verdict, prompt)
    group._blocks.chunk_pins[chunk] = 0
    assert int(group.pins.sum()) == 0 and eng.leases_open == 0
    assert np.array_equal(group.last_use, used) and np.array_equal(group.recency.next, after)
    assert group.clock.now == now
    with eng.lease(verdict, prompt):
        assert int(group.pins.sum()) == ids.size


def test_a_moved_end_block_keeps_its_new_owners_pin_when_the_lease_goes() -> None:
    """The release of a run gives back its chunks' pins, and the pin of an end block only
    if that block is still at the epoch the lease saw: one that moved behind the lease's back
    lost the lease's pin with its content, and what it holds now is another reader's."""
    eng = _run_engine()
    eng.commit(eng.prompt(tokens(5 * 16 + 1, seed=4)))
    prompt, ids = _long_prompt(eng, 200, seed=5)
    group = eng.core.group("attn")
    lease = eng.lease(eng.lookup(prompt), prompt)
    end = ids[:1]
    assert group.block_pins[end][0] == 1
    group._blocks.epoch[end] += 1  # what only a bypass of the pin could do
    lease.release()
    assert group.block_pins[end][0] == 1 and int(group.chunk_pins.sum()) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1,
                max_size=30),
       st.lists(st.integers(1, 150), min_size=4, max_size=4), st.sampled_from([1, 4, 64]))
def test_lease_pins_count_exactly_the_open_leases_over_each_block(
        steps: list[tuple[int, bool, bool]], lengths: list[int], chunk: int) -> None:
    """Whatever mix of long and short prompts is leased (with its lookup or after it) and
    released, in any order, and whatever the chunk size, each block holds exactly as many
    pins as open leases cover it (runs by whole chunks, short or broken runs block by block),
    and none once every lease is gone."""
    eng = _run_engine(chunk)
    prompts = [_long_prompt(eng, length, seed=10 + i) for i, length in enumerate(lengths)]
    group = eng.core.group("attn")
    open_leases: list[tuple[Lease, np.ndarray]] = []
    for which, take, one_step in steps:
        if take or not open_leases:
            prompt, ids = prompts[which]
            lease = eng.lookup_and_lease(prompt)[1] if one_step else \
                eng.lease(eng.lookup(prompt), prompt)
            open_leases.append((lease, ids))
        else:
            lease, _ = open_leases.pop(which % len(open_leases))
            lease.release()
        expected = np.zeros(group.n_blocks, dtype=np.int64)
        for _, ids in open_leases:
            expected[ids] += 1
        assert (group.pins == expected).all()
    for lease, _ in open_leases:
        lease.release()
    assert int(group.pins.sum()) == 0 and int(group.chunk_pins.sum()) == 0


# -- the engine's lock ---------------------------------------------------------------------------


#: Every public Engine method that touches the core.
LOCKED = ["lookup", "commit", "give_back", "offload", "lease", "lookup_and_lease",
          "leases_open", "discover", "spill_down", "restore", "close"]


def _call(eng: Engine, method: str) -> Callable[[], object]:
    prompt = eng.prompt(TEXT)
    calls: dict[str, Callable[[], object]] = {
        "lookup": lambda: eng.lookup(prompt),
        "commit": lambda: eng.commit(prompt),
        "give_back": lambda: eng.give_back("attn", 1),
        "offload": lambda: eng.offload("attn", [block_id(eng, "attn", TEXT, 0)]),
        "lease": lambda: eng.lease(eng.lookup(prompt), prompt).release(),
        "lookup_and_lease": lambda: eng.lookup_and_lease(prompt)[1].release(),
        "leases_open": lambda: eng.leases_open,
        "discover": lambda: eng.discover(prompt),
        "spill_down": lambda: eng.spill_down("attn", Tier.HOST, 1),
        "restore": lambda: eng.restore(eng.lookup(prompt), prompt),
        "close": eng.close,
    }
    return calls[method]


@pytest.mark.parametrize("method", LOCKED)
def test_every_public_engine_method_waits_for_the_lock(method: str) -> None:
    """While another thread holds ``engine.lock`` a call does not run; once released it does."""
    eng = _engine("dense")
    eng.commit(eng.prompt(TEXT))
    call = _call(eng, method)
    finished = threading.Event()

    def caller() -> None:
        call()
        finished.set()

    with eng.lock:
        thread = threading.Thread(target=caller)
        thread.start()
        assert not finished.wait(0.2), f"{method} ran while another thread held the lock"
    thread.join(JOIN_S)
    assert finished.is_set() and not thread.is_alive()


def test_lease_validate_and_release_wait_for_the_lock() -> None:
    eng, lease = _committed("dense")
    finished = threading.Event()

    def caller() -> None:
        lease.validate()
        lease.release()
        finished.set()

    with eng.lock:
        thread = threading.Thread(target=caller)
        thread.start()
        assert not finished.wait(0.2)
        assert lease.blocks("attn").size == 20 and not lease.released
    thread.join(JOIN_S)
    assert finished.is_set() and eng.leases_open == 0


def test_lease_repr_says_what_it_holds() -> None:
    eng, lease = _committed("dense")
    assert repr(lease) == "Lease(320 tokens, 20 blocks pinned, open)"
    with pytest.raises(KvfsmError, match="no group 'nope'"):
        lease.blocks("nope")
    lease.release()
    assert repr(lease).endswith("released)")
    eng.core.assert_invariants()


def test_the_docs_lease_example_runs() -> None:
    """docs/leases.md stays true: its Python blocks run, in order, in one namespace."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "leases.md"
    blocks = re.findall(r"^```python\n(.*?)^```", doc.read_text(encoding="utf-8"),
                        re.DOTALL | re.MULTILINE)
    assert blocks
    namespace: dict[str, object] = {"__name__": "doc"}
    for number, code in enumerate(blocks, start=1):
        exec(compile(code, f"leases.md python block #{number}", "exec"), namespace)


def test_a_lease_marks_its_blocks_used_in_the_pass_that_pins_them() -> None:
    """Taking a lease is a use: the blocks it pins (one run here, pinned by whole chunks)
    carry the newest use stamp and sit at the young end of their recency list, in prompt
    order, so a give-back reaches them last; other prompts' blocks keep their stamps."""
    eng = _run_engine()
    other, other_ids = _long_prompt(eng, 40, seed=6)
    prompt, ids = _long_prompt(eng, 200, seed=7)
    eng.lease(eng.lookup(other), other).release()  # the other prompt used last...
    group = eng.core.group("attn")
    before = group.last_use[other_ids].copy()
    with eng.lease(eng.lookup(prompt), prompt) as lease:  # ...until this one
        assert np.array_equal(lease.blocks("attn"), ids)
        assert (group.last_use[ids] == group.clock.now).all()
        assert (group.last_use[other_ids] == before).all() and before.max() < group.clock.now
        listed = int(group.recency.list_of_state[group.states[ids[0]]])
        tail, order = int(group.recency.tail[listed]), []
        while tail >= 0 and len(order) < ids.size:
            order.append(tail)
            tail = int(group.recency.prev[tail])
        assert order[::-1] == ids.tolist()
    eng.core.assert_invariants()
