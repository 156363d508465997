"""Differential fuzz of the serving loop: kvfsm's reuse against recomputing, for every tiny model.

Invariant: for any small workload (2 to 4 requests sharing a prefix, some extending an earlier
request, 20 to 80 tokens, never a multiple of the block size), any pool sizes (device, host, and
disk and remote blocks with a disk tier in a temporary directory and a Redis server behind the
remote one, where it runs) and any schedule of faults drawn from the injectors of the model's
group kinds and stored tiers (one before each request, on a block of an earlier request's
prompt), serving in ``kvfsm`` mode at ``Level.FULL`` generates exactly the greedy tokens of
``nocache`` mode, with first-step logits within 1e-4 (float32 rounding of chunked forwards), and
the state core's invariants hold afterwards.

Examples: a tenth of the loaded Hypothesis profile's ``max_examples`` per model (10 under the
default profile), so the file stays well under a minute; ``HYPOTHESIS_PROFILE=long`` fuzzes
deliberately. Each example is marked with its model and faults (``hypothesis.event``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfsm import Engine
from kvfsm.lookup import Level
from kvfsm.serve import _faults as faults
from kvfsm.serve import _stores as stores
from kvfsm.serve import declare, tiny_model
from kvfsm.serve._demo import stored_tiers_of
from kvfsm.serve._loop import Request, serve
from kvfsm.spec import GroupKind, ModelDecl, Tier
from kvfsm.state import CoreConfig

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest.importorskip("torch")

MODELS = ("gpt_oss", "qwen3_next", "deepseek_v4")
TOLERANCE = 1e-4
NEW_TOKENS = 3
EXAMPLES = max(2, settings().max_examples // 10)

#: Injectors for every kind, and those for one kind only.
GENERIC = ("corrupt_host_copy", "flip_device_bytes", "spill_block", "restore_in_flight")
DISK = ("flip_disk_byte", "truncate_disk_file", "delete_disk_file")
REMOTE = ("evict_remote_value", "plant_foreign_value", "slow_remote")
BY_KIND = {
    GroupKind.FULL: (*DISK, *REMOTE),
    GroupKind.SLIDING_WINDOW: ("evict_window_block",),
    GroupKind.RECURRENT: ("evict_snapshot", "stale_snapshot", *DISK),
    GroupKind.COMPRESSED: ("evict_compressed_block", "compression_incomplete", *DISK),
}
#: How late a slow remote load answers here, and how long kvfsm mode waits (seconds).
SLOW_S, WAIT_S = 0.3, 0.1


@pytest.fixture(scope="module")
def remote() -> Iterator[stores.RemoteStore | None]:
    """A Redis server for the remote tier where one runs (else no remote tier)."""
    if stores.remote_unusable("redis") is not None:
        yield None
        return
    with stores.RemoteStore("redis") as store:
        yield store

_loaded: dict[str, Any] = {}


@pytest.fixture(scope="module", params=MODELS)
def tiny(request: pytest.FixtureRequest) -> Any:
    model_type: str = request.param
    if model_type not in _loaded:
        _loaded[model_type] = tiny_model(model_type, seed=0)
    return _loaded[model_type]


def injectors(decl: ModelDecl) -> list[tuple[str, str]]:
    """Every (injector, group) pair that applies to ``decl``'s groups."""
    return [(name, group.name) for group in decl.groups
            for name in (*GENERIC, *BY_KIND.get(group.kind, ()))]


def lengths() -> st.SearchStrategy[int]:
    return st.sampled_from([n for n in range(20, 81) if n % 16])


@st.composite
def workloads(draw: st.DrawFn, decl: ModelDecl) -> tuple[list[Request], list[Any], Any]:
    """(requests, faults before each request, pool sizes)."""
    count = draw(st.integers(2, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    shared = [int(t) for t in rng.integers(0, 1000, draw(st.integers(8, 19)))]
    prompts: list[list[int]] = []
    for _ in range(count):
        length = draw(lengths())
        longer = [p for p in prompts if len(p) < length]
        base = draw(st.sampled_from([shared, *longer]))  # a new user, or a later turn
        prompts.append(base + [int(t) for t in rng.integers(0, 1000, length - len(base))])
    pairs = injectors(decl)
    schedule = [None] + [
        draw(st.none() | st.tuples(st.sampled_from(pairs), st.integers(0, i - 1),
                                   st.integers(0, 4)))
        for i in range(1, count)]
    pools = draw(st.tuples(st.sampled_from([6, 12, 32]), st.sampled_from([0, 4]),
                           st.sampled_from([0, 2, 8]), st.sampled_from([0, 8])))
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(prompts)]
    return requests, schedule, pools


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_kvfsm_serves_the_tokens_of_recomputing(tiny: Any, remote: stores.RemoteStore | None,
                                                data: st.DataObject) -> None:
    config = tiny.config
    decl = declare(config)
    requests, schedule, (device, host, disk, far) = data.draw(workloads(decl))
    event(f"model {config.model_type}")
    by_rid = {r.rid: i for i, r in enumerate(requests)}

    def hook(engine: Engine, request: Request) -> list[str]:
        fault = schedule[by_rid[request.rid]]
        if fault is None:
            return []
        (name, group), target, index = fault
        event(f"{config.model_type}: {name} on {group}")
        inject = getattr(faults, name)
        if name == "slow_remote":
            inject = functools.partial(inject, seconds=SLOW_S)
        line: str = inject(engine, requests[target].tokens, index=index, group=group)
        if "moved to" in line:
            event(f"{config.model_type}: {name} landed")
        return [line]

    reference = serve(tiny, None, requests, "nocache")
    # A remote tier only where a group keeps one, written from a disk tier (an engine with a
    # host pool and no disk tier is refused one: its blocks would never reach it).
    far *= Tier.REMOTE in stored_tiers_of(decl) and (disk > 0 or host == 0)
    with stores.engine_tiers(remote, disk=disk > 0, use_remote=far > 0) as tiers:
        engine = Engine(decl, CoreConfig(device_blocks=device, host_blocks=host,
                                         disk_blocks=disk if "disk" in tiers else 0,
                                         remote_blocks=far if "remote" in tiers else 0,
                                         cache_salt=f"fuzz/{data.draw(st.integers(0, 2**32))}",
                                         backend="numpy"), tiers=tiers)
        try:
            got = serve(tiny, engine, requests, "kvfsm", level=Level.FULL, hook=hook,
                        restore_timeout=WAIT_S)
        finally:
            engine.close()
        for ref, result in zip(reference, got, strict=True):
            assert result.tokens == ref.tokens, (result.rid, result.events)
            delta = float(np.abs(result.logits - ref.logits).max())
            assert delta <= TOLERANCE, (result.rid, delta, result.events)
        if any(r.reused_tokens for r in got):
            event(f"{config.model_type}: some prefix reused")
        if any(step.tier in ("disk", "remote") for r in got for step in r.steps):
            event(f"{config.model_type}: restored from a stored tier")
        assert engine.core.check_invariants() == []


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_without_faults_kvfsm_reuses_what_a_hit_only_engine_reuses(tiny: Any,
                                                                   data: st.DataObject) -> None:
    """kvfsm is not merely conservative: on any small fault-free workload and pool sizes, each
    request reuses exactly as many tokens in ``kvfsm`` mode (after its restore plan) as a
    hit-only engine does, and generates the same tokens."""
    decl = declare(tiny.config)
    requests, _, (device, host, _disk, _remote) = data.draw(workloads(decl))

    def engine() -> Engine:
        return Engine(decl, CoreConfig(device_blocks=device, host_blocks=host,
                                       backend="numpy"))

    naive = serve(tiny, engine(), requests, "naive")
    kvfsm = serve(tiny, engine(), requests, "kvfsm", level=Level.FULL)
    for hit_only, result in zip(naive, kvfsm, strict=True):
        assert result.reused_tokens == hit_only.reused_tokens, result.rid
        assert result.tokens == hit_only.tokens, result.rid
