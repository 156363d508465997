"""The core's side of stored tiers (disk, remote): copies recorded by one bit per tier, blocks
discovered from a key, loads recorded by the data path and verified at ``restore_done``, a
restored block that keeps its stored copy, and the invariants that watch the bits."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvfsm import CoreConfig, GuardRejected, KvfsmError, StateCore, Tier, shipped_models
from kvfsm.spec import Event
from kvfsm.state import StateError

DENSE = shipped_models()["dense"]
PAYLOAD = DENSE.group("attn").payload_bytes


def _core(**sizes: int) -> StateCore:
    config = {"device_blocks": 2, "host_blocks": 2, "disk_blocks": 2, "remote_blocks": 2} | sizes
    return StateCore(DENSE, CoreConfig(backend="numpy", **config))


def _content(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8)


def test_a_discovered_copy_is_a_hash_hit_that_is_not_readable() -> None:
    core = _core()
    ids = core.discover("attn", [0, 1], [11, 12], [21, 22], Tier.DISK)
    group = core.group("attn")
    assert [group.machine.state_of(int(i)) for i in ids] == ["disk", "disk"]
    assert core.lookup_words("attn", [11, 12], [21, 22]).tolist() == ids.tolist()
    assert core.describe("attn", int(ids[0])).stored == (Tier.DISK,)
    with pytest.raises(StateError):
        core.read("attn", ids)
    assert core.check_invariants() == []


def test_discovery_is_all_or_nothing_and_refuses_known_keys() -> None:
    core = _core(disk_blocks=1)
    before = core.group("attn").states.copy()
    with pytest.raises(GuardRejected):  # two copies, room for one
        core.discover("attn", [0, 1], [1, 2], [3, 4], Tier.DISK)
    assert np.array_equal(core.group("attn").states, before)
    assert (core.lookup_words("attn", [1, 2], [3, 4]) == -1).all()
    core.discover("attn", [0], [1], [3], Tier.DISK)
    with pytest.raises(StateError, match="already"):
        core.discover("attn", [0], [1], [3], Tier.REMOTE)
    with pytest.raises(KvfsmError, match="stored tiers"):
        core.discover("attn", [1], [5], [6], Tier.HOST)
    with pytest.raises(KvfsmError, match="discover"):
        core.fire("attn", [3], Event.DISCOVER_DISK)
    assert core.check_invariants() == []


def test_a_restore_from_disk_needs_the_loaded_bytes_to_match_their_header() -> None:
    core = _core()
    (block,) = core.discover("attn", [0], [7], [8], Tier.DISK).tolist()
    core.fire("attn", [block], Event.RESTORE_BEGIN)
    content = _content(1)
    with pytest.raises(GuardRejected):  # nothing loaded yet: the slot holds no such bytes
        core.fire("attn", [block], Event.RESTORE_DONE)
    flipped = content.copy()
    flipped[5] ^= 0x10
    core.record_loaded("attn", [block], [xxhash.xxh3_64_intdigest(content)], flipped[None])
    with pytest.raises(GuardRejected):  # what arrived is not what the header promised
        core.fire("attn", [block], Event.RESTORE_DONE)
    (row,) = core.restore_rows("attn", [block])  # the loader's in-place path
    row[:] = content
    core.record_loaded("attn", [block], [xxhash.xxh3_64_intdigest(content)])
    core.fire("attn", [block], Event.RESTORE_DONE)
    group = core.group("attn")
    assert group.machine.state_of(block) == "device_disk"
    assert (core.read("attn", [block])[0] == content).all()
    assert core.describe("attn", block).stored == (Tier.DISK,)  # the file is kept
    core.fire("attn", [block], Event.EVICT)  # costs no write: back to the copy on disk
    assert group.machine.state_of(block) == "disk"
    assert core.lookup_words("attn", [7], [8]).tolist() == [block]
    assert core.check_invariants() == []


def test_loads_and_stores_are_only_for_blocks_moving_through_a_stored_tier() -> None:
    core = _core()
    ids = core.allocate("attn", [0], [1], [2])
    with pytest.raises(StateError):
        core.restore_rows("attn", ids)
    with pytest.raises(StateError):
        core.record_loaded("attn", ids, [0])
    with pytest.raises(StateError):
        core.spill_rows("attn", ids)


def test_a_spill_to_disk_exposes_the_host_copy_and_records_the_disk_copy_when_done() -> None:
    core = _core()
    ids = core.allocate("attn", [0], [1], [2])
    core.fire("attn", ids, Event.WRITE_BEGIN)
    content = _content(2)
    core.write("attn", ids, content[None])
    core.fire("attn", ids, Event.WRITE_DONE)
    core.fire("attn", ids, Event.SPILL_BEGIN)
    core.fire("attn", ids, Event.SPILL_DONE)
    core.fire("attn", ids, Event.SPILL_BEGIN)  # host -> disk
    rows, sums = core.spill_rows("attn", ids)
    assert (rows[0] == content).all()
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(content)]
    core.fire("attn", ids, Event.SPILL_DONE)
    assert core.describe("attn", int(ids[0])).stored == (Tier.DISK,)
    assert core.group("attn").stored_used(Tier.DISK) == 1
    core.fire("attn", ids, Event.SPILL_BEGIN)  # disk -> remote moves the copy
    core.fire("attn", ids, Event.SPILL_DONE)
    assert core.describe("attn", int(ids[0])).stored == (Tier.REMOTE,)
    assert core.check_invariants() == []


def test_without_a_stored_tier_nothing_goes_there() -> None:
    core = _core(disk_blocks=0, remote_blocks=0)
    assert core.group("attn").n_blocks == 4
    with pytest.raises(GuardRejected):
        core.discover("attn", [0], [1], [2], Tier.DISK)


def test_the_copy_bits_are_watched_by_the_invariants() -> None:
    """A copy bit on a block whose state holds none, or a count that disagrees with the
    bits, is reported (seeded behind the core's back)."""
    core = _core()
    (block,) = core.discover("attn", [0], [1], [2], Tier.REMOTE).tolist()
    group = core.group("attn")
    copies = group._blocks.copies
    copies[block] = 0
    problems = core.check_invariants()
    assert any("lines_agree" in p for p in problems)
    assert any("slot_owned_once" in p for p in problems)
    copies[block] = 1 << Tier.REMOTE
    free = int(np.flatnonzero(group.states == group.table.initial)[0])
    copies[free] = 1 << Tier.DISK
    assert any("lines_agree" in p for p in core.check_invariants())
