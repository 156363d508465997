"""CacheAdapter on tiny GPT-OSS: what kvfsm calls usable rebuilds exactly the recomputed cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm import Engine, KvfsmError, shipped_models
from kvfsm.lookup import Reason
from kvfsm.serve import declare, tiny_config
from kvfsm.serve._adapter import CacheAdapter, CacheAdapterError
from kvfsm.spec import Event, Form
from kvfsm.state import CoreConfig

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
torch = pytest.importorskip("torch")

BLOCK = 16
TOLERANCE = 1e-4
PROMPT = 90  # not a multiple of the block size


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(0, 1000, PROMPT)]


@pytest.fixture(scope="module")
def reference(model: Any, tokens: list[int]) -> Any:
    """Logits of an uncached forward of the whole prompt, [tokens, vocab]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def fresh(config: Any, device_blocks: int = 32,
          host_blocks: int = 8) -> tuple[Engine, CacheAdapter]:
    engine = Engine(declare(config, block_size=BLOCK),
                    CoreConfig(device_blocks=device_blocks, host_blocks=host_blocks,
                               backend="numpy"))
    return engine, CacheAdapter(engine, config)


def prefill(model: Any, cache: Any, tokens: list[int], start: int = 0) -> Any:
    """Forward ``tokens[start:]`` at their positions on ``cache``; logits [tokens, vocab]."""
    with torch.no_grad():
        ids = torch.tensor([tokens[start:]])
        positions = torch.arange(start, len(tokens))[None]
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits[0]


def stored(model: Any, config: Any, tokens: list[int], **sizes: int) -> tuple[Engine,
                                                                              CacheAdapter]:
    engine, adapter = fresh(config, **sizes)
    cache = adapter.new_cache()
    prefill(model, cache, tokens)
    result = adapter.store(tokens, cache)
    assert dict(result.skipped) == {}
    return engine, adapter


def test_store_then_rebuild_at_every_usable_length(model: Any, config: Any, tokens: list[int],
                                                   reference: Any) -> None:
    engine, adapter = stored(model, config, tokens)
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == verdict.hit_tokens == (PROMPT - 1) // BLOCK * BLOCK
    window = config.sliding_window
    worst = 0.0
    for length in range(0, PROMPT, BLOCK):
        cache = adapter.rebuild(tokens, length)
        assert cache.get_seq_length() == length
        for index, kind in enumerate(config.layer_types):
            layer = cache.layers[index]
            if length == 0:
                continue
            held = layer.keys.shape[-2]
            if kind == "full_attention":
                assert held == length
            else:  # the window's blocks: at least the W-1 tokens before ``length``
                assert layer.cumulative_length == length
                assert min(length, window - 1) <= held < window - 1 + BLOCK
        logits = prefill(model, cache, tokens, length)
        delta = float((logits - reference[length:]).abs().max())
        worst = max(worst, delta)
        assert delta <= TOLERANCE, (length, delta)
    print(f"\nrebuild at every usable length: max |dlogit| {worst:.2e}")


def test_payload_is_the_cache_sliced_by_block(model: Any, config: Any, tokens: list[int]) -> None:
    """Block j of a group holds exactly tokens [16j, 16j+16) of its layers' K and V."""
    engine, adapter = fresh(config)
    cache = adapter.new_cache()
    prefill(model, cache, tokens)
    # Before store the sliding layers still hold every token (they record their past).
    keys = {i: (layer.keys[0].clone(), layer.values[0].clone())
            for i, layer in enumerate(cache.layers)}
    ids = adapter.store(tokens, cache).ids
    for group in adapter.groups:
        decl = group.decl
        raw = engine.core.read(group.name, ids[group.name], form=Form.RAW)
        blocks = raw.view(np.float32).reshape(-1, *decl.shape)
        for j, block in enumerate(blocks):
            for slot, layer in enumerate(group.layers):
                k, v = keys[layer]
                span = slice(j * BLOCK, (j + 1) * BLOCK)
                assert np.array_equal(block[slot, 0], k[:, span].numpy())
                assert np.array_equal(block[slot, 1], v[:, span].numpy())
    # After store the sliding layers are back to their window.
    for index, kind in enumerate(config.layer_types):
        if kind == "sliding_attention":
            assert cache.layers[index].keys.shape[-2] == config.sliding_window - 1
            assert not cache.layers[index].record_past


def test_rebuild_refuses_what_the_verdict_does_not_allow(model: Any, config: Any,
                                                         tokens: list[int]) -> None:
    engine, adapter = stored(model, config, tokens)
    prompt = engine.prompt(tokens)
    high, low = prompt.words(BLOCK)
    sliding = int(engine.core.lookup_words("sliding", high[2:3], low[2:3])[0])
    engine.core.fire("sliding", [sliding], Event.EVICT)  # the window block of L = 48
    with pytest.raises(CacheAdapterError, match="does not allow"):
        adapter.rebuild(tokens, 48)
    adapter.rebuild(tokens, 32)  # its window is block 1: still there
    adapter.rebuild(tokens, 80)  # block 2 is not in the window of 80
    full = int(engine.core.lookup_words("full", high[1:2], low[1:2])[0])
    engine.core.fire("full", [full], Event.SPILL_BEGIN)
    engine.core.fire("full", [full], Event.SPILL_DONE)
    verdict = engine.lookup(tokens)
    assert verdict.usable_tokens == 16 and Reason.NOT_RESIDENT in verdict.reason_set
    for length in (32, 80):
        with pytest.raises(CacheAdapterError, match="does not allow"):
            adapter.rebuild(tokens, length)
    with pytest.raises(CacheAdapterError, match="does not allow"):
        adapter.rebuild(tokens, 80, verdict=verdict)
    with pytest.raises(CacheAdapterError, match="verdict is for a prompt"):
        adapter.rebuild(tokens[:50], 16, verdict=verdict)
    with pytest.raises(CacheAdapterError, match="outside"):
        adapter.rebuild(tokens, PROMPT)
    adapter.rebuild(tokens, 16, verdict=verdict)


def test_a_plain_cache_commits_full_attention_only(model: Any, config: Any,
                                                   tokens: list[int]) -> None:
    """Without recording, blocks that slid out of the window are gone: the sliding group is
    skipped (never filled with anything else) and the full group is committed."""
    from transformers import DynamicCache

    engine, adapter = fresh(config)
    cache = DynamicCache(config=config)
    prefill(model, cache, tokens)
    result = adapter.store(tokens, cache)
    assert result.ids["full"].size == PROMPT // BLOCK and result.ids["sliding"].size == 0
    assert "slid out of its window" in result.skipped["sliding"]
    assert dict(result.missing) == {"sliding": tuple(range(PROMPT // BLOCK))}
    verdict = engine.lookup(tokens)
    assert verdict.group("full").usable_tokens == 80
    assert verdict.usable_tokens == 0


def test_store_after_a_rebuild_commits_only_new_blocks(model: Any, config: Any,
                                                       tokens: list[int]) -> None:
    engine, adapter = stored(model, config, tokens[:60])
    longer = tokens[:60] + [7] * 35
    verdict = engine.lookup(longer)
    assert verdict.usable_tokens == 48
    cache = adapter.rebuild(longer, 48, verdict=verdict)
    logits = prefill(model, cache, longer, 48)
    result = adapter.store(longer, cache)
    assert {name: ids.size for name, ids in result.ids.items()} == {"full": 2, "sliding": 2}
    assert engine.lookup(longer).usable_tokens == 80
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([longer])).logits[0, 48:]
    assert float((logits - reference).abs().max()) <= TOLERANCE
    assert engine.core.check_invariants() == []


def test_a_declaration_that_does_not_fit_is_refused(config: Any) -> None:
    engine = Engine(shipped_models()["gpt_oss_like"], CoreConfig(device_blocks=4,
                                                                  backend="numpy"))
    with pytest.raises(CacheAdapterError, match="does not fit"):
        CacheAdapter(engine, config)
    other = tiny_config("gpt_oss", sliding_window=32)
    with pytest.raises(CacheAdapterError, match="window"):
        CacheAdapter(Engine(declare(config), CoreConfig(device_blocks=4, backend="numpy")),
                     other)


def test_a_commit_without_room_raises_and_ends_the_recording(model: Any, config: Any,
                                                             tokens: list[int]) -> None:
    from kvfsm.state import StateError

    engine, adapter = fresh(config, device_blocks=2, host_blocks=0)
    cache = adapter.new_cache()
    prefill(model, cache, tokens)
    with pytest.raises(StateError, match="nothing changed"):
        adapter.store(tokens, cache)
    for index, kind in enumerate(config.layer_types):
        if kind == "sliding_attention":
            assert not cache.layers[index].record_past
            assert cache.layers[index].keys.shape[-2] == config.sliding_window - 1
    assert engine.lookup(tokens).hit_tokens == 0


def test_prefill_without_capture_points_is_one_forward(model: Any, config: Any,
                                                       tokens: list[int], reference: Any) -> None:
    """GPT-OSS's sliding layers record their past: nothing is captured between forwards, so a
    recording prefill is one forward; it records until store, and after it decodes as usual."""
    _, adapter = fresh(config)
    assert adapter.chunk_ends(0, PROMPT) == [PROMPT]
    cache = adapter.new_cache()
    with torch.no_grad():
        logits = adapter.prefill(model, cache, tokens, all_logits=True)
    assert float((logits - reference).abs().max()) <= TOLERANCE
    assert adapter.recording(cache)
    adapter.store(tokens, cache)
    assert not adapter.recording(cache)
    with torch.no_grad():
        last = adapter.prefill(model, cache, [5], PROMPT)
        expected = model(input_ids=torch.tensor([[*tokens, 5]])).logits[0, -1]
    assert last.shape == (1, config.vocab_size)
    assert float((last[0] - expected).abs().max()) <= TOLERANCE


def test_a_failed_block_the_cache_no_longer_holds_costs_only_itself(
        model: Any, config: Any, tokens: list[int]) -> None:
    """A window block long out of the cache that a lookup saw failing its checksum: the commit
    would replace it but the adapter has no content for it, so it alone is left out (and named
    as such); the blocks computed past the resume point are committed and reused next."""
    from kvfsm.serve import flip_device_bytes

    engine, adapter = stored(model, config, tokens[:60])
    flip_device_bytes(engine, tokens[:60], index=0, group="sliding")
    assert engine.lookup(tokens[:17], level="full").usable_tokens == 0  # block 0 seen failing
    longer = tokens[:60] + [7] * 35
    verdict = engine.lookup(longer, level="full")
    assert verdict.usable_tokens == 48
    cache = adapter.rebuild(longer, 48, verdict=verdict)
    prefill(model, cache, longer, 48)
    result = adapter.store(longer, cache, computed_from=48)
    assert {name: ids.size for name, ids in result.ids.items()} == {"full": 2, "sliding": 2}
    assert dict(result.missing) == {"sliding": (0,)}
    assert result.skipped["sliding"].startswith("blocks [0] (tokens [0, 16)) not committed")
    assert "its copy of [0] is one the commit would replace" in result.skipped["sliding"]
    assert engine.lookup(longer, level="full").usable_tokens == 80
    assert engine.core.check_invariants() == []


def test_store_refuses_a_bad_computed_from_before_anything(model: Any, config: Any,
                                                           tokens: list[int]) -> None:
    engine, adapter = fresh(config)
    cache = adapter.new_cache()
    prefill(model, cache, tokens)
    for bad in (-1, 1.5, True):
        with pytest.raises(KvfsmError, match="computed_from"):
            adapter.store(tokens, cache, computed_from=bad)  # type: ignore[arg-type]
    assert adapter.recording(cache) and engine.lookup(tokens).hit_tokens == 0  # untouched
    assert dict(adapter.store(tokens, cache).skipped) == {}
