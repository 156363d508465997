"""Time a lease's steps as a server runs them: take, validate and release right after each
lookup (whose long prompt has just pushed the lease's arrays out of the caches), on an engine
with Prometheus metrics and a JSONL event log attached. Prints one JSON object of minima and
medians in microseconds.

Usage: ``python tools/lease_steps.py [--model NAME] [--tokens N] [--rounds R]``.

Minima are what to compare between two commits on a shared machine: run this from each (with
``PYTHONPATH`` at the other's checkout), alternated, a few times each; busy spells move medians
by more than a change of a few microseconds. ``observe_lookup_us_min`` is the metrics' share
of a lookup (``timeit`` minimum).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

from kvfsm import CoreConfig, Engine, EngineMetrics, EventLog, Level, shipped_models

VOCABULARY = 100_000
#: Blocks of headroom in the pool beyond the prompt's.
SPARE_BLOCKS = 8


def lease_steps(model: str = "deepseek_v4_like", tokens: int = 131_072, rounds: int = 600,
                seed: int = 0) -> dict[str, object]:
    """Per step (``take``, ``validate``, ``release``, ``all``), the least and the median
    microseconds over ``rounds`` leases, each right after a STANDARD lookup of one committed
    prompt of ``tokens`` tokens."""
    from prometheus_client import CollectorRegistry

    decl = shipped_models()[model]
    text = np.random.default_rng(seed).integers(0, VOCABULARY, tokens + 1)
    finest = min(group.block_size for group in decl.groups)
    config = CoreConfig(device_blocks=tokens // finest + SPARE_BLOCKS,
                        host_blocks=0, backend="numpy")
    times: dict[str, list[float]] = {"take": [], "validate": [], "release": [], "all": []}
    with tempfile.TemporaryDirectory(prefix="kvfsm-lease-steps-") as root, \
            EventLog(Path(root) / "events.jsonl") as log:
        metrics = EngineMetrics(CollectorRegistry())
        engine = Engine(decl, config, metrics=metrics, event_log=log)
        prompt = engine.prompt(text)
        engine.commit(prompt)
        verdict = engine.lookup(prompt, level=Level.FULL)  # checksums verified once
        for _ in range(rounds):
            verdict = engine.lookup(prompt, level=Level.STANDARD)
            start = time.perf_counter()
            lease = engine.lease(verdict, prompt)
            taken = time.perf_counter()
            lease.validate()
            validated = time.perf_counter()
            lease.release()
            released = time.perf_counter()
            for step, (begin, end) in {"take": (start, taken), "validate": (taken, validated),
                                       "release": (validated, released),
                                       "all": (start, released)}.items():
                times[step].append((end - begin) * 1e6)
        blocks = sum(lease.blocks(group).size for group in lease.groups)
        observe = min(timeit.repeat(lambda: metrics.observe_lookup(verdict), number=2000,
                                    repeat=5)) / 2000 * 1e6
        engine.close()
    return {"model": model, "tokens": tokens, "usable_tokens": verdict.usable_tokens,
            "blocks_leased": blocks, "rounds": rounds,
            **{f"{step}_us_min": min(each) for step, each in times.items()},
            **{f"{step}_us_median": statistics.median(each) for step, each in times.items()},
            "observe_lookup_us_min": observe}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek_v4_like", choices=sorted(shipped_models()))
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--rounds", type=int, default=600)
    args = parser.parse_args()
    if args.tokens < 1 or args.rounds < 1:
        parser.error("--tokens and --rounds must be >= 1")
    print(json.dumps(lease_steps(args.model, args.tokens, args.rounds), indent=1))


if __name__ == "__main__":
    main()
