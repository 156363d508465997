"""Tests of ``SlotPool``: allocation bookkeeping under any order of takes and releases, refused
calls that change nothing, bytes and checksums surviving copies between tiers and backends,
alignment, and typed views. CuPy variants carry the ``gpu`` marker and skip where there is no
CUDA device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm._errors import KvfsmError
from kvfsm.memory import (
    Backend,
    CupyBackend,
    NumpyBackend,
    PoolExhausted,
    SlotError,
    SlotPool,
    select_backend,
    torch_view,
)
from kvfsm.spec import Tier
from tests.gpu import GPU, HAVE_GPU

Snapshot = tuple[Any, ...]


requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA device")


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=GPU)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return select_backend(request.param)


def snapshot(pool: SlotPool) -> Snapshot:
    """Everything observable about a pool: bookkeeping and every byte, padding included."""
    return (
        pool.owner.copy(),
        pool.checksum.copy(),
        pool.free_slots(),
        pool.free,
        pool.used,
        pool.backend.to_numpy(pool.data).copy() if not pool.on_host else pool.data.copy(),
    )


def assert_same(a: Snapshot, b: Snapshot) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def payload(seed: int, k: int, width: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size=(k, width), dtype=np.uint8)


def host_pool(n: int = 16, width: int = 100, **kw: Any) -> SlotPool:
    return SlotPool(Tier.HOST, n, width, backend=NumpyBackend(), **kw)


# -- allocation ----------------------------------------------------------------------------


def test_fresh_pool() -> None:
    pool = host_pool(8, 100)
    assert (pool.capacity, pool.free, pool.used) == (8, 8, 0)
    assert pool.stride == 256
    assert (pool.owner == -1).all()
    assert pool.data.shape == (8, 256)
    assert pool.data.dtype == np.uint8
    assert pool.problems() == []


def test_take_records_owners_and_release_forgets_them() -> None:
    pool = host_pool(8)
    slots = pool.take(np.array([40, 41, 42]))
    assert slots.dtype == np.int32
    assert slots.tolist() == [0, 1, 2]
    assert pool.owner[slots].tolist() == [40, 41, 42]
    assert (pool.free, pool.used) == (5, 3)
    pool.write(slots, payload(0, 3, 100))
    pool.record_checksum(slots)
    pool.release(slots[1:])
    assert pool.owner.tolist()[:3] == [40, -1, -1]
    assert pool.checksum[1:3].tolist() == [0, 0]
    assert pool.take([7, 8]).tolist() == [1, 2]  # LIFO, same order back
    assert pool.problems() == []


def test_bookkeeping_is_read_only() -> None:
    pool = host_pool(4)
    with pytest.raises(ValueError):
        pool.owner[0] = 3
    with pytest.raises(ValueError):
        pool.checksum[0] = 3


@given(
    n=st.integers(0, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.randoms()), max_size=40),
)
def test_any_order_of_takes_and_releases_keeps_books(n: int, ops: list[Any]) -> None:
    """After any sequence of takes and releases: free + used == capacity, problems() == [],
    the taken slots are distinct, and ``owner`` matches a dict model exactly."""
    pool = host_pool(n, 8, alignment=8)
    model: dict[int, int] = {}
    next_owner = 0
    for is_take, k, rnd in ops:
        if is_take:
            k = min(k, pool.free)
            owners = np.arange(next_owner, next_owner + k)
            next_owner += k
            slots = pool.take(owners)
            assert len(set(slots.tolist())) == k
            assert not set(slots.tolist()) & set(model)
            model.update(zip(slots.tolist(), owners.tolist(), strict=True))
        else:
            victims = rnd.sample(sorted(model), min(k, len(model)))
            rnd.shuffle(victims)
            pool.release(np.array(victims, dtype=np.int64))
            for v in victims:
                del model[v]
        assert pool.free + pool.used == pool.capacity == n
        assert pool.used == len(model)
        assert pool.problems() == []
        expected = np.full(n, -1, dtype=np.int64)
        expected[list(model)] = list(model.values())
        np.testing.assert_array_equal(pool.owner, expected)


@given(n=st.integers(0, 20), used=st.integers(0, 20), extra=st.integers(1, 10))
def test_exhausted_changes_nothing(n: int, used: int, extra: int) -> None:
    """A take asking for more than is free raises PoolExhausted (naming tier, asked and free)
    and leaves the full snapshot unchanged."""
    pool = host_pool(n, 16, alignment=16)
    pool.take(np.arange(min(used, n)))
    before = snapshot(pool)
    asked = pool.free + extra
    with pytest.raises(PoolExhausted) as info:
        pool.take(np.arange(asked))
    assert (info.value.tier, info.value.asked, info.value.free) == (Tier.HOST, asked, pool.free)
    assert "host" in str(info.value)
    assert f"asked for {asked}" in str(info.value)
    assert_same(before, snapshot(pool))


@given(data=st.data(), n=st.integers(1, 20))
def test_bad_release_changes_nothing(data: st.DataObject, n: int) -> None:
    """A release naming a free slot, an out-of-range slot or one slot twice raises SlotError
    and leaves the full snapshot unchanged, however many good slots share its batch."""
    pool = host_pool(n, 16, alignment=16)
    taken = pool.take(np.arange(data.draw(st.integers(0, n))))
    pool.write(taken, payload(1, len(taken), 16))
    pool.record_checksum(taken)
    good = data.draw(st.lists(st.sampled_from(taken.tolist()), unique=True)) if len(taken) else []
    free = pool.free_slots().tolist()
    choices = [st.sampled_from([-1, n, n + 5, -(2**40)])]
    if free:
        choices.append(st.sampled_from(free))
    if good:
        choices.append(st.sampled_from(good))  # a duplicate of a good slot
    bad = data.draw(st.one_of(choices))
    batch = data.draw(st.permutations([*good, bad]))
    before = snapshot(pool)
    with pytest.raises(SlotError):
        pool.release(np.array(batch, dtype=np.int64))
    assert_same(before, snapshot(pool))
    assert pool.problems() == []


def test_double_free_is_refused() -> None:
    pool = host_pool(4)
    slots = pool.take([1, 2])
    pool.release(slots[:1])
    before = snapshot(pool)
    with pytest.raises(SlotError, match="free"):
        pool.release(slots)
    with pytest.raises(SlotError, match="twice"):
        pool.release(np.array([1, 1]))
    assert_same(before, snapshot(pool))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        host_pool(4, 8, alignment=48)
    with pytest.raises(ValueError, match="pinned"):
        SlotPool(Tier.DEVICE, 4, 8, backend=NumpyBackend(), pinned=True)
    pool = host_pool(4)
    with pytest.raises(KvfsmError, match=">= 0"):
        pool.take([-1])
    with pytest.raises(SlotError, match="integer"):
        pool.release(np.array([0.0, 1.0]))
    assert pool.take([]).shape == (0,)
    pool.release([])
    assert pool.problems() == []


def test_problems_finds_corrupt_books() -> None:
    pool = host_pool(4)
    pool.take([9, 9])
    pool._owner[0] = -1  # white-box: a slot freed behind the allocator's back
    found = pool.problems()
    assert any("missing from the free stack" in p for p in found)
    assert any("!= capacity" in p for p in found)


# -- bytes ---------------------------------------------------------------------------------


def test_write_read_round_trip(backend: Backend) -> None:
    pool = SlotPool(Tier.DEVICE, 8, 300, backend=backend)
    slots = pool.take([5, 6, 7])
    data = payload(2, 3, 300)
    pool.write(slots, data)
    np.testing.assert_array_equal(pool.read(slots[::-1]), data[::-1])
    pool.write(slots[:1], backend.asarray(data[2:]))  # a backend array is fine too
    np.testing.assert_array_equal(pool.read(slots[:1]), data[2:])


def test_write_wrong_payload_names_expected_and_got() -> None:
    pool = host_pool(4, 100)
    slots = pool.take([1, 2])
    before = snapshot(pool)
    with pytest.raises(KvfsmError, match=r"uint8 \[2, 100\], got uint8 \[2, 99\]"):
        pool.write(slots, np.zeros((2, 99), dtype=np.uint8))
    with pytest.raises(KvfsmError, match=r"got float32 \[2, 100\]"):
        pool.write(slots, np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(SlotError, match="twice"):
        pool.write(np.array([slots[0], slots[0]]), np.zeros((2, 100), dtype=np.uint8))
    assert_same(before, snapshot(pool))


def test_free_slots_cannot_be_touched() -> None:
    pool = host_pool(4, 10)
    pool.take([1])
    for call in (
        lambda: pool.write([3], np.zeros((1, 10), dtype=np.uint8)),
        lambda: pool.read([3]),
        lambda: pool.record_checksum([3]),
        lambda: pool.verify_checksum([3]),
        lambda: pool.read([4]),
    ):
        with pytest.raises(SlotError):
            call()


def test_round_trip_through_a_pinned_host_tier(backend: Backend) -> None:
    """device -> host (pinned) -> device: every byte and every checksum survives, although the
    three pools have different strides."""
    width = 1000
    dev = SlotPool(Tier.DEVICE, 8, width, backend=backend, alignment=256)
    host = SlotPool(Tier.HOST, 6, width, backend=backend, alignment=4096, pinned=True)
    back = SlotPool(Tier.DEVICE, 8, width, backend=backend, alignment=64)
    assert host.on_host
    assert isinstance(host.data, np.ndarray)
    src = dev.take(np.arange(5))
    data = payload(3, 5, width)
    dev.write(src, data)
    dev.record_checksum(src)
    mid = host.take(np.arange(5))
    dev.copy_rows_to(src, host, mid[::-1])
    np.testing.assert_array_equal(host.read(mid[::-1]), data)
    assert host.verify_checksum(mid).all()
    np.testing.assert_array_equal(host.checksum[mid[::-1]], dev.checksum[src])
    dst = back.take(np.arange(5))[::-1]
    host.copy_rows_to(mid[::-1], back, dst)
    np.testing.assert_array_equal(back.read(dst), data)
    assert back.verify_checksum(dst).all()
    np.testing.assert_array_equal(back.checksum[dst], dev.checksum[src])
    for pool in (dev, host, back):
        assert pool.problems() == []


def test_corrupt_byte_fails_verification(backend: Backend) -> None:
    pool = SlotPool(Tier.DEVICE, 4, 64, backend=backend)
    slots = pool.take([1, 2, 3])
    pool.write(slots, payload(4, 3, 64))
    pool.record_checksum(slots)
    assert pool.verify_checksum(slots).all()
    row = pool.read(slots[1:2])
    row[0, 17] ^= 0x01
    pool.write(slots[1:2], row)
    assert pool.verify_checksum(slots).tolist() == [True, False, True]


def test_corruption_through_the_typed_view_is_caught() -> None:
    pool = host_pool(4, 64)
    slots = pool.take([1, 2])
    pool.write(slots, payload(5, 2, 64))
    pool.record_checksum(slots)
    view = pool.typed_view(np.uint8, 64)
    view[slots[0], 63] ^= 0x80
    assert pool.verify_checksum(slots).tolist() == [False, True]


def test_bad_copies_change_nothing() -> None:
    a, b = host_pool(4, 32), host_pool(4, 32)
    other = host_pool(4, 33)
    sa, sb = a.take([1, 2]), b.take([3])
    a.write(sa, payload(6, 2, 32))
    a.record_checksum(sa)
    snaps = snapshot(a), snapshot(b)
    with pytest.raises(KvfsmError, match="2 source slots but 1 destination"):
        a.copy_rows_to(sa, b, sb)
    with pytest.raises(KvfsmError, match="payload sizes differ"):
        a.copy_rows_to(sa[:1], other, other.take([0]))
    with pytest.raises(SlotError, match="free"):
        a.copy_rows_to(sa[:1], b, [2])
    with pytest.raises(SlotError, match="free"):
        a.copy_rows_to([3], b, sb)
    assert_same(snaps[0], snapshot(a))
    assert_same(snaps[1], snapshot(b))


def test_copy_within_one_pool_overlapping() -> None:
    pool = host_pool(4, 16)
    slots = pool.take([0, 1, 2])
    data = payload(7, 3, 16)
    pool.write(slots, data)
    pool.copy_rows_to(slots[:2], pool, slots[1:])  # shift by one
    np.testing.assert_array_equal(pool.read(slots), data[[0, 0, 1]])


# -- geometry ------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [64, 256, 4096])
@pytest.mark.parametrize("width", [1, 64, 100, 4096, 5000])
def test_every_slot_is_aligned(backend: Backend, alignment: int, width: int) -> None:
    for tier, pinned in ((Tier.DEVICE, False), (Tier.HOST, False), (Tier.HOST, True)):
        pool = SlotPool(tier, 9, width, backend=backend, alignment=alignment, pinned=pinned)
        every = np.arange(9)
        assert pool.stride % alignment == 0
        assert width <= pool.stride < width + alignment
        np.testing.assert_array_equal(pool.offsets(every), every * pool.stride)
        assert pool.aligned(every).all()
        if pool.on_host:
            assert pool.data.ctypes.data % alignment == 0


def test_typed_view_shares_memory(backend: Backend) -> None:
    pool = SlotPool(Tier.DEVICE, 5, 2 * 8 * 4, backend=backend, alignment=256)
    view = pool.typed_view(np.float32, (2, 8))
    assert tuple(view.shape) == (5, 2, 8)
    assert view.dtype == np.float32
    slots = pool.take([1, 2])
    view[slots[1], 1, 7] = 1.5
    backend.synchronize()
    expected = np.zeros((1, 64), dtype=np.uint8)
    expected[0, 60:64] = np.frombuffer(np.float32(1.5).tobytes(), dtype=np.uint8)
    np.testing.assert_array_equal(pool.read(slots[1:]), expected)
    if isinstance(view, np.ndarray):
        assert np.shares_memory(view, pool.data)
    with pytest.raises(KvfsmError, match="expected exactly payload_bytes = 64"):
        pool.typed_view(np.float32, (3, 8))


def test_typed_view_feeds_torch(backend: Backend) -> None:
    torch = pytest.importorskip("torch")
    if backend.is_gpu and not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    pool = SlotPool(Tier.DEVICE, 3, 32, backend=backend)
    slots = pool.take([0, 1, 2])
    tensor = torch_view(pool.typed_view(np.float16, 16))
    tensor[2, 0] = 2.0
    backend.synchronize()
    assert pool.read(slots[2:])[0, :2].tobytes() == np.float16(2.0).tobytes()


# -- GPU-only ------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
def test_cupy_device_pool_lives_on_the_device() -> None:
    import cupy

    cp_backend = CupyBackend()
    dev = SlotPool(Tier.DEVICE, 4, 128, backend=cp_backend, alignment=4096)
    assert isinstance(dev.data, cupy.ndarray)
    assert not dev.on_host
    assert dev.aligned(np.arange(4)).all()
    assert dev.data.data.ptr % 4096 == 0


@pytest.mark.gpu
@requires_gpu
def test_cross_backend_copies() -> None:
    """NumPy device pool -> CuPy device pool -> CuPy pinned host pool keeps bytes and sums."""
    cpu = SlotPool(Tier.DEVICE, 4, 512, backend=NumpyBackend())
    gpu = SlotPool(Tier.DEVICE, 4, 512, backend=CupyBackend())
    pinned = SlotPool(Tier.HOST, 4, 512, backend=CupyBackend(), pinned=True)
    data = payload(8, 4, 512)
    a, b, c = cpu.take(np.arange(4)), gpu.take(np.arange(4)), pinned.take(np.arange(4))
    cpu.write(a, data)
    cpu.record_checksum(a)
    cpu.copy_rows_to(a, gpu, b)
    gpu.copy_rows_to(b, pinned, c)
    np.testing.assert_array_equal(pinned.read(c), data)
    assert gpu.verify_checksum(b).all()
    assert pinned.verify_checksum(c).all()
