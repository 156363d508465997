"""``SlotPool``: the fixed-size slot allocator of one tier, over one real byte array.

Every slot is one row of a ``[n_slots, stride]`` uint8 array whose rows start at ``alignment``
bytes; the free list is an int32 stack, ownership and checksums are flat arrays. All operations
take whole batches and are O(k) in the batch, and every check runs before anything is written,
so a refused call leaves the pool exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm.memory._backend import Array, Backend, NumpyBackend, data_ptr
from kvfsm.spec._vocabulary import Tier

#: ``owner`` value of a free slot.
FREE = -1

#: Rows at least this long are copied host to host one by one (a Python step per row costs
#: less than faulting in a batch-sized temporary); shorter ones are gathered in one call.
_ROW_COPY_BYTES = 64 << 10

_HOST = NumpyBackend()


def _shown(slots: Iterable[int], limit: int = 8) -> str:
    items = [int(s) for s in slots]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(str(s) for s in items[:limit]) + more


class PoolExhausted(KvfsmError):
    """A ``take`` asked for more slots than are free; nothing was taken."""

    def __init__(self, tier: Tier, asked: int, free: int, capacity: int) -> None:
        self.tier = tier
        self.asked = asked
        self.free = free
        self.capacity = capacity
        super().__init__(
            f"{tier.spec_name} pool exhausted: asked for {asked} slots, {free} free of {capacity}"
        )


class SlotError(KvfsmError):
    """A batch named slots it may not (out of range, free, or duplicated); nothing changed."""

    def __init__(self, tier: Tier, slots: Iterable[int], why: str) -> None:
        self.tier = tier
        self.slots: tuple[int, ...] = tuple(int(s) for s in slots)
        self.why = why
        named = f" {_shown(self.slots)}" if self.slots else ""
        super().__init__(f"{tier.spec_name} pool: slots{named}: {why}")


class SlotPool:
    """``n_slots`` slots of ``payload_bytes`` each, in one tier's memory.

    Device-tier data lives in ``backend`` memory; every other tier lives on the host (page-locked
    through ``backend`` when ``pinned``), so one CuPy backend serves both ends of a spill.
    ``owner`` holds each slot's owner id (-1 = free) and ``checksum`` the xxh3_64 recorded for
    the bytes in that slot. Not thread-safe: one writer at a time.
    """

    def __init__(
        self,
        tier: Tier,
        n_slots: int,
        payload_bytes: int,
        *,
        backend: Backend,
        alignment: int = 256,
        pinned: bool = False,
    ) -> None:
        tier = Tier(tier)
        if not 0 <= n_slots < 2**31:
            raise ValueError(f"n_slots must be in [0, 2**31), got {n_slots}")
        if payload_bytes < 1:
            raise ValueError(f"payload_bytes must be >= 1, got {payload_bytes}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        on_device = tier is Tier.DEVICE
        if pinned and on_device:
            raise ValueError("pinned applies to host-side tiers only, not to the device tier")
        self.tier = tier
        self.backend = backend
        self.payload_bytes = payload_bytes
        self.alignment = alignment
        self.stride = -(-payload_bytes // alignment) * alignment
        self.pinned = pinned
        # The ops that touch this pool's bytes: the backend's own for device data, NumPy's else.
        self._ops: Backend = backend if on_device else _HOST
        # Over-allocate by one alignment and start at the first aligned byte: neither NumPy nor
        # CuPy's pool promises 4096-byte alignment.
        total = n_slots * self.stride + alignment
        if on_device:
            raw = backend.zeros((total,), np.uint8)
        elif pinned:
            raw = backend.pinned_host_zeros((total,), np.uint8)
        else:
            raw = np.zeros(total, dtype=np.uint8)
        shift = -data_ptr(raw) % alignment
        self._data: Array = raw[shift : shift + n_slots * self.stride].reshape(n_slots, self.stride)
        self._payload: Array = self._data[:, :payload_bytes]
        # Free stack: slots[:top] are free; the initial order hands out 0, 1, 2, ... first.
        self._stack = np.arange(n_slots - 1, -1, -1, dtype=np.int32)
        self._top = n_slots
        self._owner = np.full(n_slots, FREE, dtype=np.int64)
        self._checksum = np.zeros(n_slots, dtype=np.uint64)
        # Scratch for the O(k) duplicate check (no sort); its contents never matter.
        self._mark = np.zeros(n_slots, dtype=np.intp)

    # -- counts and views ------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return int(self._owner.shape[0])

    @property
    def free(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.capacity - self._top

    @property
    def on_host(self) -> bool:
        """Whether this pool's bytes are host memory (NumPy arrays)."""
        return not self._ops.is_gpu

    @property
    def owner(self) -> NDArray[np.int64]:
        """A read-only view of each slot's owner id (-1 = free)."""
        view = self._owner.view()
        view.setflags(write=False)
        return view

    @property
    def checksum(self) -> NDArray[np.uint64]:
        """A read-only view of each slot's recorded xxh3_64 (0 = none recorded)."""
        view = self._checksum.view()
        view.setflags(write=False)
        return view

    @property
    def data(self) -> Array:
        """The whole ``[n_slots, stride]`` uint8 backend array, padding included."""
        return self._data

    def free_slots(self) -> NDArray[np.int32]:
        """A copy of the free stack, bottom first (the next ``take`` pops from the end)."""
        return self._stack[: self._top].copy()

    def __repr__(self) -> str:
        return (
            f"SlotPool({self.tier.spec_name}, {self.capacity} x {self.payload_bytes} B "
            f"(stride {self.stride}), {self.free} free, backend={self.backend.name}"
            f"{', pinned' if self.pinned else ''})"
        )

    # -- allocation ------------------------------------------------------------------------

    def take(self, owners: ArrayLike) -> NDArray[np.int32]:
        """Take ``len(owners)`` slots, recording their owners; returns the slots, in O(k).

        Raises :class:`PoolExhausted` (nothing taken) when fewer are free.
        """
        own = np.asarray(owners)
        if own.size == 0:
            return np.empty(0, dtype=np.int32)
        if own.ndim != 1 or not np.issubdtype(own.dtype, np.integer):
            raise KvfsmError(
                f"{self.tier.spec_name} pool: owners must be a 1-D integer array, got "
                f"shape {own.shape} dtype {own.dtype}"
            )
        if (own < 0).any():
            raise KvfsmError(
                f"{self.tier.spec_name} pool: owner ids must be >= 0 (-1 marks a free slot), "
                f"got {_shown(own[own < 0])}"
            )
        k = int(own.shape[0])
        top = self._top
        if k > top:
            raise PoolExhausted(self.tier, k, top, self.capacity)
        slots = self._stack[top - k : top][::-1].copy()
        self._top = top - k
        self._owner[slots] = own
        return slots

    def release(self, slots: ArrayLike) -> None:
        """Return used slots to the free stack, in O(k); forgets their owners and checksums.

        Raises :class:`SlotError` (nothing released) for a slot out of range, already free, or
        named twice in the batch.
        """
        idx = self._slots(slots, unique=True, live=True)
        k = int(idx.shape[0])
        if k == 0:
            return
        # Pushed reversed, so a following take(k) hands the same slots back in the same order.
        self._stack[self._top : self._top + k] = idx[::-1]
        self._top += k
        self._owner[idx] = FREE
        self._checksum[idx] = 0

    # -- bytes -----------------------------------------------------------------------------

    def write(self, slots: ArrayLike, payload: Array) -> None:
        """Write ``payload`` (uint8 ``[k, payload_bytes]``, host or backend array) into used
        slots. Does not record checksums: that is :meth:`record_checksum`'s job."""
        idx = self._slots(slots, unique=True, live=True)
        shape = tuple(getattr(payload, "shape", np.shape(payload)))
        dtype = np.dtype(getattr(payload, "dtype", np.asarray(payload).dtype))
        expected = (int(idx.shape[0]), self.payload_bytes)
        if shape != expected or dtype != np.uint8:
            raise KvfsmError(
                f"{self.tier.spec_name} pool: payload must be uint8 {list(expected)}, got "
                f"{dtype} {list(shape)}"
            )
        if idx.shape[0]:
            self._ops.put(self._payload, idx, payload)

    def read(self, slots: ArrayLike) -> NDArray[np.uint8]:
        """A host copy of the payload bytes of used slots, uint8 ``[k, payload_bytes]``."""
        idx = self._slots(slots, unique=False, live=True)
        return self._ops.to_numpy(self._ops.take(self._payload, idx))

    def copy_rows_to(self, src_slots: ArrayLike, dst_pool: SlotPool, dst_slots: ArrayLike) -> None:
        """Copy the payload bytes and recorded checksums of used ``src_slots`` into used
        ``dst_slots`` of ``dst_pool`` (any tier, any backend: device <-> host included)."""
        if dst_pool.payload_bytes != self.payload_bytes:
            raise KvfsmError(
                f"copy {self.tier.spec_name} -> {dst_pool.tier.spec_name}: payload sizes "
                f"differ ({self.payload_bytes} B vs {dst_pool.payload_bytes} B)"
            )
        src = self._slots(src_slots, unique=False, live=True)
        dst = dst_pool._slots(dst_slots, unique=True, live=True)
        if src.shape[0] != dst.shape[0]:
            raise KvfsmError(
                f"copy {self.tier.spec_name} -> {dst_pool.tier.spec_name}: "
                f"{src.shape[0]} source slots but {dst.shape[0]} destination slots"
            )
        if src.shape[0] == 0:
            return
        if (dst_pool is not self and not self._ops.is_gpu and not dst_pool._ops.is_gpu
                and self.payload_bytes >= _ROW_COPY_BYTES):
            # Host to host, large rows: copy row to row, no batch-sized temporary to fault in.
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                np.copyto(dst_pool._payload[d], self._payload[s])
            dst_pool._checksum[dst] = self._checksum[src]
            return
        # Gather first (a copy), so overlapping src/dst within one pool is still correct.
        rows = self._ops.take(self._payload, src)
        src_gpu, dst_gpu = self._ops.is_gpu, dst_pool._ops.is_gpu
        if src_gpu and not dst_gpu:
            rows = self._ops.to_numpy(rows)
        elif dst_gpu and not src_gpu:
            rows = dst_pool._ops.asarray(rows)
        dst_pool._ops.put(dst_pool._payload, dst, rows)
        # The checksum travels with the bytes it describes.
        dst_pool._checksum[dst] = self._checksum[src]

    def row_views(self, slots: ArrayLike) -> list[NDArray[np.uint8]]:
        """Writable views of the payload bytes of used slots of a host-memory pool, one per
        slot, in order: where a loader reads a stored copy straight into the slot it will be
        verified in (no staging copy). A device pool on a GPU has none: stage and ``write``."""
        if not self.on_host:
            raise KvfsmError(f"{self.tier.spec_name} pool: its bytes are device memory; "
                             "load into a host buffer and write() them")
        idx = self._slots(slots, unique=True, live=True)
        payload: NDArray[np.uint8] = self._payload
        return [payload[i] for i in idx.tolist()]

    def set_checksums(self, slots: ArrayLike, checksums: ArrayLike) -> None:
        """Record, for used slots, checksums computed where their bytes came from (a stored
        copy's header): the ``checksum_ok`` guard then re-hashes what actually arrived."""
        idx = self._slots(slots, unique=True, live=True)
        values = np.asarray(checksums, dtype=np.uint64)
        if values.shape != idx.shape:
            raise KvfsmError(f"{self.tier.spec_name} pool: {idx.shape[0]} slots but "
                             f"{values.shape} checksums")
        self._checksum[idx] = values

    # -- checksums -------------------------------------------------------------------------

    def record_checksum(self, slots: ArrayLike) -> None:
        """Hash the payload bytes of used slots now and record it as their checksum."""
        idx = self._slots(slots, unique=False, live=True)
        if idx.shape[0]:
            self._checksum[idx] = self._ops.checksum_rows(self._payload, idx)

    def verify_checksum(self, slots: ArrayLike) -> NDArray[np.bool_]:
        """Per slot: does a fresh hash of its payload equal the recorded checksum?"""
        idx = self._slots(slots, unique=False, live=True)
        if idx.shape[0] == 0:
            return np.zeros(0, dtype=np.bool_)
        return np.asarray(self._ops.checksum_rows(self._payload, idx) == self._checksum[idx])

    # -- geometry --------------------------------------------------------------------------

    def offsets(self, slots: ArrayLike) -> NDArray[np.int64]:
        """Byte offsets of slots from the start of :attr:`data` (free slots included)."""
        idx = self._slots(slots, unique=False, live=False)
        return idx.astype(np.int64) * np.int64(self.stride)

    def aligned(self, slots: ArrayLike) -> NDArray[np.bool_]:
        """Per slot: is its first byte's real address a multiple of ``alignment``?"""
        base = np.int64(data_ptr(self._data))
        return np.asarray((base + self.offsets(slots)) % np.int64(self.alignment) == 0)

    def typed_view(self, dtype: DTypeLike, shape: int | tuple[int, ...]) -> Array:
        """The payload of every slot as ``[n_slots, *shape]`` of ``dtype``, sharing memory (for
        kernels and :func:`torch_view`); ``shape`` must cover exactly ``payload_bytes``."""
        dt = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        got = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        if got != self.payload_bytes or dt.itemsize == 0:
            raise KvfsmError(
                f"{self.tier.spec_name} pool: typed view {dt} {list(dims)} covers {got} B, "
                f"expected exactly payload_bytes = {self.payload_bytes} B"
            )
        if self.stride % dt.itemsize:
            raise KvfsmError(
                f"{self.tier.spec_name} pool: stride {self.stride} B is not a multiple of "
                f"{dt} ({dt.itemsize} B)"
            )
        # Reinterpret the contiguous whole first (CuPy needs C order for that), then slice off
        # the padding and split the last axis: both are views on NumPy and CuPy alike.
        full = self._data.view(dt)
        out = full[:, : self.payload_bytes // dt.itemsize].reshape((self.capacity, *dims))
        if self.capacity and (
            data_ptr(out) != data_ptr(self._data)
            or (self.capacity > 1 and out.strides[0] != self.stride)
        ):
            raise KvfsmError(f"{self.tier.spec_name} pool: typed view would copy, refused")
        return out

    # -- self-check ------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Everything wrong with the bookkeeping; ``[]`` when the free stack holds exactly the
        slots whose owner is -1, each once, and the counts add up."""
        out: list[str] = []
        n, top = self.capacity, self._top
        name = self.tier.spec_name
        if not 0 <= top <= n:
            return [f"{name}: free-stack top {top} outside [0, {n}]"]
        entries = self._stack[:top].astype(np.int64)
        outside = entries[(entries < 0) | (entries >= n)]
        if outside.size:
            out.append(f"{name}: free stack holds out-of-range slots {_shown(outside)}")
            entries = entries[(entries >= 0) & (entries < n)]
        uniq, counts = np.unique(entries, return_counts=True)
        if (counts > 1).any():
            out.append(f"{name}: free stack holds slots twice: {_shown(uniq[counts > 1])}")
        bad_owner = np.flatnonzero(self._owner < FREE)
        if bad_owner.size:
            out.append(f"{name}: slots with owner < -1: {_shown(bad_owner)}")
        is_free = self._owner == FREE
        on_stack = np.zeros(n, dtype=np.bool_)
        on_stack[uniq] = True
        owned_on_stack = np.flatnonzero(on_stack & ~is_free)
        if owned_on_stack.size:
            out.append(f"{name}: owned slots on the free stack: {_shown(owned_on_stack)}")
        lost = np.flatnonzero(is_free & ~on_stack)
        if lost.size:
            out.append(f"{name}: free slots missing from the free stack: {_shown(lost)}")
        n_used = int(np.count_nonzero(~is_free))
        if top + n_used != n:
            out.append(f"{name}: free {top} + used {n_used} != capacity {n}")
        return out

    # -- checks ----------------------------------------------------------------------------

    def _slots(self, slots: ArrayLike, *, unique: bool, live: bool) -> NDArray[np.intp]:
        """Validate a batch of slot indices; raises :class:`SlotError`, writes no state."""
        arr = np.asarray(slots)
        if arr.size == 0:
            return np.empty(0, dtype=np.intp)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise SlotError(
                self.tier, (), f"must be a 1-D integer array, got shape {arr.shape} {arr.dtype}"
            )
        n = self.capacity
        bad = (arr < 0) | (arr >= n)
        if bad.any():
            raise SlotError(self.tier, arr[bad], f"out of range [0, {n})")
        idx = arr.astype(np.intp, copy=False)
        k = int(idx.shape[0])
        if unique and k > 1:
            # Each slot remembers the last batch position that named it; a mismatch is a repeat.
            pos = np.arange(k, dtype=np.intp)
            self._mark[idx] = pos
            repeated = self._mark[idx] != pos
            if repeated.any():
                raise SlotError(self.tier, np.unique(idx[repeated]), "named twice in the batch")
        if live:
            idle = self._owner[idx] == FREE
            if idle.any():
                raise SlotError(self.tier, idx[idle], "free (released or never taken)")
        return idx
