"""Every invariant of ``StateCore.check_invariants`` catches the fault it is about, and the
restore-time checksum guard refuses a corrupted copy.

Each invariant gets one test: a real core is brought to a sound state through the public API,
found sound, then exactly one fault is seeded behind the core's back (through :func:`_corrupt`
or :func:`_corrupt_pool` only) and the report must name that invariant for that group. A new
invariant without a seeded fault fails here until one is added to ``SEEDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import (
    CoreConfig,
    GuardRejected,
    InvariantViolation,
    StateCore,
    Tier,
    shipped_models,
)
from kvfsm.memory import SlotPool
from kvfsm.spec import Event
from kvfsm.state import NO_TARGET, GroupState
from kvfsm.state._hashtable import EMPTY
from kvfsm.state._invariants import CORE_INVARIANTS

IdArray = NDArray[np.intp]

#: Groups history (compressed), swa (sliding window) and index (sparse_index -> history).
DEEPSEEK = shipped_models()["deepseek_v4_like"]
#: One full_kv group, attn.
DENSE = shipped_models()["dense"]


# -- seeding faults ----------------------------------------------------------------------------


def _corrupt(group: GroupState, field: str, index: Any, value: Any) -> None:
    """Write ``value`` at ``index`` of one of ``group``'s per-block arrays, behind the core's back.

    ``field`` names the array (``"pins"``); a per-tier array is indexed by ``(tier, block)``
    (``"slot"``); a dotted name reaches an array of a member, the hash map's slots
    (``"hash_map.value"``), which is the group's own rather than a per-block array.
    """
    arrays = getattr(group, "_blocks", group)
    head, *rest = field.split(".")
    target: Any = getattr(arrays if hasattr(arrays, head) else group, head)
    for part in rest:
        target = getattr(target, part)
    if isinstance(target, Mapping):
        key, index = index
        target = target[key]
    target[index] = value


def _corrupt_pool(pool: SlotPool, field: str, index: Any, value: Any) -> None:
    """Write into a pool's books (``owner``, ``stack``); the pool publishes them read-only, so
    the write goes to the array behind the view."""
    getattr(pool, f"_{field}")[index] = value


# -- a sound core ------------------------------------------------------------------------------


@attrs.frozen
class Sound:
    """A deepseek_v4_like core in a sound state, and which blocks are where."""

    core: StateCore
    #: Complete history blocks (written, hashed, readable).
    history: IdArray
    #: A history block still being written (partial content, not hashed).
    writing: IdArray
    #: Complete sliding-window blocks.
    swa: IdArray
    #: Readable index blocks, each pointing at every block of ``history``.
    index: IdArray

    def group(self, name: str) -> GroupState:
        return self.core.group(name)

    def a_free_block(self, name: str) -> int:
        group = self.group(name)
        return int(np.flatnonzero(group.states == group.table.initial)[0])


def _payload(core: StateCore, group: str, count: int, seed: int) -> NDArray[np.uint8]:
    size = core.group(group).decl.payload_bytes
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def _start(core: StateCore, group: str, count: int, first_key: int) -> IdArray:
    """Allocate ``count`` blocks with distinct keys and begin writing them."""
    keys = np.arange(first_key, first_key + count, dtype=np.uint64)
    ids = core.allocate(group, np.arange(count), keys, keys * np.uint64(7919))
    core.fire(group, ids, Event.WRITE_BEGIN)
    return ids


def _commit(core: StateCore, group: str, count: int, first_key: int,
            targets: IdArray | None = None) -> IdArray:
    """Blocks written and complete, in the engine's order: allocate, write_begin, index refs,
    write, write_done."""
    ids = _start(core, group, count, first_key)
    if targets is not None:
        top_k = core.group(group).refs_target.shape[1]
        refs = np.full((count, top_k), NO_TARGET, dtype=np.int32)
        refs[:, : targets.size] = targets
        core.set_index_refs(group, ids, refs)
    core.write(group, ids, _payload(core, group, count, seed=first_key))
    core.fire(group, ids, Event.WRITE_DONE)
    return ids


def _sound() -> Sound:
    core = StateCore(DEEPSEEK, CoreConfig(device_blocks=4, host_blocks=2, backend="numpy"))
    history = _commit(core, "history", 2, first_key=1)
    writing = _start(core, "history", 1, first_key=100)
    swa = _commit(core, "swa", 2, first_key=200)
    index = _commit(core, "index", 1, first_key=300, targets=history)
    return Sound(core, history, writing, swa, index)


# -- one seeded fault per invariant ------------------------------------------------------------


def _pin_a_free_block(s: Sound) -> str:
    # pinned_is_readable: a reader holds a block that has no content.
    _corrupt(s.group("swa"), "pins", s.a_free_block("swa"), 1)
    return "swa"


def _give_a_slot_to_another_owner(s: Sound) -> str:
    group = s.group("history")
    slot = int(group.slot[Tier.DEVICE][s.history[0]])
    _corrupt_pool(group.pools[Tier.DEVICE], "owner", slot, int(s.history[1]))
    return "history"


def _drop_the_slot_of_a_resident_block(s: Sound) -> str:
    _corrupt(s.group("swa"), "slot", (Tier.DEVICE, s.swa[0]), -1)
    return "swa"


def _map_a_key_to_a_block_being_written(s: Sound) -> str:
    group = s.group("history")
    entry = int(np.flatnonzero(group.hash_map.value == s.history[0])[0])
    _corrupt(group, "hash_map.value", entry, int(s.writing[0]))
    return "history"


def _empty_a_live_hash_entry(s: Sound) -> str:
    group = s.group("swa")
    entry = int(np.flatnonzero(group.hash_map.value == s.swa[0])[0])
    _corrupt(group, "hash_map.value", entry, EMPTY)  # the live count still says it is there
    return "swa"


def _point_an_index_at_a_freed_block(s: Sound) -> str:
    _corrupt(s.group("index"), "refs_target", (s.index[0], 0), s.a_free_block("history"))
    return "index"


def _unlink_a_reference_from_the_reverse_map(s: Sound) -> str:
    group = s.group("index")
    row = int(s.index[-1])
    node = row * group.refs_target.shape[1]  # its first reference, linked under its target
    assert group.refs_target[row, 0] != -1
    _corrupt(group, "dependents.linked_target", node, -1)
    return "index"


def _forget_a_sub_block_of_a_complete_block(s: Sound) -> str:
    group = s.group("history")
    _corrupt(group, "sub_blocks", s.history[0], group.full_sub_mask & ~1)
    return "history"


def _stack_a_live_block_as_free(s: Sound) -> str:
    group = s.group("swa")
    _corrupt(group, "free_ids", group.free_top - 1, int(s.swa[0]))
    return "swa"


def _drop_a_readable_block_from_its_recency_list(s: Sound) -> str:
    group = s.group("swa")
    listed = int(group.recency.list_of_state[group.states[s.swa[0]]])
    oldest = int(group.recency.head[listed])
    # Its list's head skips it, behind the core's back: give-backs would never offer it.
    _corrupt(group, "recency.head", listed, int(group.recency.next[oldest]))
    return "swa"


def _count_a_restore_that_is_not_running(s: Sound) -> str:
    group = s.group("history")
    group._restoring += 1  # a plain counter, not an array: written behind the core's back
    return "history"


#: Per invariant of CORE_INVARIANTS: seed exactly its fault, return the group seeded.
SEEDS: dict[str, Callable[[Sound], str]] = {
    "lifecycle": _pin_a_free_block,
    "slot_owned_once": _give_a_slot_to_another_owner,
    "lines_agree": _drop_the_slot_of_a_resident_block,
    "hash_complete": _map_a_key_to_a_block_being_written,
    "hash_table_sound": _empty_a_live_hash_entry,
    "index_current": _point_an_index_at_a_freed_block,
    "dependents_exact": _unlink_a_reference_from_the_reverse_map,
    "sub_blocks_complete": _forget_a_sub_block_of_a_complete_block,
    "free_ids_exact": _stack_a_live_block_as_free,
    "recency_exact": _drop_a_readable_block_from_its_recency_list,
    "restores_counted": _count_a_restore_that_is_not_running,
}


def test_every_core_invariant_has_a_seeded_fault() -> None:
    assert sorted(SEEDS) == sorted(inv.name for inv in CORE_INVARIANTS)


@pytest.mark.parametrize("name", [inv.name for inv in CORE_INVARIANTS])
def test_seeded_fault_is_reported_by_its_invariant(name: str) -> None:
    sound = _sound()
    assert sound.core.check_invariants() == []
    if name not in SEEDS:
        pytest.fail(f"invariant {name!r} has no seeded fault: add one to SEEDS")
    group = SEEDS[name](sound)
    problems = sound.core.check_invariants()
    assert any(p.startswith(f"{group}: {name}: ") for p in problems), problems
    with pytest.raises(InvariantViolation) as raised:
        sound.core.assert_invariants()
    assert raised.value.problems == tuple(problems)


def test_a_false_record_of_a_run_linked_in_order_is_a_recency_fault() -> None:
    """``recency_exact`` also holds the recency record to the links: one naming a block as
    part of a run on a list it is not on (a touch would trust it and skip reading links) is
    reported."""
    sound = _sound()
    group = sound.group("swa")
    block = int(sound.swa[0])
    listed = int(group.recency.list_of_state[group.states[block]])
    _corrupt(group, "recency.linked_run", slice(None), np.array([block, 1, listed + 1]))
    problems = sound.core.check_invariants()
    assert any(p.startswith("swa: recency_exact: ") and "record of a run" in p
               for p in problems), problems


# -- the restore-time checksum guard -----------------------------------------------------------


def _spilled_block(core: StateCore) -> tuple[int, NDArray[np.uint8]]:
    """One complete attn block spilled to host, and the bytes written into it."""
    ids = _start(core, "attn", 1, first_key=1)
    payload = _payload(core, "attn", 1, seed=7)
    core.write("attn", ids, payload)
    core.fire("attn", ids, Event.WRITE_DONE)
    core.fire("attn", ids, Event.SPILL_BEGIN)
    core.fire("attn", ids, Event.SPILL_DONE)
    assert core.group("attn").machine.state_of(int(ids[0])) == "host"
    return int(ids[0]), payload


def _books(core: StateCore) -> dict[str, Any]:
    """Copies of the attn group's states, slots, epochs and both pools' bytes and books."""
    group = core.group("attn")
    out: dict[str, Any] = {"states": group.states.copy(), "epoch": group.epoch.copy(),
                           "map": sorted(group.hash_map.items())}
    for tier, pool in group.pools.items():
        out[f"slot[{tier.spec_name}]"] = group.slot[tier].copy()
        out[f"owner[{tier.spec_name}]"] = pool.owner.copy()
        out[f"checksum[{tier.spec_name}]"] = pool.checksum.copy()
        out[f"data[{tier.spec_name}]"] = np.asarray(pool.data).copy()
    return out


def _same(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [key for key in before if not np.array_equal(before[key], after[key])]


@pytest.mark.parametrize("offset", [0, -1], ids=["first-byte", "last-byte"])
def test_restore_done_refuses_a_corrupted_host_copy_and_changes_nothing(offset: int) -> None:
    core = StateCore(DENSE, CoreConfig(device_blocks=2, host_blocks=2, backend="numpy"))
    block, _ = _spilled_block(core)
    group = core.group("attn")
    host = group.pools[Tier.HOST]
    slot = int(group.slot[Tier.HOST][block])
    recorded = int(host.checksum[slot])
    # A fault on the physical line: one payload byte of the host copy flips, its checksum not.
    host.data[slot, offset % group.decl.payload_bytes] ^= 0xFF
    assert int(host.checksum[slot]) == recorded
    core.fire("attn", [block], Event.RESTORE_BEGIN)
    before = _books(core)
    with pytest.raises(GuardRejected, match="checksum_ok"):
        core.fire("attn", [block], Event.RESTORE_DONE)
    assert _same(before, _books(core)) == []
    assert group.machine.state_of(block) == "restoring_host"
    core.fire("attn", [block], Event.RESTORE_FAIL)
    assert group.machine.state_of(block) == "host"
    assert group.slot[Tier.DEVICE][block] == -1
    assert core.check_invariants() == []


def test_restore_done_accepts_an_intact_host_copy_and_reads_back_the_same_bytes() -> None:
    core = StateCore(DENSE, CoreConfig(device_blocks=2, host_blocks=2, backend="numpy"))
    block, payload = _spilled_block(core)
    core.fire("attn", [block], Event.RESTORE_BEGIN)
    core.fire("attn", [block], Event.RESTORE_DONE)
    assert core.group("attn").machine.state_of(block) == "device"
    assert np.array_equal(core.read("attn", [block]), payload)
    assert core.check_invariants() == []


def test_core_wide_restore_budget_must_count_the_restoring_blocks() -> None:
    """The core-wide budget's counts are the groups' restoring blocks and their bytes; a count
    moved behind the core's back is reported."""
    sound = _sound()
    assert sound.core.check_invariants() == []
    sound.core.restore_budget.moved(1, 4096)
    problems = sound.core.check_invariants()
    assert any(p.startswith("*: restore_budget: ") for p in problems), problems
