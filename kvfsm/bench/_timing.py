"""Timing helpers: medians of repeated runs, measured in one process so ratios are fair."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(run: Callable[[], object], *, repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``run()`` over ``repeat`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
