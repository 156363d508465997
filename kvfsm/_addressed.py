"""Arrays handed to a compiled kernel by address: one small table instead of many arguments.

numba unboxes every array argument on every call (some 45 ns each on the development
machine, besides matching its type). A kernel whose many input arrays are
the same ones on every call (a group's metadata, its hash table) can take them as one
read-only ``int64`` table of ``(address, rows, columns)`` triples (:func:`address_table`) and
view them again inside with :func:`array_at`: one unboxing instead of a dozen and more.

What makes it safe: the table is made only from C-contiguous arrays of the exact dtypes and
dimensions the kernel views them as (else :func:`address_table` answers None and the caller
passes the arrays as they are), and the table (an :class:`AddressTable`, and every copy or
view of it) holds the arrays themselves, so no address outlives its memory. A kernel reads
them, and writes those its contract says it writes (a lease's pass: the pins, recency links
and use stamps it keeps), as it would the arrays passed themselves. What an address table
cannot see is an owner swapping an array for another:
it is for arrays made once with their owner (a :class:`~kvfsm.state.GroupState`'s and a hash
table's are; the lookup's statics that hold a table are made again when a group's table is
replaced).

:func:`array_at` is a plain function (NumPy over a ctypes buffer) for twins and plain-Python
runs; compiled code gets numba's own version, registered when kernels are first compiled
(:func:`register`), as do :func:`vector_at` and :func:`matrix_at`, which read an entry of a
table. numba's disk cache checks a kernel against its own file only: a change to these
compiled versions reaches kernels already cached when their files change too.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

#: Entries per array in an address table: its address, its rows, its columns (1: a vector).
ENTRY: Final = 3


class AddressTable(np.ndarray[Any, np.dtype[np.int64]]):
    """An ``int64`` vector of ``(address, rows, columns)`` triples that holds the arrays it
    addresses (``held``; carried over to its copies and views). numba reads it as a plain
    read-only ``int64`` array."""

    held: tuple[NDArray[Any], ...]
    #: The dtype and dimensions of each array, as the table was made for them.
    kinds: tuple[tuple[type[np.generic], int], ...]

    def __array_finalize__(self, obj: object) -> None:
        self.held = getattr(obj, "held", ())
        self.kinds = getattr(obj, "kinds", ())

    def deep_copy(self) -> AddressTable:
        """A table over copies of the arrays this one addresses (each keeping its writeable
        flag): what running a kernel on a copy of its arguments copies (a kernel may write
        what a table addresses)."""
        copies = []
        for array in self.held:
            copy = array.copy()
            copy.flags.writeable = array.flags.writeable
            copies.append(copy)
        table = address_table(copies, self.kinds)
        assert table is not None, "copies are laid out as the arrays they copy"
        return table


def address_table(arrays: Sequence[NDArray[Any]],
                  kinds: Sequence[tuple[type[np.generic], int]]) -> AddressTable | None:
    """``(address, rows, columns)`` per array, read-only, where each array is C-contiguous
    with the dtype and number of dimensions (1 or 2) ``kinds`` names for its position; None
    where one is not (a caller then passes the arrays themselves)."""
    if len(arrays) != len(kinds):
        return None
    table = np.empty(ENTRY * len(arrays), dtype=np.int64).view(AddressTable)
    table.held = tuple(arrays)
    table.kinds = tuple(kinds)
    for at, (array, (dtype, dimensions)) in enumerate(zip(arrays, kinds, strict=True)):
        if not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype) or \
                array.ndim != dimensions or not array.flags.c_contiguous:
            return None
        table[ENTRY * at] = array.ctypes.data
        table[ENTRY * at + 1] = array.shape[0]
        table[ENTRY * at + 2] = array.shape[1] if dimensions == 2 else 1
    table.flags.writeable = False
    return table


def array_at(address: int, shape: tuple[int, ...], dtype: type[np.generic]) -> NDArray[Any]:
    """The C-contiguous array of ``shape`` and ``dtype`` whose data starts at ``address``
    (memory someone else holds alive; see the module docstring)."""
    dtype_of = np.dtype(dtype)
    count = 1
    for size in shape:
        count *= int(size)
    buffer = (ctypes.c_char * (count * dtype_of.itemsize)).from_address(int(address))
    flat: NDArray[Any] = np.frombuffer(memoryview(buffer), dtype=dtype_of, count=count)
    return flat.reshape(tuple(int(size) for size in shape))


def vector_at(table: NDArray[np.int64], at: int, dtype: type[np.generic]) -> NDArray[Any]:
    """The vector entry ``at`` of an address table addresses (compiled code calls it too)."""
    return array_at(table[ENTRY * at], (table[ENTRY * at + 1],), dtype)


def matrix_at(table: NDArray[np.int64], at: int, dtype: type[np.generic]) -> NDArray[Any]:
    """The matrix entry ``at`` of an address table addresses (compiled code calls it too)."""
    return array_at(table[ENTRY * at], (table[ENTRY * at + 1], table[ENTRY * at + 2]), dtype)


def views(table: NDArray[np.int64], kinds: Sequence[tuple[type[np.generic], int]],
          first: int = 0) -> tuple[NDArray[Any], ...]:
    """The arrays entries ``first`` on of an address table address, one per kind in
    ``kinds`` (plain-Python views, for twins)."""
    return tuple(matrix_at(table, first + at, dtype) if dimensions == 2
                 else vector_at(table, first + at, dtype)
                 for at, (dtype, dimensions) in enumerate(kinds))


def unowned(array: NDArray[Any]) -> NDArray[Any]:
    """``array`` itself; in compiled code, a view of it that owns no reference to its memory
    (its views own none either), for an array its caller keeps alive for the whole call.

    Why: every view a compiled kernel takes of an array that owns its memory (a slice, a
    ``view`` of another dtype) takes and gives back a reference with an atomic add, some
    5 ns each, and a kernel that lays out a dozen views of its output paid more for them
    than for a short prompt's work. Views of an unowned array skip both (as the arrays an
    address table addresses do). Safe only where the array outlives every use of the view:
    an argument, which its caller holds for the whole call. Not for an array the kernel
    allocates itself: numba drops a local's reference right after its last use, which may
    come before the view's, and the memory would be freed under the view."""
    return array


_REGISTERED: list[bool] = []
#: Two threads compiling their first kernels at once register the version once.
_REGISTERING = threading.Lock()


def register(numba: Any) -> None:
    """Give compiled code its version of :func:`array_at` (once): ``numba.carray`` over the
    address as a pointer; and :func:`vector_at` and :func:`matrix_at`, compiled into their
    callers."""
    with _REGISTERING:
        if not _REGISTERED:
            _register(numba)
            _REGISTERED.append(True)


def _register(numba: Any) -> None:
    from numba import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def _pointer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            pointer: Any = builder.inttoptr(args[0], context.get_value_type(types.voidptr))
            return pointer
        return types.voidptr(types.int64), codegen

    @overload(array_at)
    def _array_at(address: Any, shape: Any, dtype: Any) -> Any:
        def view(address: Any, shape: Any, dtype: Any) -> Any:
            return numba.carray(_pointer(address), shape, dtype)  # type: ignore[call-arg]
        return view

    from numba.np import arrayobj
    arrays: Any = arrayobj  # untyped

    @intrinsic
    def _without_owner(typingctx: Any, array: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            # The array's own fields but no meminfo (and so no parent object either).
            kind = signature.args[0]
            owned = arrays.make_array(kind)(context, builder, value=args[0])
            view = arrays.make_array(kind)(context, builder)
            arrays.populate_array(view, data=owned.data, shape=owned.shape,
                                  strides=owned.strides, itemsize=owned.itemsize, meminfo=None)
            return view._getvalue()
        return array(array), codegen

    @overload(unowned)
    def _unowned(array: Any) -> Any:
        if isinstance(array, types.Array):
            def view(array: Any) -> Any:
                return _without_owner(array)  # type: ignore[call-arg]
            return view
        return None

    numba.extending.register_jitable(vector_at)
    numba.extending.register_jitable(matrix_at)
