"""The prefix hash map as an open-addressing hash table of one 8-byte word per slot.

Keys are 128-bit chained prefix hashes; values are block ids. A key is always its block's own
hash: the table reads each block's two key words from per-block arrays its owner gives it at
construction (a group's ``hash_high`` / ``hash_low``, written before the block is published and
left alone while it is mapped), so a slot need not hold the key. A slot is one uint64: the top
32 bits of the key's high word (its *fingerprint*) above the block id (int32; -1 empty, -2
tombstone), 8 bytes per slot where three parallel arrays took 20.

A probe reads one slot per step and compares the fingerprint; only where it matches does it read
the block's key words to compare the whole key. A hit thus costs one random access into the
table plus the block's words, which for a prompt's blocks lie next to each other (allocated in
one batch), and a miss costs its chain's slots alone (a stray fingerprint match, 1 in 2**32 per
occupied slot met, costs one more read). At a million blocks per group the table is 16 MiB
instead of 40 and a lookup misses the cache once per key instead of three times.

Beside the slots the table keeps ``mapped``, one flag per block, set exactly while the block is
the value of a live entry. A key is mapped once and a block only under its own words, so "block
b is mapped and its words are key k" means "k maps to b": a lookup walking a prompt's blocks,
which are usually allocated in one batch, confirms each next block that way (its flag and words
lie next to the previous block's) and probes the table only where that fails.

The table has a power-of-two capacity of at least twice the block count; since every live entry
is a distinct block (its key is that block's words), it is at most half full and never grows.
Collisions are resolved by linear probing from ``low & mask`` (xxh3 words are uniformly random,
so the low bits spread keys evenly, and the fingerprint, taken from the other word, is
independent of the home slot).

Every batch operation is vectorized in probe rounds: one round is a few array operations over
the keys still pending, and the number of rounds is the longest probe chain met (small at a load
factor of one half); finding keys (every lookup) is the kernel ``probe_kernel``: one compiled
pass walking each key's chain (numba) when compiled kernels are enabled, else its NumPy twin,
the probe rounds. Removal leaves a tombstone; when tombstones exceed a quarter of the capacity
the table is rebuilt in place (its live entries re-inserted, vectorized). There is no Python
object per entry and no Python loop per key on any batch path.

A key never sits beyond an empty slot of its chain: insertion takes the first free slot from the
key's home, removal only turns slots into tombstones, and only a rebuild empties slots (after
which every entry is inserted again). Lookups may therefore stop at the first empty slot.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._jit import kernel

#: Block id of a slot that never held an entry since the last rebuild.
EMPTY: Final = -1
#: Block id of a slot whose entry was removed; probing continues past it.
TOMBSTONE: Final = -2
#: Slots a lookup examines per pending key after the first round (contiguous, cache-friendly).
WINDOW: Final = 8
#: Keys whose home slots the compiled probe reads before walking their chains: enough
#: independent loads to keep the CPU's outstanding cache misses busy, few enough for L1.
READ_AHEAD: Final = 256
#: Bits of a slot above its block id: the fingerprint (the key's high word's top bits).
_BLOCK_BITS: Final = 32
#: The fingerprint and block halves of a slot word.
SLOT_FINGERPRINT: Final = np.uint64(((1 << 64) - 1) ^ ((1 << _BLOCK_BITS) - 1))
SLOT_BLOCK: Final = np.uint64((1 << _BLOCK_BITS) - 1)
#: A slot word whose block half reads EMPTY / TOMBSTONE as int32.
EMPTY_SLOT: Final = np.uint64(EMPTY & ((1 << _BLOCK_BITS) - 1))
#: Index of the block half among a slot's two int32 halves in memory (for the ``value`` view).
_BLOCK_HALF: Final = 0 if sys.byteorder == "little" else 1
_WORD = (1 << 64) - 1
_KEY = (1 << 128) - 1
_WINDOW_OFFSETS = np.arange(WINDOW, dtype=np.intp)

U64Array = NDArray[np.uint64]
IdArray = NDArray[np.intp]


def _capacity_for(entries: int) -> int:
    """The smallest power of two holding ``entries`` at a load factor of at most one half."""
    return 1 << max(3, (2 * max(entries, 1) - 1).bit_length())


def slot_words(high: U64Array, blocks: NDArray[np.integer]) -> U64Array:
    """The slot word of each entry: its key's fingerprint (``high``'s top bits) and block id."""
    words: U64Array = (high & SLOT_FINGERPRINT) | blocks.astype(np.uint64)
    return words


def probe_example() -> tuple[object, ...]:
    keys = np.zeros(8, dtype=np.uint64)
    return (np.full(8, EMPTY_SLOT, dtype=np.uint64), keys, keys.copy(), keys[:1], keys[:1],
            np.empty(1, dtype=np.intp), True)


def probe_twin(slots: U64Array, block_high: U64Array, block_low: U64Array, high: U64Array,
                low: U64Array, out: IdArray, want_block: bool) -> None:
    """:func:`probe_kernel` as vectorized probe rounds: one round is a few array operations
    over the keys still pending."""
    capacity, n_blocks = slots.size, block_high.size
    # First round: the home slot alone, where most keys are (1-D, the cheapest form: one
    # gather of slots, one of each word array, compares over every key, no index lists).
    pos = (low & np.uint64(capacity - 1)).astype(np.intp)
    word = slots[pos]
    block = (word & SLOT_BLOCK).astype(np.intp)
    live = block < n_blocks  # EMPTY and TOMBSTONE read as 2**32 - 1 and 2**32 - 2
    at = np.where(live, block, 0)
    hit = (live & ((word & SLOT_FINGERPRINT) == (high & SLOT_FINGERPRINT))
           & (block_low[at] == low) & (block_high[at] == high))
    found: IdArray = np.where(hit, pos, -1)
    pending = np.flatnonzero(~hit & ((word & SLOT_BLOCK) != EMPTY_SLOT))
    pos, hi, lo = pos[pending] + 1, high[pending], low[pending]
    # Later rounds: WINDOW contiguous slots per key still pending. Flat positions of the
    # few set entries stand in for reductions along the short axis, which are slow.
    wrap = capacity - 1
    probed = 1  # slots of each chain examined; past the capacity a chain has no end
    while pending.size and probed < capacity:
        probed += WINDOW
        window = (pos[:, None] + _WINDOW_OFFSETS) & wrap
        words = slots[window]
        blocks = (words & SLOT_BLOCK).astype(np.intp)
        flat = np.flatnonzero((blocks < n_blocks)
                              & ((words & SLOT_FINGERPRINT) == (hi[:, None] & SLOT_FINGERPRINT)))
        rows, cols = flat // WINDOW, flat % WINDOW
        candidate = blocks[rows, cols]
        keep = (block_low[candidate] == lo[rows]) & (block_high[candidate] == hi[rows])
        rows, cols = rows[keep], cols[keep]
        # Keys are stored once, so at most one slot of a window holds a pending key.
        found[pending[rows]] = window[rows, cols]
        go = np.ones(pending.size, dtype=np.bool_)
        go[np.flatnonzero((words & SLOT_BLOCK) == EMPTY_SLOT) // WINDOW] = False
        go[rows] = False
        pending, pos, hi, lo = pending[go], pos[go] + WINDOW, hi[go], lo[go]
    if want_block:
        held = (slots[np.maximum(found, 0)] & SLOT_BLOCK).astype(np.intp)
        out[:] = np.where(found >= 0, held, -1)
    else:
        out[:] = found


def probe_keys(slots: U64Array, block_high: U64Array, block_low: U64Array, high: U64Array,
               low: U64Array, out: NDArray[np.int64], start: int, stop: int,
               home_words: U64Array, want_block: bool, until_found: bool) -> int:
    """The one probe of the table (:func:`probe_kernel` and the lookup's group pass call it,
    compiled into each): per key ``start`` to ``stop - 1`` (at most ``home_words.size``),
    linear probing from its home slot until its entry or an empty slot. ``out`` gets the slot
    (``want_block`` false) or the block id (true), -1 when absent; with ``until_found`` it
    stops after the first key found. Returns the index after the last key probed.

    A slot is the key's only if its fingerprint matches and its block's words
    (``block_high``, ``block_low``) equal the key; a block id beyond those words never
    matches. A chain never runs past the capacity, so a table left without empty slots
    (corrupt) still ends the probe. The keys' home slots are read first into ``home_words``:
    loads independent of each other, which the CPU overlaps (cache misses in a large table),
    where walking one chain at a time waits on every branch that depends on the slot just
    read. (One call per run of keys, not per key: a call per key costs the compiled walk
    three times its time.)"""
    mask = np.uint64(slots.size - 1)
    n_blocks = np.uint64(block_high.size)
    for i in range(start, stop):
        home_words[i - start] = slots[low[i] & mask]
    for i in range(start, stop):
        key_high, key_low = high[i], low[i]
        fingerprint = key_high & SLOT_FINGERPRINT
        pos = key_low & mask
        word = home_words[i - start]
        out[i] = -1
        for _ in range(slots.size):
            block = word & SLOT_BLOCK
            if block == EMPTY_SLOT:
                break
            if (block < n_blocks and (word & SLOT_FINGERPRINT) == fingerprint
                    and block_low[block] == key_low and block_high[block] == key_high):
                out[i] = block if want_block else pos
                break
            pos = (pos + np.uint64(1)) & mask
            word = slots[pos]
        if until_found and out[i] >= 0:
            return i + 1
    return stop


@kernel(example=probe_example, twin=probe_twin, calls=(probe_keys,))
def probe_kernel(slots: U64Array, block_high: U64Array, block_low: U64Array, high: U64Array,
                 low: U64Array, out: IdArray, want_block: bool) -> None:
    """Per key, :func:`probe_keys`: ``out`` gets the slot (``want_block`` false) or the
    block id (true), -1 when absent, :data:`READ_AHEAD` keys at a time. Compiled (the twin,
    :func:`probe_twin`, probes in vectorized rounds)."""
    home_words = np.empty(min(READ_AHEAD, high.size), dtype=np.uint64)
    for start in range(0, high.size, READ_AHEAD):
        probe_keys(slots, block_high, block_low, high, low, out, start,
                   min(start + READ_AHEAD, high.size), home_words, want_block, False)


def _words(high: ArrayLike, low: ArrayLike) -> tuple[U64Array, U64Array]:
    hi = np.asarray(high, dtype=np.uint64).ravel()
    lo = np.asarray(low, dtype=np.uint64).ravel()
    if hi.shape != lo.shape:
        raise ValueError(f"high and low words differ in length: {hi.size} != {lo.size}")
    return hi, lo


class BlockHashTable:
    """Block key -> block id, with ``dict.setdefault`` / guarded ``del`` semantics in batches.

    ``words``: the per-block key arrays ``(high, low)`` (uint64, ``n_blocks`` each) the table
    reads to confirm a key; its owner writes a block's words before the block is inserted and
    leaves them alone while the block is mapped. Without them the table allocates its own
    (``block_high``, ``block_low``, zero), for the caller to write the same way."""

    def __init__(self, n_blocks: int, words: tuple[U64Array, U64Array] | None = None) -> None:
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        if n_blocks >= 2**31:
            raise ValueError(f"block ids are int32 here; {n_blocks} blocks do not fit")
        self.n_blocks = n_blocks
        self._owns_words = words is None
        if words is None:
            words = (np.zeros(n_blocks, dtype=np.uint64), np.zeros(n_blocks, dtype=np.uint64))
        for name, array in zip(("high", "low"), words, strict=True):
            if array.dtype != np.uint64 or array.shape != (n_blocks,):
                raise ValueError(f"the {name} key words must be a uint64 array of {n_blocks} "
                                 f"blocks, got {array.dtype} {array.shape}")
        #: Each block's key words, read where a slot's fingerprint matches a key.
        self.block_high, self.block_low = words
        self.capacity = _capacity_for(n_blocks)
        self._mask = np.uint64(self.capacity - 1)
        #: One word per slot: fingerprint above block id (see the module docstring).
        self.slots = np.full(self.capacity, EMPTY_SLOT, dtype=np.uint64)
        #: The block id of each slot (int32, EMPTY / TOMBSTONE): a view of the slots' low halves.
        self.value: NDArray[np.int32] = self.slots.view(np.int32)[_BLOCK_HALF::2]
        self.n_live = 0
        self.n_tombstones = 0
        #: Per block: it is the block of a live entry (mapped under its own words). With the
        #: words, it answers "does key k map to block b" without reading the slots: a
        #: lookup whose next block is the one after the last it found confirms it so, in
        #: order (a prompt's blocks are allocated in a batch), instead of probing the table.
        self._mapped = np.zeros(n_blocks, dtype=np.bool_)
        self.mapped: NDArray[np.bool_] = self._mapped.view()
        self.mapped.flags.writeable = False

    @property
    def nbytes(self) -> int:
        """Bytes the table allocated: its slots, its mapped flags, and the key words where
        it owns them."""
        owned = self.block_high.nbytes + self.block_low.nbytes if self._owns_words else 0
        return self.slots.nbytes + self._mapped.nbytes + owned

    def _home(self, low: U64Array) -> IdArray:
        home: IdArray = (low & self._mask).astype(np.intp)
        return home

    # -- batch operations ------------------------------------------------------------------

    def _find(self, high: U64Array, low: U64Array) -> IdArray:
        """The slot holding each key, or -1."""
        slots = np.empty(high.size, dtype=np.intp)
        probe_kernel(self.slots, self.block_high, self.block_low, high, low, slots, False)
        return slots

    def lookup(self, high: ArrayLike, low: ArrayLike) -> IdArray:
        """The block id of each key ``(high, low)``, or -1 where the key is absent."""
        hi, lo = _words(high, low)
        found = np.empty(hi.size, dtype=np.intp)
        probe_kernel(self.slots, self.block_high, self.block_low, hi, lo, found, True)
        return found

    def lookup_into(self, high: U64Array, low: U64Array, out: IdArray) -> None:
        """:meth:`lookup` into ``out`` for callers whose keys are already uint64 arrays of
        ``out``'s length (a lookup's hot path: no conversion, no allocation)."""
        probe_kernel(self.slots, self.block_high, self.block_low, high, low, out, True)

    def insert_first(self, high: ArrayLike, low: ArrayLike, blocks: ArrayLike) -> None:
        """Map each key to its block unless the key is mapped already (``dict.setdefault``);
        among equal keys in one batch the first occurrence wins. Each key must be its block's
        words (a ValueError otherwise, the table unchanged)."""
        hi, lo = _words(high, low)
        given = np.asarray(blocks, dtype=np.intp).ravel()
        if given.shape != hi.shape:
            raise ValueError(f"{hi.size} keys but {given.size} blocks")
        if given.size and (given.min() < 0 or given.max() >= self.n_blocks):
            raise ValueError(f"block ids must lie in [0, {self.n_blocks})")
        other = np.flatnonzero((self.block_high[given] != hi) | (self.block_low[given] != lo))
        if other.size:
            raise ValueError(f"keys differ from their blocks' words (blocks "
                             f"{given[other][:8].tolist()}): a block's key is its own hash")
        ids = given.astype(np.int32)
        if self.n_tombstones and hi.size:
            # A free slot on a key's chain may be a tombstone with the key further along it:
            # drop the keys present first, so the rest may take the first free slot they meet.
            absent = self._find(hi, lo) < 0
            hi, lo, ids = hi[absent], lo[absent], ids[absent]
            if (self.n_live + self.n_tombstones + hi.size
                    > self.capacity - self.capacity // 4):
                # Keep empty slots to end the probes of absent keys: drop the tombstones.
                self._rebuild()
        if hi.size:
            self._place(hi, lo, ids)

    def _place(self, hi: U64Array, lo: U64Array, ids: NDArray[np.int32]) -> None:
        """Insert keys that are absent, or found on their chain before any free slot. A free
        slot is always left: every live entry is a distinct block, at most half the slots."""
        # Pending keys stay in batch order; equal keys share a chain, so they move in step.
        pos = self._home(lo)
        wrap = self.capacity - 1
        while hi.size:
            held = self.value[pos]
            done = np.zeros(hi.size, dtype=np.bool_)
            occupied = np.flatnonzero(held >= 0)
            if occupied.size:
                at = held[occupied]
                done[occupied] = ((self.block_low[at] == lo[occupied])
                                  & (self.block_high[at] == hi[occupied]))
            free = np.flatnonzero(held < 0)
            if free.size:
                done[free] = self._claim(pos, hi, lo, ids, free, held)
            if done.all():
                return
            keep = ~done
            pos = (pos[keep] + 1) & wrap
            hi, lo, ids = hi[keep], lo[keep], ids[keep]

    def _claim(self, pos: IdArray, hi: U64Array, lo: U64Array, ids: NDArray[np.int32],
               free: IdArray, held: NDArray[np.int32]) -> NDArray[np.bool_]:
        """Pending keys ``free`` stand on free slots: one per slot takes it (the first in batch
        order among equal keys); returns, per key of ``free``, whether it is now mapped."""
        slots = pos[free]
        # Scratch claims in the block halves: each contender writes its pending index and one
        # write per slot survives, whichever it is; the survivor is that slot's winner.
        marker = free.astype(np.int32)
        self.value[slots] = marker
        winner = self.value[slots].astype(np.intp)
        twin = (winner != free) & (hi[winner] == hi[free]) & (lo[winner] == lo[free])
        if twin.any():
            # Equal keys met at one slot: the earliest in the batch must win.
            np.minimum.at(self.value, slots[twin], marker[twin])
            winner = self.value[slots].astype(np.intp)
        won = winner == free
        taken, winners = slots[won], free[won]
        self.slots[taken] = slot_words(hi[winners], ids[winners])
        self._mapped[ids[winners]] = True
        self.n_live += int(taken.size)
        self.n_tombstones -= int(np.count_nonzero(held[winners] == TOMBSTONE))
        # A loser whose key equals its slot's winner's is a duplicate in the batch: mapped.
        mapped: NDArray[np.bool_] = won | ((hi[winner] == hi[free]) & (lo[winner] == lo[free]))
        return mapped

    def remove_if(self, high: ArrayLike, low: ArrayLike, blocks: ArrayLike) -> None:
        """Remove each key where it maps to the given block (``if m.get(k) == b: del m[k]``)."""
        hi, lo = _words(high, low)
        ids = np.asarray(blocks, dtype=np.intp).ravel()
        if ids.shape != hi.shape:
            raise ValueError(f"{hi.size} keys but {ids.size} blocks")
        slots = self._find(hi, lo)
        hit = slots >= 0
        slots = slots[hit]
        slots = slots[self.value[slots] == ids[hit]]
        if not slots.size:
            return
        self._mapped[self.value[slots]] = False
        # A key may repeat in the batch: count the slots that change, not the keys.
        if slots.size * 16 >= self.capacity:
            self.value[slots] = TOMBSTONE
            removed = self.n_live - int(np.count_nonzero(self.value >= 0))
        else:
            marker = -3 - np.arange(slots.size, dtype=np.int32)
            self.value[slots] = marker
            removed = int(np.count_nonzero(self.value[slots] == marker))
            self.value[slots] = TOMBSTONE
        self.n_live -= removed
        self.n_tombstones += removed
        if self.n_tombstones > self.capacity // 4:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop every tombstone by inserting the live entries again."""
        live = np.flatnonzero(self.value >= 0)
        ids = self.value[live].copy()
        self.slots.fill(EMPTY_SLOT)
        self.n_live = self.n_tombstones = 0
        if live.size:
            self._place(self.block_high[ids], self.block_low[ids], ids)

    # -- dict-like helpers (not on hot paths) ----------------------------------------------

    def entries(self) -> tuple[U64Array, U64Array, IdArray]:
        """``(high, low, block)`` arrays of every live entry, in slot order."""
        blocks = self.value[self.value >= 0].astype(np.intp)
        blocks = blocks[blocks < self.n_blocks]  # a corrupt id has no words (problems says)
        return self.block_high[blocks], self.block_low[blocks], blocks

    def get(self, key: int, default: int | None = None) -> int | None:
        """The block of a 128-bit key ``(high << 64) | low``, or ``default``."""
        if not 0 <= key <= _KEY:
            return default
        block = int(self.lookup([key >> 64], [key & _WORD])[0])
        return block if block >= 0 else default

    def items(self) -> list[tuple[int, int]]:
        high, low, blocks = self.entries()
        return [((h << 64) | lo, b) for h, lo, b in
                zip(high.tolist(), low.tolist(), blocks.tolist(), strict=True)]

    def values(self) -> list[int]:
        values: list[int] = self.entries()[2].tolist()
        return values

    def __len__(self) -> int:
        return self.n_live

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.get(key) is not None

    def __iter__(self) -> Iterator[int]:
        return iter([key for key, _ in self.items()])

    def problems(self) -> list[str]:
        """Structural faults: counts that disagree with the slots, block ids beyond the words
        or mapped twice, fingerprints not their block's, or entries lookup misses."""
        out: list[str] = []
        value = self.value
        live, tombs = int((value >= 0).sum()), int((value == TOMBSTONE).sum())
        if (live, tombs) != (self.n_live, self.n_tombstones):
            out.append(f"counts say {self.n_live} live and {self.n_tombstones} tombstones, "
                       f"slots hold {live} and {tombs}")
        if not (value >= TOMBSTONE).all():
            out.append("a slot holds a value below the tombstone marker")
        if (value == EMPTY).sum() == 0:
            out.append("no empty slot is left, so a probe for an absent key never ends")
        beyond = value[value >= self.n_blocks]
        if beyond.size:
            out.append(f"slots name blocks {beyond[:8].tolist()} beyond the {self.n_blocks} "
                       "blocks with key words")
        high, low, blocks = self.entries()
        counts = np.bincount(blocks, minlength=self.n_blocks)
        if (counts > 1).any():
            out.append(f"blocks {np.flatnonzero(counts > 1)[:8].tolist()} are mapped twice")
        held = self.slots[(value >= 0) & (value < self.n_blocks)]
        stale = blocks[(held & SLOT_FINGERPRINT) != (high & SLOT_FINGERPRINT)]
        if stale.size:
            out.append(f"slots of blocks {stale[:8].tolist()} hold another key's fingerprint "
                       "(a block's words changed while it was mapped?)")
        flagged = np.zeros(self.n_blocks, dtype=np.bool_)
        flagged[blocks] = True
        wrong = np.flatnonzero(flagged != self._mapped)
        if wrong.size:
            out.append(f"blocks {wrong[:8].tolist()} are flagged mapped where they are not "
                       "the block of a live entry, or the reverse")
        missed = np.flatnonzero(self.lookup(high, low) != blocks)
        if missed.size:
            out.append(f"{missed.size} entries are not found by lookup (blocks "
                       f"{blocks[missed][:8].tolist()}); a key is stored twice or past an "
                       "empty slot of its chain")
        return out
