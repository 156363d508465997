"""Properties of the shipped lifecycle specs themselves: each one's kind, and the sparse index's
defences against pointing at freed blocks, shown through the public StateCore API."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from kvfsm import CoreConfig, StateCore, shipped_models
from kvfsm.spec import Event, GroupKind, Lifecycle, shipped_lifecycles

EXPECTED_KINDS = {
    "full_kv": GroupKind.FULL,
    "sliding_window": GroupKind.SLIDING_WINDOW,
    "compressed": GroupKind.COMPRESSED,
    "sparse_index": GroupKind.SPARSE_INDEX,
    "recurrent": GroupKind.RECURRENT,
}


def test_every_shipped_lifecycle_declares_its_kind() -> None:
    assert {name: lc.kind for name, lc in shipped_lifecycles().items()} == EXPECTED_KINDS


# ------------------------------------------------------------------ sparse index, spec level


def _stale_successors(lifecycle: Lifecycle) -> dict[str, set[str]]:
    """The rows that can still fire once an index's targets have changed: ``targets_current``
    refuses for good (an epoch never goes back), every other guard may pass."""
    edges: dict[str, set[str]] = {}
    for row in lifecycle.rows:
        if all(call.name != "targets_current" for call in row.guards):
            edges.setdefault(row.source, set()).add(row.dest)
    return edges


def _reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, queue = {start}, deque([start])
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def test_a_stale_index_never_becomes_readable_and_can_always_be_freed() -> None:
    lifecycle = shipped_lifecycles()["sparse_index"]
    edges = _stale_successors(lifecycle)
    readable = {s.name for s in lifecycle.states if s.readable}
    for state in lifecycle.states:
        reach = _reachable(state.name, edges)
        assert lifecycle.initial in reach, f"a stale index in {state.name!r} is stuck"
        if not state.readable:
            assert not reach & readable, (
                f"a stale index in {state.name!r} can become readable again: "
                f"{sorted(reach & readable)}"
            )


def test_every_in_flight_hashed_index_state_can_be_invalidated() -> None:
    """A target's invalidate_dependents reaches an index whatever operation it is in, so a stale
    index leaves the hash map at once instead of waiting to be evicted."""
    lifecycle = shipped_lifecycles()["sparse_index"]
    invalidated = {row.source for row in lifecycle.rows if row.event is Event.INVALIDATE}
    for state in lifecycle.states:
        if state.hashed:
            assert state.name in invalidated, state.name


# ------------------------------------------------------------------ sparse index, public API


@pytest.fixture
def core() -> StateCore:
    return StateCore(
        shipped_models()["deepseek_v4_like"],
        CoreConfig(device_blocks=8, host_blocks=4, backend="numpy"),
    )


def _written(core: StateCore, group: str, key: int, targets: list[int] | None = None) -> int:
    """A block of ``group`` allocated under hash key (key, key), written and complete."""
    (block,) = core.allocate(group, [0], [key], [key])
    core.fire(group, [block], Event.WRITE_BEGIN)
    if targets is not None:
        top_k = core.group(group).decl.top_k or 0
        core.set_index_refs(group, [block], [targets + [-1] * (top_k - len(targets))])
    payload = np.zeros((1, core.group(group).decl.payload_bytes), dtype=np.uint8)
    core.write(group, [block], payload)
    core.fire(group, [block], Event.WRITE_DONE)
    return int(block)


def _state(core: StateCore, group: str, block: int) -> str:
    state = core.group(group)
    return state.table.state_name(int(state.states[block]))


def test_index_spilling_when_its_target_is_evicted_never_reads_stale(core: StateCore) -> None:
    target = _written(core, "history", 1)
    index = _written(core, "index", 2, [target])
    core.fire("index", [index], Event.SPILL_BEGIN)
    assert _state(core, "index", index) == "spilling_host"

    core.fire("history", [target], Event.EVICT)  # its invalidate_dependents reaches the index
    # The spill's failure arrives afterwards; it must not make the index readable again.
    moved = core.fire("index", [index], Event.SPILL_FAIL, masked=True)
    assert core.check_invariants() == []
    assert not moved.any()
    assert _state(core, "index", index) == "invalid"
    assert core.lookup_words("index", [2], [2]).tolist() == [-1]

    core.fire("index", [index], Event.FREE)
    assert _state(core, "index", index) == "free"
    assert core.check_invariants() == []


def test_index_restoring_when_its_target_is_evicted_leaves_the_hash_map(
    core: StateCore,
) -> None:
    target = _written(core, "history", 1)
    index = _written(core, "index", 2, [target])
    core.fire("index", [index], Event.SPILL_BEGIN)
    core.fire("index", [index], Event.SPILL_DONE)
    core.fire("index", [index], Event.RESTORE_BEGIN)
    assert _state(core, "index", index) == "restoring_host"

    core.fire("history", [target], Event.EVICT)
    assert _state(core, "index", index) == "invalid"
    assert core.lookup_words("index", [2], [2]).tolist() == [-1]
    assert core.check_invariants() == []
