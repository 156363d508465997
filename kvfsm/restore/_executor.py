"""The restore executor: runs a verdict's plan with real copies from disk and remote tiers.

A restore from a stored tier is three moves. ``restore_begin`` (fired here, on the caller's
thread) takes a device slot; worker threads load the stored copies straight into those slots
(or into a host buffer where the device pool is GPU memory) and verify each copy's header and
checksum; back on the caller's thread, when the caller waits or polls, each block's transition
is completed: ``restore_done`` where the copy verified (its guard re-checks what arrived),
``restore_fail`` elsewhere, and a copy that is gone or bad for good (missing, corrupt, foreign)
is forgotten (``evict``), so the next lookup recomputes from the first failing block. Workers
touch only tier I/O and the bytes of slots held in a restoring state, which no reader may read;
every state change happens in ``fire`` on the thread that drives the core. A load that outlives
a caller's wait keeps its slot (the block stays restoring, not readable) until it ends, so a late
read can never land in a slot that serves another block; a plan made meanwhile (its step for such
a block is ``restore_done``) fires nothing on it and joins the running load instead.

Spills into stored tiers (:meth:`RestoreExecutor.store`) run the same way in the other
direction: ``spill_begin``, copies written by workers, ``spill_done`` where the tier took them.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm import _args
from kvfsm._errors import KvfsmError
from kvfsm.fsm import INVALID
from kvfsm.lookup import RestoreStep
from kvfsm.restore._health import StoreTimeouts, TierHealth
from kvfsm.restore._keys import KeyFields, KeyMaker
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore
from kvfsm.tiers import BlockKey, LoadResult, LoadStatus, StoredTier

IdArray = NDArray[np.intp]
_T = TypeVar("_T")
#: ``(group, count, keep)``: give back up to ``count`` device slots, never a block of ``keep``.
MakeRoom = Callable[[str, int, IdArray], int]

#: Told of every batch of restores that ended (caller's thread, under the lock): the group, the
#: tier the copies came from, how many ended how (load status names; ``OK``: made readable),
#: the payload bytes made readable and the seconds the copies took.
RestoreListener = Callable[[str, Tier, Mapping[str, int], int, float], None]


#: Per block of a store job: the target tier holds it now; its source copy is gone for good.
_Stored = tuple[NDArray[np.bool_], NDArray[np.bool_]]

#: Most blocks per worker task (a batch is split evenly over the workers, in tasks no larger
#: than this, so every worker reads while the others hash).
CHUNK_BLOCKS = 64

#: What a probe asks a failing remote tier about: a key no engine writes (the answer, not the
#: key, is what counts).
PROBE_KEY = BlockKey(model=b"kvfsm-probe\0\0\0\0\0", group=0, layout=0, chain_high=0,
                     chain_low=0, token_start=0, token_end=0)


@attrs.frozen
class GroupOutcome:
    """What became of one group's loads from stored tiers, once settled."""

    group: str
    #: Block ids made readable / rolled back (copy kept, may be retried) / forgotten (copy gone
    #: or bad) / still loading when the wait ended (not readable; settled by a later poll).
    restored: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    pending: tuple[int, ...] = ()
    #: Load statuses seen, by name (``OK``, ``MISSING``, ``CORRUPT``, ...).
    statuses: Mapping[str, int] = attrs.field(factory=dict)
    bytes_loaded: int = 0


@attrs.define(eq=False)
class _Load:
    """One worker task: load ``ids`` of ``group`` from ``tier`` into ``rows``."""

    group: str
    tier: Tier
    ids: IdArray
    rows: list[Any]
    staged: bool
    then: tuple[Event, ...]
    future: cf.Future[LoadResult]
    #: Seconds the worker spent on the load (set by the worker when it ends).
    seconds: list[float] = attrs.field(factory=lambda: [0.0])
    settled: bool = False
    #: Tickets that report this load: the one that started it and any submitted while it ran
    #: whose plan named its blocks.
    tickets: list[RestoreTicket] = attrs.field(factory=list)


@attrs.define(eq=False)
class SpillJob:
    """One batch of spills into stored tiers: blocks ``ids`` of ``group`` (``at``: their
    places in the batch asked for), written by ``parts`` (each a slice of ``ids`` and the
    worker's future, into the tier of the same place in ``targets``)."""

    group: str
    ids: IdArray
    at: IdArray
    parts: list[tuple[IdArray, cf.Future[_Stored]]] = attrs.field(factory=list)
    targets: list[Tier] = attrs.field(factory=list)
    settled: bool = False
    #: Per block, once settled: the tier holds its copy now (``spill_done`` fired).
    stored: NDArray[np.bool_] = attrs.field(factory=lambda: np.zeros(0, dtype=np.bool_))

    def done(self) -> bool:
        return all(future.done() for _, future in self.parts)


#: Makes the next round of a restore after one failed: a ticket for the plan of a fresh lookup
#: (submitted), or None when no round would land more.
Replan = Callable[[], "RestoreTicket | None"]


class RestoreTicket:
    """The loads one plan started; wait on all of them or on one group's.

    With ``replan`` (what :meth:`kvfsm.Engine.restore` gives when it knows the prompt), a
    round in which a step failed (a corrupt host copy, a damaged file, a refused step) is
    followed by another: the fallback length may need blocks the first plan did not name
    (its window blocks, its snapshot), so the ticket asks ``replan`` for the next plan and
    waits on it too, until a round fails nothing or no plan is left, within the same wait."""

    def __init__(self, executor: RestoreExecutor, loads: list[_Load],
                 immediate: Mapping[str, tuple[int, ...]], notes: tuple[str, ...],
                 replan: Replan | None = None) -> None:
        self._executor = executor
        self._loads = loads
        #: Blocks restored without stored-tier I/O (from host), per group.
        self.immediate = {name: tuple(ids) for name, ids in immediate.items()}
        #: Steps refused on the way (a guard said no, no row), one line each.
        self.notes = notes
        self._outcomes: dict[str, GroupOutcome] = {}
        self._replan = replan
        #: A step of the latest round failed: another round may land the fallback length.
        self._round_failed = bool(notes)
        #: Rounds run (1: the plan it was made for).
        self.rounds = 1

    def with_replan(self, replan: Replan) -> RestoreTicket:
        """This ticket, following failed rounds with ``replan``'s plans; rounds whose steps
        all settled already (host copies, refused steps) are followed at once."""
        self._replan = replan
        self._next_rounds(None, block=False)
        return self

    def _absorb(self, other: RestoreTicket) -> None:
        for load in other._loads:
            load.tickets = [self if ticket is other else ticket for ticket in load.tickets]
        self._loads += other._loads
        for name, ids in other.immediate.items():
            self.immediate[name] = (*self.immediate.get(name, ()), *ids)
        self.notes = (*self.notes, *other.notes)
        for name, outcome in other._outcomes.items():
            mine = self._outcomes.get(name)
            self._outcomes[name] = outcome if mine is None else _merged(mine, outcome)
        self._round_failed = other._round_failed
        self.rounds += 1

    def _next_rounds(self, deadline: float | None, *, block: bool = True) -> None:
        """While the latest round failed a step, run the next once its loads have settled,
        waiting for loads until ``deadline`` (a ``time.monotonic`` instant; None: no limit);
        ``block=False`` runs only rounds that need no waiting."""
        while self._replan is not None:
            if any(not load.settled for load in self._loads):
                if not block:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                cf.wait([load.future for load in self._loads if not load.settled],
                        timeout=left)
                self._executor.settle_all(self._loads)
                if any(not load.settled for load in self._loads):
                    return
            if not self._round_failed:
                return
            self._round_failed = False
            more = self._replan()
            if more is None:
                return
            self._absorb(more)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({load.group for load in self._loads} | set(self.immediate)))

    def done(self, group: str | None = None) -> bool:
        """Whether every load (of ``group``) has finished its I/O (settled or not)."""
        return all(load.future.done() for load in self._loads
                   if group is None or load.group == group)

    def wait(self, group: str | None = None, timeout: float | None = None
             ) -> Mapping[str, GroupOutcome]:
        """Wait up to ``timeout`` seconds (None: until done) for the loads of ``group`` (all
        groups: None), settle every finished one, run the next rounds where one failed (see
        the class) and return each group's outcome so far. Loads still running stay
        pending: their blocks keep their slots, not readable, until a later wait or poll.
        ``group`` must be one of the model's groups and ``timeout`` a number of seconds >= 0
        (else a KvfsmError naming it)."""
        if group is not None:
            known = self._executor.core.groups
            if not isinstance(group, str) or group not in known:
                raise KvfsmError(f"wait(group=...) must be one of the model's groups "
                                 f"{sorted(known)}, got {group!r}")
        if timeout is not None:
            timeout = _args.seconds("wait(timeout=...)", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        loads = [load for load in self._loads if group is None or load.group == group]
        cf.wait([load.future for load in loads if not load.settled], timeout=timeout)
        self._executor.settle_all(loads)
        if group is None:
            self._next_rounds(deadline)
            loads = self._loads
        pending: dict[str, list[int]] = collections.defaultdict(list)
        for load in loads:
            if not load.settled:
                pending[load.group] += load.ids.tolist()
        names = [group] if group is not None else list(self.groups)
        return {name: attrs.evolve(self._outcomes.get(name, GroupOutcome(name)),
                                   pending=tuple(pending.get(name, ())),
                                   restored=(*self.immediate.get(name, ()),
                                             *self._outcomes.get(name, GroupOutcome(name))
                                             .restored))
                for name in names}

    def record(self, load: _Load, restored: IdArray, failed: IdArray, lost: IdArray,
               statuses: Mapping[str, int], width: int) -> None:
        """Add one settled load: its blocks by outcome, its load statuses (name -> count)
        and the payload bytes of the OK ones (``width`` each)."""
        if failed.size or lost.size:
            self._round_failed = True
        before = self._outcomes.get(load.group, GroupOutcome(load.group))
        merged = dict(before.statuses)
        for name, count in statuses.items():
            merged[name] = merged.get(name, 0) + count
        self._outcomes[load.group] = attrs.evolve(
            before, restored=(*before.restored, *restored.tolist()),
            failed=(*before.failed, *failed.tolist()), lost=(*before.lost, *lost.tolist()),
            statuses=merged,
            bytes_loaded=before.bytes_loaded + statuses.get(LoadStatus.OK.name, 0) * width)


class RestoreExecutor:
    """Runs restore plans and spills against ``core`` with the stored ``tiers``.

    It fires on the caller's thread; ``workers`` threads do the I/O. ``lock``, where several
    threads drive the core (the engine's lock), is held around everything that fires
    (submits, settles in ``wait`` and ``poll``, spills), never while waiting for I/O.
    ``make_room`` gives back device slots before restores take them (the engine's
    ``give_back``); without it a plan needing more slots than are free fails its
    ``restore_begin`` (``has_room``) and recomputes.
    """

    def __init__(self, core: StateCore, tiers: Mapping[Tier, StoredTier], *,
                 workers: int = 2, make_room: MakeRoom | None = None,
                 lock: contextlib.AbstractContextManager[Any] | None = None,
                 timeouts: StoreTimeouts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise KvfsmError(f"RestoreExecutor needs at least one worker, got {workers}")
        self.core = core
        self.tiers = dict(tiers)
        self.timeouts = timeouts or StoreTimeouts()
        #: Per stored tier: whether it answers, and when it may be asked again (a remote tier
        #: that failed gets loads and spills again once it answered a presence question).
        self.health = {tier: TierHealth(tier, self.timeouts, clock, probed=tier is not Tier.DISK)
                       for tier in self.tiers}
        self.keys = KeyMaker(core)
        self._make_room = make_room
        self._workers = workers
        self._lock: contextlib.AbstractContextManager[Any] = (
            lock if lock is not None else contextlib.nullcontext())
        #: Worker threads per (tier, direction), made on first use: a tier whose loads hang
        #: (a slow or dead store) must not hold up loads from another tier, nor the spills
        #: that make room, which would wait behind it on a shared pool. A remote tier's are
        #: left to their hung calls when it fails (:meth:`_failed`), and fresh ones serve it
        #: when it answers again.
        self._pools: dict[tuple[Tier, str], cf.ThreadPoolExecutor] = {}
        #: Pools left behind that way (close waits for their calls: each ends by its
        #: client's timeout).
        self._abandoned: list[cf.ThreadPoolExecutor] = []
        #: Guards the two above (pools are asked for with and without the engine's lock).
        self._pools_lock = threading.Lock()
        #: Loads not yet settled (or settled by a ticket and not yet dropped by a poll).
        self._open: list[_Load] = []
        #: Told of every batch of restores that ended (metrics, the admission gate).
        self.listeners: list[RestoreListener] = []
        #: Spills into stored tiers begun and not yet settled.
        self._stores: list[SpillJob] = []
        #: Set by close() once the workers are stopped.
        self._closing = False
        #: Copies being removed, by key: a put of the same key waits for its removal.
        self._removing: dict[BlockKey, cf.Future[None]] = {}

    # -- restores --------------------------------------------------------------------------

    def submit(self, plan: Sequence[RestoreStep],
               keep: Mapping[str, Iterable[int] | NDArray[np.intp]] | None = None
               ) -> RestoreTicket:
        """Start every step of ``plan`` (``Verdict.plan``): fire up to ``restore_begin`` now,
        host copies complete at once, stored copies load on workers. ``keep``: per group,
        blocks ``make_room`` must not give back (the prompt's own).

        A block whose load is still running (a plan made while it loads says ``restore_done``)
        is left to that load, which this ticket then reports too: nothing is fired on it here,
        since its slot must stay its own until the load ends. A block left restoring from a
        stored tier with no load running (begun by hand) gets its load now."""
        with self._lock:
            return self._submit(plan, keep)

    def _submit(self, plan: Sequence[RestoreStep],
                keep: Mapping[str, Iterable[int] | NDArray[np.intp]] | None) -> RestoreTicket:
        core = self.core
        running: dict[tuple[str, int], _Load] = {
            (load.group, block): load for load in self._open if not load.settled
            for block in load.ids.tolist()} if self._open else {}
        joined: dict[int, _Load] = {}
        if self._make_room is not None:
            for name in sorted({step.group for step in plan}):
                wanted = sum(Event.RESTORE_BEGIN in step.path for step in plan
                             if step.group == name)
                given = (keep or {}).get(name, ())
                own = np.asarray(given, dtype=np.intp) if isinstance(given, np.ndarray) \
                    else np.fromiter(given, dtype=np.intp)
                self._make_room(name, wanted - core.group(name).pools[Tier.DEVICE].free, own)
        batches: dict[tuple[str, tuple[Event, ...]], list[RestoreStep]] = {}
        for step in plan:
            batches.setdefault((step.group, step.path), []).append(step)
        loads: list[_Load] = []
        immediate: dict[str, list[int]] = collections.defaultdict(list)
        notes: list[str] = []
        for (group, path), steps in batches.items():
            started = time.perf_counter()
            ids = np.array([step.block_id for step in steps], dtype=np.intp)
            if Event.RESTORE_BEGIN in path:
                ids, skipped = self._answering(group, ids)
                notes += skipped
            if running:
                busy = np.array([(group, block) in running for block in ids.tolist()],
                                dtype=np.bool_)
                for block in ids[busy].tolist():
                    joined[id(running[group, block])] = running[group, block]
                ids = ids[~busy]
            for position, event in enumerate(path):
                if event is Event.RESTORE_DONE:
                    # Already restoring from a stored tier: done comes from its load only.
                    state = core.group(group)
                    loading = state.table.loading[state.states[ids]]
                    loads += self._start_loads(group, ids[loading], path[position + 1:])
                    ids = ids[~loading]
                moved = core.fire(group, ids, event, masked=True)
                refused = ids[~moved]
                notes += self._refused(group, refused, event)
                if event is Event.RESTORE_DONE and refused.size:
                    core.fire(group, refused, Event.RESTORE_FAIL, masked=True)
                    if Event.RESTORE_BEGIN in path:
                        # Copied from host just now and different from its checksum: the
                        # host copy is bad; drop it, recompute.
                        core.fire(group, refused, Event.INVALIDATE, masked=True)
                    # Else the device copy of a restore begun earlier is what failed (half
                    # landed): rolled back to its source copy, which the next round copies
                    # again and checks.
                ids = ids[moved]
                if event is Event.RESTORE_BEGIN:
                    loading = core.group(group).table.loading[core.group(group).states[ids]]
                    loads += self._start_loads(group, ids[loading], path[position + 1:])
                    ids = ids[~loading]
            immediate[group] += ids.tolist()
            if ids.size and Event.RESTORE_BEGIN in path:
                width = core.group(group).decl.payload_bytes
                self._tell(group, Tier.HOST, {"OK": int(ids.size)}, int(ids.size) * width,
                           time.perf_counter() - started)
        ticket = RestoreTicket(self, [*loads, *joined.values()],
                               {g: tuple(v) for g, v in immediate.items()}, tuple(notes))
        for load in [*loads, *joined.values()]:
            load.tickets.append(ticket)
        self._open += loads
        return ticket

    def _answering(self, group: str, ids: IdArray) -> tuple[IdArray, list[str]]:
        """``ids`` less the blocks whose copy lies in a stored tier backing off (nothing is
        asked of it until then: the caller recomputes them), and a note for each tier."""
        if not self.health:
            return ids, []
        state = self.core.group(group)
        residency = state.table.residency[state.states[ids]]
        notes, keep = [], np.ones(ids.size, dtype=np.bool_)
        for tier, health in self.health.items():
            if not health.usable():
                there = residency == int(tier)
                if there.any():
                    keep &= ~there
                    notes.append(f"{group}: {int(there.sum())} restores from the "
                                 f"{tier.spec_name} tier skipped: it is not answering "
                                 f"({health.last_error}); asked again in "
                                 f"{health.wait_s():.2f} s")
        return ids[keep], notes

    def presence(self, store: StoredTier, keys: Sequence[BlockKey],
                 deadline_s: float | None) -> NDArray[np.bool_]:
        """Which of ``keys`` ``store`` holds (a hint), asked on a worker and waited for at most
        ``deadline_s`` (None: the configured ``presence_s``) for a remote tier; a disk tier
        answers from its index at once. A tier backing off, one that raised, or one that did
        not answer in time holds nothing this time (and backs off)."""
        nothing = np.zeros(len(keys), dtype=np.bool_)
        if not keys:
            return nothing
        health = self.health.get(store.tier)
        if store.tier is Tier.DISK or health is None:
            return np.asarray(store.contains(keys), dtype=np.bool_)
        if health.down():
            return nothing
        limit = self.timeouts.presence_s if deadline_s is None else deadline_s
        tier = store.tier
        future = self._run_on(tier, "ask", store.contains, list(keys))
        try:
            held = np.asarray(future.result(timeout=limit), dtype=np.bool_)
        except cf.TimeoutError:
            self._failed(tier, f"no answer to a presence question within {limit:g} s")
            return nothing
        except Exception as exc:  # a tier that raised: it holds nothing we can trust now
            self._failed(tier, f"{type(exc).__name__}: {exc}")
            return nothing
        if not bool(getattr(store, "available", True)):
            self._failed(tier, str(getattr(store, "last_error", None) or "the store is down"))
            return nothing
        health.answered()
        return held

    def probe(self, tiers: Iterable[Tier], *, answering: bool = False) -> None:
        """Ask each of ``tiers`` that failed and whose back-off is over a presence question
        (bounded by ``presence_s``; without the engine's lock): its answer lets loads and
        spills into it start again, its silence backs it off once more. Costs nothing for a
        tier that answers, unless ``answering``: then a remote tier still counted as answering
        is asked too (a caller whose copies into it are late: a silent store is found out in
        ``presence_s`` rather than by the client's timeout)."""
        for tier in tiers:
            health = self.health.get(tier)
            if health is None or not health.probed:
                continue
            if health.probe_due() or (answering and health.up):
                self.presence(self.tiers[tier], [PROBE_KEY], None)

    def _failed(self, tier: Tier, why: str) -> None:
        """``tier`` did not answer: back it off, and (a remote tier) leave its worker threads
        to the calls they are in, which hang until the client's timeout: calls made once it
        answers again get fresh threads instead of waiting behind them (calls still queued
        there are cancelled: their loads and spills fail, their copies stay where they
        were)."""
        health = self.health.get(tier)
        if health is not None:
            health.failed(why)
        if tier is Tier.DISK:
            return  # local file calls end; their removals must not be dropped
        with self._pools_lock:
            gone = [self._pools.pop(key) for key in list(self._pools) if key[0] is tier]
            self._abandoned = [pool for pool in self._abandoned if _busy(pool)] + gone
        for pool in gone:
            pool.shutdown(wait=False, cancel_futures=True)

    def _tell(self, group: str, tier: Tier, outcomes: Mapping[str, int], nbytes: int,
              seconds: float) -> None:
        for listener in self.listeners:
            listener(group, tier, outcomes, nbytes, seconds)

    def _refused(self, group: str, ids: IdArray, event: Event) -> list[str]:
        state = self.core.group(group)
        out = []
        for block in ids.tolist():
            row = state.table.row(int(state.states[block]), event)
            why = "no row for its state" if row is None else \
                "a guard said no (one of " + ", ".join(str(c) for c in row.guards) + ")"
            out.append(f"{group} block id {block}: {event.spec_name} refused: {why}")
        return out

    def _start_loads(self, group: str, ids: IdArray, then: tuple[Event, ...]) -> list[_Load]:
        if not ids.size:
            return []
        core = self.core
        state = core.group(group)
        staged = not state.pools[Tier.DEVICE].on_host
        loads = []
        residency = state.table.residency[state.states[ids]]
        for tier_id in np.unique(residency).tolist():
            tier = Tier(tier_id)
            chosen = ids[residency == tier_id]
            store = self.tiers.get(tier)
            # Rows and what the keys are made of for the whole batch at once (each call
            # validates its batch), then one worker task per chunk, which builds its keys and
            # loads, so reads overlap checksums on other cores and the first worker starts
            # before the last key is made.
            rows: list[Any] = (list(np.empty((chosen.size, state.decl.payload_bytes), np.uint8))
                               if staged else core.restore_rows(group, chosen))
            fields = self.keys.fields(group, chosen)
            per_task = min(-(-chosen.size // self._workers), CHUNK_BLOCKS)
            for start in range(0, chosen.size, per_task):
                stop = min(start + per_task, chosen.size)
                part_rows = rows[start:stop]
                future: cf.Future[LoadResult]
                seconds = [0.0]
                if store is None:
                    future = cf.Future()
                    future.set_result(_all(stop - start, LoadStatus.FAILED))
                else:
                    future = self._run_on(
                        tier, "load", _load, store, fields, start, stop, part_rows, seconds)
                loads.append(_Load(group, tier, chosen[start:stop], part_rows, staged, then,
                                   future, seconds))
        return loads

    def settle(self, load: _Load) -> None:
        """Complete the transitions of a finished load (caller's thread) and report it to
        every ticket watching it."""
        self.settle_all([load])

    def settle_all(self, loads: Iterable[_Load]) -> int:
        """Settle every finished load of ``loads``, one batch of fires per group and path
        (caller's thread, under the lock); returns how many were settled."""
        with self._lock:
            ready: dict[tuple[str, tuple[Event, ...]], list[_Load]] = {}
            for load in loads:
                if not load.settled and load.future.done():
                    load.settled = True
                    ready.setdefault((load.group, load.then), []).append(load)
            for (group, then), batch in ready.items():
                self._settle_batch(group, then, batch)
            return sum(len(batch) for batch in ready.values())

    def _settle_batch(self, group: str, then: tuple[Event, ...], loads: list[_Load]) -> None:
        core = self.core
        results = []
        for load in loads:
            try:
                results.append(load.future.result())
            except Exception:  # a tier that raised: nothing it loaded is trusted
                results.append(_all(load.ids.size, LoadStatus.FAILED))
        ids = np.concatenate([load.ids for load in loads])
        status = np.concatenate([result.status for result in results])
        ok = status == LoadStatus.OK
        lost_status = _IS_LOST[status]
        good_at = np.flatnonzero(ok)
        good = ids[good_at]
        if good.size:
            staged = [row for load in loads if load.staged for row in load.rows]
            payload = np.stack(staged)[ok] if staged else None
            checksum = np.concatenate([result.checksum for result in results])[ok]
            core.record_loaded(group, good, checksum, payload, verified=payload is None)
        done = _fire(core, group, good, Event.RESTORE_DONE)
        # What became of each block, by its place in ``ids``: failed (copy kept) unless below.
        outcome = np.full(ids.size, _FAILED, dtype=np.uint8)
        # A copy that arrived whole and still failed restore_done's check is not trusted twice:
        # rolled back and forgotten, like a copy that is gone or bad for good.
        outcome[good_at[~done]] = _LOST_COPY
        outcome[~ok & lost_status] = _LOST_COPY
        _fire(core, group, np.concatenate([good[~done], ids[~ok]]), Event.RESTORE_FAIL)
        _fire(core, group, ids[outcome == _LOST_COPY], Event.EVICT)
        restored_at = good_at[done]
        for event in then:
            if event is not Event.RESTORE_DONE:
                restored_at = restored_at[_fire(core, group, ids[restored_at], event)]
        outcome[good_at[done]] = _NEITHER  # done, but a later step of the path refused it
        outcome[restored_at] = _RESTORED
        start = 0
        width = core.group(group).decl.payload_bytes
        for load, result in zip(loads, results, strict=True):
            mine, codes = load.ids, outcome[start:start + load.ids.size]
            start += load.ids.size
            counts = np.bincount(result.status, minlength=_STATUS_COUNT)
            statuses = {_STATUS_NAMES[value]: int(counts[value])
                        for value in np.flatnonzero(counts).tolist()}
            if not load.future.cancelled():  # a cancelled load never asked the tier
                self._judge(load.tier, counts)
            made = codes == _RESTORED
            if self.listeners:
                self._tell(group, load.tier, statuses, int(made.sum()) * width,
                           load.seconds[0])
            for ticket in load.tickets:
                ticket.record(load, mine[made], mine[codes == _FAILED],
                              mine[codes == _LOST_COPY], statuses, width)

    def _judge(self, tier: Tier, counts: NDArray[np.int64]) -> None:
        """A load's statuses tell whether its tier answers: any answer (a value good or bad,
        a missing key, a late read) says it does; nothing but FAILED says it does not."""
        health = self.health.get(tier)
        if health is None:
            return
        if int(counts.sum()) > int(counts[LoadStatus.FAILED]):
            health.answered()
        elif counts.sum():
            self._failed(tier, "its loads failed")

    def poll(self) -> int:
        """Settle every load and spill whose I/O has finished; returns how many loads were
        settled."""
        with self._lock:
            settled = self.settle_all(self._open)
            self._open = [load for load in self._open if not load.settled]
            if self._stores:
                self.settle_stores()
            return settled

    @property
    def loads_in_flight(self) -> int:
        return sum(not load.settled for load in self._open)

    # -- spills into stored tiers --------------------------------------------------------------

    def store(self, group: str, ids: Iterable[int], *, timeout: float | None = None
              ) -> NDArray[np.bool_]:
        """Spill ``ids`` one tier down into a stored tier (host -> disk, disk -> remote) and
        wait for it (:meth:`begin_store`, then :meth:`settle_stores` once the copies are
        written; a put still running after ``timeout`` is waited for: its source bytes must
        stay where they are until it ends). Returns which blocks moved."""
        with self._lock:
            jobs = self.begin_store(group, ids)
        cf.wait([future for job in jobs for _, future in job.parts], timeout=timeout)
        with self._lock:
            for job in jobs:
                cf.wait([future for _, future in job.parts])
            self.settle_stores(jobs)
        batch = np.fromiter(ids, dtype=np.intp) if not isinstance(ids, np.ndarray) else ids
        moved = np.zeros(batch.size, dtype=np.bool_)
        for job in jobs:
            moved[job.at[job.stored]] = True
        return moved

    def begin_store(self, group: str, ids: Iterable[int]) -> list[SpillJob]:
        """Start spilling ``ids`` one tier down into a stored tier: ``spill_begin`` now (the
        source copy stays authoritative), the copies written by workers; :meth:`poll` (or
        :meth:`settle_stores`) fires ``spill_done`` where the tier took them and ``spill_fail``
        elsewhere, and forgets a source copy a relay (disk -> remote) found gone or bad for
        good. Blocks whose spill would not go into a stored tier, or into one backing off, are
        left alone. Returns the jobs (one per group batch), empty when nothing began."""
        with self._lock:
            core = self.core
            state = core.group(group)
            batch = ids if isinstance(ids, np.ndarray) else np.fromiter(ids, dtype=np.intp)
            batch = batch.astype(np.intp, copy=False)
            table = state.table
            after = table.next_state[state.states[batch], Event.SPILL_BEGIN]
            ok_after = np.where(after != INVALID, after, 0)
            target_of = np.where(after != INVALID, table.storing_to[ok_after], -1)
            into_store = target_of >= 0
            for tier, health in self.health.items():
                if not health.usable():
                    into_store &= target_of != int(tier)
            for code in {int(t) for t in target_of[into_store].tolist()}:
                if Tier(code) not in self.tiers:
                    into_store &= target_of != code
            began = np.zeros(batch.size, dtype=np.bool_)
            began[into_store] = core.fire(group, batch[into_store], Event.SPILL_BEGIN,
                                          masked=True)
            if not began.any():
                return []
            at = np.flatnonzero(began)
            going = batch[at]
            target = table.storing_to[state.states[going]]
            source = table.residency[state.states[going]]
            job = SpillJob(group, going, at)
            for pair in {(int(t), int(s)) for t, s in zip(target.tolist(), source.tolist(),
                                                           strict=True)}:
                where = np.flatnonzero((target == pair[0]) & (source == pair[1]))
                per_task = min(-(-where.size // self._workers), CHUNK_BLOCKS)
                for first in range(0, where.size, per_task):
                    part = where[first:first + per_task]
                    job.parts.append((part, self._start_store(group, going[part],
                                                              Tier(pair[1]), Tier(pair[0]))))
                    job.targets.append(Tier(pair[0]))
            self._stores.append(job)
            return [job]

    def settle_stores(self, jobs: Sequence[SpillJob] | None = None) -> int:
        """Complete the spills of ``jobs`` (None: every open one) whose copies are all written:
        ``spill_done`` where the tier holds the copy, ``spill_fail`` elsewhere (the source copy
        stays), a relay's lost source forgotten. Jobs still writing are left for a later call.
        Returns how many jobs were settled."""
        with self._lock:
            settled = 0
            for job in list(self._stores if jobs is None else jobs):
                if job.settled or not all(future.done() for _, future in job.parts):
                    continue
                self._settle_store(job)
                settled += 1
            self._stores = [job for job in self._stores if not job.settled]
            return settled

    def _settle_store(self, job: SpillJob) -> None:
        core = self.core
        stored = np.zeros(job.ids.size, dtype=np.bool_)
        lost = np.zeros(job.ids.size, dtype=np.bool_)
        for (part, future), tier in zip(job.parts, job.targets, strict=True):
            health = self.health.get(tier)
            try:
                stored[part], lost[part] = future.result()
            except cf.CancelledError:  # left behind when the tier failed (see _failed)
                stored[part] = False
                continue
            except Exception as exc:  # a tier that raised: nothing it wrote is trusted
                stored[part] = False
                if health is not None:
                    self._failed(tier, f"{type(exc).__name__}: {exc}")
                continue
            if health is not None:
                store = self.tiers[tier]
                if not bool(getattr(store, "available", True)):
                    self._failed(tier, str(getattr(store, "last_error", None) or "puts failed"))
                elif stored[part].any():
                    health.answered()
        job.settled = True
        job.stored = stored
        core.fire(job.group, job.ids[stored], Event.SPILL_DONE)
        core.fire(job.group, job.ids[~stored], Event.SPILL_FAIL)
        core.fire(job.group, job.ids[lost & ~stored], Event.EVICT, masked=True)

    def remove(self, tier: Tier, keys: Sequence[BlockKey]) -> None:
        """Drop ``keys``' copies from ``tier`` on a worker (best effort: a copy left behind
        is never loaded without its block, and the tier's own cap evicts it in time)."""
        store = self.tiers.get(tier)
        if store is None or not keys:
            return
        if self._closing:  # the workers are gone: the settles of close() remove in place
            _remove(store, list(keys))
            return
        future = self._run_on(tier, "store", _remove, store, list(keys))
        self._removing = {key: done for key, done in self._removing.items()
                          if not done.done()}
        self._removing.update(dict.fromkeys(keys, future))

    @property
    def stores_in_flight(self) -> list[SpillJob]:
        """Spills begun and not yet settled."""
        return [job for job in self._stores if not job.settled]

    def _start_store(self, group: str, ids: IdArray, source: Tier, target: Tier
                     ) -> cf.Future[_Stored]:
        keys = self.keys.keys(group, ids)
        if self._removing:
            # The same copy written again right after its block left the tier: the removal
            # (a local unlink, queued first) must not land after the new copy.
            cf.wait([self._removing[key] for key in keys if key in self._removing])
        into = self.tiers.get(target)
        nothing = np.zeros(ids.size, dtype=np.bool_)
        if into is None:
            return _done((nothing, nothing))
        if source is Tier.HOST:
            rows, sums = self.core.spill_rows(group, ids)
            return self._run_on(target, "store", _put, into, keys, rows, sums)
        origin = self.tiers.get(source)
        if origin is None:
            return _done((nothing, nothing))
        width = self.core.group(group).decl.payload_bytes
        return self._run_on(target, "store", _relay, origin, into, keys, width)

    def _run_on(self, tier: Tier, direction: str, call: Callable[..., _T], *args: Any
                ) -> cf.Future[_T]:
        """``call(*args)`` on ``tier``'s worker threads for ``direction``, made on first use.
        Under the pools' lock: a failure retiring them (:meth:`_failed`) cannot come between
        finding them and handing them the call."""
        with self._pools_lock:
            pool = self._pools.get((tier, direction))
            if pool is None:
                pool = self._pools[tier, direction] = cf.ThreadPoolExecutor(
                    max_workers=self._workers,
                    thread_name_prefix=f"kvfsm-{direction}-{tier.spec_name}")
            return pool.submit(call, *args)

    def close(self) -> None:
        """Stop the workers: I/O not started is cancelled, running I/O is waited for (each
        tier bounds its own calls), then every load and spill is settled, so no block is left
        restoring or spilling (tiers are the caller's to close)."""
        with self._pools_lock:
            pools = [*self._pools.values(), *self._abandoned]
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        self._closing = True
        with self._lock:
            self.settle_all(self._open)
            self._open = [load for load in self._open if not load.settled]
            self.settle_stores()

    def __enter__(self) -> RestoreExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _busy(pool: cf.ThreadPoolExecutor) -> bool:
    """Whether a pool left behind still has a thread in a call."""
    return any(thread.is_alive() for thread in getattr(pool, "_threads", ()))


def _put(into: StoredTier, keys: Sequence[BlockKey], rows: Sequence[Any],
         sums: NDArray[np.uint64]) -> _Stored:
    return np.asarray(into.put(keys, rows, sums), dtype=np.bool_), np.zeros(len(keys), np.bool_)


def _merged(first: GroupOutcome, then: GroupOutcome) -> GroupOutcome:
    """One group's outcomes over two rounds of a restore."""
    statuses = dict(first.statuses)
    for name, count in then.statuses.items():
        statuses[name] = statuses.get(name, 0) + count
    return GroupOutcome(first.group, (*first.restored, *then.restored),
                        (*first.failed, *then.failed), (*first.lost, *then.lost),
                        (*first.pending, *then.pending), statuses,
                        first.bytes_loaded + then.bytes_loaded)


def _remove(store: StoredTier, keys: list[BlockKey]) -> None:
    with contextlib.suppress(Exception):  # best effort: see RestoreExecutor.remove
        store.remove(keys)


def _load(store: StoredTier, fields: KeyFields, begin: int, end: int, rows: Sequence[Any],
          seconds: list[float]) -> LoadResult:
    """One worker task: build the keys of blocks ``[begin, end)`` of a batch and load them;
    ``seconds[0]`` gets how long it took."""
    started = time.perf_counter()
    try:
        return store.load_into(fields.build(begin, end), rows)
    finally:
        seconds[0] = time.perf_counter() - started


def _relay(origin: StoredTier, into: StoredTier, keys: Sequence[BlockKey],
           width: int) -> _Stored:
    """Copy verified values from one stored tier to another (disk -> remote): which were
    stored, and which source copies the load found gone or bad for good."""
    buffers = np.empty((len(keys), width), dtype=np.uint8)
    loaded = origin.load_into(keys, list(buffers))
    ok = loaded.ok
    lost = _IS_LOST[loaded.status]
    stored = np.zeros(len(keys), dtype=np.bool_)
    if ok.any():
        chosen = np.flatnonzero(ok)
        stored[chosen] = into.put([keys[i] for i in chosen.tolist()], list(buffers[chosen]),
                                  loaded.checksum[chosen])
    return stored, lost


#: Per load status value: the stored copy is gone or bad for good.
_IS_LOST = np.zeros(256, dtype=np.bool_)
_IS_LOST[[int(s) for s in LoadStatus if s.lost]] = True
_STATUS_COUNT = max(int(s) for s in LoadStatus) + 1
_STATUS_NAMES = {int(s): s.name for s in LoadStatus}
#: What became of a block a settle saw: readable, rolled back (copy kept), rolled back and
#: forgotten (copy gone or bad), or done but refused by a later step of its path.
_RESTORED, _FAILED, _LOST_COPY, _NEITHER = 0, 1, 2, 3


def _fire(core: StateCore, group: str, ids: IdArray, event: Event) -> NDArray[np.bool_]:
    """A masked fire that skips empty batches (most settles have nothing to roll back)."""
    if not ids.size:
        return np.zeros(0, dtype=np.bool_)
    return core.fire(group, ids, event, masked=True)


def _all(count: int, status: LoadStatus) -> LoadResult:
    return LoadResult(np.full(count, int(status), dtype=np.uint8),
                      np.zeros(count, dtype=np.uint64))


def _done(value: _Stored) -> cf.Future[_Stored]:
    future: cf.Future[_Stored] = cf.Future()
    future.set_result(value)
    return future
