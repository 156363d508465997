"""Arrays handed to compiled kernels by address (kvfsm/_addressed.py): a table is made only of
arrays laid out as the kernel views them, it keeps them alive, and a lookup's group pass
through a table answers as the pass over the arrays themselves."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from kvfsm._addressed import ENTRY, AddressTable, address_table, array_at, register, unowned
from kvfsm._jit import settings as jit
from kvfsm.lookup import _statics
from kvfsm.lookup._group_pass import FIXED_KINDS, pack_fixed
from tests.lookup_models import DEEPSEEK, FOUR, GPT_OSS, PROMPTS, engine

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
    """Every group of the models the suite declares (every kind) hands its group pass the
    fixed arrays as one address table holding them."""
    eng = engine(decl, device=24, host=6)
    eng.lookup(PROMPTS[0])
    for group in eng.core.groups.values():
        statics = _statics.statics_for(group, group.decl.layout, eng.profile)
        table = statics.fixed_table
        assert isinstance(table, AddressTable), group.name
        assert len(table.held) == len(FIXED_KINDS) and table.held[4] is group.states
        assert statics.fixed.tolist() == table.tolist()


def test_the_group_pass_refuses_fixed_arrays_laid_out_otherwise() -> None:
    """An array of another dtype or a strided one cannot be read by address: a TypeError
    naming the layouts, never a table that would be misread."""
    eng = engine(FOUR)
    group = next(iter(eng.core.groups.values()))
    arrays = list(group.hash_map.slots for _ in FIXED_KINDS)
    with pytest.raises(TypeError, match="FIXED_KINDS"):
        pack_fixed(tuple(arrays))
    with pytest.raises(TypeError, match="FIXED_KINDS"):
        pack_fixed((np.zeros(16, np.uint64)[::2], *arrays[1:]))


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
