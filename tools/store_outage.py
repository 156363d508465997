"""A remote store that freezes, black-holes or dies under a serving load: what it costs the
calls that never touch it. Prints one JSON object.

Usage (from the repository root, so this checkout's kvfsm is imported)::

    python -m tools.store_outage [--store redis|mooncake|both] [--threads 4] [--frozen-s 5]
        [--blackhole-s 10] [--killed-s 3] [--no-kill] [--normal-s 5] [--hole drop|hold]

An engine (``dense`` by default) with a disk tier in a temporary directory and a remote tier
(Redis or Mooncake: a real server on 127.0.0.1 reached through ``tools/blackhole.py``'s proxy
from the start, each client with its default timeouts) serves ``--threads`` threads, each
running a random mix (``--mix``, in percent) of

* ``resident``: a lookup of a prompt whose blocks are all on the device (timed alone; pinned
  there for the run, as by long requests reading them), then a lease of it and its release,
  as a scheduler runs the request;
* ``stored``: a prompt whose blocks only the remote store holds (another engine published
  them): lookup (its presence question discovers them), restore, wait up to
  ``--restore-wait-s``, lookup, and the device slots given back (``offload``: the blocks stay
  hits on the store's copies);
* ``commit``: a new prompt looked up (a miss: the store is asked about it) and committed; with
  device, host and disk full, each commit pushes older blocks down, host -> disk -> remote.

The threads first run flat out for ``--warmup-s``; from then on they are paced (Poisson
arrivals) at ``--load`` (0.5) of the rate they reached, or at ``--rate`` operations per second,
so a call held up by the store shows as operations not done (throughput below the offered rate)
and a lookup's latency is not mostly its wait for the GIL behind threads spinning flat out.

Phases: ``normal``; ``frozen`` (the server SIGSTOPped for ``--frozen-s``); ``after_frozen``;
``blackhole`` (the proxy swallows everything for ``--blackhole-s``; ``--hole drop``, the
default: connections open during the hole stay silent after it, ``hold``: their bytes go on
after it); ``after_blackhole``; ``killed`` (the server SIGKILLed and restarted on the same port
after ``--killed-s``) and ``after_killed``; each ``after_*`` and ``normal`` lasts
``--normal-s``. While the store is back, the publisher (the engine that owns the stored
prompts) looks every 0.25 s whether it still holds them and puts them again where it does not:
a restarted server comes back empty, and Mooncake loses the values in a client's segment when
its master stops hearing from the client (measured after the 10 s black hole: every value gone
and puts refused for about 2 s, until the client had remounted).

Per phase: median and p99 of the resident lookups and their ratios to ``normal``; operations
completed per second and the ratio to ``normal``; restores from the store tried and succeeded;
for each ``after_*`` phase the seconds from the store's return to the engine's first answer
from it (``tier_answering_s``), to each put again by the publisher
(``republished_after_return_s``) and to the first restore from it that succeeded
(``first_good_restore_s``). ``targets`` checks the
issue's: resident lookups within 2x normal and throughput at least 80 % of normal during each
outage, the first good restore within 1 s of the return. Timing ratios mean something within
one run only. ``--dump-after-s`` prints every thread's stack to stderr (a few times at most)
when an operation has run that long: what it waits on. ``--lock-stats`` adds, per phase, how
the engine's lock was held: its share of the wall time, the longest hold, the waits for it and
the calls that held it longest (whether any hold spans store I/O shows there).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, shipped_models
from kvfsm.spec import Tier
from kvfsm.state import GroupState, Prompt
from kvfsm.tiers import (
    DiskTier,
    MooncakeMaster,
    MooncakeTier,
    RedisServer,
    RedisTier,
    StoredTier,
)
from tools.blackhole import MODES, BlackHoleProcess

#: The issue's targets: ratios to the normal phase, seconds after the store's return.
LOOKUP_RATIO_MAX = 2.0
THROUGHPUT_RATIO_MIN = 0.8
FIRST_RESTORE_MAX_S = 1.0
KINDS = ("resident", "stored", "commit")
#: Dumps of all threads' stacks at most, per run.
_DUMPS = 3
#: How often the publisher looks whether the store still holds the stored prompts.
_PUBLISH_EVERY_S = 0.25
#: Seconds between setting the offered rate and the first phase.
_SETTLE_S = 1.0
#: A paced thread that fell behind catches up on at most this much of its schedule.
_DEBT_S = 0.1
#: How long the resident prompts stay pinned (the whole run).
_PINNED_S = 24 * 3600.0
#: Verdicts of resident lookups that were not fully usable kept for the report, at most.
_EXAMPLES = 3


class Op(NamedTuple):
    """One operation a load thread completed."""

    kind: str
    start: float
    end: float
    #: The timed lookup of a resident prompt (seconds; 0 for other kinds).
    lookup_s: float = 0.0
    #: A restore from the remote store was started / made at least one block readable.
    tried: bool = False
    restored: bool = False
    #: A resident prompt not fully usable, or a stored one that was not even a hit.
    missed: bool = False


class TimedRLock:
    """The engine's lock, recording each outermost hold: when it began, how long it was held
    and waited for, and the three calls that took it (``--lock-stats``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        #: (start, held_s, waited_s, taken_by) per outermost hold.
        self.holds: list[tuple[float, float, float, str]] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        asked = time.monotonic()
        taken = self._lock.acquire(blocking, timeout)
        if taken:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                frame = sys._getframe(1)
                if frame.f_code.co_name == "__enter__" and frame.f_back is not None:
                    frame = frame.f_back
                names = []
                while frame is not None and len(names) < 3:
                    names.append(frame.f_code.co_name)
                    frame = frame.f_back
                now = time.monotonic()
                self._local.began = (now, now - asked, " < ".join(names))
            self._local.depth = depth + 1
        return taken

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            began, waited, by = self._local.began
            self.holds.append((began, time.monotonic() - began, waited, by))
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]


class _Threading:
    """``threading`` for ``kvfsm._engine`` while an Engine is built: its lock is timed."""

    def __init__(self, made: list[TimedRLock]) -> None:
        self._made = made

    def RLock(self) -> TimedRLock:
        lock = TimedRLock()
        self._made.append(lock)
        return lock

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


def lock_stats(holds: list[tuple[float, float, float, str]], phase: Phase) -> dict[str, Any]:
    """How the engine's lock was held during ``phase``: share of the wall time, the longest
    hold, the waits for it, and which calls held it longest in all."""
    mine = [h for h in holds if phase.start <= h[0] < phase.end]
    seconds = phase.end - phase.start
    if not mine or seconds <= 0:
        return {}
    by: dict[str, list[float]] = {}
    for _, held, _, taken_by in mine:
        by.setdefault(taken_by, []).append(held)
    top = sorted(by.items(), key=lambda item: -sum(item[1]))[:3]
    waits = [h[2] for h in mine]
    return {"held_share": round(sum(h[1] for h in mine) / seconds, 3),
            "longest_hold_ms": _ms([h[1] for h in mine], 100),
            "wait_median_ms": _ms(waits, 50), "wait_p99_ms": _ms(waits, 99),
            "wait_max_ms": _ms(waits, 100),
            "held_most_by": {name: {"holds": len(held), "ms_per_s": round(
                sum(held) / seconds * 1000, 1), "longest_ms": _ms(held, 100)}
                for name, held in top}}


class Phase(NamedTuple):
    name: str
    start: float
    end: float
    #: When the store answered again (the phases after an outage), else None.
    returned: float | None
    #: CPU seconds used during the phase: this process, the proxy's, and the whole box's
    #: (busy and in all, over every core).
    cpu: dict[str, float] | None = None


def _ticks(pid: int) -> float:
    """CPU seconds process ``pid`` used so far (0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _box() -> tuple[float, float]:
    """CPU seconds the whole box spent busy and in all, over every core, so far."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values[:8]) - idle) / tick, sum(values[:8]) / tick


class CpuMeter:
    """Samples of the CPU this process, the proxy process and the box have used."""

    def __init__(self, proxy_pid: int) -> None:
        self.proxy_pid = proxy_pid
        self.last = self._sample()

    def _sample(self) -> dict[str, float]:
        busy, total = _box()
        return {"engine_process": time.process_time(), "proxy_process": _ticks(self.proxy_pid),
                "box_busy": busy, "box_total": total}

    def since_last(self) -> dict[str, float]:
        """CPU seconds used since the previous call (or construction)."""
        now = self._sample()
        used = {name: now[name] - self.last[name] for name in now}
        self.last = now
        return used


class Servers:
    """The store's server, the proxy in front of it and the engine's client of it."""

    def __init__(self, store: str, hole: str) -> None:
        self.store = store
        self.server: RedisServer | MooncakeMaster = (
            RedisServer() if store == "redis" else MooncakeMaster())
        self.server.start()
        self.proxy = BlackHoleProcess(self.server.port, mode=hole)
        self.tier: StoredTier = (
            RedisTier(self.proxy.address) if store == "redis" else
            MooncakeTier(self.proxy.address, global_segment_bytes=1 << 30,
                         local_buffer_bytes=64 << 20))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.tier.close()
        self.proxy.close()
        self.server.stop()


def _payload(fill: int) -> Any:
    def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
        return np.full((index.size, group.decl.payload_bytes), fill % 251, np.uint8)

    return payload


class Load:
    """The engine, its prompts and the threads running the mix."""

    def __init__(self, engine: Engine, tier: StoredTier, *, threads: int, mix: list[int],
                 prompt_blocks: int, resident: int, stored: int, restore_wait_s: float,
                 dump_after_s: float, seed: int) -> None:
        self.engine = engine
        self.tier = tier
        self.threads = threads
        self.weights = np.asarray(mix, dtype=np.float64) / sum(mix)
        self.restore_wait_s = restore_wait_s
        self.dump_after_s = dump_after_s
        self.dump_kinds: tuple[str, ...] = KINDS
        self.seed = seed
        size = max(group.decl.block_size for group in engine.core.groups.values())
        self.tokens = prompt_blocks * size + 1
        self.resident = [engine.prompt(self._ids(0, k)) for k in range(resident)]
        self.stored = [engine.prompt(self._ids(1, k)) for k in range(stored)]
        self.fillers = 0
        self.ops: list[Op] = []
        self._ops_lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        #: Per worker: the kind and start of the operation it is in (None: between two).
        self._current: dict[int, tuple[str, float] | None] = {}
        self._pins: list[Any] = []
        #: Engine calls that raised: (when, kind of operation, the error).
        self.errors: list[tuple[float, str, str]] = []
        #: Operations per second offered, all threads together (0: as fast as they go).
        self.rate = 0.0
        self.dumps = 0
        #: What the first lookups of a resident prompt that was not fully usable said.
        self.miss_examples: list[str] = []
        self.started = 0.0
        self.full_usable = 0

    def _ids(self, family: int, a: int, b: int = 0) -> NDArray[np.int64]:
        """Token ids of a prompt no other shares: its first three say whose it is."""
        return np.concatenate([np.array([family, a, b], dtype=np.int64) + 1,
                               np.arange(self.tokens - 3, dtype=np.int64) + 10])

    # -- setup -----------------------------------------------------------------------------------

    def publish(self, *, until: float | None = None) -> bool:
        """Put the stored prompts' blocks into the remote store, as another engine that
        computed them would (retrying until the store takes all of them, or ``until``)."""
        keys, rows, checksums = self._published()
        while True:
            if bool(np.asarray(self.tier.put(keys, rows, checksums)).all()):
                return True
            if until is not None and time.monotonic() > until:
                return False
            time.sleep(_PUBLISH_EVERY_S / 5)

    def keep_published(self, until: float) -> list[float]:
        """Until ``until``, look every ``_PUBLISH_EVERY_S`` whether the store still holds the
        stored prompts and put them again where it does not (the engine that owns them keeps
        them there); returns when each put again that the store took was done."""
        keys, _, _ = self._published()
        done: list[float] = []
        while time.monotonic() < until:
            if not bool(np.asarray(self.tier.contains(keys)).all()) and self.publish(
                    until=until):
                done.append(time.monotonic())
            time.sleep(max(0.0, min(_PUBLISH_EVERY_S, until - time.monotonic())))
        return done

    def _published(self) -> tuple[list[Any], list[Any], NDArray[np.uint64]]:
        """The stored prompts' keys, payloads and checksums."""
        core = self.engine.core
        keys, rows, sums = [], [], []
        for k, prompt in enumerate(self.stored):
            for name, group in core.groups.items():
                if Tier.REMOTE not in group.stored:
                    continue
                decl = group.decl
                high, low = prompt.words(decl.block_size)
                index = group.rule.commit_blocks(decl, high.size)
                for key in self.engine.restorer.keys.prompt_keys(name, high, low, index):
                    row = np.full(decl.payload_bytes, (k * 7 + 3) % 251, np.uint8)
                    keys.append(key)
                    rows.append(row)
                    sums.append(xxhash.xxh3_64_intdigest(row))
        return keys, rows, np.asarray(sums, dtype=np.uint64)

    def fill(self) -> None:
        """Enough prompts that device, host and disk are full (every later commit pushes blocks
        down to the remote store), then the resident prompts, on the device and pinned there
        for the run (long requests reading them: no commit's room ever gives them back)."""
        engine = self.engine
        group = next(iter(engine.core.groups.values()))
        blocks_per_prompt = self.tokens // group.decl.block_size
        room = sum(pool.capacity for pool in group.pools.values()) + group.stored.get(
            Tier.DISK, 0)
        self.fillers = room // blocks_per_prompt + 4
        for n in range(self.fillers):
            self._commit_new(-1, n, record=False)
        for k, prompt in enumerate(self.resident):
            engine.commit(prompt, payload=_payload(k))
            self._pins.append(engine.lease(engine.lookup(prompt), prompt, ttl_s=_PINNED_S))
        self.full_usable = min(engine.lookup(p).usable_tokens for p in self.resident)

    # -- the mix -------------------------------------------------------------------------------

    def start(self) -> None:
        self.started = time.monotonic()
        for t in range(self.threads):
            worker = threading.Thread(target=self._run, args=(t,), daemon=True,
                                      name=f"load-{t}")
            self._workers.append(worker)
            worker.start()
        if self.dump_after_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="load-watch").start()

    def stop(self, timeout_s: float) -> int:
        """Stop the workers and let the I/O they started end (settled by polls); returns how
        many workers did not end within ``timeout_s``."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for lease in self._pins:
            lease.release()
        restorer = self.engine.restorer
        while time.monotonic() < deadline:
            with self.engine.lock:
                restorer.poll()
                if not restorer.loads_in_flight and not restorer.stores_in_flight:
                    break
            time.sleep(0.05)
        return sum(worker.is_alive() for worker in self._workers)

    def _record(self, op: Op) -> None:
        with self._ops_lock:
            self.ops.append(op)

    def _run(self, t: int) -> None:
        rng = np.random.default_rng(self.seed * 1000 + t)
        mine = [p for k, p in enumerate(self.stored) if k % self.threads == t] or self.stored
        made = 0
        due = time.monotonic()
        while not self._stop.is_set():
            if self.rate > 0:  # paced: this thread's share of the offered rate, Poisson
                due = max(due + rng.exponential(self.threads / self.rate),
                          time.monotonic() - _DEBT_S)
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
            kind = KINDS[int(rng.choice(len(KINDS), p=self.weights))]
            self._current[t] = (kind, time.monotonic())
            try:
                if kind == "resident":
                    self._resident(t, self.resident[int(rng.integers(len(self.resident)))])
                elif kind == "stored":
                    self._stored(mine[int(rng.integers(len(mine)))])
                else:
                    made += 1
                    self._commit_new(t, made - 1)
            except Exception as exc:  # an engine call raised: reported, and the load goes on
                self.errors.append((time.monotonic(), kind, f"{type(exc).__name__}: {exc}"))
            self._current[t] = None

    def _resident(self, t: int, prompt: Prompt) -> None:
        engine = self.engine
        start = time.monotonic()
        verdict = engine.lookup(prompt)
        looked = time.monotonic()
        with contextlib.suppress(Exception):  # a block that moved meanwhile: no lease
            engine.lease(verdict, prompt).release()
        missed = verdict.usable_tokens < self.full_usable
        if missed and len(self.miss_examples) < _EXAMPLES:
            self.miss_examples.append(verdict.summary())
        self._record(Op("resident", start, time.monotonic(), looked - start, missed=missed))

    def _stored(self, prompt: Prompt) -> None:
        engine = self.engine
        start = time.monotonic()
        verdict = engine.lookup(prompt)
        tried = restored = False
        if verdict.restorable_tokens > verdict.usable_tokens:
            tried = any(step.tier is Tier.REMOTE for step in verdict.plan)
            ticket = engine.restore(verdict, prompt)
            outcome = ticket.wait(timeout=self.restore_wait_s)
            restored = tried and any(o.statuses.get("OK", 0) for o in outcome.values())
            engine.lookup(prompt)
        self._give_back(prompt)
        self._record(Op("stored", start, time.monotonic(), tried=tried, restored=restored,
                        missed=verdict.hit_tokens == 0))

    def _give_back(self, prompt: Prompt) -> None:
        engine = self.engine
        with engine.lock:
            per_group = {}
            for name, group in engine.core.groups.items():
                high, low = prompt.words(group.decl.block_size)
                ids = engine.core.lookup_words(name, high, low)
                per_group[name] = ids[ids >= 0]
        for name, ids in per_group.items():
            if ids.size:
                engine.offload(name, ids)

    def _commit_new(self, t: int, n: int, *, record: bool = True) -> None:
        """Commit thread ``t``'s ``n``-th new prompt (-1: the fill before the run)."""
        engine = self.engine
        start = time.monotonic()
        prompt = engine.prompt(self._ids(2, t + 1, n))
        engine.lookup(prompt)
        engine.commit(prompt, payload=_payload(n))
        if record:
            self._record(Op("commit", start, time.monotonic()))

    def _watch(self) -> None:
        while not self._stop.wait(0.02) and self.dumps < _DUMPS:
            now = time.monotonic()
            slow = [(t, c[0]) for t, c in list(self._current.items())
                    if c is not None and c[0] in self.dump_kinds
                    and now - c[1] > self.dump_after_s]
            if slow:
                self.dumps += 1
                print(f"--- at {now - self.started:.3f} s: operations running over "
                      f"{self.dump_after_s:g} s (thread, kind): {slow}; every thread's stack:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                time.sleep(self.dump_after_s)


# -- the report ------------------------------------------------------------------------------------


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def summarize(ops: list[Op], phases: list[Phase], health: list[tuple[float, bool]],
              holds: list[tuple[float, float, float, str]] | None = None,
              errors: tuple[tuple[float, str, str], ...] | list[tuple[float, str, str]] = ()
              ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    base: dict[str, Any] = {}
    for phase in phases:
        seconds = phase.end - phase.start
        started = [op for op in ops if phase.start <= op.start < phase.end]
        ended = [op for op in ops if phase.start <= op.end < phase.end]
        lookups = [op.lookup_s for op in started if op.kind == "resident"]
        median, p99 = _ms(lookups, 50), _ms(lookups, 99)
        per_s = round(len(ended) / seconds, 1) if seconds > 0 else None
        if phase.name == "normal":
            base = {"median": median, "p99": p99, "per_s": per_s}
        stored = [op for op in started if op.kind == "stored"]
        row: dict[str, Any] = {
            "phase": phase.name, "seconds": round(seconds, 3),
            "resident_lookup": {
                "count": len(lookups), "median_ms": median, "p99_ms": p99,
                "max_ms": _ms(lookups, 100),
                "median_ratio": _ratio(median, base.get("median")),
                "p99_ratio": _ratio(p99, base.get("p99")),
                "not_fully_usable": sum(op.missed for op in started if op.kind == "resident")},
            "ops": len(ended), "ops_per_s": per_s,
            "ops_ratio": _ratio(per_s, base.get("per_s")),
            "ops_by_kind": {kind: sum(op.kind == kind for op in ended) for kind in KINDS},
            "median_ms_by_kind": {kind: _ms([op.end - op.start for op in started
                                             if op.kind == kind], 50) for kind in KINDS},
            "max_ms_by_kind": {kind: _ms([op.end - op.start for op in started
                                          if op.kind == kind], 100) for kind in KINDS},
            "errors": sum(phase.start <= at < phase.end for at, _, _ in errors),
            "store_restores": {"tried": sum(op.tried for op in stored),
                               "succeeded": sum(op.restored for op in stored),
                               "stored_not_a_hit": sum(op.missed for op in stored)},
            "remote_tier_health": [
                [round(at - phase.start, 3), "up" if up else "down"]
                for at, up in health if phase.start <= at < phase.end][:12],
        }
        if phase.returned is not None:
            up = [at for at, is_up in health if is_up and at >= phase.returned]
            row["tier_answering_s"] = round(min(up) - phase.returned, 3) if up else None
            # Within the phase (None: none before the next outage began).
            good = [op.end for op in ops if op.restored and phase.returned <= op.end < phase.end]
            row["first_good_restore_s"] = round(min(good) - phase.returned, 3) if good else None
            after = [op.end for op in ops if op.restored and op.start >= phase.returned
                     and op.end < phase.end]
            row["first_good_restore_started_after_s"] = (
                round(min(after) - phase.returned, 3) if after else None)
        row["started_at_s"] = round(phase.start - phases[0].start, 3)
        if holds is not None:
            row["engine_lock"] = lock_stats(holds, phase)
        if phase.cpu is not None and seconds > 0:
            # Cores' worth: 1.0 is one core busy the whole phase.
            cpu = phase.cpu
            row["cpu_cores"] = {
                "engine_process": round(cpu["engine_process"] / seconds, 2),
                "proxy_process": round(cpu["proxy_process"] / seconds, 2),
                "box_busy": round(cpu["box_busy"] / seconds, 2),
                "box_cores": round(cpu["box_total"] / seconds, 1)}
        out.append(row)
    return out


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for row in rows:
        name = row["phase"]
        if name in ("frozen", "blackhole", "killed"):
            lookup = row["resident_lookup"]
            checks[f"{name}.lookup_median_within_2x"] = (
                lookup["median_ratio"] is not None and lookup["median_ratio"] <= LOOKUP_RATIO_MAX)
            checks[f"{name}.lookup_p99_within_2x"] = (
                lookup["p99_ratio"] is not None and lookup["p99_ratio"] <= LOOKUP_RATIO_MAX)
            checks[f"{name}.throughput_at_least_80pct"] = (
                row["ops_ratio"] is not None and row["ops_ratio"] >= THROUGHPUT_RATIO_MIN)
        if "first_good_restore_s" in row:
            first = row["first_good_restore_s"]
            checks[f"{name}.first_good_restore_within_1s"] = (
                first is not None and first <= FIRST_RESTORE_MAX_S)
    checks["all_met"] = all(checks.values())
    return checks


# -- one run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _engine(model: str, servers: Servers, directory: Path, *, device: int, host: int,
            disk: int, remote: int, timed: list[TimedRLock] | None = None
            ) -> Iterator[Engine]:
    decl = shipped_models()[model]
    widest = max(group.payload_bytes for group in decl.groups)
    disk_dir = directory / "disk"
    disk_tier = DiskTier(disk_dir, capacity_bytes=DiskTier.capacity_for(
        disk_dir, widest, disk * len(decl.groups)), fsync=False)
    module = sys.modules[Engine.__module__]
    if timed is not None:  # the Engine makes its lock with threading.RLock()
        module.threading = _Threading(timed)  # type: ignore[attr-defined]
    try:
        engine = Engine(decl, CoreConfig(device_blocks=device, host_blocks=host,
                                         disk_blocks=disk, remote_blocks=remote),
                        tiers={"disk": disk_tier, "remote": servers.tier})
    finally:
        module.threading = threading  # type: ignore[attr-defined]
    try:
        yield engine
    finally:
        engine.close()
        disk_tier.close()


def run(store: str = "redis", *, model: str = "dense", threads: int = 4,
        mix: tuple[int, int, int] = (70, 15, 15), normal_s: float = 5.0,
        frozen_s: float = 5.0, blackhole_s: float = 10.0, killed_s: float = 3.0,
        kill: bool = True, warmup_s: float = 2.0, hole: str = "drop",
        load_fraction: float = 0.5, rate: float = 0.0, prompt_blocks: int = 8,
        resident: int = 16, stored: int = 16, restore_wait_s: float = 0.2,
        dump_after_s: float = 0.0, dump_kinds: tuple[str, ...] = KINDS,
        lock_timing: bool = False, seed: int = 1) -> dict[str, Any]:
    """One store's run through every phase (see the module); the report as a dict."""
    servers = Servers(store, hole)
    health: list[tuple[float, bool]] = []
    phases: list[Phase] = []
    timed: list[TimedRLock] = []
    device = (resident + stored + 4 * threads) * prompt_blocks
    try:
        with tempfile.TemporaryDirectory(prefix="kvfsm-outage-") as tmp, \
                _engine(model, servers, Path(tmp), device=device, host=8 * prompt_blocks,
                        disk=16 * prompt_blocks, remote=1 << 17,
                        timed=timed if lock_timing else None) as engine:
            engine.restorer.health[Tier.REMOTE].listeners.append(
                lambda tier, up: health.append((time.monotonic(), up)))
            load = Load(engine, servers.tier, threads=threads, mix=list(mix),
                        prompt_blocks=prompt_blocks, resident=resident, stored=stored,
                        restore_wait_s=restore_wait_s, dump_after_s=dump_after_s, seed=seed)
            load.dump_kinds = dump_kinds
            load.publish()
            load.fill()
            load.start()
            # Warm-up, flat out: what the box can do, and the rate offered from then on.
            time.sleep(warmup_s / 2)
            counted = len(load.ops)
            time.sleep(warmup_s / 2)
            capacity = (len(load.ops) - counted) / (warmup_s / 2)
            load.rate = rate if rate > 0 else load_fraction * capacity
            time.sleep(_SETTLE_S)
            server, proxy = servers.server, servers.proxy
            meter = CpuMeter(proxy.pid)
            at = time.monotonic()

            def phase(name: str, seconds: float) -> None:
                nonlocal at
                time.sleep(max(0.0, at + seconds - time.monotonic()))
                end = time.monotonic()
                phases.append(Phase(name, at, end, None, meter.since_last()))
                at = end

            def after(name: str) -> None:
                """The store is back (now): normal load, the publisher putting the stored
                prompts again whenever the store lacks them (a restarted server, a Mooncake
                master that dropped this client's segment)."""
                nonlocal at
                back = at = time.monotonic()
                done = load.keep_published(back + normal_s)
                republished[name] = [round(t - back, 3) for t in done]
                phases.append(Phase(name, back, time.monotonic(), back, meter.since_last()))
                at = phases[-1].end

            republished: dict[str, list[float]] = {}
            phase("normal", normal_s)
            server.pause()
            phase("frozen", frozen_s)
            server.resume()
            after("after_frozen")
            proxy.swallow()
            phase("blackhole", blackhole_s)
            proxy.heal()
            after("after_blackhole")
            if kill:
                server.kill()
                time.sleep(max(0.0, at + killed_s - time.monotonic()))
                server.restart()  # the phase ends when the server answers again
                phases.append(Phase("killed", at, time.monotonic(), None, meter.since_last()))
                after("after_killed")
            stuck = load.stop(timeout_s=30.0)
            ops = list(load.ops)
    finally:
        servers.close()
    rows = summarize(ops, phases, health, timed[0].holds if timed else None, load.errors)
    return {
        "store": store, "model": model, "threads": threads, "hole": hole,
        "capacity_ops_per_s": round(capacity, 1), "offered_ops_per_s": round(load.rate, 1),
        "setup": {"device_blocks": device, "host_blocks": 8 * prompt_blocks,
                  "disk_blocks": 16 * prompt_blocks, "prompt_tokens": load.tokens,
                  "resident_prompts": resident, "stored_prompts": stored,
                  "filler_prompts": load.fillers, "mix_percent": dict(zip(KINDS, mix,
                                                                          strict=True)),
                  "restore_wait_s": restore_wait_s},
        "phases": rows,
        "republished_after_return_s": republished,
        "threads_still_running_at_stop": stuck,
        "errors": len(load.errors),
        "error_examples": sorted({f"{kind}: {error}" for _, kind, error in load.errors})[:5],
        "stack_dumps": load.dumps,
        "resident_not_fully_usable_examples": load.miss_examples,
        "targets": targets(rows),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="redis", choices=["redis", "mooncake", "both"])
    parser.add_argument("--model", default="dense", choices=sorted(shipped_models()))
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--mix", default="70,15,15",
                        help="percent of resident lookups, stored restores, commits")
    parser.add_argument("--normal-s", type=float, default=5.0)
    parser.add_argument("--frozen-s", type=float, default=5.0)
    parser.add_argument("--blackhole-s", type=float, default=10.0)
    parser.add_argument("--killed-s", type=float, default=3.0)
    parser.add_argument("--no-kill", action="store_true", help="skip the killed phase")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--hole", default="drop", choices=MODES,
                        help="drop: connections open during the hole stay silent after it; "
                             "hold: their bytes are delivered after it")
    parser.add_argument("--load", type=float, default=0.5,
                        help="offered rate as a fraction of what the warm-up did flat out")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="offered operations per second (overrides --load)")
    parser.add_argument("--restore-wait-s", type=float, default=0.2)
    parser.add_argument("--dump-after-s", type=float, default=0.0,
                        help="dump every thread's stack when an operation runs this long")
    parser.add_argument("--dump-kinds", default=",".join(KINDS),
                        help="the kinds of operation --dump-after-s watches")
    parser.add_argument("--lock-stats", action="store_true",
                        help="time every hold of the engine's lock (a Python-level lock: "
                             "a few microseconds more per call)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    mix = tuple(int(part) for part in args.mix.split(","))
    if len(mix) != len(KINDS) or min(mix) < 0 or sum(mix) <= 0:
        parser.error("--mix needs three percentages, e.g. 70,15,15")
    stores = ["redis", "mooncake"] if args.store == "both" else [args.store]
    report: dict[str, Any] = {
        "command": "python -m tools.store_outage " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        "runs": {store: run(store, model=args.model, threads=args.threads,
                            mix=(mix[0], mix[1], mix[2]), normal_s=args.normal_s,
                            frozen_s=args.frozen_s, blackhole_s=args.blackhole_s,
                            killed_s=args.killed_s, kill=not args.no_kill,
                            warmup_s=args.warmup_s, hole=args.hole,
                            load_fraction=args.load, rate=args.rate,
                            restore_wait_s=args.restore_wait_s,
                            dump_after_s=args.dump_after_s,
                            dump_kinds=tuple(args.dump_kinds.split(",")),
                            lock_timing=args.lock_stats, seed=args.seed)
                 for store in stores},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
