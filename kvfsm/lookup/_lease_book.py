"""The book of one engine's leases: it hands them out (from a lookup's probe where it can, else
by probing the prompt again), keeps the open ones, and releases the expired.

What a lease holds and how it is validated and given back is :mod:`kvfsm.lookup._lease`'s.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.fsm import FORM_COMPRESSED, FORM_RAW
from kvfsm.lookup._lease import DEFAULT_LEASE_TTL_S, Lease, _Held
from kvfsm.lookup._lease_pass import ANSWER_COLUMNS, TAKEN, LeaseArrays, answer_runs
from kvfsm.lookup._lease_pins import (
    CHECK_FAILED,
    MOVED,
    PINNED_FULL,
    UNREADABLE,
    WRONG_FORM,
    pin_if_usable,
    take_unchanged,
    unpin_unmoved,
)
from kvfsm.lookup._lease_probed import ProbedHold, refuse_probed
from kvfsm.lookup._types import Probe, ProbedGroup, Verdict
from kvfsm.state import FAILED, MAX_PINS, GroupState, Prompt, StateCore, StateError
from kvfsm.state._core import PinRun

IdArray = NDArray[np.intp]

#: The next expiry when no lease is open.
NO_EXPIRY: Final = float("inf")


class LeaseBook:
    """Hands out the leases of one core and keeps the open ones (one per engine).

    ``lock`` is the owner's lock (reentrant); every method takes it. ``clock`` is monotonic.
    """

    def __init__(self, core: StateCore, lock: threading.RLock | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.lock = lock if lock is not None else threading.RLock()
        self.clock = clock
        self._open: dict[int, Lease] = {}
        #: Told of every refusal (a lease not granted, a validate that failed): metrics.
        self.on_refusal: Callable[[LeaseLost], None] | None = None
        #: The earliest expiry among open leases, NO_EXPIRY when none is open (reap does
        #: nothing before it; the book's own to change).
        self.next_expiry = NO_EXPIRY
        #: The pin pass's answer (used under the lock).
        self._answer = np.empty(4, dtype=np.int64)
        #: The core's groups' arrays in its lookups' order, for one-pass takes (made on the
        #: first).
        self._arrays: LeaseArrays | None = None

    def refused(self, lost: LeaseLost) -> None:
        if self.on_refusal is not None:
            self.on_refusal(lost)

    @property
    def open(self) -> int:
        """Leases neither released nor expired-and-reaped."""
        with self.lock:
            return len(self._open)

    def leases(self) -> tuple[Lease, ...]:
        with self.lock:
            return tuple(self._open.values())

    def take(self, verdict: Verdict, prompt: Prompt, *,
             ttl_s: float = DEFAULT_LEASE_TTL_S) -> Lease:
        """Pin the blocks ``verdict`` called usable for ``prompt`` (made or checked for this
        core by the caller) and record their epochs: the one take of the book.

        Where the verdict is this core's lookup of ``prompt`` and nothing changed since (the
        core's count of changes is the lookup's), one compiled pass pins and touches every
        group's blocks straight from the lookup's outputs (:meth:`_take_probed`); anything
        else checks the prompt's blocks again against the verdict and pins those
        (:meth:`_take_again`).

        Raises :class:`~kvfsm.LeaseLost` (nothing pinned) where a block needed at
        ``verdict.usable_tokens`` is no longer cached, readable in the form the kernel reads,
        free of a failed checksum, or (an index) pointing at targets still at their epochs:
        it changed since the lookup; look up again; nothing else changed either. A
        :class:`StateError` where a block already holds ``MAX_PINS`` pins: nothing pinned,
        though the blocks of groups taken before it may have been marked used (their
        recency refreshed, nothing a verdict reads: an unchanged group's pins and its use
        are one pass).
        """
        if ttl_s is not DEFAULT_LEASE_TTL_S:  # check_ttl's own first test, a frame fewer
            check_ttl(ttl_s)
        tokens = verdict.usable_tokens
        with self.lock:
            probe = verdict.probe
            if probe is not None and probe.prompt is prompt and probe.exact and \
                    probe.spans is not None and probe.passes is not None and \
                    probe.tokens == tokens and probe.core() is self.core:
                lease = self._take_probed(probe, tokens, ttl_s)
                if lease is not None:
                    return lease
            return self._take_again(verdict, prompt, ttl_s)

    def _take_again(self, verdict: Verdict, prompt: Prompt, ttl_s: float) -> Lease:
        """:meth:`take` where the one-pass take cannot serve: each group's blocks checked
        again against ``verdict`` (its probe's ids and epochs where it is this core's lookup of
        this prompt, else the prompt's blocks probed afresh), then pinned."""
        tokens = verdict.usable_tokens
        if tokens > prompt.n_tokens:
            raise KvfsmError(f"the verdict covers {tokens} tokens but the prompt has only "
                             f"{prompt.n_tokens}: not this prompt's verdict")
        held = self._probed(verdict, prompt)
        if held is not None:
            return self._open_lease(tokens, held, ttl_s)
        try:
            needed = {name: _needed(state, prompt, tokens)
                      for name, state in self.core.groups.items()}
        except LeaseLost as lost:
            self.refused(lost)
            raise
        # Per target group: the blocks the lease's index blocks point at.
        targets: dict[str, list[IdArray]] = {}
        for name, (ids, _) in needed.items():
            group = self.core.group(name)
            if group.target is not None:
                targets.setdefault(group.target.name, []).append(_targets(group, ids))
        done: list[str] = []
        try:
            for name, (ids, _) in needed.items():
                if ids.size:
                    self.core.pin(name, ids)
                    done.append(name)
        except Exception:
            for name in done:
                self.core.unpin(name, needed[name][0])
            raise
        recorded = tuple(_record(self.core.group(name), ids, index, targets.get(name, []))
                         for name, (ids, index) in needed.items())
        return self._open_lease(tokens, recorded, ttl_s)

    def _take_probed(self, probe: Probe, tokens: int, ttl_s: float) -> Lease | None:
        """The lease of ``tokens`` made by pinning and touching the blocks of every group of a
        lookup's ``probe`` (its pass outputs, at its candidate ``at``, where its ``spans``
        say) in one compiled call, where no group changed since the lookup. None where some
        group changed, or an index group points past what the lease would hold of its
        target (nothing changed: :meth:`take` checks the blocks again). A StateError (a
        block already at ``MAX_PINS``) or KvfsmError (an id outside its group) where a group
        refused: the groups before it stay marked used (their recency refreshed), nothing
        is pinned. One frame from the lookup's outputs to the open lease: a server takes a
        lease on every request, right after a long lookup, where each frame costs cache
        misses. For :meth:`take`, which checked that this core's lookup made ``probe``."""
        spans, passes = probe.spans, probe.passes
        assert spans is not None and passes is not None
        arrays = self._arrays
        if arrays is None or arrays.names is not spans.names:
            arrays = self._arrays_named(spans.names)
        if arrays.change_count.total != probe.changes:
            return None
        outs = tuple([each[2] for each in passes])
        answers = np.empty((len(outs), ANSWER_COLUMNS), dtype=np.int64)
        clock = arrays.clock
        stop, touched, one_runs = arrays.take(outs, spans.bounds, spans.offsets, probe.at,
                                              clock.now + 1, answers)
        clock.now += touched  # the ticks the pass took (Clock.advance, one call less)
        # Built as a tuple: a named tuple's own constructor is one more Python call.
        hold: ProbedHold = tuple.__new__(ProbedHold, (
            arrays, passes, outs, spans.offsets, answers, probe.changes, touched,
            one_runs == touched))
        if stop != TAKEN:
            if stop < 0:
                return None  # an index's targets outside what is held: checked again
            refuse_probed(hold, stop)
        core = self.core
        if core.pins_observed:  # told once taken: a refused take pinned nothing
            tellers = core.lease_pin_tellers
            if hold.one_runs and tellers is not None:  # the usual lease, two frames fewer
                for tell in tellers:
                    tell(arrays.names, answers, touched, 1)
            elif hold.one_runs:  # hold.tell_pins's usual case, a frame fewer
                core.tell_lease_pins(arrays.names, answers, touched, 1, answer_runs)
            else:
                hold.tell_pins(core, 1)
        # _open_lease, inline (a frame fewer on every request's take).
        lease = Lease(self, tokens, hold, self.clock() + ttl_s)
        self._open[id(lease)] = lease
        if lease.expires_at < self.next_expiry:
            self.next_expiry = lease.expires_at
        return lease

    def _arrays_named(self, names: tuple[str, ...]) -> LeaseArrays:
        """The core's groups' arrays in the order of ``names`` (a lookup's tuple), gathered on
        the first take and kept while lookups name the groups with that tuple."""
        arrays = self._arrays
        if arrays is None or arrays.names is not names:
            arrays = self._arrays = LeaseArrays([self.core.group(name) for name in names], names)
        return arrays

    def _open_lease(self, tokens: int, held: tuple[_Held, ...] | ProbedHold,
                    ttl_s: float) -> Lease:
        lease = Lease(self, tokens, held, self.clock() + ttl_s)
        self._open[id(lease)] = lease
        if lease.expires_at < self.next_expiry:
            self.next_expiry = lease.expires_at
        return lease

    def _probed(self, verdict: Verdict, prompt: Prompt) -> tuple[_Held, ...] | None:
        """The lease's holdings made from what the verdict's lookup found (its probe), pinned;
        None where the probe cannot serve (no probe, another core, another prompt, an index
        whose targets the lease would not hold as blocks): the caller probes and checks
        afresh. LeaseLost (nothing pinned) where a block moved or stopped being usable since
        the lookup."""
        probe = verdict.probe
        core = self.core
        if probe is None or probe.core() is not core or probe.tokens != verdict.usable_tokens:
            return None
        groups = probe.groups
        by_name = core.groups
        if len(groups) != len(by_name):
            return None
        states = [by_name.get(group.group) for group in groups]
        # The lookup's own prompt (a prompt only grows): its blocks are the ones probed.
        same_prompt = probe.prompt is prompt
        probed: dict[str, ProbedGroup] | None = None
        for group, state in zip(groups, states, strict=True):
            if state is None:
                return None
            if not same_prompt and group.last_words is not None:
                high, low = prompt.words(state.decl.block_size)
                if group.hi > high.size or \
                        (int(high[group.hi - 1]), int(low[group.hi - 1])) != group.last_words:
                    return None  # another prompt: its own blocks, probed afresh
            if state.target is not None and group.hi > group.lo:
                if probed is None:
                    probed = {each.group: each for each in groups}
                target = probed.get(state.target.name)
                if target is None or not _targets_held(state, group, target):
                    return None
        held: list[_Held | None] = [None] * len(groups)
        answer = self._answer
        # Groups changed since the lookup go first: only there can a block have moved
        # (LeaseLost), and they are only pinned, so such a refusal leaves nothing changed.
        # The others are pinned and marked used in one pass each: only a block at MAX_PINS
        # refuses there, and then the unchanged groups before it stay marked used.
        unchanged: list[int] = []
        try:
            for at, (group, state) in enumerate(zip(groups, states, strict=True)):
                assert state is not None
                if group.changes == state.changes and group.ids.size:
                    unchanged.append(at)
                    continue
                first, why = pin_if_usable(state, group.ids, group.epochs, group.cut - group.lo)
                if first >= 0:
                    raise self._refusal(state, group, first, why)
                held[at] = _Held(state, group.ids, group.lo, group.ids, group.epochs, True,
                                 state.changes)
            for at in unchanged:
                group, state = groups[at], states[at]
                assert state is not None
                # Nothing changed since the lookup: every block is as it saw it (usable).
                first, run, one_run = take_unchanged(state, group.ids, group.epochs, answer)
                if first >= 0:
                    raise self._refusal(state, group, first, PINNED_FULL)
                # Positional, in field order: one per group on every take.
                held[at] = _Held(state, group.ids, group.lo, group.ids, group.epochs, True,
                                 state.changes, run, one_run, True)
        except Exception:
            for taken in held:  # pinned before the refusal
                if taken is not None:
                    unpin_unmoved(taken.state, taken.pinned, taken.epochs, taken.run)
            raise
        runs: list[PinRun] = []
        for taken in held:
            assert taken is not None
            if taken.pinned.size and not taken.touched:
                # The core's own ids, just checked: no conversion or range check again.
                taken.state.touch(taken.pinned)
            if core.pins_observed and taken.pinned.size:  # told once every group is pinned
                if taken.one_run:  # consecutive ids: a run, as a one-pass take tells it
                    runs.append((taken.group, int(taken.pinned[0]), taken.pinned.size, 1))
                else:
                    core.tell_pins(taken.group, taken.pinned.copy(), 1)
        if runs:
            core.tell_pin_runs(runs)
        return tuple(held)  # type: ignore[arg-type]

    def _refusal(self, state: GroupState, group: ProbedGroup, first: int,
                 why: int) -> Exception:
        """The error of a take refused at ``group``'s block ``first``: a StateError where it
        holds MAX_PINS pins, else LeaseLost saying why (told to ``on_refusal``)."""
        if why == PINNED_FULL:
            return StateError(f"{state.name}: more than {MAX_PINS} pins on one block "
                              f"(block {int(group.ids[first])}); nothing was pinned")
        lost = _unusable(state, group, first, why)
        self.refused(lost)
        return lost

    def drop(self, lease: Lease) -> None:
        """Release ``lease``'s pins and forget it (idempotent)."""
        lease.release()

    def forget(self, lease: Lease) -> None:
        """Stop counting ``lease`` as open (:meth:`Lease.release` gives back its pins; the
        lock held)."""
        self._open.pop(id(lease), None)

    def reap(self) -> int:
        """Release the pins of every expired lease no reader is reading (never validated);
        returns how many. A lease validated for a read keeps its pins past its ttl until its
        reader's next call on it (``validate`` then raises LeaseLost, ``release`` gives them
        back): its blocks never go to another prompt under a read in progress. O(1) before
        the earliest expiry, so the engine calls it on every call."""
        if self.next_expiry == NO_EXPIRY:
            return 0  # no lease open: nothing to reap (a stale read only defers a reap)
        with self.lock:
            now = self.clock()
            if now < self.next_expiry:
                return 0
            expired = [lease for lease in self._open.values()
                       if now >= lease.expires_at and not lease.reading]
            for lease in expired:
                lease.mark_expired()
                self.drop(lease)
            self.next_expiry = min((lease.expires_at for lease in self._open.values()
                                    if not lease.reading), default=NO_EXPIRY)
            return len(expired)

    def release_all(self) -> int:
        """Release every open lease (an engine closing); returns how many."""
        with self.lock:
            open_leases = list(self._open.values())
            for lease in open_leases:
                self.drop(lease)
            self.next_expiry = NO_EXPIRY
            return len(open_leases)


def check_ttl(ttl_s: float) -> None:
    """A KvfsmError unless ``ttl_s`` is a finite number of seconds above 0 (an infinite one
    would let a lease its reader forgot hold its blocks for ever)."""
    if ttl_s is not DEFAULT_LEASE_TTL_S and (
            not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not ttl_s > 0
            or not math.isfinite(ttl_s)):
        raise KvfsmError(f"lease ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")


def _targets_held(index: GroupState, rows: ProbedGroup, target: ProbedGroup) -> bool:
    """The lease will hold, as blocks of the target group, every block that index rows
    ``[rows.lo, rows.hi)`` may point at: usable rows point only at this prompt's history
    blocks that end before the row does (the lookup checked each reference), so at
    positions below ``rows.hi * index_block // target_block``; the lease holds the target
    group's ``[target.lo, target.hi)``."""
    assert index.target is not None
    reach = rows.hi * index.decl.block_size // index.target.decl.block_size
    return target.lo == 0 and target.hi >= reach


_WHY = {
    MOVED: "its content moved since the lookup",
    UNREADABLE: "not readable any more",
    WRONG_FORM: "not readable in the form the kernel reads",
    CHECK_FAILED: "a lookup saw it fail its checksum",
    PINNED_FULL: "pinned by too many readers",
}


def _unusable(state: GroupState, group: ProbedGroup, first: int, why: int) -> LeaseLost:
    block = int(group.ids[first])
    code = int(state.states[block])
    if not state.table.hashed[code]:
        what = "no longer cached"
    else:
        what = f"no longer usable as the verdict said: {_WHY[why]}"
    return LeaseLost(f"prompt block {group.lo + first} is {what}; look up again",
                     group=state.name, block=block,
                     old_epoch=int(group.epochs[first]), new_epoch=int(state.epoch[block]),
                     state=state.table.state_name(int(state.states[block])))


def _needed(state: GroupState, prompt: Prompt, tokens: int
            ) -> tuple[IdArray, NDArray[np.int64]]:
    """The block ids the kernel reads in ``state``'s group at ``tokens`` (the kind's rule:
    ``[lo, cut)`` compressed, ``[cut, hi)`` raw) and their prompt block indices, or LeaseLost
    naming the first that is no longer cached, readable in that form, or free of a failed
    checksum. (An index whose targets moved was invalidated with them: not readable.)"""
    decl = state.decl
    need = state.rule.needed(decl, np.array([tokens], dtype=np.int64))
    lo, cut, hi = int(need.lo[0]), int(need.cut[0]), int(need.hi[0])
    high, low = prompt.words(decl.block_size)
    if hi > high.size:
        raise KvfsmError(f"{state.name}: the verdict needs {hi} blocks of this prompt, which "
                         f"has {high.size}: not this prompt's verdict")
    ids = state.hash_map.lookup(high[lo:hi], low[lo:hi])
    index = np.arange(lo, hi, dtype=np.int64)
    forms = np.where(index < cut, FORM_COMPRESSED, FORM_RAW).astype(np.int8)
    gone = ids < 0
    if gone.any():
        first = int(np.flatnonzero(gone)[0])
        raise LeaseLost(f"prompt block {lo + first} is no longer cached; look up again",
                        group=state.name, block=-1)
    codes = state.states[ids]
    unreadable = ~state.table.readable[codes] | (state.table.form[codes] != forms)
    bad = unreadable | (state.check[ids] == FAILED)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        why = "not readable in the form the kernel reads" if unreadable[first] else \
            "a lookup saw it fail its checksum"
        raise LeaseLost(f"no longer usable as the verdict said: {why}; look up again",
                        group=state.name, block=int(ids[first]),
                        state=state.table.state_name(int(codes[first])))
    return ids.astype(np.intp), index


def _targets(state: GroupState, ids: IdArray) -> IdArray:
    """The distinct target blocks the index blocks ``ids`` point at (none for other kinds)."""
    if state.target is None or not ids.size:
        return np.zeros(0, dtype=np.intp)
    return state.target.distinct(state.index_targets(ids))


def _record(state: GroupState, pinned: IdArray, index: NDArray[np.int64],
            targets: list[IdArray]) -> _Held:
    """The epochs of ``pinned`` and of ``targets``: blocks of this group that index blocks of
    the lease point at (pinned through their index)."""
    extra = state.distinct(np.concatenate(targets).astype(np.intp)) if targets \
        else np.zeros(0, dtype=np.intp)
    extra = state.without(extra, pinned)
    ids = np.concatenate([pinned, extra]).astype(np.intp)
    first = int(index[0]) if index.size else 0
    return _Held(state, pinned, first, ids, state.epoch[ids].copy(),
                 changes=state.changes)
