"""Time a lookup whose prompt is only half cached (its first half committed, the second
new) beside a full-hit lookup of that half, at several prompt lengths: what a partial hit
costs over a full one (its reasons). Prints, per length, the least and the median ms of each.

Usage: ``python tools/bench_partial.py [--config full|full_swa] [--lengths 1024,16384,...]
[--metrics]``. With ``--metrics`` the engine carries Prometheus metrics (``kvfsm[metrics]``),
whose shortfall counter reads every verdict's reasons: a partial hit is then explained at the
lookup, and the figures show what that costs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_bench import kvfsm_model, pool_blocks

from kvfsm import CoreConfig, Engine
from kvfsm.lookup import Level
from kvfsm.obs import EngineMetrics

#: Timed rounds per figure.
ROUNDS = 7
#: Calls per round: about this many tokens looked up per round.
TOKENS_PER_ROUND = 20_000


def _ms(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """Least and median ms per call over :data:`ROUNDS` rounds of ``calls`` calls."""
    per_call = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - start) / calls * 1e3)
    return min(per_call), statistics.median(per_call)


def bench_partial(config: str, lengths: list[int], metrics: bool = False
                  ) -> list[dict[str, float | int]]:
    """Per prompt length, the partial-hit and full-hit lookups' least and median ms, and the
    partial hit's usable tokens (the cached half); ``metrics``: with Prometheus metrics
    attached to the engine."""
    rows: list[dict[str, float | int]] = []
    for tokens in lengths:
        text = np.arange(tokens, dtype=np.int64) * 7 + 3
        engine = Engine(kvfsm_model(config), CoreConfig(
            device_blocks=pool_blocks(tokens, 1), host_blocks=0, backend="numpy"),
            metrics=_metrics() if metrics else None)
        half = engine.prompt(text[: tokens // 2])
        engine.commit(half)
        prompt = engine.prompt(text)
        engine.lookup(prompt, level=Level.FULL)  # checksums verified once
        calls = max(3, TOKENS_PER_ROUND // tokens)
        partial = _ms(functools.partial(engine.lookup, prompt, level=Level.STANDARD), calls)
        full = _ms(functools.partial(engine.lookup, half, level=Level.STANDARD), calls)
        usable = engine.lookup(prompt, level=Level.STANDARD).usable_tokens
        rows.append({"tokens": tokens, "usable_tokens": usable, "partial_ms_min": partial[0],
                     "partial_ms_median": partial[1], "full_hit_ms_min": full[0],
                     "full_hit_ms_median": full[1]})
        engine.close()
    return rows


def _metrics() -> EngineMetrics:
    """Metrics in a registry of their own (prometheus-client is an optional dependency)."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        sys.exit('bench_partial: --metrics needs prometheus-client (pip install "kvfsm[metrics]")')
    return EngineMetrics(CollectorRegistry())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="full", choices=("full", "full_swa"))
    parser.add_argument("--lengths", default="1024,16384,131072",
                        type=lambda text: [int(each) for each in text.split(",")])
    parser.add_argument("--metrics", action="store_true",
                        help="attach Prometheus metrics to the engine")
    args = parser.parse_args()
    for row in bench_partial(args.config, args.lengths, args.metrics):
        print(f"{row['tokens']:>7} tokens: partial hit {row['partial_ms_min']:.4f} / "
              f"{row['partial_ms_median']:.4f} ms, full hit of the half "
              f"{row['full_hit_ms_min']:.4f} / {row['full_hit_ms_median']:.4f} ms (min / median)")


if __name__ == "__main__":
    main()
