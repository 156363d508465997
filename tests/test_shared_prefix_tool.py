"""tools/shared_prefix.py: one small run over the three tiny models (one document, two questions,
two timed rounds), its JSON's shape, and that a restarted engine and a second engine each
restored tokens from the stored tier for every model, lost none and matched recomputing. Times
are reported, never asserted. The run starts a Mooncake master: where one cannot run the test
skips, except under ``CI=true``, where it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvfsm.serve import _stores as stores
from tests.remote_servers import unavailable
from tests.tool_modules import load_tool

pytest.importorskip("transformers")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--documents", "1", "--doc-tokens", "48", "--questions", "2", "--rounds", "2"]
SCENARIO_KEYS = {"tier", "prompts", "prompt_tokens", "reused_tokens", "restored_tokens",
                 "device_tokens", "restored_blocks", "recomputed_tokens", "expected_tokens",
                 "lost_tokens", "restored_from", "outputs_match", "max_logit_delta", "a_states",
                 "invariants", "ttft"}
TTFT_KEYS = {"prompts", "rounds", "restored_ms", "restored_parts_ms", "recompute_ms", "ratio",
             "ratio_quartiles", "reused_tokens", "expected_tokens", "max_logit_delta"}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("shared_prefix")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    why = stores.remote_unusable("mooncake")
    if why is not None:
        unavailable(f"mooncake: {why}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "tools.shared_prefix", *SMALL], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "shared prefix: " in done.stderr  # progress on stderr, the report alone on stdout
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def test_the_report_has_every_figure_per_model_and_scenario(report: dict[str, Any],
                                                            tool: ModuleType) -> None:
    assert set(report) == {"settings", "store", "models", "command"}
    assert report["command"] == "python -m tools.shared_prefix " + " ".join(SMALL)
    assert report["settings"]["rounds"] == 2 and report["settings"]["doc_tokens"] == 48
    assert list(report["models"]) == list(tool.MODELS)
    for figures in report["models"].values():
        assert set(figures) == {"restart", "shared"}
        for scenario in figures.values():
            assert set(scenario) == SCENARIO_KEYS
            assert set(scenario["ttft"]) == TTFT_KEYS
            ttft = scenario["ttft"]
            assert ttft["rounds"] == 2 and ttft["prompts"] == 1
            assert set(ttft["restored_parts_ms"]) == {"lookup", "restore", "rebuild", "prefill"}
            assert scenario["prompt_tokens"] == (scenario["reused_tokens"]
                                                 + scenario["recomputed_tokens"])
            assert scenario["reused_tokens"] == (scenario["restored_tokens"]
                                                 + scenario["device_tokens"])


def test_every_model_restores_from_the_stored_tier_and_loses_no_reuse(
        report: dict[str, Any]) -> None:
    for model, figures in report["models"].items():
        for name, tier in (("restart", "disk"), ("shared", "remote")):
            scenario = figures[name]
            assert scenario["restored_tokens"] > 0, (model, name, scenario)
            assert scenario["restored_blocks"] > 0, (model, name, scenario)
            assert scenario["restored_from"] == [tier], (model, name)
            assert scenario["lost_tokens"] == 0, (model, name, scenario)
            assert scenario["outputs_match"] and scenario["invariants"] == [], (model, name)
            ttft = scenario["ttft"]
            assert ttft["reused_tokens"] == ttft["expected_tokens"] > 0, (model, name, ttft)
            assert set(map(tuple, scenario["a_states"].values())) == {(tier,)}, (model, name)


def test_the_workload(tool: ModuleType) -> None:
    work = tool.workload(documents=2, doc_tokens=50, questions=3, new_tokens=4)
    assert [len(work[name]) for name in ("a", "b", "ttft")] == [6, 6, 2]
    prompts = [tokens for requests in work.values() for _, tokens, _ in requests]
    documents = {tuple(tokens[:50]) for tokens in prompts}
    assert len(documents) == 2  # every prompt is one of the two documents and a question
    assert all(54 <= len(tokens) < 90 for tokens in prompts)
    assert len({tuple(tokens) for tokens in prompts}) == len(prompts)  # no prompt twice
    assert [rid for rid, _, _ in work["a"]][:2] == ["a0.0", "a0.1"]  # documents interleaved


@pytest.mark.parametrize("argv", [["--models", "llama"], ["--rounds", "0"],
                                  ["--doc-tokens", "8"]])
def test_bad_arguments_are_refused(tool: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    assert exited.value.code == 2
