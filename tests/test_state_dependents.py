"""The dependents map (target block -> index rows referencing it) against a brute-force scan.

Pools are tiny (a few rows, slots and targets) so a row names one target in several slots, many
rows share targets, relinking moves a row between lists and unlinking rows already unlinked or
whose references the caller has already overwritten all happen often. Every test runs with
compiled kernels and with the plain-Python / vectorized twins.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm._jit import settings as jit
from kvfsm.state import _dependents
from kvfsm.state._dependents import Dependents, link_kernel, unlink_kernel, walk_kernel

#: Hypothesis with the (function-scoped) ``jit_backend`` fixture: the fixture only selects the
#: backend, which every example shares, so running it once per test is what is wanted.
FIXTURE_OK = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


def brute_force(refs: np.ndarray, linked: np.ndarray, targets: list[int]) -> np.ndarray:
    """Rows that are linked and reference any of ``targets``: the scan the map replaces."""
    return np.flatnonzero(linked & np.isin(refs, targets).any(axis=1))


def references_to(refs: np.ndarray, linked: np.ndarray, targets: list[int]) -> int:
    """How many linked reference slots name one of ``targets``: the nodes a walk must meet."""
    return int((linked[:, None] & np.isin(refs, np.unique(targets))).sum())


@st.composite
def operations(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[str, list[int], object]]]:
    n_rows = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, 4))
    n_targets = draw(st.integers(1, 5))
    rows = st.lists(st.integers(0, n_rows - 1), unique=True, max_size=n_rows)
    ref_rows = st.lists(st.integers(-1, n_targets - 1), min_size=top_k, max_size=top_k)
    steps: list[tuple[str, list[int], object]] = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["link", "link", "unlink", "scribble", "query", "query"]))
        if kind == "link":
            chosen = draw(rows)
            refs = [draw(ref_rows) for _ in chosen]
            steps.append((kind, chosen, refs))
        elif kind == "unlink":
            # Repeats and rows never linked included; the caller may clear the rows' references
            # before unlinking them.
            steps.append((kind, draw(st.lists(st.integers(0, n_rows - 1), max_size=n_rows)),
                          draw(st.booleans())))
        elif kind == "scribble":
            # The caller writes garbage into rows it has not linked (free index blocks).
            steps.append((kind, draw(rows), draw(ref_rows)))
        else:
            steps.append((kind, draw(st.lists(st.integers(0, n_targets - 1), max_size=6)),
                          None))
    return n_rows, top_k, n_targets, steps


@FIXTURE_OK
@given(drawn=operations())
def test_matches_brute_force_across_link_unlink_relink(
        jit_backend: str,
        drawn: tuple[int, int, int, list[tuple[str, list[int], object]]]) -> None:
    """After any sequence of link / relink / unlink / query: the rows found for any targets
    (repeated or not) are exactly, sorted and unique, the linked rows whose references name one
    of them, found by walking exactly the linked references to those targets; and the
    structure equals one built from scratch from the linked rows' current references
    (``problems`` is empty), whatever the caller wrote into rows it has not linked."""
    n_rows, top_k, n_targets, steps = drawn
    deps = Dependents(n_rows, top_k, n_targets)
    refs = np.full((n_rows, top_k), -1, dtype=np.int32)
    linked = np.zeros(n_rows, dtype=bool)
    for kind, chosen, extra in steps:
        index = np.array(chosen, dtype=np.intp)
        if kind == "link":
            new = np.array(extra, dtype=np.int32).reshape(len(chosen), top_k)
            refs[index] = new  # the caller overwrites, then links: old links come off by node
            deps.link(index, new)
            linked[index] = True
        elif kind == "unlink":
            if extra:
                refs[index] = -1
            deps.unlink(index)
            linked[index] = False
        elif kind == "scribble":
            free = index[~linked[index]]
            refs[free] = np.array(extra, dtype=np.int32)
        else:
            found = deps.rows_pointing_at(index)
            assert found.dtype == np.intp
            assert found.tolist() == brute_force(refs, linked, chosen).tolist()
            assert deps.last_walked == references_to(refs, linked, chosen)
        assert deps.problems(refs, rows=np.flatnonzero(linked)) == []
    # The default reading of "linked rows" (rows with a linked node) agrees too.
    assert deps.problems(refs) == []


@FIXTURE_OK
@given(drawn=operations())
def test_wide_node_ids_behave_the_same(
        jit_backend: str, wide_nodes: None,
        drawn: tuple[int, int, int, list[tuple[str, list[int], object]]]) -> None:
    """With int64 node ids (chosen when ``n_rows * top_k >= 2**31``, forced here) every query
    still equals the brute-force scan and the structure stays sound."""
    n_rows, top_k, n_targets, steps = drawn
    deps = Dependents(n_rows, top_k, n_targets)
    assert deps.prev.dtype == deps.next.dtype == deps.head.dtype == np.int64
    refs = np.full((n_rows, top_k), -1, dtype=np.int32)
    linked = np.zeros(n_rows, dtype=bool)
    for kind, chosen, extra in steps:
        index = np.array(chosen, dtype=np.intp)
        if kind == "link":
            refs[index] = np.array(extra, dtype=np.int32).reshape(len(chosen), top_k)
            deps.link(index, refs[index])
            linked[index] = True
        elif kind == "unlink":
            deps.unlink(index)
            linked[index] = False
        elif kind == "query":
            assert deps.rows_pointing_at(index).tolist() == brute_force(refs, linked,
                                                                        chosen).tolist()
    assert deps.problems(refs, rows=np.flatnonzero(linked)) == []


@pytest.fixture
def wide_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node ids int64 from the first node on."""
    monkeypatch.setattr(_dependents, "_INT32_NODES", 0)


def sound_example() -> tuple[Dependents, np.ndarray]:
    """Six rows of three slots over four targets, rows 4 and 5 not linked (5 holds garbage)."""
    refs = np.array([[0, 1, 0], [1, -1, 2], [0, 0, 0], [3, 2, 1], [-1, -1, -1], [2, 2, 2]],
                    dtype=np.int32)
    deps = Dependents(6, 3, 4)
    deps.link(np.arange(5), refs[:5])
    return deps, refs


def node_of(row: int, slot: int) -> int:
    return row * 3 + slot


CORRUPTIONS: dict[str, Callable[[Dependents, np.ndarray], None]] = {
    "next skips a node": lambda d, r: d.next.__setitem__(int(d.head[0]),
                                                         d.next[d.next[d.head[0]]]),
    "next points at itself": lambda d, r: d.next.__setitem__(int(d.head[0]), d.head[0]),
    "prev of a head set": lambda d, r: d.prev.__setitem__(int(d.head[1]), node_of(4, 0)),
    "head names another list's node": lambda d, r: d.head.__setitem__(3, d.head[2]),
    "head lost": lambda d, r: d.head.__setitem__(2, -1),
    "linked under a stale target": lambda d, r: r.__setitem__((3, 0), 1),
    "reference never linked": lambda d, r: r.__setitem__((1, 1), 3),
    "unlinked node keeps a pointer": lambda d, r: d.next.__setitem__(node_of(4, 2),
                                                                     d.head[0]),
    "pointer out of range": lambda d, r: d.prev.__setitem__(0, 10_000),
    "two lists spliced": lambda d, r: (d.next.__setitem__(int(d.head[3]), d.head[1]),
                                       d.prev.__setitem__(int(d.head[1]), d.head[3])),
}


@pytest.mark.usefixtures("jit_backend")
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_problems_fire_on_seeded_corruption(corruption: str) -> None:
    """``problems`` is empty on a structure built by link/unlink (row 5's garbage references
    ignored, it is not linked) and names a fault after any one seeded corruption: a broken,
    cyclic or out-of-range pointer, a wrong or lost head, a node linked under a target its
    reference no longer names, or a reference of a linked row that was never linked."""
    deps, refs = sound_example()
    assert deps.problems(refs) == []
    assert deps.problems(refs, rows=np.arange(5)) == []
    CORRUPTIONS[corruption](deps, refs)
    assert deps.problems(refs, rows=np.arange(5)) != []


@pytest.mark.usefixtures("jit_backend")
def test_problems_checks_the_rows_said_to_be_linked() -> None:
    """Given the rows that should be linked, a row left unlinked that holds references, or a
    row linked that should not be, is a fault; a row without references is the same linked or
    not."""
    deps, refs = sound_example()
    assert deps.problems(refs, rows=np.arange(6)) != []  # row 5 holds references, unlinked
    assert deps.problems(refs, rows=np.array([0, 1, 2])) != []  # row 3 is linked
    assert deps.problems(refs, rows=np.arange(4)) == []  # row 4 holds no references
    deps.unlink(np.array([3]))
    assert deps.problems(refs, rows=np.arange(4)) != []  # row 3 is no longer linked
    assert deps.problems(refs, rows=np.array([0, 1, 2])) == []


@pytest.mark.usefixtures("jit_backend")
def test_a_cyclic_list_ends_the_walk_with_an_error() -> None:
    """A corrupt (cyclic) list makes ``rows_pointing_at`` raise rather than loop forever."""
    deps, _ = sound_example()
    deps.next[deps.head[0]] = deps.head[0]
    with pytest.raises(RuntimeError, match="cyclic"):
        deps.rows_pointing_at(np.array([0]))


@pytest.mark.usefixtures("jit_backend")
def test_inputs_are_checked() -> None:
    """Rows, targets and references outside the pool, and references of the wrong shape, are
    refused before anything changes."""
    deps, refs = sound_example()
    with pytest.raises(IndexError):
        deps.link(np.array([6]), np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(IndexError):
        deps.link(np.array([4]), np.array([[0, 4, -1]], dtype=np.int32))
    with pytest.raises(IndexError):
        deps.link(np.array([4]), np.array([[0, -2, -1]], dtype=np.int32))
    with pytest.raises(ValueError, match="shape"):
        deps.link(np.array([4]), np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(IndexError):
        deps.unlink(np.array([-1]))
    with pytest.raises(IndexError):
        deps.rows_pointing_at(np.array([4]))
    assert deps.problems(refs) == []
    assert deps.rows_pointing_at(np.array([], dtype=np.intp)).tolist() == []


@pytest.mark.skipif(not jit.available, reason="numba is not installed")
@pytest.mark.parametrize("each", [link_kernel, unlink_kernel, walk_kernel],
                         ids=lambda each: each.__name__)
def test_compiled_twin_and_python_kernels_agree(each: object) -> None:
    """On random sound structures (and walk buffers sometimes too small for the answer), the
    compiled kernel, its twin and its plain-Python loop leave every argument array equal."""
    rng = np.random.default_rng(2024)
    for _ in range(300):
        state = rng.bit_generator.state
        runs = []
        for run in (each.compiled, each.twin, each.python):  # type: ignore[attr-defined]
            rng.bit_generator.state = state
            args = each.inputs(rng)  # type: ignore[attr-defined]
            run(*args)
            runs.append([a for a in args if isinstance(a, np.ndarray)])
        for other in runs[1:]:
            for a, b in zip(runs[0], other, strict=True):
                assert np.array_equal(a, b)


def test_memory_per_index_block() -> None:
    """12 bytes per reference slot (two int32 pointers and an int32 target) plus 4 per target
    block, besides the small walk scratch: 96 bytes per index block at top_k 8."""
    deps = Dependents(1000, 8, 300)
    scratch = deps._found.nbytes + deps._counts.nbytes
    assert deps.nbytes - scratch == 1000 * 96 + 300 * 4


@pytest.mark.usefixtures("jit_backend")
def test_a_million_rows_cost_only_what_is_walked() -> None:
    """At 1 000 000 index rows (top_k 8, 250 000 targets, ~32 references per target) finding
    one target's dependents is exact, walks exactly the references to it, and neither it nor
    relinking a few rows allocates anything of the pool's size (traced allocations stay far
    below even one byte per row). Not a timing test: it counts what is touched."""
    n_rows, top_k, n_targets = 1_000_000, 8, 250_000
    rng = np.random.default_rng(7)
    deps = Dependents(n_rows, top_k, n_targets)
    refs = np.full((n_rows, top_k), -1, dtype=np.int32)
    # Compiled: every row linked. Plain Python: a spread-out sample (its loops are slow).
    chosen = (np.arange(n_rows) if jit.enabled
              else np.sort(rng.choice(n_rows, 3000, replace=False)))
    refs[chosen] = rng.integers(-1, n_targets, (chosen.size, top_k), dtype=np.int32)
    target = 12_345
    holders = chosen[rng.choice(chosen.size, 32, replace=False)]
    refs[holders, rng.integers(0, top_k, holders.size)] = target
    refs[holders[0]] = target  # one row naming it in every slot
    for start in range(0, chosen.size, 65_536):
        part = chosen[start:start + 65_536]
        deps.link(part, refs[part])
    linked = np.zeros(n_rows, dtype=bool)
    linked[chosen] = True
    expected = brute_force(refs, linked, [target])
    assert expected.size >= 32

    deps.rows_pointing_at(np.array([target]))  # first call may compile
    tracemalloc.start()
    try:
        found = deps.rows_pointing_at(np.array([target, target]))
        moved = holders[1:5]
        refs[moved] = -1
        deps.link(moved, refs[moved])
        after = deps.rows_pointing_at(np.array([target]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found.tolist() == expected.tolist()
    assert after.tolist() == np.setdiff1d(expected, moved).tolist()
    assert deps.last_walked == references_to(refs, linked, [target])
    assert peak < 64 * 1024 < n_rows
