"""Evicting one history block while N sparse-index blocks point into the history: the cost of
finding its dependents should be the references to it, whatever N (one run, medians).

    python tools/bench_evict.py 9000 1000000
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from kvfsm.spec import parse_model
from kvfsm.state import CoreConfig, StateCore

#: Index blocks (16 tokens) per history block (64 tokens), and references per index block: each
#: history block is then referenced by TOP_K * ROWS_PER_HISTORY_BLOCK = 32 index rows.
ROWS_PER_HISTORY_BLOCK = 4
TOP_K = 8
RUNS = 9

MODEL = """
[model]
name = "evict_bench"
description = "compressed history and a sparse index with tiny payloads"
layout_version = 1

[[groups]]
name = "history"
kind = "compressed"
lifecycle = "compressed"
block_size = 64
shape = [64, 1]
dtype = "uint8"
sub_blocks = 4
[groups.layout]
dim_order = ["block", "token", "latent"]
alignment = 64
padding = 0

[[groups]]
name = "index"
kind = "sparse_index"
lifecycle = "sparse_index"
block_size = 16
shape = [1, 8, 2]
dtype = "int32"
target_group = "history"
top_k = 8
[groups.layout]
dim_order = ["block", "token", "topk", "ref"]
alignment = 64
padding = 0
"""


def _written(core: StateCore, group: str, count: int, rng: np.random.Generator) -> np.ndarray:
    words = rng.integers(0, 2**63, (2, count), dtype=np.uint64)
    ids = core.allocate(group, np.arange(count), words[0], words[1])
    core.fire(group, ids, "write_begin")
    return ids


def evict_ms(index_blocks: int) -> float:
    """Median ms to evict one history block with ``index_blocks`` index blocks in the core."""
    history_blocks = max(index_blocks // ROWS_PER_HISTORY_BLOCK, 64)
    core = StateCore(parse_model(MODEL), CoreConfig(
        device_blocks=history_blocks, per_group={"index": {"device": index_blocks}},
        backend="numpy"))
    rng = np.random.default_rng(0)
    history = _written(core, "history", history_blocks, rng)
    payload = core.group("history").decl.payload_bytes
    core.write("history", history, np.zeros((history.size, payload), np.uint8))
    for event in ("write_done", "compress_begin", "compress_done"):
        core.fire("history", history, event)
    index = _written(core, "index", index_blocks, rng)
    rows = np.arange(index_blocks)
    refs = (rows[:, None] // ROWS_PER_HISTORY_BLOCK - np.arange(TOP_K)[None, :]) % history_blocks
    core.set_index_refs("index", index, refs.astype(np.int32))
    payload = core.group("index").decl.payload_bytes
    core.write("index", index, np.zeros((index_blocks, payload), np.uint8))
    core.fire("index", index, "write_done")
    times = []
    for run in range(RUNS):
        start = time.perf_counter()
        core.fire("history", [int(history[run])], "evict")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str]) -> None:
    sizes = [int(arg) for arg in argv] or [9_000, 1_000_000]
    print(json.dumps({str(size): round(evict_ms(size), 4) for size in sizes}))


if __name__ == "__main__":
    main(sys.argv[1:])
