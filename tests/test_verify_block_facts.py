"""Block facts: one byte per prompt block, the same from the compiled pass and the NumPy twin."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvfsm._jit import read_only
from kvfsm._jit import settings as jit
from kvfsm.spec import Event, Layout
from kvfsm.verify._block_facts import (
    CODE_SHIFT,
    FOUND,
    LAYOUT,
    PLACED,
    READ_RAW,
    TO_RAW,
    WHOLE,
    block_facts,
)
from kvfsm.verify._paths import restore_paths
from tests.verify_models import DENSE, block_id, engine, tokens

N_BLOCKS, N_STATES, N_LAYOUTS = 12, 5, 3


@st.composite
def groups(draw: st.DrawFn) -> tuple[SimpleNamespace, np.ndarray, np.ndarray, np.ndarray]:
    """Metadata arrays of a group (only what block_facts reads), prompt ids, layout verdicts
    and restore codes per state, all drawn freely."""
    def array(dtype: type, size: int, low: int, high: int) -> np.ndarray:
        return draw(hnp.arrays(dtype, size, elements=st.integers(low, high)))

    group = SimpleNamespace(
        states=read_only(array(np.uint8, N_BLOCKS, 0, N_STATES - 1)),  # as a machine's view
        position=array(np.int32, N_BLOCKS, -1, 8),
        sub_blocks=array(np.uint16, N_BLOCKS, 0, 3),
        full_sub_mask=draw(st.sampled_from([1, 3])),
        layout_id=array(np.uint8, N_BLOCKS, 0, N_LAYOUTS - 1),
    )
    ids = draw(hnp.arrays(np.intp, st.integers(0, 10), elements=st.integers(-1, N_BLOCKS - 1)))
    layout_ok = draw(hnp.arrays(np.bool_, N_LAYOUTS))
    code = array(np.uint8, N_STATES, 0, 15)
    return group, ids, layout_ok, code


@pytest.mark.skipif(not jit.available, reason="numba is not installed")
@settings(max_examples=200, deadline=None)
@given(drawn=groups())
def test_compiled_and_numpy_facts_agree(
        drawn: tuple[SimpleNamespace, np.ndarray, np.ndarray, np.ndarray]) -> None:
    """For any metadata, ids (missing ones included) and per-layout / per-state inputs, the
    compiled pass and the NumPy twin write the same byte per block, and a missing block's byte
    is 0."""
    group, ids, layout_ok, code = drawn
    compiled = block_facts(group, ids, layout_ok, code)  # type: ignore[arg-type]
    with jit.using(False):
        twin = block_facts(group, ids, layout_ok, code)  # type: ignore[arg-type]
    assert compiled.tolist() == twin.tolist()
    assert not compiled[ids < 0].any()


@pytest.mark.usefixtures("jit_backend")
def test_each_fact_of_a_real_group() -> None:
    """A committed dense prompt: blocks present, placed, whole and readable raw; then one block
    spilled (reachable raw, not readable), one recorded at another position, one written under
    a layout the kernel does not read, and a hash that is not cached."""
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    core = eng.core
    group = core.group("attn")
    ids = np.array([block_id(eng, "attn", text, i) for i in range(10)], dtype=np.intp)
    spilled = int(ids[3])
    core.fire("attn", [spilled], Event.SPILL_BEGIN)
    core.fire("attn", [spilled], Event.SPILL_DONE)
    moved = ids.copy()
    moved[[5, 6]] = moved[[6, 5]]  # positions 5 and 6 hold each other's blocks
    moved[9] = -1
    other = Layout(dim_order=("block", "dim", "token"), alignment=256, padding=0)
    layout_ok = np.array([layout == other for layout in group.layouts])
    code = restore_paths(group.table).code
    facts = block_facts(group, moved, np.ones_like(layout_ok), code)
    everything = FOUND | PLACED | WHOLE | LAYOUT | READ_RAW | TO_RAW
    assert facts[0] == everything
    assert facts[3] & (FOUND | READ_RAW | TO_RAW) == FOUND | TO_RAW
    assert not facts[5] & PLACED and not facts[6] & PLACED and facts[7] & PLACED
    assert facts[9] == 0
    assert (block_facts(group, ids, layout_ok, code) & LAYOUT == 0).all()
    assert int(facts[0]) >> CODE_SHIFT == int(code[group.states[ids[0]]])
