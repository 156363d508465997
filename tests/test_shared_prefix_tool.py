"""tools/shared_prefix.py: one run of docs/tiers.md's command over the three tiny models, with one
timed round instead of the page's 15, its JSON's shape, that a restarted engine and a second
engine each restored tokens from the stored tier for every model, lost none and matched
recomputing, and that the page's token and block figures are the run's (they do not depend on
the rounds). Times are reported, never asserted: the page names the keys they come from. The run
starts a Mooncake master: where one cannot run the test skips, except under ``CI=true``, where
it fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvfsm.serve import _stores as stores
from tests.doc_figures import KEY, integers, lookup, numbers, page, section, table
from tests.remote_servers import unavailable
from tests.tool_modules import load_tool

pytest.importorskip("transformers")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DOC = section(page("tiers.md"), "Two engines sharing one store")
#: docs/tiers.md's command, and the same with one timed round.
DOC_COMMAND = re.search(r"`(python -m tools\.shared_prefix [^`]*)`", DOC).group(1)  # type: ignore[union-attr]
ROUNDS = 1
ARGV = re.sub(r"--rounds \d+", f"--rounds {ROUNDS}", DOC_COMMAND).split()[3:]
#: The page's table: a row per model and scenario, in this order.
SCENARIOS = ("restart", "shared")
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
    done = subprocess.run([sys.executable, "-m", "tools.shared_prefix", *ARGV], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "shared prefix: " in done.stderr  # progress on stderr, the report alone on stdout
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def test_the_report_has_every_figure_per_model_and_scenario(report: dict[str, Any],
                                                            tool: ModuleType) -> None:
    assert set(report) == {"settings", "store", "models", "command"}
    assert report["command"] == "python -m tools.shared_prefix " + " ".join(ARGV)
    assert report["settings"]["rounds"] == ROUNDS
    assert list(report["models"]) == list(tool.MODELS)
    for figures in report["models"].values():
        assert set(figures) == {"restart", "shared"}
        for scenario in figures.values():
            assert set(scenario) == SCENARIO_KEYS
            assert set(scenario["ttft"]) == TTFT_KEYS
            ttft = scenario["ttft"]
            assert ttft["rounds"] == ROUNDS and ttft["prompts"] == report["settings"]["documents"]
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


def _columns() -> list[list[str]]:
    """The report keys of each figure column of the page's table (after model and B), as the
    line under the table names them."""
    line = re.search(r"Columns, as the report names them[^:]*: ([^;]*);", " ".join(DOC.split()))
    assert line, "the page does not say which report keys its columns are"
    return [KEY.findall(column) for column in line.group(1).split(", ")]


def _flat(value: Any) -> list[float]:
    return [float(v) for v in (value if isinstance(value, list) else [value])]


def test_the_pages_workload_is_the_runs(report: dict[str, Any]) -> None:
    settings = re.search(r"(\d+) documents of (\d+) tokens, (\d+) questions of (\d+)-(\d+) "
                         r"tokens", " ".join(DOC.split()))
    assert settings, "the page does not give the workload"
    documents, doc_tokens, questions, shortest, longest = map(int, settings.groups())
    ran = report["settings"]
    assert (ran["documents"], ran["doc_tokens"], ran["questions"]) == (documents, doc_tokens,
                                                                       questions)
    assert ran["question_tokens"] == [shortest, longest + 1]  # [first, end)


def test_the_pages_token_figures_are_the_runs(report: dict[str, Any], tool: ModuleType) -> None:
    """Every row of the page's table: the tokens restored (blocks loaded), from the device,
    recomputed and lost are the run's; the times and ratios are under the keys the page
    names, as numbers."""
    rows = table(DOC, "model | B |")
    order = [(model, scenario) for model in tool.MODELS for scenario in SCENARIOS]
    assert len(rows) == len(order)
    columns = _columns()
    for row, (model, scenario) in zip(rows, order, strict=True):
        figures = report["models"][model][scenario]
        assert ("restart" in row[1]) == (scenario == "restart"), row
        for cell, keys in zip(row[2:], columns, strict=True):
            values = [v for key in keys for v in _flat(lookup(figures, key))]
            if all(key.startswith("ttft.") for key in keys):  # timed: varies by run
                assert len(numbers(cell)) == len(values), (row, keys)
            else:
                assert integers(cell) == values, (model, scenario, keys, cell)
    text = " ".join(DOC.split())
    timed = re.search(r"every timed round reused the (\d+) tokens", text)
    loaded = re.search(r"\((\d+) to (\d+) blocks loaded", text)
    assert timed and loaded
    scenarios = [figures[s] for figures in report["models"].values() for s in SCENARIOS]
    assert {s["ttft"]["reused_tokens"] for s in scenarios} == {int(timed.group(1))}
    restarts = [figures["restart"]["restored_blocks"] for figures in report["models"].values()]
    assert (min(restarts), max(restarts)) == tuple(map(int, loaded.groups()))


def test_the_pages_timed_figures_name_keys_of_the_report(report: dict[str, Any]) -> None:
    """Every key the page names from its table on (times, ratios, their parts, the logits'
    difference) is each scenario's, with numbers (``outputs_match``: a truth)."""
    text = DOC[DOC.index("Columns, as the report names them"):]
    for figures in (f[s] for f in report["models"].values() for s in SCENARIOS):
        for key in KEY.findall(text):
            value = lookup(figures, key)
            values = value.values() if isinstance(value, dict) else _flat(value)
            assert value is True or all(isinstance(v, float | int) for v in values), (key, value)


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
