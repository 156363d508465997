"""tools/ab_bench.py: two checkouts' workers timed in alternated bursts, compared per burst."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tool_modules import TOOLS, load_tool

REPO = TOOLS.parent


def test_a_lookup_compared_with_itself_reports_both_sides_and_the_ratios() -> None:
    """The same checkout on both sides: each side's median lookup, and per-burst ratios after /
    before whose quartiles are ordered and near 1 (the same code)."""
    report = load_tool("ab_bench").compare(REPO, REPO, path="lookup", model="dense",
                                           tokens=512, bursts=4, per_burst=20)
    assert report["before_lookup_us"] > 0 and report["after_lookup_us"] > 0
    low, middle, high = report["ratio_after_before_quartiles"]
    assert 0 < low <= middle <= high
    assert 0.2 < middle < 5  # the same code: no side is five times the other
    assert report["before_usable_tokens"] == report["after_usable_tokens"] == 512


def test_the_lease_overhead_with_metrics_and_log_is_reported_per_side() -> None:
    """``lease --observed``: each side's overhead of a leased, validated and released lookup
    with metrics and an event log over a plain one, in µs and as a share, and the per-burst
    differences."""
    pytest.importorskip("prometheus_client")
    report = load_tool("ab_bench").compare(REPO, REPO, path="lease", observed=True,
                                           model="deepseek_v4_like", tokens=1025, bursts=2,
                                           per_burst=10)
    for side in ("before", "after"):
        assert report[f"{side}_overhead_us"] > 0
        assert report[f"{side}_overhead_share"] > 0
    low, middle, high = report["overhead_after_minus_before_us_quartiles"]
    assert low <= middle <= high
    assert report["before_usable_tokens"] == report["after_usable_tokens"] == 1024


def test_a_checkout_without_kvfsm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="holds no kvfsm package"):
        load_tool("ab_bench").compare(tmp_path, REPO)
    with pytest.raises(SystemExit, match="path must be one of"):
        load_tool("ab_bench").compare(REPO, REPO, path="evict")
    with pytest.raises(SystemExit, match="cached fraction"):
        load_tool("ab_bench").compare(REPO, REPO, cached=0.0)


def test_partial_hits_are_compared_with_part_of_the_prompt_committed() -> None:
    """``--cached-fraction 0.5``: each side's workers commit half the prompt, so every lookup
    compared is a partial hit (a half-cached prompt of 512 tokens: its explanation is made
    when first read, the general path of the lookup)."""
    tool = load_tool("ab_bench")
    report = tool.compare(REPO, REPO, path="lookup", model="dense", tokens=512, bursts=2,
                          per_burst=10, cached=0.5)
    assert report["cached_fraction"] == 0.5
    assert report["before_lookup_us"] > 0 and report["after_lookup_us"] > 0
    for side in ("before", "after"):
        assert 0 < report[f"{side}_usable_tokens"] <= 256
