"""Deterministic faults on a live engine, for every kind the served models declare.

Each injector acts on one block of a prompt (by its index in the prompt), through the state
core's own events where the fault is a state (an eviction, a spill, a restore in flight, a
compression under way) and on the pool bytes directly where it is damage no event records (a
corrupted host copy, device bytes flipped in place, a snapshot overwritten by another). Each
returns one line describing what it did, or why it did nothing (the block is not cached in that
state), and never raises for a block that is missing.

Any kind (``group`` names the group; the default is the model's first ``full`` group, else
its first group):

* :func:`corrupt_host_copy`: a block is spilled to host and one byte of its host copy flipped.
* :func:`flip_device_bytes`: sign bits of a resident block flipped on the device (silent: its
  state and recorded checksum are unchanged; only a FULL lookup recomputes the checksum).
* :func:`spill_block`: a block spilled to host and left there.
* :func:`restore_in_flight`: a spilled block whose restore has begun and not finished; by
  default half of the copy has not landed (the device slot's second half is still zeros).

Sliding window:

* :func:`evict_window_block`: a sliding-window block inside the window is evicted.

Recurrent (a snapshot exists only at its checkpoint; ``index`` defaults to the snapshot at the
prompt's longest reusable checkpoint, :func:`checkpoint_block`):

* :func:`evict_snapshot`: the snapshot is evicted. Both engines see the miss and resume from an
  earlier checkpoint.
* :func:`stale_snapshot`: the snapshot's device bytes are those of an earlier checkpoint (a
  snapshot write that never landed over a reused slot), silently: a hit-only engine resumes
  from the wrong position's state; a FULL lookup sees the checksum fail.

Compressed (``index`` defaults to the last compressed block of the prompt's longest reusable
prefix):

* :func:`evict_compressed_block`: a compressed block is evicted: every longer prefix loses it.
* :func:`compression_incomplete`: the block is caught again mid-compression (re-written raw,
  ``compress_begin`` fired, ``compress_done`` not yet): not readable in compressed form until
  the compression completes (the verdict's plan finishes it). Its raw bytes are the entries
  themselves (the declaration's compressor emits entries already compressed), so this fault
  damages nothing a reader sees; it exercises the plan path, not a wrong read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._engine import Engine
from kvfsm.spec import Event, GroupKind, Tier
from kvfsm.state import GroupState
from kvfsm.verify import Prompt


def _prompt(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike) -> Prompt:
    return prompt if isinstance(prompt, Prompt) else engine.prompt(prompt)


def _default(engine: Engine) -> str:
    """The model's first ``full`` group, else its first group."""
    try:
        return group_of_kind(engine, GroupKind.FULL)
    except KeyError:
        return engine.model.groups[0].name


def group_of_kind(engine: Engine, kind: GroupKind | str) -> str:
    """The name of ``engine``'s first group of ``kind``."""
    wanted = GroupKind(kind)
    for decl in engine.model.groups:
        if decl.kind is wanted:
            return decl.name
    raise KeyError(f"{engine.model.name}: no {wanted.value} group")


def block_id(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, group: str,
             index: int) -> int:
    """The id of ``prompt``'s block ``index`` of ``group`` in the hash map, -1 if not cached."""
    prompt = _prompt(engine, prompt)
    high, low = prompt.words(engine.core.group(group).decl.block_size)
    if not 0 <= index < high.size:
        return -1
    return int(engine.core.lookup_words(group, high[index : index + 1],
                                        low[index : index + 1])[0])


def window_blocks(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike,
                  group: str | None = None) -> list[int]:
    """Indices of the sliding-window blocks the prompt's longest reusable prefix needs (the
    largest multiple of the block size below its last token)."""
    prompt = _prompt(engine, prompt)
    name = group or group_of_kind(engine, GroupKind.SLIDING_WINDOW)
    state = engine.core.group(name)
    step = engine.model.lcm_block_size
    length = (max(prompt.n_tokens - 1, 0) // step) * step
    needed = state.rule.needed(state.decl, np.array([length], dtype=np.int64))
    return list(range(int(needed.lo[0]), int(needed.hi[0])))


def _state(group: GroupState, block: int) -> str:
    return group.table.state_name(int(group.states[block]))


def _where(group: str, index: int, block: int) -> str:
    return f"{group} block {index} (id {block})"


def _evict(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, name: str, index: int,
           what: str) -> str:
    """Evict the prompt's block ``index`` of group ``name``; says what happened, ``what``
    naming the block in the success message (``"snapshot evicted"``)."""
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, nothing evicted"
    before = _state(engine.core.group(name), block)
    if not engine.core.fire(name, [block], Event.EVICT, masked=True)[0]:
        return f"{_where(name, index, block)}: cannot be evicted from {before!r}"
    return f"{_where(name, index, block)}{what} (was {before!r})"


def evict_window_block(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                       index: int | None = None, group: str | None = None) -> str:
    """Evict a sliding-window block inside the window of the prompt's longest reusable prefix
    (``index`` defaults to the window's last block)."""
    name = group or group_of_kind(engine, GroupKind.SLIDING_WINDOW)
    if index is None:
        window = window_blocks(engine, prompt, name)
        if not window:
            return f"{name}: no window block to evict (prompt too short)"
        index = window[-1]
    return _evict(engine, prompt, name, index, " inside the window evicted")


def _spill(engine: Engine, name: str, block: int) -> bool:
    """Spill ``block`` to host if it is resident; True when it ends on host."""
    state = engine.core.group(name)
    if _state(state, block) == "host":
        return True
    if not engine.core.fire(name, [block], Event.SPILL_BEGIN, masked=True)[0]:
        return False
    if not engine.core.fire(name, [block], Event.SPILL_DONE, masked=True)[0]:
        engine.core.fire(name, [block], Event.SPILL_FAIL, masked=True)
        return False
    return True


def spill_block(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                index: int, group: str | None = None) -> str:
    """Spill a block to host and leave it there (a hit that must be restored before use)."""
    name = group or _default(engine)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, nothing spilled"
    if not _spill(engine, name, block):
        return f"{_where(name, index, block)}: cannot be spilled from " \
               f"{_state(engine.core.group(name), block)!r}"
    return f"{_where(name, index, block)} spilled to host, left unrestored"


def corrupt_host_copy(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                      index: int, group: str | None = None, byte: int = 3) -> str:
    """Spill a block to host (if resident) and flip one byte of its host copy (``byte`` 3 is
    the sign and top exponent bits of the first float32 value)."""
    name = group or _default(engine)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, nothing corrupted"
    if not _spill(engine, name, block):
        return f"{_where(name, index, block)}: cannot be spilled from " \
               f"{_state(engine.core.group(name), block)!r}"
    state = engine.core.group(name)
    slot = int(state.slot[Tier.HOST][block])
    state.pools[Tier.HOST].data[slot, byte] ^= 0xFF
    return f"{_where(name, index, block)} spilled, byte {byte} of its host copy flipped"


def flip_device_bytes(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                      index: int, group: str | None = None, values: int = 16,
                      first: int = 0) -> str:
    """Flip the sign bit of ``values`` consecutive values (from value ``first``) of a resident
    block's device bytes, in place: silent corruption, no state or checksum moves."""
    name = group or _default(engine)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, nothing flipped"
    state = engine.core.group(name)
    slot = int(state.slot[Tier.DEVICE][block])
    if slot < 0:
        return f"{_where(name, index, block)}: not on the device ({_state(state, block)!r})"
    size = np.dtype(state.decl.dtype).itemsize
    top = (first + np.arange(values)) * size + size - 1  # little-endian: sign in the last byte
    state.pools[Tier.DEVICE].data[slot, top] ^= 0x80
    return (f"{_where(name, index, block)}: sign bits of values {first}..{first + values - 1} "
            "flipped on the device")


def restore_in_flight(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                      index: int, group: str | None = None, landed: bool = False) -> str:
    """Spill a block (if resident) and begin its restore without finishing it. Unless
    ``landed``, the second half of the device slot is zeroed: that part of the copy has not
    arrived yet."""
    name = group or _default(engine)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, no restore begun"
    if not _spill(engine, name, block):
        return f"{_where(name, index, block)}: cannot be spilled from " \
               f"{_state(engine.core.group(name), block)!r}"
    if not engine.core.fire(name, [block], Event.RESTORE_BEGIN, masked=True)[0]:
        return f"{_where(name, index, block)}: spilled, restore refused (no room or admission)"
    state = engine.core.group(name)
    if not landed:
        slot = int(state.slot[Tier.DEVICE][block])
        half = state.decl.payload_bytes // 2
        state.pools[Tier.DEVICE].data[slot, half : state.decl.payload_bytes] = 0
    return (f"{_where(name, index, block)} spilled, restore in flight"
            + ("" if landed else " (half of the copy not landed)"))


def _reusable_length(engine: Engine, prompt: Prompt, step: int) -> int:
    """The longest prefix of ``prompt`` a lookup can reuse whose length is a multiple of
    ``step`` (and of the LCM block size)."""
    step = math.lcm(step, engine.model.lcm_block_size)
    return (max(prompt.n_tokens - 1, 0) // step) * step


def _bytes_of(group: GroupState, block: int) -> NDArray[np.uint8] | None:
    """The payload bytes of ``block`` from the first tier holding it, None if none does."""
    for tier in Tier:
        if tier in group.pools and int(group.slot[tier][block]) >= 0:
            slot = np.array([group.slot[tier][block]], dtype=np.intp)
            data: NDArray[np.uint8] = group.pools[tier].read(slot)[0]
            return data
    return None


def checkpoint_block(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike,
                     group: str | None = None) -> int:
    """Index of the recurrent snapshot block at the prompt's longest reusable checkpoint (the
    largest multiple of the checkpoint interval and the LCM block size below its last token);
    -1 when the prompt is too short to have one."""
    prompt = _prompt(engine, prompt)
    name = group or group_of_kind(engine, GroupKind.RECURRENT)
    decl = engine.core.group(name).decl
    length = _reusable_length(engine, prompt, decl.checkpoint_interval or decl.block_size)
    return length // decl.block_size - 1


def evict_snapshot(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                   index: int | None = None, group: str | None = None) -> str:
    """Evict the recurrent snapshot at the prompt's longest reusable checkpoint (``index``
    defaults to :func:`checkpoint_block`): resuming there is impossible, an earlier checkpoint
    is the best either engine can do."""
    name = group or group_of_kind(engine, GroupKind.RECURRENT)
    if index is None:
        index = checkpoint_block(engine, prompt, name)
    return _evict(engine, prompt, name, index, ": snapshot evicted")


def stale_snapshot(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                   index: int | None = None, group: str | None = None, back: int = 1) -> str:
    """Overwrite the device bytes of a resident recurrent snapshot (``index`` defaults to
    :func:`checkpoint_block`) with those of the snapshot ``back`` checkpoints earlier, or with
    zeros (the state before any token) when there is none: a snapshot of the wrong checkpoint,
    silently (state and recorded checksum unchanged)."""
    name = group or group_of_kind(engine, GroupKind.RECURRENT)
    if index is None:
        index = checkpoint_block(engine, prompt, name)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, no snapshot made stale"
    state = engine.core.group(name)
    slot = int(state.slot[Tier.DEVICE][block])
    if slot < 0:
        return f"{_where(name, index, block)}: not on the device ({_state(state, block)!r})"
    decl = state.decl
    per = (decl.checkpoint_interval or decl.block_size) // decl.block_size
    earlier = index - back * per
    source = block_id(engine, prompt, name, earlier) if earlier >= 0 else -1
    data = _bytes_of(state, source) if source >= 0 else None
    if data is None:
        data = np.zeros(decl.payload_bytes, dtype=np.uint8)
        what = "zeros (the state before any token)"
    else:
        after = (earlier + 1) * decl.block_size
        what = f"the bytes of block {earlier} (the snapshot after {after} tokens)"
    state.pools[Tier.DEVICE].data[slot, : decl.payload_bytes] = data
    return f"{_where(name, index, block)}: snapshot overwritten on the device with {what}"


def compressed_block(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike,
                     group: str | None = None) -> int:
    """Index of the last compressed block of the prompt's longest reusable prefix; -1 if
    none."""
    prompt = _prompt(engine, prompt)
    name = group or group_of_kind(engine, GroupKind.COMPRESSED)
    size = engine.core.group(name).decl.block_size
    return _reusable_length(engine, prompt, size) // size - 1


def evict_compressed_block(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                           index: int | None = None, group: str | None = None) -> str:
    """Evict a compressed block (``index`` defaults to :func:`compressed_block`): every prefix
    reaching past its start loses it."""
    name = group or group_of_kind(engine, GroupKind.COMPRESSED)
    if index is None:
        index = compressed_block(engine, prompt, name)
    return _evict(engine, prompt, name, index, ": compressed block evicted")


def compression_incomplete(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                           index: int | None = None, group: str | None = None) -> str:
    """Catch a resident compressed block (``index`` defaults to :func:`compressed_block`)
    mid-compression: it is dropped and written again raw with the same bytes, then
    ``compress_begin`` is fired and ``compress_done`` is not. Readable only raw until the
    compression completes."""
    prompt = _prompt(engine, prompt)
    name = group or group_of_kind(engine, GroupKind.COMPRESSED)
    if index is None:
        index = compressed_block(engine, prompt, name)
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, no compression restarted"
    core, state = engine.core, engine.core.group(name)
    before = _state(state, block)
    if before != "compressed":
        return f"{_where(name, index, block)}: not resident compressed ({before!r})"
    data = _bytes_of(state, block)
    if data is None or not core.fire(name, [block], Event.EVICT, masked=True)[0]:
        return f"{_where(name, index, block)}: cannot be evicted from {before!r}"
    high, low = prompt.words(state.decl.block_size)
    (fresh,) = core.allocate(name, [index], high[index : index + 1], low[index : index + 1])
    core.fire(name, [fresh], Event.WRITE_BEGIN)
    core.write(name, [fresh], data[None])
    core.fire(name, [fresh], Event.WRITE_DONE)
    core.fire(name, [fresh], Event.COMPRESS_BEGIN)
    return (f"{_where(name, index, int(fresh))}: written again raw and caught mid-compression "
            f"({_state(state, int(fresh))!r})")
