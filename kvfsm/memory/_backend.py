"""One small array-backend interface over NumPy (host) and CuPy (CUDA device).

A slot pool only ever needs a handful of whole-batch operations: allocate, move to and from the
host, gather and scatter rows by an index array, hash rows, and wait for the device. Keeping that
surface this small is what lets the same pool code run on either library.
"""

from __future__ import annotations

import abc
import os
from typing import Any, Final, TypeAlias

import numpy as np
import xxhash
from numpy.typing import DTypeLike, NDArray

from kvfsm._errors import KvfsmError

#: A NumPy ndarray, or a CuPy ndarray on the current device (CuPy has no type stubs).
Array: TypeAlias = Any
Shape: TypeAlias = int | tuple[int, ...]

#: The environment variable that overrides ``select_backend("auto")``.
BACKEND_ENV: Final = "KVFSM_BACKEND"

_CHOICES: Final = ("auto", "numpy", "cupy")


class BackendUnavailable(KvfsmError):
    """The asked-for array backend cannot run here (library missing, or no usable device)."""


class Backend(abc.ABC):
    """Batched array operations on one kind of memory. Indices are host (NumPy) int arrays."""

    name: str
    is_gpu: bool

    @abc.abstractmethod
    def zeros(self, shape: Shape, dtype: DTypeLike) -> Array:
        """A zero-filled array in this backend's memory."""

    @abc.abstractmethod
    def asarray(self, array: NDArray[Any]) -> Array:
        """Host array -> backend array (a copy to the device for CuPy, no copy for NumPy)."""

    @abc.abstractmethod
    def to_numpy(self, array: Array) -> NDArray[Any]:
        """Backend array -> host NumPy array (a blocking copy from the device for CuPy)."""

    @abc.abstractmethod
    def take(self, pool: Array, index: NDArray[np.integer[Any]]) -> Array:
        """The rows ``pool[index]`` as a new contiguous backend array (one batched gather)."""

    @abc.abstractmethod
    def put(self, pool: Array, index: NDArray[np.integer[Any]], values: Array) -> None:
        """``pool[index] = values`` in one batched scatter; ``values`` may be host or backend."""

    @abc.abstractmethod
    def checksum_rows(self, pool: Array, index: NDArray[np.integer[Any]]) -> NDArray[np.uint64]:
        """xxh3_64 of the bytes of each row ``pool[i]`` for ``i`` in ``index``."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until every queued operation of this backend has finished."""

    @abc.abstractmethod
    def pinned_host_zeros(self, shape: Shape, dtype: DTypeLike) -> NDArray[Any]:
        """A zero-filled *host* array; page-locked where the backend has a device to DMA from."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def hash_host_rows(pool: NDArray[Any], index: NDArray[np.integer[Any]]) -> NDArray[np.uint64]:
    """xxh3_64 of the bytes of each host row ``pool[i]`` for ``i`` in ``index``.

    xxhash has no batched API, so this is one C call per row. Rows that are contiguous on their
    own (any 2-D pool with a contiguous last axis, padded or not) are hashed in place; only
    other layouts are gathered first. Hashing in place runs ~10x faster on large rows than
    gathering into a fresh buffer.
    """
    idx = np.asarray(index, dtype=np.intp)
    k = int(idx.shape[0])
    if k == 0:
        return np.empty(0, dtype=np.uint64)
    digest = xxhash.xxh3_64_intdigest
    if pool.ndim == 2 and (pool.shape[1] <= 1 or pool.strides[1] == pool.itemsize):
        return np.fromiter((digest(pool[i]) for i in idx.tolist()), dtype=np.uint64, count=k)
    rows = np.ascontiguousarray(np.take(pool, idx, axis=0)).reshape(k, -1)
    return np.fromiter((digest(rows[i]) for i in range(k)), dtype=np.uint64, count=k)


def data_ptr(array: Array) -> int:
    """The address of an array's first byte: host pointer for NumPy, device pointer for CuPy."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


def _as_index(index: NDArray[Any]) -> NDArray[np.intp]:
    return np.asarray(index, dtype=np.intp)


class NumpyBackend(Backend):
    """Host memory through NumPy; every operation is synchronous."""

    name = "numpy"
    is_gpu = False

    def zeros(self, shape: Shape, dtype: DTypeLike) -> NDArray[Any]:
        return np.zeros(shape, dtype=dtype)

    def asarray(self, array: NDArray[Any]) -> NDArray[Any]:
        return np.asarray(array)

    def to_numpy(self, array: Array) -> NDArray[Any]:
        if isinstance(array, np.ndarray):
            return array
        # A CuPy array handed to the host backend: copy it down rather than fail obscurely.
        get = getattr(array, "get", None)
        if callable(get):
            return np.asarray(get())
        return np.asarray(array)

    def take(self, pool: NDArray[Any], index: NDArray[np.integer[Any]]) -> NDArray[Any]:
        return np.take(pool, _as_index(index), axis=0)

    def put(self, pool: NDArray[Any], index: NDArray[np.integer[Any]], values: Array) -> None:
        pool[_as_index(index)] = self.to_numpy(values)

    def checksum_rows(
        self, pool: NDArray[Any], index: NDArray[np.integer[Any]]
    ) -> NDArray[np.uint64]:
        return hash_host_rows(pool, index)

    def synchronize(self) -> None:
        return None

    def pinned_host_zeros(self, shape: Shape, dtype: DTypeLike) -> NDArray[Any]:
        # No device to DMA from: ordinary pageable memory is all "pinned" could mean here.
        return np.zeros(shape, dtype=dtype)


def _import_cupy() -> Any:
    """The ``cupy`` module when it imports and sees a CUDA device; else BackendUnavailable."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        raise BackendUnavailable(
            f"CuPy backend unavailable: cannot import cupy ({type(exc).__name__}: {exc}); "
            "install it with pip install 'kvfsm[cuda]' on a machine with a CUDA GPU"
        ) from exc
    try:
        available = bool(cupy.cuda.is_available())
    except Exception as exc:
        raise BackendUnavailable(
            f"CuPy backend unavailable: CUDA query failed ({type(exc).__name__}: {exc})"
        ) from exc
    if not available:
        raise BackendUnavailable(
            "CuPy backend unavailable: cupy imports but cupy.cuda.is_available() is False "
            "(no CUDA device or driver visible)"
        )
    return cupy


class CupyBackend(Backend):
    """CUDA device memory through CuPy, on the current device and stream.

    Gathers and scatters are queued on the current stream; ``to_numpy`` blocks until its copy is
    done, ``synchronize`` waits for everything else.
    """

    name = "cupy"
    is_gpu = True

    def __init__(self) -> None:
        self._cp = _import_cupy()

    def zeros(self, shape: Shape, dtype: DTypeLike) -> Array:
        return self._cp.zeros(shape, dtype=dtype)

    def asarray(self, array: NDArray[Any]) -> Array:
        return self._cp.asarray(array)

    def to_numpy(self, array: Array) -> NDArray[Any]:
        if isinstance(array, np.ndarray):
            return array
        return np.asarray(self._cp.asnumpy(array))

    def take(self, pool: Array, index: NDArray[np.integer[Any]]) -> Array:
        cp = self._cp
        return cp.take(pool, cp.asarray(index, dtype=cp.intp), axis=0)

    def put(self, pool: Array, index: NDArray[np.integer[Any]], values: Array) -> None:
        cp = self._cp
        # Explicit host->device conversion: CuPy refuses implicit mixing in some versions.
        pool[cp.asarray(index, dtype=cp.intp)] = cp.asarray(values)

    def checksum_rows(self, pool: Array, index: NDArray[np.integer[Any]]) -> NDArray[np.uint64]:
        # Hashed on the host for now: one gather on the device, one copy down, then xxh3.
        rows = self.to_numpy(self.take(pool, index))
        if rows.shape[0] == 0:
            return np.empty(0, dtype=np.uint64)
        return hash_host_rows(rows.reshape(rows.shape[0], -1), np.arange(rows.shape[0]))

    def synchronize(self) -> None:
        self._cp.cuda.Device().synchronize()

    def pinned_host_zeros(self, shape: Shape, dtype: DTypeLike) -> NDArray[Any]:
        zeros_pinned = _cupyx_zeros_pinned()
        if zeros_pinned is not None:
            return np.asarray(zeros_pinned(shape, dtype=dtype))
        # Older CuPy: wrap a raw page-locked allocation; the array keeps the buffer alive.
        dt = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(dims, dtype=np.int64))
        mem = self._cp.cuda.alloc_pinned_memory(max(count * dt.itemsize, 1))
        out = np.frombuffer(mem, dtype=dt, count=count).reshape(dims)
        out[...] = 0
        return out


def _cupyx_zeros_pinned() -> Any:
    """``cupyx.zeros_pinned`` (CuPy >= 9), or None where this CuPy lacks it."""
    try:
        import cupyx
    except ImportError:
        return None
    return getattr(cupyx, "zeros_pinned", None)


def _cupy_usable() -> bool:
    try:
        _import_cupy()
    except BackendUnavailable:
        return False
    return True


def select_backend(prefer: str = "auto") -> Backend:
    """The backend to use: ``"numpy"`` or ``"cupy"`` force one (CuPy raising
    :class:`BackendUnavailable` when it cannot run); ``"auto"`` takes ``$KVFSM_BACKEND`` when set,
    else CuPy when it imports and sees a device, else NumPy."""
    choice = prefer.strip().lower()
    source = "prefer"
    if choice == "auto":
        env = os.environ.get(BACKEND_ENV, "").strip().lower()
        if env:
            choice, source = env, f"${BACKEND_ENV}"
    if choice not in _CHOICES:
        raise KvfsmError(
            f"unknown array backend {choice!r} (from {source}); expected one of {list(_CHOICES)}"
        )
    if choice == "numpy":
        return NumpyBackend()
    if choice == "cupy":
        return CupyBackend()
    return CupyBackend() if _cupy_usable() else NumpyBackend()


def torch_view(array: Array) -> Any:
    """A torch tensor sharing ``array``'s memory (host or device), through DLPack; no copy."""
    try:
        from torch.utils.dlpack import from_dlpack
    except ImportError as exc:
        raise KvfsmError(
            "torch_view needs PyTorch, an optional extra: pip install 'kvfsm[torch]'"
        ) from exc
    return from_dlpack(array)
