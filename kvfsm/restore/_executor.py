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
read can never land in a slot that serves another block.

Spills into stored tiers (:meth:`RestoreExecutor.store`) run the same way in the other
direction: ``spill_begin``, copies written by workers, ``spill_done`` where the tier took them.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.restore._keys import KeyMaker
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore
from kvfsm.tiers import BlockKey, LoadResult, LoadStatus, StoredTier
from kvfsm.verify import RestoreStep

IdArray = NDArray[np.intp]
#: ``(group, count, keep)``: give back up to ``count`` device slots, never a block of ``keep``.
MakeRoom = Callable[[str, int, IdArray], int]

#: Blocks per worker task: several tasks per batch let reads overlap checksums on other cores.
CHUNK_BLOCKS = 8


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
    settled: bool = False


class RestoreTicket:
    """The loads one plan started; wait on all of them or on one group's."""

    def __init__(self, executor: RestoreExecutor, loads: list[_Load],
                 immediate: Mapping[str, tuple[int, ...]], notes: tuple[str, ...]) -> None:
        self._executor = executor
        self._loads = loads
        #: Blocks restored without stored-tier I/O (from host), per group.
        self.immediate = dict(immediate)
        #: Steps refused on the way (a guard said no, no row), one line each.
        self.notes = notes
        self._outcomes: dict[str, GroupOutcome] = {}

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({load.group for load in self._loads} | set(self.immediate)))

    def done(self, group: str | None = None) -> bool:
        """Whether every load (of ``group``) has finished its I/O (settled or not)."""
        return all(load.future.done() for load in self._loads
                   if group is None or load.group == group)

    def wait(self, group: str | None = None, timeout: float | None = None
             ) -> Mapping[str, GroupOutcome]:
        """Wait up to ``timeout`` seconds for the loads of ``group`` (all groups: None), settle
        every finished one and return each group's outcome so far. Loads still running stay
        pending: their blocks keep their slots, not readable, until a later wait or poll."""
        loads = [load for load in self._loads if group is None or load.group == group]
        cf.wait([load.future for load in loads if not load.settled], timeout=timeout)
        for load in loads:
            self._executor.settle(load, self)
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
               result: LoadResult) -> None:
        before = self._outcomes.get(load.group, GroupOutcome(load.group))
        statuses = collections.Counter(dict(before.statuses))
        statuses.update(LoadStatus(int(s)).name for s in result.status.tolist())
        width = self._executor.core.group(load.group).decl.payload_bytes
        self._outcomes[load.group] = attrs.evolve(
            before, restored=(*before.restored, *restored.tolist()),
            failed=(*before.failed, *failed.tolist()), lost=(*before.lost, *lost.tolist()),
            statuses=dict(statuses),
            bytes_loaded=before.bytes_loaded + int(result.ok.sum()) * width)


class RestoreExecutor:
    """Runs restore plans and spills against ``core`` with the stored ``tiers``.

    Drive it from the thread that drives the core (it fires there); ``workers`` threads do the
    I/O. ``make_room`` gives back device slots before restores take them (the engine's
    ``give_back``); without it a plan needing more slots than are free fails its
    ``restore_begin`` (``has_room``) and recomputes.
    """

    def __init__(self, core: StateCore, tiers: Mapping[Tier, StoredTier], *,
                 workers: int = 2, make_room: MakeRoom | None = None) -> None:
        if workers < 1:
            raise KvfsmError(f"RestoreExecutor needs at least one worker, got {workers}")
        self.core = core
        self.tiers = dict(tiers)
        self.keys = KeyMaker(core)
        self._make_room = make_room
        self._pool = cf.ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix="kvfsm-restore")
        self._open: list[tuple[_Load, RestoreTicket]] = []

    # -- restores --------------------------------------------------------------------------

    def submit(self, plan: Sequence[RestoreStep], keep: Mapping[str, Iterable[int]] | None = None
               ) -> RestoreTicket:
        """Start every step of ``plan`` (``Verdict.plan``): fire up to ``restore_begin`` now,
        host copies complete at once, stored copies load on workers. ``keep``: per group,
        blocks ``make_room`` must not give back (the prompt's own)."""
        core = self.core
        if self._make_room is not None:
            for name in sorted({step.group for step in plan}):
                wanted = sum(Event.RESTORE_BEGIN in step.path for step in plan
                             if step.group == name)
                own = np.fromiter((keep or {}).get(name, ()), dtype=np.intp)
                self._make_room(name, wanted - core.group(name).pools[Tier.DEVICE].free, own)
        batches: dict[tuple[str, tuple[Event, ...]], list[RestoreStep]] = {}
        for step in plan:
            batches.setdefault((step.group, step.path), []).append(step)
        loads: list[_Load] = []
        immediate: dict[str, list[int]] = collections.defaultdict(list)
        notes: list[str] = []
        for (group, path), steps in batches.items():
            ids = np.array([step.block_id for step in steps], dtype=np.intp)
            for position, event in enumerate(path):
                moved = core.fire(group, ids, event, masked=True)
                refused = ids[~moved]
                notes += self._refused(group, refused, event)
                if event is Event.RESTORE_DONE and refused.size:
                    # The host copy arrived different from its checksum: drop it, recompute.
                    core.fire(group, refused, Event.RESTORE_FAIL, masked=True)
                    core.fire(group, refused, Event.INVALIDATE, masked=True)
                ids = ids[moved]
                if event is Event.RESTORE_BEGIN:
                    loading = core.group(group).table.loading[core.group(group).states[ids]]
                    loads += self._start_loads(group, ids[loading], path[position + 1:])
                    ids = ids[~loading]
            immediate[group] += ids.tolist()
        ticket = RestoreTicket(self, loads, {g: tuple(v) for g, v in immediate.items()},
                               tuple(notes))
        self._open += [(load, ticket) for load in loads]
        return ticket

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
            for start in range(0, chosen.size, CHUNK_BLOCKS):
                part = chosen[start:start + CHUNK_BLOCKS]
                rows: list[Any] = (list(np.empty((part.size, state.decl.payload_bytes), np.uint8))
                                   if staged else core.restore_rows(group, part))
                keys = self.keys.keys(group, part)
                future: cf.Future[LoadResult]
                if store is None:
                    future = cf.Future()
                    future.set_result(_all(len(keys), LoadStatus.FAILED))
                else:
                    future = self._pool.submit(store.load_into, keys, rows)
                loads.append(_Load(group, tier, part, rows, staged, then, future))
        return loads

    def settle(self, load: _Load, ticket: RestoreTicket) -> None:
        """Complete the transitions of a finished load (caller's thread)."""
        if load.settled or not load.future.done():
            return
        load.settled = True
        core = self.core
        try:
            result = load.future.result()
        except Exception:  # a tier that raised: nothing it loaded is trusted
            result = _all(load.ids.size, LoadStatus.FAILED)
        ok = result.ok
        good = load.ids[ok]
        if good.size:
            core.record_loaded(load.group, good, result.checksum[ok],
                               np.stack([load.rows[i] for i in np.flatnonzero(ok)])
                               if load.staged else None, verified=not load.staged)
        done = core.fire(load.group, good, Event.RESTORE_DONE, masked=True)
        restored = good[done]
        lost_mask = np.array([LoadStatus(int(s)).lost for s in result.status.tolist()],
                             dtype=np.bool_)
        rolled = np.concatenate([good[~done], load.ids[~ok]])
        core.fire(load.group, rolled, Event.RESTORE_FAIL, masked=True)
        # A copy that is gone or bad for good is forgotten; one that failed to verify after
        # arriving whole is forgotten too (its bytes cannot be trusted twice).
        lost = np.concatenate([good[~done], load.ids[~ok & lost_mask]])
        core.fire(load.group, lost, Event.EVICT, masked=True)
        for event in load.then:
            if event is not Event.RESTORE_DONE and restored.size:
                restored = restored[core.fire(load.group, restored, event, masked=True)]
        failed = load.ids[~ok & ~lost_mask]
        ticket.record(load, restored, failed, lost, result)

    def poll(self) -> int:
        """Settle every load whose I/O has finished; returns how many loads were settled."""
        settled = 0
        still: list[tuple[_Load, RestoreTicket]] = []
        for load, ticket in self._open:
            if not load.settled:
                self.settle(load, ticket)
            if load.settled:
                settled += 1
            else:
                still.append((load, ticket))
        self._open = still
        return settled

    @property
    def loads_in_flight(self) -> int:
        return sum(not load.settled for load, _ in self._open)

    # -- spills into stored tiers --------------------------------------------------------------

    def store(self, group: str, ids: Iterable[int], *, timeout: float | None = None
              ) -> NDArray[np.bool_]:
        """Spill ``ids`` one tier down into a stored tier (host -> disk, disk -> remote) and
        wait: ``spill_begin``, the copies written by workers, ``spill_done`` where the tier
        holds them, ``spill_fail`` elsewhere. Returns which blocks moved."""
        core = self.core
        state = core.group(group)
        batch = np.fromiter(ids, dtype=np.intp)
        moved = np.zeros(batch.size, dtype=np.bool_)
        began = core.fire(group, batch, Event.SPILL_BEGIN, masked=True)
        going = batch[began]
        target = state.table.storing_to[state.states[going]]
        source = state.table.residency[state.states[going]]
        stored = np.zeros(going.size, dtype=np.bool_)
        jobs: list[tuple[NDArray[np.intp], cf.Future[NDArray[np.bool_]]]] = []
        for pair in {(int(t), int(s)) for t, s in zip(target.tolist(), source.tolist(),
                                                       strict=True)}:
            where = np.flatnonzero((target == pair[0]) & (source == pair[1]))
            for start in range(0, where.size, CHUNK_BLOCKS):
                part = where[start:start + CHUNK_BLOCKS]
                jobs.append((part, self._start_store(group, going[part], Tier(pair[1]),
                                                     Tier(pair[0]))))
        cf.wait([future for _, future in jobs], timeout=timeout)
        for part, future in jobs:
            # A put still running after the timeout is waited for: its source bytes must
            # stay where they are until it ends.
            try:
                stored[part] = future.result()
            except Exception:
                stored[part] = False
        core.fire(group, going[stored], Event.SPILL_DONE)
        core.fire(group, going[~stored], Event.SPILL_FAIL)
        moved[np.flatnonzero(began)[stored]] = True
        return moved

    def _start_store(self, group: str, ids: IdArray, source: Tier, target: Tier
                     ) -> cf.Future[NDArray[np.bool_]]:
        keys = self.keys.keys(group, ids)
        into = self.tiers.get(target)
        if into is None:
            return _done(np.zeros(ids.size, dtype=np.bool_))
        if source is Tier.HOST:
            rows, sums = self.core.spill_rows(group, ids)
            return self._pool.submit(into.put, keys, rows, sums)
        origin = self.tiers.get(source)
        if origin is None:
            return _done(np.zeros(ids.size, dtype=np.bool_))
        width = self.core.group(group).decl.payload_bytes
        return self._pool.submit(_relay, origin, into, keys, width)

    def close(self) -> None:
        """Wait for running I/O and stop the workers (tiers are the caller's to close)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RestoreExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _relay(origin: StoredTier, into: StoredTier, keys: Sequence[BlockKey],
           width: int) -> NDArray[np.bool_]:
    """Copy verified values from one stored tier to another (disk -> remote)."""
    buffers = np.empty((len(keys), width), dtype=np.uint8)
    loaded = origin.load_into(keys, list(buffers))
    ok = loaded.ok
    stored = np.zeros(len(keys), dtype=np.bool_)
    if ok.any():
        chosen = np.flatnonzero(ok)
        stored[chosen] = into.put([keys[i] for i in chosen.tolist()], list(buffers[chosen]),
                                  loaded.checksum[chosen])
    return stored


def _all(count: int, status: LoadStatus) -> LoadResult:
    return LoadResult(np.full(count, int(status), dtype=np.uint8),
                      np.zeros(count, dtype=np.uint64))


def _done(value: NDArray[np.bool_]) -> cf.Future[NDArray[np.bool_]]:
    future: cf.Future[NDArray[np.bool_]] = cf.Future()
    future.set_result(value)
    return future
