"""Gate 1, admission: the core-wide cap on restores in flight (blocks and bytes), the lookup
that never offers a plan past it, the caps following measured bandwidth and free memory, and
the per-request choice between restoring, restoring part, waiting and recomputing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm import Engine, GuardRejected, KvfsmError, Prompt
from kvfsm.gates import Action, AdmissionConfig, AdmissionGate
from kvfsm.spec import Event, Tier
from kvfsm.state import CoreConfig, RestoreBudget
from kvfsm.tiers import DiskTier
from tests.lookup_models import DENSE, GPT_OSS, QWEN, TWO_SIZES, block_id, tokens

PROMPT_TOKENS = 321


def _spilled_engine(decl: object = DENSE, *, spill_every: int = 1, **caps: int | None
                    ) -> tuple[Engine, np.ndarray]:
    """An engine whose committed prompt has every ``spill_every``-th block of every group
    spilled to host (so a lookup plans host restores), with core-wide restore caps."""
    eng = Engine(decl, CoreConfig(device_blocks=64, host_blocks=64, backend="numpy",  # type: ignore[arg-type]
                                  **caps))
    text = tokens(PROMPT_TOKENS)
    eng.commit(text)
    prompt = eng.prompt(text)
    for name, group in eng.core.groups.items():
        high, low = prompt.words(group.decl.block_size)
        found = eng.core.lookup_words(name, high, low)[::spill_every]
        ids = [int(i) for i in found if i >= 0 and group.machine.state_of(int(i)) == "device"]
        moved = eng.core.fire(name, ids, Event.SPILL_BEGIN, masked=True)
        eng.core.fire(name, np.asarray(ids)[moved], Event.SPILL_DONE)
    return eng, text


def _run_plan(eng: Engine, steps: object) -> None:
    """Fire every step's path unmasked: a refusal raises."""
    for step in steps:  # type: ignore[attr-defined]
        for event in step.path:
            eng.core.fire(step.group, [step.block_id], event)


# -- the cap, in the core -------------------------------------------------------------------


def test_restore_begin_is_refused_past_the_byte_cap() -> None:
    """No more blocks begin restoring than the byte cap holds, however many are asked at once;
    the counts stay exact."""
    width = DENSE.groups[0].payload_bytes
    eng, _ = _spilled_engine(max_restore_bytes=3 * width)
    host = eng.core.blocks_in("attn", "host")
    assert host.size > 3
    moved = eng.core.fire("attn", host, Event.RESTORE_BEGIN, masked=True)
    assert int(moved.sum()) == 3
    budget = eng.core.restore_budget
    assert (budget.ops, budget.bytes) == (3, 3 * width)
    with pytest.raises(GuardRejected):
        eng.core.fire("attn", host[~moved][:1], Event.RESTORE_BEGIN)
    eng.core.fire("attn", host[moved], Event.RESTORE_DONE)
    assert (budget.ops, budget.bytes) == (0, 0)
    assert eng.core.check_invariants() == []


def test_restore_begin_is_refused_past_the_ops_cap_across_groups() -> None:
    """The ops cap is core-wide: restores of one group use up the room of another."""
    eng, _ = _spilled_engine(GPT_OSS, max_restore_ops=4)
    attn, swa = eng.core.blocks_in("attn", "host"), eng.core.blocks_in("swa", "host")
    assert attn.size >= 3 and swa.size >= 3
    assert int(eng.core.fire("attn", attn[:3], Event.RESTORE_BEGIN, masked=True).sum()) == 3
    assert int(eng.core.fire("swa", swa[:3], Event.RESTORE_BEGIN, masked=True).sum()) == 1
    assert eng.core.restore_budget.ops == 4
    assert eng.core.check_invariants() == []


def test_lowering_a_cap_keeps_restores_in_flight_and_blocks_new_ones() -> None:
    eng, _ = _spilled_engine()
    host = eng.core.blocks_in("attn", "host")
    eng.core.fire("attn", host[:4], Event.RESTORE_BEGIN)
    eng.core.restore_budget.set_caps(2, None)
    assert eng.core.group("attn").restore_budget() == 0
    assert not eng.core.fire("attn", host[4:5], Event.RESTORE_BEGIN, masked=True).any()
    eng.core.fire("attn", host[:4], Event.RESTORE_DONE)
    assert eng.core.group("attn").restore_budget() == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_caps_are_refused_and_change_nothing(bad: object) -> None:
    budget = RestoreBudget(5, 100)
    with pytest.raises(KvfsmError, match="max_"):
        budget.set_caps(bad, None)  # type: ignore[arg-type]
    with pytest.raises(KvfsmError, match="max_bytes"):
        budget.set_caps(None, bad)  # type: ignore[arg-type]
    assert (budget.max_ops, budget.max_bytes) == (5, 100)
    with pytest.raises(KvfsmError, match="max_restore_bytes"):
        CoreConfig(max_restore_bytes=bad)  # type: ignore[arg-type]


def test_lifted_puts_the_caps_back_even_on_errors() -> None:
    budget = RestoreBudget(5, 100)
    with pytest.raises(RuntimeError), budget.lifted():
        assert not budget.capped
        raise RuntimeError("boom")
    assert (budget.max_ops, budget.max_bytes) == (5, 100)


# -- the verdict never offers what the gate refuses ---------------------------------------------


@given(data=st.data())
def test_a_plan_always_fits_the_core_wide_caps(data: st.DataObject) -> None:
    """Whatever blocks of whichever groups are spilled and whatever the core-wide caps, every
    restore of a verdict's plan, fired at once, is admitted: the plan never asks for more
    blocks or bytes than the caps leave, summed over groups."""
    decl = data.draw(st.sampled_from([DENSE, GPT_OSS, QWEN, TWO_SIZES]), label="model")
    width = max(g.payload_bytes for g in decl.groups)
    ops = data.draw(st.none() | st.integers(0, 12), label="max_ops")
    nbytes = data.draw(st.none() | st.integers(0, 12 * width), label="max_bytes")
    every = data.draw(st.integers(1, 4), label="spill_every")
    eng, text = _spilled_engine(decl, spill_every=every, max_restore_ops=ops,
                                max_restore_bytes=nbytes)
    verdict = eng.lookup(text)
    restores = [s for s in verdict.plan if Event.RESTORE_BEGIN in s.path]
    asked = sum(eng.core.group(s.group).decl.payload_bytes for s in restores)
    assert ops is None or len(restores) <= ops
    assert nbytes is None or asked <= nbytes
    _run_plan(eng, verdict.plan)  # raises GuardRejected if any begin were refused
    assert eng.lookup(text).usable_tokens >= verdict.restorable_tokens
    assert eng.core.check_invariants() == []


def test_the_combined_cap_cuts_a_plan_each_group_alone_would_fit() -> None:
    """Two groups each fitting the cap alone but not together: the verdict restores less
    than the hit rather than offer a plan whose second group's begins would be refused."""
    eng, text = _spilled_engine(GPT_OSS)
    whole = eng.lookup(text)
    per_group = {g: sum(s.group == g and Event.RESTORE_BEGIN in s.path for s in whole.plan)
                 for g in ("attn", "swa")}
    assert min(per_group.values()) >= 2
    cap = max(per_group.values())  # each group alone fits; together they do not
    eng.core.restore_budget.set_caps(cap, None)
    cut = eng.lookup(text)
    assert cut.restorable_tokens < whole.restorable_tokens
    assert sum(Event.RESTORE_BEGIN in s.path for s in cut.plan) <= cap
    _run_plan(eng, cut.plan)


# -- the caps follow measurements ---------------------------------------------------------------


def test_the_byte_cap_follows_measured_bandwidth() -> None:
    width = DENSE.groups[0].payload_bytes
    eng, _ = _spilled_engine()
    gate = AdmissionGate(eng.core, AdmissionConfig(window_s=0.01, memory_fraction=1.0,
                                                   bandwidth_bytes_per_s={"host": 1e5},
                                                   smoothing=1.0))
    _, slow = gate.update_caps()
    assert slow == max(int(1e5 * 0.01), width)
    gate.record_restore(Tier.HOST, 64 * width, 64 * width / 4e5)  # four times as fast
    _, fast = gate.update_caps()
    assert fast == pytest.approx(min(4e5 * 0.01, gate.free_device_bytes()), abs=1)
    assert fast > slow
    assert eng.core.restore_budget.max_bytes == fast


def test_the_byte_cap_follows_free_device_memory() -> None:
    width = DENSE.groups[0].payload_bytes
    eng, _ = _spilled_engine()
    gate = AdmissionGate(eng.core, AdmissionConfig(memory_fraction=0.5,
                                                   bandwidth_bytes_per_s={"host": 1e12}))
    _, before = gate.update_caps()
    assert before == gate.free_device_bytes() // 2
    eng.commit(tokens(16 * 20, seed=5))  # takes device slots
    _, after = gate.update_caps()
    assert after == max(gate.free_device_bytes() // 2, width) and after < before


def test_configured_ceilings_bound_what_measurements_allow() -> None:
    eng, _ = _spilled_engine()
    width = DENSE.groups[0].payload_bytes
    gate = AdmissionGate(eng.core, AdmissionConfig(max_ops=7, max_bytes=2 * width,
                                                   bandwidth_bytes_per_s={"host": 1e12}))
    assert gate.update_caps() == (7, 2 * width)


def test_measurements_that_say_nothing_are_ignored() -> None:
    eng, _ = _spilled_engine()
    gate = AdmissionGate(eng.core)
    before = gate.bandwidth(Tier.HOST), gate.prefill_tokens_per_s
    gate.record_restore(Tier.HOST, 0, 1.0)
    gate.record_restore(Tier.HOST, 100, 0.0)
    gate.record_prefill(10, float("nan"))
    assert (gate.bandwidth(Tier.HOST), gate.prefill_tokens_per_s) == before
    with pytest.raises(KvfsmError, match="device"):
        gate.record_restore(Tier.DEVICE, 100, 1.0)


@pytest.mark.parametrize("bad", [{"window_s": 0}, {"memory_fraction": 1.5},
                                 {"prefill_tokens_per_s": -1},
                                 {"bandwidth_bytes_per_s": {"tape": 1e9}},
                                 {"bandwidth_bytes_per_s": {"disk": 0}},
                                 {"max_ops": -2}])
def test_bad_admission_config_names_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(KvfsmError, match=next(iter(bad))):
        AdmissionConfig(**bad)  # type: ignore[arg-type]


# -- the choice ---------------------------------------------------------------------------------


def _gate(eng: Engine, host_bps: float, prefill: float) -> AdmissionGate:
    """A gate that prices with these rates and leaves the core's caps as they are."""
    return AdmissionGate(eng.core, AdmissionConfig(bandwidth_bytes_per_s={"host": host_bps},
                                                   prefill_tokens_per_s=prefill),
                         apply_caps=False)


def test_fast_restores_are_taken_and_slow_ones_recomputed() -> None:
    eng, text = _spilled_engine(spill_every=2)
    verdict = eng.lookup(text)
    assert verdict.restorable_tokens > verdict.usable_tokens
    fast = _gate(eng, 1e12, 1e3).decide(verdict)
    assert fast.action is Action.RESTORE and fast.reuse_tokens == verdict.restorable_tokens
    assert fast.restore_bytes > 0
    slow = _gate(eng, 1.0, 1e6).decide(verdict)
    assert slow.action is Action.RECOMPUTE and slow.reuse_tokens == verdict.usable_tokens
    assert slow.restore_bytes == 0 and not slow.restores_now


def test_when_the_cap_binds_the_cheaper_of_part_and_wait_is_chosen() -> None:
    """With restores in flight holding the cap, a request restores the part that fits when
    the drain is slow, and waits when the drain is quick and recomputing the rest is slow."""
    width = DENSE.groups[0].payload_bytes
    eng, text = _spilled_engine(spill_every=4, max_restore_ops=6)
    host = eng.core.blocks_in("attn", "host")
    # Another request's restores in flight: two of the four.
    own = {block_id(eng, "attn", text, i) for i in range(PROMPT_TOKENS // 16)}
    other = eng.prompt(tokens(64, seed=77))
    eng.commit(other)
    theirs = [block_id(eng, "attn", tokens(64, seed=77), i) for i in range(2)]
    eng.core.fire("attn", theirs, Event.SPILL_BEGIN)
    eng.core.fire("attn", theirs, Event.SPILL_DONE)
    eng.core.fire("attn", theirs, Event.RESTORE_BEGIN)
    assert own.isdisjoint(theirs) and 4 < host.size <= 6  # fits once theirs have landed
    cut = eng.lookup(text)
    with eng.core.restore_budget.lifted():
        whole = eng.lookup(text)
    assert whole.restorable_tokens > cut.restorable_tokens
    drain_slow = _gate(eng, 10 * width, 1e9)  # recomputing is nearly free
    assert drain_slow.decide(cut, whole).action in (Action.PARTIAL, Action.RECOMPUTE)
    quick = _gate(eng, 1e12, 1.0)  # restores instant, compute very slow: wait, restore all
    decision = quick.decide(cut, whole)
    assert decision.action is Action.WAIT
    assert decision.reuse_tokens == whole.restorable_tokens and not decision.restores_now
    assert set(decision.estimates) == {Action.RECOMPUTE, Action.PARTIAL, Action.WAIT}


# -- the engine: plan, measurements, and the cap under concurrent requests ----------------------


def test_engine_plan_prices_with_what_it_measured() -> None:
    """``Engine.plan`` restores what is cheap to restore and recomputes what is not, as the
    restore bandwidth it measured and the prefill rate it was told say."""
    eng, text = _spilled_engine(spill_every=2)
    eng.record_prefill(1, 1e3)  # a very slow model: restoring wins
    assert eng.plan(text).action is Action.RESTORE
    eng.admission._bandwidth[Tier.HOST] = 1.0  # a very slow host link: recomputing wins
    eng.record_prefill(10**9, 1e-3)
    decision = eng.plan(text)
    assert decision.action is Action.RECOMPUTE and not decision.restores_now


def test_a_prompt_with_nothing_to_restore_is_reused_not_recomputed() -> None:
    """A fully usable prompt (or one with nothing restorable) is ``REUSE``: reuse the usable
    length and compute the rest, never ``RECOMPUTE`` (which means restoring was weighed and
    lost); the decision prints as a few short lines."""
    eng, text = _spilled_engine(spill_every=2)
    verdict = eng.lookup(text)
    eng.restore(verdict, eng.prompt(text)).wait(timeout=30)
    decision = eng.plan(text)
    assert decision.verdict.restorable_tokens == decision.verdict.usable_tokens > 0
    assert decision.action is Action.REUSE and not decision.restores_now
    assert decision.reuse_tokens == decision.verdict.usable_tokens
    lines = str(decision).splitlines()
    assert lines[0].startswith("Decision: reuse, reusing ")
    assert max(map(len, lines)) < 120


def test_engine_measures_restore_bandwidth_from_real_restores() -> None:
    eng, text = _spilled_engine(spill_every=2)
    before = eng.admission.measured_restores
    decision = eng.plan(text)
    eng.restore(decision.verdict, eng.prompt(text)).wait()
    assert eng.admission.measured_restores == before + 1
    assert eng.admission.bandwidth(Tier.HOST) > 0


def test_engine_with_admission_caps_restores_in_flight(tmp_path: Path) -> None:
    eng = _disk_engine(tmp_path, max_ops=3)
    assert eng.core.restore_budget.max_ops == 3
    prompt = _on_disk(eng, seed=1)
    verdict = eng.lookup(prompt)
    assert sum(Event.RESTORE_BEGIN in s.path for s in verdict.plan) <= 3
    assert verdict.restorable_tokens < verdict.hit_tokens  # the cap cut the plan
    decision = eng.plan(prompt)
    assert decision.action in (Action.PARTIAL, Action.WAIT, Action.RECOMPUTE)
    eng.close()


BENCH_WIDTH = 4096
BLOCKS_PER_PROMPT = 6


def _disk_engine(tmp_path: Path, *, max_ops: int | None = None, max_bytes: int | None = None
                 ) -> Engine:
    from kvfsm.bench._restore import restore_model

    store = DiskTier(tmp_path / "disk", capacity_bytes=1 << 26, fsync=False)
    config = AdmissionConfig(max_ops=max_ops, max_bytes=max_bytes, memory_fraction=1.0,
                             bandwidth_bytes_per_s={"host": 1e12, "disk": 1e12})
    return Engine(restore_model(BENCH_WIDTH),
                  CoreConfig(device_blocks=24, host_blocks=24, disk_blocks=64,
                             backend="numpy"),
                  tiers={"disk": store}, workers=2, admission=config)


def _on_disk(eng: Engine, seed: int) -> Prompt:
    """A prompt of ``BLOCKS_PER_PROMPT`` complete blocks (and one token more), committed, then
    spilled device -> host -> disk."""
    prompt = eng.prompt(tokens(16 * BLOCKS_PER_PROMPT + 1, seed=seed))
    eng.commit(prompt)
    with eng.lock:
        ids = _ids(eng, prompt)
        eng.core.fire("attn", ids, Event.SPILL_BEGIN)
        eng.core.fire("attn", ids, Event.SPILL_DONE)
        assert eng.restorer.store("attn", ids).all()
    return prompt


def _ids(eng: Engine, prompt: Prompt) -> np.ndarray:
    found = eng.core.lookup_words("attn", *prompt.words(16))
    return found[found >= 0]


class _CapWatch:
    """A core observer checking, at every restore_begin that moved blocks, that the restores in
    flight are within the caps in force (and remembering the worst it saw)."""

    def __init__(self, eng: Engine) -> None:
        self.budget = eng.core.restore_budget
        self.violations: list[str] = []
        self.most_ops = self.most_bytes = 0

    def moved(self, group: str, event: Event, ids: Any, before: Any, after: Any,
              epochs: Any) -> None:
        if event is not Event.RESTORE_BEGIN:
            return
        budget = self.budget
        self.most_ops = max(self.most_ops, budget.ops)
        self.most_bytes = max(self.most_bytes, budget.bytes)
        if (budget.max_ops is not None and budget.ops > budget.max_ops) or \
                (budget.max_bytes is not None and budget.bytes > budget.max_bytes):
            self.violations.append(repr(budget))

    def read(self, group: str, ids: Any, epochs: Any) -> None:
        pass



def _requests(eng: Engine, prompts: list[Prompt], rounds: int) -> list[BaseException]:
    """One thread per prompt, ``rounds`` times: plan, restore what the decision says, wait,
    then send the prompt's blocks back to disk. Returns what any thread raised."""
    import threading

    errors: list[BaseException] = []

    def serve(prompt: Prompt) -> None:
        try:
            for _ in range(rounds):
                decision = eng.plan(prompt)
                if decision.restores_now:
                    eng.restore(decision.verdict, prompt).wait(timeout=30)
                with eng.lock:
                    ids = _ids(eng, prompt)
                    back = ids[eng.core.group("attn").table.readable[
                        eng.core.group("attn").states[ids]]]
                    eng.core.fire("attn", back, Event.EVICT, masked=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a request thread hung"
    return errors


@pytest.mark.parametrize(("max_ops", "max_blocks_of_bytes"), [(4, None), (None, 3), (5, 2)])
def test_the_caps_hold_under_concurrent_requests(tmp_path: Path, max_ops: int | None,
                                                 max_blocks_of_bytes: int | None) -> None:
    """Requests on several threads plan, restore from disk and send their blocks back, over
    and over: at no restore_begin are more blocks or bytes in flight than the caps in force,
    and the counts end at zero with every invariant holding."""
    max_bytes = None if max_blocks_of_bytes is None else max_blocks_of_bytes * BENCH_WIDTH
    eng = _disk_engine(tmp_path, max_ops=max_ops, max_bytes=max_bytes)
    prompts = [_on_disk(eng, seed) for seed in range(3)]
    watch = _CapWatch(eng)
    eng.core.add_observer(watch)
    errors = _requests(eng, prompts, rounds=25)
    eng.close()
    assert errors == []
    assert watch.violations == []
    assert watch.most_ops > 0  # restores did run concurrently
    assert (eng.core.restore_budget.ops, eng.core.restore_budget.bytes) == (0, 0)
    assert eng.core.check_invariants() == []


def test_without_the_gate_concurrent_requests_exceed_the_cap(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    """The same requests with the admission guard and the verdict's budget both blind to the
    core-wide caps: restores in flight go past them (what the test above rules out)."""
    from kvfsm.state import GroupState

    monkeypatch.setattr(GroupState, "restore_budget", lambda self: 1 << 30)
    eng = _disk_engine(tmp_path, max_ops=2)
    prompts = [_on_disk(eng, seed) for seed in range(3)]
    watch = _CapWatch(eng)
    eng.core.add_observer(watch)
    errors = _requests(eng, prompts, rounds=3)
    eng.close()
    assert errors == []
    assert watch.violations != []


def test_waiting_is_not_offered_when_the_whole_plan_never_fits() -> None:
    """A plan larger than the caps cannot be had by waiting: part now, or recompute."""
    eng, text = _spilled_engine(max_restore_ops=4)
    cut = eng.lookup(text)
    with eng.core.restore_budget.lifted():
        whole = eng.lookup(text)
    assert sum(Event.RESTORE_BEGIN in s.path for s in whole.plan) > 4
    decision = _gate(eng, 1e12, 1.0).decide(cut, whole)
    assert Action.WAIT not in decision.estimates
    assert decision.action is Action.PARTIAL


def test_the_gate_keeps_the_core_configs_ceilings() -> None:
    eng, _ = _spilled_engine(max_restore_ops=3, max_restore_bytes=10**9)
    gate = AdmissionGate(eng.core, AdmissionConfig(max_ops=5, memory_fraction=1.0,
                                                   bandwidth_bytes_per_s={"host": 1e15}))
    assert gate.update_caps() == (3, min(gate.free_device_bytes(), 10**9))
