"""A lease taken and given back in one compiled pass over every group (kvfsm.lookup._lease_pass,
held by kvfsm.lookup._lease.Lease): on its lookup's own verdict, or on a new lookup of the
prompt where the verdict's probe cannot serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import CoreConfig, Engine, EventLog, Lease, shipped_models
from kvfsm.lookup import Probe
from kvfsm.lookup._buffers import EPOCH, LEASE_KINDS, LINKED_RUN, PINS, PREV
from kvfsm.lookup._lease_pass import LeaseArrays, lease_table
from kvfsm.obs import replay
from kvfsm.state import MAX_PINS, StateError
from tests.lookup_models import (
    DEEPSEEK,
    FOUR,
    GPT_OSS,
    PROMPTS,
    block_id,
    drive,
    engine,
    same_holdings_then_released,
    tokens,
)

TEXT = tokens(321)
MODELS = ["dense", "gpt_oss_like", "deepseek_v4_like", "qwen3_next_like"]


def _engine(name: str, **extra: Any) -> Engine:
    return Engine(shipped_models()[name],
                  CoreConfig(device_blocks=64, host_blocks=16, backend="numpy"), **extra)


def _bookkeeping(eng: Engine) -> dict[str, Any]:
    """Everything a lease's take and release write: per group the pins, chunk pins, use
    stamps and recency links, and the core's use clock."""
    seen: dict[str, Any] = {"clock": eng.core.clock.now}
    for name, state in eng.core.groups.items():
        recency = state.recency
        seen[name] = [state.block_pins.tolist(), state.chunk_pins.tolist(),
                      state.last_use.tolist(), recency.prev.tolist(), recency.next.tolist(),
                      recency.head.tolist(), recency.tail.tolist()]
    return seen


def _on_the_probe_and_looked_up_again(name: str, logs: tuple[EventLog, EventLog] | None = None
                                 ) -> tuple[Engine, Lease, Engine, Lease]:
    """Two engines in the same state, each leasing the same verdict: one on the lookup's own
    prompt (its probe), one on an equal prompt made again (the lookup's outputs are not that
    prompt's, so the prompt is looked up again)."""
    made = []
    for at in range(2):
        eng = _engine(name, event_log=None if logs is None else logs[at])
        prompt = eng.prompt(TEXT)
        eng.commit(prompt)
        made.append((eng, prompt, eng.lookup(prompt)))
    (one, prompt, verdict), (other, _, other_verdict) = made
    looked: list[int] = []
    look_up = other._leases.look_up
    other._leases.look_up = lambda *args: looked.append(1) or look_up(*args)  # type: ignore
    fast, slow = one.lease(verdict, prompt), other.lease(other_verdict, other.prompt(TEXT))
    assert looked == [1]  # the two paths compared
    return one, fast, other, slow


@pytest.mark.parametrize("name", MODELS)
def test_a_lease_after_a_new_lookup_writes_what_the_probes_lease_writes(name: str) -> None:
    """Every shipped model: a lease on the lookup's probe pins the same blocks and chunks,
    stamps the same uses, links the same recency lists and takes the same clock ticks as a
    lease taken after a new lookup; it holds the same blocks at the same epochs, validates,
    and gives back exactly what it took."""
    one, fast, other, slow = _on_the_probe_and_looked_up_again(name)
    assert _bookkeeping(one) == _bookkeeping(other)
    same_holdings_then_released(fast, slow)
    assert _bookkeeping(one) == _bookkeeping(other)
    assert all(not state.block_pins.any() and not state.chunk_pins.any()
               for state in one.core.groups.values())


def test_a_lease_on_its_lookups_own_verdict_does_not_look_up_again() -> None:
    """The usual lease (the lookup's prompt, nothing changed since) makes no second lookup:
    with the book's lookup broken it is still taken, validated and given back."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)

    def broken(*args: object) -> None:
        raise AssertionError("looked up again")

    eng._leases.look_up = broken  # type: ignore[assignment]
    with eng.lease(verdict, prompt) as lease:
        lease.validate()
        assert lease.blocks("index").size == 20
    assert eng.leases_open == 0
    assert not eng.core.group("index").block_pins.any()


def test_a_refusal_in_one_pass_pins_nothing_and_names_the_block() -> None:
    """A block already at the pin limit in the last group refuses the one-pass take: a
    StateError naming it, no pin left in any group, no lease open, and a lease after a
    new lookup refuses alike."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    full = block_id(eng, "index", TEXT, 7)
    eng.core.group("index").add_pins(np.full(MAX_PINS, full, dtype=np.intp))
    before = {name: (state.block_pins.tolist(), state.chunk_pins.tolist())
              for name, state in eng.core.groups.items()}
    with pytest.raises(StateError, match=f"block {full}"):
        eng.lease(verdict, prompt)
    assert {name: (state.block_pins.tolist(), state.chunk_pins.tolist())
            for name, state in eng.core.groups.items()} == before
    assert eng.leases_open == 0
    with pytest.raises(StateError, match=f"block {full}"):
        eng.lease(verdict, eng.prompt(TEXT))


def test_a_group_changed_after_the_take_is_checked_block_by_block() -> None:
    """After a one-pass take, a change in some group (another prompt committed) makes
    validate look at the lease's blocks themselves: they did not move, so it passes."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        eng.commit(eng.prompt(tokens(97, seed=5)))
        lease.validate()
        assert lease.valid


def test_a_lease_after_a_new_lookup_logs_the_reads_the_probes_lease_logs(tmp_path: Path) -> None:
    """The event log of a lease on its lookup's probe reads the same runs as one taken after
    a new lookup (on its lease line: its take, read and give-back at once, nothing logged
    between), and replays clean."""
    logs = [tmp_path / "one.jsonl", tmp_path / "other.jsonl"]
    opened = (EventLog(logs[0]), EventLog(logs[1]))
    _, fast, _, slow = _on_the_probe_and_looked_up_again("deepseek_v4_like", opened)
    fast.validate()
    slow.validate()
    fast.release()
    slow.release()
    for log in opened:
        log.close()
    reads = [[record["runs"] for record in map(json.loads, path.read_text().splitlines()[1:])
              if record["type"] in ("read", "reads", "take_read", "lease")] for path in logs]
    assert reads[0] and reads[0] == reads[1]
    assert '"type":"lease"' in logs[0].read_text()
    for path in logs:
        assert replay(path).accepted


def test_lease_arrays_are_the_groups_own() -> None:
    """The gathered address table holds each group's arrays themselves (no copies: a pass
    writes them), in the order given."""
    eng = _engine("deepseek_v4_like")
    order = [eng.core.group(name) for name in ("history", "swa", "index")]
    arrays = LeaseArrays(order)
    assert arrays.names == ("history", "swa", "index")
    per_group = len(LEASE_KINDS)
    for g, state in enumerate(order):
        held = arrays.table.held[g * per_group : (g + 1) * per_group]
        assert held[PINS] is state._blocks.pins
        assert np.shares_memory(held[PINS], state.block_pins)
        assert held[EPOCH] is state.epoch and held[PREV] is state.recency.prev
        assert held[LINKED_RUN] is state.recency.linked_run
    assert arrays.fixed[2, 1] == 0  # the index points into the history, at position 0
    assert arrays.clock is eng.core.clock and arrays.change_count is eng.core.change_count
    names = ("history", "swa", "index")
    assert LeaseArrays(order, names).names is names  # a probe's names, kept for identity
    with pytest.raises(ValueError, match="not the groups'"):
        LeaseArrays(order, ("swa", "history", "index"))
    with pytest.raises(ValueError, match="at least one group"):
        LeaseArrays([])


def _pins_now(eng: Engine) -> dict[str, tuple[list[int], list[int]]]:
    return {name: (state.block_pins.tolist(), state.chunk_pins.tolist())
            for name, state in eng.core.groups.items()}


def _leased(eng: Engine, verdict: Any, prompt: Any
            ) -> tuple[str, dict[str, tuple[list[int], list[int]]] | None, Lease | None]:
    """The lease's outcome (its class, or the error's), the pins while it is held."""
    try:
        lease = eng.lease(verdict, prompt)
    except Exception as error:  # compared between the two paths
        return type(error).__name__, None, None
    return "Lease", _pins_now(eng), lease


@settings(max_examples=60, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, FOUR, GPT_OSS]))
def test_in_any_reachable_state_a_lease_after_a_new_lookup_pins_what_the_probes_pins(
        data: st.DataObject, decl: Any) -> None:
    """For any state the drive reaches (corrupted copies, flipped bytes, scrambled index
    references included), a lease on a lookup's own verdict either refuses as a lease after
    a new lookup refuses for the same verdict, or holds exactly the blocks it holds, at the
    same pins and chunk pins; each gives back exactly what it took."""
    eng = engine(decl, device=24, host=6)
    drive(eng, data, data.draw(st.integers(1, 12), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    cut = data.draw(st.integers(1, text.size), label="length")
    before = _pins_now(eng)
    prompt = eng.prompt(text[:cut])
    outcome, held, lease = _leased(eng, eng.lookup(prompt), prompt)
    # The same verdict again (nothing moved since: the take above only touched), leased with
    # an equal prompt made anew: looked up again.
    again = eng.lookup(prompt)
    if lease is not None:
        lease.release()
    assert _pins_now(eng) == before
    other, other_held, other_lease = _leased(eng, again, eng.prompt(text[:cut]))
    assert (outcome, held) == (other, other_held)
    if lease is not None and other_lease is not None:
        for name in lease.groups:
            assert lease.blocks(name).tolist() == other_lease.blocks(name).tolist()
            assert lease.epochs(name).tolist() == other_lease.epochs(name).tolist()
        other_lease.release()
    assert _pins_now(eng) == before


def test_a_lease_table_refuses_arrays_it_would_have_to_copy() -> None:
    """The one-pass lease writes pins, links and stamps through its address table into the
    groups' own arrays: an array of another dtype or a strided one is refused with a
    TypeError naming it, never converted into a copy the pass would write instead."""
    eng = _engine("deepseek_v4_like")
    state = eng.core.group("history")
    own = [state.states, state.recency.list_of_state, state._blocks.last_use,
           state.recency.prev, state.recency.next, state.recency.head, state.recency.tail,
           state._blocks.pins, state._blocks.chunk_pins, state.epoch, state.recency.linked_run]
    assert lease_table([own]).held == tuple(own)
    for which, bad in ((PINS, own[PINS].astype(np.uint32)),
                       (PREV, np.zeros(2 * own[PREV].size, dtype=np.int32)[::2])):
        arrays = list(own)
        arrays[which] = bad
        with pytest.raises(TypeError, match=f"lease array {which}"):
            lease_table([arrays])



def test_a_probe_not_made_by_a_lookup_never_reaches_the_bound_take(jit_backend: str) -> None:
    """The one-pass take calls entry points bound to a lookup's own arrays, unchecked. A
    verdict carrying a probe made by hand (its ids strided views) is leased through a new
    lookup instead: the bound entry points only ever see the new lookup's arrays, and the
    lease holds what a lookup's own does."""
    eng = _engine("deepseek_v4_like")
    prompt = eng.prompt(TEXT)
    eng.commit(prompt)
    with eng.lease(eng.lookup(prompt), prompt) as lease:  # binds the entry points (compiled)
        expected = {name: lease.blocks(name).tolist() for name in lease.groups}
    verdict = eng.lookup(prompt)
    probe = verdict.probe
    assert probe is not None and probe.exact
    arrays = eng._leases._arrays
    assert arrays is not None
    take, unpin = arrays._take_entry, arrays._unpin_entry
    seen: list[tuple[np.ndarray, ...]] = []

    def watched(entry: Any) -> Any:
        def call(outs: tuple[np.ndarray, ...], *rest: object) -> Any:
            seen.append(outs)
            return entry(outs, *rest)
        return call

    if jit_backend == "numba":
        assert take is not None and unpin is not None
        arrays._take_entry, arrays._unpin_entry = watched(take), watched(unpin)
    by_hand = tuple(group._replace(ids=np.repeat(group.ids, 2)[::2]) for group in probe.groups)
    made = attrs.evolve(verdict, probe=Probe(probe.core, probe.tokens, by_hand, prompt))
    assert made.probe is not None and not made.probe.exact
    with eng.lease(made, prompt) as lease:
        lease.validate()
        assert {name: lease.blocks(name).tolist() for name in lease.groups} == expected
    for outs in seen:
        assert all(out.dtype == np.int64 and out.flags.c_contiguous for out in outs)
        assert len(outs) == len(probe.groups)
    assert all(not state.block_pins.any() and not state.chunk_pins.any()
               for state in eng.core.groups.values())


def test_a_prompt_whose_words_end_before_its_tokens_is_looked_up_and_leased_on_its_words(
        ) -> None:
    """A prompt holding fewer hash words at one block size than its tokens complete: the
    lookup reads that group over the blocks the words hold (no candidate past them is
    usable), and a lease of that verdict pins, validates and gives back what it found."""
    eng = _engine("deepseek_v4_like")
    eng.commit(eng.prompt(TEXT))
    prompt = eng.prompt(TEXT)
    size = eng.core.group("swa").decl.block_size
    high, low = prompt.words(size)
    prompt._words_at[size] = (high[:-3].copy(), low[:-3].copy())  # the last 3 blocks unhashed
    verdict = eng.lookup(prompt)
    assert 0 < verdict.usable_tokens <= (high.size - 3) * size
    with eng.lease(verdict, prompt) as lease:
        lease.validate()
        assert lease.tokens == verdict.usable_tokens
    assert all(not state.block_pins.any() and not state.chunk_pins.any()
               for state in eng.core.groups.values())
