"""Time prompt hashing (block sizes 16 and 64 together, as the deepseek_v4_like model keeps
both) against a per-block SHA-256 chain hashed the way vLLM 0.33 does it by default, in one run,
and print one JSON object.

Usage: ``python tools/bench_hashing.py [--tokens N] [--repeat R] [--vllm-python PYTHON]``.

The cases are timed interleaved (one call of each per round, ``R`` rounds), so load on a shared
machine touches them alike; each reports its best and median milliseconds. ``vllm_style`` is a
re-creation of vLLM's default chain from a Python list: per 16-token block, SHA-256 of the
pickled ``(parent digest, tuple(block), None)``. With ``--vllm-python`` (an interpreter that can
import vLLM) the same chain is also timed with vLLM's own hash function, in that interpreter,
between two halves of the rounds. Compare runs on the same machine only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np

from kvfsm._jit import settings as jit
from kvfsm._jit import warm_up
from kvfsm._tokens import as_token_ids
from kvfsm.state import Prompt, hash_seed

#: Block sizes hashed together (the deepseek_v4_like model's), and vLLM's default block size.
BLOCK_SIZES = (16, 64)
VLLM_BLOCK = 16
#: Token ids are drawn below this (a vocabulary's size), from a fixed seed.
VOCABULARY = 150_000
RANDOM_SEED = 0

#: Run in vLLM's interpreter: vLLM's own chain over the same tokens, printing JSON milliseconds.
_VLLM_SNIPPET = textwrap.dedent("""
    import json, random, statistics, sys, time
    from vllm.utils.hashing import sha256
    n, repeat, block, vocabulary, seed = map(int, sys.argv[1:6])
    rng = random.Random(seed)
    tokens = [rng.randrange(0, vocabulary) for _ in range(n)]
    try:
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
        init_none_hash(sha256)
        source = "vllm hash_block_tokens + sha256"
    except ImportError:  # the engine modules need extras; time vLLM's sha256 on the same input
        root = sha256(b"")
        def hash_block_tokens(fn, parent, block_tokens, extra):
            return fn((parent or root, tuple(block_tokens), extra))
        source = "vllm sha256 (hash_block_tokens re-created)"
    def chain():
        parent = None
        for start in range(0, n - n % block, block):
            parent = hash_block_tokens(sha256, parent, tokens[start:start + block], None)
    chain()
    times = []
    for _ in range(repeat):
        start = time.perf_counter(); chain(); times.append(time.perf_counter() - start)
    print(json.dumps({"source": source, "best_ms": min(times) * 1e3,
                      "median_ms": statistics.median(times) * 1e3}))
""")


def vllm_style_chain(tokens: list[int], block: int) -> bytes:
    """vLLM's default block chain, re-created: SHA-256 of each pickled (parent, block, None)."""
    parent = hashlib.sha256(b"").digest()
    for start in range(0, len(tokens) - len(tokens) % block, block):
        payload = pickle.dumps((parent, tuple(tokens[start : start + block]), None),
                               protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(payload).digest()
    return parent


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"best_ms": round(min(seconds) * 1e3, 3),
            "median_ms": round(statistics.median(seconds) * 1e3, 3)}


def _run_vllm(python: str, n_tokens: int, repeat: int) -> dict[str, object]:
    command = [python, "-c", _VLLM_SNIPPET, str(n_tokens), str(repeat), str(VLLM_BLOCK),
               str(VOCABULARY), str(RANDOM_SEED)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    result: dict[str, object] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131_072, help="prompt length")
    parser.add_argument("--repeat", type=int, default=30, help="rounds (one call per case)")
    parser.add_argument("--vllm-python", help="an interpreter that imports vLLM (optional)")
    args = parser.parse_args(argv)
    rng = random.Random(RANDOM_SEED)
    as_list = [rng.randrange(0, VOCABULARY) for _ in range(args.tokens)]
    as_array = np.array(as_list, dtype=np.int64)
    seed = hash_seed("bench", 1)
    strong_seed = hash_seed("bench", 1, hash_function="sha256")
    warm_up()

    def numpy_twin() -> None:
        with jit.using(False):
            Prompt(seed, BLOCK_SIZES, as_list)

    cases: dict[str, Callable[[], object]] = {
        "kvfsm_list": lambda: Prompt(seed, BLOCK_SIZES, as_list),
        "kvfsm_array": lambda: Prompt(seed, BLOCK_SIZES, as_array),
        "list_to_int64_only": lambda: as_token_ids(as_list),
        "kvfsm_list_sha256": lambda: Prompt(strong_seed, BLOCK_SIZES, as_list,
                                            hash_function="sha256"),
        "vllm_style_sha256_list": lambda: vllm_style_chain(as_list, VLLM_BLOCK),
    }
    if jit.available:
        cases["kvfsm_list_without_numba"] = numpy_twin
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run()
    vllm: dict[str, object] | None = None
    for round_number in range(args.repeat):
        if args.vllm_python and round_number == args.repeat // 2:
            vllm = _run_vllm(args.vllm_python, args.tokens, max(args.repeat // 3, 3))
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    report: dict[str, object] = {
        "tokens": args.tokens, "block_sizes": list(BLOCK_SIZES), "rounds": args.repeat,
        "backend": jit.backend,
        **{name: _summary(seconds) for name, seconds in times.items()},
    }
    baseline = statistics.median(times["vllm_style_sha256_list"])
    kvfsm = statistics.median(times["kvfsm_list"])
    report["speedup_vs_vllm_style_median"] = round(baseline / kvfsm, 2)
    if vllm is not None:
        report["vllm"] = vllm
        if isinstance(vllm.get("median_ms"), float):
            report["speedup_vs_vllm_median"] = round(
                float(vllm["median_ms"]) / (kvfsm * 1e3), 2)  # type: ignore[arg-type]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
