"""``kvfsm bench state``: the state core's bytes per block and its batched block throughput.

Footprint figures come from the ``nbytes`` of the arrays a real :class:`StateCore` built, not from
constants, so they change when the core's dtypes (or its hash table's capacity) do. Throughput
drives whole batches through the public API of the core with every guard and effect of the
``full_kv`` lifecycle bound for real (slots, epochs, checksums, the hash table), one phase at a
time, all measured in one run.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.bench._timing import Progress, ProgressFn
from kvfsm.fsm import EffectFn, Machine
from kvfsm.spec import Call, Event, GroupDecl, GroupKind, Layout, ModelDecl, Row, shipped_models
from kvfsm.state import CoreConfig, GroupState, StateCore

#: One batched life of a block, in order; ``write`` is the payload copy, the rest are fires.
PHASES = ("allocate", "write_begin", "write", "write_done", "evict")

#: Effects that publish into and drop from the prefix hash table (vectorized probe rounds).
HASH_MAP_EFFECTS = ("publish_hash", "drop_hash")

#: Shape of one block of the bench model: one token, K and V, one head, head_dim 4, float16.
BENCH_SHAPE = (1, 2, 1, 4)


def bench_model() -> ModelDecl:
    """A one-group ``full_kv`` model whose blocks hold 16 bytes, so a million fit in 16 MiB."""
    group = GroupDecl(
        name="attn",
        kind=GroupKind.FULL,
        lifecycle="full_kv",
        block_size=BENCH_SHAPE[0],
        shape=BENCH_SHAPE,
        dtype="float16",
        layout=Layout(dim_order=("block", "token", "kv", "head", "dim"), alignment=16, padding=0),
    )
    return ModelDecl(
        name="bench_tiny",
        description="One full-attention group of 16-byte blocks, for kvfsm bench state.",
        layout_version=1,
        groups=(group,),
        source="<kvfsm.bench.state>",
        spec_hash="",
    )


def logical_arrays(group: GroupState) -> dict[str, NDArray[np.generic]]:
    """The per-block arrays of a group's logical line, by name, the hash words excluded."""
    arrays: dict[str, NDArray[np.generic]] = {
        "state": group.states,
        "epoch": group.epoch,
        "position": group.position,
        "pins": group.block_pins,
        # One counter per chunk of 1 << PIN_CHUNK_SHIFT blocks (leases' runs): 1/32 byte.
        "chunk_pins": group.chunk_pins,
        "last_use": group.last_use,
        "check": group.check,
        "layout_id": group.layout_id,
    }
    for tier, slots in group.slot.items():
        arrays[f"slot_{tier.spec_name}"] = slots
    arrays["stored_copies"] = group.copies
    arrays["sub_blocks"] = group.sub_blocks
    arrays["index_refs"] = group.refs_target
    arrays["index_epochs"] = group.refs_epoch
    arrays["free_ids"] = group.free_ids
    return arrays


def _traced_core(model: ModelDecl, blocks_per_tier: int) -> tuple[StateCore, int]:
    """A core with a device and a host pool of ``blocks_per_tier`` slots per group, and the bytes
    tracemalloc saw allocated while building it (NumPy reports its array buffers to it)."""
    config = CoreConfig(device_blocks=blocks_per_tier, host_blocks=blocks_per_tier,
                        backend="numpy")
    gc.collect()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        core = StateCore(model, config)
        return core, tracemalloc.get_traced_memory()[0] - before
    finally:
        if started:
            tracemalloc.stop()


def _listed_bytes(group: GroupState) -> int:
    """Bytes of every array the footprint figures name, payload included."""
    pools = group.pools.values()
    return (
        sum(a.nbytes for a in logical_arrays(group).values())
        + group.hash_high.nbytes + group.hash_low.nbytes + group.hash_map.nbytes
        + sum(p.owner.nbytes + p.checksum.nbytes + p.free_slots().nbytes + int(p.data.nbytes)
              for p in pools)
    )


def footprint(blocks_per_tier: int = 512) -> dict[str, float | int | str]:
    """Bytes per block of the shipped ``dense`` model's group with a device and a host pool."""
    model = shipped_models()["dense"]
    _traced_core(model, 1)  # first build fills caches (loaded specs, compiled tables)
    small, small_traced = _traced_core(model, blocks_per_tier)
    core, traced = _traced_core(model, 2 * blocks_per_tier)
    group = core.group(model.groups[0].name)
    n = group.n_blocks
    per_array = {name: a.nbytes / n for name, a in logical_arrays(group).items() if a.nbytes}
    # A fresh pool's free stack holds every slot, so free_slots() is the whole stack's size.
    slots = sum(pool.capacity for pool in group.pools.values())
    physical = sum(pool.owner.nbytes + pool.checksum.nbytes + pool.free_slots().nbytes
                   for pool in group.pools.values()) / slots
    # What else grows with the block count (scratch arrays, ...): the difference between two
    # sizes, so the fixed cost (compiled table, Python objects) cancels out.
    small_group = small.group(group.name)
    unlisted = (traced - _listed_bytes(group)) - (small_traced - _listed_bytes(small_group))
    return {
        "model": model.name,
        "group": group.name,
        "tiers": "+".join(tier.spec_name for tier in group.pools),
        "metadata_bytes_per_block": sum(per_array.values()),
        "metadata_layout": " + ".join(f"{name} {size:g}" for name, size in per_array.items()),
        "hash_bytes_per_block": (group.hash_high.nbytes + group.hash_low.nbytes) / n,
        "physical_bytes_per_slot": physical,
        "unlisted_bytes_per_block": unlisted / (n - small_group.n_blocks),
    }


def _timed_effects(machine: Machine, spent: dict[str, float]) -> None:
    """Wrap every effect bound in ``machine`` so its wall time adds up in ``spent[name]``.

    One ``perf_counter`` pair per effect per batch: negligible next to a batch of blocks.
    """
    # The machine offers no hook around its effects; the bench reaches into its bound table
    # (private) rather than measure a copy of the effects' code.
    rows = machine._row_effects
    for effects in rows:
        for index, (call, effect) in enumerate(effects):
            effects[index] = (call, _timed(effect, spent))


def _timed(effect: EffectFn, spent: dict[str, float]) -> EffectFn:
    def run(ids: NDArray[np.intp], call: Call, row: Row) -> None:
        start = time.perf_counter()
        effect(ids, call, row)
        spent[call.name] = spent.get(call.name, 0.0) + time.perf_counter() - start

    return run


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KvfsmError(f"bench state: {what}")


def bench_state(
    *, blocks: int = 1_000_000, repeat: int = 3, progress: ProgressFn | None = None
) -> dict[str, float | int | str]:
    """Footprint per block, and blocks per second through allocate -> write_begin -> write ->
    write_done -> evict on batches of ``blocks`` (median of ``repeat`` cycles after one warm-up).
    ``progress`` takes a line per cycle and phase (nothing is reported without it).
    """
    if blocks < 1 or repeat < 1:
        raise KvfsmError(f"bench state: blocks and repeat must be >= 1, got {blocks}, {repeat}")
    report = Progress("bench state", progress)
    report.phase(f"building a core of {blocks} blocks")
    model = bench_model()
    decl = model.groups[0]
    core = StateCore(model, CoreConfig(device_blocks=blocks, host_blocks=0, backend="numpy"))
    name = decl.name
    group = core.group(name)
    rng = np.random.default_rng(0)
    positions = np.arange(blocks, dtype=np.int32) * np.int32(decl.block_size)
    # Random 128-bit identities: distinct, as chained prefix hashes are (hashing is the
    # request's work, done once as its tokens arrive, not the core's).
    high = rng.integers(0, 2**64, size=blocks, dtype=np.uint64, endpoint=False)
    low = rng.integers(0, 2**64, size=blocks, dtype=np.uint64, endpoint=False)
    payload = rng.integers(0, 256, size=(blocks, decl.payload_bytes), dtype=np.uint8)
    spent: dict[str, float] = {}
    _timed_effects(group.machine, spent)
    ids = np.zeros(0, dtype=np.intp)
    moved: list[NDArray[np.bool_]] = []

    def allocate() -> None:
        nonlocal ids
        ids = core.allocate(name, positions, high, low)

    steps: dict[str, Callable[[], object]] = {
        "allocate": allocate,
        "write_begin": lambda: moved.append(core.fire(name, ids, Event.WRITE_BEGIN)),
        "write": lambda: core.write(name, ids, payload),
        "write_done": lambda: moved.append(core.fire(name, ids, Event.WRITE_DONE)),
        "evict": lambda: moved.append(core.fire(name, ids, Event.EVICT)),
    }

    def cycle() -> dict[str, float]:
        spent.clear()
        moved.clear()
        times: dict[str, float] = {}
        mapped = 0
        for phase, step in steps.items():
            in_effects = sum(spent.values())
            start = time.perf_counter()
            step()
            times[phase] = time.perf_counter() - start
            times[f"outside:{phase}"] = times[phase] - (sum(spent.values()) - in_effects)
            if phase == "write_done":
                mapped = len(group.hash_map)
        _require(ids.size == blocks and all(bool(m.all()) for m in moved),
                 "a phase refused blocks")
        _require(mapped == blocks and not group.hash_map,
                 f"the hash map held {mapped} of {blocks} keys after write_done and "
                 f"{len(group.hash_map)} after evict")
        return times | {f"effect:{key}": value for key, value in spent.items()}

    report.phase(f"warm-up cycle of {blocks} blocks")
    cycle()  # warm-up: first touches of the pool and arrays
    runs: list[dict[str, float]] = []
    for done in range(repeat):
        report.phase(f"cycle {done + 1}/{repeat} of {blocks} blocks")
        runs.append(cycle())
    report.phase("checking invariants")
    # Untimed: one full cycle more, so the invariants are checked with every block published
    # and again with none. The hash table's arrays are allocated up front at their full size.
    for phase in PHASES[:-1]:
        steps[phase]()
    problems = core.check_invariants()
    _require(not problems, "invariants broken: " + "; ".join(problems[:4]))
    steps["evict"]()
    problems = core.check_invariants()
    _require(not problems, "invariants broken: " + "; ".join(problems[:4]))

    def median(key: str) -> float:
        return statistics.median(run.get(key, 0.0) for run in runs)

    total = statistics.median(sum(run[p] for p in PHASES) for run in runs)
    effects = sorted({key for run in runs for key in run if key.startswith("effect:")})
    hash_map_s = sum(median(f"effect:{e}") for e in HASH_MAP_EFFECTS)
    outside_s = sum(median(f"outside:{p}") for p in PHASES)
    report.phase("measuring the footprint per block")
    figures: dict[str, float | int | str] = dict(footprint())
    figures |= {
        "blocks": blocks,
        "repeat": repeat,
        "payload_bytes": decl.payload_bytes,
        "hash_map_bytes_per_block": group.hash_map.nbytes / group.n_blocks,
        "hash_map_capacity": group.hash_map.capacity,
        "alloc_write_free_per_s": blocks / total,
        "cycle_ms": total * 1e3,
    }
    figures |= {f"{phase}_ms": median(phase) * 1e3 for phase in PHASES}
    figures |= {f"effect_{key.split(':', 1)[1]}_ms": median(key) * 1e3 for key in effects}
    figures |= {
        "outside_effects_ms": outside_s * 1e3,
        "hash_map_share": hash_map_s / total,
        "outside_effects_share": outside_s / total,
    }
    busiest = max(PHASES, key=lambda p: median(f"outside:{p}"))
    figures["note"] = _note(total, hash_map_s, outside_s, busiest)
    return figures


def _note(total: float, hash_map_s: float, outside_s: float, busiest: str) -> str:
    """Where the cycle's time goes, in words, the largest part first."""
    parts = {
        "the hash map's publish (write_done) and drop (evict), vectorized probe rounds over "
        "each batch": hash_map_s / total,
        "the other effects (slots, epochs, checksums)": (total - hash_map_s - outside_s) / total,
        f"the core's own work outside effects (id checks, guards, the payload copy; most in "
        f"{busiest})": outside_s / total,
    }
    ranked = sorted(parts.items(), key=lambda item: -item[1])
    text = "; ".join(f"{share:.0%} {what}" for what, share in ranked)
    if hash_map_s / total >= 0.5:
        return "the hash map dominates (random access into its arrays): " + text
    return text
