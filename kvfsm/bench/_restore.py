"""``kvfsm bench restore``: restores from disk, remote and host into the device pool, against raw
reads of the same bytes, all measured in one run.

* **disk**: a model of one ``full_kv`` group whose blocks hold ``block_bytes`` each, every block
  spilled to a :class:`DiskTier` (files in page cache: each read once first), then, timed, the
  data path of the engine: ``restore`` -> ``ticket.wait()`` until every block is back on the
  device (``device_disk``), each copy read by ``workers`` threads straight into its device slot
  and its header and xxh3 checksum verified there. The verdict whose plan it runs is taken by
  ``lookup`` just before the clock starts (``kvfsm bench lookup`` measures lookups). Untimed
  between runs: the blocks are evicted back to disk. The baseline is a plain single-threaded
  loop of ``os.open`` + ``os.readv`` of the same files into a preallocated
  ``[blocks, file bytes]`` array, no checks. ``DiskTier.load_into`` of all blocks on one
  thread, no engine around it, is reported too (``disk_tier_*``, against raw reads in a
  second alternation of its own): what the tier costs apart from the executor.
* **remote**: the same blocks put into a Mooncake Store by a writer client that holds the
  segment, restored by an engine whose remote tier is a second client (discovered by the
  lookup, fetched over the transfer engine, verified), against a loop of ``client.get(key)``
  on that second client (and, stricter, ``client.get_into`` of each value into a preallocated
  array: ``raw_remote_into_gbps``). Without Mooncake, a Redis server (``RedisTier``, ``GET``);
  without either, the remote figures are null and ``remote_skipped`` says why.
* **host**: blocks spilled to the host pool restored by ``restore_begin`` / ``restore_done``
  alone (a copy inside ``fire`` and the ``checksum_ok`` guard's re-hash), for reference.

Rates count payload bytes only (headers excluded, for kvfsm and baseline alike) in GB/s
(1e9 bytes/s). Each figure is the best of ``repeat`` runs, the kvfsm path and its baseline
alternating, so a noisy machine disturbs both alike and the least disturbed run of each counts.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import attrs
import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.bench._timing import Progress, ProgressFn
from kvfsm.lookup import Verdict
from kvfsm.restore import GroupOutcome, RestoreTicket
from kvfsm.spec import Event, ModelDecl, Tier, parse_model
from kvfsm.state import CoreConfig, Prompt
from kvfsm.tiers import HEADER_BYTES, DiskTier, LoadResult, StoredTier, TierError

#: The bench model's only group, and the tokens one block covers.
GROUP = "attn"
BLOCK_TOKENS = 16
#: One block is ``[token, kv, head, dim]`` float16: block_bytes = 64 * heads * head_dim.
_BYTES_PER_HEAD_DIM = BLOCK_TOKENS * 2 * 2
_HEAD_DIM = 128
#: Which remote stores the bench may measure, in the order ``auto`` tries them.
REMOTE_STORES = ("mooncake", "redis")

Figures = dict[str, float | int | str | bool | None]


def restore_model(block_bytes: int) -> ModelDecl:
    """The shipped ``dense`` model's group (``full_kv``, block-first K/V layout) with as many
    KV heads as make a block of ``block_bytes`` bytes (a multiple of 64)."""
    if block_bytes < _BYTES_PER_HEAD_DIM or block_bytes % _BYTES_PER_HEAD_DIM:
        raise KvfsmError(f"bench restore: block bytes must be a positive multiple of "
                         f"{_BYTES_PER_HEAD_DIM} (16 tokens of float16 K and V), got {block_bytes}")
    per_token = block_bytes // _BYTES_PER_HEAD_DIM
    heads, dim = ((per_token // _HEAD_DIM, _HEAD_DIM) if per_token % _HEAD_DIM == 0
                  else (1, per_token))
    return parse_model(f"""
[model]
name = "dense_restore_bench"
description = "The dense model with {block_bytes}-byte blocks, for kvfsm bench restore."
layout_version = 1

[[groups]]
name = "{GROUP}"
kind = "full"
lifecycle = "full_kv"
block_size = {BLOCK_TOKENS}
shape = [{BLOCK_TOKENS}, 2, {heads}, {dim}]
dtype = "float16"

[groups.layout]
dim_order = ["block", "token", "kv", "head", "dim"]
alignment = 256
padding = 0
""", source="<kvfsm.bench.restore>")


def bench_restore(
    *,
    blocks: int = 64,
    block_bytes: int = 1 << 20,
    workers: int = 2,
    repeat: int = 40,
    remote: str = "auto",
    progress: ProgressFn | None = None,
) -> Figures:
    """Restore throughput from disk, remote and host into the device pool, and the disk and
    remote ratios to raw single-threaded reads of the same bytes (see the module docstring).
    ``remote``: ``auto`` (Mooncake, else Redis), ``mooncake``, ``redis`` or ``none``.
    ``progress`` takes a line per phase and, on long measurements, run counts."""
    if min(blocks, workers, repeat) < 1:
        raise KvfsmError(f"bench restore: blocks, workers and repeat must be >= 1, got "
                         f"{blocks}, {workers}, {repeat}")
    if remote not in ("auto", "none", *REMOTE_STORES):
        raise KvfsmError(f"bench restore: remote must be auto, none or one of "
                         f"{list(REMOTE_STORES)}, got {remote!r}")
    model = restore_model(block_bytes)
    report = Progress("bench restore", progress)
    payload = np.random.default_rng(0).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    tokens = np.arange(blocks * BLOCK_TOKENS + 1)  # every block complete, one token to compute
    figures: Figures = {
        "model": model.name,
        "blocks": blocks,
        "block_bytes": block_bytes,
        "payload_mib": blocks * block_bytes / (1 << 20),
        "workers": workers,
        "raw_threads": 1,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "load_average_1m": _load_average(),
    }
    figures |= _disk_phase(model, payload, tokens, workers, repeat, report)
    figures |= _remote_phase(model, payload, tokens, workers, repeat, remote, report)
    figures |= _host_phase(model, payload, tokens, repeat, report)
    return figures


# -- timing ---------------------------------------------------------------------------------------

def _nothing() -> None:
    pass


@attrs.frozen
class Measured:
    """A measured path: ``timed`` is clocked; ``prepare`` runs untimed right before it (what
    must be fresh when the clock starts), ``reset`` untimed right after."""

    timed: Callable[[], None]
    reset: Callable[[], None] = _nothing
    prepare: Callable[[], None] = _nothing


def best_seconds(paths: Sequence[Measured], *, repeat: int,
                 on_run: Callable[[int, int], None] | None = None) -> list[float]:
    """The least wall time of each path's ``timed()`` over ``repeat`` rounds after one untimed
    round; in each round the paths run one after another, so a disturbance hits them alike."""
    for path in paths:
        path.prepare()
        path.timed()
        path.reset()
    best = [float("inf")] * len(paths)
    for done in range(1, repeat + 1):
        for i, path in enumerate(paths):
            path.prepare()
            start = time.perf_counter()
            path.timed()
            took = time.perf_counter() - start
            path.reset()
            best[i] = min(best[i], took)
        if on_run is not None:
            on_run(done, repeat)
    return best


def _load_average() -> float | None:
    """The 1-minute load average when the bench starts (how busy the machine was), if known."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- the engine side ------------------------------------------------------------------------------


def _commit(engine: Engine, prompt: Prompt, payload: NDArray[np.uint8]) -> None:
    """Cache every block of ``prompt`` on the device, block ``i`` holding ``payload[i]``."""
    engine.commit(prompt, payload=lambda _group, index: payload[index])
    _expect(engine, ("device",), payload.shape[0], "after the commit")


def _expect(engine: Engine, states: Sequence[str], count: int, when: str) -> None:
    found = engine.core.blocks_in(GROUP, states).size
    if found != count:
        raise KvfsmError(f"bench restore: {when}, {found} of {count} blocks are "
                         f"{' or '.join(states)}")


class _Restores:
    """The timed data path of one phase: ``restore`` -> ``wait`` of every block of ``prompt``
    (its verdict looked up before the clock starts), then (untimed) a check that each block
    landed in ``landed``, verified, and ``back()`` to where it came from."""

    def __init__(self, engine: Engine, prompt: Prompt, payload: NDArray[np.uint8], what: str,
                 landed: str, back: Callable[[], None], *, stored: bool = True) -> None:
        self.engine = engine
        self.stored = stored
        self.prompt = prompt
        self.payload = payload
        self.what = what
        self.landed = landed
        self.back = back
        self.ticket: RestoreTicket | None = None
        self.verdict: Verdict | None = None
        self.outcome: dict[str, GroupOutcome] = {}
        #: Least blocks restored and verified by one run (every run checked), -1 before any.
        self.verified = -1
        self.bytes_checked = False

    def prepare(self) -> None:
        """The verdict whose plan the timed run executes, taken just before the clock starts,
        as a scheduler looks a request up and then restores what it found (the lookup has its
        own bench, ``kvfsm bench lookup``)."""
        self.verdict = self.engine.lookup(self.prompt)

    def timed(self) -> None:
        if self.verdict is None:
            raise KvfsmError(f"bench restore: {self.what}: no verdict prepared")
        self.ticket = self.engine.restore(self.verdict, self.prompt)
        self.outcome = dict(self.ticket.wait())
        self.verdict = None

    @property
    def measured(self) -> Measured:
        return Measured(self.timed, self.reset, self.prepare)

    def reset(self) -> None:
        """Check what the run restored, then move the blocks back (untimed). A block counts as
        verified when ``restore_done`` took it (its ``checksum_ok`` guard passed: bytes hashed
        in the slot by the loader, or re-hashed there) and, for a stored tier, its load said
        OK (header, key, length and payload checksum verified)."""
        blocks = self.payload.shape[0]
        core = self.engine.core
        ids = core.blocks_in(GROUP, self.landed)
        outcome = self.outcome.get(GROUP)
        restored = len(outcome.restored) if outcome is not None else 0
        statuses = dict(outcome.statuses) if outcome is not None else {}
        verified = min(restored, statuses.get("OK", 0)) if self.stored else restored
        if ids.size != blocks or verified != blocks:
            notes = self.ticket.notes[:3] if self.ticket is not None else ()
            raise KvfsmError(f"bench restore: {self.what}: {restored} of {blocks} blocks "
                             f"restored, {ids.size} {self.landed}, {verified} verified "
                             f"(load statuses {statuses}; {list(notes)})")
        if not self.bytes_checked:  # once: the bytes that landed are the ones committed
            positions = core.group(GROUP).position[ids]
            if not np.array_equal(core.read(GROUP, ids), self.payload[positions]):
                raise KvfsmError(f"bench restore: {self.what}: restored bytes differ from "
                                 "the committed ones")
            self.bytes_checked = True
        self.verified = verified if self.verified < 0 else min(self.verified, verified)
        self.back()


def _disk_phase(model: ModelDecl, payload: NDArray[np.uint8], tokens: NDArray[np.int64],
                workers: int, repeat: int, report: Progress) -> Figures:
    blocks, width = payload.shape
    report.phase(f"disk: spilling {blocks} blocks of {width} bytes to a disk tier")
    with tempfile.TemporaryDirectory(prefix="kvfsm-bench-restore-") as root, ExitStack() as stack:
        disk = DiskTier(root, capacity_bytes=2 * blocks * (HEADER_BYTES + width), fsync=False)
        engine = Engine(model, CoreConfig(device_blocks=blocks, host_blocks=blocks,
                                          disk_blocks=blocks, backend="numpy"),
                        tiers={"disk": disk}, workers=workers)
        stack.callback(engine.close)
        prompt = engine.prompt(tokens)
        _commit(engine, prompt, payload)
        engine.give_back(GROUP, blocks)  # device -> host (a copy inside fire)
        engine.spill_down(GROUP, Tier.HOST, blocks)  # host -> disk files, through the tier
        _expect(engine, ("disk",), blocks, "after spilling to disk")
        core = engine.core

        def evict() -> None:
            core.fire(GROUP, core.blocks_in(GROUP, "device_disk"), Event.EVICT)

        restores = _Restores(engine, prompt, payload, "disk", "device_disk", evict)
        # The baseline: the same files (by block position), read whole into one preallocated
        # array, one file after another on this thread.
        keys = sorted(disk.keys(), key=lambda key: key.token_start)
        files = [os.path.join(root, key.name + ".kvb") for key in keys]
        raw = np.zeros((blocks, HEADER_BYTES + width), dtype=np.uint8)
        views = [memoryview(row) for row in raw]

        def raw_read() -> None:
            for path, view in zip(files, views, strict=True):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.readv(fd, [view])
                finally:
                    os.close(fd)

        raw_read()  # page cache warm: every file read once
        # The spill wrote without fsync: flush those dirty pages now, or the kernel's
        # writeback would compete with the timed runs.
        if hasattr(os, "sync"):
            os.sync()
        if not np.array_equal(raw[:, HEADER_BYTES:], payload):
            raise KvfsmError("bench restore: disk: the files do not hold the committed bytes")
        # The tier alone, for reference: ``DiskTier.load_into`` of every block on this thread
        # (open, one readv into the row, header and checksum verified), no engine around it.
        rows = list(np.zeros((blocks, width), dtype=np.uint8))
        loaded: list[LoadResult] = []

        def tier_read() -> None:
            loaded.append(disk.load_into(keys, rows))

        def tier_check() -> None:
            if not loaded.pop().ok.all():
                raise KvfsmError("bench restore: disk: the tier failed to load a block")

        report.phase(f"disk: restores with {workers} worker(s) vs raw reads")
        # Each comparison alternates only its own two paths: a third path touching another
        # 64 MiB between them would leave each run of the first with colder caches.
        kvfsm_s, raw_s = best_seconds([restores.measured, Measured(raw_read)],
                                      repeat=repeat, on_run=report.runs("disk"))
        report.phase("disk: the tier alone, one thread, vs raw reads")
        tier_s, tier_raw_s = best_seconds([Measured(tier_read, tier_check), Measured(raw_read)],
                                          repeat=repeat, on_run=report.runs("disk tier"))
    nbytes = blocks * width
    return {
        "disk_gbps": _gbps(nbytes, kvfsm_s),
        "raw_disk_gbps": _gbps(nbytes, raw_s),
        "disk_ratio": raw_s / kvfsm_s,
        "disk_restore_ms": kvfsm_s * 1e3,
        "raw_disk_ms": raw_s * 1e3,
        "disk_tier_gbps": _gbps(nbytes, tier_s),
        "disk_tier_ratio": tier_raw_s / tier_s,
        "disk_verified_blocks": restores.verified,
    }


def _host_phase(model: ModelDecl, payload: NDArray[np.uint8], tokens: NDArray[np.int64],
                repeat: int, report: Progress) -> Figures:
    blocks, width = payload.shape
    report.phase(f"host: restores of {blocks} blocks")
    engine = Engine(model, CoreConfig(device_blocks=blocks, host_blocks=blocks,
                                      backend="numpy"))
    try:
        prompt = engine.prompt(tokens)
        _commit(engine, prompt, payload)

        def spill() -> None:
            engine.give_back(GROUP, blocks)  # device -> host

        spill()
        _expect(engine, ("host",), blocks, "after spilling to host")
        restores = _Restores(engine, prompt, payload, "host", "device", spill, stored=False)
        (host_s,) = best_seconds([restores.measured], repeat=repeat,
                                 on_run=report.runs("host"))
    finally:
        engine.close()
    return {
        "host_gbps": _gbps(blocks * width, host_s),
        "host_restore_ms": host_s * 1e3,
        "host_verified_blocks": restores.verified,
    }


# -- remote stores --------------------------------------------------------------------------------


class _Store:
    """A remote store to measure: who puts the values, the tier the engine restores from, and
    that tier's own raw client ``get``."""

    def __init__(self, name: str, path: str, writer: StoredTier, reader: StoredTier,
                 prefix: str, get: Callable[[str], Any],
                 get_into: Callable[[str, int, int], int] | None = None) -> None:
        self.name = name
        self.path = path
        self.writer = writer
        self.reader = reader
        self.prefix = prefix
        self.get = get
        #: ``(key, address, size) -> bytes read``: a zero-copy read, where the client has one.
        self.get_into = get_into


def _open_store(name: str, stack: ExitStack, nbytes: int) -> _Store:
    """Start ``name``'s server on loopback and connect to it, closing all on ``stack``; a
    TierError says why it cannot run here (not installed, no binary, no answer)."""
    from kvfsm.tiers import MooncakeMaster, MooncakeTier, RedisServer, RedisTier

    if name == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except (ImportError, OSError) as exc:
            raise TierError(f"the Mooncake client does not import ({exc})") from exc
        master = MooncakeMaster()
        stack.callback(master.stop)
        master.start()
        # The writer's segment holds every value (with room for the store's own overhead);
        # the reader mounts none, so every value it reads crosses the transfer engine.
        writer = MooncakeTier(master.address, global_segment_bytes=2 * nbytes + (32 << 20),
                              lease_s=master.lease_s)
        stack.callback(writer.close)
        reader = MooncakeTier(master.address, global_segment_bytes=0, lease_s=master.lease_s)
        stack.callback(reader.close)
        return _Store(name, "a second Mooncake client, no segment of its own, reading the "
                      "writer's segment over TCP on loopback", writer, reader, reader.prefix,
                      reader.client.get, reader.client.get_into)
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        raise TierError(f"the redis client does not import ({exc})") from exc
    server = RedisServer()
    stack.callback(server.stop)
    server.start()
    tier = RedisTier(server.address)
    stack.callback(tier.close)
    return _Store(name, "one Redis client over TCP on loopback (MGET for kvfsm, GET raw)",
                  tier, tier, tier.prefix, tier.client.get)


def _no_remote(why: str) -> Figures:
    return {"remote_store": None, "remote_path": None, "remote_skipped": why,
            "remote_gbps": None, "raw_remote_gbps": None, "remote_ratio": None,
            "raw_remote_into_gbps": None, "remote_ratio_vs_into": None,
            "remote_restore_ms": None, "raw_remote_ms": None, "remote_verified_blocks": None}


def _remote_phase(model: ModelDecl, payload: NDArray[np.uint8], tokens: NDArray[np.int64],
                  workers: int, repeat: int, remote: str, report: Progress) -> Figures:
    if remote == "none":
        return _no_remote("not asked for (remote: none)")
    reasons = []
    for name in REMOTE_STORES if remote == "auto" else (remote,):
        with ExitStack() as stack:
            report.phase(f"remote: starting {name}")
            try:
                store = _open_store(name, stack, payload.nbytes + payload.shape[0] * HEADER_BYTES)
            except TierError as exc:
                reasons.append(f"{name}: {' '.join(str(exc).split())}")
                report.phase(f"remote: {name} unavailable ({reasons[-1]})")
                continue
            return _remote_measure(store, model, payload, tokens, workers, repeat, report)
    return _no_remote("; ".join(reasons))


def _remote_measure(store: _Store, model: ModelDecl, payload: NDArray[np.uint8],
                    tokens: NDArray[np.int64], workers: int, repeat: int,
                    report: Progress) -> Figures:
    blocks, width = payload.shape
    engine = Engine(model, CoreConfig(device_blocks=blocks, remote_blocks=blocks,
                                      backend="numpy"),
                    tiers={"remote": store.reader}, workers=workers)
    try:
        prompt = engine.prompt(tokens)
        high, low = prompt.words(BLOCK_TOKENS)
        keys = engine.restorer.keys.prompt_keys(GROUP, high, low, np.arange(blocks))
        sums = np.array([xxhash.xxh3_64_intdigest(row) for row in payload], dtype=np.uint64)
        report.phase(f"remote ({store.name}): putting {blocks} blocks")
        stored = store.writer.put(keys, list(payload), sums)
        if not stored.all():
            raise KvfsmError(f"bench restore: {store.name} took {int(stored.sum())} of "
                             f"{blocks} values")
        names = [store.prefix + key.name for key in keys]
        get = store.get
        for name, row in zip(names, payload, strict=True):  # the values are the blocks
            value = get(name)
            if value is None or bytes(value)[HEADER_BYTES:] != row.tobytes():
                raise KvfsmError(f"bench restore: {store.name} returned another value "
                                 f"for {name}")

        def raw_get() -> None:
            for name in names:
                get(name)

        paths: list[Measured] = [Measured(raw_get)]
        get_into = store.get_into
        if get_into is not None:
            # A stricter baseline beside the asked-for one: the same values read one by one
            # into a preallocated array (no bytes object made per value), as on disk.
            value_bytes = HEADER_BYTES + width
            into = np.zeros((blocks, value_bytes), dtype=np.uint8)
            addresses = [int(row.ctypes.data) for row in into]

            def raw_get_into() -> None:
                for name, address in zip(names, addresses, strict=True):
                    get_into(name, address, value_bytes)

            raw_get_into()
            if not np.array_equal(into[:, HEADER_BYTES:], payload):
                raise KvfsmError(f"bench restore: {store.name}: get_into read other bytes")
            paths.append(Measured(raw_get_into))

        core = engine.core

        def evict() -> None:
            core.fire(GROUP, core.blocks_in(GROUP, "device_remote"), Event.EVICT)

        # The first (untimed) lookup discovers the values; every later one finds them known.
        restores = _Restores(engine, prompt, payload, f"remote ({store.name})",
                             "device_remote", evict)
        report.phase(f"remote ({store.name}): restores with {workers} worker(s) vs raw gets")
        kvfsm_s, raw_s, *into_s = best_seconds(
            [restores.measured, *paths], repeat=repeat,
            on_run=report.runs(f"remote ({store.name})"))
    finally:
        engine.close()
    nbytes = blocks * width
    return {
        "remote_store": store.name,
        "remote_path": store.path,
        "remote_skipped": None,
        "remote_gbps": _gbps(nbytes, kvfsm_s),
        "raw_remote_gbps": _gbps(nbytes, raw_s),
        "remote_ratio": raw_s / kvfsm_s,
        "raw_remote_into_gbps": _gbps(nbytes, into_s[0]) if into_s else None,
        "remote_ratio_vs_into": into_s[0] / kvfsm_s if into_s else None,
        "remote_restore_ms": kvfsm_s * 1e3,
        "raw_remote_ms": raw_s * 1e3,
        "remote_verified_blocks": restores.verified,
    }


# -- the human table ------------------------------------------------------------------------------


def restore_table(figures: Mapping[str, object]) -> list[str]:
    """A few lines for a person: one row per path, the rates and ratios, what was measured."""

    def num(key: str) -> str:
        value = figures.get(key)
        return f"{value:,.3f}" if isinstance(value, float) else "-"

    remote = figures.get("remote_store")
    lines = [
        f"bench restore: {figures['blocks']} blocks x {figures['block_bytes']:,} bytes "
        f"({figures['payload_mib']:,.1f} MiB of payload), kvfsm with {figures['workers']} "
        f"worker thread(s), raw reads on {figures['raw_threads']}",
        f"{'path':26s} {'GB/s':>9s} {'raw GB/s':>9s} {'ratio':>7s}",
        f"{'disk -> device pool':26s} {num('disk_gbps'):>9s} {num('raw_disk_gbps'):>9s} "
        f"{num('disk_ratio'):>7s}",
        f"{'  disk tier alone, 1 thread':26s} {num('disk_tier_gbps'):>9s} "
        f"{num('raw_disk_gbps'):>9s} {num('disk_tier_ratio'):>7s}",
        f"{'remote -> device pool':26s} {num('remote_gbps'):>9s} {num('raw_remote_gbps'):>9s} "
        f"{num('remote_ratio'):>7s}",
        f"{'  vs get_into, not get':26s} {num('remote_gbps'):>9s} "
        f"{num('raw_remote_into_gbps'):>9s} {num('remote_ratio_vs_into'):>7s}",
        f"{'host -> device pool':26s} {num('host_gbps'):>9s} {'-':>9s} {'-':>7s}",
    ]
    if remote is None:
        lines.append(f"remote: not measured: {figures.get('remote_skipped')}")
    else:
        lines.append(f"remote: {remote}: {figures.get('remote_path')}")
    lines.append(f"verified blocks per run: disk {figures['disk_verified_blocks']}, remote "
                 f"{figures['remote_verified_blocks'] if remote is not None else '-'}, host "
                 f"{figures['host_verified_blocks']} (of {figures['blocks']})")
    return lines
