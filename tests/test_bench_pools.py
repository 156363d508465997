"""The pool-size bench runs at tiny sizes and reports every operation at every size."""

from __future__ import annotations

import pytest

from kvfsm._errors import KvfsmError
from kvfsm.bench._pools import OPERATIONS, bench_pool_sizes


def test_bench_reports_every_operation_at_every_pool_size() -> None:
    lines: list[str] = []
    report = bench_pool_sizes(pool_sizes=(600, 300), tokens=2048, repeat=1,
                              progress=lines.append)
    assert report["pool_sizes"] == [300, 600]
    for op in OPERATIONS:
        timings = report[f"{op}_ms"]
        assert isinstance(timings, dict) and set(timings) == {"300", "600"}
        assert all(ms > 0 for ms in timings.values())
        ratio = report[f"{op}_ratio_max_vs_min_pool"]
        assert isinstance(ratio, float) and ratio > 0
    assert lines and all(line.startswith("bench pools: ") for line in lines)


def test_a_pool_too_small_for_the_prompt_is_refused() -> None:
    with pytest.raises(KvfsmError, match="smallest pool"):
        bench_pool_sizes(pool_sizes=(10,), tokens=2048, repeat=1)
