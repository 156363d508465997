"""The touch pass: blocks used now are stamped and moved to the young end of their list, and a
lease's touch pins them in the same pass, by whole chunks where they are one run, or refuses
with nothing changed."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm.state._recency import Recency
from kvfsm.state._touch import (
    NO_PINNING,
    ONE_RUN,
    RUNS,
    run_chunks,
    touch_kernel,
    unpin_loop,
)
from tests.kernel_inputs import chunk_bounds
from tests.kernel_twins import unpin_twin

#: The backend fixture is set once per test, not per example: it changes nothing per input.
FIXTURE_OK = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])

N_BLOCKS = 40
SHIFT = 3  # chunks of 8 ids
#: State 0 puts a block on list 0; state 1 on no list.
LIST_OF_STATE = np.array([0, -1], dtype=np.int8)


def _touch(ids: list[int], *, limit: int, pins: np.ndarray, chunk_pins: np.ndarray,
           recency: Recency, last_use: np.ndarray, tick: int) -> np.ndarray:
    batch = np.array(ids, dtype=np.intp)
    states = np.zeros(N_BLOCKS, dtype=np.uint8)
    states.flags.writeable = False
    out = np.full(4, -7, dtype=np.int64)
    touch_kernel(batch, states, recency.list_of_state, last_use, tick, recency.prev,
                 recency.next, recency.head, recency.tail, np.zeros(batch.size, dtype=np.uint32),
                 pins, chunk_pins, SHIFT, limit, recency.linked_run, out, False)
    return out


def _fresh() -> tuple[Recency, np.ndarray, np.ndarray, np.ndarray]:
    recency = Recency(N_BLOCKS, LIST_OF_STATE)
    ids = np.arange(N_BLOCKS, dtype=np.intp)
    recency.moved(ids, np.ones(N_BLOCKS, dtype=np.uint8), np.zeros(N_BLOCKS, dtype=np.uint8))
    return (recency, np.zeros(N_BLOCKS, dtype=np.uint32), np.zeros(N_BLOCKS, dtype=np.uint16),
            np.zeros((N_BLOCKS >> SHIFT) + 1, dtype=np.uint16))


def _order(recency: Recency) -> list[int]:
    block, order = int(recency.head[0]), []
    while block >= 0:
        order.append(block)
        block = int(recency.next[block])
    return order


@FIXTURE_OK
@given(first=st.integers(0, N_BLOCKS - 1), data=st.data())
def test_a_run_is_pinned_by_whole_chunks_and_moved_to_the_young_end(
        jit_backend: str, first: int, data: st.DataObject) -> None:
    """A lease's touch of consecutive ids pins each whole chunk inside them once and each id
    outside those chunks once, so every block holds exactly one pin more, and leaves the ids
    at the young end of their list in order, stamped with the tick."""
    count = data.draw(st.integers(1, N_BLOCKS - first), label="count")
    recency, last_use, pins, chunk_pins = _fresh()
    ids = list(range(first, first + count))
    out = _touch(ids, limit=5, pins=pins, chunk_pins=chunk_pins, recency=recency,
                 last_use=last_use, tick=9)
    lo_chunk, hi_chunk = chunk_bounds(first, count, SHIFT)
    assert out.tolist() == [-1, -1, int(hi_chunk > lo_chunk), 1]
    held = pins.astype(np.int64) + np.repeat(chunk_pins, 1 << SHIFT)[:N_BLOCKS]
    expected = np.zeros(N_BLOCKS, dtype=np.int64)
    expected[ids] = 1
    assert held.tolist() == expected.tolist()
    assert _order(recency)[-count:] == ids and (last_use[ids] == 9).all()
    assert not recency.problems(np.zeros(N_BLOCKS, dtype=np.uint8), last_use)


@FIXTURE_OK
@given(first=st.integers(0, N_BLOCKS - 1), count=st.integers(1, 24), seed=st.integers(0, 99),
       run=st.booleans(), full=st.integers(0, 23), outside=st.booleans())
def test_a_refused_touch_changes_nothing(jit_backend: str, first: int, count: int, seed: int,
                                        run: bool, full: int, outside: bool) -> None:
    """Where a counter the pass would add to (a block's own pins, or its chunk's inside a
    run) is already at the limit, or one id lies outside the blocks, the touch refuses,
    naming the first index it concerns, and no pin, stamp or link changed."""
    # One run of consecutive ids (often spanning whole chunks), or the same ids shuffled.
    ids = list(range(first, min(first + count, N_BLOCKS)))
    if not run:
        ids = np.random.default_rng(seed).permutation(ids).tolist()
    recency, last_use, pins, chunk_pins = _fresh()
    at = full % len(ids)
    # Ids inside a whole chunk of their run of consecutive ids are pinned through the chunk.
    inside, _ = run_chunks(np.array(ids, dtype=np.intp), SHIFT)
    chunk = ids[at] >> SHIFT
    if outside:
        ids[at] = N_BLOCKS
    elif inside[at]:
        # Inside a run's whole chunk the pass pins the chunk: that counter is at the limit,
        # and the first id it concerns is the chunk's first.
        chunk_pins[chunk] = 2
        at = ids.index(chunk << SHIFT)
    else:
        pins[ids[at]] = 2
    before = (pins.copy(), chunk_pins.copy(), last_use.copy(), recency.prev.copy(),
              recency.next.copy(), recency.head.copy(), recency.tail.copy())
    out = _touch(ids, limit=2, pins=pins, chunk_pins=chunk_pins, recency=recency,
                 last_use=last_use, tick=9)
    assert (out[0], out[1]) == ((at, -1) if outside else (-1, at))
    after = (pins, chunk_pins, last_use, recency.prev, recency.next, recency.head, recency.tail)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_plain_touch_pins_nothing(jit_backend: str) -> None:
    recency, last_use, pins, chunk_pins = _fresh()
    out = _touch([3, 4, 5], limit=NO_PINNING, pins=pins, chunk_pins=chunk_pins,
                 recency=recency, last_use=last_use, tick=4)
    assert out.tolist() == [-1, -1, 0, 0]
    assert not pins.any() and not chunk_pins.any() and _order(recency)[-3:] == [3, 4, 5]


def _runs(data: st.DataObject) -> list[int]:
    """A few runs of consecutive ids, disjoint, in any order (a commit that made room)."""
    cuts = sorted(data.draw(st.sets(st.integers(0, N_BLOCKS), min_size=2, max_size=6),
                            label="cuts"))
    runs = [list(range(a, data.draw(st.integers(a, b), label="end")))
            for a, b in itertools.pairwise(cuts)]
    order = data.draw(st.permutations(range(len(runs))), label="order")
    return [block for i in order for block in runs[i]]


@FIXTURE_OK
@given(data=st.data())
def test_several_runs_are_each_pinned_by_their_whole_chunks_and_given_back_exactly(
        jit_backend: str, data: st.DataObject) -> None:
    """A lease's touch of several runs of consecutive ids pins each whole chunk inside a run
    once and every other id once, so every block holds exactly one pin more; the unpin with
    the touch's answer gives back exactly that, leaving every counter as it was."""
    ids = _runs(data)
    if not ids:
        return
    recency, last_use, pins, chunk_pins = _fresh()
    out = _touch(ids, limit=5, pins=pins, chunk_pins=chunk_pins, recency=recency,
                 last_use=last_use, tick=9)
    _, chunks = run_chunks(np.array(ids, dtype=np.intp), SHIFT)
    consecutive = ids == list(range(ids[0], ids[0] + len(ids)))
    assert out[:2].tolist() == [-1, -1]
    assert out[2] == ((ONE_RUN if consecutive else RUNS) if chunks.size else 0)
    assert int(chunk_pins.sum()) == chunks.size
    held = pins.astype(np.int64) + np.repeat(chunk_pins, 1 << SHIFT)[:N_BLOCKS]
    expected = np.zeros(N_BLOCKS, dtype=np.int64)
    expected[ids] = 1
    assert held.tolist() == expected.tolist()
    batch = np.array(ids, dtype=np.intp)
    epoch = np.zeros(N_BLOCKS, dtype=np.uint32)
    epoch.flags.writeable = False
    for unpin in (unpin_loop, unpin_twin):  # the one-pass give-back's loop, and its twin
        given, given_chunks = pins.copy(), chunk_pins.copy()
        unpin(batch, np.zeros(batch.size, dtype=np.uint32), epoch, given, given_chunks, SHIFT,
              int(out[2]))
        assert not given.any() and not given_chunks.any()


@FIXTURE_OK
@given(data=st.data())
def test_a_touch_trusting_the_record_of_a_linked_run_moves_what_reading_the_links_moves(
        jit_backend: str, data: st.DataObject) -> None:
    """Through any touches (runs of consecutive ids, several runs, shuffled ids; pinning or
    not), the record of a run linked in order stays true of the links, and each touch leaves
    the links, stamps and pins exactly as the same touch with no record (which reads every
    link): the record only spares reading them."""
    recency, last_use, pins, chunk_pins = _fresh()
    plain, plain_use, plain_pins, plain_chunks = _fresh()
    for tick in range(1, data.draw(st.integers(1, 8), label="touches") + 1):
        ids = data.draw(st.one_of(
            st.builds(lambda a, n: list(range(a, min(a + n, N_BLOCKS))),
                      st.integers(0, N_BLOCKS - 1), st.integers(1, N_BLOCKS)),
            st.builds(_runs, st.just(data)),
            st.permutations(range(N_BLOCKS)).map(lambda p: list(p[:5]))), label="ids")
        if not ids:
            continue
        limit = data.draw(st.sampled_from([NO_PINNING, 50]), label="limit")
        plain.linked_run[:] = (0, 0, -1)  # reads every link
        out = _touch(ids, limit=limit, pins=pins, chunk_pins=chunk_pins, recency=recency,
                     last_use=last_use, tick=tick)
        plain_out = _touch(ids, limit=limit, pins=plain_pins, chunk_pins=plain_chunks,
                           recency=plain, last_use=plain_use, tick=tick)
        assert out.tolist() == plain_out.tolist()
        for mine, theirs in ((recency.prev, plain.prev), (recency.next, plain.next),
                             (recency.head, plain.head), (recency.tail, plain.tail),
                             (last_use, plain_use), (pins, plain_pins),
                             (chunk_pins, plain_chunks)):
            assert mine.tolist() == theirs.tolist()
        assert not recency.problems(np.zeros(N_BLOCKS, dtype=np.uint8), last_use)
