"""Stateful fuzzing of the whole state core against a plain Python reference model.

The reference reads the lifecycle specs as plain dictionaries and applies guards and effects by
their meaning, block by block, with no arrays; the core must agree with it after every step:
same lifecycle state and pins for every block, same hash map, the bytes read back equal to the
bytes written (across spill, restore and compression), and every invariant of
``StateCore.check_invariants`` holding. Faults are injected on the physical line (corrupted
host copies) and must surface as refused restores, never as wrong bytes. Disk and remote copies
are stored by key outside the core: the fuzzer plays the data path, discovering copies, loading
them (good or flipped) between ``restore_begin`` and ``restore_done``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvfsm import KvfsmError, TransitionError
from kvfsm.spec import Content, Event, GroupKind, Lifecycle, ModelDecl, Tier, shipped_models
from kvfsm.spec._vocabulary import DISCOVER_EVENT
from kvfsm.state import CoreConfig, StateCore, join_words

DEVICE, HOST, DISK, REMOTE = 3, 2, 2, 2
MAX_RESTORES = 2
#: How the core adopts a copy found in each stored tier (StateCore.discover).
DISCOVERS = DISCOVER_EVENT
#: Every event but allocate and discovery (StateCore.allocate / discover record identities).
EVENTS = [e for e in Event if e is not Event.ALLOCATE and e not in DISCOVERS.values()]
#: Events that undo progress; `advance` picks them less often so runs get deep.
SETBACKS = frozenset({Event.FREE, Event.EVICT, Event.INVALIDATE, Event.WRITE_FAIL,
                      Event.COMPRESS_FAIL, Event.SPILL_FAIL, Event.RESTORE_FAIL})
#: States the fuzzer moved blocks into, to show (and test) that runs reach deep.
REACHED: set[str] = set()


class RefBlock:
    """What the reference knows about one block."""

    def __init__(self) -> None:
        self.state = "free"
        self.pins = 0
        self.version = 0  # bumped where the spec says bump_epoch
        self.data: bytes | None = None  # bytes written, once complete
        self.pending: bytearray | None = None  # bytes being written
        self.sub: set[int] = set()
        #: Offsets of the host copy with a byte flipped (a second flip of one puts it back).
        self.host_flips: set[int] = set()
        #: Restoring from a stored tier: what the data path loaded since restore_begin.
        self.loaded: str | None = None
        self.key = 0
        self.refs: list[tuple[int, int]] = []  # (target block, target version) for indexes


class RefGroup:
    def __init__(self, name: str, lifecycle: Lifecycle, kind: GroupKind, n_blocks: int,
                 capacity: dict[Tier, int], sub_blocks: int, payload: int) -> None:
        self.name = name
        self.lifecycle = lifecycle
        self.kind = kind
        self.blocks = [RefBlock() for _ in range(n_blocks)]
        self.capacity = capacity
        self.sub_blocks = sub_blocks
        self.payload = payload
        self.rows = {(r.source, r.event): r for r in lifecycle.rows}
        self.states = {s.name: s for s in lifecycle.states}

    def used(self, tier: Tier) -> int:
        return sum(tier in self.states[b.state].slots for b in self.blocks)

    def restoring(self) -> int:
        return sum(
            s.in_flight and s.residency not in (None, Tier.DEVICE) and Tier.DEVICE in s.slots
            for s in (self.states[b.state] for b in self.blocks))


class CoreMachine(RuleBasedStateMachine):
    """Drives one StateCore and one reference model with the same operations."""

    model: ClassVar[ModelDecl]

    @initialize()
    def build(self) -> None:
        config = CoreConfig(device_blocks=DEVICE, host_blocks=HOST, disk_blocks=DISK,
                            remote_blocks=REMOTE, max_restores_in_flight=MAX_RESTORES,
                            backend="numpy")
        self.core = StateCore(self.model, config)
        self.ref: dict[str, RefGroup] = {}
        for name, group in self.core.groups.items():
            self.ref[name] = RefGroup(
                name, group.table.lifecycle, group.decl.kind, group.n_blocks,
                {t: p.capacity for t, p in group.pools.items()} | group.stored,
                group.decl.sub_blocks or 0, group.decl.payload_bytes)
        self.next_key = 1

    # -- reference semantics ---------------------------------------------------------------

    def _guard(self, group: RefGroup, block: int, call: Any, demand: dict[Any, int]) -> bool:
        b = group.blocks[block]
        if call.name == "has_room":
            demand[call.tier] = demand.get(call.tier, 0) + 1
            return group.used(call.tier) + demand[call.tier] <= group.capacity.get(call.tier, 0)
        if call.name == "no_pins":
            return b.pins == 0
        if call.name == "admission_open":
            demand["restores"] = demand.get("restores", 0) + 1
            return group.restoring() + demand["restores"] <= MAX_RESTORES
        if call.name == "all_sub_blocks_present":
            return b.sub == set(range(group.sub_blocks or 1))
        if call.name == "checksum_ok":
            if group.states[b.state].residency in DISCOVERS:
                return b.loaded == "good"  # only a good load verifies
            return not b.host_flips
        if call.name == "targets_current":
            target = self.ref[self.core.group(group.name).decl.target_group or ""]
            return all(target.blocks[t].version == v and target.states[target.blocks[t].state]
                       .hashed for t, v in b.refs)
        raise AssertionError(call)

    def _expect(self, group: RefGroup, blocks: list[int], event: Event) -> bool:
        """Would the whole batch move (all-or-nothing)?"""
        demand: dict[Any, int] = {}
        for block in blocks:
            row = group.rows.get((group.blocks[block].state, event))
            if row is None:
                return False
            if not all(self._guard(group, block, call, demand) for call in row.guards):
                return False
        return True

    def _apply(self, group: RefGroup, blocks: list[int], event: Event) -> None:
        for block in blocks:
            b = group.blocks[block]
            row = group.rows[(b.state, event)]
            dest = group.states[row.dest]
            names = {c.name for c in row.effects}
            if "bump_epoch" in names:
                b.version += 1
            if "clear_sub_blocks" in names:
                b.sub = set()
            if event is Event.WRITE_DONE:
                b.data, b.pending = bytes(b.pending or b""), None
            if dest.content is Content.NONE:
                b.data, b.pending, b.refs = None, None, []
            if dest.residency is not Tier.HOST and Tier.HOST not in dest.slots:
                b.host_flips = set()
            b.loaded = None
            b.state = row.dest
            REACHED.add(f"{group.name}:{row.dest}")
            if "invalidate_dependents" in names:
                self._invalidate_dependents(group, block)

    def _invalidate_dependents(self, target: RefGroup, block: int) -> None:
        for name, group in self.ref.items():
            decl = self.core.group(name).decl
            if decl.kind is not GroupKind.SPARSE_INDEX or decl.target_group != target.name:
                continue
            for index, b in enumerate(group.blocks):
                if any(t == block for t, _ in b.refs) and self._expect(
                        group, [index], Event.INVALIDATE):
                    self._apply(group, [index], Event.INVALIDATE)

    # -- rules -----------------------------------------------------------------------------

    def _group(self, data: st.DataObject) -> RefGroup:
        return self.ref[data.draw(st.sampled_from(sorted(self.ref)), label="group")]

    @staticmethod
    def _block(data: st.DataObject, group: RefGroup, fits: Any) -> int:
        """Mostly a block for which the operation makes sense, sometimes any block."""
        good = [i for i, b in enumerate(group.blocks) if fits(group.states[b.state])]
        if good and data.draw(st.integers(0, 9), label="bias"):
            return data.draw(st.sampled_from(good), label="block")
        return data.draw(st.integers(0, len(group.blocks) - 1), label="block")

    @rule(data=st.data(), count=st.integers(1, 3))
    def allocate(self, data: st.DataObject, count: int) -> None:
        group = self._group(data)
        free = [i for i, b in enumerate(group.blocks) if b.state == "free"]
        room = group.capacity[Tier.DEVICE] - group.used(Tier.DEVICE)
        keys = list(range(self.next_key, self.next_key + count))
        self.next_key += count
        words = np.array([[k, k * 7919] for k in keys], dtype=np.uint64)
        if count > room or count > len(free):
            with pytest.raises(KvfsmError):
                self.core.allocate(group.name, np.arange(count), words[:, 0], words[:, 1])
            return
        ids = self.core.allocate(group.name, np.arange(count), words[:, 0], words[:, 1])
        assert len(set(ids.tolist())) == count
        for block, (high, low) in zip(ids.tolist(), words.tolist(), strict=True):
            assert group.blocks[block].state == "free"
            b = group.blocks[block]
            b.key = join_words(high, low)
            b.state = "allocated"
            b.sub = set()
            REACHED.add(f"{group.name}:allocated")

    @rule(data=st.data(), count=st.integers(1, 2))
    def discover(self, data: st.DataObject, count: int) -> None:
        """Copies found in a stored tier become blocks there, all or none."""
        group = self._group(data)
        tier = data.draw(st.sampled_from(sorted(DISCOVERS)), label="tier")
        row = group.rows.get(("free", DISCOVERS[tier]))
        free = [i for i, b in enumerate(group.blocks) if b.state == "free"]
        keys = list(range(self.next_key, self.next_key + count))
        self.next_key += count
        words = np.array([[k, k * 7919] for k in keys], dtype=np.uint64)
        if row is None or count > len(free) or \
                group.used(tier) + count > group.capacity.get(tier, 0):
            before = self.core.group(group.name).states.copy()
            with pytest.raises(KvfsmError):
                self.core.discover(group.name, np.arange(count), words[:, 0], words[:, 1], tier)
            assert np.array_equal(self.core.group(group.name).states, before)
            return
        ids = self.core.discover(group.name, np.arange(count), words[:, 0], words[:, 1], tier)
        for block, (high, low) in zip(ids.tolist(), words.tolist(), strict=True):
            b = group.blocks[block]
            assert b.state == "free"
            b.key = join_words(high, low)
            b.state, b.version = row.dest, b.version + 1
            b.sub = set(range(group.sub_blocks or 1))
            b.data = np.random.default_rng(block).integers(
                0, 256, group.payload, np.uint8).tobytes()
            REACHED.add(f"{group.name}:{row.dest}")

    def _load(self, group: RefGroup, block: int, good: bool) -> None:
        """Play the data path: the block's stored copy arrives in its device slot."""
        b = group.blocks[block]
        content = np.frombuffer(b.data or bytes(group.payload), dtype=np.uint8)
        arrived = content.copy()
        if not good:
            arrived[0] ^= 1
        self.core.record_loaded(group.name, [block], [xxhash.xxh3_64_intdigest(content)],
                                arrived[None])
        b.loaded = "good" if good else "bad"

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        group = self._group(data)
        loading = [i for i, b in enumerate(group.blocks)
                   if self.core.group(group.name).table.loading[
                       self.core.group(group.name).table.state_id(b.state)]]
        if not loading:
            block = data.draw(st.integers(0, len(group.blocks) - 1), label="block")
            with pytest.raises(KvfsmError):
                self.core.record_loaded(group.name, [block], [0])
            return
        block = data.draw(st.sampled_from(loading), label="loading block")
        self._load(group, block, data.draw(st.integers(0, 5), label="good load") > 0)

    @rule(data=st.data())
    def fire(self, data: st.DataObject) -> None:
        group = self._group(data)
        # Mostly events some block can take, so runs go deep into the lifecycle.
        possible = sorted({e for b in group.blocks for e in EVENTS if (b.state, e) in group.rows})
        choices = possible if possible and data.draw(st.integers(0, 9), label="bias") else EVENTS
        event = data.draw(st.sampled_from(choices), label="event")
        able = [i for i, b in enumerate(group.blocks) if (b.state, event) in group.rows]
        pool = able if able and data.draw(st.integers(0, 9)) else list(range(len(group.blocks)))
        blocks = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        self._fire_checked(group, blocks, event)

    def _fire_checked(self, group: RefGroup, blocks: list[int], event: Event) -> None:
        before = self.core.group(group.name).states.copy()
        if self._expect(group, blocks, event):
            self.core.fire(group.name, blocks, event)
            self._apply(group, blocks, event)
        else:
            with pytest.raises(TransitionError):
                self.core.fire(group.name, blocks, event)
            assert np.array_equal(self.core.group(group.name).states, before)

    def _advance(self, data: st.DataObject, group: RefGroup | None = None,
                 block: int | None = None) -> None:
        """One block one step further along a row of its lifecycle (writing first if needed);
        a random live block of a random group unless given."""
        if group is None or block is None:
            group = self._group(data)
            live = [i for i, b in enumerate(group.blocks) if b.state != "free"]
            if not live:
                self.allocate(data, 1)
                return
            block = data.draw(st.sampled_from(live), label="live block")
        b = group.blocks[block]
        events = [e for e in EVENTS if (b.state, e) in group.rows]
        if not events:
            return
        onward = [e for e in events if e not in SETBACKS]
        if onward and data.draw(st.integers(0, 2), label="onward"):
            events = onward
        event = data.draw(st.sampled_from(events), label="event")
        if event is Event.RESTORE_DONE and group.states[b.state].residency in DISCOVERS and \
                data.draw(st.integers(0, 4), label="load first"):
            self._load(group, block, good=True)
        if event is Event.WRITE_DONE and data.draw(st.integers(0, 4), label="write first"):
            payload = np.random.default_rng(block).integers(0, 256, group.payload, np.uint8)
            self.core.write(group.name, [block], payload[None])
            b.pending = bytearray(payload.tobytes())
            b.sub = set(range(group.sub_blocks or 1))
        self._fire_checked(group, [block], event)

    # Three rules drive the lifecycle forward, so runs reach spill, restore and compression.
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        self._advance(data)

    @rule(data=st.data())
    def advance_more(self, data: st.DataObject) -> None:
        self._advance(data)

    @rule(data=st.data())
    def advance_further(self, data: st.DataObject) -> None:
        self._advance(data)

    @rule(data=st.data(), steps=st.integers(2, 8))
    def tour(self, data: st.DataObject, steps: int) -> None:
        """One live block several steps along its lifecycle at once, so states several rows
        deep (a host copy spilling on to disk, a restore from host) are reached within a
        short run whatever the other draws were."""
        group = self._group(data)
        live = [i for i, b in enumerate(group.blocks) if b.state != "free"]
        if not live:
            return
        block = data.draw(st.sampled_from(live), label="touring block")
        for _ in range(steps):
            if group.blocks[block].state == "free":
                return
            self._advance(data, group, block)

    @rule(data=st.data(), event=st.sampled_from([Event.SPILL_BEGIN, Event.RESTORE_BEGIN]))
    def move_tier(self, data: st.DataObject, event: Event) -> None:
        """Begin a spill or a restore of a block that has one: with stored tiers a host copy
        can go down (disk) or back up (device), so each direction gets its own chance."""
        group = self._group(data)
        able = [i for i, b in enumerate(group.blocks) if (b.state, event) in group.rows]
        if not able:
            return
        block = data.draw(st.sampled_from(able), label="moving block")
        self._fire_checked(group, [block], event)

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        group = self._group(data)
        block = self._block(data, group, lambda s: s.content is Content.PARTIAL)
        b = group.blocks[block]
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        rng = np.random.default_rng(seed)
        writing = group.states[b.state].content is Content.PARTIAL
        if group.kind is GroupKind.COMPRESSED and data.draw(st.booleans(), label="sub"):
            part = data.draw(st.integers(0, group.sub_blocks - 1), label="part")
            width = -(-group.payload // group.sub_blocks)
            start, stop = part * width, min((part + 1) * width, group.payload)
            chunk = rng.integers(0, 256, stop - start, dtype=np.uint8)
            if not writing:
                with pytest.raises(KvfsmError):
                    self.core.write(group.name, [block], chunk[None], sub_block=part)
                return
            self.core.write(group.name, [block], chunk[None], sub_block=part)
            pending = b.pending or bytearray(group.payload)
            pending[start:stop] = chunk.tobytes()
            b.pending = pending
            b.sub.add(part)
            return
        payload = rng.integers(0, 256, group.payload, dtype=np.uint8)
        if not writing:
            with pytest.raises(KvfsmError):
                self.core.write(group.name, [block], payload[None])
            return
        self.core.write(group.name, [block], payload[None])
        b.pending = bytearray(payload.tobytes())
        b.sub = set(range(group.sub_blocks or 1))

    @precondition(lambda self: any(
        self.core.group(g).target is not None for g in self.core.groups))
    @rule(data=st.data())
    def set_refs(self, data: st.DataObject) -> None:
        name = next(g for g in sorted(self.core.groups) if self.core.group(g).target is not None)
        group, core_group = self.ref[name], self.core.group(name)
        target = self.ref[core_group.decl.target_group or ""]
        block = self._block(data, group, lambda s: s.content is Content.PARTIAL)
        top_k = core_group.refs_target.shape[1]
        targets = data.draw(st.lists(st.integers(0, len(target.blocks) - 1), max_size=top_k,
                                     unique=True), label="targets")
        row = np.full((1, top_k), -1, dtype=np.int32)
        row[0, : len(targets)] = targets
        if group.states[group.blocks[block].state].content is not Content.PARTIAL:
            with pytest.raises(KvfsmError):
                self.core.set_index_refs(name, [block], row)
            return
        self.core.set_index_refs(name, [block], row)
        group.blocks[block].refs = [(t, target.blocks[t].version) for t in targets]

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        group = self._group(data)
        block = self._block(data, group, lambda s: s.readable)
        b = group.blocks[block]
        decl = self.core.group(group.name).decl
        target = self.ref.get(decl.target_group or "")
        ok = group.states[b.state].readable and (target is None or all(
            target.states[target.blocks[t].state].readable for t, _ in b.refs))
        if not ok:
            with pytest.raises(KvfsmError):
                self.core.pin(group.name, [block])
            return
        self.core.pin(group.name, [block])
        b.pins += 1
        if target is not None:
            for t, _ in b.refs:
                target.blocks[t].pins += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        group = self._group(data)
        pinned = [i for i, b in enumerate(group.blocks) if b.pins]
        if not pinned:
            return
        block = data.draw(st.sampled_from(pinned), label="block")
        self.core.unpin(group.name, [block])
        group.blocks[block].pins -= 1
        decl = self.core.group(group.name).decl
        if decl.target_group:
            for t, _ in group.blocks[block].refs:
                self.ref[decl.target_group].blocks[t].pins -= 1

    @rule(data=st.data())
    def corrupt_host_copy(self, data: st.DataObject) -> None:
        """A fault on the physical line: one byte of a spilled block's host copy flips (the
        same byte flipped twice is intact again: found by a long run, seed 51277)."""
        group = self._group(data)
        spilled = [i for i, b in enumerate(group.blocks) if b.state == "host"]
        if not spilled:
            return
        block = data.draw(st.sampled_from(spilled), label="block")
        core_group = self.core.group(group.name)
        pool = core_group.pools[Tier.HOST]
        slot = int(core_group.slot[Tier.HOST][block])
        offset = data.draw(st.integers(0, group.payload - 1), label="offset")
        pool.data[slot, offset] ^= 0xFF
        group.blocks[block].host_flips ^= {offset}

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def agrees_with_reference(self) -> None:
        if not hasattr(self, "core"):
            return
        assert self.core.check_invariants() == []
        for name, group in self.ref.items():
            core_group = self.core.group(name)
            states = [core_group.table.state_name(int(s)) for s in core_group.states]
            assert states == [b.state for b in group.blocks], name
            assert core_group.pins.tolist() == [b.pins for b in group.blocks], name
            # A block's key finds it exactly while the spec says it is hashed; keys are distinct
            # per allocation, so the map holds nothing else and other keys find nothing.
            hashed = [group.states[b.state].hashed for b in group.blocks]
            expected = [block if hashed[block] else -1 for block in range(len(hashed))]
            found = self.core.lookup_hash(name, [b.key for b in group.blocks]).tolist()
            assert found == expected, (name, found, expected)
            assert len(core_group.hash_map) == sum(hashed), name
            for block, b in enumerate(group.blocks):
                if group.states[b.state].readable:
                    got = self.core.read(name, [block])[0].tobytes()
                    assert got == b.data, f"{name} block {block} read back other bytes"


class DeepseekCore(CoreMachine):
    model = shipped_models()["deepseek_v4_like"]


class QwenNextCore(CoreMachine):
    model = shipped_models()["qwen3_next_like"]


class GptOssCore(CoreMachine):
    model = shipped_models()["gpt_oss_like"]


#: The fuzz budget follows the loaded Hypothesis profile (``settings.default`` once conftest
#: or ``CI=true`` has loaded it): FUZZ_SCALE times its ``max_examples``, its
#: ``stateful_step_count`` and everything else it sets (the ``ci`` profile's derandomize). The
#: default and ``ci`` profiles (100 examples, 50 steps) give the CI budget the issue asks for,
#: 200 examples of 50 steps; ``HYPOTHESIS_PROFILE=long`` gives 10,000 of 100; a smaller profile
#: gives a shorter run.
FUZZ_SCALE = 2
FUZZ = settings(
    settings.default,
    max_examples=FUZZ_SCALE * settings.default.max_examples,
    deadline=None,
    suppress_health_check=sorted(
        {*settings.default.suppress_health_check, HealthCheck.too_slow,
         HealthCheck.filter_too_much}, key=lambda check: check.value),
)


def test_deepseek_core_agrees_with_reference() -> None:
    run_state_machine_as_test(DeepseekCore, settings=FUZZ)


def test_qwen_next_core_agrees_with_reference() -> None:
    run_state_machine_as_test(QwenNextCore, settings=FUZZ)


def test_gpt_oss_core_agrees_with_reference() -> None:
    half = settings(FUZZ, max_examples=FUZZ.max_examples // 2)
    run_state_machine_as_test(GptOssCore, settings=half)


def missing_states() -> set[str]:
    """The DeepSeek model's states (those its pools allow) a derandomized fuzz run never
    reached."""
    REACHED.clear()
    # Derandomized so the coverage claim is a fixed fact, not a coin toss.
    run_state_machine_as_test(DeepseekCore, settings=settings(
        FUZZ, max_examples=300, database=None, derandomize=True))
    core = StateCore(DeepseekCore.model, CoreConfig(
        device_blocks=DEVICE, host_blocks=HOST, disk_blocks=DISK, remote_blocks=REMOTE,
        backend="numpy"))
    return {
        f"{name}:{state}"
        for name, group in core.groups.items()
        for state in group.table.lifecycle.state_names
        # A tier the group has neither a pool nor stored copies in is unreachable by design.
        if not set(group.table.lifecycle.state(state).slots) - set(group.pools)
        - set(group.stored)
    } - REACHED - {f"{name}:free" for name in core.groups}


def test_fuzzing_reaches_every_state_of_the_deepseek_model() -> None:
    """The rules are biased enough that spill, restore, compression and invalidation happen.

    Run in a fresh interpreter, derandomized, so the claim is a fixed fact. Runs of 300
    examples once missed one or two states several rows deep on some paths (which path the
    derandomized run took moved with unrelated changes); the ``tour`` rule walks one block
    several rows at once, and random seeds 0-4 then each reached every state."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c",
         "from tests.test_state_fuzz import missing_states; print(sorted(missing_states()))"],
        cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
