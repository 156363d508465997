"""Arrays handed to compiled kernels by address (kvfsm/_addressed.py): a table is made only of
arrays laid out as the kernel views them, it keeps them alive, and a lookup's group pass
through a table answers as the pass over the arrays themselves."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm._addressed import ENTRY, AddressTable, address_table, array_at, register, unowned
from kvfsm._jit import settings as jit
from kvfsm.lookup import Level, _statics
from kvfsm.lookup._group_pass import FIXED_KINDS, pack_fixed
from tests.lookup_models import DEEPSEEK, FOUR, GPT_OSS, PROMPTS, drive, engine

needs_numba = pytest.mark.skipif(not jit.available, reason="numba is not installed")

KINDS = ((np.uint8, 1), (np.int32, 2), (np.uint64, 1))


def _arrays() -> list[np.ndarray[Any, Any]]:
    return [np.arange(5, dtype=np.uint8), np.arange(12, dtype=np.int32).reshape(4, 3),
            np.arange(3, dtype=np.uint64) * 2**40]


def test_a_table_views_each_array_as_it_is() -> None:
    arrays = _arrays()
    table = address_table(arrays, KINDS)
    assert table is not None and not table.flags.writeable
    assert table.dtype == np.int64 and table.size == ENTRY * len(arrays)
    for at, (array, (dtype, dimensions)) in enumerate(zip(arrays, KINDS, strict=True)):
        address, rows, columns = table[ENTRY * at : ENTRY * at + ENTRY].tolist()
        shape = (rows, columns) if dimensions == 2 else (rows,)
        view = array_at(address, shape, dtype)
        assert view.dtype == array.dtype and view.shape == array.shape
        assert view.tolist() == array.tolist()


@pytest.mark.parametrize("change", ["dtype", "dimensions", "strided", "count", "not an array"])
def test_a_table_of_arrays_laid_out_otherwise_is_refused(change: str) -> None:
    """Another dtype, another number of dimensions, a strided view, a count other than the
    kinds', or no array at all: no table (the kernel would read such memory as if laid out
    as the kinds say)."""
    arrays: list[Any] = _arrays()
    kinds = KINDS
    if change == "dtype":
        arrays[0] = arrays[0].astype(np.int8)
    elif change == "dimensions":
        arrays[1] = arrays[1].ravel()
    elif change == "strided":
        arrays[2] = (np.arange(6, dtype=np.uint64))[::2]
    elif change == "count":
        kinds = KINDS[:2]
    else:
        arrays[0] = arrays[0].tolist()
    assert address_table(arrays, kinds) is None


def test_a_table_and_its_copies_keep_the_arrays_alive() -> None:
    """The table holds what it addresses, and so does every copy or view of it: dropping
    every other reference to the arrays leaves the memory the addresses name in place."""
    table = address_table(_arrays(), KINDS)
    assert table is not None
    copies = [table.copy(), table[:], np.array(table, copy=True, subok=True)]
    del table
    gc.collect()
    for copy in copies:
        assert isinstance(copy, AddressTable) and len(copy.held) == len(KINDS)
        address, rows, columns = copy[ENTRY : 2 * ENTRY].tolist()
        assert array_at(address, (rows, columns), np.int32).tolist() == \
            np.arange(12, dtype=np.int32).reshape(4, 3).tolist()


@pytest.mark.parametrize("decl", [DEEPSEEK, FOUR, GPT_OSS], ids=lambda decl: decl.name)
def test_every_shipped_groups_fixed_arrays_pack_into_a_table(decl: Any) -> None:
    """Every group of the models the suite declares (every kind) has its group pass's fixed
    arrays laid out as the address table needs: the lookup never falls back to passing
    sixteen arrays on a compiled first pass."""
    eng = engine(decl, device=24, host=6)
    eng.lookup(PROMPTS[0])
    for group in eng.core.groups.values():
        statics = _statics.statics_for(group, group.decl.layout, eng.profile)
        assert statics.fixed is not None, group.name
        assert statics.fixed_table is not None
        assert len(statics.fixed_table.held) == len(FIXED_KINDS)
        assert pack_fixed(statics.arrays) is not None


@needs_numba
@settings(max_examples=40, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, FOUR, GPT_OSS]))
def test_a_lookup_through_address_tables_answers_as_one_through_the_arrays(
        data: st.DataObject, decl: Any) -> None:
    """In any state the drive reaches, a compiled lookup whose group passes take the fixed
    arrays as address tables gives the verdict of one whose passes take the arrays (the
    statics' tables removed), at every level."""
    eng = engine(decl, device=24, host=6)
    drive(eng, data, data.draw(st.integers(1, 10), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    level = data.draw(st.sampled_from(list(Level)), label="level")
    with jit.using(True):
        through_tables = _core_lookup(eng, prompt, level)
        every = [statics for group in eng.core.groups.values()
                 for statics in _statics._STATICS.get(group, {}).values()]
        every += [statics for known in _known_statics(eng) for statics in known.values()]
        kept = [(statics, statics.fixed) for statics in every]
        try:
            for statics, _ in kept:
                statics.fixed = None
            through_arrays = _core_lookup(eng, prompt, level)
        finally:
            for statics, fixed in kept:
                statics.fixed = fixed
    assert through_tables == through_arrays


def _core_lookup(eng: Any, prompt: Any, level: Level) -> Any:
    """The core's lookup (no checksums recorded, so both calls see the same core)."""
    from kvfsm.lookup import lookup
    return lookup(eng.core, prompt, level=level)


def _known_statics(eng: Any) -> list[dict[Any, Any]]:
    """The statics caches of the lookup's layout of ``eng``'s core."""
    from kvfsm.lookup._lookup_layout import layout_of
    return [known_here for _, _, _, known_here in layout_of(eng.core).groups]


def test_an_unowned_array_is_the_array_itself_outside_compiled_code() -> None:
    array = np.arange(4)
    assert unowned(array) is array


@needs_numba
def test_views_of_an_unowned_array_read_and_write_the_array() -> None:
    """In compiled code an unowned view has the array's shape and memory: slices and dtype
    views of it read what the array holds and writes through them land in the array, for
    vectors and matrices, and the array lives on unchanged in size after the call."""
    import numba

    from kvfsm._jit import _numba

    register(_numba())

    @numba.njit(cache=False)
    def through_views(out: Any, matrix: Any) -> int:
        out, matrix = unowned(out), unowned(matrix)
        words = out[2:6].view(np.uint32)
        words[1] = 7  # the high half of out[2] on a little-endian machine, the low otherwise
        out[0] = out[1] + matrix.shape[0] * 10 + matrix.shape[1]
        row = matrix[1]
        row[0] += 100
        return int(matrix[1, 2] + out.size)

    out = np.arange(8, dtype=np.int64)
    matrix = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert through_views(out, matrix) == 6 + 8
    assert out[0] == 1 + 34 and out.size == 8
    assert out[2:6].view(np.uint32)[1] == 7
    assert matrix[1, 0] == 104 and matrix.sum() == np.arange(12).sum() + 100
