"""tools/bench_partial.py: a partial hit's lookup timed beside a full hit's."""

from __future__ import annotations

import pytest

from tests.tool_modules import load_tool


@pytest.mark.parametrize("config", ["full", "full_swa"])
def test_a_partial_hit_is_timed_beside_the_full_hit_of_its_cached_half(config: str) -> None:
    """Each length reports the partial hit (usable: its cached half) and the full hit of that
    half, least at most median."""
    rows = load_tool("bench_partial").bench_partial(config, [512, 1024])
    assert [row["tokens"] for row in rows] == [512, 1024]
    assert [row["usable_tokens"] for row in rows] == [256, 512]
    for row in rows:
        for kind in ("partial", "full_hit"):
            assert 0 < row[f"{kind}_ms_min"] <= row[f"{kind}_ms_median"]


def test_with_metrics_the_same_lookups_are_timed_and_their_shortfalls_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``metrics=True`` gives the engine Prometheus metrics: the same rows, and the metrics
    count the partial hits' shortfalls (what makes each partial hit explain itself)."""
    pytest.importorskip("prometheus_client")
    tool = load_tool("bench_partial")
    made = []
    real = tool._metrics

    def kept() -> object:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(tool, "_metrics", kept)
    rows = tool.bench_partial("full", [512], metrics=True)
    assert [row["usable_tokens"] for row in rows] == [256]
    assert len(made) == 1
    assert b"kvfsm_shortfalls_total{" in made[0].exposition()
