"""Sparse-index reference checks (made by the group pass, compiled and NumPy): which prompt
rows may point at which history blocks, and why a row fails."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm import Engine
from kvfsm.lookup import DeviceProfile, Level, Reason
from kvfsm.lookup._group_eval import GroupEval
from kvfsm.lookup._why import BY_CODE
from kvfsm.spec import Event
from kvfsm.state import NO_TARGET
from tests.lookup_models import DEEPSEEK, block_id, engine, group_eval, tokens

pytestmark = pytest.mark.usefixtures("jit_backend")

TEXT = tokens(321, seed=4)
#: Index blocks (16 tokens) and history blocks (64 tokens) of TEXT.
ROWS, HISTORY = 20, 5


def _indexed(refs_of_row: list[list[int]]) -> tuple[Engine, np.ndarray, np.ndarray]:
    """An engine with TEXT's history and window cached and its index rows written with the
    given references (history block positions of TEXT, -1 unused); returns the engine, the index
    ids by row and the history ids by position."""
    eng = engine(DEEPSEEK)
    eng.commit(eng.prompt(TEXT), groups=["history", "swa"])
    core = eng.core
    history = np.array([block_id(eng, "history", TEXT, h) for h in range(HISTORY)])
    high, low = eng.prompt(TEXT).words(16)
    ids = core.allocate("index", np.arange(ROWS), high[:ROWS], low[:ROWS])
    core.fire("index", ids, Event.WRITE_BEGIN)
    refs = np.full((ROWS, 4), NO_TARGET, dtype=np.int32)
    for row, targets in enumerate(refs_of_row):
        refs[row, : len(targets)] = [history[t] if t >= 0 else NO_TARGET for t in targets]
    core.set_index_refs("index", ids, refs)
    core.write("index", ids, np.zeros((ROWS, core.group("index").decl.payload_bytes), np.uint8))
    core.fire("index", ids, Event.WRITE_DONE)
    return eng, ids, history


def _behind_the_cores_back(array: np.ndarray) -> np.ndarray:
    """A writable view of a group's metadata array, to corrupt it as no core event would (the
    core hands out read-only views of arrays it writes)."""
    writable = array.view()
    writable.flags.writeable = True
    return writable


def _evaluated(eng: Engine, history_order: list[int] | None = None
               ) -> tuple[GroupEval, GroupEval]:
    """The history and index groups of TEXT evaluated as a lookup does (the history first),
    the history's blocks taken in ``history_order`` (positions of TEXT; default all in order):
    another order puts other blocks at the prompt's positions."""
    core, prompt = eng.core, eng.prompt(TEXT)
    order = list(range(HISTORY)) if history_order is None else history_order
    lengths = np.zeros(1, dtype=np.int64)
    history_words = tuple(words[order] for words in prompt.words(64))
    evaluated: dict[str, GroupEval] = {}
    for name, (high, low), history in (("history", history_words, None),
                                       ("index", prompt.words(16), "history")):
        evaluated[name] = group_eval(
            core.group(name), high, low, lengths, level=Level.FULL, kernel_layout=None,
            profile=DeviceProfile(), history=evaluated.get(history or ""), checksums=False)
    return evaluated["history"], evaluated["index"]


class _RowChecks:
    """The index rows' reference checks of one evaluation: ``fit`` per row, and why a row
    failed (as the verdict names it)."""

    def __init__(self, index: GroupEval) -> None:
        assert index.fit is not None
        self.index, self.fit = index, index.fit

    def reason(self, row: int) -> Reason | None:
        code = self.index.reason_codes(np.array([row], dtype=np.int64), np.zeros(1, np.bool_))
        return BY_CODE[int(code[0])]


def _check(eng: Engine, history_order: list[int] | None = None) -> _RowChecks:
    """The index rows' checks of TEXT (see :func:`_evaluated`)."""
    return _RowChecks(_evaluated(eng, history_order)[1])


def test_a_target_is_allowed_from_the_first_row_whose_block_covers_it() -> None:
    """History block 2 holds tokens [128, 192): index row r (tokens [16r, 16r+16)) may point at
    it only once its own block ends at or after 192, i.e. from row 11 on."""
    eng, _, _ = _indexed([[2]] * ROWS)
    fit = _check(eng).fit[:ROWS]
    assert fit.tolist() == [row >= 11 for row in range(ROWS)]
    verdict = eng.lookup(TEXT)
    assert verdict.usable_tokens == 0
    assert {s.reason for s in verdict.reasons if s.group == "index"} == {Reason.GROUP_GAP}


def test_unused_references_always_pass() -> None:
    eng, _, _ = _indexed([[-1, -1]] * ROWS)
    assert _check(eng).fit[:ROWS].all()


def test_one_bad_reference_fails_its_row_only() -> None:
    refs = [[0, 1] if row >= 7 else [] for row in range(ROWS)]
    refs[12] = [0, 1, 4]  # block 4 ends at token 320, after row 12 ends
    eng, _, _ = _indexed(refs)
    check = _check(eng)
    assert np.flatnonzero(~check.fit[:ROWS]).tolist() == [12]
    assert check.reason(12) is Reason.GROUP_GAP


def test_a_target_freed_makes_its_rows_stale() -> None:
    """The core frees an index block with its target; a target dead while its index block is
    still mapped (metadata changed behind the core's back) makes that block's row stale."""
    refs = [[0] if row < 10 else [1] for row in range(ROWS)]
    refs[:4] = [[]] * 4
    eng, _, history = _indexed(refs)
    group = eng.core.group("history")
    free = group.table.state_id("free")
    _behind_the_cores_back(group.states)[history[1]] = free
    check = _check(eng)
    assert check.fit[:ROWS].tolist() == [row < 10 for row in range(ROWS)]
    assert check.reason(15) is Reason.INDEX_STALE
    eng, _, history = _indexed(refs)
    eng.core.fire("history", [history[1]], Event.EVICT)  # its dependents go with it
    assert {(s.reason, s.block_index) for s in eng.lookup(TEXT).reasons if s.group == "index"} \
        == {(Reason.NOT_CACHED, row) for row in range(10, ROWS)}


def test_an_epoch_bump_makes_the_reference_stale() -> None:
    eng, _, history = _indexed([[0]] * ROWS)
    group = eng.core.group("history")
    _behind_the_cores_back(group.epoch)[history[0]] += 1  # as a spill/restore round trip would
    check = _check(eng)
    assert not check.fit[:ROWS].any()
    assert check.reason(5) is Reason.INDEX_STALE


def test_foreign_targets_fail() -> None:
    """Other blocks at the prompt's history positions (its blocks in reverse): no row's
    targets are this prompt's, though each is alive and at its epoch."""
    eng, _, _ = _indexed([[0]] * ROWS)
    check = _check(eng, list(range(HISTORY))[::-1])
    assert not check.fit[:ROWS].any()
    assert check.reason(5) is Reason.GROUP_GAP


@pytest.mark.parametrize("corrupt", [-7, 10_000, np.iinfo(np.int32).max])
def test_a_reference_outside_the_target_group_fails_and_is_never_read(corrupt: int) -> None:
    """Metadata corrupted behind the core's back (the core refuses such targets on write):
    the row fails as stale, the restore plan's residency check and the reason do not crash."""
    eng, ids, _ = _indexed([[0] if row >= 3 else [] for row in range(ROWS)])
    _behind_the_cores_back(eng.core.group("index").refs_target)[ids[14], 1] = corrupt
    check = _check(eng)
    assert np.flatnonzero(~check.fit[:ROWS]).tolist() == [14]
    assert check.reason(14) is Reason.INDEX_STALE
    assert eng.lookup(TEXT).usable_tokens <= 14 * 16


def test_a_prompt_without_history_blocks_fits_only_unused_references() -> None:
    """Shorter than one history block: no target can be of this prompt."""
    eng, _, _ = _indexed([[0] if row % 2 else [] for row in range(ROWS)])
    fit = _check(eng, []).fit[:ROWS]
    assert fit.tolist() == [row % 2 == 0 for row in range(ROWS)]
