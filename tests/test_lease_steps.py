"""tools/lease_steps.py: the steps of a lease right after each lookup, timed and reported."""

from __future__ import annotations

import pytest

from tests.tool_modules import load_tool

pytest.importorskip("prometheus_client")


def test_the_steps_are_timed_and_add_up() -> None:
    """A short run reports every step's minimum and median; the whole is at least each step,
    and the lease covered the prompt's usable blocks."""
    report = load_tool("lease_steps").lease_steps(tokens=2049, rounds=5)
    assert report["usable_tokens"] == 2048
    assert report["blocks_leased"] > 0
    for step in ("take", "validate", "release"):
        # Every round's whole is at least each of its steps.
        assert 0 < report[f"{step}_us_min"] <= report["all_us_min"]
        assert report[f"{step}_us_min"] <= report[f"{step}_us_median"]
    assert report["observe_lookup_us_min"] > 0
