"""A use of blocks in one compiled pass: each gets the tick and moves to its recency list's young
end (:mod:`kvfsm.state._recency`), a lease pinning it once more first; :func:`unpin_loop` unpins."""

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

#: A group's ``linked_run``: one run of consecutive ids linked in order on one list (first id,
#: length (0: none), list). Set by a touch of such a batch, forgotten by a touch or relink of
#: another batch sharing an id (only moves break links), so ids inside it need no link read.
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
    """Per distinct id, whether a pinning touch pins it through a whole chunk (``1 << shift`` ids)
    inside its maximal run of consecutive ids (else alone); and those chunks, in prompt order."""
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


def _touch_known(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                 last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                 next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                 seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                 chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                 linked_run: NDArray[np.int64], out: NDArray[np.int64], one_run: bool) -> None:
    """Stamp ``ids`` with ``tick`` in ``last_use`` and move each listed one to its list's tail, in
    batch order (``linked_run``: :data:`RUN_FIRST`); with ``max_pins`` > 0, first pin the distinct
    ids once more (:func:`run_chunks`; ``out[2]``: how; ``out[3]``: ids consecutive and ``seen``
    uniform). ``out[0]`` / ``out[1]``: the first index whose id is outside the blocks / whose block
    (or chunk) already holds ``max_pins`` (-1: none); either refusal changes nothing. With
    ``one_run`` the caller knows ids consecutive and ``seen`` uniform: only the ends are checked."""
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
    run = False  # a run linked in order (one list: the first's) is spliced whole, as moving each
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
def _run_end(ids: IdArray, i: int, consecutive: bool) -> int:
    """The end (exclusive) of the run of consecutive ids from index ``i`` (the batch's, known
    ``consecutive``): the one cut of a batch into runs, for the pin and its give-back alike."""
    count = ids.size
    if consecutive:
        return count
    j = i + 1
    while j < count and ids[j] == ids[j - 1] + 1:
        j += 1
    return j


@inlined
def _whole_chunks(start: int, length: int, shift: int) -> tuple[int, int]:
    """The whole chunks ``[lo, hi)`` (of ``1 << shift`` ids) in ``[start, start + length)``."""
    return (start + (1 << shift) - 1) >> shift, (start + length) >> shift


@inlined
def _pin_runs(ids: IdArray, consecutive: bool, pins: NDArray[np.uint16],
              chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
              out: NDArray[np.int64]) -> bool:
    """Pin the distinct ``ids`` once more (``consecutive``: one run) as :func:`run_chunks` says;
    ``out[2]``: how. Limits are checked first, in prompt order: if a block (or chunk) already
    holds ``max_pins``, ``out[1]`` is its index, nothing is pinned and the answer is False."""
    count = ids.size
    chunked = False
    for phase in range(2):
        i = 0
        while i < count:
            start, j = ids[i], _run_end(ids, i, consecutive)
            lo, hi = _whole_chunks(start, j - i, shift)
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
    """Move linked ``first`` .. ``last`` (``last`` not the tail) to the tail of list ``listed``."""
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
    """Stamp ``ids`` (linked in order on list ``listed``) with ``tick``; splice them to its tail."""
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
    """Stamp each of ``ids`` with ``tick``, moving it in batch order to its list's tail (if any)."""
    for i in range(ids.size):
        block = ids[i]
        last_use[block] = tick
        listed = list_of_state[states[block]]
        if listed >= 0 and next_[block] >= 0:  # else on no list, or its list's tail already
            _span_to_tail(block, block, listed, prev, next_, head, tail)


def unpin_loop(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
               pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
               run: int) -> None:
    """Give back a pinning touch's pins on the distinct ``ids`` (``run``: its ``out[2]``): one less
    on each whole chunk of a run and on each other block still at epoch ``recorded[i]`` (a moved
    block lost its pin with its content; another owner's pin is never taken); never below 0."""
    count = ids.size
    i = 0
    while i < count:
        start, j = ids[i], _run_end(ids, i, run != RUNS)  # the next run, as the touch cut it
        lo, hi = _whole_chunks(start, j - i, shift)
        head, tail = j, j  # blocks pinned one by one: ``[i, head)`` and ``[tail, j)``
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


def _touch_example() -> tuple[object, ...]:
    nodes = np.full(2, -1, dtype=np.int32)
    # The call site passes the machine's read-only state view.
    return (np.zeros(1, dtype=np.intp), read_only(np.zeros(2, dtype=np.uint8)),
            np.full(1, NO_LIST, dtype=np.int8), np.zeros(2, dtype=np.uint32), 1, nodes,
            nodes.copy(), nodes[:1].copy(), nodes[:1].copy(), np.zeros(1, dtype=np.uint32),
            np.zeros(2, dtype=np.uint16), np.zeros(1, dtype=np.uint16), 6, NO_PINNING,
            no_linked_run(), np.zeros(4, dtype=np.int64), False)


#: What a kernel running the touch calls (compiled into it).
TOUCH_CALLS: Final = (_touch_known, _pin_runs, _run_end, _whole_chunks, _span_to_tail,
                     _splice_to_tail, _each_to_tail)
#: What a kernel running the give-back calls.
UNPIN_CALLS: Final = (unpin_loop, _run_end, _whole_chunks)
touch_kernel = kernel(example=_touch_example, calls=TOUCH_CALLS[1:])(_touch_known)
