"""A use of blocks in one compiled pass: each is stamped with the use's tick and moved to the
young end of its recency list (:mod:`kvfsm.state._recency`), and, for a lease, pinned once
more first; and the loop that gives a lease's pins back (:func:`unpin_loop`).
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import inlined, kernel, read_only

IdArray = NDArray[np.intp]
#: ``list_of_state`` value of a state whose blocks sit on no recency list.
NO_LIST: Final = -1
#: Pin limit that asks a touch to pin nothing.
NO_PINNING: Final = 0


#: A group's record (``linked_run``) of one run of consecutive ids linked in order on one
#: list: first id, length (0: none), list. A touch finding such a batch records it; a touch or
#: relink of any other batch holding an id of the run forgets it (only moving one of its
#: blocks can break its links), so ids inside the record are linked in order unread.
RUN_FIRST: Final = 0
RUN_COUNT: Final = 1
RUN_LIST: Final = 2


def no_linked_run() -> NDArray[np.int64]:
    """A new group's record: no run (``RUN_FIRST``, ``RUN_COUNT``, ``RUN_LIST``)."""
    return np.array([0, 0, NO_LIST], dtype=np.int64)


#: ``out[2]`` of a pinning touch, and the ``run`` of its unpin: how the pins were taken.
ONE_BY_ONE: Final = 0
#: One run of consecutive ids: its whole chunks in ``chunk_pins``, its two ends one by one.
ONE_RUN: Final = 1
#: Several runs: each run spanning a whole chunk as :data:`ONE_RUN`, every other id alone.
RUNS: Final = 2


def run_chunks(ids: IdArray, shift: int) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:
    """How a pinning touch pins the distinct ``ids``: per id, whether it lies in a whole chunk
    (of ``1 << shift`` ids) inside its maximal run of consecutive ids (pinned through the
    chunk; every other id alone), and those chunks, in prompt order."""
    count = ids.size
    if not count:
        return np.zeros(0, dtype=np.bool_), np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [count])))
    firsts = ids[starts].astype(np.int64)
    lo = (firsts + (1 << shift) - 1) >> shift
    hi = (firsts + lengths) >> shift
    run_of = np.repeat(np.arange(starts.size), lengths)
    inside = (hi[run_of] > lo[run_of]) & (ids >= lo[run_of] << shift) & \
        (ids < hi[run_of] << shift)
    whole = hi > lo
    chunks = np.concatenate([np.arange(a, b, dtype=np.int64)
                             for a, b in zip(lo[whole].tolist(), hi[whole].tolist(),
                                             strict=True)] or [np.zeros(0, dtype=np.int64)])
    return inside, chunks


def _touch_loop(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                linked_run: NDArray[np.int64], out: NDArray[np.int64]) -> None:
    """:func:`_touch_known` of a batch nothing is known of."""
    _touch_known(ids, states, list_of_state, last_use, tick, prev, next_, head, tail, seen,
                 pins, chunk_pins, shift, max_pins, linked_run, out, False)


def _touch_known(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                 last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                 next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                 seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                 chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                 linked_run: NDArray[np.int64], out: NDArray[np.int64], one_run: bool) -> None:
    """Blocks ``ids`` were used at ``tick``, in batch order: each gets ``last_use`` ``tick``
    and, where its state puts it on a list, moves to that list's tail (``linked_run``: see
    :data:`RUN_FIRST`). With ``max_pins`` above 0 the distinct ``ids`` are first pinned once
    more each, as :func:`run_chunks` says; ``out[2]`` tells how (:data:`ONE_BY_ONE` ...),
    ``out[3]`` whether the ids are consecutive and ``seen`` all one value.

    ``out[0]``: -1, or the index of the first id outside the blocks; ``out[1]``: -1, or the
    first index whose block (or chunk) already holds ``max_pins`` pins. On either refusal
    nothing changes. ``one_run``: the caller knows the ids are consecutive and ``seen`` all
    one value, so neither is read: the run's range is checked from its ends."""
    n = last_use.size
    out[0], out[1], out[2], out[3] = -1, -1, 0, 0
    count = ids.size
    if count == 0:
        return
    first = ids[0]
    off = 0
    if not one_run:
        for i in range(count):
            off |= ids[i] - (first + i)
    consecutive = off == 0 and first >= 0 and first + count <= n
    # One run of one list in batch order is spliced to the tail whole: the order moving each
    # in turn would leave. Linked blocks share a list, so only the first's is looked up.
    run = False
    listed = -1
    known_first, known_count = linked_run[RUN_FIRST], linked_run[RUN_COUNT]
    known_end = known_first + known_count
    overlaps = False
    if consecutive:
        listed = list_of_state[states[first]]
        overlaps = known_count > 0 and first < known_end and known_first < first + count
        if count > 1 and listed >= 0:
            if known_count > 0 and linked_run[RUN_LIST] == listed and \
                    known_first <= first and first + count <= known_end:
                run = True  # inside the recorded run: linked in order, no link read
            else:
                links = next_[first:first + count - 1]
                linked = 0
                for i in range(links.size):
                    linked |= links[i] - (first + i + 1)
                run = linked == 0
    else:
        run = count > 1
        for i in range(count):
            block = ids[i]
            if block < 0 or block >= n:
                out[0] = i
                return
            if known_first <= block < known_end:
                overlaps = True
            if not run:
                continue
            if i == 0:
                listed = list_of_state[states[block]]
                run = listed >= 0
            else:
                run = next_[ids[i - 1]] == block
    if max_pins > 0:
        differ = 0
        if not one_run:
            base = seen[0]
            for i in range(seen.size):
                differ |= seen[i] ^ base
        out[3] = consecutive and differ == 0
        if not _pin_runs(ids, consecutive, pins, chunk_pins, shift, max_pins, out):
            return
    if run and consecutive:
        linked_run[RUN_FIRST], linked_run[RUN_COUNT], linked_run[RUN_LIST] = first, count, \
            listed
    elif overlaps:
        linked_run[RUN_FIRST], linked_run[RUN_COUNT], linked_run[RUN_LIST] = 0, 0, NO_LIST
    if run:
        _splice_to_tail(ids, consecutive, listed, tick, last_use, prev, next_, head, tail)
    else:
        _each_to_tail(ids, states, list_of_state, tick, last_use, prev, next_, head, tail)


@inlined
def _pin_runs(ids: IdArray, consecutive: bool, pins: NDArray[np.uint16],
              chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
              out: NDArray[np.int64]) -> bool:
    """Pin the distinct ``ids`` once more each (``consecutive``: they are one run): each
    maximal run's whole chunks of ``1 << shift`` ids in ``chunk_pins``, every other id in
    ``pins``; ``out[2]`` says how (:data:`ONE_BY_ONE`, :data:`ONE_RUN`, :data:`RUNS`). The
    limits are checked first, in prompt order: where a block (or its chunk) already holds
    ``max_pins``, ``out[1]`` is its index, nothing is pinned and the answer is False."""
    count = ids.size
    chunked = False
    for phase in range(2):
        i = 0
        while i < count:
            start = ids[i]
            j = count
            if not consecutive:
                j = i + 1
                while j < count and ids[j] == ids[j - 1] + 1:
                    j += 1
            lo = (start + (1 << shift) - 1) >> shift
            hi = (start + (j - i)) >> shift
            if hi > lo:
                chunked = True
                head_end, tail_start, end = lo << shift, hi << shift, start + (j - i)
                if phase == 0:
                    for block in range(start, head_end):
                        if pins[block] >= max_pins:
                            out[1] = i + block - start
                            return False
                    for chunk in range(lo, hi):
                        if chunk_pins[chunk] >= max_pins:
                            out[1] = i + (chunk << shift) - start
                            return False
                    for block in range(tail_start, end):
                        if pins[block] >= max_pins:
                            out[1] = i + block - start
                            return False
                else:
                    for block in range(start, head_end):
                        pins[block] += 1
                    for chunk in range(lo, hi):
                        chunk_pins[chunk] += 1
                    for block in range(tail_start, end):
                        pins[block] += 1
            else:
                for k in range(i, j):
                    if phase == 0:
                        if pins[ids[k]] >= max_pins:
                            out[1] = k
                            return False
                    else:
                        pins[ids[k]] += 1
            i = j
    if chunked:
        out[2] = ONE_RUN if consecutive else RUNS
    return True


@inlined
def _span_to_tail(first: int, last: int, listed: int, prev: NDArray[np.int32],
                  next_: NDArray[np.int32], head: NDArray[np.int32],
                  tail: NDArray[np.int32]) -> None:
    """Move the blocks linked from ``first`` to ``last`` on list ``listed``, ``last`` not its
    tail, to the list's tail in their order."""
    after, before = next_[last], prev[first]
    if before >= 0:
        next_[before] = after
    else:
        head[listed] = after
    prev[after] = before
    end = tail[listed]
    next_[end] = first
    prev[first] = end
    next_[last] = -1
    tail[listed] = last


@inlined
def _splice_to_tail(ids: IdArray, consecutive: bool, listed: int, tick: int,
                    last_use: NDArray[np.uint32], prev: NDArray[np.int32],
                    next_: NDArray[np.int32], head: NDArray[np.int32],
                    tail: NDArray[np.int32]) -> None:
    """Stamp ``ids`` (one run linked in order on list ``listed``) with ``tick`` and move the
    run to the list's tail whole: O(1) moves, the order moving each in turn would leave."""
    count = ids.size
    first, last = ids[0], ids[count - 1]
    if consecutive:
        last_use[first:first + count] = tick
    else:
        for i in range(count):
            last_use[ids[i]] = tick
    if next_[last] >= 0:  # else at the tail already
        _span_to_tail(first, last, listed, prev, next_, head, tail)


@inlined
def _each_to_tail(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                  tick: int, last_use: NDArray[np.uint32], prev: NDArray[np.int32],
                  next_: NDArray[np.int32], head: NDArray[np.int32],
                  tail: NDArray[np.int32]) -> None:
    """Stamp each of ``ids`` with ``tick`` and move it, in batch order, to the tail of the
    list its state puts it on (none: left where it is)."""
    for i in range(ids.size):
        block = ids[i]
        last_use[block] = tick
        listed = list_of_state[states[block]]
        if listed >= 0 and next_[block] >= 0:  # else on no list, or its list's tail already
            _span_to_tail(block, block, listed, prev, next_, head, tail)


def unpin_loop(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
               pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
               run: int) -> None:
    """Give back what a pinning touch pinned on the distinct blocks ``ids`` (``run``: its
    ``out[2]``): one pin less on each whole chunk of a run, and on each other block still at
    its epoch ``recorded[i]`` (a moved block lost its pin with its content: another owner's
    pin is never taken); never below 0."""
    count = ids.size
    i = 0
    while i < count:
        # The next run as the touch found it.
        start = ids[i]
        j = count
        if run == RUNS:
            j = i + 1
            while j < count and ids[j] == ids[j - 1] + 1:
                j += 1
        lo = (start + (1 << shift) - 1) >> shift
        hi = (start + (j - i)) >> shift
        # Blocks pinned one by one: ``[i, head)`` and ``[tail, j)``.
        head, tail = j, j
        if run != ONE_BY_ONE and hi > lo:
            for chunk in range(lo, hi):
                if chunk_pins[chunk] > 0:
                    chunk_pins[chunk] -= 1
            head, tail = i + (lo << shift) - start, i + (hi << shift) - start
        for k in range(i, head):
            block = ids[k]
            if epoch[block] == recorded[k] and pins[block] > 0:
                pins[block] -= 1
        for k in range(tail, j):
            block = ids[k]
            if epoch[block] == recorded[k] and pins[block] > 0:
                pins[block] -= 1
        i = j


def _unpin_twin(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
                pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
                run: int) -> None:
    """:func:`unpin_loop` as array operations."""
    if run != ONE_BY_ONE:
        inside, chunks = run_chunks(ids, shift)
        chunks = chunks[chunk_pins[chunks] > 0]
        chunk_pins[chunks] -= np.uint16(1)
        ids, recorded = ids[~inside], recorded[~inside]
    unmoved = ids[epoch[ids] == recorded]
    held = unmoved[pins[unmoved] > 0]
    pins[held] -= np.uint16(1)


def _touch_twin(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                linked_run: NDArray[np.int64], out: NDArray[np.int64]) -> None:
    """:func:`_touch_loop` in NumPy (the reference), every link read."""
    # Imported here: the recency lists' module uses this one's kernel.
    from kvfsm.state._recency import relink_loop

    out[:4] = (-1, -1, 0, 0)
    outside = np.flatnonzero((ids < 0) | (ids >= last_use.size))
    if outside.size:
        out[0] = outside[0]
        return
    count = ids.size
    known_first, known_count = int(linked_run[RUN_FIRST]), int(linked_run[RUN_COUNT])
    overlaps = bool(((ids >= known_first) & (ids < known_first + known_count)).any())
    consecutive = count > 0 and bool((ids == ids[0] + np.arange(count)).all())
    listed_first = int(list_of_state[states[ids[0]]]) if count else NO_LIST
    in_order = count > 1 and listed_first != NO_LIST and consecutive and \
        bool((next_[ids[:-1]] == ids[1:]).all())
    if max_pins > 0 and count:
        out[3] = consecutive and bool((seen == seen[0]).all())
        inside, chunks = run_chunks(ids, shift)
        ends = ~inside
        full = np.flatnonzero(inside & (chunk_pins[ids >> shift] >= max_pins)
                              | ends & (pins[ids] >= max_pins))
        if full.size:
            out[1] = full[0]
            return
        if chunks.size:
            chunk_pins[chunks] += np.uint16(1)
            out[2] = ONE_RUN if consecutive else RUNS
        pins[ids[ends]] += np.uint16(1)
    if in_order:
        linked_run[:] = (ids[0], count, listed_first)
    elif overlaps:
        linked_run[:] = (0, 0, NO_LIST)
    last_use[ids] = tick
    lists = list_of_state[states[ids]]
    on = np.flatnonzero(lists != NO_LIST)
    # The record is this touch's own (set above): the relinks are not to forget it.
    relink_loop(prev, next_, head, tail, ids[on], lists[on], lists[on], no_linked_run())


def _touch_example() -> tuple[object, ...]:
    nodes = np.full(2, -1, dtype=np.int32)
    # The call site passes the machine's read-only state view.
    return (np.zeros(1, dtype=np.intp), read_only(np.zeros(2, dtype=np.uint8)),
            np.full(1, NO_LIST, dtype=np.int8), np.zeros(2, dtype=np.uint32), 1, nodes,
            nodes.copy(), nodes[:1].copy(), nodes[:1].copy(), np.zeros(1, dtype=np.uint32),
            np.zeros(2, dtype=np.uint16), np.zeros(1, dtype=np.uint16), 6, NO_PINNING,
            no_linked_run(), np.zeros(4, dtype=np.int64))


#: What a kernel running the touch calls (compiled into it).
TOUCH_CALLS: Final = (_touch_known, _pin_runs, _span_to_tail, _splice_to_tail, _each_to_tail)

touch_kernel = kernel(example=_touch_example, twin=_touch_twin,
                      calls=TOUCH_CALLS)(_touch_loop)
