"""The group pass: the fact bits of a real group's blocks, and hand-made index rows where
neighbouring rows hold the same references (the compiled pass reuses the previous row's
answer) getting the answers a full check gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm._jit import settings as jit
from kvfsm.spec import Event, Layout
from kvfsm.verify import DeviceProfile, Level
from kvfsm.verify._block_facts import (
    CODE_SHIFT,
    FOUND,
    LAYOUT,
    PLACED,
    READ_RAW,
    TO_RAW,
    WHOLE,
)
from kvfsm.verify._group_eval import GroupEval
from kvfsm.verify._group_pass import (
    CHECKS_IGNORED,
    FIT,
    N_FLAGS,
    N_PARAMS,
    N_SCALARS,
    P_FULL_SUB_MASK,
    P_OWN_SIZE,
    P_TARGET_SIZE,
    SETTLED_OK,
    group_pass,
)
from kvfsm.verify._paths import restore_paths
from tests.verify_models import DENSE, engine, tokens

#: Every state readable raw (the restore-path code's low bit).
_READ_RAW = 1


def _rows_of(refs: list[list[int]], ids: list[int], history_settled: list[bool]
             ) -> tuple[Any, ...]:
    """Arguments of one index group over four history blocks (one per position, at epoch 0,
    alive): its blocks' references ``refs`` (by block id), the prompt rows ``ids`` and which
    history positions are settled. Target and index blocks are the same size, so history
    position ``p`` may be pointed at from row ``p`` on."""
    n_blocks, n = len(refs), len(ids)
    params = np.zeros(N_PARAMS, dtype=np.int64)
    params[P_FULL_SUB_MASK], params[P_TARGET_SIZE], params[P_OWN_SIZE] = 1, 16, 16
    return (
        np.array(ids, dtype=np.intp), np.zeros(n_blocks, np.uint8), np.zeros(n_blocks, np.uint32),
        np.array([ids.index(b) if b in ids else -1 for b in range(n_blocks)], np.int32),
        np.ones(n_blocks, np.uint16), np.zeros(n_blocks, np.uint8), np.ones(1, np.bool_),
        np.full(1, _READ_RAW, np.uint8), np.zeros(n_blocks, np.uint8),
        np.array(refs, dtype=np.int32), np.zeros((n_blocks, len(refs[0])), np.uint32),
        np.zeros(4, np.uint32), np.zeros(4, np.uint8), np.ones(1, np.bool_),
        np.arange(4, dtype=np.int32), np.zeros((2, 1), np.bool_), params,
        np.arange(4, dtype=np.intp), np.array(history_settled, dtype=np.bool_),
        np.ones(0, np.bool_), np.array([[0], [0], [n]], dtype=np.int64), np.ones(1, np.bool_),
        CHECKS_IGNORED, False, True, all(history_settled), 0, False,
        np.empty(n, np.uint8), np.empty(n, np.uint32), np.empty((N_FLAGS, n), np.bool_),
        np.empty(N_SCALARS + 1, np.int64))


@pytest.mark.parametrize("compiled", [False, True])
def test_repeated_references_get_the_answers_of_a_full_check(compiled: bool) -> None:
    """Rows 1-4 hold the references of the row before them (block 1 twice, then block 0 with
    the same references); position 1 is not settled. Row 0 fails (position 1 is allowed from
    row 1 on) and every later row fits, none settled; block 2 points at settled positions
    only."""
    if compiled and not jit.available:
        pytest.skip("numba is not installed")
    refs = [[0, 1], [0, 1], [0, 2]]
    args = _rows_of(refs, [0, 1, 1, 1, 0, 2], [True, False, True, True])
    with jit.using(compiled):
        group_pass(*args)
    flags = args[-2]
    assert flags[FIT].tolist() == [False, True, True, True, True, True]
    assert flags[SETTLED_OK].tolist() == [False] * 5 + [True]


@pytest.mark.usefixtures("jit_backend")
def test_each_fact_of_a_real_group() -> None:
    """A committed dense prompt: blocks present, placed, whole and readable raw; then one block
    spilled (reachable raw, not readable), two found at each other's positions (the prompt's
    hashes swapped), a hash that is not cached, and every block read under a layout it was not
    written in."""
    eng = engine(DENSE)
    text = tokens(161)
    prompt = eng.prompt(text)
    eng.commit(prompt)
    core = eng.core
    group = core.group("attn")
    high, low = (words[:10].copy() for words in prompt.words(16))
    ids = core.lookup_words("attn", high, low)
    core.fire("attn", [int(ids[3])], Event.SPILL_BEGIN)
    core.fire("attn", [int(ids[3])], Event.SPILL_DONE)
    for words in (high, low):
        words[[5, 6]] = words[[6, 5]]  # positions 5 and 6 find each other's blocks
    high[9] ^= np.uint64(1)  # a hash no block has

    def facts(reads: Layout | None) -> np.ndarray:
        return GroupEval(core, group, high, low, np.zeros(1, dtype=np.int64),
                         level=Level.FULL, kernel_layout=reads, profile=DeviceProfile(),
                         checksums=False).facts

    written = facts(None)
    everything = FOUND | PLACED | WHOLE | LAYOUT | READ_RAW | TO_RAW
    assert written[0] == everything
    assert written[3] & (FOUND | READ_RAW | TO_RAW) == FOUND | TO_RAW
    assert not written[5] & PLACED and not written[6] & PLACED and written[7] & PLACED
    assert written[9] == 0
    code = restore_paths(group.table).code
    assert int(written[0]) >> CODE_SHIFT == int(code[group.states[ids[0]]])
    other = Layout(dim_order=("block", "dim", "token"), alignment=256, padding=0)
    assert (facts(other) & LAYOUT == 0).all()
