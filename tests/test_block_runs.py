"""tools/block_runs.py: a steady serving load keeps each prompt's blocks in few ascending runs
(the free-id stack hands freed blocks back in order, never reversed)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.tool_modules import load_tool


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("block_runs")


def test_a_load_that_evicts_for_room_keeps_prompts_in_few_ascending_runs(
        tool: ModuleType) -> None:
    """Every commit here evicts other prompts' blocks for room. No two neighbouring blocks of a
    lease step down by one (a freed batch handed back reversed: before the fix, most steps
    did), and a lease's blocks lie in a few runs, not one per block."""
    report = tool.block_runs(blocks=1200, requests=25)
    group = report["groups"]["attn"]
    assert group["leases"] == 25
    assert group["descending_steps"] == 0
    assert group["runs_median"] <= 32  # leases of 128 to 1 006 blocks
