"""The StateCore API called directly: allocation, refused calls, bytes across tiers, LRU eviction,
index pins, write layouts, configuration and the invariant report."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import GuardRejected, KvfsmError
from kvfsm.spec import Event, Form, Layout, Tier
from kvfsm.state import (
    MAX_PINS,
    NO_TARGET,
    CoreConfig,
    InvariantViolation,
    StateCore,
    StateError,
    join_words,
)
from tests.lookup_models import DEEPSEEK, DENSE, GPT_OSS

Snapshot = dict[str, dict[str, Any]]


def _core(model: Any = DENSE, device: int = 8, host: int = 4, **config: Any) -> StateCore:
    return StateCore(model, CoreConfig(device_blocks=device, host_blocks=host, backend="numpy",
                                       **config))


def _allocate(core: StateCore, group: str, count: int, first_key: int) -> np.ndarray:
    """``count`` blocks at positions 0.. with distinct keys from ``first_key`` on."""
    keys = np.arange(first_key, first_key + count, dtype=np.uint64)
    return core.allocate(group, np.arange(count), keys, keys * np.uint64(7919))


def _payload(core: StateCore, group: str, count: int, seed: int = 0) -> np.ndarray:
    size = core.group(group).decl.payload_bytes
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def _complete(core: StateCore, group: str, ids: Any, payload: np.ndarray | None = None) -> None:
    ids = np.asarray(ids)
    core.fire(group, ids, Event.WRITE_BEGIN)
    core.write(group, ids, _payload(core, group, ids.size) if payload is None else payload)
    core.fire(group, ids, Event.WRITE_DONE)


def _state(core: StateCore, group: str, block: int) -> str:
    return core.group(group).machine.state_of(int(block))


def _snapshot(core: StateCore) -> Snapshot:
    """Copies of every documented metadata array, the pools' bytes and counts, and the map."""
    out: Snapshot = {}
    for name, g in core.groups.items():
        arrays: dict[str, Any] = {
            "states": g.states.copy(), "pins": g.pins.copy(), "epoch": g.epoch.copy(),
            "position": g.position.copy(), "last_use": g.last_use.copy(),
            "sub_blocks": g.sub_blocks.copy(), "layout_id": g.layout_id.copy(),
            "hash_high": g.hash_high.copy(), "hash_low": g.hash_low.copy(),
            "refs_target": g.refs_target.copy(), "refs_epoch": g.refs_epoch.copy(),
            "free_ids": np.sort(g.free_ids[: g.free_top]),
            "hash_map": np.array(sorted(g.hash_map.items()), dtype=object),
        }
        for tier, slots in g.slot.items():
            arrays[f"slot[{tier.spec_name}]"] = slots.copy()
        for tier, pool in g.pools.items():
            arrays[f"free[{tier.spec_name}]"] = np.array(pool.free)
            arrays[f"bytes[{tier.spec_name}]"] = np.asarray(pool.data).copy()
        out[name] = arrays
    return out


def _assert_unchanged(before: Snapshot, after: Snapshot) -> None:
    changed = [f"{group}.{key}" for group, arrays in before.items()
               for key, value in arrays.items() if not np.array_equal(value, after[group][key])]
    assert not changed, changed


# -- allocate -----------------------------------------------------------------------------------


def test_allocate_records_position_and_hash_and_publishes_only_when_complete() -> None:
    core = _core()
    high = np.array([11, 12, 13], dtype=np.uint64)
    low = np.array([21, 22, 23], dtype=np.uint64)
    ids = core.allocate("attn", [5, 7, 9], high, low)
    group = core.group("attn")
    assert len(set(ids.tolist())) == 3
    assert group.position[ids].tolist() == [5, 7, 9]
    keys = [join_words(h, lo) for h, lo in zip(high.tolist(), low.tolist(), strict=True)]
    assert [core.hash_key("attn", int(b)) for b in ids] == keys
    assert [_state(core, "attn", b) for b in ids] == ["allocated"] * 3
    assert (core.lookup_hash("attn", keys) == -1).all()  # no identity before write_done
    _complete(core, "attn", ids)
    assert core.lookup_hash("attn", keys).tolist() == ids.tolist()
    assert core.lookup_words("attn", high, low).tolist() == ids.tolist()
    assert core.check_invariants() == []


@pytest.mark.parametrize(
    ("device", "host", "first", "asked", "error"),
    [
        pytest.param(4, 2, 3, 4, StateError, id="more-than-free-logical-ids"),
        pytest.param(4, 4, 3, 2, GuardRejected, id="more-than-free-device-slots"),
    ],
)
def test_allocate_is_all_or_nothing(device: int, host: int, first: int, asked: int,
                                    error: type[KvfsmError]) -> None:
    core = _core(device=device, host=host)
    _complete(core, "attn", _allocate(core, "attn", first, first_key=1))
    before = _snapshot(core)
    keys = np.arange(100, 100 + asked, dtype=np.uint64)
    with pytest.raises(error):
        core.allocate("attn", np.arange(asked), keys, keys)
    _assert_unchanged(before, _snapshot(core))
    assert (core.lookup_words("attn", keys, keys) == -1).all()
    assert core.check_invariants() == []
    # Nothing leaked: what fits is still handed out.
    fits = core.group("attn").pools[Tier.DEVICE].free
    assert _allocate(core, "attn", fits, first_key=200).size == fits


def test_allocate_refuses_positions_and_hashes_of_different_lengths() -> None:
    core = _core()
    before = _snapshot(core)
    with pytest.raises(KvfsmError, match="attn"):
        core.allocate("attn", [0, 1], [1], [1])
    _assert_unchanged(before, _snapshot(core))


def test_fire_refuses_allocate() -> None:
    core = _core()
    before = _snapshot(core)
    for event in (Event.ALLOCATE, "allocate"):
        with pytest.raises(KvfsmError, match="allocate"):
            core.fire("attn", [0], event)
    _assert_unchanged(before, _snapshot(core))
    assert core.check_invariants() == []


# -- refused calls change nothing ---------------------------------------------------------------


Blocks = dict[str, int]


def _scene() -> tuple[StateCore, Blocks]:
    """A deepseek-like core with blocks in many states, some pinned, one index pointing at
    history blocks and one at a spilled one."""
    core = _core(DEEPSEEK, device=8, host=4)
    h = _allocate(core, "history", 6, first_key=100).tolist()
    _complete(core, "history", h[:2] + h[4:5])
    core.fire("history", [h[0], h[4]], Event.COMPRESS_BEGIN)
    core.fire("history", [h[0], h[4]], Event.COMPRESS_DONE)
    core.fire("history", [h[4]], Event.SPILL_BEGIN)
    core.fire("history", [h[4]], Event.SPILL_DONE)
    core.fire("history", [h[2], h[5]], Event.WRITE_BEGIN)
    width = core.group("history").decl.payload_bytes // 4
    core.write("history", [h[2]], np.full((1, width), 7, np.uint8), sub_block=1)
    s = _allocate(core, "swa", 2, first_key=200).tolist()
    _complete(core, "swa", s[:1])
    core.pin("swa", s[:1])
    i = _allocate(core, "index", 4, first_key=300).tolist()
    core.fire("index", i, Event.WRITE_BEGIN)
    refs = np.full((2, 4), NO_TARGET, dtype=np.int32)
    refs[0, :2] = [h[0], h[1]]
    refs[1, 0] = h[4]
    core.set_index_refs("index", i[:2], refs)
    core.write("index", i[:2], _payload(core, "index", 2))
    core.fire("index", i[:2], Event.WRITE_DONE)
    core.pin("index", i[:1])
    blocks = {
        "compressed": h[0], "raw": h[1], "h_writing": h[2], "h_allocated": h[3], "h_host": h[4],
        "h_writing2": h[5], "swa": s[0], "swa_allocated": s[1], "index": i[0],
        "index_to_host": i[1], "index_writing": i[2], "index_writing2": i[3],
    }
    assert core.check_invariants() == []
    return core, blocks


def _zeros(core: StateCore, group: str, rows: int, extra: int = 0) -> np.ndarray:
    return np.zeros((rows, core.group(group).decl.payload_bytes + extra), np.uint8)


def _refs(*targets: int) -> np.ndarray:
    row = np.full((1, 4), NO_TARGET, dtype=np.int32)
    row[0, : len(targets)] = targets
    return row


Call = Callable[[StateCore, Blocks], object]
SUB = 256  # bytes of one history sub-block (1024-byte payload in 4 parts)

REFUSED: list[Any] = [
    # write outside a writing state
    pytest.param("history", lambda c, b: c.write("history", [b["raw"]], _zeros(c, "history", 1)),
                 id="write-complete"),
    pytest.param("swa", lambda c, b: c.write("swa", [b["swa_allocated"]], _zeros(c, "swa", 1)),
                 id="write-allocated"),
    pytest.param("history", lambda c, b: c.write("history", [b["h_host"]],
                                                 _zeros(c, "history", 1)), id="write-spilled"),
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"], b["raw"]],
                                                 _zeros(c, "history", 2)), id="write-mixed-batch"),
    pytest.param("history", lambda c, b: c.write(
        "history", [b["compressed"]], np.zeros((1, SUB), np.uint8), sub_block=0),
        id="write-sub-block-compressed"),
    # payload shape
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"]],
                                                 _zeros(c, "history", 1, extra=1)),
                 id="write-wrong-width"),
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"], b["h_writing2"]],
                                                 np.zeros(3, np.uint8)),
                 id="write-ragged-payload"),
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"]],
                                                 np.zeros((1, SUB + 1), np.uint8), sub_block=0),
                 id="write-sub-block-wrong-width"),
    # sub_block range and kind
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"]],
                                                 np.zeros((1, SUB), np.uint8), sub_block=4),
                 id="sub-block-past-end"),
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"]],
                                                 np.zeros((1, SUB), np.uint8), sub_block=-1),
                 id="sub-block-negative"),
    pytest.param("index", lambda c, b: c.write("index", [b["index_writing"]],
                                               _zeros(c, "index", 1), sub_block=0),
                 id="sub-block-not-compressed"),
    # read
    pytest.param("history", lambda c, b: c.read("history", [b["h_allocated"]]),
                 id="read-allocated"),
    pytest.param("history", lambda c, b: c.read("history", [b["h_writing"]]), id="read-writing"),
    pytest.param("history", lambda c, b: c.read("history", [b["h_host"]]), id="read-spilled"),
    pytest.param("history", lambda c, b: c.read("history", [b["compressed"]], form=Form.RAW),
                 id="read-compressed-as-raw"),
    pytest.param("history", lambda c, b: c.read("history", [b["raw"]], form=Form.COMPRESSED),
                 id="read-raw-as-compressed"),
    pytest.param("history", lambda c, b: c.read("history", [b["raw"], b["compressed"]],
                                                form=Form.RAW), id="read-mixed-forms"),
    # pin / unpin
    pytest.param("history", lambda c, b: c.pin("history", [b["h_host"]]), id="pin-spilled"),
    pytest.param("swa", lambda c, b: c.pin("swa", [b["swa"], b["swa_allocated"]]),
                 id="pin-mixed-batch"),
    pytest.param("index", lambda c, b: c.pin("index", [b["index_to_host"]]),
                 id="pin-index-with-spilled-target"),
    pytest.param("index", lambda c, b: c.unpin("index", [b["index_to_host"]]),
                 id="unpin-unpinned"),
    pytest.param("history", lambda c, b: c.unpin("history", [b["h_allocated"]]),
                 id="unpin-allocated"),
    pytest.param("swa", lambda c, b: c.unpin("swa", [b["swa"], b["swa_allocated"]]),
                 id="unpin-mixed-batch"),
    # set_index_refs
    pytest.param("swa", lambda c, b: c.set_index_refs("swa", [b["swa_allocated"]], _refs()),
                 id="refs-not-an-index"),
    pytest.param("index", lambda c, b: c.set_index_refs(
        "index", [b["index_writing"]], np.zeros((1, 5), np.int32)), id="refs-wrong-top-k"),
    pytest.param("index", lambda c, b: c.set_index_refs(
        "index", [b["index_writing"], b["index_writing2"]], np.zeros(7, np.int32)),
        id="refs-ragged"),
    pytest.param("index", lambda c, b: c.set_index_refs(
        "index", [b["index_writing"]], _refs(c.group("history").n_blocks)),
        id="refs-target-past-end"),
    pytest.param("index", lambda c, b: c.set_index_refs("index", [b["index_writing"]],
                                                        _refs(-2)), id="refs-target-negative"),
    pytest.param("index", lambda c, b: c.set_index_refs("index", [b["index"]],
                                                        _refs(b["raw"])), id="refs-complete"),
    # ids
    pytest.param("history", lambda c, b: c.write("history", [b["h_writing"]] * 2,
                                                 _zeros(c, "history", 2)), id="repeated-ids-write"),
    pytest.param("history", lambda c, b: c.read("history", [b["raw"]] * 2),
                 id="repeated-ids-read"),
    pytest.param("history", lambda c, b: c.pin("history", [b["raw"]] * 2), id="repeated-ids-pin"),
    pytest.param("swa", lambda c, b: c.unpin("swa", [b["swa"]] * 2), id="repeated-ids-unpin"),
    pytest.param("index", lambda c, b: c.set_index_refs(
        "index", [b["index_writing"]] * 2, np.full((2, 4), NO_TARGET, np.int32)),
        id="repeated-ids-refs"),
    pytest.param("history", lambda c, b: c.fire("history", [b["raw"]] * 2, Event.EVICT),
                 id="repeated-ids-fire"),
    *[pytest.param("history", call, id=f"out-of-range-ids-{name}") for name, call in {
        "write": lambda c, b: c.write("history", [c.group("history").n_blocks],
                                      _zeros(c, "history", 1)),
        "read": lambda c, b: c.read("history", [-1]),
        "pin": lambda c, b: c.pin("history", [c.group("history").n_blocks]),
        "unpin": lambda c, b: c.unpin("history", [-1]),
        "fire": lambda c, b: c.fire("history", [b["raw"], 10_000], Event.EVICT),
        "refs": lambda c, b: c.set_index_refs("history", [-1], _refs()),
    }.items()],
    *[pytest.param("nope", call, id=f"unknown-group-{name}") for name, call in {
        "allocate": lambda c, b: c.allocate("nope", [0], [1], [1]),
        "fire": lambda c, b: c.fire("nope", [0], Event.EVICT),
        "write": lambda c, b: c.write("nope", [0], np.zeros((1, 8), np.uint8)),
        "read": lambda c, b: c.read("nope", [0]),
        "pin": lambda c, b: c.pin("nope", [0]),
        "unpin": lambda c, b: c.unpin("nope", [0]),
        "refs": lambda c, b: c.set_index_refs("nope", [0], _refs()),
        "touch": lambda c, b: c.touch("nope", [0]),
        "eviction": lambda c, b: c.eviction_candidates("nope", 1),
        "lookup": lambda c, b: c.lookup_hash("nope", [1]),
        "layout": lambda c, b: c.set_write_layout("nope", c.group("history").decl.layout),
    }.items()],
    pytest.param("history", lambda c, b: c.fire("history", [b["h_allocated"]], Event.ALLOCATE),
                 id="fire-allocate"),
]


@pytest.mark.parametrize(("group", "call"), REFUSED)
def test_a_refused_call_names_the_group_and_changes_nothing(group: str, call: Call) -> None:
    core, blocks = _scene()
    before = _snapshot(core)
    with pytest.raises(KvfsmError) as refused:
        call(core, blocks)
    assert group in str(refused.value)
    _assert_unchanged(before, _snapshot(core))
    assert core.check_invariants() == []


@pytest.mark.parametrize("sub_block", [None, 7], ids=["wrong-width", "sub-block-past-end"])
def test_a_refused_write_keeps_the_recorded_layout(sub_block: int | None) -> None:
    core, blocks = _scene()
    decl = core.group("history").decl
    core.set_write_layout("history", Layout(("block", "dim", "token"), decl.layout.alignment, 0))
    before = _snapshot(core)
    with pytest.raises(KvfsmError):
        core.write("history", [blocks["h_writing"]], np.zeros((1, 10), np.uint8),
                   sub_block=sub_block)
    _assert_unchanged(before, _snapshot(core))


@pytest.mark.parametrize("block", [-1, 10_000])
def test_touch_refuses_out_of_range_ids(block: int) -> None:
    core, _ = _scene()
    before = _snapshot(core)
    with pytest.raises(KvfsmError, match="history"):
        core.touch("history", [block])
    _assert_unchanged(before, _snapshot(core))


# -- bytes --------------------------------------------------------------------------------------


def test_bytes_written_survive_spill_and_restore() -> None:
    core = _core(device=4, host=4)
    ids = _allocate(core, "attn", 3, first_key=1)
    kv = _payload(core, "attn", 3, seed=42)
    _complete(core, "attn", ids, kv)
    cold = ids[:2]
    core.fire("attn", cold, Event.SPILL_BEGIN)
    core.fire("attn", cold, Event.SPILL_DONE)
    # The freed device slots are reused and overwritten by other blocks meanwhile.
    other = _allocate(core, "attn", 3, first_key=50)
    _complete(core, "attn", other, _payload(core, "attn", 3, seed=7))
    core.fire("attn", other[:2], Event.EVICT)
    core.fire("attn", cold, Event.RESTORE_BEGIN)
    core.fire("attn", cold, Event.RESTORE_DONE)
    assert (core.read("attn", ids, form=Form.RAW) == kv).all()
    assert core.check_invariants() == []


def test_compressed_bytes_written_by_sub_block_survive_spill_and_restore() -> None:
    core = _core(DEEPSEEK, device=4, host=4)
    (block,) = _allocate(core, "history", 1, first_key=1)
    data = _payload(core, "history", 1, seed=3)
    core.fire("history", [block], Event.WRITE_BEGIN)
    for part in (2, 0, 3):
        core.write("history", [block], data[:, part * SUB : (part + 1) * SUB], sub_block=part)
    with pytest.raises(GuardRejected):  # sub-block 1 is missing
        core.fire("history", [block], Event.WRITE_DONE)
    core.write("history", [block], data[:, SUB : 2 * SUB], sub_block=1)
    core.fire("history", [block], Event.WRITE_DONE)
    assert (core.read("history", [block], form=Form.RAW) == data).all()
    for event in ("compress_begin", "compress_done", "spill_begin", "spill_done",
                  "restore_begin", "restore_done"):
        core.fire("history", [block], event)
    assert (core.read("history", [block], form=Form.COMPRESSED) == data).all()
    assert core.check_invariants() == []


# -- eviction order -----------------------------------------------------------------------------


def test_eviction_candidates_are_least_recently_used_first() -> None:
    core = _core(device=8, host=4)
    ids = _allocate(core, "attn", 7, first_key=1)
    _complete(core, "attn", ids[:6])
    for block in (3, 0, 5, 1, 4, 2):
        core.touch("attn", [ids[block]])
    assert core.eviction_candidates("attn", 10).tolist() == ids[[3, 0, 5, 1, 4, 2]].tolist()
    assert core.eviction_candidates("attn", 2).tolist() == ids[[3, 0]].tolist()
    core.pin("attn", [ids[3]])  # pinned: never a candidate
    core.fire("attn", [ids[0]], Event.SPILL_BEGIN)  # mid-spill: no evict row, not a candidate
    assert core.eviction_candidates("attn", 2).tolist() == ids[[5, 1]].tolist()
    core.fire("attn", [ids[0]], Event.SPILL_DONE)  # on the host now: not a device block
    assert core.eviction_candidates("attn", 10).tolist() == ids[[5, 1, 4, 2]].tolist()
    core.touch("attn", [ids[5]])
    assert core.eviction_candidates("attn", 10).tolist() == ids[[1, 4, 2, 5]].tolist()
    # ids[6] is allocated but never written: not evictable at all.
    assert ids[6] not in core.eviction_candidates("attn", 10)
    core.unpin("attn", [ids[3]])
    assert core.eviction_candidates("attn", 1).tolist() == [ids[1]]


N_LRU = 10


@settings(max_examples=200, deadline=None)
@given(
    order=st.permutations(range(N_LRU)),
    touches=st.lists(st.integers(0, N_LRU - 1), max_size=30),
    pinned=st.sets(st.integers(0, N_LRU - 1)),
    spilled=st.sets(st.integers(0, N_LRU - 1), max_size=4),
    count=st.integers(0, N_LRU + 2),
)
def test_eviction_candidates_are_the_oldest_evictable_blocks(
    order: list[int], touches: list[int], pinned: set[int], spilled: set[int], count: int
) -> None:
    """For any order of uses, any pins and any spills, eviction_candidates(n) is exactly the n
    least recently used blocks among the unpinned device-resident ones, oldest first."""
    core = _core(device=N_LRU, host=4)
    ids = _allocate(core, "attn", N_LRU, first_key=1)
    _complete(core, "attn", ids)
    spilled -= pinned
    if spilled:
        core.fire("attn", ids[sorted(spilled)], Event.SPILL_BEGIN)
        core.fire("attn", ids[sorted(spilled)], Event.SPILL_DONE)
    last: dict[int, int] = {}
    for tick, block in enumerate([*order, *touches]):
        core.touch("attn", [ids[block]])
        last[block] = tick
    for block in sorted(pinned):
        core.pin("attn", [ids[block]])
    evictable = [b for b in range(N_LRU) if b not in pinned and b not in spilled]
    expected = sorted(evictable, key=last.__getitem__)[:count]
    assert core.eviction_candidates("attn", count).tolist() == ids[expected].tolist()


# -- index pins ---------------------------------------------------------------------------------


def test_pinning_an_index_pins_its_targets_until_unpinned() -> None:
    core = _core(DEEPSEEK, device=8, host=4)
    history = _allocate(core, "history", 3, first_key=1)
    _complete(core, "history", history)
    (index,) = _allocate(core, "index", 1, first_key=100)
    core.fire("index", [index], Event.WRITE_BEGIN)
    core.set_index_refs("index", [index], _refs(history[0], history[1]))
    core.write("index", [index], _payload(core, "index", 1))
    core.fire("index", [index], Event.WRITE_DONE)
    core.touch("history", history)

    core.pin("index", [index])
    for target in history[:2]:
        with pytest.raises(GuardRejected):
            core.fire("history", [target], Event.EVICT)
    core.fire("history", history[:2], Event.COMPRESS_BEGIN)
    with pytest.raises(GuardRejected):  # the raw form may not vanish under the index's reader
        core.fire("history", history[:2], Event.COMPRESS_DONE)
    core.fire("history", history[:2], Event.COMPRESS_FAIL)
    assert core.eviction_candidates("history", 3).tolist() == [history[2]]
    assert core.check_invariants() == []

    core.unpin("index", [index])
    assert sorted(core.eviction_candidates("history", 3).tolist()) == sorted(history.tolist())
    core.fire("history", [history[0]], Event.EVICT)
    # The index pointed at the evicted block: it is invalidated with it, never left stale.
    assert _state(core, "index", index) == "invalid"
    assert core.check_invariants() == []


@pytest.mark.parametrize("where", ["negative", "one past the end", "far past"])
def test_an_index_reference_outside_its_target_group_is_never_current(where: str) -> None:
    """Index metadata corrupted behind the core's back to point outside the target group:
    the ``targets_current`` guard says not current (a negative reference is not read as
    counting from the end, where a block at the recorded epoch would make it pass), so
    ``spill_fail`` back to a readable state is refused with a GuardRejected and nothing
    moves, and pinning the index (which pins its targets) is a StateError naming the
    reference. Found by a long Hypothesis run (seed 51277): the guard raised an IndexError."""
    core = _core(DEEPSEEK, device=8, host=4)
    history = _allocate(core, "history", 8, first_key=1)
    _complete(core, "history", history)
    (index,) = _allocate(core, "index", 1, first_key=100)
    core.fire("index", [index], Event.WRITE_BEGIN)
    core.set_index_refs("index", [index], _refs(history[0], history[1]))
    core.write("index", [index], _payload(core, "index", 1))
    core.fire("index", [index], Event.WRITE_DONE)
    group, targets = core.group("index"), core.group("history")
    outside = {"negative": -5, "one past the end": targets.n_blocks,
               "far past": 1 << 30}[where]
    group._blocks.refs_target[index, 0] = outside
    # At the epoch of the block a negative reference would wrap to.
    group._blocks.refs_epoch[index, 0] = targets.epoch[outside % targets.n_blocks]
    assert group.targets_current(np.array([index])).tolist() == [False]
    # Pinning it would pin its targets: refused naming the reference, nothing pinned (a
    # negative one pinned the block it wrapped to).
    before = _snapshot(core)
    with pytest.raises(StateError, match=rf"point outside history .*\[{outside}\]"):
        core.pin("index", [index])
    _assert_unchanged(before, _snapshot(core))
    core.fire("index", [index], Event.SPILL_BEGIN)
    before = _snapshot(core)
    with pytest.raises(GuardRejected, match="targets_current"):
        core.fire("index", [index], Event.SPILL_FAIL)
    _assert_unchanged(before, _snapshot(core))


def test_index_target_pins_cannot_be_released_twice() -> None:
    """Whatever a careless reader unpins, a block no reader holds ends up evictable."""
    core = _core(DEEPSEEK, device=8, host=4)
    history = _allocate(core, "history", 2, first_key=1)
    _complete(core, "history", history)
    (index,) = _allocate(core, "index", 1, first_key=100)
    core.fire("index", [index], Event.WRITE_BEGIN)
    core.set_index_refs("index", [index], _refs(history[0]))
    core.write("index", [index], _payload(core, "index", 1))
    core.fire("index", [index], Event.WRITE_DONE)
    core.pin("index", [index])
    with contextlib.suppress(KvfsmError):
        core.unpin("history", [history[0]])  # this reader never pinned it
    with contextlib.suppress(KvfsmError):
        core.unpin("index", [index])
    assert history[0] in core.eviction_candidates("history", 2)


# -- layouts and configuration ------------------------------------------------------------------


def test_set_write_layout_records_the_layout_of_each_block() -> None:
    core = _core()
    group = core.group("attn")
    default = group.decl.layout
    other = Layout(("block", "dim", "token"), default.alignment, default.padding)
    first = _allocate(core, "attn", 2, first_key=1)
    _complete(core, "attn", first)
    core.set_write_layout("attn", other)
    second = _allocate(core, "attn", 2, first_key=10)
    _complete(core, "attn", second)
    core.set_write_layout("attn", other)  # setting it again changes nothing
    core.set_write_layout("attn", default)
    third = _allocate(core, "attn", 1, first_key=20)
    _complete(core, "attn", third)

    def layouts(ids: np.ndarray) -> list[Layout]:
        return [group.layouts[int(group.layout_id[b])] for b in ids]

    assert layouts(first) == [default, default]
    assert layouts(second) == [other, other]
    assert layouts(third) == [default]
    assert len(group.layouts) == 2


def test_core_config_per_group_overrides_slots() -> None:
    config = CoreConfig(device_blocks=4, host_blocks=2, backend="numpy",
                        per_group={"swa": {"device": 10, "host": 0}, "attn": {"HOST": 3}})
    core = StateCore(GPT_OSS, config)
    swa, full = core.group("swa"), core.group("attn")
    assert swa.pools[Tier.DEVICE].capacity == 10
    assert Tier.HOST not in swa.pools
    assert swa.n_blocks == 10
    assert full.pools[Tier.DEVICE].capacity == 4
    assert full.pools[Tier.HOST].capacity == 3
    assert full.n_blocks == 7
    assert config.slots("other") == {Tier.DEVICE: 4, Tier.HOST: 2}  # no override: defaults


def test_a_group_without_device_slots_is_refused() -> None:
    config = CoreConfig(device_blocks=4, per_group={"swa": {"device": 0}}, backend="numpy")
    with pytest.raises(KvfsmError, match="swa"):
        StateCore(GPT_OSS, config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"device_blocks": 0}, "device_blocks must be >= 1"),
        ({"device_blocks": -1}, "device_blocks must be >= 1"),
        ({"host_blocks": -1}, "host_blocks must be >= 0"),
        ({"max_restores_in_flight": -1}, "max_restores_in_flight must be >= 0"),
        ({"device_blocks": 2.5}, "device_blocks must be an int"),
        ({"device_blocks": True}, "device_blocks must be an int"),
        ({"backend": "tpu"}, "backend must be one of"),
        ({"per_group": {"swa": {"device": -2}}}, "must be an int >= 0"),
        ({"per_group": {"swa": {"nvme": 2}}}, "unknown tier 'nvme'"),
        ({"pin_chunk_blocks": 0}, "pin_chunk_blocks must be >= 1"),
        ({"pin_chunk_blocks": 48}, "pin_chunk_blocks must be a power of two"),
        ({"pin_chunk_blocks": 1 << 17}, "pin_chunk_blocks must be a power of two up to"),
        ({"pin_chunk_blocks": 4.0}, "pin_chunk_blocks must be an int"),
    ],
)
def test_config_values_are_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(KvfsmError, match=message):
        CoreConfig(**fields)  # type: ignore[arg-type]


# -- the invariant report -----------------------------------------------------------------------


def test_assert_invariants_lists_a_hand_corrupted_slot() -> None:
    core = _core()
    ids = _allocate(core, "attn", 2, first_key=1)
    _complete(core, "attn", ids)
    core.assert_invariants()
    core.group("attn")._blocks.slot[Tier.DEVICE][ids[0]] = -1  # a device block with no slot
    problems = core.check_invariants()
    assert problems
    assert all(p.startswith("attn: ") for p in problems)
    assert any("lines_agree" in p for p in problems)
    with pytest.raises(InvariantViolation) as raised:
        core.assert_invariants()
    assert raised.value.problems == tuple(problems)
    assert all(p in str(raised.value) for p in problems)


# -- derived indexes kept by every fire; values that cannot wrap ---------------------------------


def test_firing_through_the_machine_keeps_the_free_stack_exact() -> None:
    """Regression: firing through ``group.machine`` bypassed the free-id stack."""
    core = _core()
    group = core.group("attn")
    ids = _allocate(core, "attn", 3, first_key=1)
    _complete(core, "attn", ids)
    group.machine.fire_batch(ids[:2], Event.EVICT)  # not through core.fire
    assert core.check_invariants() == []
    # Allocating chosen free ids directly through the machine takes them off the stack too.
    free = np.sort(group.free_ids[: group.free_top])
    chosen = free[[0, free.size // 2]]
    group.machine.fire_batch(chosen, Event.ALLOCATE)
    assert not np.isin(chosen, group.free_ids[: group.free_top]).any()
    assert core.check_invariants() == []


@pytest.mark.parametrize("order", ["ascending", "scrambled"])
def test_blocks_freed_together_are_allocated_again_in_the_order_they_were_freed(
        order: str) -> None:
    """The free-id stack gives a batch of freed ids back, on the next allocations, in the order
    they were freed (not reversed): a prompt's blocks freed in prompt order come back as the
    same ascending run, which a lookup confirms without the hash table and a lease pins by
    whole chunks. Allocating part of them takes the batch's first ones."""
    core = _core(device=32, host=4)
    ids = _allocate(core, "attn", 12, first_key=1)
    _complete(core, "attn", ids)
    freed = ids if order == "ascending" else np.random.default_rng(3).permutation(ids)
    core.fire("attn", freed, Event.EVICT)
    assert core.group("attn").pop_free_ids(5).tolist() == freed[:5].tolist()
    again = _allocate(core, "attn", 5, first_key=100)
    assert again.tolist() == freed[:5].tolist()
    rest = _allocate(core, "attn", 7, first_key=200)
    assert rest.tolist() == freed[5:].tolist()
    assert core.check_invariants() == []


def test_restores_in_flight_are_counted_by_every_fire() -> None:
    core = _core(max_restores_in_flight=2)
    group = core.group("attn")
    ids = _allocate(core, "attn", 3, first_key=1)
    _complete(core, "attn", ids)
    core.fire("attn", ids, Event.SPILL_BEGIN)
    core.fire("attn", ids, Event.SPILL_DONE)
    assert core.fire("attn", ids, Event.RESTORE_BEGIN, masked=True).tolist() == [True, True,
                                                                                False]
    assert (group.restores_in_flight(), group.restore_budget()) == (2, 0)
    group.machine.fire_batch(ids[:1], Event.RESTORE_FAIL)
    assert (group.restores_in_flight(), group.restore_budget()) == (1, 1)


def test_pins_never_wrap() -> None:
    core = _core()
    group = core.group("attn")
    ids = _allocate(core, "attn", 1, first_key=1)
    _complete(core, "attn", ids)
    group._blocks.pins[ids] = MAX_PINS - 1  # as if 65534 readers held it
    core.pin("attn", ids)
    with pytest.raises(StateError, match="pins"):
        core.pin("attn", ids)
    assert int(group.pins[ids[0]]) == MAX_PINS


def test_an_index_pin_that_would_wrap_its_target_changes_nothing() -> None:
    from tests.lookup_models import engine, tokens

    eng = engine(DEEPSEEK)
    text = tokens(321)
    eng.commit(text)
    core = eng.core
    high, low = eng.prompt(text).words(16)
    row = int(core.lookup_words("index", high[10:11], low[10:11])[0])
    target = int(core.group("index").refs_target[row, 0])
    core.group("history")._blocks.pins[target] = MAX_PINS
    with pytest.raises(StateError, match="pins"):
        core.pin("index", [row])
    assert int(core.group("index").pins[row]) == 0
    assert int(core.group("history").pins[target]) == MAX_PINS


def test_metadata_is_read_only_outside_the_core() -> None:
    core = _core()
    group = core.group("attn")
    for view in (group.epoch, group.pins, group.block_pins, group.chunk_pins, group.position,
                 group.check, group.sub_blocks, group.slot[Tier.DEVICE], group.free_ids,
                 group.states):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1


def test_evicting_a_target_walks_only_its_own_references() -> None:
    """Finding the index rows that point at an evicted history block costs the references to
    it, not the index pool (it scanned every reference before)."""
    from tests.lookup_models import engine, tokens

    eng = engine(DEEPSEEK, device=400, host=0)
    for seed in range(8):
        eng.commit(tokens(1025, seed=seed))
    index, history = eng.core.group("index"), eng.core.group("history")
    assert index.dependents is not None
    text = tokens(1025, seed=3)
    target = int(eng.core.lookup_words("history", *[w[5:6] for w in
                                                    eng.prompt(text).words(64)])[0])
    pointing = int((index.refs_target == target).sum())
    assert 0 < pointing < int((index.refs_target != NO_TARGET).sum()) // 20
    eng.core.fire("history", [target], Event.EVICT)
    assert index.dependents.last_walked == pointing
    assert history.states[target] == history.table.initial
    assert eng.core.check_invariants() == []


def test_describe_and_blocks_in_show_what_a_caller_needs() -> None:
    core = _core()
    ids = _allocate(core, "attn", 2, first_key=1)
    _complete(core, "attn", ids)
    info = core.describe("attn", int(ids[0]))
    assert (info.state, info.position, info.pins, info.verified) == ("device", 0, 0, True)
    assert info.layout == core.group("attn").decl.layout
    assert set(info.slots) == {Tier.DEVICE}
    core.fire("attn", ids[1:], Event.INVALIDATE)
    assert core.blocks_in("attn", "invalid").tolist() == [int(ids[1])]
    assert core.blocks_in("attn", ["invalid", "device"]).tolist() == sorted(ids.tolist())
    with pytest.raises(KvfsmError, match="no state 'nope'"):
        core.blocks_in("attn", "nope")


def test_changes_counts_every_move_and_recorded_failure_and_nothing_else() -> None:
    """A group's ``changes`` moves with every batch that moves its blocks and every checksum
    failure recorded; reads, touches, pins, passes and refused fires leave it alone (a lease
    relies on it: while it stands still, what was seen of the group's blocks still holds)."""
    core = _core()
    group = core.group("attn")
    ids = _allocate(core, "attn", 3, 100)
    after_allocate = group.changes
    assert after_allocate > 0
    _complete(core, "attn", ids)
    settled = group.changes
    assert settled == after_allocate + 2  # write_begin, write_done
    core.read("attn", ids)
    core.touch("attn", ids)
    core.pin("attn", ids[:1])
    core.record_checks("attn", ids, np.ones(3, dtype=np.bool_))
    with pytest.raises(GuardRejected):
        core.fire("attn", ids[:1], Event.EVICT)  # pinned: refused, nothing moves
    assert group.changes == settled
    core.record_checks("attn", ids[1:2], np.zeros(1, dtype=np.bool_))
    assert group.changes == settled + 1
    core.unpin("attn", ids[:1])
    core.fire("attn", ids[2:], Event.EVICT)
    assert group.changes == settled + 2


def test_the_core_change_count_is_the_sum_of_its_groups_changes() -> None:
    """The core's ``change_count`` (shared by its groups) moves with every group's ``changes``
    and with nothing else: a lease made from a lookup compares that one number to know no
    group changed since."""
    core = _core(DEEPSEEK)
    counter = core.change_count
    assert all(state.change_count is counter for state in core.groups.values())

    def total() -> int:
        return sum(state.changes for state in core.groups.values())

    assert counter.total == total() == 0
    names = list(core.groups)
    for at, name in enumerate(names):
        ids = _allocate(core, name, 2, first_key=100 * (at + 1))
        assert counter.total == total() > 0
        _complete(core, name, ids)
        assert counter.total == total()
        before = counter.total
        core.touch(name, ids)
        core.pin(name, ids[:1])
        core.unpin(name, ids[:1])
        assert counter.total == before  # no change to any block
        core.record_checks(name, ids[:1], np.zeros(1, dtype=np.bool_))
        assert counter.total == total() == before + 1
