"""The prefix hash table (open addressing, vectorized probe rounds) against a plain dict.

Keys come from a small pool whose low words share their low bits, so most keys start probing at
the same few slots, chains wrap around the end of the table and keys differ only in their high
word; batches repeat keys, remove absent keys or name the wrong block, and churn enough for
tombstones to force rebuilds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvfsm.state._hashtable import EMPTY, TOMBSTONE, BlockHashTable

#: Every test runs with compiled kernels and with their NumPy twins.
pytestmark = pytest.mark.usefixtures("jit_backend")

WORD = (1 << 64) - 1
#: High words: keys equal in their low word differ only here.
HIGHS = (0, 1, 1 << 63, WORD)
#: Low words: the low 8 bits (a table of up to 256 slots probes from there) are one of three
#: values, 255 putting the home at the table's last slot so chains wrap.
LOWS = tuple((upper << 40) | bits for upper in (0, 1, 7) for bits in (0, 1, 255))
POOL = tuple((high, low) for high in HIGHS for low in LOWS)


def key_of(high: int, low: int) -> int:
    return (high << 64) | low


def words(keys: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([h for h, _ in keys], dtype=np.uint64),
            np.array([lo for _, lo in keys], dtype=np.uint64))


# A batch: (index into the example's key pool, block id) pairs; repeats are likely.
BATCH = st.lists(st.tuples(st.integers(0, len(POOL) - 1), st.integers(0, 7)), max_size=12)
#: What the stateful runs made happen, to show (and test) that they exercise every path.
SEEN: set[str] = set()


class TableMachine(RuleBasedStateMachine):
    """After every step the table equals a dict that saw the same operations one key at a time:
    same entries, same lookups (present and absent keys), same length and membership, and its
    slots agree with its counts with every entry reachable from its home slot."""

    @initialize(n_blocks=st.integers(1, 12), n_keys=st.integers(1, len(POOL)))
    def build(self, n_blocks: int, n_keys: int) -> None:
        self.table = BlockHashTable(n_blocks)
        self.model: dict[int, int] = {}
        # Few keys: churn piles up tombstones; many: the table outgrows its blocks.
        self.keys = POOL[:n_keys]

    def _keys(self, batch: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [self.keys[i % len(self.keys)] for i, _ in batch]

    @rule(batch=BATCH)
    def insert_first(self, batch: list[tuple[int, int]]) -> None:
        keys = self._keys(batch)
        absent = [k for k in keys if key_of(*k) not in self.model]
        if len(set(absent)) < len(absent):
            SEEN.add("equal absent keys in one batch")
        capacity, tombstones = self.table.capacity, self.table.n_tombstones
        self.table.insert_first(*words(keys), [b for _, b in batch])
        if self.table.capacity > capacity:
            SEEN.add("grown")
        elif self.table.n_tombstones < tombstones:
            SEEN.add("tombstone reused or cleared")
        for (high, low), (_, block) in zip(keys, batch, strict=True):
            self.model.setdefault(key_of(high, low), block)

    @rule(batch=BATCH, right=st.lists(st.booleans(), min_size=12, max_size=12))
    def remove_if(self, batch: list[tuple[int, int]], right: list[bool]) -> None:
        """Mostly the block the key maps to now (so entries go), else the drawn block."""
        keys = self._keys(batch)
        blocks = [self.model.get(key_of(*k), b) if ok else b
                  for k, (_, b), ok in zip(keys, batch, right, strict=False)]
        tombstones = self.table.n_tombstones
        self.table.remove_if(*words(keys), blocks)
        if self.table.n_tombstones < tombstones:
            SEEN.add("rebuilt after removals")
        for (high, low), block in zip(keys, blocks, strict=True):
            if self.model.get(key_of(high, low)) == block:
                del self.model[key_of(high, low)]

    @rule(picks=st.lists(st.integers(0, len(POOL) - 1), max_size=20))
    def lookup(self, picks: list[int]) -> None:
        keys = [POOL[i] for i in picks]  # any key of the whole pool: absent ones too
        found = self.table.lookup(*words(keys))
        assert found.dtype == np.intp
        assert found.tolist() == [self.model.get(key_of(*k), -1) for k in keys]

    @invariant()
    def equals_the_dict(self) -> None:
        table, model = self.table, self.model
        assert sorted(table.items()) == sorted(model.items())
        assert sorted(table.values()) == sorted(model.values())
        assert len(table) == len(model)
        assert table.lookup(*words(list(POOL))).tolist() == [
            model.get(key_of(*k), -1) for k in POOL]
        key = key_of(*self.keys[-1])
        assert table.get(key) == model.get(key) and (key in table) == (key in model)
        assert table.problems() == []
        assert table.n_tombstones <= table.capacity // 4


def test_table_agrees_with_a_dict() -> None:
    run_state_machine_as_test(TableMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None))


def test_runs_reach_every_path() -> None:
    """The stateful runs contend for slots with equal keys, reuse tombstones, rebuild and grow."""
    SEEN.clear()
    # Derandomized so the coverage claim is a fixed fact, not a coin toss.
    run_state_machine_as_test(TableMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None, database=None,
        derandomize=True))
    every = {"equal absent keys in one batch", "grown", "tombstone reused or cleared",
             "rebuilt after removals"}
    assert every == SEEN


def test_churn_reaches_rebuilds() -> None:
    """Removing what was inserted, over and over, leaves tombstones until a rebuild clears them;
    the contents stay those of the dict throughout."""
    table = BlockHashTable(4)
    keys = list(POOL[:4])
    for round_ in range(20):
        blocks = [round_ % 7] * len(keys)
        table.insert_first(*words(keys), blocks)
        assert table.lookup(*words(keys)).tolist() == blocks
        table.remove_if(*words(keys), blocks)
        assert len(table) == 0 and table.problems() == []
        assert table.n_tombstones <= table.capacity // 4
    assert table.capacity == 8  # never grew: at most 4 keys were live


@given(n_blocks=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_full_load_keeps_capacity_and_load_factor(n_blocks: int, seed: int) -> None:
    """With every block published under a distinct key the table is at most half full and was
    sized once: a power of two of at least twice the block count, never grown."""
    rng = np.random.default_rng(seed)
    table = BlockHashTable(n_blocks)
    capacity = table.capacity
    assert capacity & (capacity - 1) == 0 and capacity >= 2 * n_blocks
    high = rng.integers(0, 2**64, n_blocks, dtype=np.uint64, endpoint=False)
    # Few distinct homes: long chains, many keys per probe round contending for one slot.
    low = (rng.integers(0, 2**40, n_blocks, dtype=np.uint64) << np.uint64(8)) | rng.integers(
        0, 16, n_blocks, dtype=np.uint64)
    high[: n_blocks // 3] = 0  # some keys differ in their low word only
    keys = {key_of(h, lo) for h, lo in zip(high.tolist(), low.tolist(), strict=True)}
    blocks = np.arange(n_blocks)
    table.insert_first(high, low, blocks)
    assert len(table) == len(keys) and table.capacity == capacity
    assert 2 * len(table) <= table.capacity
    model: dict[int, int] = {}
    for h, lo, b in zip(high.tolist(), low.tolist(), blocks.tolist(), strict=True):
        model.setdefault(key_of(h, lo), b)
    assert dict(table.items()) == model
    assert table.problems() == []
    # Batch duplicates: the whole batch again, reversed, changes nothing (keys present).
    table.insert_first(high[::-1], low[::-1], blocks[::-1] + n_blocks)
    assert dict(table.items()) == model
    table.remove_if(high, low, blocks)
    assert len(table) == 0 and table.capacity == capacity and table.problems() == []


def test_first_occurrence_wins_within_a_batch() -> None:
    """Among equal keys of one batch the first one's block is kept, as dict.setdefault would,
    whichever of the writes to a contended slot the array assignment keeps."""
    table = BlockHashTable(8)
    high = np.zeros(6, dtype=np.uint64)
    low = np.array([5, 5, 21, 5, 21, 37], dtype=np.uint64)  # one home slot for all (mask 15)
    table.insert_first(high, low, [1, 2, 3, 4, 5, 6])
    assert table.lookup(high, low).tolist() == [1, 1, 3, 1, 3, 6]
    assert len(table) == 3 and table.problems() == []


def test_tombstone_is_not_reused_while_the_key_lies_further_along() -> None:
    """A key behind a tombstone on its chain is found, not inserted a second time."""
    table = BlockHashTable(8)
    high = np.zeros(3, dtype=np.uint64)
    low = np.array([3, 19, 35], dtype=np.uint64)  # home slot 3 for all three
    for i in range(3):  # one at a time, so they take slots 3, 4 and 5 in this order
        table.insert_first(high[i : i + 1], low[i : i + 1], [i])
    assert table.value[3:6].tolist() == [0, 1, 2]
    table.remove_if(high[:1], low[:1], [0])  # slot 3 becomes a tombstone before 19 and 35
    assert table.n_tombstones == 1
    table.insert_first(high[1:], low[1:], [7, 8])
    assert table.lookup(high, low).tolist() == [-1, 1, 2]
    assert len(table) == 2 and table.problems() == []
    table.insert_first(high[:1], low[:1], [9])  # the absent key may take the tombstone
    assert table.value[3] == 9 and table.n_tombstones == 0


def test_remove_needs_the_mapped_block() -> None:
    """A key goes only when removed with the block it maps to; repeating it in one batch
    removes it once."""
    table = BlockHashTable(4)
    high, low = np.array([1], dtype=np.uint64), np.array([2], dtype=np.uint64)
    table.insert_first(high, low, [3])
    table.remove_if(high, low, [4])
    assert table.get(key_of(1, 2)) == 3
    table.remove_if(np.array([1, 1], np.uint64), np.array([2, 2], np.uint64), [3, 3])
    assert table.get(key_of(1, 2)) is None and table.get(key_of(1, 2), -1) == -1
    assert len(table) == 0 and table.problems() == []


def test_slot_markers_and_bad_input() -> None:
    """Slots start empty, cost 20 bytes each, and malformed batches are refused, not stored."""
    table = BlockHashTable(2)
    assert (table.value == EMPTY).all() and EMPTY != TOMBSTONE
    assert table.nbytes == table.capacity * 20
    assert -1 not in table and (1 << 128) not in table
    with pytest.raises(ValueError, match="differ in length"):
        table.lookup([1, 2], [1])
    with pytest.raises(ValueError, match="blocks"):
        table.insert_first([1], [1], [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        table.insert_first([1], [1], [-1])
    with pytest.raises(ValueError, match="int32"):
        table.insert_first([1], [1], [1 << 31])
    assert table.get(-1, 7) == 7 and table.get(1 << 128) is None


def test_a_table_without_empty_slots_still_answers() -> None:
    """Every slot taken (a corrupt table: the real one keeps at least half empty): probes end
    after one lap instead of circling, finding the keys present and reporting the rest absent."""
    table = BlockHashTable(4)
    n = table.capacity
    table.key_high[:] = np.arange(n, dtype=np.uint64)
    table.key_low[:] = np.arange(n, dtype=np.uint64) * np.uint64(n)  # every home is slot 0
    table.value[:] = np.arange(n, dtype=np.int32)
    present = table.lookup(table.key_high, table.key_low)
    assert present.tolist() == list(range(n))
    assert table.lookup([n + 5], [3]).tolist() == [-1]
    assert any("no empty slot" in problem for problem in table.problems())
