"""``kvfsm bench lookup`` reports its figures (never asserting times)."""

from __future__ import annotations

import json

import pytest

from kvfsm import KvfsmError
from kvfsm.bench import bench_lookup
from kvfsm.cli import main

#: The per-length and pool-size tables left out (they build engines up to 1 M blocks).
NO_TABLES = ("--lengths", "none", "--pool-sizes", "none")
KEYS = ("tokens", "lookup_ms_median", "baseline_ms_median", "ratio_baseline_vs_lookup",
        "hash_ms_median", "lookup_ms_median_engine", "lookup_ms_median_metrics_log",
        "lookup_ms_median_observed", "lookup_ms_median_stepped")


def test_bench_lookup_figures() -> None:
    figures = bench_lookup(tokens=4096, repeat=3, observed_rounds=5)
    assert figures["observed_rounds"] == 5
    for key in KEYS:
        assert figures[key] > 0, key
    assert figures["lookup_numpy_ms_median"] > 0
    assert figures["kernels"] in ("numba", "numpy")
    assert figures["usable_tokens"] == 4096  # the committed prompt is reusable up to its end
    assert figures["ratio_baseline_vs_lookup"] == pytest.approx(
        figures["baseline_ms_median"] / figures["lookup_ms_median"])
    assert figures["observability_overhead"] == pytest.approx(
        figures["lookup_ms_median_observed"] / figures["lookup_ms_median_engine"] - 1)
    assert figures["metrics_log_overhead"] == pytest.approx(
        figures["lookup_ms_median_metrics_log"] / figures["lookup_ms_median_engine"] - 1)
    assert figures["log_write_ms_per_observed_lookup"] > 0  # the rounds' reads were written
    assert figures["observability_overhead_with_log_writes"] == pytest.approx(
        (figures["lookup_ms_median_observed"] + figures["log_write_ms_per_observed_lookup"])
        / figures["lookup_ms_median_engine"] - 1)
    assert figures["observability_overhead_stepped"] == pytest.approx(
        figures["lookup_ms_median_stepped"] / figures["lookup_ms_median_engine"] - 1)
    assert figures["lease_ms_median"] == pytest.approx(
        figures["lookup_ms_median_observed"] - figures["lookup_ms_median_metrics_log"])
    for step in ("take", "validate", "release"):
        assert figures[f"lease_{step}_ms_median"] > 0, step
        assert 0 < figures[f"lease_{step}_ms_min"] <= figures[f"lease_{step}_ms_median"], step
    assert figures["observability_overhead_of_minima"] == pytest.approx(
        figures["lookup_ms_min_observed"] / figures["lookup_ms_min_engine"] - 1)
    assert figures["lookup_ms_min_engine"] <= figures["lookup_ms_median_engine"]
    assert figures["observability_overhead_paired"] == pytest.approx(
        figures["observed_minus_engine_ms_paired"] / figures["lookup_ms_median_engine"])


def test_bench_lookup_without_prometheus_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    figures = bench_lookup(tokens=1024, repeat=1, observed_rounds=1)
    assert figures["lookup_ms_median_observed"] is None
    assert figures["observability_overhead_of_minima"] is None
    assert figures["observability_overhead_paired"] is None
    assert figures["observability_overhead_stepped"] is None
    assert figures["observability_overhead_with_log_writes"] is None
    assert "prometheus-client" in str(figures["observed_skipped"])


def test_cli_bench_lookup_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lookup", "--json", "--tokens", "2048", *NO_TABLES]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(KEYS) <= set(figures)


def test_cli_bench_lookup_reports_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lookup", "--json", "--tokens", "2048", *NO_TABLES]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == 2048  # progress never reaches stdout
    progress = captured.err.splitlines()
    assert "bench lookup: hashing 2048 tokens..." in progress
    assert all(line.startswith("bench lookup: ") for line in progress)
    assert main(["bench", "lookup", "--quiet", "--tokens", "2048", *NO_TABLES]) == 0
    assert capsys.readouterr().err == ""


def test_bench_lookup_refuses_empty_prompts() -> None:
    with pytest.raises(KvfsmError, match=r"bench lookup: tokens, repeat and observed_rounds "
                       r"must be >= 1, got 0, 3, 801"):
        bench_lookup(tokens=0, repeat=3)
    with pytest.raises(KvfsmError, match=r"must be >= 1, got 1024, 3, 0"):
        bench_lookup(tokens=1024, repeat=3, observed_rounds=0)


def test_bench_lookup_counts_runs_of_long_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.bench import _timing

    monkeypatch.setattr(_timing, "RUN_LINE_INTERVAL_S", 0.0)  # every measurement counts as long
    lines: list[str] = []
    bench_lookup(tokens=1024, repeat=3, progress=lines.append, observed_rounds=3)
    assert "bench lookup: hit-only baseline: 3/3 runs" in lines
    assert "bench lookup: hashing: 2/3 runs" in lines


def test_bench_lookup_tables_per_length_and_pool_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``lengths``: per prompt length the lookup's median and cost per 1 k tokens;
    ``pool_sizes``: per operation its cost at each pool size and the ratio largest/smallest."""
    assert main(["bench", "lookup", "--json", "--quiet", "--tokens", "1024", "--lengths",
                 "1024,2048", "--pool-sizes", "2000,4000"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures["lengths"]) == {"1024", "2048"}
    for row in figures["lengths"].values():
        assert row["lookup_ms_median"] > 0 and row["usable_tokens"] > 0
        # The partial hit: a prompt sharing the committed one's first half uses at most it.
        assert row["partial_lookup_ms_median"] > 0
        assert 0 <= row["partial_usable_tokens"] <= row["usable_tokens"] // 2 + 1
    pools = figures["pool_sizes"]
    assert pools["pool_sizes"] == [2000, 4000]
    assert pools["lookup_ratio_max_vs_min_pool"] > 0


@pytest.mark.parametrize("text", ["0", "1,x", ""])
def test_cli_bench_lookup_refuses_bad_sizes(text: str) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "lookup", "--lengths", text])


@pytest.mark.parametrize(("lengths", "pool_sizes", "match"), [
    ((1024, 0), (), "lengths must be >= 1"),
    ((), (5,), "smallest pool holds 5"),
])
def test_bad_table_arguments_are_refused_before_anything_is_measured(
        lengths: tuple[int, ...], pool_sizes: tuple[int, ...], match: str) -> None:
    """A length below 1 or a pool too small for the pool table's prompt is a KvfsmError
    before the first phase starts, not after minutes of measuring the rest."""
    phases: list[str] = []
    with pytest.raises(KvfsmError, match=match):
        bench_lookup(tokens=4096, repeat=1, observed_rounds=1, lengths=lengths,
                     pool_sizes=pool_sizes, progress=phases.append)
    assert phases == []
