"""The serving loop on tiny GPT-OSS: kvfsm's reuse gives exactly the tokens of recomputing,
under faults that make a hit-only engine read wrong bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import Engine, KvfsmError
from kvfsm.lookup import Level, Reason
from kvfsm.serve import _faults as faults
from kvfsm.serve import declare
from kvfsm.serve._loop import Request, Result, intact_tokens, restore_plan, serve
from kvfsm.spec import Event, Tier
from kvfsm.state import CoreConfig, GroupState
from tests.chat_prompts import chat_prompts

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest.importorskip("torch")

TOLERANCE = 1e-4
NEW_TOKENS = 16


def engine_for(config: Any, device_blocks: int, host_blocks: int) -> Engine:
    return Engine(declare(config), CoreConfig(device_blocks=device_blocks,
                                              host_blocks=host_blocks, backend="numpy"))


class Workload:
    """A shared 40-token system prompt, three users, two or three turns each (each turn
    extends the user's previous prompt); 57 to 99 tokens, none a multiple of 16."""

    def __init__(self, seed: int = 7) -> None:
        self.system, self.prompts = chat_prompts(seed)
        self.requests = [Request(rid, tokens, NEW_TOKENS) for rid, tokens in self.prompts.items()]
        p = self.prompts
        #: Before request rid: a fault on the blocks it is about to reuse.
        self.faults: dict[str, Callable[[Engine], str]] = {
            # A1's full block 2 spilled and its host copy damaged.
            "A2": lambda e: faults.corrupt_host_copy(e, p["A1"], index=2),
            # The system prompt's full block 1 silently damaged on the device: a stray write
            # over one KV head's V (values 768..1023: layer 0, V, head 1, its 16 tokens).
            "C1": lambda e: faults.flip_device_bytes(e, self.system, index=1, values=256,
                                                     first=768),
            # B1's window block evicted: the hit itself shrinks.
            "B2": lambda e: faults.evict_window_block(e, p["B1"]),
            # A2's full block 3 spilled and half restored.
            "A3": lambda e: faults.restore_in_flight(e, p["A2"], index=3),
            # C1's window block spilled, left there.
            "C2": lambda e: faults.spill_block(e, p["C1"], index=3, group="sliding"),
        }

    def hook(self, engine: Engine, request: Request) -> list[str]:
        inject = self.faults.get(request.rid)
        return [inject(engine)] if inject else []


def delta(a: Result, b: Result) -> float:
    return float(np.abs(a.logits - b.logits).max())


def test_kvfsm_gives_the_tokens_of_recomputing_under_faults(model: Any, config: Any) -> None:
    work = Workload()
    reference = serve(model, None, work.requests, "nocache")
    engines = {mode: engine_for(config, device_blocks=12, host_blocks=6)
               for mode in ("naive", "kvfsm")}
    naive = serve(model, engines["naive"], work.requests, "naive", hook=work.hook)
    kvfsm = serve(model, engines["kvfsm"], work.requests, "kvfsm", level=Level.FULL,
                  hook=work.hook)
    faulted = [i for i, r in enumerate(work.requests) if r.rid in work.faults]
    for i in faulted:  # every fault landed, in both engines
        for results in (naive, kvfsm):
            assert len(results[i].events) == 1, results[i].events
            assert "not cached" not in results[i].events[0]
            assert "cannot" not in results[i].events[0]
    for ref, got in zip(reference, kvfsm, strict=True):
        assert got.tokens == ref.tokens, got.rid
        assert delta(got, ref) <= TOLERANCE, (got.rid, delta(got, ref))
        assert got.reused_tokens <= got.hit_tokens
    wrong_logits = [naive[i].rid for i in faulted if delta(naive[i], reference[i]) > 1e-3]
    wrong_tokens = [naive[i].rid for i in faulted if naive[i].tokens != reference[i].tokens]
    print(f"\n{len(faulted)} faulted requests; naive: logits off on {len(wrong_logits)} "
          f"{wrong_logits}, greedy tokens off on {len(wrong_tokens)} {wrong_tokens}; "
          f"max |dlogit| naive {max(map(delta, naive, reference)):.2e}, "
          f"kvfsm {max(map(delta, kvfsm, reference)):.2e}")
    for n, k in zip(naive, kvfsm, strict=True):
        print(f"  {k.rid}: {k.prompt_tokens} tokens, hit {k.hit_tokens}, naive reused "
              f"{n.reused_tokens}, kvfsm usable {k.usable_tokens} restorable "
              f"{k.restorable_tokens} reused {k.reused_tokens}, restores {k.restore.restored} "
              f"restored {k.restore.lost} lost; {'; '.join(k.events)}")
    assert wrong_logits, "naive mode read every faulted block correctly"
    assert wrong_tokens, "naive mode's damaged caches never changed a greedy token"
    # Faults the hit sees (an evicted window block) cost naive nothing; the damaged bytes do.
    assert "A2" in wrong_logits and "A3" in wrong_logits and "C1" in wrong_logits
    for engine in engines.values():
        assert engine.core.check_invariants() == []


@pytest.mark.parametrize("pools", [(32, 8), (7, 6)], ids=["roomy", "tight"])
def test_without_faults_naive_and_kvfsm_agree(model: Any, config: Any,
                                             pools: tuple[int, int]) -> None:
    work = Workload(seed=11)
    reference = serve(model, None, work.requests, "nocache")
    naive = serve(model, engine_for(config, *pools), work.requests, "naive")
    kvfsm = serve(model, engine_for(config, *pools), work.requests, "kvfsm", level="full")
    for ref, n, k in zip(reference, naive, kvfsm, strict=True):
        assert n.tokens == k.tokens == ref.tokens, k.rid
        assert delta(n, ref) <= TOLERANCE and delta(k, ref) <= TOLERANCE, k.rid
        assert k.reused_tokens == k.hit_tokens, k.rid  # after its restores, all of the hit
        if pools == (32, 8):  # nothing given back: usable is the hit, as much as naive reuses
            assert k.usable_tokens == k.hit_tokens == n.reused_tokens, k.rid
    assert sum(k.reused_tokens for k in kvfsm) > 0
    if pools == (7, 6):
        assert sum(k.restore.restored for k in kvfsm) > 0  # memory pressure made it restore


def random_payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
    rng = np.random.default_rng(int(index.sum()))
    return rng.integers(0, 256, (index.size, group.decl.payload_bytes), dtype=np.uint8)


def test_a_restore_failing_its_checksum_is_rolled_back(config: Any) -> None:
    engine = engine_for(config, device_blocks=16, host_blocks=4)
    tokens = list(range(70))
    engine.commit(tokens, payload=random_payload)
    faults.corrupt_host_copy(engine, tokens, index=1)
    verdict = engine.lookup(tokens, level=Level.FULL)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (16, 64)
    outcome, steps = restore_plan(engine, verdict)
    assert (outcome.restored, outcome.lost) == (0, 1) and "checksum_ok" in outcome.notes[0]
    assert steps == (("full", "full", "host", "lost", "CORRUPT"),)
    assert faults.block_id(engine, tokens, "full", 1) == -1  # dropped, to be recomputed
    assert engine.lookup(tokens).usable_tokens == 16
    assert engine.core.check_invariants() == []


def test_fault_injectors(config: Any) -> None:
    tokens = list(range(75))

    def committed() -> Engine:
        engine = engine_for(config, device_blocks=16, host_blocks=4)
        engine.commit(tokens, payload=random_payload)
        assert engine.lookup(tokens, level=Level.FULL).usable_tokens == 64
        return engine

    engine = committed()
    assert faults.window_blocks(engine, tokens) == [3]
    assert "evicted" in faults.evict_window_block(engine, tokens)
    verdict = engine.lookup(tokens)
    assert verdict.hit_tokens < 64 and Reason.WINDOW_MISMATCH in verdict.reason_set

    engine = committed()
    assert "host copy flipped" in faults.corrupt_host_copy(engine, tokens, index=2)
    assert engine.core.describe("full", faults.block_id(engine, tokens, "full", 2)).state == "host"

    engine = committed()
    assert "flipped on the device" in faults.flip_device_bytes(engine, tokens, index=2)
    assert engine.lookup(tokens, level=Level.STANDARD).usable_tokens == 64  # silent
    verdict = engine.lookup(tokens, level=Level.FULL)
    assert verdict.usable_tokens == 32 and Reason.CHECKSUM_MISMATCH in verdict.reason_set

    engine = committed()
    assert "left unrestored" in faults.spill_block(engine, tokens, index=1, group="sliding")
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == 64  # not in the window of 64
    assert "left unrestored" in faults.spill_block(engine, tokens, index=3, group="sliding")
    verdict = engine.lookup(tokens)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (48, 64)

    engine = committed()
    assert "half of the copy" in faults.restore_in_flight(engine, tokens, index=0)
    block = faults.block_id(engine, tokens, "full", 0)
    assert engine.core.describe("full", block).state == "restoring_host"
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == 0
    assert [e for step in verdict.plan for e in step.path] == [Event.RESTORE_DONE]
    group = engine.core.group("full")
    assert not group.pools[Tier.DEVICE].verify_checksum([group.slot[Tier.DEVICE][block]])[0]

    assert "not cached" in faults.spill_block(engine, list(range(500, 540)), index=0)


def test_serve_checks_its_mode(model: Any, config: Any) -> None:
    with pytest.raises(KvfsmError, match="mode"):
        serve(model, None, [], "cached")  # type: ignore[arg-type]
    with pytest.raises(KvfsmError, match="needs an engine"):
        serve(model, None, [], "kvfsm")


# -- partial commits: a block the adapter lacks costs only itself -----------------------------

TURNS = (101, 141, 171)  # three turns of one chat, each extending the last; none a multiple of 16
#: The group whose block 0 (tokens [0, 16)) leaves the cache between turns 1 and 2: long out of
#: turn 2's window (sliding) or before its resume point (a snapshot), so the rebuilt cache of
#: turn 2 never holds it and no prefill of turn 2 captures it.
OLDER_BLOCK = {"gpt_oss": "sliding", "qwen3_next": "linear"}


@pytest.fixture(scope="module")
def qwen3_next() -> Any:
    from kvfsm.serve import tiny_model

    return tiny_model("qwen3_next", seed=0)


def chat_turns() -> list[Request]:
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 1000, TURNS[-1])]
    return [Request(f"t{i}", tokens[:n], 2) for i, n in enumerate(TURNS)]


def older_block_hook(group: str, move: Event) -> Callable[[Engine, Request], list[str]]:
    """Before turn 2: block 0 of ``group`` (turn 1's) moved on ``move`` (evicted, spilled)."""

    def hook(engine: Engine, request: Request) -> list[str]:
        if request.rid != "t1":
            return []
        block = faults.block_id(engine, request.tokens, group, 0)
        engine.core.fire(group, [block], move)
        if move is Event.SPILL_BEGIN:
            engine.core.fire(group, [block], Event.SPILL_DONE)
        return [f"{group} block 0 {move.spec_name}"]

    return hook


@pytest.mark.parametrize("model_type", sorted(OLDER_BLOCK))
def test_an_older_block_evicted_between_turns_costs_only_itself(
        model: Any, qwen3_next: Any, model_type: str) -> None:
    """Turn 2 resumes at 96 after an older window block / snapshot of turn 1 (block 0) was
    evicted: its commit leaves out block 0 alone, so turn 3 reuses all 128 tokens turn 2
    computed (before: the whole group was skipped and turn 3 reused 96), and the outputs are
    those of recomputing."""
    served = {"gpt_oss": model, "qwen3_next": qwen3_next}[model_type]
    group = OLDER_BLOCK[model_type]
    requests = chat_turns()
    engine = Engine(declare(served.config), CoreConfig(device_blocks=32, host_blocks=8,
                                                       backend="numpy"))
    results = serve(served, engine, requests, "kvfsm", level=Level.FULL,
                    hook=older_block_hook(group, Event.EVICT))
    reference = serve(served, None, requests, "nocache")
    assert [r.reused_tokens for r in results] == [0, 96, TURNS[1] // 16 * 16]
    for turn in results[1:]:  # only the block really missing is named
        (skipped,) = turn.store_skipped
        assert skipped.startswith(f"{group}: blocks [0] (tokens [0, 16)) not committed"), skipped
    for got, ref in zip(results, reference, strict=True):
        assert got.tokens == ref.tokens and delta(got, ref) <= TOLERANCE, got.rid
    assert engine.core.check_invariants() == []


def test_an_older_window_block_spilled_between_turns_stays_where_it_is(
        model: Any, config: Any) -> None:
    """Block 0 of turn 1's window spilled to host before turn 2: turn 2 reused 96 tokens
    (``computed_from``), so the commit keeps the host copy (it has nothing to rewrite it from)
    and commits the rest; nothing is reported missing and turn 3 reuses all of turn 2."""
    requests = chat_turns()
    engine = engine_for(config, device_blocks=32, host_blocks=8)
    results = serve(model, engine, requests, "kvfsm", level=Level.FULL,
                    hook=older_block_hook("sliding", Event.SPILL_BEGIN))
    assert [r.store_skipped for r in results] == [(), (), ()]
    assert [r.reused_tokens for r in results] == [0, 96, TURNS[1] // 16 * 16]
    block = faults.block_id(engine, requests[0].tokens, "sliding", 0)
    assert engine.core.describe("sliding", block).state == "host"


# -- the intact-tokens oracle -----------------------------------------------------------------

#: Disk bytes each test engine may keep: far above its 8 disk blocks, so the core decides.
DISK_BYTES = 1 << 24


def test_intact_tokens_reads_every_copy_and_not_the_verdict(config: Any, tmp_path: Path) -> None:
    """A 75-token prompt (full and sliding blocks 0..3, lengths 0..64 to try): the oracle finds
    the largest length whose every needed block has a copy whose bytes match their checksum,
    wherever it lies, whatever the verdict says."""
    from kvfsm.serve._stores import ObservedTier
    from kvfsm.tiers import DiskTier

    tokens = list(range(75))

    def committed(name: str) -> Engine:
        disk = ObservedTier(DiskTier(tmp_path / name, capacity_bytes=DISK_BYTES, fsync=False))
        engine = Engine(declare(config), CoreConfig(device_blocks=16, host_blocks=4,
                                                    disk_blocks=8, backend="numpy"),
                        tiers={"disk": disk})
        engine.commit(tokens, payload=random_payload)
        assert intact_tokens(engine, engine.prompt(tokens)) == 64
        return engine

    def both(engine: Engine, level: Level = Level.FULL) -> tuple[int, int]:
        """(the oracle's intact tokens, the verdict's usable tokens)"""
        prompt = engine.prompt(tokens)
        return intact_tokens(engine, prompt), engine.lookup(prompt, level=level).usable_tokens

    engine = committed("device")  # silent device damage the STANDARD verdict does not see
    faults.flip_device_bytes(engine, tokens, index=2)
    assert both(engine, Level.STANDARD) == (32, 64)

    engine = committed("in_flight")  # the device copy half landed; the host copy is whole
    faults.restore_in_flight(engine, tokens, index=0)
    assert both(engine) == (64, 0)

    engine = committed("host")  # spilled to host: intact there, usable after a restore
    faults.spill_block(engine, tokens, index=1)
    assert both(engine) == (64, 16)
    faults.corrupt_host_copy(engine, tokens, index=1)  # now its only copy is damaged
    assert both(engine) == (16, 16)

    engine = committed("disk")  # a disk file: intact while its header and payload verify
    assert "moved to disk" in faults.delete_disk_file(engine, tokens, index=3)
    assert both(engine)[0] == 48
    assert "flipped" in faults.flip_disk_byte(engine, tokens, index=1)
    assert both(engine)[0] == 16
    assert "torn write" in faults.truncate_disk_file(engine, tokens, index=0)
    assert both(engine)[0] == 0

    engine = committed("window")  # the window block of 64 gone: 48 is the longest intact
    assert "evicted" in faults.evict_window_block(engine, tokens)
    assert both(engine) == (48, 48)
