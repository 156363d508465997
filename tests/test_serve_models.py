"""CacheAdapter and the serving loop on tiny Qwen3-Next and DeepSeek-V4 (GPT-OSS: see
test_serve_adapter.py and test_serve_loop.py).

Invariants proven per model:

* What kvfsm calls usable rebuilds a cache giving the logits of recomputing: after storing a
  prompt prefilled through ``CacheAdapter.prefill``, a rebuild at every usable length ``L``
  followed by the rest of the prompt matches one uncached forward to 1e-4 (float32 rounding of
  a chunked forward), and each state a group holds equals that of an uncached forward of the
  first ``L`` tokens (recurrent snapshots exactly at ``L``, compressed entries ``L // rate``).
* Under faults that damage bytes, kvfsm's verdict-driven reuse gives exactly the greedy tokens of
  recomputing (logits within 1e-4), while a hit-only engine reads wrong bytes on at least one
  request; without faults kvfsm's usable prefix is the whole hit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import Engine
from kvfsm.lookup import Level, Reason
from kvfsm.serve import _faults as faults
from kvfsm.serve import declaration_toml, declare, tiny_config, tiny_model
from kvfsm.serve._adapter import CacheAdapter, CacheAdapterError
from kvfsm.serve._loop import Request, Result, restore_plan, serve
from kvfsm.spec import Event, parse_model
from kvfsm.state import CoreConfig, GroupState
from tests.chat_prompts import chat_prompts

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
torch = pytest.importorskip("torch")

MODELS = ("qwen3_next", "deepseek_v4")
BLOCK = 16
TOLERANCE = 1e-4
PROMPT = 90  # not a multiple of the block size
NEW_TOKENS = 16

_loaded: dict[str, Any] = {}


@pytest.fixture(scope="module", params=MODELS)
def tiny(request: pytest.FixtureRequest) -> Any:
    """A tiny seeded model of each architecture (built once per module)."""
    model_type: str = request.param
    if model_type not in _loaded:
        _loaded[model_type] = tiny_model(model_type, seed=0)
    return _loaded[model_type]


def engine_for(config: Any, device_blocks: int = 64, host_blocks: int = 8) -> Engine:
    return Engine(declare(config, block_size=BLOCK),
                  CoreConfig(device_blocks=device_blocks, host_blocks=host_blocks,
                             backend="numpy"))


def tokens_of(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def forward(model: Any, tokens: list[int]) -> Any:
    """An uncached forward: (logits [tokens, vocab], the cache it leaves)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]
    return logits, cache


def states(model: Any, cache: Any) -> dict[str, Any]:
    """Every fixed-size or compressed state a declared group holds, by name."""
    out: dict[str, Any] = {}
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "recurrent_states"):
            out[f"{i}.conv"] = layer.conv_states[0][..., -model.config.linear_conv_kernel_dim:]
            out[f"{i}.recurrent"] = layer.recurrent_states[0]
        for field in ("compressed_kv", "overlap_kv", "overlap_gate"):
            for part, value in getattr(layer, field, {}).items():
                out[f"{i}.{field}.{part}"] = value
        if hasattr(layer, "entry_count"):
            out[f"{i}.entry_count"] = dict(layer.entry_count)
    return out


def stored(model: Any, tokens: list[int], **sizes: int) -> tuple[Engine, CacheAdapter]:
    engine = engine_for(model.config, **sizes)
    adapter = CacheAdapter(engine, model.config)
    cache = adapter.new_cache()
    with torch.no_grad():
        adapter.prefill(model, cache, tokens)
    result = adapter.store(tokens, cache)
    assert dict(result.skipped) == {}
    return engine, adapter


def test_store_then_rebuild_at_every_usable_length(tiny: Any) -> None:
    tokens = tokens_of(3, PROMPT)
    reference, _ = forward(tiny, tokens)
    engine, adapter = stored(tiny, tokens)
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == verdict.hit_tokens == (PROMPT - 1) // BLOCK * BLOCK
    worst = 0.0
    for length in range(0, PROMPT, BLOCK):
        cache = adapter.rebuild(tokens, length)
        # A forward given no positions takes them from here (transformers >= 5.25 asks the
        # first layer, a linear one in Qwen3-Next).
        assert int(cache.get_seq_length()) == length
        if length:
            expected = states(tiny, forward(tiny, tokens[:length])[1])
            got = states(tiny, cache)
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                if isinstance(value, dict):  # entry counters: L // rate
                    assert got[name] == value, (length, name)
                else:
                    assert torch.allclose(got[name], value, atol=1e-5), (length, name)
        with torch.no_grad():
            logits = adapter.prefill(tiny, cache, tokens[length:], length, all_logits=True)
        delta = float((logits - reference[length:]).abs().max())
        worst = max(worst, delta)
        assert delta <= TOLERANCE, (length, delta)
    print(f"\n{tiny.config.model_type}: rebuild at every usable length, max |dlogit| "
          f"{worst:.2e}")


def test_prefill_chunks_end_at_every_capture_point(tiny: Any) -> None:
    """Chunks end at each checkpoint (and, for DeepSeek-V4's non-recording sliding layers, each
    block end); only while the cache records. A recording prefill captures one snapshot per
    checkpoint it crosses, each the state after exactly that many tokens."""
    engine = engine_for(tiny.config)
    adapter = CacheAdapter(engine, tiny.config)
    assert adapter.chunk_ends(32, 90) == [48, 64, 80, 90]
    assert adapter.chunk_ends(32, 48) == [48]
    tokens = tokens_of(5, 70)
    cache = adapter.new_cache()
    with torch.no_grad():
        adapter.prefill(tiny, cache, tokens)
    recurrent = next(g.name for g in adapter.groups if g.kind.value == "recurrent")
    captured = adapter._records[cache].captured[recurrent]
    assert sorted(captured) == [0, 1, 2, 3]
    for index, snapshot in captured.items():
        at = (index + 1) * BLOCK
        expected = adapter.codecs[recurrent]._pack(forward(tiny, tokens[:at])[1])
        assert torch.allclose(snapshot, expected, atol=1e-5), index
    with pytest.raises(CacheAdapterError, match="misplace"):
        adapter.prefill(tiny, cache, [1], 64)
    adapter.store(tokens, cache)
    assert not adapter.recording(cache)


def test_a_model_called_directly_leaves_only_the_live_snapshot(tiny: Any) -> None:
    """Without CacheAdapter.prefill nothing is captured: of the recurrent group only the
    snapshot the cache's own state is (after the last token) is committed, the earlier ones
    are skipped (never filled with another checkpoint's state); the per-token groups that
    still hold their blocks are committed. So Qwen3-Next (full attention keeps every token)
    reuses the whole prompt and no shorter length; the models with a sliding window no
    length (the window's first block slid out before it was captured)."""
    engine = engine_for(tiny.config)
    adapter = CacheAdapter(engine, tiny.config)
    tokens = tokens_of(6, 64)
    cache = adapter.new_cache()
    with torch.no_grad():
        tiny(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    result = adapter.store(tokens, cache)
    recurrent = next(g.name for g in adapter.groups if g.kind.value == "recurrent")
    assert recurrent in result.skipped and "not captured" in result.skipped[recurrent]
    whole = 64 if tiny.config.model_type == "qwen3_next" else 0
    assert engine.lookup([*tokens, 1]).usable_tokens == whole
    assert engine.lookup([*tokens[:48], 1]).usable_tokens == 0

    engine = engine_for(tiny.config)
    adapter = CacheAdapter(engine, tiny.config)
    cache = adapter.new_cache()
    with torch.no_grad():  # a 16-token prompt: its one snapshot is the live state
        tiny(input_ids=torch.tensor([tokens[:16]]), cache=cache, use_cache=True)
    result = adapter.store(tokens[:16], cache)
    assert dict(result.skipped) == {}
    assert engine.lookup(tokens[:17]).usable_tokens == 16


def test_store_after_a_rebuild_commits_only_new_blocks(tiny: Any) -> None:
    tokens = tokens_of(3, PROMPT)
    engine, adapter = stored(tiny, tokens[:60])
    longer = tokens[:60] + [7] * 35
    verdict = engine.lookup(longer)
    assert verdict.usable_tokens == 48
    cache = adapter.rebuild(longer, 48, verdict=verdict)
    with torch.no_grad():
        logits = adapter.prefill(tiny, cache, longer[48:], 48, all_logits=True)
    result = adapter.store(longer, cache)
    assert {name: ids.size for name, ids in result.ids.items()} == {
        g.name: 2 for g in adapter.groups}
    assert engine.lookup(longer).usable_tokens == 80
    reference, _ = forward(tiny, longer)
    assert float((logits - reference[48:]).abs().max()) <= TOLERANCE
    assert engine.core.check_invariants() == []


def test_a_declaration_missing_a_state_is_refused(tiny: Any) -> None:
    config = tiny.config
    text = declaration_toml(config)
    recurrent = "linear" if config.model_type == "qwen3_next" else "csa_overlap"
    head, _, rest = text.partition(f'[[groups]]\nname = "{recurrent}"')
    tail = rest.partition("[[groups]]")
    kept = head + (f"[[groups]]{tail[2]}" if tail[1] else "")
    engine = Engine(parse_model(kept), CoreConfig(device_blocks=4, backend="numpy"))
    with pytest.raises(CacheAdapterError, match="would be lost"):
        CacheAdapter(engine, config)
    wider = tiny_config(config.model_type, head_dim=32)
    with pytest.raises(CacheAdapterError, match="does not fit"):
        CacheAdapter(Engine(declare(config), CoreConfig(device_blocks=4, backend="numpy")),
                     wider)


# ------------------------------------------------------------------------------ serving


class Workload:
    """A shared 40-token system prompt, three users, two or three turns each (each turn
    extends the user's previous prompt); 57 to 99 tokens, none a multiple of 16. Before five
    requests a fault lands on blocks the request is about to reuse."""

    def __init__(self, model_type: str, seed: int = 7, new_tokens: int = NEW_TOKENS) -> None:
        self.system, self.prompts = chat_prompts(seed)
        self.requests = [Request(rid, tokens, new_tokens) for rid, tokens in self.prompts.items()]
        p = self.prompts
        qwen = model_type == "qwen3_next"
        #: The kind each faulted request's fault damages.
        self.faults: dict[str, Callable[[Engine], str]] = {
            # A1's block 2 spilled and its host copy damaged (full K/V; CSA entries).
            "A2": lambda e: faults.corrupt_host_copy(e, p["A1"], index=2,
                                                     group="full" if qwen else "csa"),
            # The system prompt's block 1 silently damaged on the device: Qwen's full K/V (V of
            # KV head 1), DeepSeek's sliding K=V of layer 0 (its window at L = 32).
            "C1": lambda e: faults.flip_device_bytes(e, self.system, index=1, values=256,
                                                     first=768 if qwen else 0,
                                                     group="full" if qwen else "sliding"),
            # B1's snapshot at its checkpoint evicted (Qwen); B1's HCA block 2 evicted
            # (DeepSeek): the hit itself shrinks.
            "B2": (lambda e: faults.evict_snapshot(e, p["B1"])) if qwen else (
                lambda e: faults.evict_compressed_block(e, p["B1"], group="hca")),
            # A2's snapshot at 80 overwritten with the one at 64: the wrong checkpoint.
            "A3": lambda e: faults.stale_snapshot(e, p["A2"]),
            # C1's snapshot (Qwen) or HCA block (DeepSeek) 3 spilled and half restored.
            "C2": lambda e: faults.restore_in_flight(e, p["C1"], index=3,
                                                     group="linear" if qwen else "hca"),
        }

    def hook(self, engine: Engine, request: Request) -> list[str]:
        inject = self.faults.get(request.rid)
        return [inject(engine)] if inject else []


def delta(a: Result, b: Result) -> float:
    return float(np.abs(a.logits - b.logits).max())


def test_kvfsm_gives_the_tokens_of_recomputing_under_faults(tiny: Any) -> None:
    model_type = tiny.config.model_type
    work = Workload(model_type)
    reference = serve(tiny, None, work.requests, "nocache")
    engines = {mode: engine_for(tiny.config, device_blocks=12, host_blocks=6)
               for mode in ("naive", "kvfsm")}
    naive = serve(tiny, engines["naive"], work.requests, "naive", hook=work.hook)
    kvfsm = serve(tiny, engines["kvfsm"], work.requests, "kvfsm", level=Level.FULL,
                  hook=work.hook)
    faulted = [i for i, r in enumerate(work.requests) if r.rid in work.faults]
    for i in faulted:  # every fault landed, in both engines
        for results in (naive, kvfsm):
            assert len(results[i].events) == 1, results[i].events
            assert "not cached" not in results[i].events[0]
            assert "cannot" not in results[i].events[0]
            assert "not on the device" not in results[i].events[0]
    for ref, got in zip(reference, kvfsm, strict=True):
        assert got.tokens == ref.tokens, got.rid
        assert delta(got, ref) <= TOLERANCE, (got.rid, delta(got, ref))
        assert got.reused_tokens <= got.hit_tokens
        assert got.store_skipped == (), got.store_skipped
    wrong_logits = [naive[i].rid for i in faulted if delta(naive[i], reference[i]) > 1e-3]
    wrong_tokens = [naive[i].rid for i in faulted if naive[i].tokens != reference[i].tokens]
    print(f"\n{model_type}: {len(faulted)} faulted requests; naive: logits off on "
          f"{len(wrong_logits)} {wrong_logits}, greedy tokens off on {len(wrong_tokens)} "
          f"{wrong_tokens}; max |dlogit| naive {max(map(delta, naive, reference)):.2e}, "
          f"kvfsm {max(map(delta, kvfsm, reference)):.2e}")
    for n, k in zip(naive, kvfsm, strict=True):
        print(f"  {k.rid}: {k.prompt_tokens} tokens, hit {k.hit_tokens}, naive reused "
              f"{n.reused_tokens}, kvfsm usable {k.usable_tokens} restorable "
              f"{k.restorable_tokens} reused {k.reused_tokens}, restores {k.restore.restored} "
              f"restored {k.restore.lost} lost; {'; '.join(k.events)}")
    assert wrong_tokens, "naive mode's damaged caches never changed a greedy token"
    # Damaged bytes (a bad host copy, a stale snapshot, a half-landed restore) cost naive.
    wrong = set(wrong_logits) | set(wrong_tokens)
    assert {"A2", "A3", "C2"} <= wrong, wrong
    # Evictions shrink the hit itself: kvfsm resumes from what is left, as naive does.
    b2 = work.requests.index(next(r for r in work.requests if r.rid == "B2"))
    assert kvfsm[b2].reused_tokens == kvfsm[b2].hit_tokens == 32
    for engine in engines.values():
        assert engine.core.check_invariants() == []


@pytest.mark.parametrize("pools", [(32, 8), (7, 6)], ids=["roomy", "tight"])
def test_without_faults_usable_is_the_hit(tiny: Any, pools: tuple[int, int]) -> None:
    work = Workload(tiny.config.model_type, seed=11, new_tokens=4)
    reference = serve(tiny, None, work.requests, "nocache")
    naive = serve(tiny, engine_for(tiny.config, *pools), work.requests, "naive")
    kvfsm = serve(tiny, engine_for(tiny.config, *pools), work.requests, "kvfsm", level="full")
    for ref, n, k in zip(reference, naive, kvfsm, strict=True):
        assert n.tokens == k.tokens == ref.tokens, k.rid
        assert delta(n, ref) <= TOLERANCE and delta(k, ref) <= TOLERANCE, k.rid
        assert k.reused_tokens == k.hit_tokens, k.rid  # after its restores, all of the hit
        if pools == (32, 8):  # nothing given back: usable is the hit, as much as naive reuses
            assert k.usable_tokens == k.hit_tokens == n.reused_tokens, k.rid
    assert sum(k.reused_tokens for k in kvfsm) > 0
    if pools == (7, 6):
        assert sum(k.restore.restored for k in kvfsm) > 0  # memory pressure made it restore


# ------------------------------------------------------------------------------ injectors


def random_payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
    rng = np.random.default_rng(int(index.sum()))
    return rng.integers(0, 256, (index.size, group.decl.payload_bytes), dtype=np.uint8)


def committed(config: Any, tokens: list[int]) -> Engine:
    engine = engine_for(config, device_blocks=16, host_blocks=4)
    engine.commit(tokens, payload=random_payload)
    assert engine.lookup(tokens, level=Level.FULL).usable_tokens == 64
    return engine


def test_recurrent_fault_injectors(tiny: Any) -> None:
    tokens = list(range(75))
    name = "linear" if tiny.config.model_type == "qwen3_next" else "csa_overlap"
    engine = committed(tiny.config, tokens)
    assert faults.checkpoint_block(engine, tokens) == 3
    assert "snapshot evicted" in faults.evict_snapshot(engine, tokens)
    verdict = engine.lookup(tokens, level=Level.FULL)
    assert verdict.usable_tokens == verdict.hit_tokens == 48
    assert verdict.group(name).stop is Reason.NOT_CACHED

    engine = committed(tiny.config, tokens)
    assert "bytes of block 2" in faults.stale_snapshot(engine, tokens)
    ids = [faults.block_id(engine, tokens, name, i) for i in (2, 3)]
    assert np.array_equal(engine.core.read(name, [ids[0]]), engine.core.read(name, [ids[1]]))
    assert engine.lookup(tokens, level=Level.STANDARD).usable_tokens == 64  # silent
    verdict = engine.lookup(tokens, level=Level.FULL)
    assert verdict.usable_tokens == 48 and Reason.CHECKSUM_MISMATCH in verdict.reason_set
    assert "zeros" in faults.stale_snapshot(engine, tokens, index=0)
    assert not engine.core.read(name, [faults.block_id(engine, tokens, name, 0)]).any()
    assert "not cached" in faults.evict_snapshot(engine, list(range(500, 540)))


def test_compressed_fault_injectors() -> None:
    config = tiny_config("deepseek_v4")
    tokens = list(range(75))
    engine = committed(config, tokens)
    assert faults.compressed_block(engine, tokens, "csa") == 3
    assert "compressed block evicted" in faults.evict_compressed_block(engine, tokens, index=1,
                                                                         group="hca")
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == verdict.hit_tokens == 16

    engine = committed(config, tokens)
    before = engine.core.read("csa", [faults.block_id(engine, tokens, "csa", 3)])
    assert "mid-compression" in faults.compression_incomplete(engine, tokens, group="csa")
    block = faults.block_id(engine, tokens, "csa", 3)
    assert engine.core.describe("csa", block).state == "compressing"
    verdict = engine.lookup(tokens, level=Level.FULL)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (48, 64)
    assert [e for step in verdict.plan for e in step.path] == [Event.COMPRESS_DONE]
    assert restore_plan(engine, verdict)[0].restored == 1
    assert engine.lookup(tokens, level=Level.FULL).usable_tokens == 64
    assert np.array_equal(engine.core.read("csa", [block]), before)  # the same entries
    assert engine.core.check_invariants() == []
