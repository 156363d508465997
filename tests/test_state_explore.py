"""The bounded exhaustive check of the real core: clean on the shipped models, finds seeded bugs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvfsm.spec import shipped_models
from kvfsm.state import CoreConfig, GroupState
from kvfsm.state._explore import configuration_key, explore_core

TINY = CoreConfig(device_blocks=2, host_blocks=1, max_restores_in_flight=1, backend="numpy")
ONE_EACH = CoreConfig(device_blocks=1, host_blocks=1, max_restores_in_flight=1, backend="numpy")
TIERS_DOC = Path(__file__).resolve().parents[1] / "docs" / "tiers.md"


def test_dense_model_is_explored_completely_and_clean() -> None:
    """Every configuration of a 2-device-slot, 1-host-slot dense pool satisfies every core
    invariant, and every refused operation leaves the configuration exactly as it was."""
    result = explore_core(shipped_models()["dense"], TINY)
    assert result.complete
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.configurations > 500
    assert result.refusals > result.transitions  # most operations are illegal somewhere


@pytest.mark.parametrize("model", ["deepseek_v4_like", "qwen3_next_like", "gpt_oss_like"])
def test_hybrid_models_are_clean_to_a_bound(model: str) -> None:
    """Multi-group models explode combinatorially; the first few hundred configurations (all
    of the shortest operation sequences, breadth first) must be clean."""
    result = explore_core(shipped_models()[model], ONE_EACH, max_configurations=250)
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.configurations > 250


def test_a_hash_map_that_forgets_to_drop_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def keep_hash(self: GroupState, ids: np.ndarray, call: object, row: object) -> None:
        return None

    monkeypatch.setattr(GroupState, "_drop_hash", keep_hash)
    result = explore_core(shipped_models()["dense"], TINY, max_configurations=200)
    (violation,) = [v for v in result.violations if "hash_complete" in v.problem]
    assert "reachable by hash in state 'free'" in violation.problem
    assert violation.trace[-1].endswith(": evict") or violation.trace[-1].endswith(": invalidate")
    assert violation.trace[0] == "attn: allocate"


def test_a_slot_leak_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def forget(self: GroupState, ids: np.ndarray, call: object, row: object) -> None:
        self._blocks.slot[call.tier][ids] = -1  # type: ignore[attr-defined]

    monkeypatch.setattr(GroupState, "_return_slot", forget)
    result = explore_core(shipped_models()["dense"], TINY, max_configurations=50)
    assert any("slot_owned_once" in v.problem for v in result.violations)


def test_configuration_key_ignores_slot_numbers_and_epochs() -> None:
    from kvfsm.state import StateCore

    model = shipped_models()["dense"]
    first, second = StateCore(model, TINY), StateCore(model, TINY)
    for core in (first, second):
        ids = core.allocate("attn", [0], [1], [2])
        core.fire("attn", ids, "write_begin")
        core.fire("attn", ids, "write_fail")
    second.fire("attn", [0], "write_begin")
    second.fire("attn", [0], "write_fail")  # two more epoch bumps, same configuration
    assert configuration_key(first) == configuration_key(second)


def test_stored_tiers_are_explored_completely_and_clean() -> None:
    """Every configuration of one device slot, one disk copy and one remote copy of a dense
    group, driven by allocation, discovery, every event and good loads by the data path,
    satisfies every core invariant: copies found on disk or remote, restored (device_disk,
    device_remote), evicted back to their copy, invalidated, failed."""
    stored = CoreConfig(device_blocks=1, disk_blocks=1, remote_blocks=1,
                        max_restores_in_flight=1, backend="numpy")
    result = explore_core(shipped_models()["dense"], stored, max_configurations=5_000)
    assert result.complete
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.configurations > 500
    # docs/tiers.md quotes this run's count.
    quoted = re.search(r"one device slot, one disk and one remote copy completely \((\d+) "
                       r"configurations", " ".join(TIERS_DOC.read_text(encoding="utf-8").split()))
    assert quoted is not None and int(quoted.group(1)) == result.configurations
