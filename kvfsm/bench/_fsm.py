"""``kvfsm bench fsm``: batched fire vs scalar fire vs the `transitions` library, in one run."""

from __future__ import annotations

import numpy as np

from kvfsm._errors import KvfsmError
from kvfsm.bench._timing import Progress, ProgressFn, median_seconds
from kvfsm.fsm._compiled import compile_lifecycle
from kvfsm.fsm._machine import Machine
from kvfsm.fsm._reference import ReferenceMachine
from kvfsm.spec._shipped import shipped_lifecycles
from kvfsm.spec._vocabulary import Event

#: One full life of a block: four transitions, every one through a row with guards or effects.
CYCLE = (Event.ALLOCATE, Event.WRITE_BEGIN, Event.WRITE_DONE, Event.EVICT)


def bench_fsm(
    *,
    blocks: int = 1_000_000,
    scalar_cycles: int = 20_000,
    reference_cycles: int = 2_000,
    repeat: int = 5,
    progress: ProgressFn | None = None,
) -> dict[str, float | int | str]:
    """Transitions per second of the three ways to drive the ``full_kv`` lifecycle.

    Guards and effects are bound permissively (always pass, do nothing): this measures the
    table machinery itself; the memory work of effects is measured by ``bench state``.
    ``progress`` takes a line per measurement (nothing is reported without it).
    """
    counts = (blocks, scalar_cycles, reference_cycles, repeat)
    if min(counts) < 1:
        raise KvfsmError(
            "bench fsm: blocks, scalar_cycles, reference_cycles and repeat must be >= 1, got "
            + ", ".join(map(str, counts))
        )
    report = Progress("bench fsm", progress)
    lifecycle = shipped_lifecycles()["full_kv"]
    table = compile_lifecycle(lifecycle)

    batched = Machine(table, blocks, permissive=True)
    # Shuffled like ids drawn from a free list: no sorted-input fast path helps here.
    ids = np.random.default_rng(0).permutation(blocks).astype(np.intp)

    def batched_cycle() -> None:
        for event in CYCLE:
            batched.fire_batch(ids, event)

    report.phase(f"batched fire of {blocks} blocks")
    batched_s = median_seconds(batched_cycle, repeat=repeat, on_run=report.runs("batched fire"))

    scalar = Machine(table, 1, permissive=True)

    def scalar_cycles_run() -> None:
        fire = scalar.fire
        for _ in range(scalar_cycles):
            for event in CYCLE:
                fire(0, event)

    report.phase(f"scalar fire, {scalar_cycles} cycles")
    scalar_s = median_seconds(scalar_cycles_run, repeat=repeat, on_run=report.runs("scalar fire"))

    reference = ReferenceMachine(lifecycle)

    def reference_run() -> None:
        fire = reference.fire
        for _ in range(reference_cycles):
            for event in CYCLE:
                fire(event)

    report.phase(f"the transitions library, {reference_cycles} cycles")
    reference_s = median_seconds(
        reference_run, repeat=repeat, on_run=report.runs("the transitions library"))

    batched_per_s = blocks * len(CYCLE) / batched_s
    transitions_per_s = reference_cycles * len(CYCLE) / reference_s
    return {
        "lifecycle": lifecycle.name,
        "blocks": blocks,
        "batched_per_s": batched_per_s,
        "scalar_per_s": scalar_cycles * len(CYCLE) / scalar_s,
        "transitions_per_s": transitions_per_s,
        "ratio_batched_vs_transitions": batched_per_s / transitions_per_s,
    }
