"""Which index blocks point at a given set of target blocks, at the cost of the answer.

A sparse-index group's block holds ``top_k`` references to blocks of a target group
(``refs_target[row, j]``, -1 unused). When target blocks are evicted, every index block pointing
at one of them must be found. Scanning ``refs_target`` costs the whole pool; this structure
costs the references it walks.

Layout: every reference slot of the index is a node, ``node = row * top_k + j``. Each target
block has one doubly linked list of the nodes that reference it, threaded through the node
arrays themselves (no Python object per node, no growth):

* ``head[t]``: the first node referencing target ``t``, -1 when none does;
* ``prev[node]``, ``next[node]``: its neighbours on its target's list, -1 at either end (and
  both -1 when the node is not linked);
* ``linked_target[node]``: the target the node is linked under, -1 when not linked. Unlinking
  reads it, never the caller's ``refs_target``, which the caller may already have overwritten.

Node ids are int32 while ``n_rows * top_k < 2**31`` and int64 beyond (chosen once, at
construction); ``linked_target`` is int32 (targets are int32 in ``refs_target``).

Costs: :meth:`Dependents.link` and :meth:`Dependents.unlink` cost ``O(top_k)`` per row given
(each node is put on or taken off its list in O(1)); :meth:`Dependents.rows_pointing_at` costs
the nodes on the given targets' lists plus sorting the rows found (``O(m log m)``). No call
allocates or scans anything of size ``n_rows`` or ``n_targets``; the only scratch is the
buffer the walk writes rows into, grown geometrically to the largest answer seen.
:meth:`Dependents.problems` is the exception: it is an invariant check and reads everything.

Memory: per index block ``top_k * (2 * 4 + 4)`` bytes with int32 nodes (96 bytes at top_k 8),
``top_k * (2 * 8 + 4)`` with int64 nodes (160 at top_k 8); per target block 4 bytes (8 with
int64 nodes) for ``head``; plus the walk's scratch (8 bytes per row of the largest answer).

Backends: every loop is a kernel (:mod:`kvfsm._jit`): compiled by numba when
``settings.enabled``, else its twin. The twins of ``link_kernel`` and ``unlink_kernel`` are the
loops themselves run as plain Python (``kernel.python``): splicing nodes in and out of linked
lists has no natural NumPy form, and these calls touch only ``top_k`` nodes per row. The walk
behind :meth:`~Dependents.rows_pointing_at` has a vectorized twin: it walks all the given lists
together in rounds (one round per list position, a few array operations over the lists not yet
ended), so it meets the same nodes, in as many rounds as the longest list is long, and writes
the same rows in the same order.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel

IdArray = NDArray[np.intp]
NodeArray = NDArray[np.int32] | NDArray[np.int64]

#: Largest node count that int32 node ids can address.
_INT32_NODES = 2**31


def _unlink_loop(prev: NodeArray, next_: NodeArray, linked_target: NDArray[np.int32],
                 head: NodeArray, top_k: int, rows: IdArray) -> None:
    """Take every linked node of each of ``rows`` off its target's list (O(1) per node)."""
    for i in range(rows.size):
        base = rows[i] * top_k
        for j in range(top_k):
            node = base + j
            target = linked_target[node]
            if target < 0:
                continue
            before = prev[node]
            after = next_[node]
            if before >= 0:
                next_[before] = after
            else:
                head[target] = after
            if after >= 0:
                prev[after] = before
            prev[node] = -1
            next_[node] = -1
            linked_target[node] = -1


def _link_loop(prev: NodeArray, next_: NodeArray, linked_target: NDArray[np.int32],
               head: NodeArray, top_k: int, rows: IdArray, refs: NDArray[np.int32]) -> None:
    """Per row ``rows[i]``: unlink what it had linked, then push each node ``j`` with
    ``refs[i, j] >= 0`` onto the front of target ``refs[i, j]``'s list. A row given twice ends
    with its last references."""
    # The unlink is _unlink_loop's body written out again, on purpose: as a helper the
    # kernels call per node (numba's register_jitable, inlined or not) it measured 10-35x
    # slower on 1.6 M nodes.
    for i in range(rows.size):
        base = rows[i] * top_k
        for j in range(top_k):
            node = base + j
            target = linked_target[node]
            if target < 0:
                continue
            before = prev[node]
            after = next_[node]
            if before >= 0:
                next_[before] = after
            else:
                head[target] = after
            if after >= 0:
                prev[after] = before
            prev[node] = -1
            next_[node] = -1
            linked_target[node] = -1
        for j in range(top_k):
            target = refs[i, j]
            if target < 0:
                continue
            node = base + j
            first = head[target]
            next_[node] = first
            prev[node] = -1
            if first >= 0:
                prev[first] = node
            head[target] = node
            linked_target[node] = target


def _walk_loop(next_: NodeArray, head: NodeArray, top_k: int, targets: IdArray, out: IdArray,
               counts: NDArray[np.int64]) -> None:
    """Walk the lists of ``targets`` in turn, writing the row of each node met into ``out``
    while it has room. ``counts[0]``: the nodes met (the caller grows ``out`` and walks again
    when that exceeds its size); ``counts[1]``: 1 when a list ran longer than there are nodes
    (a cycle: corrupt), which ends that list's walk."""
    met = 0
    counts[1] = 0
    limit = next_.size
    for i in range(targets.size):
        node = head[targets[i]]
        steps = 0
        while node >= 0:
            if met < out.size:
                out[met] = node // top_k
            met += 1
            steps += 1
            if steps > limit:
                counts[1] = 1
                break
            node = next_[node]
    counts[0] = met


def _walk_rounds(next_: NodeArray, head: NodeArray, top_k: int, targets: IdArray, out: IdArray,
                 counts: NDArray[np.int64]) -> None:
    """The walk's vectorized twin: round ``r`` takes the ``r``-th node of every list not yet
    ended (a few array operations per round, as many rounds as the longest list is long); the
    rows are then put in the walk's order (list by list). Same ``out`` and ``counts`` as the
    walk on sound lists; on a cycle it flags ``counts[1]`` and stops."""
    node = head[targets]
    owner = np.flatnonzero(node >= 0)
    node = node[owner]
    nodes, owners = [], []
    counts[1] = 0
    for _ in range(next_.size + 1):
        if not node.size:
            break
        nodes.append(node)
        owners.append(owner)
        node = next_[node]
        going = node >= 0
        node, owner = node[going], owner[going]
    else:
        counts[1] = 1
    if not nodes:
        counts[0] = 0
        return
    # Rounds were appended in order, so a stable sort by list keeps each list's order.
    order = np.argsort(np.concatenate(owners), kind="stable")
    rows = np.concatenate(nodes)[order] // top_k
    room = min(rows.size, out.size)
    out[:room] = rows[:room]
    counts[0] = rows.size


def _empty_nodes(size: int, wide: bool) -> NodeArray:
    """``size`` node ids, all -1: int64 when ``wide``, else int32."""
    if wide:
        return np.full(size, -1, dtype=np.int64)
    return np.full(size, -1, dtype=np.int32)


def _sorted_unique(values: IdArray) -> IdArray:
    """``np.unique(values)`` for a small array: NumPy's own costs several times more on a
    thousand values (it hashes before sorting)."""
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def _random_lists(rng: np.random.Generator) -> tuple[NodeArray, NodeArray, NDArray[np.int32],
                                                      NodeArray, int]:
    """A sound structure over a few rows, slots and targets (repeated targets likely)."""
    n_rows, top_k, n_targets = (int(rng.integers(1, 12)), int(rng.integers(1, 5)),
                                int(rng.integers(1, 6)))
    prev, next_ = _empty_nodes(n_rows * top_k, False), _empty_nodes(n_rows * top_k, False)
    linked = np.full(n_rows * top_k, -1, dtype=np.int32)
    head = _empty_nodes(n_targets, False)
    for _ in range(int(rng.integers(0, 4))):
        rows = rng.permutation(n_rows)[: int(rng.integers(0, n_rows + 1))].astype(np.intp)
        refs = rng.integers(-1, n_targets, (rows.size, top_k), dtype=np.int32)
        _link_loop(prev, next_, linked, head, top_k, rows, refs)
    return prev, next_, linked, head, top_k


def _link_example() -> tuple[object, ...]:
    nodes = _empty_nodes(2, False)
    return (nodes, nodes.copy(), np.full(2, -1, dtype=np.int32), _empty_nodes(1, False), 2,
            np.zeros(1, dtype=np.intp), np.full((1, 2), -1, dtype=np.int32))


def _link_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    prev, next_, linked, head, top_k = _random_lists(rng)
    n_rows = prev.size // top_k
    rows = rng.permutation(n_rows)[: int(rng.integers(0, n_rows + 1))].astype(np.intp)
    refs = rng.integers(-1, head.size, (rows.size, top_k), dtype=np.int32)
    return prev, next_, linked, head, top_k, rows, refs


def _unlink_example() -> tuple[object, ...]:
    return _link_example()[:6]


def _unlink_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    prev, next_, linked, head, top_k = _random_lists(rng)
    rows = rng.integers(0, prev.size // top_k, int(rng.integers(0, 8))).astype(np.intp)
    return prev, next_, linked, head, top_k, rows


def _walk_example() -> tuple[object, ...]:
    return (_empty_nodes(2, False), _empty_nodes(1, False), 2, np.zeros(1, dtype=np.intp),
            np.zeros(1, dtype=np.intp), np.zeros(2, dtype=np.int64))


def _walk_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    _, next_, _, head, top_k = _random_lists(rng)
    targets = rng.integers(0, head.size, int(rng.integers(0, 6))).astype(np.intp)
    out = np.zeros(int(rng.integers(0, next_.size + 1)), dtype=np.intp)  # sometimes too small
    return next_, head, top_k, targets, out, np.zeros(2, dtype=np.int64)


#: Linking and unlinking have no natural NumPy form (splicing nodes in and out of lists): their
#: twins are the loops themselves, run as plain Python, touching ``top_k`` nodes per row.
unlink_kernel = kernel(example=_unlink_example, twin=_unlink_loop,
                       inputs=_unlink_inputs)(_unlink_loop)
link_kernel = kernel(example=_link_example, twin=_link_loop, inputs=_link_inputs)(_link_loop)
walk_kernel = kernel(example=_walk_example, twin=_walk_rounds, inputs=_walk_inputs)(_walk_loop)


class Dependents:
    """Reverse map target block -> index rows referencing it: one doubly linked list per target,
    threaded through the index's reference slots."""

    def __init__(self, n_rows: int, top_k: int, n_targets: int) -> None:
        if n_rows < 0 or top_k < 1 or n_targets < 0:
            raise ValueError(f"need n_rows >= 0, top_k >= 1, n_targets >= 0; got {n_rows}, "
                             f"{top_k}, {n_targets}")
        if n_targets >= 2**31:
            raise ValueError(f"target ids are int32; {n_targets} targets do not fit")
        self.n_rows, self.top_k, self.n_targets = n_rows, top_k, n_targets
        n_nodes = n_rows * top_k
        wide = n_nodes >= _INT32_NODES
        self.prev: NodeArray = _empty_nodes(n_nodes, wide)
        self.next: NodeArray = _empty_nodes(n_nodes, wide)
        self.linked_target: NDArray[np.int32] = np.full(n_nodes, -1, dtype=np.int32)
        self.head: NodeArray = _empty_nodes(n_targets, wide)
        self._found: IdArray = np.empty(64, dtype=np.intp)
        self._counts = np.zeros(2, dtype=np.int64)
        #: Nodes the last :meth:`rows_pointing_at` walked (for tests of its cost).
        self.last_walked = 0

    @property
    def nbytes(self) -> int:
        return (self.prev.nbytes + self.next.nbytes + self.linked_target.nbytes
                + self.head.nbytes + self._found.nbytes + self._counts.nbytes)

    # -- validation of inputs (costs the input, never the pool) ----------------------------

    def _rows(self, rows: IdArray) -> IdArray:
        out = np.ascontiguousarray(np.asarray(rows, dtype=np.intp).ravel())
        if out.size and (int(out.min()) < 0 or int(out.max()) >= self.n_rows):
            raise IndexError(f"rows must lie in [0, {self.n_rows}); got "
                             f"{int(out.min())}..{int(out.max())}")
        return out

    def _targets(self, targets: IdArray) -> IdArray:
        out = np.asarray(targets, dtype=np.intp).ravel()
        if out.size and (int(out.min()) < 0 or int(out.max()) >= self.n_targets):
            raise IndexError(f"targets must lie in [0, {self.n_targets}); got "
                             f"{int(out.min())}..{int(out.max())}")
        return out

    # -- updates -------------------------------------------------------------------------

    def link(self, rows: IdArray, refs: NDArray[np.int32]) -> None:
        """Set the references of ``rows`` to ``refs`` (``[rows.size, top_k]``, -1 unused):
        whatever those rows had linked before is unlinked first. Costs ``O(top_k)`` per row."""
        rows = self._rows(rows)
        refs = np.ascontiguousarray(refs, dtype=np.int32)
        if refs.shape != (rows.size, self.top_k):
            raise ValueError(f"refs must have shape {(rows.size, self.top_k)}, got {refs.shape}")
        if refs.size and (int(refs.min()) < -1 or int(refs.max()) >= self.n_targets):
            raise IndexError(f"references must lie in [-1, {self.n_targets}); got "
                             f"{int(refs.min())}..{int(refs.max())}")
        link_kernel(self.prev, self.next, self.linked_target, self.head, self.top_k, rows, refs)

    def unlink(self, rows: IdArray) -> None:
        """Forget every reference of ``rows`` (a row not linked is left as it is)."""
        rows = self._rows(rows)
        unlink_kernel(self.prev, self.next, self.linked_target, self.head, self.top_k, rows)

    # -- queries -------------------------------------------------------------------------

    def rows_pointing_at(self, targets: IdArray) -> IdArray:
        """Sorted unique rows with at least one linked reference to any of ``targets``. Costs
        the nodes on those targets' lists (each target walked once however often given)."""
        wanted = self._targets(targets)
        if wanted.size > 1:
            wanted = _sorted_unique(wanted)
        while True:
            walk_kernel(self.next, self.head, self.top_k, wanted, self._found, self._counts)
            met = int(self._counts[0])
            if self._counts[1]:
                raise RuntimeError("a dependents list is cyclic; see Dependents.problems()")
            if met <= self._found.size:
                break
            self._found = np.empty(max(met, 2 * self._found.size), dtype=np.intp)
        self.last_walked = met
        return _sorted_unique(self._found[:met])

    # -- invariant check -----------------------------------------------------------------

    def problems(self, refs_target: NDArray[np.int32],
                 rows: IdArray | None = None) -> list[str]:
        """Faults, empty when sound. Sound means the structure equals the one built from scratch
        by linking ``rows`` (default: every row with a linked node) with their references in
        ``refs_target`` (``[n_rows, top_k]``; rows not linked may hold anything):

        1. a node is linked (``linked_target >= 0``) exactly when its row is one of ``rows``
           and ``refs_target`` of it is not -1, and then ``linked_target`` equals that
           reference;
        2. a node not linked has ``prev == next == -1`` and heads no list;
        3. each target's linked nodes form one list from ``head[target]``: ``prev`` and
           ``next`` mirror each other, stay among nodes linked under the same target, only the
           head has no ``prev``, and walking from the heads meets every linked node (no cycle).

        Reads the whole structure (an invariant check, not a hot path)."""
        out: list[str] = []
        refs = np.asarray(refs_target)
        if refs.shape != (self.n_rows, self.top_k):
            return [f"refs_target has shape {refs.shape}, expected {(self.n_rows, self.top_k)}"]
        n_nodes = self.n_rows * self.top_k
        prev, next_, linked, head = self.prev, self.next, self.linked_target, self.head
        for name, array, high in (("prev", prev, n_nodes), ("next", next_, n_nodes),
                                  ("head", head, n_nodes),
                                  ("linked_target", linked, self.n_targets)):
            bad = np.flatnonzero((array < -1) | (array >= high))
            if bad.size:
                out.append(f"{name} holds values outside [-1, {high}) at {bad[:8].tolist()}")
        if out:
            return out  # the checks below index with these arrays

        # 1. The linked set and targets against a build from scratch.
        is_linked = linked >= 0
        expected_rows: NDArray[np.bool_]
        if rows is None:
            expected_rows = np.asarray(is_linked.reshape(self.n_rows, self.top_k).any(axis=1))
        else:
            expected_rows = np.zeros(self.n_rows, dtype=bool)
            expected_rows[self._rows(rows)] = True
        expected = np.where(expected_rows[:, None], refs, -1).astype(np.int64).ravel()
        wrong = np.flatnonzero(expected != linked)
        if wrong.size:
            nodes = wrong[:8]
            out.append(f"{wrong.size} nodes are linked under a target other than their "
                       f"reference: nodes {nodes.tolist()} (row, slot) "
                       f"{[(int(n) // self.top_k, int(n) % self.top_k) for n in nodes]} hold "
                       f"{linked[nodes].tolist()}, a fresh build holds "
                       f"{expected[nodes].tolist()}")

        # 2. Nodes not linked are detached.
        loose = np.flatnonzero(~is_linked & ((prev != -1) | (next_ != -1)))
        if loose.size:
            out.append(f"{loose.size} unlinked nodes keep list pointers: {loose[:8].tolist()}")
        has_head = np.flatnonzero(head >= 0)
        bad_head = has_head[linked[head[has_head]] != has_head]
        if bad_head.size:
            out.append(f"{bad_head.size} targets' heads are not nodes linked under them: "
                       f"targets {bad_head[:8].tolist()}")
        headed = has_head[linked[head[has_head]] == has_head]
        early = headed[prev[head[headed]] != -1]
        if early.size:
            out.append(f"{early.size} list heads have a prev: targets {early[:8].tolist()}")

        # 3. Pointers mirror each other within one target's list; one list per target.
        nodes = np.flatnonzero(is_linked)
        after = next_[nodes]
        on = after >= 0
        broken = nodes[on][(prev[after[on]] != nodes[on])
                           | (linked[after[on]] != linked[nodes[on]])]
        if broken.size:
            out.append(f"{broken.size} next pointers are not mirrored by prev within the "
                       f"target's list: nodes {broken[:8].tolist()}")
        before = prev[nodes]
        on = before >= 0
        broken = nodes[on][(next_[before[on]] != nodes[on])
                           | (linked[before[on]] != linked[nodes[on]])]
        if broken.size:
            out.append(f"{broken.size} prev pointers are not mirrored by next within the "
                       f"target's list: nodes {broken[:8].tolist()}")
        starts = nodes[before < 0]
        not_head = starts[head[linked[starts]] != starts]
        if not_head.size:
            out.append(f"{not_head.size} nodes without a prev are not their target's head: "
                       f"nodes {not_head[:8].tolist()}")
        node = head[has_head]
        walked = 0
        for _ in range(nodes.size + 1):
            if not node.size:
                break
            walked += node.size
            node = next_[node]
            node = node[node >= 0]
        else:
            walked = -1
        if walked != nodes.size:
            out.append(f"walking the lists from their heads meets "
                       f"{'endlessly many (a cycle)' if walked < 0 else walked} nodes, "
                       f"{nodes.size} are linked")
        return out
