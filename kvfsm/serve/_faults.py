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

Stored tiers (kinds whose lifecycle reaches disk: full, compressed, recurrent; remote: full).
Each first moves the block down to the tier as memory pressure would (device -> host -> disk
-> remote, making room below the same way ``Engine.spill_down`` does), so that its only copy is
the stored one, then acts on that copy behind the tier's back (the file, or the store's raw
client), as a crash, another process or the store itself would:

* :func:`flip_disk_byte`: one payload byte of the block's disk file flipped (bit rot).
* :func:`truncate_disk_file`: the file cut short in its payload (a torn write).
* :func:`delete_disk_file`: the file deleted (evicted by someone else); the tier's index and the
  core still say it is there.
* :func:`evict_remote_value`: the remote value deleted by the raw client (the store evicted it).
* :func:`plant_foreign_value`: under the block's remote key, the whole, self-consistent value
  of another prefix's block (the prompt's neighbouring block of the group).
* :func:`slow_remote`: the next load of the block's remote value answers ``seconds`` late (a slow
  store): longer than ``kvfsm`` mode waits, so the request recomputes from that block.

A hit-only reader of the stored bytes (``naive`` mode) reads the flipped byte, the zeros past a
cut and the other block's payload as this block's; it notices only a value that is gone (a read
error). kvfsm's loads verify header and checksum: the copy is ``CORRUPT``, ``FOREIGN`` or
``MISSING``, forgotten, and the block recomputed.

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
from kvfsm.serve._stores import delete_value, observed, read_value, value_name, write_value
from kvfsm.spec import Event, GroupKind, Tier
from kvfsm.state import GroupState, Prompt
from kvfsm.tiers import HEADER_BYTES, BlockKey, encode_header

#: How late a ``slow_remote`` load answers, seconds (the serving loop waits 0.5 s).
SLOW_REMOTE_S = 1.0


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


def _make_room(engine: Engine, name: str, tier: Tier, keep: int = -1) -> None:
    """Room for one more block of group ``name`` in ``tier``, as memory pressure makes it: the
    least recently used blocks there are spilled a tier down (``Engine.spill_down``); where no
    tier below takes them (a lifecycle that stops at host), they are evicted. Never ``keep``."""
    state = engine.core.group(name)
    if tier in state.pools:
        short = 1 - state.pools[tier].free
    elif tier in state.stored:
        short = 1 - (state.stored[tier] - state.stored_used(tier))
    else:
        return
    if short <= 0:
        return
    engine.spill_down(name, tier, short, keep=[keep] if keep >= 0 else [])
    if tier not in state.pools or state.pools[tier].free > 0:
        return
    table, states = state.table, state.states
    here = np.flatnonzero((table.residency[states] == int(tier)) & ~table.in_flight[states]
                          & ~table.readable[states] & (state.pins == 0))
    here = here[here != keep]
    oldest = here[np.argsort(state.last_use[here], kind="stable")][:1].astype(np.intp)
    engine.core.fire(name, oldest, Event.EVICT, masked=True)


def _spill(engine: Engine, name: str, block: int) -> bool:
    """Spill ``block`` to host if it is on the device (making host room first); True when it
    ends on host. A block further down (disk, remote) is left alone: its spill would be the
    next tier's, whose bytes only the engine's data path moves."""
    state = engine.core.group(name)
    if _state(state, block) == "host":
        return True
    if Tier.HOST not in state.pools or \
            int(state.table.residency[state.states[block]]) != int(Tier.DEVICE):
        return False
    _make_room(engine, name, Tier.HOST, keep=block)
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
    size = state.decl.itemsize
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


# -- stored tiers -----------------------------------------------------------------------------

def sink(engine: Engine, name: str, block: int, tier: Tier) -> bool:
    """Move ``block`` of group ``name`` down the tiers until its only copy is in ``tier`` (the
    state named like it: ``disk``, ``remote``), spilling one tier at a time and making room
    below first; a block restored from a stored copy it kept (``device_disk``) just gives its
    device slot back. True when it ends there."""
    core = engine.core
    state = core.group(name)
    for _ in range(4):
        here = _state(state, block)
        if here == tier.spec_name:
            return True
        if here in ("device_disk", "device_remote"):
            if not core.fire(name, [block], Event.EVICT, masked=True)[0]:
                return False
            continue
        residency = int(state.table.residency[state.states[block]])
        if residency < 0 or residency >= int(tier) or state.table.in_flight[state.states[block]]:
            return False
        below = Tier(residency + 1)
        if below not in state.pools and (below not in state.stored or below not in engine.tiers):
            return False
        if below in state.pools:
            if not _spill(engine, name, block):
                return False
            continue
        _make_room(engine, name, below, keep=block)
        if not engine.restorer.store(name, [block])[0]:
            return False
    return _state(state, block) == tier.spec_name


def _key(engine: Engine, name: str, block: int) -> BlockKey:
    return engine.restorer.keys.keys(name, np.array([block], dtype=np.intp))[0]


def _sunk(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, name: str, index: int,
          tier: Tier, what: str) -> tuple[int, BlockKey] | str:
    """``(block id, its key)`` once the prompt's block ``index`` of ``name`` is only in
    ``tier``; else the line saying why nothing was done (``what`` names the fault)."""
    block = block_id(engine, prompt, name, index)
    if block < 0:
        return f"{name} block {index}: not cached, no {what}"
    if tier not in engine.tiers:
        return f"{_where(name, index, block)}: no {tier.spec_name} tier, no {what}"
    before = _state(engine.core.group(name), block)
    if not sink(engine, name, block, tier):
        return (f"{_where(name, index, block)}: cannot be moved to {tier.spec_name} from "
                f"{before!r}, no {what}")
    return block, _key(engine, name, block)


def _moved(engine: Engine, name: str, index: int, block: int, tier: Tier) -> str:
    return f"{_where(name, index, block)} moved to {tier.spec_name}"


def flip_disk_byte(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                   index: int, group: str | None = None, byte: int = 7) -> str:
    """Move a block down to disk and flip payload byte ``byte`` of its file (byte 7: the sign
    and top exponent bits of its second float32 value; not byte 3, which
    :func:`corrupt_host_copy` flips, so two faults on one block never cancel), header
    untouched."""
    name = group or _default(engine)
    found = _sunk(engine, prompt, name, index, Tier.DISK, "byte flipped")
    if isinstance(found, str):
        return found
    block, key = found
    store = engine.tiers[Tier.DISK]
    data = read_value(store, key)
    if data is None or len(data) <= HEADER_BYTES + byte:
        return f"{_moved(engine, name, index, block, Tier.DISK)}, but its file is not there"
    damaged = bytearray(data)
    damaged[HEADER_BYTES + byte] ^= 0xFF
    write_value(store, key, bytes(damaged))
    return f"{_moved(engine, name, index, block, Tier.DISK)}, payload byte {byte} of its file " \
           "flipped"


def truncate_disk_file(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                       index: int, group: str | None = None, keep: float = 0.5) -> str:
    """Move a block down to disk and cut its file after ``keep`` of its payload (a torn write:
    the rest never reached the disk)."""
    name = group or _default(engine)
    found = _sunk(engine, prompt, name, index, Tier.DISK, "file cut")
    if isinstance(found, str):
        return found
    block, key = found
    store = engine.tiers[Tier.DISK]
    data = read_value(store, key)
    if data is None:
        return f"{_moved(engine, name, index, block, Tier.DISK)}, but its file is not there"
    size = HEADER_BYTES + int((len(data) - HEADER_BYTES) * keep)
    write_value(store, key, data[:size])
    return f"{_moved(engine, name, index, block, Tier.DISK)}, its file cut to {size} of " \
           f"{len(data)} bytes (a torn write)"


def delete_disk_file(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                     index: int, group: str | None = None) -> str:
    """Move a block down to disk and delete its file behind the tier's back."""
    return _delete_stored(engine, prompt, group, index, Tier.DISK, "file deleted",
                          "its file deleted (as if evicted)", "its file was not there")


def evict_remote_value(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                       index: int, group: str | None = None) -> str:
    """Move a block down to remote and delete its value there with the store's raw client (the
    store evicting it)."""
    return _delete_stored(engine, prompt, group, index, Tier.REMOTE, "value evicted",
                          "its value evicted from the store", "its value was not there")


def _delete_stored(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike,
                   group: str | None, index: int, tier: Tier, what: str, gone: str,
                   absent: str) -> str:
    """Move a block down to ``tier`` and delete its stored copy behind the tier's back."""
    name = group or _default(engine)
    found = _sunk(engine, prompt, name, index, tier, what)
    if isinstance(found, str):
        return found
    block, key = found
    deleted = delete_value(engine.tiers[tier], key)
    return f"{_moved(engine, name, index, block, tier)}, {gone if deleted else absent}"


def _payload_of(engine: Engine, name: str, block: int) -> NDArray[np.uint8] | None:
    """A block's payload from its pool slot, else its stored value (unchecked)."""
    state = engine.core.group(name)
    data = _bytes_of(state, block)
    if data is not None:
        return data
    for tier in (Tier.DISK, Tier.REMOTE):
        if tier in engine.tiers and tier in state.stored and state.holds(tier)[block]:
            value = read_value(engine.tiers[tier], _key(engine, name, block))
            if value is not None and len(value) > HEADER_BYTES:
                return np.frombuffer(value, np.uint8)[HEADER_BYTES:]
    return None


def plant_foreign_value(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                        index: int, group: str | None = None) -> str:
    """Move a block down to remote and put under its key the whole value (header naming its own
    key, payload, checksum) of another prefix's block: the prompt's block ``index - 1`` of the
    group (``index + 1`` for the first)."""
    import xxhash

    name = group or _default(engine)
    found = _sunk(engine, prompt, name, index, Tier.REMOTE, "foreign value planted")
    if isinstance(found, str):
        return found
    block, key = found
    for other_index in (index - 1, index + 1):
        other = block_id(engine, prompt, name, other_index) if other_index >= 0 else -1
        payload = None if other < 0 else _payload_of(engine, name, other)
        if payload is not None:
            break
    else:
        return f"{_moved(engine, name, index, block, Tier.REMOTE)}, but no other block of the " \
               "prompt to take a value from"
    data = bytes(payload)
    value = encode_header(_key(engine, name, other), len(data),
                          xxhash.xxh3_64_intdigest(data)) + data
    store = engine.tiers[Tier.REMOTE]
    write_value(store, key, value)
    return f"{_moved(engine, name, index, block, Tier.REMOTE)}, the value of block " \
           f"{other_index} (id {other}) planted under its key {value_name(store, key)[-24:]}"


def slow_remote(engine: Engine, prompt: Prompt | Sequence[int] | ArrayLike, *,
                index: int, group: str | None = None, seconds: float = SLOW_REMOTE_S) -> str:
    """Move a block down to remote and make the next load of its value answer ``seconds``
    late (the engine's remote tier must be an ``ObservedTier``, as the demo's are)."""
    name = group or _default(engine)
    found = _sunk(engine, prompt, name, index, Tier.REMOTE, "slow load")
    if isinstance(found, str):
        return found
    block, key = found
    store = observed(engine.tiers, Tier.REMOTE)
    if store is None:
        return f"{_moved(engine, name, index, block, Tier.REMOTE)}, but its tier cannot be " \
               "slowed down"
    store.slow_down([key], seconds)
    return f"{_moved(engine, name, index, block, Tier.REMOTE)}, its next load answers " \
           f"{seconds:g} s late"
