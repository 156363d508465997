"""The prefix hash map as an open-addressing hash table of plain NumPy arrays.

Keys are 128-bit chained prefix hashes stored as two uint64 words; values are block ids. The
table has a power-of-two capacity of at least twice the group's block count, so even with every
block published it is at most half full. Collisions are resolved by linear probing from
``low & mask`` (xxh3 words are uniformly random, so the low bits spread keys evenly).

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

from collections.abc import Iterator

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._jit import kernel

#: ``value`` of a slot that never held an entry since the last rebuild.
EMPTY = -1
#: ``value`` of a slot whose entry was removed; probing continues past it.
TOMBSTONE = -2
#: Slots a lookup examines per pending key after the first round (contiguous, cache-friendly).
WINDOW = 8
_WORD = (1 << 64) - 1
_KEY = (1 << 128) - 1
_WINDOW_OFFSETS = np.arange(WINDOW, dtype=np.intp)

U64Array = NDArray[np.uint64]
IdArray = NDArray[np.intp]


def _capacity_for(entries: int) -> int:
    """The smallest power of two holding ``entries`` at a load factor of at most one half."""
    return 1 << max(3, (2 * max(entries, 1) - 1).bit_length())


def _probe_example() -> tuple[object, ...]:
    keys, value = np.zeros(8, dtype=np.uint64), np.full(8, EMPTY, dtype=np.int32)
    return keys, keys, value, keys[:1], keys[:1], np.empty(1, dtype=np.intp), True


def _probe_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A valid table (no key twice, none past an empty slot of its chain: keys inserted at the
    first empty slot, some then removed to tombstones; now and then no empty slot at all) and
    keys to find: stored ones, and others sharing home slots and words with them."""
    capacity = 1 << int(rng.integers(3, 7))
    full = rng.random() < 0.1
    n_keys = capacity if full else int(rng.integers(0, capacity // 2 + 1))
    key_high = np.zeros(capacity, dtype=np.uint64)
    key_low = np.zeros(capacity, dtype=np.uint64)
    value = np.full(capacity, EMPTY, dtype=np.int32)
    # Few distinct high words and low words in a few multiples of the capacity: long chains,
    # and keys equal in one word only.
    high_words = rng.integers(0, 3, 2 * capacity).astype(np.uint64)
    low_words = rng.integers(0, 4 * capacity, 2 * capacity).astype(np.uint64)
    stored: set[tuple[int, int]] = set()
    for hi, lo in zip(high_words.tolist(), low_words.tolist(), strict=True):
        if len(stored) == n_keys:
            break
        if (hi, lo) in stored:
            continue
        stored.add((hi, lo))
        pos = lo & (capacity - 1)
        while value[pos] != EMPTY:
            pos = (pos + 1) & (capacity - 1)
        key_high[pos], key_low[pos] = hi, lo
        value[pos] = rng.integers(0, 8)  # block 0 often: a twin must not take it for a marker
    value[(value >= 0) & (rng.random(capacity) < 0.3)] = TOMBSTONE
    # Keys to find: stored ones (removed ones included), and others sharing a word with them.
    n = int(rng.integers(0, 2 * capacity))
    high = rng.choice(high_words, n).astype(np.uint64)
    low = rng.choice(low_words, n).astype(np.uint64)
    chosen = rng.random(n) < 0.5
    if stored:
        pairs = np.array(sorted(stored), dtype=np.uint64)[rng.integers(0, len(stored), n)]
        high[chosen], low[chosen] = pairs[chosen, 0], pairs[chosen, 1]
    return (key_high, key_low, value, high, low, np.full(n, -7, dtype=np.intp),
            bool(rng.integers(0, 2)))


def _probe_twin(key_high: U64Array, key_low: U64Array, value: NDArray[np.int32],
                high: U64Array, low: U64Array, out: IdArray, want_block: bool) -> None:
    """:func:`probe_kernel` as vectorized probe rounds: one round is a few array operations
    over the keys still pending."""
    capacity = value.size
    # First round: the home slot alone, where most keys are (1-D, the cheapest form: three
    # gathers and compares over every key, no index lists).
    pos = (low & np.uint64(capacity - 1)).astype(np.intp)
    values = value[pos]
    hit = (values >= 0) & (key_low[pos] == low) & (key_high[pos] == high)
    found: IdArray = np.where(hit, pos, -1)
    pending = np.flatnonzero(~hit & (values != EMPTY))
    pos, hi, lo = pos[pending] + 1, high[pending], low[pending]
    # Later rounds: WINDOW contiguous slots per key still pending. Flat positions of the
    # few set entries stand in for reductions along the short axis, which are slow.
    wrap = capacity - 1
    probed = 1  # slots of each chain examined; past the capacity a chain has no end
    while pending.size and probed < capacity:
        probed += WINDOW
        slots = (pos[:, None] + _WINDOW_OFFSETS) & wrap
        values = value[slots]
        flat = np.flatnonzero((values >= 0) & (key_low[slots] == lo[:, None]))
        rows, cols = flat // WINDOW, flat % WINDOW
        keep = key_high[slots[rows, cols]] == hi[rows]
        rows, cols = rows[keep], cols[keep]
        found[pending[rows]] = slots[rows, cols]
        go = np.ones(pending.size, dtype=np.bool_)
        go[np.flatnonzero(values == EMPTY) // WINDOW] = False
        go[rows] = False
        pending, pos, hi, lo = pending[go], pos[go] + WINDOW, hi[go], lo[go]
    out[:] = np.where(found >= 0, value[np.maximum(found, 0)], -1) if want_block else found


@kernel(example=_probe_example, twin=_probe_twin, inputs=_probe_inputs)
def probe_kernel(key_high: U64Array, key_low: U64Array, value: NDArray[np.int32],
                 high: U64Array, low: U64Array, out: IdArray, want_block: bool) -> None:
    """Per key, linear probing from its home until its entry or an empty slot: ``out`` gets
    the slot (``want_block`` false) or the block id (true), -1 when absent. One pass, compiled
    (the twin, :func:`_probe_twin`, probes in vectorized rounds). A chain never runs past the
    capacity, so a table left without empty slots (corrupt) still ends the probe."""
    mask = np.uint64(value.size - 1)
    wrap = value.size - 1
    for i in range(high.size):
        hi, lo = high[i], low[i]
        pos = np.intp(lo & mask)
        out[i] = -1
        for _ in range(value.size):
            held = value[pos]
            if held == EMPTY:
                break
            if held >= 0 and key_low[pos] == lo and key_high[pos] == hi:
                out[i] = held if want_block else pos
                break
            pos = (pos + 1) & wrap


def _words(high: ArrayLike, low: ArrayLike) -> tuple[U64Array, U64Array]:
    hi = np.asarray(high, dtype=np.uint64).ravel()
    lo = np.asarray(low, dtype=np.uint64).ravel()
    if hi.shape != lo.shape:
        raise ValueError(f"high and low words differ in length: {hi.size} != {lo.size}")
    return hi, lo


class BlockHashTable:
    """128-bit key -> block id, with ``dict.setdefault`` / guarded ``del`` semantics in batches."""

    def __init__(self, n_blocks: int) -> None:
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        self.n_blocks = n_blocks
        self._allocate(_capacity_for(n_blocks))

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._mask = np.uint64(capacity - 1)
        self.key_high = np.zeros(capacity, dtype=np.uint64)
        self.key_low = np.zeros(capacity, dtype=np.uint64)
        #: Block id per slot, or EMPTY / TOMBSTONE.
        self.value = np.full(capacity, EMPTY, dtype=np.int32)
        self.n_live = 0
        self.n_tombstones = 0

    @property
    def nbytes(self) -> int:
        return self.key_high.nbytes + self.key_low.nbytes + self.value.nbytes

    def _home(self, low: U64Array) -> IdArray:
        home: IdArray = (low & self._mask).astype(np.intp)
        return home

    # -- batch operations ------------------------------------------------------------------

    def _find(self, high: U64Array, low: U64Array) -> IdArray:
        """The slot holding each key, or -1."""
        slots = np.empty(high.size, dtype=np.intp)
        probe_kernel(self.key_high, self.key_low, self.value, high, low, slots, False)
        return slots

    def lookup(self, high: ArrayLike, low: ArrayLike) -> IdArray:
        """The block id of each key ``(high, low)``, or -1 where the key is absent."""
        hi, lo = _words(high, low)
        found = np.empty(hi.size, dtype=np.intp)
        probe_kernel(self.key_high, self.key_low, self.value, hi, lo, found, True)
        return found

    def insert_first(self, high: ArrayLike, low: ArrayLike, blocks: ArrayLike) -> None:
        """Map each key to its block unless the key is mapped already (``dict.setdefault``);
        among equal keys in one batch the first occurrence wins."""
        hi, lo = _words(high, low)
        given = np.asarray(blocks, dtype=np.intp).ravel()
        if given.shape != hi.shape:
            raise ValueError(f"{hi.size} keys but {given.size} blocks")
        if given.size and (given.min() < 0 or given.max() > np.iinfo(np.int32).max):
            raise ValueError("block ids must be >= 0 and fit in int32")
        ids = given.astype(np.int32)
        crowded = self.n_live + hi.size > self.capacity // 2
        if (self.n_tombstones or crowded) and hi.size:
            # A free slot on a key's chain may be a tombstone with the key further along it:
            # drop the keys present first, so the rest may take the first free slot they meet
            # (and so keys already present do not count as new entries).
            absent = self._find(hi, lo) < 0
            hi, lo, ids = hi[absent], lo[absent], ids[absent]
        if hi.size:
            new = hi.size
            if crowded and self.n_live + new > self.capacity // 2:
                # Close to full: count equal keys of the batch once before growing for them.
                order = np.lexsort((lo, hi))
                new = 1 + int(np.count_nonzero((np.diff(hi[order]) != 0)
                                               | (np.diff(lo[order]) != 0)))
            self._reserve(new)
            self._place(hi, lo, ids)

    def _place(self, hi: U64Array, lo: U64Array, ids: NDArray[np.int32]) -> None:
        """Insert keys that are absent, or found on their chain before any free slot."""
        # Pending keys stay in batch order; equal keys share a chain, so they move in step.
        pos = self._home(lo)
        wrap = self.capacity - 1
        while hi.size:
            values = self.value[pos]
            done = np.zeros(hi.size, dtype=np.bool_)
            occupied = np.flatnonzero(values >= 0)
            if occupied.size:
                at = pos[occupied]
                done[occupied] = ((self.key_low[at] == lo[occupied])
                                  & (self.key_high[at] == hi[occupied]))
            free = np.flatnonzero(values < 0)
            if free.size:
                done[free] = self._claim(pos, hi, lo, ids, free, values)
            if done.all():
                return
            keep = ~done
            pos = (pos[keep] + 1) & wrap
            hi, lo, ids = hi[keep], lo[keep], ids[keep]

    def _claim(self, pos: IdArray, hi: U64Array, lo: U64Array, ids: NDArray[np.int32],
               free: IdArray, values: NDArray[np.int32]) -> NDArray[np.bool_]:
        """Pending keys ``free`` stand on free slots: one per slot takes it (the first in batch
        order among equal keys); returns, per key of ``free``, whether it is now mapped."""
        slots = pos[free]
        marker = free.astype(np.int32)
        # Scratch claims in the value array: one write per slot survives, whichever it is.
        self.value[slots] = marker
        won: NDArray[np.bool_] = self.value[slots] == marker
        taken, winners = slots[won], free[won]
        self.key_high[taken], self.key_low[taken] = hi[winners], lo[winners]
        losers = np.flatnonzero(~won)
        if not losers.size:
            self._settle(taken, ids[winners], values[winners])
            return won
        # A loser whose key equals its slot's new key is a duplicate in the batch: mapped.
        at = slots[losers]
        twin = ((self.key_low[at] == lo[free[losers]])
                & (self.key_high[at] == hi[free[losers]]))
        if twin.any():
            # Equal keys met at one slot (with the same key words): the earliest must win.
            np.minimum.at(self.value, at[twin], marker[losers[twin]])
            won = self.value[slots] == marker
            taken, winners = slots[won], free[won]
            losers = np.flatnonzero(~won)
            at = slots[losers]  # the key words there are unchanged: twins share them
            twin = ((self.key_low[at] == lo[free[losers]])
                    & (self.key_high[at] == hi[free[losers]]))
        self._settle(taken, ids[winners], values[winners])
        won[losers[twin]] = True  # now: mapped
        return won

    def _settle(self, taken: IdArray, blocks: NDArray[np.int32],
                before: NDArray[np.int32]) -> None:
        """Claimed slots (keys written) get their blocks; the counts follow."""
        self.value[taken] = blocks
        self.n_live += int(taken.size)
        self.n_tombstones -= int(np.count_nonzero(before == TOMBSTONE))

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
            self._rebuild(self.capacity)

    def _reserve(self, incoming: int) -> None:
        """Keep a free slot on every chain: at most half live, three quarters in use."""
        if self.n_live + incoming > self.capacity // 2:
            self._rebuild(_capacity_for(self.n_live + incoming))
        elif self.n_live + self.n_tombstones + incoming > self.capacity - self.capacity // 4:
            self._rebuild(self.capacity)

    def _rebuild(self, capacity: int) -> None:
        """Drop every tombstone by inserting the live entries again (a new capacity may grow)."""
        live = np.flatnonzero(self.value >= 0)
        hi, lo, ids = self.key_high[live], self.key_low[live], self.value[live]
        if capacity == self.capacity:
            self.value.fill(EMPTY)
            self.n_live = self.n_tombstones = 0
        else:
            self._allocate(capacity)
        if live.size:
            self._place(hi, lo, ids)

    # -- dict-like helpers (not on hot paths) ----------------------------------------------

    def entries(self) -> tuple[U64Array, U64Array, IdArray]:
        """``(high, low, block)`` arrays of every live entry, in slot order."""
        live = np.flatnonzero(self.value >= 0)
        return self.key_high[live], self.key_low[live], self.value[live].astype(np.intp)

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
        """Structural faults: counts that disagree with the slots, or entries lookup misses."""
        out: list[str] = []
        live, tombs = int((self.value >= 0).sum()), int((self.value == TOMBSTONE).sum())
        if (live, tombs) != (self.n_live, self.n_tombstones):
            out.append(f"counts say {self.n_live} live and {self.n_tombstones} tombstones, "
                       f"slots hold {live} and {tombs}")
        if not (self.value >= TOMBSTONE).all():
            out.append("a slot holds a value below the tombstone marker")
        if (self.value == EMPTY).sum() == 0:
            out.append("no empty slot is left, so a probe for an absent key never ends")
        high, low, blocks = self.entries()
        missed = np.flatnonzero(self.lookup(high, low) != blocks)
        if missed.size:
            out.append(f"{missed.size} entries are not found by lookup (blocks "
                       f"{blocks[missed][:8].tolist()}); a key is stored twice or past an "
                       "empty slot of its chain")
        return out
