"""``kvfsm bench lookup``: the verdict of a long prompt vs a hit-only per-block walk, one run."""

from __future__ import annotations

import numpy as np

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm._jit import settings as jit
from kvfsm.bench._timing import Progress, ProgressFn, median_seconds
from kvfsm.spec import shipped_models
from kvfsm.state import CoreConfig
from kvfsm.verify import Level, lookup


def bench_lookup(
    *, tokens: int = 131_072, repeat: int = 41, progress: ProgressFn | None = None
) -> dict[str, float | int | str]:
    """Median lookup latency over the DeepSeek-style model (every group, every layer at FULL
    level minus data checksums; with checksums, and with the NumPy twins of the compiled
    kernels, reported too), against a baseline that walks each group's blocks one by one in
    Python checking only the hash, like a hit-only cache. ``progress`` takes a line per phase
    and, on long measurements, run counts (nothing is reported without it)."""
    if tokens < 1 or repeat < 1:
        raise KvfsmError(f"bench lookup: tokens and repeat must be >= 1, got {tokens}, {repeat}")
    report = Progress("bench lookup", progress)
    report.phase(f"building an engine for {tokens} tokens")
    model = shipped_models()["deepseek_v4_like"]
    finest = min(g.block_size for g in model.groups)
    blocks = tokens // finest + 8
    engine = Engine(model, CoreConfig(device_blocks=blocks, host_blocks=0, backend="numpy"))
    text = np.random.default_rng(0).integers(0, 100_000, tokens + 1)

    report.phase(f"hashing {tokens} tokens")
    hash_s = median_seconds(lambda: engine.prompt(text), repeat=max(repeat // 8, 3),
                            on_run=report.runs("hashing"))
    report.phase("committing the prompt")
    prompt = engine.prompt(text)
    engine.commit(prompt)

    def run_lookup() -> None:
        lookup(engine.core, prompt, level=Level.FULL, checksums=False)

    report.phase(f"lookup with {jit.backend} kernels")
    lookup_s = median_seconds(run_lookup, repeat=repeat,
                              on_run=report.runs(f"lookup with {jit.backend} kernels"))
    # The same lookup with the kernels' NumPy twins (what runs where numba is missing).
    report.phase("lookup with numpy kernels")
    with jit.using(False):
        numpy_s = median_seconds(run_lookup, repeat=repeat,
                                 on_run=report.runs("lookup with numpy kernels"))
    report.phase("lookup with data checksums")
    with_checksums_s = median_seconds(
        lambda: lookup(engine.core, prompt, level=Level.FULL), repeat=max(repeat // 8, 3),
        on_run=report.runs("lookup with data checksums"))
    verdict = lookup(engine.core, prompt, level=Level.FULL)

    # The hit-only baseline: a dict of 128-bit key -> block id per group, as a dict-based
    # cache keeps them; it collects the block ids (an engine needs them to read) and stops at
    # the first miss, checking nothing else.
    report.phase("building the hit-only baseline's dicts")
    tables = {group.name: dict(group.hash_map.items()) for group in engine.core.groups.values()}
    chains = {
        group.name: [int(h) << 64 | int(low) for h, low in zip(
            *(w.tolist() for w in prompt.words(group.decl.block_size)), strict=True)]
        for group in engine.core.groups.values()
    }

    sizes = {name: engine.core.group(name).decl.block_size for name in chains}

    def baseline() -> int:
        hit = tokens
        for name, chain in chains.items():
            get = tables[name].get
            found: list[int] = []
            for key in chain:
                block = get(key)
                if block is None:
                    break
                found.append(block)
            hit = min(hit, len(found) * sizes[name])
        return hit

    report.phase("hit-only baseline walk")
    baseline_s = median_seconds(baseline, repeat=repeat, on_run=report.runs("hit-only baseline"))
    return {
        "model": model.name,
        "tokens": tokens,
        "usable_tokens": verdict.usable_tokens,
        "kernels": jit.backend,
        "lookup_ms_median": lookup_s * 1e3,
        "lookup_numpy_ms_median": numpy_s * 1e3,
        "lookup_with_checksums_ms_median": with_checksums_s * 1e3,
        "baseline_ms_median": baseline_s * 1e3,
        "ratio_baseline_vs_lookup": baseline_s / lookup_s,
        "hash_ms_median": hash_s * 1e3,
    }
