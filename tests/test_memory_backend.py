"""Tests of the array backends: host/device round trips, batched gather and scatter, row
checksums, backend selection, and the zero-copy torch view. CuPy tests carry the ``gpu`` marker
and skip cleanly where CuPy or a CUDA device is missing."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvfsm._errors import KvfsmError
from kvfsm.memory import (
    Backend,
    BackendUnavailable,
    CupyBackend,
    NumpyBackend,
    select_backend,
    torch_view,
)
from tests.gpu import GPU, HAVE_GPU


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=GPU)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return select_backend(request.param)


def _host_rows(rng: np.random.Generator, n: int, width: int) -> np.ndarray[Any, Any]:
    return rng.integers(0, 256, size=(n, width), dtype=np.uint8)


# -- round trips and gather/scatter --------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float16, np.float32, np.uint64])
def test_round_trip(backend: Backend, dtype: type[np.generic]) -> None:
    host = np.arange(60, dtype=dtype).reshape(3, 4, 5)
    back = backend.to_numpy(backend.asarray(host))
    assert isinstance(back, np.ndarray)
    assert back.dtype == host.dtype
    np.testing.assert_array_equal(back, host)


def test_zeros(backend: Backend) -> None:
    z = backend.to_numpy(backend.zeros((4, 3), np.float32))
    assert z.shape == (4, 3)
    assert z.dtype == np.float32
    assert not z.any()


def test_gather_scatter(backend: Backend) -> None:
    rng = np.random.default_rng(0)
    ref = _host_rows(rng, 32, 48)
    pool = backend.asarray(ref)
    index = np.array([5, 0, 31, 5], dtype=np.int32)
    np.testing.assert_array_equal(backend.to_numpy(backend.take(pool, index)), ref[index])
    dst = np.array([3, 9, 1], dtype=np.int64)
    values = _host_rows(rng, 3, 48)
    backend.put(pool, dst, values)  # host values into a backend pool
    backend.put(pool, np.array([7]), backend.asarray(values[:1]))  # backend values too
    backend.synchronize()
    ref[dst] = values
    ref[7] = values[0]
    np.testing.assert_array_equal(backend.to_numpy(pool), ref)


@given(
    pool=hnp.arrays(np.uint8, st.tuples(st.integers(1, 24), st.integers(1, 40))),
    data=st.data(),
)
def test_numpy_take_put_match_fancy_indexing(
    pool: np.ndarray[Any, Any], data: st.DataObject
) -> None:
    """take is ``pool[index]`` for any index (repeats allowed); put of distinct rows is
    ``pool[index] = values``, leaving every other row untouched."""
    b = NumpyBackend()
    n, width = pool.shape
    index = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=3 * n)), dtype=np.int64)
    np.testing.assert_array_equal(b.take(pool, index), pool[index])
    dst = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True)), dtype=np.int32)
    values = data.draw(hnp.arrays(np.uint8, (dst.shape[0], width)))
    expected = pool.copy()
    expected[dst] = values
    b.put(pool, dst, values)
    np.testing.assert_array_equal(pool, expected)


# -- checksums -----------------------------------------------------------------------------


def test_checksum_is_xxh3_of_row_bytes(backend: Backend) -> None:
    rng = np.random.default_rng(1)
    ref = _host_rows(rng, 10, 100)
    pool = backend.asarray(ref)
    index = np.array([0, 9, 4, 4])
    got = backend.checksum_rows(pool, index)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxhash.xxh3_64_intdigest(ref[i].tobytes()) for i in index]


def test_checksum_of_non_contiguous_rows_hashes_only_the_view(backend: Backend) -> None:
    """A padded pool's payload columns hash the same as the bare payload."""
    rng = np.random.default_rng(2)
    padded = _host_rows(rng, 6, 64)
    pool = backend.asarray(padded)
    index = np.arange(6)
    np.testing.assert_array_equal(
        backend.checksum_rows(pool[:, :40], index),
        NumpyBackend().checksum_rows(np.ascontiguousarray(padded[:, :40]), index),
    )


def test_checksum_of_strided_and_nd_rows() -> None:
    """Rows that are not contiguous on their own hash their logical bytes, in C order."""
    b = NumpyBackend()
    cube = np.arange(5 * 3 * 4, dtype=np.uint8).reshape(5, 3, 4)
    strided = np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2]
    for pool in (cube, strided):
        index = np.array([4, 1])
        expected = [
            xxhash.xxh3_64_intdigest(np.ascontiguousarray(pool[i]).tobytes()) for i in index
        ]
        assert b.checksum_rows(pool, index).tolist() == expected


@given(rows=hnp.arrays(np.uint8, st.tuples(st.integers(0, 16), st.integers(1, 64))))
def test_checksum_matches_per_row_digest(rows: np.ndarray[Any, Any]) -> None:
    """checksum_rows(pool, index)[j] == xxh3_64(bytes of pool[index[j]]) for every j."""
    index = np.arange(rows.shape[0])[::-1]
    got = NumpyBackend().checksum_rows(rows, index)
    assert got.tolist() == [xxhash.xxh3_64_intdigest(rows[i].tobytes()) for i in index]


def test_checksum_sees_one_flipped_bit() -> None:
    rows = np.zeros((2, 4096), dtype=np.uint8)
    rows[1, 2048] = 1
    a, b = NumpyBackend().checksum_rows(rows, np.array([0, 1]))
    assert a != b


def test_empty_batches(backend: Backend) -> None:
    pool = backend.zeros((4, 8), np.uint8)
    none = np.empty(0, dtype=np.int64)
    assert backend.to_numpy(backend.take(pool, none)).shape == (0, 8)
    assert backend.checksum_rows(pool, none).shape == (0,)


def test_pinned_host_zeros_is_a_host_array(backend: Backend) -> None:
    host = backend.pinned_host_zeros((3, 256), np.uint8)
    assert isinstance(host, np.ndarray)
    assert host.shape == (3, 256)
    assert not host.any()
    host[:] = 7  # writable host memory
    assert int(host.sum()) == 7 * 3 * 256


# -- selection -----------------------------------------------------------------------------


def test_select_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFSM_BACKEND", "cupy")  # only "auto" reads the env var
    b = select_backend("numpy")
    assert isinstance(b, NumpyBackend)
    assert (b.name, b.is_gpu) == ("numpy", False)


def test_env_overrides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFSM_BACKEND", "numpy")
    assert isinstance(select_backend(), NumpyBackend)
    monkeypatch.setenv("KVFSM_BACKEND", "tpu")
    with pytest.raises(KvfsmError, match="KVFSM_BACKEND"):
        select_backend()


def test_unknown_preference() -> None:
    with pytest.raises(KvfsmError, match="'metal'"):
        select_backend("metal")


def test_auto_without_gpu_is_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert isinstance(select_backend("auto"), NumpyBackend)


def test_cupy_missing_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailable, match="cannot import cupy"):
        CupyBackend()
    with pytest.raises(BackendUnavailable):
        select_backend("cupy")
    assert issubclass(BackendUnavailable, KvfsmError)


def test_cupy_without_device_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(BackendUnavailable, match="is_available"):
        CupyBackend()
    monkeypatch.delenv("KVFSM_BACKEND", raising=False)
    assert isinstance(select_backend(), NumpyBackend)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA device")
def test_auto_prefers_cupy_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_BACKEND", raising=False)
    b = select_backend()
    assert isinstance(b, CupyBackend)
    assert (b.name, b.is_gpu) == ("cupy", True)


# -- torch ---------------------------------------------------------------------------------


def test_torch_view_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other tests may have imported torch already: hide every module the view imports.
    for name in ("torch", "torch.utils", "torch.utils.dlpack"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(KvfsmError, match=r"pip install 'kvfsm\[torch\]'"):
        torch_view(np.zeros(4, dtype=np.uint8))


def test_torch_view_shares_memory(backend: Backend) -> None:
    torch = pytest.importorskip("torch")
    if backend.is_gpu and not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    arr = backend.zeros((4, 8), np.float32)
    tensor = torch_view(arr)
    assert tuple(tensor.shape) == (4, 8)
    tensor[2, 3] = 5.0
    backend.synchronize()
    assert backend.to_numpy(arr)[2, 3] == 5.0
