"""The engine's stored tiers (disk, remote): discovering their copies, forgetting copies they
evicted, spilling down into them and restoring from them.

What a block records of its stored copies is one bit per tier; the tier is the truth about what
it holds. This module keeps the two in step from the engine's side: a copy the tier's own size
cap evicted is forgotten once no state still leans on it (a block restored from it keeps the bit
until it is evicted back to the tier), blocks the caller is about to use are never spilled or
forgotten to make room, and a device batch larger than the host pool still moves down through
host to disk rather than being dropped while the tiers below have room.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Mapping

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm.fsm import INVALID
from kvfsm.lookup import Verdict
from kvfsm.restore import RestoreExecutor, RestoreTicket, SpillJob
from kvfsm.spec import Event, Tier
from kvfsm.spec._vocabulary import STORED_TIERS
from kvfsm.state import GroupState, Prompt, StateCore
from kvfsm.tiers import BlockKey, StoredTier

IdArray = NDArray[np.intp]
#: How often a wait for copies looks again at whether their tier still answers.
_WAIT_SLICE_S = 0.02


def check_tiers(core: StateCore, tiers: Mapping[Tier | str, StoredTier]) -> dict[Tier, StoredTier]:
    """``tiers`` keyed by ``Tier``, each one a stored tier the config gives blocks to, or a
    KvfsmError naming what is wrong."""
    out: dict[Tier, StoredTier] = {}
    for name, store in tiers.items():
        try:
            tier = Tier[name.upper()] if isinstance(name, str) else Tier(name)
        except (KeyError, ValueError):
            raise KvfsmError(f"Engine(tiers=...): unknown tier {name!r}; stored tiers are "
                             "'disk' and 'remote'") from None
        if tier not in STORED_TIERS:
            raise KvfsmError(f"Engine(tiers=...): {tier.spec_name} is a pool the core owns, "
                             "not a stored tier; pass 'disk' or 'remote'")
        if not isinstance(store, StoredTier):
            raise KvfsmError(f"Engine(tiers=...): {tier.spec_name} must be a StoredTier "
                             f"(DiskTier, MooncakeTier, RedisTier), got {type(store).__name__}")
        if not any(tier in group.stored for group in core.groups.values()):
            raise KvfsmError(f"Engine(tiers=...): a {tier.spec_name} tier was given but no "
                             f"group keeps blocks there: set CoreConfig.{tier.spec_name}_blocks")
        out[tier] = store
    for tier in STORED_TIERS:
        setting = f"{tier.spec_name}_blocks"
        if tier not in out and any(tier in group.stored for group in core.groups.values()):
            raise KvfsmError(f"CoreConfig.{setting} gives blocks a {tier.spec_name} copy but no "
                             f"{tier.spec_name} tier is attached: pass tiers={{"
                             f"{tier.spec_name!r}: ...}} or leave {setting} at 0")
    if Tier.REMOTE in out and Tier.DISK not in out and any(
            Tier.HOST in group.pools for group in core.groups.values()):
        raise KvfsmError("Engine(tiers=...): a remote tier is written from disk (host -> disk "
                         "-> remote), and no disk tier is attached, so this engine's spilled "
                         "blocks would never reach the remote store: attach a DiskTier, or "
                         "set host_blocks=0 for an engine that only reads what others stored")
    return out


@attrs.frozen(eq=False)
class PresenceAsk:
    """The keys of one group's blocks (prompt block indices ``missing``) the core does not
    know, to ask ``tiers`` (fastest first) about."""

    group: str
    tiers: tuple[Tier, ...]
    missing: NDArray[np.int64]
    keys: list[BlockKey]


@attrs.frozen(eq=False)
class PresenceAnswer:
    """Per block of ``ask``: the tier that holds its copy (fastest first), -1 where none."""

    ask: PresenceAsk
    found_in: NDArray[np.int64]


@attrs.define
class Spills:
    """What :meth:`EngineTiers.start_spills` did: blocks evicted at once, the jobs spilling
    the asked tier's blocks, and the jobs making room below it."""

    evicted: int = 0
    own: list[SpillJob] = attrs.field(factory=list)
    below: list[SpillJob] = attrs.field(factory=list)


class _DiskFiles:
    """Removes a block's disk file when its disk slot goes (evicted, invalidated, relayed on
    to remote): the files are exactly the copies the core counts in ``disk_blocks``, so disk
    use follows the core's bound and a restarted engine finds every file it left. The keys
    are made as the block moves (its identity is still recorded); the files are removed on
    a worker, never under the engine's lock."""

    observes_reads = False

    def __init__(self, core: StateCore, restorer: RestoreExecutor) -> None:
        self._core = core
        self._restorer = restorer
        self._holds = {name: group.table.holds_slot[:, int(Tier.DISK)]
                       for name, group in core.groups.items()
                       if int(Tier.DISK) < group.table.holds_slot.shape[1]}

    def moved(self, group: str, event: Event, ids: IdArray, before: NDArray[np.uint8],
              after: NDArray[np.uint8], epochs: NDArray[np.uint32]) -> None:
        holds = self._holds.get(group)
        if holds is None or not holds.any():
            return
        gone = ids[holds[before] & ~holds[after]]
        if gone.size:
            self._restorer.remove(Tier.DISK, self._restorer.keys.keys(group, gone))

    def read(self, group: str, ids: IdArray, epochs: NDArray[np.uint32]) -> None:
        """Reads change no file."""


def _usable_somewhere(group: GroupState, high: NDArray[np.uint64], low: NDArray[np.uint64],
                      missing: NDArray[np.int64], found_in: NDArray[np.int64]
                      ) -> NDArray[np.bool_]:
    """Per missing block: some length of the prompt needs it, by the kind's rule, with every
    block that length needs known to the core or found in a tier (a full group's blocks past
    its first hole are of no use; a window or a snapshot past a hole may be)."""
    decl = group.decl
    size = decl.block_size
    n_blocks = high.size
    present = np.ones(n_blocks, dtype=np.bool_)  # known, or not kept by a prefill at all
    present[missing] = found_in >= 0
    lengths = np.arange(1, n_blocks + 1, dtype=np.int64) * size
    needed = group.rule.needed(decl, lengths)
    holes = np.concatenate([[0], np.cumsum(~present)])
    whole = holes[needed.hi] - holes[needed.lo] == 0
    if needed.servable is not None:
        whole &= needed.servable
    # Blocks inside [lo, hi) of some whole length: +1 at lo, -1 at hi, a running sum.
    marks = np.zeros(n_blocks + 1, dtype=np.int64)
    np.add.at(marks, needed.lo[whole], 1)
    np.add.at(marks, needed.hi[whole], -1)
    wanted: NDArray[np.bool_] = (np.cumsum(marks)[:n_blocks] > 0)[missing]
    return wanted


def _kept(size: int, keep: ArrayLike) -> IdArray:
    """The ids of ``keep`` that name blocks (others are ignored)."""
    kept = np.asarray(keep, dtype=np.intp).ravel()
    in_range: IdArray = kept[(kept >= 0) & (kept < size)]
    return in_range


class EngineTiers:
    """The stored-tier side of an :class:`~kvfsm.Engine` (``core``, its checked ``tiers`` and
    the ``restorer`` running I/O against them)."""

    def __init__(self, core: StateCore, tiers: Mapping[Tier, StoredTier],
                 restorer: RestoreExecutor, lock: threading.RLock) -> None:
        self.core = core
        self.tiers = dict(tiers)
        self.restorer = restorer
        self._lock = lock
        if Tier.DISK in self.tiers:
            # One occupancy for core and directory: a block leaving disk takes its file along.
            core.add_observer(_DiskFiles(core, restorer))
        #: Per tier, keys the tier reported evicted whose block could not be forgotten yet (it
        #: was restoring, or restored and still holding the copy's bit): looked at again by
        #: every :meth:`forget_evicted` until the block lands back on that tier or goes.
        self._gone: dict[Tier, dict[BlockKey, None]] = {tier: {} for tier in self.tiers}

    # -- discovery ---------------------------------------------------------------------------

    def asks(self, prompt: Prompt) -> list[PresenceAsk]:
        """Under the engine's lock: per group and stored tier, the keys of ``prompt``'s blocks
        the core does not know that the tier may hold (what :meth:`answer` asks the tiers
        and :meth:`adopt` adopts). Costs the prompt's blocks once; no I/O."""
        out: list[PresenceAsk] = []
        for group in self.core.groups.values():
            tiers = [t for t in sorted(group.stored) if t in self.tiers]
            if not tiers:
                continue
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            index = group.rule.commit_blocks(decl, high.size)
            known = self.core.lookup_words(group.name, high[index], low[index]) >= 0
            missing = index[~known]
            if missing.size:
                keys = self.restorer.keys.prompt_keys(group.name, high, low, missing)
                out.append(PresenceAsk(group.name, tuple(tiers), missing, keys))
        return out

    def answer(self, asks: list[PresenceAsk], deadline_s: float | None) -> list[PresenceAnswer]:
        """Without the engine's lock: which tier holds each asked key, the fastest first (-1:
        none). A tier that does not answer within ``deadline_s`` (None: no limit) counts as
        holding nothing this time; its answer is not waited for by anyone else."""
        out = []
        for ask in asks:
            found_in = np.full(ask.missing.size, -1, dtype=np.int64)
            for tier in ask.tiers:
                unsure = np.flatnonzero(found_in < 0)
                if not unsure.size:
                    break
                held = self.restorer.presence(self.tiers[tier], [ask.keys[i] for i in
                                                                 unsure.tolist()], deadline_s)
                found_in[unsure[held]] = int(tier)
            out.append(PresenceAnswer(ask, found_in))
        return out

    def adopt(self, prompt: Prompt, answers: list[PresenceAnswer]) -> int:
        """Under the engine's lock: adopt what ``answers`` found that some length of the
        prompt could use, by each kind's rule (a full group's blocks up to its first hole,
        the windows and snapshots around any hole), each from the fastest tier holding it,
        as room in that tier's logical ids allows. Blocks the core learned of meanwhile are
        left alone. Returns the blocks adopted."""
        adopted = 0
        for answer in answers:
            group = self.core.group(answer.ask.group)
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            missing, found_in = answer.ask.missing, answer.found_in
            useful = found_in >= 0
            if not useful.any():
                continue
            useful &= _usable_somewhere(group, high, low, missing, found_in)
            # Learned meanwhile (another thread's commit or discovery): not a miss any more.
            useful[useful] &= self.core.lookup_words(group.name, high[missing[useful]],
                                                     low[missing[useful]]) < 0
            for tier in answer.ask.tiers:
                chosen = missing[useful & (found_in == int(tier))]
                room = min(group.stored[tier] - group.stored_used(tier), group.free_top)
                chosen = chosen[:max(room, 0)]
                if chosen.size:
                    self.core.discover(group.name, chosen, high[chosen], low[chosen], tier)
                    adopted += int(chosen.size)
        return adopted

    def discover(self, prompt: Prompt, deadline_s: float | None = None) -> int:
        """See :meth:`kvfsm.Engine.discover` (asks, answers and adopts in one go)."""
        return self.adopt(prompt, self.answer(self.asks(prompt), deadline_s))

    def forget_evicted(self) -> None:
        """Blocks whose only copy is in a stored tier that has since evicted it (its own size
        cap) are forgotten, so they stop being hits. A block still restoring from the copy, or
        restored from it (``device_disk``: readable, holding the copy's bit), is forgotten once
        it is back on the tier and the tier still lacks the copy."""
        for tier, store in self.tiers.items():
            drain = getattr(store, "drain_evicted", None)
            gone = self._gone[tier]
            if drain is not None:
                gone.update(dict.fromkeys(drain()))
            if gone:
                self._forget(tier, store, gone)

    def _forget(self, tier: Tier, store: StoredTier, gone: dict[BlockKey, None]) -> None:
        by_group: dict[str, list[BlockKey]] = {}
        for key in list(gone):
            name = self.restorer.keys.group_of.get(key.group)
            if name is None:
                del gone[key]
            else:
                by_group.setdefault(name, []).append(key)
        for name, keys in by_group.items():
            group = self.core.group(name)
            table = group.table
            words = np.array([(k.chain_high, k.chain_low) for k in keys], dtype=np.uint64)
            ids = self.core.lookup_words(name, words[:, 0], words[:, 1])
            known = ids >= 0
            own = np.zeros(ids.size, dtype=np.bool_)
            if known.any():
                # The evicted file was this block's copy (same layout and range) and the block
                # still records holding it.
                current = self.restorer.keys.keys(name, ids[known])
                own[known] = np.array([a == b for a, b in
                                       zip(current, [keys[i] for i in np.flatnonzero(known)],
                                           strict=True)], dtype=np.bool_)
                own &= np.where(known, group.holds(tier)[np.maximum(ids, 0)], False)
            states = group.states[np.maximum(ids, 0)]
            waiting = own & (table.in_flight[states] | (table.residency[states] != int(tier)))
            back = own & ~waiting
            if back.any():
                # A copy written again since the eviction (the block was recomputed and
                # spilled anew) is the block's copy now: keep it.
                chosen = np.flatnonzero(back)
                there = store.contains([keys[i] for i in chosen.tolist()])
                self.core.fire(name, ids[chosen[~there]], Event.EVICT, masked=True)
            for i in np.flatnonzero(~waiting).tolist():
                del gone[keys[i]]

    # -- spills ------------------------------------------------------------------------------

    def below(self, group: GroupState, tier: Tier) -> Tier | None:
        """The stored tier blocks resting in ``tier`` spill into now: attached, kept by the
        group, and answering (not backing off; a remote tier that failed has answered a
        presence question since) (None: none, they are evicted instead)."""
        if int(tier) + 1 >= len(Tier):
            return None
        under = Tier(int(tier) + 1)
        if under not in group.stored or under not in self.tiers:
            return None
        health = self.restorer.health.get(under)
        return None if health is not None and not health.usable() else under

    def start_spills(self, group: str, tier: Tier, count: int, keep: ArrayLike = ()
                     ) -> Spills:
        """Under the lock, without waiting: move up to ``count`` of the oldest unpinned blocks
        resting in ``tier`` (never one of ``keep``) a tier down. Into a stored tier the copies
        are written by workers (the blocks leave ``tier`` once
        :meth:`RestoreExecutor.settle_stores` sees them written); room there is made first
        the same way, the last stored tier's oldest blocks evicted. Where nothing below takes
        them (or has room now), blocks resting in a stored tier are evicted; host blocks stay
        (the call that needs their room evicts what it must)."""
        spills = Spills()
        if count <= 0:
            return spills
        core = self.core
        state = core.group(group)
        resting = state.resting_lists.get(Tier(tier))
        if resting is None:
            return spills  # no state of this lifecycle rests there
        # The oldest unpinned blocks resting there (a recency list: costs what it walks).
        ids = state.oldest(resting, count, _kept(state.n_blocks, keep))
        if not ids.size:
            return spills
        under = self.below(state, Tier(tier))
        room = 0
        if under is not None:
            room = state.stored[under] - state.stored_used(under)
            if room < ids.size:
                deeper = self.start_spills(group, under, ids.size - room, keep)
                spills.below += deeper.own + deeper.below
                room = state.stored[under] - state.stored_used(under)
            spills.own += self.restorer.begin_store(group, ids[:max(room, 0)])
        if tier in STORED_TIERS:
            rest = ids[max(room, 0):]
            spills.evicted += int(core.fire(group, rest, Event.EVICT, masked=True).sum())
        return spills

    def spill_from_device(self, group: str, ids: IdArray) -> NDArray[np.bool_]:
        """Spill readable device blocks ``ids`` (oldest first) to host, as far as host has
        room now (nothing is waited for: the engine makes host room beforehand, without its
        lock). Returns which of ``ids`` moved (the rest stay on device)."""
        core = self.core
        state = core.group(group)
        spilled = np.zeros(ids.size, dtype=np.bool_)
        host = state.pools.get(Tier.HOST)
        if host is None or not ids.size:
            return spilled
        part = np.flatnonzero(state.event_row(Event.SPILL_BEGIN)[state.states[ids]])
        part = part[:host.free]
        if not part.size:
            return spilled
        batch = ids[part]
        began = core.fire(group, batch, Event.SPILL_BEGIN, masked=True)
        done = np.zeros(batch.size, dtype=np.bool_)
        done[began] = core.fire(group, batch[began], Event.SPILL_DONE, masked=True)
        core.fire(group, batch[began & ~done], Event.SPILL_FAIL)
        spilled[part[done]] = True
        return spilled

    def make_room(self, needs: Callable[[], Mapping[str, int]],
                  give_back: Callable[[str, int, ArrayLike], int],
                  keep: Callable[[str], ArrayLike] = lambda group: ()) -> None:
        """Before a call that needs device slots (a commit, a restore, an offload): per group
        ``needs()`` slots (asked afresh each round) are given back ahead of it the way the call
        itself would (``give_back``: to host where it has room), and host room is made by
        moving host's oldest blocks down the stored tiers, their copies written and waited for
        *without the engine's lock*, round after round (a full disk relays its oldest to
        remote first), for at most ``StoreTimeouts.spill_wait_s``. Never a block of
        ``keep(group)``. What has not landed by then stays where it is, and the call evicts
        what it must. Costs nothing where the device has the room."""
        if not self.tiers:
            return
        deadline = time.monotonic() + self.restorer.timeouts.spill_wait_s
        self.restorer.probe(self.tiers)  # a failed tier that answers again takes spills
        while True:
            jobs: list[SpillJob] = []
            gave = 0
            with self._lock:
                self.restorer.poll()
                for group, count in needs().items():
                    if count <= 0:
                        continue
                    host = self.core.group(group).pools.get(Tier.HOST)
                    if host is None:
                        continue
                    room = min(count, host.free)
                    if room:
                        gave += give_back(group, room, keep(group))
                        count -= room
                    short = self.host_short(group, count)
                    if short:
                        spills = self.start_spills(group, Tier.HOST, short, keep(group))
                        jobs += spills.own + spills.below
                        gave += spills.evicted
            if jobs:
                in_time = self._wait(jobs, deadline)
                with self._lock:
                    self.restorer.poll()
                landed = sum(int(job.stored.sum()) for job in jobs if job.settled)
                if not in_time or not (landed or gave):
                    break  # out of time, or the tiers below took nothing: stop asking
            elif not gave or time.monotonic() >= deadline:
                break
        with self._lock:
            self.restorer.poll()

    def spill_down(self, group: str, tier: Tier, count: int, keep: ArrayLike = ()) -> int:
        """See :meth:`kvfsm.Engine.spill_down`: rounds of :meth:`start_spills`, copies waited
        for without the engine's lock (at most ``StoreTimeouts.spill_wait_s``)."""
        deadline = time.monotonic() + self.restorer.timeouts.spill_wait_s
        self.restorer.probe(self.tiers)
        moved = 0
        while moved < count:
            with self._lock:
                self.restorer.poll()
                spills = self.start_spills(group, tier, count - moved, keep)
            if not spills.own and not spills.below:
                moved += spills.evicted
                break
            waited = self._wait(spills.own + spills.below, deadline)
            with self._lock:
                self.restorer.poll()
            landed = spills.evicted + sum(int(job.stored.sum()) if job.settled
                                          else int(job.ids.size) for job in spills.own)
            moved += landed
            if not waited or not landed:
                break
        return moved

    def _wait(self, jobs: list[SpillJob], deadline: float) -> bool:
        """Wait for ``jobs``' copies until ``deadline`` (the caller does not hold the lock
        unless it took it itself); True when all were written in time. Copies into a tier
        that stops answering meanwhile are not waited for: they end by its client's timeout,
        and the caller evicts what it must instead. Copies still running after
        ``presence_s`` have their tier asked a presence question (bounded the same), so a
        silent store is found out then, even where no other call asks it anything."""
        restorer = self.restorer
        health = restorer.health
        parts = [(future, tier) for job in jobs
                 for (_, future), tier in zip(job.parts, job.targets, strict=True)]
        asked_at = time.monotonic() + restorer.timeouts.presence_s
        while True:
            waiting = [future for future, tier in parts if not future.done()
                       and (tier not in health or health[tier].usable())]
            now = time.monotonic()
            left = deadline - now
            if not waiting or left <= 0:
                return all(future.done() for future, _ in parts)
            if now >= asked_at:
                asked_at = deadline  # once per wait
                restorer.probe({tier for future, tier in parts if not future.done()},
                               answering=True)
                continue
            cf.wait(waiting, timeout=min(left, asked_at - now, _WAIT_SLICE_S))

    def host_short(self, group: str, device_blocks: int) -> int:
        """Host slots ``group`` lacks now to take ``device_blocks`` spilled device blocks."""
        host = self.core.group(group).pools.get(Tier.HOST)
        return 0 if host is None else max(device_blocks - host.free, 0)

    def offload(self, group: str, ids: IdArray, keep: ArrayLike = ()) -> NDArray[np.bool_]:
        """See :meth:`kvfsm.Engine.offload` (the engine made host room first)."""
        core = self.core
        state = core.group(group)
        table = state.table
        moved = np.zeros(ids.size, dtype=np.bool_)
        if not ids.size:
            return moved
        states = state.states[ids]
        on_device = (table.residency[states] == int(Tier.DEVICE)) & ~table.in_flight[states]
        after_evict = table.next_state[states, int(Event.EVICT)]
        # A restored block that kept its stored copy gives the device slot back and stays a
        # hit on that copy (its eviction lands in a hashed state).
        keeps_copy = on_device & (after_evict != INVALID) & \
            table.hashed[np.where(after_evict == INVALID, 0, after_evict)]
        if keeps_copy.any():
            chosen = np.flatnonzero(keeps_copy)
            moved[chosen] = core.fire(group, ids[chosen], Event.EVICT, masked=True)
        spill = np.flatnonzero(on_device & ~keeps_copy & table.readable[states])
        host = state.pools.get(Tier.HOST)
        if not spill.size or host is None:
            return moved
        protect = np.concatenate([_kept(state.n_blocks, keep), ids]).astype(np.intp)
        short = int(spill.size) - host.free
        resting = state.resting_lists.get(Tier.HOST)
        if short > 0 and resting is not None:
            # What could not move below in time makes way (the newest stay hits).
            oldest = state.oldest(resting, short, protect)
            core.fire(group, oldest, Event.EVICT, masked=True)
        moved[spill] = self.spill_from_device(group, ids[spill])
        return moved

    # -- restores ----------------------------------------------------------------------------

    def restore_keep(self, verdict: Verdict, prompt: Prompt | None
                     ) -> dict[str, NDArray[np.intp]]:
        """Per group the plan restores into: the prompt's blocks its restorable prefix reads
        (room for the restores never gives them back; an array: costs those blocks once,
        never the pool). Blocks past it (the prompt's last block, always computed again)
        may make room: keeping them could leave a device exactly the prefix's size one slot
        short. Nothing without ``prompt``."""
        keep: dict[str, NDArray[np.intp]] = {}
        if prompt is None:
            return keep
        for name in {step.group for step in verdict.plan}:
            group = self.core.group(name)
            size = group.decl.block_size
            needed = -(-verdict.restorable_tokens // size)
            high, low = prompt.words(size)
            ids = self.core.lookup_words(name, high[:needed], low[:needed])
            keep[name] = ids[ids >= 0]
        return keep

    def restore(self, verdict: Verdict, prompt: Prompt | None) -> RestoreTicket:
        """See :meth:`kvfsm.Engine.restore`."""
        return self.restorer.submit(verdict.plan, keep=self.restore_keep(verdict, prompt))
