"""Leases under threads: evictors, spillers, compressors and restorers race readers that loop
lookup -> lease -> validate -> read the bytes -> validate again -> compare with what was
committed -> release. No read whose second validate passed may return other bytes, no thread
may hang, the core's invariants hold after every run and no lease stays open. Two forced
interleavings show the race is real: a reader without the lease's pins reads another block's
bytes, and validate names the block whose epoch moved.

Iterations per reader: ``KVFSM_RACE_ITERATIONS`` (default 150, 500 under ``CI=true``); the
file stays within ~40 s on a 2-core machine under CI.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, KvfsmError, LeaseLost, Prompt, shipped_models
from kvfsm.spec import Event, Tier
from kvfsm.state import GroupState, StateError
from tests.lookup_models import tokens

#: Readers' iterations each (an env knob for longer runs).
ITERATIONS = int(os.environ.get("KVFSM_RACE_ITERATIONS",
                                "500" if os.environ.get("CI") == "true" else "150"))
READERS = 3
#: Seconds a thread may take to finish once told to stop before the run counts as a deadlock.
JOIN_S = 60.0
#: Thread switches every this many seconds while racing (CPython's default is 5 ms): many
#: more interleavings per iteration.
SWITCH_S = 1e-5
#: The evictor's and spiller's pause between rounds: long enough that readers find whole
#: prefixes (a recurrent group keeps one snapshot per prompt), short enough to hit many of
#: their leases.
MUTATOR_PAUSE_S = 5e-4
#: Lease ttl of the reader that abandons its leases (a reader that died).
ABANDONED_TTL_S = 0.05
#: The shared first tokens of every prompt, and how many prompts.
SHARED, PROMPTS = 128, 4


def _texts() -> list[NDArray[np.int64]]:
    head = tokens(SHARED, seed=99)
    return [np.concatenate([head, tokens(321 - SHARED, seed=s)]) for s in range(PROMPTS)]


def _content(prompt: Prompt, group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
    """The bytes committed for ``prompt``'s blocks ``index`` of ``group``: the blocks' own
    hash words, repeated (so a block of another prompt never has the same bytes)."""
    high, low = prompt.words(group.decl.block_size)
    words = np.stack([high[index], low[index]], axis=1).astype(np.uint64)
    pair = words.view(np.uint8).reshape(index.size, 16)
    width = group.decl.payload_bytes
    return np.tile(pair, (1, -(-width // 16)))[:, :width]


def _payload(prompt: Prompt) -> Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]:
    return lambda group, index: _content(prompt, group, index)


@attrs.define
class Tally:
    """What one race saw (counts summed over its threads)."""

    #: Reads of at least one block, and leases of nothing (no usable prefix then).
    reads: int = 0
    empty: int = 0
    #: Reads whose second validate passed but whose bytes were not the committed ones.
    changed_reads: int = 0
    #: Reads whose second validate failed (pins held: must not happen).
    lost_after_read: int = 0
    #: Leases refused because a block changed between the lookup and the lease.
    lost_before: int = 0
    #: Leases taken in one step with their lookup (``lookup_and_lease``: never refused so).
    one_step: int = 0
    evicted: int = 0
    #: Evictions, invalidations and spill completions the guards refused on pinned blocks.
    refused_pinned: int = 0
    spilled: int = 0
    compressed: int = 0
    restored: int = 0
    committed: int = 0
    abandoned: int = 0
    errors: list[str] = attrs.field(factory=list)

    def add(self, **counts: int) -> None:
        with _TALLY_LOCK:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


_TALLY_LOCK = threading.Lock()


@contextlib.contextmanager
def _fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _engine(model: str) -> Engine:
    # Small pools: readers' prompts do not all fit, so every mutator has work. Pin chunks of
    # 4 ids: leases of runs pin by chunks here too, against every mutator.
    return Engine(shipped_models()[model], CoreConfig(
        device_blocks=64, host_blocks=16, per_group={"history": {"device": 10, "host": 6}}
        if model == "deepseek_v4_like" else {}, backend="numpy", pin_chunk_blocks=4))


class Race:
    """The threads of one race over one engine and its prompts."""

    def __init__(self, eng: Engine, seed: int) -> None:
        self.eng = eng
        self.core = eng.core
        self.texts = _texts()
        self.stop = threading.Event()
        self.tally = Tally()
        self.seed = seed

    def prompts(self) -> list[Prompt]:
        """Each thread's own prompt objects (a prompt caches its words lazily)."""
        return [self.eng.prompt(text) for text in self.texts]

    def guarded(self, body: Callable[[np.random.Generator], None], seed: int
                ) -> Callable[[], None]:
        def run() -> None:
            rng = np.random.default_rng(seed)
            try:
                body(rng)
            except Exception as exc:  # reported by the test, never lost in a thread
                self.tally.errors.append(f"{body.__name__}: {type(exc).__name__}: {exc}")
                self.stop.set()

        return run

    # -- readers ---------------------------------------------------------------------------

    def reader(self, rng: np.random.Generator) -> None:
        prompts = self.prompts()
        for _ in range(ITERATIONS):
            if self.stop.is_set():
                return
            prompt = prompts[int(rng.integers(len(prompts)))]
            if rng.random() < 0.5:
                # Lookup and lease as one step: nothing can change between them.
                _, lease = self.eng.lookup_and_lease(prompt)
                self.tally.add(one_step=1)
            else:
                verdict = self.eng.lookup(prompt)
                try:
                    lease = self.eng.lease(verdict, prompt)
                except LeaseLost:
                    self.tally.add(lost_before=1)
                    continue
            with lease:
                lease.validate()
                reads = [(name, self.core.read(name, lease.blocks(name)))
                         for name in lease.groups if lease.blocks(name).size]
                try:
                    lease.validate()
                except LeaseLost:
                    self.tally.add(lost_after_read=1)
                    continue
                for name, data in reads:
                    expected = _content(prompt, self.core.group(name), lease.indices(name))
                    if not np.array_equal(data, expected):
                        self.tally.add(changed_reads=1)
                self.tally.add(reads=int(bool(reads)), empty=int(not reads))

    def abandoner(self, rng: np.random.Generator) -> None:
        """A reader that dies holding its leases: their ttl frees the blocks."""
        prompts = self.prompts()
        while not self.stop.is_set():
            prompt = prompts[int(rng.integers(len(prompts)))]
            with contextlib.suppress(LeaseLost):
                self.eng.lease(self.eng.lookup(prompt), prompt, ttl_s=ABANDONED_TTL_S)
                self.tally.add(abandoned=1)
            time.sleep(ABANDONED_TTL_S / 2)

    # -- mutators ----------------------------------------------------------------------------

    def evictor(self, rng: np.random.Generator) -> None:
        """Evicts or invalidates random readable blocks, pinned or not (the guards must refuse
        pinned ones), frees invalid ones, and evicts host copies."""
        names = sorted(self.core.groups)
        while not self.stop.is_set():
            name = names[int(rng.integers(len(names)))]
            with self.eng.lock:
                group = self.core.group(name)
                live = np.flatnonzero(group.table.readable[group.states])
                if live.size:
                    chosen = rng.choice(live, size=min(2, live.size), replace=False)
                    event = Event.EVICT if rng.random() < 0.7 else Event.INVALIDATE
                    pinned = group.pins[chosen] > 0
                    moved = self.core.fire(name, chosen, event, masked=True)
                    self.tally.add(evicted=int(moved.sum()),
                                   refused_pinned=int((pinned & ~moved).sum()))
                self.core.fire(name, self.core.reclaimable(name), Event.FREE, masked=True)
                self.core.fire(name, self.core.blocks_in(name, "host")[:1], Event.EVICT,
                               masked=True)
            time.sleep(MUTATOR_PAUSE_S)

    def spiller(self, rng: np.random.Generator) -> None:
        """Spills device blocks to host: the least recently used unpinned one through
        ``give_back``, and a leased one (pinned) whose ``spill_done`` must wait for its
        readers (then ``spill_fail`` puts it back)."""
        names = sorted(self.core.groups)
        while not self.stop.is_set():
            name = names[int(rng.integers(len(names)))]
            self.tally.add(spilled=self.eng.give_back(name, 1))
            with self.eng.lock:
                group = self.core.group(name)
                leased = np.flatnonzero(group.table.readable[group.states] & (group.pins > 0)
                                        & group.event_row(Event.SPILL_BEGIN)[group.states])
                if leased.size:
                    chosen = rng.choice(leased, size=1)
                    began = chosen[self.core.fire(name, chosen, Event.SPILL_BEGIN, masked=True)]
                    pinned = group.pins[began] > 0
                    done = self.core.fire(name, began, Event.SPILL_DONE, masked=True)
                    self.core.fire(name, began[~done], Event.SPILL_FAIL)
                    self.tally.add(spilled=int(done.sum()),
                                   refused_pinned=int((pinned & ~done).sum()))
            time.sleep(MUTATOR_PAUSE_S)

    def compressor(self, rng: np.random.Generator) -> None:
        """Writes a prompt's missing history blocks raw, begins compressing them, lets the
        readers run, then finishes (a masked ``compress_done``: pinned blocks wait)."""
        prompts = self.prompts()
        history = self.core.groups.get("history")
        if history is None:
            return
        while not self.stop.is_set():
            prompt = prompts[int(rng.integers(len(prompts)))]
            with self.eng.lock:
                high, low = prompt.words(history.decl.block_size)
                known = self.core.lookup_words("history", high, low)
                missing = np.flatnonzero(known < 0)
                self.eng.give_back("history",
                                   max(missing.size - history.pools[Tier.DEVICE].free, 0),
                                   known[known >= 0])
                if missing.size and missing.size <= history.pools[Tier.DEVICE].free:
                    ids = self.core.allocate("history", missing, high[missing], low[missing])
                    self.core.fire("history", ids, Event.WRITE_BEGIN)
                    self.core.write("history", ids, _content(prompt, history, missing))
                    self.core.fire("history", ids, Event.WRITE_DONE)
                    self.core.fire("history", ids, Event.COMPRESS_BEGIN)
            time.sleep(0)  # readers run while it compresses
            with self.eng.lock:
                busy = self.core.blocks_in("history", "compressing")
                done = self.core.fire("history", busy, Event.COMPRESS_DONE, masked=True)
                self.tally.add(compressed=int(done.sum()))

    def restorer(self, rng: np.random.Generator) -> None:
        """Restores spilled prompts from host (the verdict's plan) and commits prompts again
        where nothing can be restored; a commit without room is refused whole."""
        prompts = self.prompts()
        while not self.stop.is_set():
            prompt = prompts[int(rng.integers(len(prompts)))]
            verdict = self.eng.lookup(prompt)
            if verdict.plan:
                ticket = self.eng.restore(verdict, prompt)
                self.tally.add(restored=sum(len(ids) for ids in ticket.immediate.values()))
            elif verdict.usable_tokens < verdict.prompt_tokens - 1:
                with contextlib.suppress(StateError):
                    self.eng.commit(prompt, payload=_payload(prompt))
                    self.tally.add(committed=1)
            time.sleep(0)

    def run(self) -> Tally:
        for prompt in self.prompts():
            with contextlib.suppress(StateError):
                self.eng.commit(prompt, payload=_payload(prompt))
        mutators = [self.evictor, self.spiller, self.compressor, self.restorer, self.abandoner]
        readers = [threading.Thread(target=self.guarded(self.reader, self.seed + i),
                                    name=f"reader-{i}") for i in range(READERS)]
        others = [threading.Thread(target=self.guarded(body, self.seed + 100 + i),
                                   name=body.__name__) for i, body in enumerate(mutators)]
        with _fast_switching():
            for thread in [*others, *readers]:
                thread.start()
            for thread in readers:
                thread.join(JOIN_S)
            self.stop.set()
            for thread in others:
                thread.join(JOIN_S)
        stuck = [thread.name for thread in [*readers, *others] if thread.is_alive()]
        assert not stuck, f"threads still running (a deadlock): {stuck}"
        return self.tally


@pytest.mark.parametrize("model", ["deepseek_v4_like", "qwen3_next_like", "gpt_oss_like"])
def test_readers_holding_leases_never_read_changed_blocks(model: str) -> None:
    """Whatever the mutators do between a reader's checks, a read whose second validate
    passed returned exactly the bytes committed for those positions; with pins held no
    validate fails after the read; nothing deadlocks; invariants hold; no lease stays open
    (an abandoned one is released once its ttl ran out, at the engine's next call)."""
    eng = _engine(model)
    tally = Race(eng, seed=sum(map(ord, model))).run()
    assert not tally.errors, tally.errors
    assert tally.changed_reads == 0, tally
    assert tally.lost_after_read == 0, tally
    assert tally.reads > 0 and tally.evicted > 0 and tally.spilled > 0, tally
    assert tally.one_step > 0, tally
    assert tally.restored + tally.committed > 0, tally
    if model == "deepseek_v4_like":
        assert tally.compressed > 0, tally
    time.sleep(ABANDONED_TTL_S * 2)
    assert eng.leases_open == 0
    assert all(int(group.pins.sum()) == 0 for group in eng.core.groups.values())
    eng.core.assert_invariants()
    eng.close()


# -- forced interleavings: the race is real, and the gate is what closes it ---------------------


class Interleaving:
    """A reader thread and a mutator thread taking turns on events: the reader checks, the
    mutator evicts every block of the reader's prompt and commits another prompt (the freed
    ids are reused first), then the reader reads."""

    def __init__(self, model: str) -> None:
        self.eng = _engine(model)
        self.texts = _texts()
        first = self.eng.prompt(self.texts[0])
        self.eng.commit(first, payload=_payload(first))
        self.checked = threading.Event()
        self.mutated = threading.Event()

    def mutate(self) -> None:
        try:
            assert self.checked.wait(JOIN_S)
            eng = self.eng
            with eng.lock:
                for name, group in eng.core.groups.items():
                    live = np.flatnonzero(group.table.readable[group.states])
                    eng.core.fire(name, live, Event.EVICT, masked=True)
                other = eng.prompt(self.texts[1])
                with contextlib.suppress(KvfsmError):
                    eng.commit(other, payload=_payload(other))
        finally:
            self.mutated.set()

    def run(self, reader: Callable[[], None]) -> None:
        errors: list[BaseException] = []

        def read() -> None:
            try:
                reader()
            except BaseException as exc:  # re-raised below, on the test's thread
                errors.append(exc)
            finally:
                self.checked.set()  # never leave the mutator waiting

        threads = [threading.Thread(target=read), threading.Thread(target=self.mutate)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in threads)
        if errors:
            raise errors[0]


def _read_all(eng: Engine, prompt: Prompt, blocks: dict[str, tuple[NDArray[np.intp],
              NDArray[np.int64]]]) -> tuple[bool, bool]:
    """(every block still readable, every read returned the committed bytes)."""
    readable, same = True, True
    for name, (ids, index) in blocks.items():
        try:
            data = eng.core.read(name, ids)
        except StateError:
            readable = False
            continue
        same &= bool(np.array_equal(data, _content(prompt, eng.core.group(name), index)))
    return readable, same


@pytest.mark.parametrize("model", ["dense", "deepseek_v4_like"])
def test_a_reader_without_a_lease_reads_changed_blocks(model: str) -> None:
    """Check, then read with nothing held: between the two the blocks were evicted and their
    ids reused by another prompt, so the read returns other bytes or fails (the race leases
    close)."""
    race = Interleaving(model)
    prompt = race.eng.prompt(race.texts[0])
    seen: dict[str, object] = {}

    def reader() -> None:
        with race.eng.lease(race.eng.lookup(prompt), prompt) as lease:
            blocks = {name: (lease.blocks(name), lease.indices(name)) for name in lease.groups}
        race.checked.set()  # released: the kernel reads with nothing held
        assert race.mutated.wait(JOIN_S)
        seen["read"] = _read_all(race.eng, prompt, blocks)

    race.run(reader)
    readable, same = seen["read"]  # type: ignore[misc]
    assert not (readable and same), "the unguarded read saw the committed bytes"


@pytest.mark.parametrize("model", ["dense", "deepseek_v4_like"])
def test_a_reader_holding_a_lease_reads_what_it_checked(model: str) -> None:
    """The same interleaving with the lease held across the read: the mutator's evictions
    are refused, validate passes after it, and the bytes are the committed ones."""
    race = Interleaving(model)
    prompt = race.eng.prompt(race.texts[0])
    seen: dict[str, object] = {}

    def reader() -> None:
        with race.eng.lease(race.eng.lookup(prompt), prompt) as lease:
            lease.validate()
            race.checked.set()
            assert race.mutated.wait(JOIN_S)
            lease.validate()
            blocks = {name: (lease.blocks(name), lease.indices(name)) for name in lease.groups}
            seen["read"] = _read_all(race.eng, prompt, blocks)
            seen["tokens"] = lease.tokens

    race.run(reader)
    assert seen["read"] == (True, True)
    assert seen["tokens"] == 320
    race.eng.core.assert_invariants()
    assert race.eng.leases_open == 0


@pytest.mark.parametrize("model", ["dense", "deepseek_v4_like"])
def test_validate_catches_the_change_when_pins_are_bypassed(model: str) -> None:
    """A caller that unpins the lease's blocks behind its back: the mutator's evictions go
    through, and the second validate names a block whose epoch moved, so the stale bytes are
    never used."""
    race = Interleaving(model)
    prompt = race.eng.prompt(race.texts[0])
    seen: dict[str, object] = {}

    def reader() -> None:
        with race.eng.lease(race.eng.lookup(prompt), prompt) as lease:
            with race.eng.lock:
                for name in lease.groups:
                    # The pins of the blocks alone, their own and their chunks', bypassed.
                    state, ids = race.eng.core.group(name), lease.blocks(name)
                    state._blocks.pins[ids] = 0
                    state._blocks.chunk_pins[ids >> state.pin_shift] = 0
            race.checked.set()
            assert race.mutated.wait(JOIN_S)
            try:
                lease.validate()
            except LeaseLost as lost:
                seen["lost"] = lost

    race.run(reader)
    lost = seen.get("lost")
    assert isinstance(lost, LeaseLost), "validate passed over evicted blocks"
    assert lost.group is not None and lost.block is not None
    assert lost.old_epoch != lost.new_epoch
    assert race.eng.leases_open == 0
    race.eng.core.assert_invariants()
