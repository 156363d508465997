"""A use of blocks in one compiled pass: each is stamped with the use's tick and moved to the
young end of its recency list, and, for a lease taking blocks a lookup has just seen usable,
pinned once more first.

A lease's take used to be two passes per group (pin, then touch), each a kernel call whose
fixed cost, right after a long lookup has pushed everything out of cache, outweighed the work
on the blocks. One pass per group reads the ids once for both: whether they are one run of
consecutive ids (pinned by whole chunks, spliced to the list's tail whole) and whether they lie
in the group. The recency lists themselves are :mod:`kvfsm.state._recency`'s.

The loops that give a lease's pins back (:func:`unpin_loop`) and that take and give back a
lease over every group in one call (:func:`take_probed_loop`, :func:`unpin_probed_loop`, whose
kernels :mod:`kvfsm.state._lease_pass` registers) live here too: they call the touch's loop,
and numba's disk cache recompiles a kernel only when its own file changes.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import unowned, vector_at, views
from kvfsm._jit import kernel, read_only

IdArray = NDArray[np.intp]
#: ``list_of_state`` value of a state whose blocks sit on no recency list.
NO_LIST: Final = -1
#: Pin limit that asks a touch to pin nothing.
NO_PINNING: Final = 0


#: A group's record of one run of consecutive ids linked in order on one recency list
#: (``linked_run``, int64): its first id, its length (0: no record) and its list. A touch that
#: finds a batch of consecutive ids linked in order records them; a touch or a relink of any
#: other batch holding an id of the run forgets it (only moving one of its blocks can break a
#: link between two of them). A touch of ids inside the recorded run then knows they are
#: linked in order without reading their links: a lease of a prompt leased before.
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
    """How a pinning touch pins the distinct ``ids`` by runs: per id, whether it lies in a
    whole chunk (of ``1 << shift`` ids) inside its maximal run of consecutive ids (pinned
    through the chunk), and those chunks, in prompt order. (Every other id is pinned alone.)"""
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
    and, where its state (``states[block]``) puts it on a list, moves to that list's tail.
    ``linked_run``: the group's record of a run linked in order (:data:`RUN_FIRST` ...):
    consecutive ids inside it are known linked in order unread; a batch of consecutive ids
    found linked in order becomes the record, and any other batch holding an id of the
    recorded run forgets it.

    With ``max_pins`` above 0 the distinct ``ids`` (a lease's, seen at epochs ``seen``) are
    first pinned once more each: where they are one run of consecutive ids spanning at least
    one whole chunk of ``1 << shift`` ids, the whole chunks once each in ``chunk_pins`` and
    only the ids at the two ends in ``pins`` (``out[2] = ONE_RUN``: given back so); else each
    of their maximal runs of consecutive ids that spans a whole chunk so, and every other id
    in ``pins`` (``out[2] = RUNS`` where some run was pinned by chunks, else ``ONE_BY_ONE``;
    :func:`run_chunks` says which ids a chunk holds); ``out[3]``: the ids are consecutive and
    ``seen`` all one value (a read the event log writes as one run). ``out[1]``: -1, or the
    first index whose block (or its chunk) already holds ``max_pins`` pins, and then nothing
    changes.

    ``out[0]``: -1, or the index of the first id outside the blocks, and then nothing
    changes. No gathers, masks or index lists: the range and run check, then (pinning) the
    limits and the pins, then the moves; a batch that is one run of one list in batch order
    is spliced to the tail whole.

    ``one_run``: the caller knows the ids are consecutive and ``seen`` all one value (a
    lookup counted them so), and neither is read here: the range of the run is checked
    from its ends."""
    n = last_use.size
    out[0], out[1], out[2], out[3] = -1, -1, 0, 0
    count = ids.size
    if count == 0:
        return
    first = ids[0]
    # Consecutive ids in range (a lease's usual batch): branch-free passes, which vectorize,
    # over the ids and their links.
    off = 0
    if not one_run:
        for i in range(count):
            off |= ids[i] - (first + i)
    consecutive = off == 0 and first >= 0 and first + count <= n
    # Whether the batch is one run of one list in batch order: a lease touches a prompt's
    # blocks, which usually sit so (touched together before), and moving each to the tail in
    # turn leaves that run at the tail, so it is spliced there whole (the same order, O(1)
    # moves). Blocks linked to each other share a list, so only the first's is looked up.
    run = False
    listed = -1
    known_first, known_count = linked_run[RUN_FIRST], linked_run[RUN_COUNT]
    known_end = known_first + known_count
    # Some id of the batch lies in the recorded run (then the record is kept only where the
    # batch becomes the record).
    overlaps = False
    if consecutive:
        listed = list_of_state[states[first]]
        overlaps = known_count > 0 and first < known_end and known_first < first + count
        if count > 1 and listed >= 0:
            if known_count > 0 and linked_run[RUN_LIST] == listed and \
                    known_first <= first and first + count <= known_end:
                run = True  # inside the recorded run: linked in order, no link read
            else:
                # Over a slice: indices from 0 need no negative-index check: it vectorizes.
                links = next_[first:first + count - 1]
                linked = 0
                for i in range(links.size):
                    linked |= links[i] - (first + i + 1)
                run = linked == 0
    else:
        # One pass checks the range, the run and whether an id lies in the recorded run.
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
        # Each maximal run of consecutive ids (all of them where they are consecutive: no
        # scan for breaks) pinned by the whole chunks inside it, its ends and every id of a
        # run without a whole chunk one by one. Several runs come from a commit that made
        # room (freed blocks first, then older free ids). Limits first (phase 0), in prompt
        # order, then the pins (phase 1): nothing moves on a refusal.
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
                                return
                        for chunk in range(lo, hi):
                            if chunk_pins[chunk] >= max_pins:
                                out[1] = i + (chunk << shift) - start
                                return
                        for block in range(tail_start, end):
                            if pins[block] >= max_pins:
                                out[1] = i + block - start
                                return
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
                                return
                        else:
                            pins[ids[k]] += 1
                i = j
        if chunked:
            out[2] = ONE_RUN if consecutive else RUNS
    # The record: this batch where it is consecutive ids linked in order, else none where the
    # batch holds an id of the recorded run (its moves may break the run's links).
    if run and consecutive:
        linked_run[RUN_FIRST], linked_run[RUN_COUNT], linked_run[RUN_LIST] = first, count, \
            listed
    elif overlaps:
        linked_run[RUN_FIRST], linked_run[RUN_COUNT], linked_run[RUN_LIST] = 0, 0, NO_LIST
    if run:
        if consecutive:
            last_use[first:first + count] = tick
        else:
            for i in range(count):
                last_use[ids[i]] = tick
        last = ids[count - 1]
        after = next_[last]
        if after >= 0:  # not at the tail yet
            before = prev[first]
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
        return
    for i in range(count):
        block = ids[i]
        last_use[block] = tick
        listed = list_of_state[states[block]]
        after = next_[block]
        if listed < 0 or after < 0:
            continue  # on no list, or its list's tail already
        before = prev[block]
        if before >= 0:
            next_[before] = after
        else:
            head[listed] = after
        prev[after] = before
        last = tail[listed]  # another block: this one was not the tail
        next_[last] = block
        prev[block] = last
        next_[block] = -1
        tail[listed] = block


def unpin_loop(ids: IdArray, recorded: NDArray[np.uint32], epoch: NDArray[np.uint32],
               pins: NDArray[np.uint16], chunk_pins: NDArray[np.uint16], shift: int,
               run: int) -> None:
    """Give back what a pinning touch (:func:`_touch_loop`) pinned on the distinct blocks
    ``ids`` (``run``: its answer, how it pinned them: ``ONE_BY_ONE``, ``ONE_RUN`` or
    ``RUNS``): one pin less on each whole chunk of a run, and on each other block still at
    its epoch ``recorded[i]`` (a moved block lost its pin with its content: another owner's
    pin is never taken); never below 0."""
    count = ids.size
    i = 0
    while i < count:
        # The next run as the touch found it (the same ids, the same runs): the rest of the
        # ids where they were pinned one by one or as one run, else up to the next break.
        start = ids[i]
        j = count
        if run == RUNS:
            j = i + 1
            while j < count and ids[j] == ids[j - 1] + 1:
                j += 1
        lo = (start + (1 << shift) - 1) >> shift
        hi = (start + (j - i)) >> shift
        # Blocks pinned one by one: ``[i, head)`` and ``[tail, j)`` (all of them unless the
        # run's whole chunks were pinned instead).
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


# -- one pass over every group of a lease made from a lookup's probe -----------------------

#: Columns of a probed lease's answer row per group (``answers[g]``): the first four are the
#: pinning touch's ``out`` (an id outside the group, the first at the pin limit, how the pins
#: were taken, a read of one run at one epoch); then the first id and epoch read, and the
#: prompt blocks ``[lo, hi)`` the group holds.
OUTSIDE: Final = 0
FULL: Final = 1
PINNED_AS: Final = 2
ONE_READ: Final = 3
FIRST_ID: Final = 4
FIRST_EPOCH: Final = 5
LO: Final = 6
HI: Final = 7
ANSWER_COLUMNS: Final = 8
#: Columns of a probed lease's fixed facts per group (``fixed[g]``).
SHIFT: Final = 0
TARGET: Final = 1
BLOCK: Final = 2
TARGET_BLOCK: Final = 3
FIXED_COLUMNS: Final = 4
#: ``result[0]`` of :func:`take_probed_loop`: every group pinned and touched.
TAKEN: Final = -1
#: ``result[0]``: an index group's targets are not all among the blocks the lease would
#: hold of its target group; nothing was pinned or touched.
TARGETS_OUTSIDE: Final = -2


def one_run_blocks(ids: NDArray[np.int64], epochs: NDArray[np.uint32]) -> int:
    """What a take may trust of a lookup's blocks (ids, -1 where missing, and their epochs):
    the blocks before the first missing one where they are one run of consecutive ids at
    the first's epoch, else 0 (NumPy; the lookup's compiled pass counts the same)."""
    found = ids >= 0
    chain = ids.size if found.all() else int(np.argmin(found))
    if chain == 0:
        return 0
    run = (ids[:chain] == ids[0] + np.arange(chain)) & (epochs[:chain] == epochs[0])
    return chain if run.all() else 0


def _probed_ids(out: NDArray[np.int64], at_ids: int, at_epochs: int, lo: int, hi: int
                ) -> tuple[NDArray[np.int64], NDArray[np.uint32]]:
    """The ids and epochs a lookup's group pass wrote to ``out`` for prompt blocks
    ``[lo, hi)`` (ids from word ``at_ids``, epochs two a word from ``at_epochs``)."""
    return out[at_ids + lo:at_ids + hi], out[at_epochs:].view(np.uint32)[lo:hi]


#: Per group, the arrays a lease's one-pass take and give-back read and write, in this order
#: in their address table (:data:`LEASE_KINDS` says each one's dtype): the blocks' states,
#: the recency list of each state, the blocks' use stamps, the lists' links, heads and tails,
#: the blocks' and chunks' pins, the blocks' epochs, and the record of a run linked in order.
STATES, LIST_OF_STATE, LAST_USE, PREV, NEXT, HEAD, TAIL, PINS, CHUNK_PINS, EPOCH, \
    LINKED_RUN = range(11)
LEASE_KINDS: Final[tuple[tuple[type[np.generic], int], ...]] = (
    (np.uint8, 1), (np.int8, 1), (np.uint32, 1), (np.int32, 1), (np.int32, 1), (np.int32, 1),
    (np.int32, 1), (np.uint16, 1), (np.uint16, 1), (np.uint32, 1), (np.int64, 1))
N_LEASE_ARRAYS: Final = len(LEASE_KINDS)


def leased_arrays(arrays: NDArray[np.int64], g: int) -> tuple[NDArray[Any], ...]:
    """Group ``g``'s arrays of a lease's address table, STATES ... LINKED_RUN (plain-Python
    views, for the twins)."""
    return views(arrays, LEASE_KINDS, g * N_LEASE_ARRAYS)


def take_probed_loop(outs: tuple[NDArray[np.int64], ...], bounds: NDArray[np.int64],
                     offsets: NDArray[np.int64], at: int, fixed: NDArray[np.int64],
                     arrays: NDArray[np.int64], tick: int, max_pins: int,
                     answers: NDArray[np.int64], result: NDArray[np.int64]) -> None:
    """A lease's pinning touch (:func:`_touch_known`) of every group at once, on the blocks a
    lookup found usable at its candidate ``at`` (no group changed since: only the pin limit
    is left to check), so a lease costs one compiled call, not one per group.

    Group ``g``'s blocks are prompt blocks ``[bounds[g, 0, at], bounds[g, 1, at])``, their
    ids and epochs in the lookup's pass output ``outs[g]`` from words ``offsets[g, 0]`` and
    ``offsets[g, 1]``; word ``offsets[g, 2]`` of it (-1: none) counts the prompt blocks from
    the first that the lookup found one run of consecutive ids at one epoch, so a span
    inside them is pinned and touched without reading its ids and epochs (every group's
    bounds and offsets in one array each: fewer arguments to unbox on every lease).
    ``fixed[g]`` is what the group's declaration fixes (columns ``SHIFT`` ...
    ``TARGET_BLOCK``): its pin chunk shift, the position of the group its blocks point into
    (-1: none), and the two groups' block sizes. ``arrays`` addresses
    every group's states, lists, stamps, links, pins and run records (:data:`LEASE_KINDS`
    per group, an address table: one argument instead of ten per group).

    First, no changes: an index group's usable rows point only at history blocks ending
    before them, which the lease must hold as blocks of the target group (from its block 0
    past them); where it would not, ``result[0] = TARGETS_OUTSIDE`` and nothing changes.
    Then each group with blocks, in order, touched at the next tick from ``tick`` (counted
    in ``result[1]``) with its answer row ``answers[g]`` (columns ``OUTSIDE`` ...
    ``HI``); the first refused (an id outside the group, a block at ``max_pins``) stops
    there with ``result[0] = g``: the groups before it stay pinned and touched, it and those
    after are unchanged. Else ``result[0] = TAKEN``. ``result[2]`` counts the touched
    groups whose blocks are one run at one epoch (``ONE_READ``: when it is ``result[1]``,
    the lease's read is reported from the answer rows alone)."""
    # Unowned views (the caller holds the arrays): no reference counting on each view.
    bounds, offsets, fixed, arrays, answers, result = unowned(bounds), unowned(offsets), \
        unowned(fixed), unowned(arrays), unowned(answers), unowned(result)
    groups = len(outs)
    result[0], result[1], result[2] = TAKEN, 0, 0
    for g in range(groups):
        target = fixed[g, TARGET]
        lo, hi = bounds[g, 0, at], bounds[g, 1, at]
        if target >= 0 and hi > lo:
            reach = hi * fixed[g, BLOCK] // fixed[g, TARGET_BLOCK]
            if bounds[target, 0, at] != 0 or bounds[target, 1, at] < reach:
                result[0] = TARGETS_OUTSIDE
                return
    touched = 0
    for g in range(groups):
        answer = answers[g]
        lo, hi = bounds[g, 0, at], bounds[g, 1, at]
        answer[OUTSIDE], answer[FULL], answer[PINNED_AS], answer[ONE_READ] = -1, -1, 0, 0
        answer[FIRST_ID], answer[FIRST_EPOCH], answer[LO], answer[HI] = -1, 0, lo, hi
        if hi <= lo:
            continue
        out = unowned(outs[g])
        ids, seen = _probed_ids(out, offsets[g, 0], offsets[g, 1], lo, hi)
        run_at = offsets[g, 2]
        one_run = run_at >= 0 and hi <= out[run_at]
        base = g * N_LEASE_ARRAYS
        _touch_known(ids, vector_at(arrays, base + STATES, np.uint8),
                     vector_at(arrays, base + LIST_OF_STATE, np.int8),
                     vector_at(arrays, base + LAST_USE, np.uint32), tick + touched,
                     vector_at(arrays, base + PREV, np.int32),
                     vector_at(arrays, base + NEXT, np.int32),
                     vector_at(arrays, base + HEAD, np.int32),
                     vector_at(arrays, base + TAIL, np.int32), seen,
                     vector_at(arrays, base + PINS, np.uint16),
                     vector_at(arrays, base + CHUNK_PINS, np.uint16), fixed[g, SHIFT], max_pins,
                     vector_at(arrays, base + LINKED_RUN, np.int64), answer, one_run)
        if answer[OUTSIDE] >= 0 or answer[FULL] >= 0:
            result[0], result[1] = g, touched
            return
        answer[FIRST_ID], answer[FIRST_EPOCH] = ids[0], seen[0]
        touched += 1
        result[2] += answer[ONE_READ]
    result[1] = touched


def unpin_probed_loop(outs: tuple[NDArray[np.int64], ...], offsets: NDArray[np.int64],
                      fixed: NDArray[np.int64], arrays: NDArray[np.int64],
                      answers: NDArray[np.int64], groups: int) -> None:
    """Give back what :func:`take_probed_loop` pinned in its first ``groups`` groups (its
    answer rows say where and how), as :func:`unpin_loop` per group (``arrays``: the take's
    address table)."""
    # Unowned views (the caller holds the arrays): no reference counting on each view.
    offsets, fixed, arrays, answers = unowned(offsets), unowned(fixed), unowned(arrays), \
        unowned(answers)
    for g in range(groups):
        lo, hi = answers[g, LO], answers[g, HI]
        if hi > lo:
            ids, seen = _probed_ids(unowned(outs[g]), offsets[g, 0], offsets[g, 1], lo, hi)
            base = g * N_LEASE_ARRAYS
            unpin_loop(ids, seen, vector_at(arrays, base + EPOCH, np.uint32),
                       vector_at(arrays, base + PINS, np.uint16),
                       vector_at(arrays, base + CHUNK_PINS, np.uint16), fixed[g, SHIFT],
                       answers[g, PINNED_AS])


def _touch_twin(ids: IdArray, states: NDArray[np.uint8], list_of_state: NDArray[np.int8],
                last_use: NDArray[np.uint32], tick: int, prev: NDArray[np.int32],
                next_: NDArray[np.int32], head: NDArray[np.int32], tail: NDArray[np.int32],
                seen: NDArray[np.uint32], pins: NDArray[np.uint16],
                chunk_pins: NDArray[np.uint16], shift: int, max_pins: int,
                linked_run: NDArray[np.int64], out: NDArray[np.int64]) -> None:
    """:func:`_touch_loop` without numba: the range check, the pins, the stamps and each
    block's list as array operations, and only the moves of blocks on a list as a Python
    loop; the record of a run linked in order follows the same rule, every link read."""
    # Imported here: the recency lists' module uses this one's kernel.
    from kvfsm.state._recency import relink_loop

    out[:4] = (-1, -1, 0, 0)
    outside = np.flatnonzero((ids < 0) | (ids >= last_use.size))
    if outside.size:
        out[0] = outside[0]
        return
    count = ids.size
    # Before any move: consecutive ids linked in order on one list become the record; any
    # other batch holding an id of the recorded run forgets it.
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
        # The first block (in prompt order) held to the limit, by itself or by its chunk.
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


touch_kernel = kernel(example=_touch_example, twin=_touch_twin,
                      calls=(_touch_known,))(_touch_loop)
