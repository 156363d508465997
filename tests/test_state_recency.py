"""Recency lists against a model (Python lists), and what give-backs cost: the blocks they
return and pass over, whatever the pool size. Every kernel test runs compiled and as its
plain-Python twin."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm._errors import KvfsmError
from kvfsm.spec import Event, shipped_models
from kvfsm.state import CoreConfig, StateCore
from kvfsm.state._group import EVICT_LIST, RECLAIM_LIST
from kvfsm.state._recency import NO_LIST, Recency

#: Hypothesis with the (function-scoped) ``jit_backend`` fixture, which only picks a backend.
FIXTURE_OK = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])

N_BLOCKS = 8
N_STATES = 4
#: States 0..2 map to lists 0, 1, none; state 3 to list 1 as well.
LIST_OF_STATE = np.array([0, 1, NO_LIST, 1], dtype=np.int8)
#: No chunk of ids pinned (walks over ``N_BLOCKS`` blocks, chunks of two).
NO_CHUNK_PINS = np.zeros(N_BLOCKS // 2 + 1, dtype=np.uint16)

DENSE = shipped_models()["dense"]


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, list[int], list[int]]]:
    """Moves (ids to new states) and touches (ids, repeats allowed; often consecutive ids,
    which a touch records as a run where they are linked in order) over a few blocks."""
    out: list[tuple[str, list[int], list[int]]] = []
    for _ in range(draw(st.integers(0, 25))):
        ids = draw(st.lists(st.integers(0, N_BLOCKS - 1), max_size=6))
        if draw(st.booleans()):
            first = draw(st.integers(0, N_BLOCKS - 1))
            out.append(("touch", list(range(first, draw(st.integers(first, N_BLOCKS)))), []))
        elif draw(st.booleans()):
            ids = list(dict.fromkeys(ids))  # a fire moves distinct ids
            out.append(("move", ids, draw(st.lists(st.integers(0, N_STATES - 1),
                                                   min_size=len(ids), max_size=len(ids)))))
        else:
            out.append(("touch", ids, []))
    return out


@FIXTURE_OK
@given(script=steps(), pinned=st.sets(st.integers(0, N_BLOCKS - 1)), count=st.integers(0, 9))
def test_lists_follow_the_states_oldest_first(
    jit_backend: str, script: list[tuple[str, list[int], list[int]]], pinned: set[int],
    count: int) -> None:
    """For any moves and touches, each list holds exactly the blocks whose state maps to it,
    in the order they last joined it or were touched (the model's lists), and ``oldest`` is
    the first ``count`` unpinned ones of that order."""
    recency = Recency(N_BLOCKS, LIST_OF_STATE)
    states = np.full(N_BLOCKS, 2, dtype=np.uint8)  # on no list
    last_use = np.zeros(N_BLOCKS, dtype=np.uint32)
    model: dict[int, list[int]] = {0: [], 1: []}
    for tick, (kind, ids, dest) in enumerate(script, start=1):
        batch = np.array(ids, dtype=np.intp)
        if kind == "move":
            before, after = states[batch], np.array(dest, dtype=np.uint8)
            states[batch] = after
            joined = recency.moved(batch, before, after)
            last_use[joined] = tick
            for block, old, new in zip(ids, before.tolist(), dest, strict=True):
                was, now = int(LIST_OF_STATE[old]), int(LIST_OF_STATE[new])
                if was != now:
                    if was != NO_LIST:
                        model[was].remove(block)
                    if now != NO_LIST:
                        model[now].append(block)
        else:
            assert recency.touch(batch, states, last_use, tick) == -1
            assert (last_use[batch] == tick).all()
            for block in ids:
                listed = int(LIST_OF_STATE[states[block]])
                if listed != NO_LIST:
                    model[listed].remove(block)
                    model[listed].append(block)
        assert recency.problems(states, last_use) == []
    pins = np.zeros(N_BLOCKS, dtype=np.uint16)
    pins[sorted(pinned)] = 1
    for listed, order in model.items():
        expected = [block for block in order if block not in pinned][:count]
        assert recency.oldest(listed, count, pins, NO_CHUNK_PINS, 1).tolist() == expected


def test_a_false_record_of_a_linked_run_is_reported() -> None:
    """The record of a run linked in order is checked against the links: a record naming ids
    that are not linked so (or not on its list) is a fault the invariant check reports."""
    recency = Recency(N_BLOCKS, LIST_OF_STATE)
    states = np.zeros(N_BLOCKS, dtype=np.uint8)
    order = np.array([0, 1, 2, 5, 4, 3, 6, 7], dtype=np.intp)
    recency.moved(order, np.full(N_BLOCKS, 2, dtype=np.uint8), states)
    last_use = np.zeros(N_BLOCKS, dtype=np.uint32)
    recency.linked_run[:] = (0, 3, 0)  # 0 -> 1 -> 2 on list 0: true
    assert recency.problems(states, last_use) == []
    for false in ((2, 3, 0), (0, 3, 1), (6, 3, 0)):  # 2 -> 5; another list; past the blocks
        recency.linked_run[:] = false
        assert any("not true of the links" in problem
                   for problem in recency.problems(states, last_use))


def test_a_touch_with_an_id_outside_the_blocks_changes_nothing(jit_backend: str) -> None:
    """An id out of range anywhere in the batch: its index comes back, and no stamp, list or
    link changed (the ids before it included)."""
    recency = Recency(N_BLOCKS, LIST_OF_STATE)
    states = np.array([0, 1, 3, 2, 1, 0, 1, 2], dtype=np.uint8)
    recency.moved(np.arange(N_BLOCKS), np.full(N_BLOCKS, 2, dtype=np.uint8), states)
    last_use = np.arange(N_BLOCKS, dtype=np.uint32)
    before = [a.copy() for a in (recency.prev, recency.next, recency.head, recency.tail,
                                 last_use)]
    for bad in (-1, N_BLOCKS):
        batch = np.array([1, 0, bad, 4], dtype=np.intp)
        assert recency.touch(batch, states, last_use, 99) == 2
        after = (recency.prev, recency.next, recency.head, recency.tail, last_use)
        assert all((a == b).all() for a, b in zip(before, after, strict=True))
    assert recency.touch(np.array([1, 6, 1], dtype=np.intp), states, last_use, 99) == -1
    assert recency.oldest(1, N_BLOCKS, np.zeros(N_BLOCKS, dtype=np.uint16), NO_CHUNK_PINS,
                          1).tolist() == [2, 4, 6, 1]


def test_core_touch_refuses_bad_ids_and_keeps_its_clock(jit_backend: str) -> None:
    """``StateCore.touch`` names the group and the bad id, stamps nothing and keeps its clock;
    repeats and any integer dtype or shape are accepted."""
    core, ids = _filled(64, 6)
    group = core.group("attn")
    now, stamps = core.clock.now, group.last_use.copy()
    with pytest.raises(KvfsmError, match=r"attn: block ids must lie in \[0, 128\), got 128"):
        core.touch("attn", [int(ids[0]), 128])
    with pytest.raises(KvfsmError, match="must be integers"):
        core.touch("attn", [0.5])
    assert core.clock.now == now and (group.last_use == stamps).all()
    frozen = ids[[2, 2, 0]].astype(np.int32).reshape(3, 1)
    frozen.flags.writeable = False
    core.touch("attn", frozen)
    assert core.clock.now == now + 1 and (group.last_use[ids[[0, 2]]] == now + 1).all()
    assert core.eviction_candidates("attn", 6).tolist() == ids[[1, 3, 4, 5, 2, 0]].tolist()
    assert core.check_invariants() == []


def test_oldest_skips_excluded_blocks_and_grows_its_buffer(jit_backend: str) -> None:
    n = 300  # more than the first answer buffer holds
    recency = Recency(n, LIST_OF_STATE)
    ids = np.arange(n, dtype=np.intp)
    recency.moved(ids, np.full(n, 2, dtype=np.uint8), np.ones(n, dtype=np.uint8))
    excluded = np.zeros(n, dtype=np.bool_)
    excluded[::3] = True
    got = recency.oldest(1, n, np.zeros(n, dtype=np.uint16), np.zeros(n, dtype=np.uint16), 0,
                         excluded)
    assert got.tolist() == [i for i in range(n) if i % 3]


def test_oldest_skips_the_blocks_of_pinned_chunks(jit_backend: str) -> None:
    """A pin on a chunk of ``1 << shift`` ids holds every block in it: the walk skips them
    all, as it skips a block pinned alone."""
    n, shift = 16, 2
    recency = Recency(n, LIST_OF_STATE)
    ids = np.arange(n, dtype=np.intp)
    recency.moved(ids, np.full(n, 2, dtype=np.uint8), np.ones(n, dtype=np.uint8))
    pins = np.zeros(n, dtype=np.uint16)
    pins[1] = 1
    chunk_pins = np.zeros((n >> shift) + 1, dtype=np.uint16)
    chunk_pins[2] = 1  # blocks 8 to 11
    got = recency.oldest(1, n, pins, chunk_pins, shift)
    assert got.tolist() == [0, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]


def _filled(device: int, blocks: int) -> tuple[StateCore, np.ndarray]:
    """A dense core of ``device`` device slots with ``blocks`` readable blocks, each touched
    once, oldest first."""
    core = StateCore(DENSE, CoreConfig(device_blocks=device, host_blocks=device,
                                       backend="numpy"))
    keys = np.arange(1, blocks + 1, dtype=np.uint64)
    ids = core.allocate("attn", np.arange(blocks), keys, keys * np.uint64(7919))
    core.fire("attn", ids, Event.WRITE_BEGIN)
    core.write("attn", ids, np.zeros((blocks, DENSE.groups[0].payload_bytes), np.uint8))
    core.fire("attn", ids, Event.WRITE_DONE)
    for block in ids:
        core.touch("attn", [block])
    return core, ids


@pytest.mark.parametrize("device", [64, 4096])
def test_a_give_back_walks_what_it_returns_and_skips_never_the_pool(device: int) -> None:
    """Whatever the pool size: eviction candidates, reclaimable blocks and a spill-down walk
    the blocks they return plus the pinned or excluded ones they pass over, and one more to
    see that the last one's batch (blocks used together) ends there."""
    core, ids = _filled(device, 40)
    group = core.group("attn")
    core.pin("attn", ids[:5])  # a pin is a use: they went to the young end
    for block in ids[5:]:
        core.touch("attn", [block])  # now the pinned ones are the oldest again
    assert core.eviction_candidates("attn", 3).tolist() == ids[5:8].tolist()
    assert group.recency.last_walked == 5 + 3 + 1
    assert core.eviction_candidates("attn", 3, exclude=ids[5:7]).tolist() == ids[7:10].tolist()
    assert group.recency.last_walked == 5 + 2 + 3 + 1
    core.fire("attn", ids[30:34], Event.INVALIDATE)
    assert core.reclaimable("attn").tolist() == ids[30:34].tolist()
    assert group.recency.last_walked == 4
    assert core.check_invariants() == []


def test_the_lists_are_what_give_backs_read() -> None:
    """Invalid blocks come first, each kind in order of last use; a block moving back (a
    restore) is as recent as the latest use."""
    core, ids = _filled(64, 6)
    core.fire("attn", ids[[4, 1]], Event.INVALIDATE)
    assert core.eviction_candidates("attn", 6).tolist() == ids[[4, 1, 0, 2, 3, 5]].tolist()
    core.fire("attn", ids[:1], Event.SPILL_BEGIN)
    core.fire("attn", ids[:1], Event.SPILL_DONE)
    core.fire("attn", ids[:1], Event.RESTORE_BEGIN)
    core.fire("attn", ids[:1], Event.RESTORE_DONE)
    group = core.group("attn")
    assert group.in_list(ids[:1], EVICT_LIST).all()
    assert group.reclaimable_mask(ids[[4, 1]]).all()
    assert group.oldest(RECLAIM_LIST, 9).tolist() == ids[[4, 1]].tolist()
    assert core.eviction_candidates("attn", 6).tolist() == ids[[4, 1, 2, 3, 5, 0]].tolist()
    assert core.check_invariants() == []
