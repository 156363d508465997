"""``kvfsm demo --faults``: one cached prompt, faults injected, hit vs usable.

The verdict alone, with no model served and no extra package: on the DeepSeek-style declaration
it shows what a hit-only cache would reuse and what kvfsm says is usable, and why. The serving
demo (``kvfsm demo``, :mod:`kvfsm.serve._demo`) shows the same on real models' tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvfsm._engine import Engine
from kvfsm.lookup import Level
from kvfsm.spec import Tier, shipped_models
from kvfsm.state import CoreConfig, Prompt

PROMPT_TOKENS = 1025


def _block(engine: Engine, prompt: Prompt, group: str, index: int) -> int:
    high, low = prompt.words(engine.core.group(group).decl.block_size)
    return int(engine.core.lookup_words(group, high[index : index + 1], low[index : index + 1])[0])


def _spill(engine: Engine, prompt: Prompt) -> str:
    block = _block(engine, prompt, "history", 5)
    engine.core.fire("history", [block], "spill_begin")
    engine.core.fire("history", [block], "spill_done")
    return "history block 5 spilled to host (its index rows go with it)"


def _spill_window(engine: Engine, prompt: Prompt) -> str:
    block = _block(engine, prompt, "swa", 61)
    engine.core.fire("swa", [block], "spill_begin")
    engine.core.fire("swa", [block], "spill_done")
    return "a sliding-window block inside the window spilled to host"


def _window_hole(engine: Engine, prompt: Prompt) -> str:
    engine.core.fire("swa", [_block(engine, prompt, "swa", 60)], "evict")
    return "a sliding-window block inside the window evicted"


def _corrupt_spill(engine: Engine, prompt: Prompt) -> str:
    block = _block(engine, prompt, "history", 3)
    engine.core.fire("history", [block], "spill_begin")
    engine.core.fire("history", [block], "spill_done")
    group = engine.core.group("history")
    group.pools[Tier.HOST].data[int(group.slot[Tier.HOST][block]), 0] ^= 0xFF
    engine.core.fire("history", [block], "restore_begin")
    return "history block 3 spilled, its host copy corrupted, restore in flight"


def _stale_index(engine: Engine, prompt: Prompt) -> str:
    index = _block(engine, prompt, "index", 40)
    target = int(engine.core.group("index").refs_target[index][0])
    engine.core.fire("index", [index], "spill_begin")
    engine.core.fire("history", [target], "evict")  # invalidates the spilling index with it
    return "index block 40 spilling while its target history block is freed"


def _device_bitflip(engine: Engine, prompt: Prompt) -> str:
    group = engine.core.group("swa")
    block = _block(engine, prompt, "swa", 62)
    group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), 7] ^= 0x10
    return "one bit of a resident window block flipped on the device"


FAULTS: tuple[Callable[[Engine, Prompt], str], ...] = (
    lambda engine, prompt: "no fault",
    _spill_window, _spill, _window_hole, _corrupt_spill, _stale_index, _device_bitflip,
)


def fault_report() -> list[str]:
    """One line per fault: what a hit-only cache would reuse vs what kvfsm says, and why."""
    model = shipped_models()["deepseek_v4_like"]
    tokens = np.random.default_rng(7).integers(0, 50_000, PROMPT_TOKENS)
    lines = [f"model {model.name}, prompt of {PROMPT_TOKENS} tokens, every fault on a fresh "
             "cache (FULL verification):",
             "(hit: what a hit-only cache would reuse, every group's hash chain present; "
             "per group: each group's own hit)",
             f"  {'fault':68s} {'hit':>5s} {'usable':>6s} {'after plan':>10s} "
             f"{'plan':>5s}  {'per group':24s} reasons"]
    for inject in FAULTS:
        engine = Engine(model, CoreConfig(device_blocks=128, host_blocks=16, backend="numpy"))
        prompt = engine.prompt(tokens)
        engine.commit(prompt)
        what = inject(engine, prompt)
        verdict = engine.lookup(prompt, level=Level.FULL)
        reasons = sorted({s.reason.value for s in verdict.reasons})
        lines.append(f"  {what:68s} {verdict.hit_tokens:5d} {verdict.usable_tokens:6d} "
                     f"{verdict.restorable_tokens:10d} {len(verdict.plan):5d}  "
                     f"{'/'.join(str(g.hit_tokens) for g in verdict.groups):24s} "
                     f"{', '.join(reasons)}")
    return lines
