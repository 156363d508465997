"""Sparse-index reference checks, compiled and NumPy: which prompt rows may point at which
history blocks, and why a row fails."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm import Engine
from kvfsm.spec import Event
from kvfsm.state import NO_TARGET
from kvfsm.verify import Reason
from kvfsm.verify._index_check import IndexCheck
from tests.verify_models import DEEPSEEK, block_id, engine, tokens

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


def _check(eng: Engine, ids: np.ndarray, history: np.ndarray | None) -> IndexCheck:
    return IndexCheck(eng.core.group("index"), ids.astype(np.intp),
                      None if history is None else history.astype(np.intp))


def test_a_target_is_allowed_from_the_first_row_whose_block_covers_it() -> None:
    """History block 2 holds tokens [128, 192): index row r (tokens [16r, 16r+16)) may point at
    it only once its own block ends at or after 192, i.e. from row 11 on."""
    eng, ids, history = _indexed([[2]] * ROWS)
    fit = _check(eng, ids, history).fit
    assert fit.tolist() == [row >= 11 for row in range(ROWS)]
    verdict = eng.lookup(TEXT)
    assert verdict.usable_tokens == 0
    assert {s.reason for s in verdict.reasons if s.group == "index"} == {Reason.GROUP_GAP}


def test_unused_references_always_pass() -> None:
    eng, ids, history = _indexed([[-1, -1]] * ROWS)
    assert _check(eng, ids, history).fit.all()


def test_one_bad_reference_fails_its_row_only() -> None:
    refs = [[0, 1] if row >= 7 else [] for row in range(ROWS)]
    refs[12] = [0, 1, 4]  # block 4 ends at token 320, after row 12 ends
    eng, ids, history = _indexed(refs)
    check = _check(eng, ids, history)
    assert np.flatnonzero(~check.fit).tolist() == [12]
    assert check.reason(12) is Reason.GROUP_GAP


def test_a_target_freed_or_moved_makes_its_rows_stale() -> None:
    refs = [[0] if row < 10 else [1] for row in range(ROWS)]
    refs[:4] = [[]] * 4
    eng, ids, history = _indexed(refs)
    eng.core.fire("history", [history[1]], Event.EVICT)  # freed: unhashed
    check = _check(eng, ids, history)
    assert check.fit.tolist() == [row < 10 for row in range(ROWS)]
    assert check.reason(15) is Reason.INDEX_STALE
    # Without the prompt's history only liveness and epochs count: rows 4..9 still pass.
    assert _check(eng, ids, None).fit.tolist() == [row < 10 for row in range(ROWS)]


def test_an_epoch_bump_makes_the_reference_stale() -> None:
    eng, ids, history = _indexed([[0]] * ROWS)
    group = eng.core.group("history")
    _behind_the_cores_back(group.epoch)[history[0]] += 1  # as a spill/restore round trip would
    check = _check(eng, ids, history)
    assert not check.fit.any()
    assert check.reason(5) is Reason.INDEX_STALE


def test_foreign_targets_pass_only_without_the_prompts_history() -> None:
    eng, ids, history = _indexed([[0]] * ROWS)
    shuffled = history[::-1].copy()  # another prompt's blocks at these positions
    assert not _check(eng, ids, shuffled).fit.any()
    assert _check(eng, ids, None).fit.all()


def test_targets_resident_for_the_plan() -> None:
    eng, ids, history = _indexed([[0] if row < 10 else [0, 1] for row in range(ROWS)])
    core = eng.core
    core.fire("history", [history[1]], Event.SPILL_BEGIN)
    core.fire("history", [history[1]], Event.SPILL_DONE)
    resident = _check(eng, ids, history).targets_resident()
    assert resident.tolist() == [row < 10 for row in range(ROWS)]


@pytest.mark.parametrize("corrupt", [-7, 10_000, np.iinfo(np.int32).max])
def test_a_reference_outside_the_target_group_fails_and_is_never_read(corrupt: int) -> None:
    """Metadata corrupted behind the core's back (the core refuses such targets on write):
    the row fails as stale, the restore plan's residency check and the reason do not crash."""
    eng, ids, history = _indexed([[0] if row >= 3 else [] for row in range(ROWS)])
    _behind_the_cores_back(eng.core.group("index").refs_target)[ids[14], 1] = corrupt
    check = _check(eng, ids, history)
    assert np.flatnonzero(~check.fit).tolist() == [14]
    assert check.reason(14) is Reason.INDEX_STALE
    assert not check.targets_resident()[14]
    assert eng.lookup(TEXT).usable_tokens <= 14 * 16


def test_a_prompt_without_history_blocks_fits_only_unused_references() -> None:
    """Shorter than one history block: no target can be of this prompt."""
    eng, ids, history = _indexed([[0] if row % 2 else [] for row in range(ROWS)])
    fit = _check(eng, ids, history[:0]).fit
    assert fit.tolist() == [row % 2 == 0 for row in range(ROWS)]
