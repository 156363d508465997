"""Pool-size bench: every state-core operation should cost what it touches, whatever the pool.

One engine per pool size over the shipped ``deepseek_v4_like`` model (device and host pools of
that many blocks per group), all measured in one run. Each repetition commits a fresh prompt
and then, on that prompt's blocks: looks it up, spills a batch of its history to host (the
engine's ``give_back``: least recently used first), restores that batch (a lookup's plan),
evicts one history block (its index dependents are invalidated with it) and frees every block
it left. The prompt's blocks are all freed again at the end of a repetition, so every
repetition starts from the same occupancy and only the pool size differs between engines.

Device pools are zero-filled lazily (``np.zeros`` is ``calloc``: pages never written cost no
memory), so a million blocks of 4 KiB per group reserve address space, not RAM; what is touched
is the prompt's blocks (the slots a repetition frees are the ones the next one takes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.bench._timing import Progress, ProgressFn
from kvfsm.lookup import Level, lookup
from kvfsm.spec import Event, shipped_models
from kvfsm.state import CoreConfig, Prompt

#: The model the bench runs (every kind of the DeepSeek-style stack: history, window, index).
MODEL = "deepseek_v4_like"
#: The group whose blocks are spilled, restored and evicted (the one the index points into).
HISTORY = "history"
#: History blocks spilled to host and restored per repetition.
SPILL_BATCH = 64
#: Operations measured, in the order a repetition runs them.
OPERATIONS = ("commit", "lookup", "spill", "restore", "evict", "free")
#: Untimed repetitions before the timed ones (compiled kernels, first touch of the pages).
WARMUP = 2
#: Token ids are drawn from ``[0, VOCAB)``.
VOCAB = 100_000


def check_pool_sizes(pool_sizes: Sequence[int], tokens: int, repeat: int = 1) -> list[int]:
    """The distinct ``pool_sizes`` ascending, or a KvfsmError naming what is wrong: none
    given, ``tokens`` or ``repeat`` below 1, or a pool too small for one ``tokens`` prompt
    (checked before any engine is built, so a caller running longer work first can fail
    fast)."""
    sizes = sorted({int(size) for size in pool_sizes})
    if not sizes or repeat < 1 or tokens < 1:
        raise KvfsmError(f"bench pools: need pool sizes, tokens >= 1 and repeat >= 1; got "
                         f"{list(pool_sizes)}, {tokens}, {repeat}")
    finest = min(group.block_size for group in shipped_models()[MODEL].groups)
    # The history group spills SPILL_BATCH blocks at most: a prompt shorter than that spills
    # all of its history blocks.
    needed = tokens // finest + 1
    if sizes[0] < needed:
        raise KvfsmError(f"bench pools: a {tokens}-token prompt needs {needed} blocks per "
                         f"group; the smallest pool holds {sizes[0]}")
    return sizes


def bench_pool_sizes(
    *,
    pool_sizes: Sequence[int] = (10_000, 100_000, 1_000_000),
    tokens: int = 131_072,
    repeat: int = 21,
    progress: ProgressFn | None = None,
) -> dict[str, object]:
    """Median ms of commit, lookup, spill, restore, evict and free at each pool size (blocks
    per group in the device pool and in the host pool), and per operation the ratio of its
    cost at the largest pool to its cost at the smallest (``<op>_ratio_max_vs_min_pool``;
    1.0 is flat). ``progress`` takes a line per pool size (nothing is reported without it)."""
    sizes = check_pool_sizes(pool_sizes, tokens, repeat)
    model = shipped_models()[MODEL]
    report = Progress("bench pools", progress)
    started = time.perf_counter()
    engines: dict[int, Engine] = {}
    build_s: dict[str, float] = {}
    try:
        for size in sizes:
            report.phase(f"{size} blocks per group: building the engine")
            begin = time.perf_counter()
            engines[size] = Engine(model, CoreConfig(device_blocks=size, host_blocks=size,
                                                     backend="numpy"))
            build_s[str(size)] = round(time.perf_counter() - begin, 3)
        report.phase(f"{repeat} rounds of {tokens} tokens, the pool sizes alternating")
        per_size = _measure(engines, tokens, repeat, report)
    finally:
        for engine in engines.values():
            engine.close()
    out: dict[str, object] = {
        "model": model.name,
        "tokens": tokens,
        "repeat": repeat,
        "pool_sizes": sizes,
        "spill_batch_blocks": SPILL_BATCH,
        "build_s": build_s,
    }
    for op in OPERATIONS:
        out[f"{op}_ms"] = {str(size): round(per_size[size][op], 4) for size in sizes}
    for op in OPERATIONS:
        smallest, largest = per_size[sizes[0]][op], per_size[sizes[-1]][op]
        out[f"{op}_ratio_max_vs_min_pool"] = round(largest / smallest, 3) if smallest else None
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _measure(engines: Mapping[int, Engine], tokens: int, repeat: int, report: Progress
             ) -> dict[int, dict[str, float]]:
    """Median ms per operation and pool size over ``repeat`` rounds (after :data:`WARMUP`).
    Each round runs one repetition on every engine, in an order that rotates from round to
    round (the same prompt for all), so a machine busy for a while slows every pool size
    alike and the ratios stay comparable."""
    rng = np.random.default_rng(0)
    sizes = list(engines)
    spent: dict[int, dict[str, list[float]]] = {
        size: {op: [] for op in OPERATIONS} for size in sizes}
    tell = report.runs("rounds")
    for run in range(WARMUP + repeat):
        text = rng.integers(0, VOCAB, tokens + 1)
        shift = run % len(sizes)
        for size in sizes[shift:] + sizes[:shift]:
            engine = engines[size]
            times = _repetition(engine, engine.prompt(text))
            if run >= WARMUP:
                for op, seconds in times.items():
                    spent[size][op].append(seconds)
        if run >= WARMUP:
            tell(run - WARMUP + 1, repeat)
    return {size: {op: statistics.median(values) * 1e3 for op, values in ops.items()}
            for size, ops in spent.items()}


def _timed(times: dict[str, float], op: str, run: Callable[[], object]) -> object:
    begin = time.perf_counter()
    result = run()
    times[op] = time.perf_counter() - begin
    return result


def _repetition(engine: Engine, prompt: Prompt) -> dict[str, float]:
    """One commit .. free of ``prompt``'s blocks; seconds per operation."""
    core = engine.core
    times: dict[str, float] = {}
    committed = _timed(times, "commit", lambda: engine.commit(prompt))
    assert isinstance(committed, Mapping)
    blocks: dict[str, NDArray[np.intp]] = dict(committed)
    _timed(times, "lookup", lambda: lookup(core, prompt, level=Level.FULL, checksums=False))
    history = blocks[HISTORY]
    batch = min(SPILL_BATCH, int(history.size))
    _timed(times, "spill", lambda: engine.give_back(HISTORY, batch))
    verdict = engine.lookup(prompt, level=Level.FULL)
    _timed(times, "restore", lambda: engine.restore(verdict, prompt))
    last = int(history[-1])
    _timed(times, "evict", lambda: core.fire(HISTORY, [last], Event.EVICT))

    def free() -> None:
        # Index blocks go first: freeing history would invalidate them one event earlier.
        for name in sorted(blocks, key=lambda name: name == HISTORY):
            core.fire(name, blocks[name], Event.INVALIDATE, masked=True)
            core.fire(name, blocks[name], Event.FREE, masked=True)

    _timed(times, "free", free)
    return times
