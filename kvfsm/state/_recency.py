"""Recency lists: the blocks a give-back may take, least recently used first, at the cost of
the blocks moved or walked, never the pool.

Eviction wants the oldest unpinned blocks of a class (device blocks left invalid, readable
device blocks, blocks resting in a lower tier); sorting ``last_use`` over the pool costs the
pool on every call (15 ms at a million blocks per group). Instead every block that belongs to
a class sits on that class's list, threaded through two arrays of one entry per block:

* ``prev[block]``, ``next[block]``: its neighbours on its list (-1 at either end, and both -1
  when the block is on no list);
* ``head[list]``, ``tail[list]``: the oldest and the newest block of each list (-1 empty).

A block's list follows from its lifecycle state (:attr:`Recency.list_of_state`), so a move
that changes the list unlinks the block and appends it at the tail, a touch moves it to the
tail, and both cost O(1) per block. The owner stamps ``last_use`` on both (a block entering a
list is as recent as the latest touch), so every list is in non-decreasing ``last_use`` order:
walking from the head meets blocks oldest first. A walk skips pinned and excluded blocks, so
it costs the blocks it returns plus those it skips (pinned ones, the caller's own).

A touch finding consecutive ids linked in order (a prompt's blocks, touched together before)
records that run (:attr:`Recency.linked_run`), so a later touch of ids inside it, a lease of a
prompt leased before, reads none of their links; moving any block of the run forgets it.

Memory: 8 bytes per block (two int32), plus 8 per list and 24 for the record.

Backends: the loops are kernels (:mod:`kvfsm._jit`) whose twins are the loops themselves as
plain Python (splicing lists has no NumPy form); each call touches only the blocks given or
walked. A touch (every lease, pin and allocation) is one kernel call doing all of it: the range
check, the ``last_use`` stamp, each block's list from its state, and the move to the tail (its
twin does all but the moves as array operations); see :mod:`kvfsm.state._touch`, where a
lease's take also pins in the same pass.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel

# NO_LIST is the lists' own value, defined beside the touch pass that reads it.
from kvfsm.state._touch import NO_LIST as NO_LIST
from kvfsm.state._touch import (
    NO_PINNING,
    RUN_COUNT,
    RUN_FIRST,
    RUN_LIST,
    no_linked_run,
    touch_kernel,
)

IdArray = NDArray[np.intp]
#: Entries of a walk's first answer buffer (it doubles as answers need).
_FIRST_BUFFER: Final = 64
#: A touch that pins nothing reads neither epochs nor pins.
_NOTHING_SEEN: Final = np.zeros(0, dtype=np.uint32)
_NO_PINS: Final = np.zeros(0, dtype=np.uint16)


def relink_loop(prev: NDArray[np.int32], next_: NDArray[np.int32], head: NDArray[np.int32],
                tail: NDArray[np.int32], ids: IdArray, source: NDArray[np.int8],
                dest: NDArray[np.int8], linked_run: NDArray[np.int64]) -> None:
    """Per ``ids[i]`` in order: take it off list ``source[i]`` (none when -1), then append it
    at the tail of list ``dest[i]`` (none when -1). A touch gives the same list twice: the
    block moves to the tail; an id given twice ends where its last entry puts it. An id inside
    the run ``linked_run`` records as linked in order forgets the record (its move may break
    the run's links; moving any other block changes none of them)."""
    known_first = linked_run[RUN_FIRST]
    known_end = known_first + linked_run[RUN_COUNT]
    for i in range(ids.size):
        block = ids[i]
        if known_first <= block < known_end:
            linked_run[RUN_FIRST], linked_run[RUN_COUNT], linked_run[RUN_LIST] = 0, 0, NO_LIST
            known_first = known_end = 0
        old = source[i]
        if old >= 0:
            before = prev[block]
            after = next_[block]
            if before >= 0:
                next_[before] = after
            else:
                head[old] = after
            if after >= 0:
                prev[after] = before
            else:
                tail[old] = before
            prev[block] = -1
            next_[block] = -1
        new = dest[i]
        if new >= 0:
            last = tail[new]
            prev[block] = last
            next_[block] = -1
            if last >= 0:
                next_[last] = block
            else:
                head[new] = block
            tail[new] = block


def _walk_loop(next_: NDArray[np.int32], start: int, pins: NDArray[np.uint16],
               chunk_pins: NDArray[np.uint16], shift: int, excluded: NDArray[np.bool_],
               out: IdArray, counts: NDArray[np.int64]) -> None:
    """From ``start`` along ``next_``: write up to ``out.size`` blocks with no pin (of their
    own, or on the chunk of ``1 << shift`` ids holding them) and not ``excluded`` (an empty
    ``excluded`` excludes none) into ``out``; ``counts[0]`` gets how many, ``counts[1]`` how
    many blocks were walked (kept or skipped)."""
    found = 0
    walked = 0
    block = start
    check = excluded.size > 0
    limit = next_.size
    while block >= 0 and found < out.size and walked <= limit:
        walked += 1
        if pins[block] == 0 and chunk_pins[block >> shift] == 0 and \
                not (check and excluded[block]):
            out[found] = block
            found += 1
        block = next_[block]
    counts[0] = found
    counts[1] = walked


def random_lists(rng: np.random.Generator) -> tuple[
        NDArray[np.int32], NDArray[np.int32], NDArray[np.int32], NDArray[np.int32],
        NDArray[np.int8]]:
    """Sound lists over a few blocks: ``prev``, ``next``, ``head``, ``tail``, and each block's
    list (-1: on none)."""
    n, n_lists = int(rng.integers(1, 12)), int(rng.integers(1, 4))
    prev, next_ = np.full(n, -1, dtype=np.int32), np.full(n, -1, dtype=np.int32)
    head, tail = np.full(n_lists, -1, dtype=np.int32), np.full(n_lists, -1, dtype=np.int32)
    member = rng.integers(-1, n_lists, n).astype(np.int8)
    order = rng.permutation(n).astype(np.intp)
    relink_loop(prev, next_, head, tail, order, np.full(n, -1, dtype=np.int8), member[order],
                no_linked_run())
    return prev, next_, head, tail, member


def _relink_example() -> tuple[object, ...]:
    nodes = np.full(2, -1, dtype=np.int32)
    lists = np.full(1, -1, dtype=np.int8)
    return (nodes, nodes.copy(), nodes[:1].copy(), nodes[:1].copy(), np.zeros(1, dtype=np.intp),
            lists, lists.copy(), no_linked_run())


def _relink_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    prev, next_, head, tail, member = random_lists(rng)
    ids = rng.integers(0, prev.size, int(rng.integers(0, 8))).astype(np.intp)
    # Each id leaves the list it is on (as it was before this batch): repeats are given the
    # list their earlier entry put them on.
    source, dest = np.empty(ids.size, dtype=np.int8), np.empty(ids.size, dtype=np.int8)
    where = member.copy()
    for i, block in enumerate(ids.tolist()):
        source[i] = where[block]
        dest[i] = rng.integers(-1, head.size)
        where[block] = dest[i]
    # A record of some run (the relink forgets it where an id lies in it; the record need not
    # be true here: the relink reads no link by it).
    first = int(rng.integers(0, prev.size))
    linked_run = np.array([first, int(rng.integers(0, prev.size - first + 1)),
                           int(rng.integers(-1, head.size))], dtype=np.int64)
    return prev, next_, head, tail, ids, source, dest, linked_run


def _walk_example() -> tuple[object, ...]:
    return (np.full(2, -1, dtype=np.int32), 0, np.zeros(2, dtype=np.uint16),
            np.zeros(1, dtype=np.uint16), 6, np.zeros(0, dtype=np.bool_),
            np.zeros(1, dtype=np.intp), np.zeros(2, dtype=np.int64))


def _walk_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    _, next_, head, _, _ = random_lists(rng)
    n = next_.size
    pins = (rng.random(n) < 0.3).astype(np.uint16)
    shift = int(rng.integers(0, 3))
    chunk_pins = (rng.random((n >> shift) + 1) < 0.2).astype(np.uint16)
    excluded = rng.random(n if rng.random() < 0.5 else 0) < 0.3
    out = np.zeros(int(rng.integers(0, n + 1)), dtype=np.intp)
    return (next_, int(head[int(rng.integers(0, head.size))]), pins, chunk_pins, shift,
            excluded, out, np.zeros(2, dtype=np.int64))


relink_kernel = kernel(example=_relink_example, twin=relink_loop,
                       inputs=_relink_inputs)(relink_loop)
walk_kernel = kernel(example=_walk_example, twin=_walk_loop, inputs=_walk_inputs)(_walk_loop)


class Clock:
    """A core's use counter, shared by its groups: :meth:`advance` for every touch; blocks
    joining a recency list are stamped with :attr:`now`, the latest."""

    def __init__(self) -> None:
        self.now = 0

    def advance(self, ticks: int = 1) -> int:
        """The next tick (every touch takes one; a pass that touched ``ticks`` groups in
        turn took that many)."""
        self.now += ticks
        return self.now


class Recency:
    """One recency list per class of lifecycle states over ``n`` blocks; ``list_of_state``
    gives each state's list (:data:`NO_LIST`: none)."""

    def __init__(self, n: int, list_of_state: NDArray[np.int8]) -> None:
        if n >= 2**31:
            raise ValueError(f"block ids are int32 here; {n} blocks do not fit")
        self.n = n
        self.list_of_state = np.asarray(list_of_state, dtype=np.int8)
        self.n_lists = int(self.list_of_state.max(initial=NO_LIST)) + 1
        self.prev = np.full(n, -1, dtype=np.int32)
        self.next = np.full(n, -1, dtype=np.int32)
        self.head = np.full(self.n_lists, -1, dtype=np.int32)
        self.tail = np.full(self.n_lists, -1, dtype=np.int32)
        #: The record of one run of consecutive ids linked in order on one list
        #: (:data:`~kvfsm.state._touch.RUN_FIRST` ...): a touch inside it reads no link.
        self.linked_run = no_linked_run()
        self._counts = np.zeros(2, dtype=np.int64)
        self._out = np.zeros(4, dtype=np.int64)
        self._found = np.empty(_FIRST_BUFFER, dtype=np.intp)
        #: Blocks the last :meth:`oldest` walked (kept or skipped), for tests of its cost.
        self.last_walked = 0

    @property
    def nbytes(self) -> int:
        return (self.prev.nbytes + self.next.nbytes + self.head.nbytes + self.tail.nbytes
                + self.linked_run.nbytes + self._found.nbytes + self._counts.nbytes
                + self._out.nbytes)

    def moved(self, ids: IdArray, before: NDArray[np.uint8], after: NDArray[np.uint8]
              ) -> IdArray:
        """Blocks ``ids`` moved from states ``before`` to ``after``: those whose list changed
        leave the old one and join the new one's tail. Returns the ids that joined a list."""
        source, dest = self.list_of_state[before], self.list_of_state[after]
        changed = np.flatnonzero(source != dest)
        if not changed.size:
            return ids[:0]
        relink_kernel(self.prev, self.next, self.head, self.tail, ids[changed],
                      source[changed], dest[changed], self.linked_run)
        joined: IdArray = ids[changed[dest[changed] != NO_LIST]]
        return joined

    def touch(self, ids: IdArray, states: NDArray[np.uint8], last_use: NDArray[np.uint32],
              tick: int) -> int:
        """Blocks ``ids`` were used at ``tick``: each gets it in ``last_use`` and, where its
        state (``states``: every block's) puts it on a list, moves to that list's tail, in
        batch order; one compiled pass. Returns the index in ``ids`` of the first id outside
        the blocks, having changed nothing, or -1."""
        touch_kernel(ids, states, self.list_of_state, last_use, tick, self.prev, self.next,
                     self.head, self.tail, _NOTHING_SEEN, _NO_PINS, _NO_PINS, 0, NO_PINNING,
                     self.linked_run, self._out, False)
        return int(self._out[0])

    def oldest(self, list_id: int, count: int, pins: NDArray[np.uint16],
               chunk_pins: NDArray[np.uint16], shift: int,
               excluded: NDArray[np.bool_] | None = None, *, after: int = -1) -> IdArray:
        """Up to ``count`` blocks of list ``list_id``, oldest first, skipping pinned ones (a
        pin of their own in ``pins``, or one on their chunk of ``1 << shift`` ids in
        ``chunk_pins``) and those ``excluded`` marks; ``after`` (a block on the list) starts
        the walk past it instead of at the head. Costs the blocks returned and skipped:
        the answer is walked
        into a buffer grown geometrically (a walk that fills it is walked again, twice as
        far), never one sized for ``count``."""
        self.last_walked = 0
        if count <= 0 or not 0 <= list_id < self.n_lists:
            return np.zeros(0, dtype=np.intp)
        skip = np.zeros(0, dtype=np.bool_) if excluded is None else excluded
        start = int(self.head[list_id]) if after < 0 else int(self.next[after])
        while True:
            out = self._found[: min(count, self._found.size)]
            walk_kernel(self.next, start, pins, chunk_pins, shift, skip, out, self._counts)
            self.last_walked += int(self._counts[1])
            found = int(self._counts[0])
            if found < out.size or out.size == count:
                return out[:found].copy()
            self._found = np.empty(2 * self._found.size, dtype=np.intp)

    def problems(self, states: NDArray[np.uint8], last_use: NDArray[np.uint32]) -> list[str]:
        """Faults, empty when sound: each list holds exactly the blocks whose state maps to
        it, linked both ways from head to tail, in non-decreasing ``last_use``; a block on no
        list has no neighbours. Vectorized over every block (an invariant check, not a hot
        path): local links, one head and one tail per list, and no cycle (every block reaches
        its head, by pointer jumping)."""
        out: list[str] = []
        member = self.list_of_state[states].astype(np.int64)
        on = member != NO_LIST
        prev, next_ = self.prev.astype(np.int64), self.next.astype(np.int64)
        loose = np.flatnonzero(~on & ((prev != -1) | (next_ != -1)))
        if loose.size:
            out.append(f"{loose.size} blocks on no list keep neighbours: {loose[:8].tolist()}")
        blocks = np.flatnonzero(on)
        after, before = next_[blocks], prev[blocks]
        linked = after >= 0
        broken = blocks[linked][(prev[after[linked]] != blocks[linked])
                                | (member[after[linked]] != member[blocks[linked]])]
        linked = before >= 0
        broken = np.union1d(broken, blocks[linked][
            (next_[before[linked]] != blocks[linked])
            | (member[before[linked]] != member[blocks[linked]])])
        if broken.size:
            out.append(f"blocks {broken[:8].tolist()} are not linked both ways within their "
                       "list")
            return out  # the checks below follow the links
        for end, name, link in ((self.head, "head", before), (self.tail, "tail", after)):
            ends = np.full(self.n_lists, -1, dtype=np.int64)
            count = np.bincount(member[blocks[link < 0]], minlength=self.n_lists)
            ends[member[blocks[link < 0]]] = blocks[link < 0]
            bad = np.flatnonzero((count > 1) | (ends != end))
            if bad.size:
                out.append(f"lists {bad.tolist()}: {name}s {end[bad].tolist()}, the blocks "
                           f"their links end at {ends[bad].tolist()} ({count[bad].tolist()})")
        # Pointer jumping along prev: a block that never reaches a head sits on a cycle.
        jump = np.append(np.where(prev >= 0, prev, self.n), self.n)
        for _ in range(max(self.n, 1).bit_length() + 1):
            jump = jump[jump]
        cycled = blocks[jump[blocks] != self.n]
        if cycled.size:
            out.append(f"blocks {cycled[:8].tolist()} sit on a cycle, not on their list")
        linked = after >= 0
        younger = blocks[linked][last_use[after[linked]] < last_use[blocks[linked]]]
        if younger.size:
            out.append(f"blocks {younger[:8].tolist()} are followed by blocks used before them "
                       "(last_use)")
        first, count, listed = self.linked_run.tolist()
        if count and not (first >= 0 and first + count <= self.n and
                          (member[first:first + count] == listed).all() and
                          (next_[first:first + count - 1] ==
                           np.arange(first + 1, first + count)).all()):
            out.append(f"the record of a run linked in order (ids {first}..{first + count - 1} "
                       f"on list {listed}) is not true of the links")
        return out
