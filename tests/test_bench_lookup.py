"""``kvfsm bench lookup`` reports its figures (never asserting times)."""

from __future__ import annotations

import json

import pytest

from kvfsm.bench import bench_lookup
from kvfsm.cli import main

KEYS = ("tokens", "lookup_ms_median", "baseline_ms_median", "ratio_baseline_vs_lookup",
        "hash_ms_median")


def test_bench_lookup_figures() -> None:
    figures = bench_lookup(tokens=4096, repeat=3)
    for key in KEYS:
        assert figures[key] > 0, key
    assert figures["lookup_numpy_ms_median"] > 0
    assert figures["kernels"] in ("numba", "numpy")
    assert figures["usable_tokens"] == 4096  # the committed prompt is reusable up to its end
    assert figures["ratio_baseline_vs_lookup"] == pytest.approx(
        figures["baseline_ms_median"] / figures["lookup_ms_median"])


def test_cli_bench_lookup_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lookup", "--json", "--tokens", "2048"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(KEYS) <= set(figures)
