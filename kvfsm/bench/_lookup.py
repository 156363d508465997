"""``kvfsm bench lookup``: the verdict of a long prompt vs a hit-only per-block walk, one run."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm._jit import settings as jit
from kvfsm.bench._pools import bench_pool_sizes, check_pool_sizes
from kvfsm.bench._timing import Progress, ProgressFn, median_seconds
from kvfsm.lookup import Level, lookup
from kvfsm.obs import EngineMetrics, EventLog
from kvfsm.spec import ModelDecl, shipped_models
from kvfsm.state import CoreConfig, Prompt

#: Prompt lengths of the ``lengths`` table: the short prompts most requests have up to the
#: longest contexts served.
LENGTHS = (1_024, 4_096, 16_384, 65_536, 131_072, 524_288)
#: Pool sizes (blocks per group) of the ``pool_sizes`` table: 10 k to 1 M.
POOL_SIZES = (10_000, 100_000, 1_000_000)
#: Prompt tokens of the pool-size table (fits the smallest pool; long enough to matter).
POOL_TOKENS = 16_384
#: Rounds of the observability measurement (each times four paths once, about a millisecond
#: at 131 072 tokens): its figure is a difference of a few percent between two medians, and
#: on a shared machine 41 rounds scattered it by as much as itself; 801 hold it within about
#: a percent.
OBSERVED_ROUNDS = 801


def bench_lookup(
    *, tokens: int = 131_072, repeat: int = 41, progress: ProgressFn | None = None,
    lengths: Sequence[int] = (), pool_sizes: Sequence[int] = (),
    observed_rounds: int = OBSERVED_ROUNDS,
) -> dict[str, object]:
    """Median lookup latency over the DeepSeek-style model (every group, every layer at FULL
    level minus data checksums; with checksums, and without compiled kernels, reported too),
    against a baseline that walks each group's blocks one by one in
    Python checking only the hash, like a hit-only cache. ``progress`` takes a line per phase
    and, on long measurements, run counts (nothing is reported without it). The cost of
    metrics, event log and leases is measured over ``observed_rounds`` rounds."""
    if tokens < 1 or repeat < 1 or observed_rounds < 1:
        raise KvfsmError(f"bench lookup: tokens, repeat and observed_rounds must be >= 1, got "
                         f"{tokens}, {repeat}, {observed_rounds}")
    # Every table's arguments checked before the first (long) measurement starts.
    bad_lengths = [length for length in lengths if int(length) < 1]
    if bad_lengths:
        raise KvfsmError(f"bench lookup: lengths must be >= 1, got {bad_lengths}")
    if pool_sizes:
        check_pool_sizes(pool_sizes, POOL_TOKENS)
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
    # The same lookup uncompiled: the kernels' Python source (what runs without numba).
    report.phase("lookup without compiled kernels")
    with jit.using(False):
        numpy_s = median_seconds(run_lookup, repeat=max(repeat // 8, 3),
                                 on_run=report.runs("lookup without compiled kernels"))
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
    report.phase("engine lookups with metrics, event log and leases on vs off")
    observed = _observed(model, blocks, text, observed_rounds, report)
    return {
        "model": model.name,
        "tokens": tokens,
        "usable_tokens": verdict.usable_tokens,
        "kernels": jit.backend,
        "lookup_ms_median": lookup_s * 1e3,
        "lookup_numpy_ms_median": numpy_s * 1e3,
        # How much slower the lookup is without compiled kernels (numba missing or off).
        "numpy_slowdown": numpy_s / lookup_s,
        "lookup_with_checksums_ms_median": with_checksums_s * 1e3,
        "baseline_ms_median": baseline_s * 1e3,
        "ratio_baseline_vs_lookup": baseline_s / lookup_s,
        "hash_ms_median": hash_s * 1e3,
        **observed,
        **({"lengths": _lengths(model, lengths, repeat, report)} if lengths else {}),
        **({"pool_sizes": bench_pool_sizes(pool_sizes=pool_sizes, tokens=POOL_TOKENS,
                                           progress=progress)} if pool_sizes else {}),
    }


def _lengths(model: ModelDecl, lengths: Sequence[int], repeat: int, report: Progress
             ) -> dict[str, dict[str, float | int]]:
    """Per prompt length: the median lookup (every group, every check, FULL minus data
    checksums, as the headline figure) of a committed prompt, the hashing of it, and the
    same lookup of a prompt sharing only its first half (a partial hit: usable half, the
    rest explained)."""
    table: dict[str, dict[str, float | int]] = {}
    finest = min(g.block_size for g in model.groups)
    for tokens in sorted({int(length) for length in lengths}):
        report.phase(f"lookup at {tokens} tokens")
        engine = Engine(model, CoreConfig(device_blocks=tokens // finest + 8, host_blocks=0,
                                          backend="numpy"))
        text = np.random.default_rng(tokens).integers(0, 100_000, tokens + 1)
        prompt = engine.prompt(text)
        engine.commit(prompt)
        runs = max(repeat, 3)

        def verdict(engine: Engine = engine, prompt: Prompt = prompt) -> None:
            lookup(engine.core, prompt, level=Level.FULL, checksums=False)

        def hashing(engine: Engine = engine, text: NDArray[np.int64] = text) -> None:
            engine.prompt(text)

        # The committed prompt's first half, then tokens it does not have.
        other = np.random.default_rng(tokens + 1).integers(0, 100_000, text.size)
        other[: text.size // 2] = text[: text.size // 2]
        half = engine.prompt(other)

        def partial(engine: Engine = engine, prompt: Prompt = half) -> None:
            lookup(engine.core, prompt, level=Level.FULL, checksums=False)

        lookup_s = median_seconds(verdict, repeat=runs)
        partial_s = median_seconds(partial, repeat=runs)
        hash_s = median_seconds(hashing, repeat=max(runs // 8, 3))
        usable = lookup(engine.core, prompt, level=Level.FULL, checksums=False).usable_tokens
        table[str(tokens)] = {
            "lookup_ms_median": lookup_s * 1e3, "hash_ms_median": hash_s * 1e3,
            "usable_tokens": usable, "us_per_1k_tokens": lookup_s * 1e6 / (tokens / 1024),
            "partial_lookup_ms_median": partial_s * 1e3,
            "partial_usable_tokens": lookup(engine.core, half, level=Level.FULL,
                                            checksums=False).usable_tokens}
        engine.close()
    return table


def _observed(model: ModelDecl, blocks: int, text: NDArray[np.int64], repeat: int,
              report: Progress) -> dict[str, float | str | None]:
    """``Engine.lookup`` (STANDARD level: the data checksums were verified by a first FULL
    lookup) of one engine holding the prompt, with Prometheus metrics and a JSONL event log
    attached or not (detached between runs, outside the timing): each lookup alone, plain
    and observed, and leased: the lookup and a lease of its verdict in one step
    (``Engine.lookup_and_lease``), validated and released (what a serving step does before
    the kernel reads). The lease's steps are timed on a fourth path that takes them apart
    (``Engine.lookup``, then ``Engine.lease``, ``validate``, ``release``).

    One engine, so every path reads the same arrays: two engines holding the same prompt
    differed by a few percent on their own (where their arrays lay), as much as the figure
    measured. Each round runs the four in an order drawn anew (seeded), so on average every
    path follows every other alike (a path right after a lease finds the lease's code and
    data in cache); medians."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        return dict.fromkeys(_OBSERVED_KEYS, None) | {
            "observed_skipped": 'prometheus-client is not installed (pip install "kvfsm[metrics]")'}
    config = CoreConfig(device_blocks=blocks, host_blocks=0, backend="numpy")
    metrics = EngineMetrics(CollectorRegistry())
    with tempfile.TemporaryDirectory(prefix="kvfsm-bench-lookup-") as root, \
            EventLog(Path(root) / "events.jsonl") as log:
        engine = Engine(model, config, metrics=metrics, event_log=log)
        prompt = engine.prompt(text)
        engine.commit(prompt)
        engine.lookup(prompt, level=Level.FULL)  # checksums verified: STANDARD skips them
        observers = (log, metrics)

        def observe(on: bool) -> None:
            """Metrics and log attached (as the engine was made) or detached."""
            if (engine.metrics is not None) == on:
                return
            for observer in observers:
                (engine.core.add_observer if on else engine.core.remove_observer)(observer)
            engine.metrics = metrics if on else None

        def lookup() -> None:
            engine.lookup(prompt, level=Level.STANDARD)

        def leased() -> None:
            _, lease = engine.lookup_and_lease(prompt, level=Level.STANDARD)
            try:
                lease.validate()
            finally:
                lease.release()

        # The lease's steps, each timed on the path that takes them apart (where its cost
        # goes).
        steps: dict[str, list[float]] = {"take": [], "validate": [], "release": []}

        def stepped() -> None:
            verdict = engine.lookup(prompt, level=Level.STANDARD)
            start = time.perf_counter()
            lease = engine.lease(verdict, prompt)
            taken = time.perf_counter()
            try:
                lease.validate()
                validated = time.perf_counter()
            finally:
                lease.release()
            released = time.perf_counter()
            steps["take"].append(taken - start)
            steps["validate"].append(validated - taken)
            steps["release"].append(released - validated)

        runs: dict[str, list[float]] = {"off": [], "on": [], "leased": [], "stepped": []}
        # Each path: its run and whether metrics and log are attached for it.
        paths = (("off", lookup, False), ("on", lookup, True), ("leased", leased, True),
                 ("stepped", stepped, True))
        for _, run, on in paths:
            observe(on)
            run()
        # The log's batched writes fall on one call in about a thousand records, so the
        # medians leave them out: measured on their own (seconds writing per record written,
        # times the records of one leased lookup) and added in one more key.
        observe(True)
        records_before = log.records
        leased()
        records_per_leased = log.records - records_before
        log.flush()
        written_before, records_before = log.write_seconds, log.records
        order = np.random.default_rng(0)
        tell = report.runs("observed lookups")
        for done in range(1, repeat + 1):
            for at in order.permutation(len(paths)).tolist():
                name, run, on = paths[at]
                observe(on)
                start = time.perf_counter()
                run()
                runs[name].append(time.perf_counter() - start)
            tell(done, repeat)
        observe(True)
        log.flush()
        written = log.records - records_before
        log_write_s = (log.write_seconds - written_before) / written * records_per_leased \
            if written else 0.0
        engine.close()
    off_s, on_s, leased_s, stepped_s = (statistics.median(runs[name])
                                        for name in ("off", "on", "leased", "stepped"))
    # Each round's observed path against the plain one of the same round (run within a
    # millisecond of each other): a busy spell slows both, so their difference moves less
    # than either's median.
    paired_s = statistics.median(leased - off for leased, off in
                                 zip(runs["leased"], runs["off"], strict=True))
    return {
        "observed_rounds": repeat,
        "lookup_ms_median_engine": off_s * 1e3,
        "lookup_ms_median_metrics_log": on_s * 1e3,
        "lookup_ms_median_observed": leased_s * 1e3,
        "metrics_log_overhead": on_s / off_s - 1,
        "observability_overhead": leased_s / off_s - 1,
        # The event log's batched writes, per leased lookup (what the medians leave out),
        # and the overhead with them added.
        "log_write_ms_per_observed_lookup": log_write_s * 1e3,
        "observability_overhead_with_log_writes": (leased_s + log_write_s) / off_s - 1,
        # What the lease itself adds (take, validate, release), from the same medians.
        "lease_ms_median": (leased_s - on_s) * 1e3,
        # The same path with the lookup and the lease taken in two calls.
        "lookup_ms_median_stepped": stepped_s * 1e3,
        "observability_overhead_stepped": stepped_s / off_s - 1,
        # Each step of the lease, timed on that path (right after its lookup).
        **{f"lease_{step}_ms_median": statistics.median(times) * 1e3
           for step, times in steps.items()},
        # The same from minima: on a shared machine busy spells move medians by more than a
        # change of a few percent, and the least of many runs moves least.
        "lookup_ms_min_engine": min(runs["off"]) * 1e3,
        "lookup_ms_min_observed": min(runs["leased"]) * 1e3,
        "observability_overhead_of_minima": min(runs["leased"]) / min(runs["off"]) - 1,
        "observed_minus_engine_ms_paired": paired_s * 1e3,
        "observability_overhead_paired": paired_s / off_s,
        **{f"lease_{step}_ms_min": min(times) * 1e3 for step, times in steps.items()},
    }


_OBSERVED_KEYS = ("observed_rounds", "lookup_ms_median_engine", "lookup_ms_median_metrics_log",
                  "lookup_ms_median_observed", "metrics_log_overhead", "observability_overhead",
                  "log_write_ms_per_observed_lookup", "observability_overhead_with_log_writes",
                  "lease_ms_median", "lookup_ms_median_stepped",
                  "observability_overhead_stepped", "lease_take_ms_median",
                  "lease_validate_ms_median",
                  "lease_release_ms_median", "lookup_ms_min_engine", "lookup_ms_min_observed",
                  "observability_overhead_of_minima", "observed_minus_engine_ms_paired",
                  "observability_overhead_paired", "lease_take_ms_min",
                  "lease_validate_ms_min", "lease_release_ms_min")
