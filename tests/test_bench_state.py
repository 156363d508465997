"""``kvfsm bench state``: the figures exist, are positive, and the metadata stays within budget."""

from __future__ import annotations

import json

import pytest

from kvfsm.bench import bench_state
from kvfsm.bench._state import PHASES
from kvfsm.cli import main

BLOCKS = 2000
#: Metadata bytes per block of a group with a device and a host pool: 32 for the per-block
#: arrays, plus one uint16 pin counter per chunk of 64 blocks (leases of long runs; the last
#: chunk may be partial).
METADATA_BUDGET = 32 + 1 / 16

#: Figures every report carries; each is a positive number.
POSITIVE = (
    "metadata_bytes_per_block",
    "hash_bytes_per_block",
    "physical_bytes_per_slot",
    "hash_map_bytes_per_block",
    "payload_bytes",
    "alloc_write_free_per_s",
    "cycle_ms",
    *(f"{phase}_ms" for phase in PHASES),
)


@pytest.fixture(scope="module")
def figures() -> dict[str, float | int | str]:
    return bench_state(blocks=BLOCKS, repeat=1)


def test_figures_exist_and_are_positive(figures: dict[str, float | int | str]) -> None:
    for key in POSITIVE:
        value = figures[key]
        assert isinstance(value, int | float) and value > 0, (key, value)
    assert figures["blocks"] == BLOCKS
    assert isinstance(figures["note"], str) and figures["note"]


def test_metadata_within_budget(figures: dict[str, float | int | str]) -> None:
    assert float(figures["metadata_bytes_per_block"]) <= METADATA_BUDGET, \
        figures["metadata_layout"]
    # 128-bit identities, reported apart from the metadata.
    assert figures["hash_bytes_per_block"] == 16


def test_phases_add_up_to_the_cycle(figures: dict[str, float | int | str]) -> None:
    # Medians of one run each: with repeat=1 the phases are exactly the cycle's parts.
    parts = sum(float(figures[f"{phase}_ms"]) for phase in PHASES)
    assert parts == pytest.approx(float(figures["cycle_ms"]))
    assert 0 <= float(figures["hash_map_share"]) <= 1


def test_refuses_empty_runs() -> None:
    from kvfsm import KvfsmError

    with pytest.raises(KvfsmError, match="blocks and repeat"):
        bench_state(blocks=0)


def test_cli_bench_state_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "state", "--json", "--blocks", str(BLOCKS)]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in POSITIVE:
        assert report[key] > 0, key
    assert report["metadata_bytes_per_block"] <= METADATA_BUDGET
    assert report["blocks"] == BLOCKS


def test_cli_bench_state_reports_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "state", "--json", "--blocks", str(BLOCKS)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["blocks"] == BLOCKS  # progress never reaches stdout
    progress = captured.err.splitlines()
    assert f"bench state: cycle 1/3 of {BLOCKS} blocks..." in progress
    assert all(line.startswith("bench state: ") for line in progress)
    assert main(["bench", "state", "--quiet", "--blocks", str(BLOCKS)]) == 0
    assert capsys.readouterr().err == ""


def test_bench_fsm_refuses_empty_runs() -> None:
    from kvfsm import KvfsmError
    from kvfsm.bench import bench_fsm

    with pytest.raises(KvfsmError, match=r"bench fsm: blocks, .* must be >= 1, got 0, 20000, 2000"):
        bench_fsm(blocks=0)


def test_cli_bench_fsm_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsm", "--blocks", "2000"]) == 0
    assert "batched_per_s" in capsys.readouterr().out


def test_footprint_counts_every_per_block_array() -> None:
    """Every array of a group with one entry per block is in the metadata figure (or is the
    hash, reported apart), so a new field cannot slip past the budget unseen."""
    import numpy as np

    from kvfsm.bench._state import logical_arrays
    from kvfsm.spec import shipped_models
    from kvfsm.state import CoreConfig, StateCore

    core = StateCore(shipped_models()["dense"], CoreConfig(device_blocks=8, host_blocks=8,
                                                           backend="numpy"))
    group = core.group("attn")
    listed = {id(a) for a in logical_arrays(group).values()}
    listed |= {id(group.hash_high), id(group.hash_low)}
    for name, value in vars(group).items():
        if isinstance(value, np.ndarray) and value.shape[:1] == (group.n_blocks,):
            assert id(value) in listed, name
    for tier, slots in group.slot.items():
        assert id(slots) in listed, tier
