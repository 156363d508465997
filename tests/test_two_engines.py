"""Two engines sharing one store, in separate processes, and the remote tier's faults as an
engine sees them.

Engine A runs in its own process (``tests/engine_worker.py``): it commits a prompt with known
bytes per block and pushes it down host -> disk -> remote into a Mooncake Store or a Redis
server. Engine B, here, mounts only the remote tier, finds the prefix by hash, restores it and
reads A's exact bytes back. Then the faults: another model or layout is never served, a value of
another identity under B's key is FOREIGN, the store dies and comes back, a key vanishes between
lookup and restore, a read outlives its lease, and Redis evicts under ``maxmemory``. In every
case the promise holds: a hit is never taken for a usable block, nothing raises, and the core's
invariants hold. Servers are started per module on 127.0.0.1 (skipped where a binary or client
is missing, except under ``CI=true``, where that fails).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import xxhash

from kvfsm import CoreConfig, Engine
from kvfsm.lookup import Verdict
from kvfsm.restore import GroupOutcome
from kvfsm.spec import Layout, ModelDecl, shipped_models
from kvfsm.state import GroupState
from kvfsm.tiers import (
    MooncakeMaster,
    MooncakeTier,
    RedisServer,
    RedisTier,
    StoredTier,
)
from kvfsm.tiers._servers import _die_with_parent
from tests.engine_worker import GROUP, block_content, token_ids
from tests.line_worker import LineWorker
from tests.remote_servers import (
    Clock,
    start_mooncake_master,
    start_redis_server,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "engine_worker.py"
SEGMENT = 64 << 20
BLOCKS = 5
#: Seconds to wait for one answer of the worker (a put into a dead master can take seconds).
ANSWER_TIMEOUT_S = 60.0
#: Each test's prompts start at a token range of their own, so tests sharing a store never
#: share keys.
_STARTS = itertools.count(10_000, 10_000)


@dataclass
class Store:
    """Engine B's remote tier on one store, and the raw client beside it."""

    name: str
    address: str
    tier: StoredTier
    clock: Clock
    fetch: Callable[[str], bytes | None]
    plant: Callable[[str, bytes], None]
    drop: Callable[[str], None]
    exists: Callable[[str], bool]


# -- servers and tiers -----------------------------------------------------------------------------


def _mooncake_store(server: MooncakeMaster) -> Store:
    clock = Clock()
    tier = MooncakeTier(server.address, global_segment_bytes=SEGMENT,
                        local_buffer_bytes=16 << 20, lease_s=server.lease_s, clock=clock)
    client = tier.client

    def plant(name: str, data: bytes) -> None:
        assert client.upsert(name, data) == 0

    def fetch(name: str) -> bytes | None:
        return client.get(name) or None

    return Store("mooncake", server.address, tier, clock, fetch, plant,
                 lambda name: client.remove(name, True),  # forced: past any read lease
                 lambda name: client.is_exist(name) == 1)


def _redis_store(server: RedisServer) -> Store:
    clock = Clock()
    tier = RedisTier(server.address, clock=clock)
    client = tier.client
    return Store("redis", server.address, tier, clock, client.get,
                 lambda name, data: client.set(name, data), client.delete,
                 lambda name: client.exists(name) == 1)


@pytest.fixture(scope="module")
def mooncake_store(master: MooncakeMaster) -> Iterator[Store]:
    store = _mooncake_store(master)
    yield store
    store.tier.close()


@pytest.fixture(scope="module")
def redis_store(redis_server: RedisServer) -> Iterator[Store]:
    store = _redis_store(redis_server)
    yield store
    store.tier.close()


@pytest.fixture(params=["mooncake", "redis"])
def store(request: pytest.FixtureRequest) -> Store:
    chosen: Store = request.getfixturevalue(f"{request.param}_store")
    chosen.clock.step = 0.0
    return chosen


# -- engine A, in its own process ------------------------------------------------------------------


class Worker(LineWorker):
    """``tests/engine_worker.py`` in a subprocess; always ended by ``close()`` (or the
    context manager), killed if it does not exit by itself."""

    def __init__(self, backend: str, address: str, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(
            [sys.executable, str(WORKER), "--backend", backend, "--address", address,
             "--disk", str(workdir / "disk"), "--segment-bytes", str(SEGMENT)],
            workdir / "worker.log", cwd=ROOT, timeout_s=ANSWER_TIMEOUT_S,
            preexec_fn=_die_with_parent)
        assert self.ready.get("ready") is True, self.ready

    def spill(self, start: int, blocks: int = BLOCKS, seed: int = 1) -> dict[str, Any]:
        """A commits ``token_ids(start, blocks)`` and pushes it down to the remote tier."""
        done = self.ask(op="spill", start=start, blocks=blocks, seed=seed)
        assert done.get("invariants") == [], done
        return done

    def spill_until_remote(self, start: int, blocks: int = BLOCKS, seed: int = 1,
                           within_s: float = 30.0) -> dict[str, Any]:
        """``spill`` again until the store takes every block (a restarted store refuses puts
        for a moment)."""
        deadline = time.monotonic() + within_s
        while True:
            done = self.spill(start, blocks, seed)
            if done["states"] == ["remote"] * blocks:
                return done
            assert time.monotonic() < deadline, f"the store never took A's blocks: {done}"
            time.sleep(0.2)


# -- engine B, here --------------------------------------------------------------------------------


@contextmanager
def engine_b(tier: StoredTier, model: ModelDecl | str = "dense") -> Iterator[Engine]:
    """An engine with only the remote tier (no host, no disk)."""
    config = CoreConfig(device_blocks=32, host_blocks=0, disk_blocks=0, remote_blocks=32,
                        backend="numpy")
    engine = Engine(model, config, tiers={"remote": tier})
    try:
        yield engine
        assert engine.core.check_invariants() == []
    finally:
        engine.close()


def block_ids(engine: Engine, start: int, blocks: int = BLOCKS) -> np.ndarray[Any, Any]:
    """B's block ids of the prompt's first ``blocks`` blocks (-1 where it knows none)."""
    prompt = engine.prompt(token_ids(start, blocks))
    size = engine.model.group(GROUP).block_size
    ids: np.ndarray[Any, Any] = engine.core.lookup_words(GROUP, *prompt.words(size))[:blocks]
    return ids


def states(engine: Engine, ids: Iterable[int]) -> list[str]:
    return [engine.core.describe(GROUP, int(i)).state for i in ids]


def sums_of(engine: Engine, ids: Any) -> list[int]:
    return [xxhash.xxh3_64_intdigest(row) for row in engine.core.read(GROUP, ids)]


def restore(engine: Engine, start: int, blocks: int = BLOCKS) -> tuple[Verdict, GroupOutcome]:
    """Look the prompt up, start its restores and wait for them: (verdict, outcome)."""
    prompt = engine.prompt(token_ids(start, blocks))
    verdict = engine.lookup(prompt)
    outcome = engine.restore(verdict, prompt).wait(timeout=ANSWER_TIMEOUT_S)
    return verdict, outcome.get(GROUP, GroupOutcome(GROUP))


def usable(engine: Engine, start: int, blocks: int = BLOCKS) -> int:
    return engine.lookup(engine.prompt(token_ids(start, blocks))).usable_tokens


def writes(content: Callable[[Any, int], Any]) -> Callable[[GroupState, Any], Any]:
    """A commit payload: ``content(positions, width)`` for the blocks being written."""
    return lambda group, index: content(index, group.decl.payload_bytes)


# -- 1. two engines, one store ---------------------------------------------------------------------


def test_two_engines_share_one_store(store: Store, tmp_path: Path) -> None:
    start = next(_STARTS)
    with Worker(store.name, store.address, tmp_path) as a, engine_b(store.tier) as b:
        done = a.spill(start, seed=11)
        assert done["states"] == ["remote"] * BLOCKS, done
        assert all(store.exists(name) for name in done["keys"])
        size = done["block_size"]
        prompt = b.prompt(token_ids(start, BLOCKS))
        verdict = b.lookup(prompt)  # found by hash in the store: a hit, not yet usable
        assert verdict.hit_tokens == verdict.restorable_tokens == BLOCKS * size
        assert verdict.usable_tokens == 0
        ids = block_ids(b, start)
        assert states(b, ids) == ["remote"] * BLOCKS
        outcome = b.restore(verdict, prompt).wait(timeout=ANSWER_TIMEOUT_S)[GROUP]
        assert sorted(outcome.restored) == sorted(ids.tolist())
        assert outcome.statuses == {"OK": BLOCKS}
        assert outcome.failed == outcome.lost == outcome.pending == ()
        assert outcome.bytes_loaded == BLOCKS * b.model.group(GROUP).payload_bytes
        assert usable(b, start) == BLOCKS * size
        assert states(b, ids) == ["device_remote"] * BLOCKS  # the store's copy is kept
        # Exactly A's bytes: the checksums A read back from its own core, and the content.
        assert sums_of(b, ids) == done["sums"]
        width = b.model.group(GROUP).payload_bytes
        assert np.array_equal(b.core.read(GROUP, ids), block_content(11, range(BLOCKS), width))
        assert b.core.check_invariants() == []


# -- 2. another model or layout is never served ----------------------------------------------------


def test_another_model_or_layout_finds_nothing(store: Store, tmp_path: Path) -> None:
    start = next(_STARTS)
    dense = shipped_models()["dense"]
    decl = dense.group(GROUP)
    with Worker(store.name, store.address, tmp_path) as a:
        done = a.spill(start, seed=12)
        assert done["states"] == ["remote"] * BLOCKS
        # A model differing only in its name: another cache namespace, so other hashes and
        # keys. A tiny model of another architecture with a full_kv group of the same block
        # size finds nothing either.
        for model in (attrs.evolve(dense, name="other"), "tiny_qwen3_next"):
            with engine_b(store.tier, model) as b:
                verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
                assert verdict.hit_tokens == verdict.restorable_tokens == 0, verdict
                assert not verdict.plan
        # The same model writing another layout: other keys (the layout is part of them).
        for layout in (attrs.evolve(decl.layout, alignment=512),
                       attrs.evolve(decl.layout, padding=64),
                       Layout(("block", "kv", "token", "head", "dim"), 256, 0)):
            with engine_b(store.tier) as b:
                b.core.set_write_layout(GROUP, layout)
                verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
                assert verdict.hit_tokens == verdict.restorable_tokens == 0, (layout, verdict)
        # Control: the same model and layout does find it (so the copies were there).
        with engine_b(store.tier) as b:
            verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
            assert verdict.restorable_tokens == BLOCKS * done["block_size"]


def test_a_value_of_another_identity_is_foreign(store: Store, tmp_path: Path) -> None:
    """A's whole, self-consistent values planted under the keys of an engine of another model
    (same tokens): B finds them by key, loads them, and refuses every one (FOREIGN)."""
    start = next(_STARTS)
    other = attrs.evolve(shipped_models()["dense"], name="other")
    with Worker(store.name, store.address, tmp_path) as a, engine_b(store.tier, other) as b:
        done = a.spill(start, seed=13)
        assert done["states"] == ["remote"] * BLOCKS
        size = done["block_size"]
        prompt = b.prompt(token_ids(start, BLOCKS))
        high, low = prompt.words(size)
        keys = b.restorer.keys.prompt_keys(GROUP, high, low, range(BLOCKS))
        prefix: str = getattr(store.tier, "prefix", "")
        for mine, theirs in zip(keys, done["keys"], strict=True):
            value = store.fetch(theirs)
            assert value is not None
            store.plant(prefix + mine.name, value)
        verdict = b.lookup(prompt)
        assert verdict.restorable_tokens == BLOCKS * size and verdict.usable_tokens == 0
        ids = block_ids(b, start)
        outcome = b.restore(verdict, prompt).wait(timeout=ANSWER_TIMEOUT_S)[GROUP]
        assert outcome.statuses == {"FOREIGN": BLOCKS}
        assert outcome.restored == () and sorted(outcome.lost) == sorted(ids.tolist())
        assert outcome.bytes_loaded == 0
        assert states(b, ids) == ["free"] * BLOCKS  # forgotten (evict), never readable
        assert b.core.check_invariants() == []
        # The tier dropped the bad values (on Mooncake by a forced remove: the read's own lease
        # refuses any other), so the next lookup does not find them again.
        assert not any(store.exists(prefix + mine.name) for mine in keys)
        verdict = b.lookup(prompt)
        assert verdict.hit_tokens == verdict.usable_tokens == 0
        # B recomputes: its own content is cached and served, never A's.
        width = b.model.group(GROUP).payload_bytes
        mine_content = block_content(99, range(BLOCKS), width)
        b.commit(prompt, payload=writes(lambda index, w: block_content(99, index, w)))
        assert usable(b, start) == BLOCKS * size
        assert np.array_equal(b.core.read(GROUP, block_ids(b, start)), mine_content)


# -- 3. the store killed and restarted mid-run -----------------------------------------------------


@pytest.mark.parametrize("backend", ["mooncake", "redis"])
def test_store_killed_then_restarted(backend: str, tmp_path: Path) -> None:
    """B has discovered A's blocks; the store dies before the loads: they fail (copy kept,
    ``restore_fail``) or are missing (forgotten, ``evict``), nothing is usable and nothing
    raises. Once it is back (having lost every value), the known blocks are MISSING; A spills
    again and B restores and reads A's bytes."""
    start = next(_STARTS)
    server = (start_mooncake_master() if backend == "mooncake" else start_redis_server())
    try:
        store = _mooncake_store(server) if isinstance(server, MooncakeMaster) else \
            _redis_store(server)
        try:
            with Worker(backend, server.address, tmp_path) as a, engine_b(store.tier) as b:
                done = a.spill(start, seed=14)
                assert done["states"] == ["remote"] * BLOCKS
                size = done["block_size"]
                verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
                assert verdict.restorable_tokens == BLOCKS * size
                ids = block_ids(b, start)
                server.kill()
                _, outcome = restore(b, start)
                assert set(outcome.statuses) <= {"FAILED", "MISSING"}, outcome
                assert outcome.restored == () and outcome.pending == ()
                assert sorted(outcome.failed + outcome.lost) == sorted(ids.tolist())
                # FAILED: restore_fail, the copy kept (still a hit); MISSING: forgotten.
                assert states(b, outcome.failed) == ["remote"] * len(outcome.failed)
                assert states(b, outcome.lost) == ["free"] * len(outcome.lost)
                assert b.core.check_invariants() == []
                verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))  # nothing raises
                assert verdict.usable_tokens == 0
                server.restart()
                # Back, but empty: while the client reconnects the loads still fail (copies
                # kept); then what B still knows is MISSING and forgotten. Never usable.
                deadline = time.monotonic() + 30.0
                while outcome.failed:
                    assert time.monotonic() < deadline, f"loads kept failing: {outcome}"
                    time.sleep(0.2)
                    _, outcome = restore(b, start)
                    assert set(outcome.statuses) <= {"FAILED", "MISSING"}, outcome
                    assert outcome.restored == ()
                    assert states(b, outcome.lost) == ["free"] * len(outcome.lost)
                    assert b.core.check_invariants() == []
                verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
                assert verdict.hit_tokens == verdict.usable_tokens == 0
                assert b.core.check_invariants() == []
                done = a.spill_until_remote(start, seed=14)
                _, outcome = restore(b, start)
                assert outcome.statuses == {"OK": BLOCKS}, outcome
                assert usable(b, start) == BLOCKS * size
                assert sums_of(b, block_ids(b, start)) == done["sums"]
        finally:
            store.tier.close()
    finally:
        server.stop()


# -- 4. a key evicted between lookup and restore ---------------------------------------------------


def test_key_evicted_between_lookup_and_restore(store: Store, tmp_path: Path) -> None:
    start, gone = next(_STARTS), 2
    with Worker(store.name, store.address, tmp_path) as a, engine_b(store.tier) as b:
        done = a.spill(start, seed=15)
        size = done["block_size"]
        prompt = b.prompt(token_ids(start, BLOCKS))
        verdict = b.lookup(prompt)
        assert verdict.restorable_tokens == BLOCKS * size
        ids = block_ids(b, start)
        store.drop(done["keys"][gone])
        assert not store.exists(done["keys"][gone])
        outcome = b.restore(verdict, prompt).wait(timeout=ANSWER_TIMEOUT_S)[GROUP]
        assert outcome.statuses == {"OK": BLOCKS - 1, "MISSING": 1}
        assert outcome.lost == (int(ids[gone]),) and outcome.failed == ()
        assert states(b, [ids[gone]]) == ["free"]
        assert b.core.check_invariants() == []
        verdict = b.lookup(prompt)
        assert verdict.usable_tokens == verdict.hit_tokens == gone * size
        assert sums_of(b, ids[:gone]) == done["sums"][:gone]


# -- 5. a read outliving its lease -----------------------------------------------------------------


def test_read_outliving_its_lease_is_late(store: Store, tmp_path: Path) -> None:
    start = next(_STARTS)
    with Worker(store.name, store.address, tmp_path) as a, engine_b(store.tier) as b:
        done = a.spill(start, seed=16)
        size = done["block_size"]
        # The clock jumps past the lease between the start and the end of every read.
        store.clock.step = getattr(store.tier, "lease_s") + 1.0  # noqa: B009
        try:
            verdict, outcome = restore(b, start)
        finally:
            store.clock.step = 0.0
        assert verdict.restorable_tokens == BLOCKS * size and verdict.usable_tokens == 0
        ids = block_ids(b, start)
        assert outcome.statuses == {"LATE": BLOCKS}
        assert sorted(outcome.failed) == sorted(ids.tolist())
        assert outcome.restored == outcome.lost == ()
        assert states(b, ids) == ["remote"] * BLOCKS  # restore_fail: the copy is kept
        verdict = b.lookup(b.prompt(token_ids(start, BLOCKS)))
        assert verdict.hit_tokens == verdict.restorable_tokens == BLOCKS * size
        assert verdict.usable_tokens == 0
        assert b.core.check_invariants() == []
        _, outcome = restore(b, start)  # a sane clock: the retry succeeds
        assert outcome.statuses == {"OK": BLOCKS}
        assert usable(b, start) == BLOCKS * size
        assert sums_of(b, ids) == done["sums"]


# -- 6. Redis evicting under maxmemory -------------------------------------------------------------


@pytest.mark.parametrize("policy", ["volatile-ttl", "allkeys-lru"])
def test_redis_evictions_under_maxmemory(redis_server: RedisServer, policy: str,
                                         tmp_path: Path) -> None:
    """A spills a prompt, then a second one into a Redis server capped just above the first:
    the server evicts to make room. B restores the first prompt up to its first evicted block
    and recomputes from there. With ``volatile-ttl`` the test decides which keys may go (A's
    blocks 4.. get a TTL) so the cut is in the middle; with ``allkeys-lru`` the server picks
    (approximately the oldest) and the same rule is checked wherever the cut falls."""
    start, blocks, seed = next(_STARTS), 8, 17
    server = start_redis_server(maxmemory="64mb", maxmemory_policy=policy)
    try:
        store = _redis_store(server)
        client = getattr(store.tier, "client")  # noqa: B009
        try:
            with Worker("redis", server.address, tmp_path) as a, engine_b(store.tier) as b:
                done = a.spill(start, blocks, seed)
                assert done["states"] == ["remote"] * blocks
                size, keys = done["block_size"], done["keys"]
                if policy == "volatile-ttl":
                    for at in range(4, blocks):  # evictable, the earliest block first
                        client.expire(keys[at], 3600 + at)
                used = int(client.info("memory")["used_memory"])
                client.config_set("maxmemory", used + (32 << 10))
                # A's second prompt does not fit: the server evicts what the policy lets it,
                # and refuses the puts it cannot make room for (A keeps going, consistent).
                more = a.spill(next(_STARTS), 24, seed + 1)
                stored = [name for name, state in zip(more["keys"], more["states"],
                                                      strict=True) if state == "remote"]
                present = [store.exists(name) for name in keys]
                evicted = present.count(False) + sum(not store.exists(n) for n in stored)
                assert evicted > 0, "the server should have evicted some of A's values"
                first = present.index(False) if False in present else blocks
                if policy == "volatile-ttl":
                    assert present[:4] == [True] * 4 and 4 <= first < blocks
                prompt = b.prompt(token_ids(start, blocks))
                verdict = b.lookup(prompt)
                # Only the run before the first evicted block is a hit.
                assert verdict.hit_tokens == verdict.restorable_tokens == first * size
                outcome = b.restore(verdict, prompt).wait(timeout=ANSWER_TIMEOUT_S).get(GROUP)
                if first:
                    assert outcome is not None and outcome.statuses == {"OK": first}
                else:
                    assert outcome is None  # nothing to restore
                assert b.lookup(prompt).usable_tokens == first * size
                ids = block_ids(b, start, blocks)
                assert sums_of(b, ids[:first]) == done["sums"][:first]
                # B recomputes from the first evicted block; the whole prompt is then usable.
                b.commit(prompt, payload=writes(lambda index, w: block_content(seed, index, w)))
                assert b.lookup(prompt).usable_tokens == blocks * size
                assert sums_of(b, block_ids(b, start, blocks)) == done["sums"]
        finally:
            store.tier.close()
    finally:
        server.stop()
