"""Leases: the blocks a verdict called usable stay usable until the kernel has read them.

A verdict is a snapshot. Between the check and the kernel's read a block can be evicted,
spilled, compressed or reused; every such row bumps the block's epoch and is guarded by
``no_pins``. A lease pins exactly the blocks the kernel reads at the verdict's
``usable_tokens`` (per group, what the kind's rule needs there, in the form it needs them; an
index pins its targets too) and records each one's ``(group, block, epoch)``, so
:meth:`Lease.validate` right before a read proves that nothing it covers moved, and the pins
make sure nothing could. Per group a lease holds a few arrays, never per-block objects.

Leases expire (``ttl_s``, monotonic clock): a reader that died cannot hold blocks forever. The
:class:`LeaseBook` that hands them out (one per engine) releases expired leases' pins whenever
its owner calls :meth:`LeaseBook.reap` (the engine does at the start of every call), and
counts the open ones so none leak. Pins move through the core's ``pin`` / ``unpin``; every
lease operation takes the owner's lock.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.lookup._lease_pass import HI, LO, answer_runs
from kvfsm.lookup._lease_pins import first_moved, given_back, unpin_unmoved
from kvfsm.lookup._lease_probed import ProbedHold
from kvfsm.state import GroupState, StateCore, StateError
from kvfsm.state._core import PinRun

if TYPE_CHECKING:
    from kvfsm.lookup._lease_book import LeaseBook

IdArray = NDArray[np.intp]

#: Seconds a lease holds its pins unless released first: far longer than one kernel launch
#: reads, short enough that a reader that died stops holding blocks soon.
DEFAULT_LEASE_TTL_S: Final = 10.0


class _Held(NamedTuple):
    """What one lease holds in one group: the blocks it pinned itself and every block whose
    epoch it checks (those, plus index targets pinned through their index). A named tuple:
    a lease makes one per group on every take, and an attrs value costs several times more
    to make."""

    state: GroupState
    #: Blocks pinned directly, in prompt order; the first is the prompt's block ``first``.
    pinned: IdArray
    first: int
    #: Blocks checked: ``pinned`` first, then targets of index blocks pointing here.
    ids: IdArray
    epochs: NDArray[np.uint32]
    #: Pinned as blocks alone (an index's targets are pinned as blocks of their own group in
    #: the same lease), taken from a lookup's probe; else through :meth:`StateCore.pin`.
    alone: bool = False
    #: The group's ``changes`` once the lease held its pins: while it is unchanged no block
    #: of the group moved, so each of ``ids`` is still at its epoch and state.
    changes: int = -1
    #: How ``pinned`` was pinned (:func:`~kvfsm.lookup._lease_pins.take_unchanged`): one by
    #: one (0), or where one run of consecutive ids (1) or each of several runs (2) spans
    #: whole chunks, by those chunks but for its ends; given back the same way.
    run: int = 0
    #: ``ids`` are consecutive and all at one epoch (the event log writes the read as runs
    #: without scanning them).
    one_run: bool = False
    #: Touched (used now) in the pass that pinned them.
    touched: bool = False

    @property
    def group(self) -> str:
        return self.state.name

    @property
    def indices(self) -> NDArray[np.int64]:
        return np.arange(self.first, self.first + self.pinned.size, dtype=np.int64)


class Lease:
    """The blocks of one verdict, pinned and recorded at their epochs until released.

    Use it as a context manager (released on every path) or call :meth:`release`, which may
    be called any number of times. :meth:`validate` right before a read raises
    :class:`~kvfsm.LeaseLost` unless every leased block is still at its epoch and readable in
    the form the kernel reads; ``valid`` says the same as a bool. A validated lease is being
    read: past its ttl it keeps its pins until the reader's next call on it (``release``, or
    ``validate``, which then raises LeaseLost), so the blocks never go to another prompt
    under a read in progress; a lease never validated expires at its ttl.
    """

    # Slots: a server takes a lease per request, and a slotted object is made and read with
    # fewer memory touches (right after a long lookup, each of them a cache miss).
    __slots__ = ("_book", "_expired_on_release", "_holding", "_probed", "_released",
                 "expires_at", "reading", "tokens")

    def __init__(self, book: LeaseBook, tokens: int, held: tuple[_Held, ...] | ProbedHold,
                 expires_at: float) -> None:
        self._book = book
        #: The prefix length the lease covers (the verdict's ``usable_tokens``).
        self.tokens = tokens
        #: When the lease expires, on the book's monotonic clock.
        self.expires_at = expires_at
        #: Taken in one pass from a lookup's outputs (per-group views made when asked).
        self._probed: ProbedHold | None = None
        self._holding: tuple[_Held, ...] | None = None
        if held.__class__ is ProbedHold:
            self._probed = held
        else:
            self._holding = held  # type: ignore[assignment]
        self._released = False
        self._expired_on_release = False
        #: A validate passed: a read is in progress (the pins outlive the ttl until the
        #: reader's next call on the lease).
        self.reading = False

    @property
    def _held(self) -> tuple[_Held, ...]:
        """Per group, what the lease holds (made from a one-pass take on first need)."""
        if self._holding is None:
            probed = self._probed
            assert probed is not None
            # Positional, in field order, as the per-group take makes them.
            self._holding = tuple(
                _Held(state, ids, first, ids, epochs, True, each[4], run, one_run, True)
                for state, each, (first, ids, epochs, run, one_run)
                in zip(probed.arrays.groups, probed.passes, probed.views(), strict=True))
        return self._holding

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(held.group for held in self._held)

    def blocks(self, group: str) -> IdArray:
        """The block ids of ``group`` the lease pinned (what the kernel reads), prompt order."""
        return self._held_of(group).pinned.copy()

    def indices(self, group: str) -> NDArray[np.int64]:
        """The prompt block indices of :meth:`blocks` of ``group`` (block ``i`` covers tokens
        ``[i * block_size, (i + 1) * block_size)``)."""
        return self._held_of(group).indices.copy()

    def epochs(self, group: str) -> NDArray[np.uint32]:
        """The epochs recorded for :meth:`blocks` of ``group``."""
        held = self._held_of(group)
        return held.epochs[: held.pinned.size].copy()

    def _held_of(self, group: str) -> _Held:
        for held in self._held:
            if held.group == group:
                return held
        raise KvfsmError(f"no group {group!r} in this lease; groups: {list(self.groups)}")

    @property
    def released(self) -> bool:
        return self._released

    @property
    def expired(self) -> bool:
        """Its ttl ran out (whether or not its pins were released yet)."""
        return self._expired_on_release or (not self._released
                                            and self._book.clock() >= self.expires_at)

    @property
    def valid(self) -> bool:
        """Whether :meth:`validate` would pass now."""
        try:
            self.validate()
        except LeaseLost:
            return False
        return True

    def validate(self) -> None:
        """Raise :class:`~kvfsm.LeaseLost` unless the lease is open, not expired, and every
        block it covers is at the epoch recorded, readable in the form the kernel reads, and
        not seen failing its checksum since (an expired lease's pins are released here
        too)."""
        book = self._book
        with book.lock:
            if self._released or book.clock() >= self.expires_at:
                if not self._released:
                    self.mark_expired()
                    book.drop(self)
                lost = LeaseLost(
                    f"the lease expired (its ttl ran out at {self.expires_at:.3f} on the "
                    "monotonic clock) and its pins were released; look up again"
                    if self._expired_on_release else "the lease was released")
                book.refused(lost)
                raise lost
            probed = self._probed
            # Taken in one pass with no group changed since (the usual lease): no block it
            # holds moved, nothing to look at.
            if probed is None or probed.arrays.change_count.total != probed.changes:
                try:
                    for held in self._held:
                        _check(held.state, held)
                except LeaseLost as lost:
                    book.refused(lost)
                    raise
            self.reading = True
            # The read about to happen, for the event log (replay checks its epochs).
            core = book.core
            if not core.reads_observed:
                return
            if probed is None:
                core.record_leased_reads([(held.state.name, held.ids, held.epochs,
                                           held.one_run) for held in self._held])
            elif probed.one_runs:  # report_read's usual case, one call fewer
                core.record_lease_runs(probed.arrays.names, probed.answers, probed.holding,
                                       answer_runs)
            else:
                probed.report_read(core)

    def release(self) -> None:
        """Give back the lease's pins (idempotent; safe from any thread). A block pinned by
        this lease whose epoch moved anyway (something bypassed the pin) lost its pin with its
        content: it is skipped, never unpinned under another owner."""
        book = self._book
        with book.lock:
            book.forget(self)
            if self._released:
                return
            self._released = True
            core = book.core
            probed = self._probed
            if probed is not None:
                probed.unpin()
                if not core.pins_observed:
                    return
                if probed.one_runs and probed.arrays.change_count.total == probed.changes:
                    # tell_pins's usual case (nothing changed since the take), frames fewer
                    tellers = core.lease_pin_tellers
                    if tellers is None:
                        core.tell_lease_pins(probed.arrays.names, probed.answers,
                                             probed.holding, -1, answer_runs)
                    else:
                        for tell in tellers:
                            tell(probed.arrays.names, probed.answers, probed.holding, -1)
                else:
                    probed.tell_pins(core, -1)
                return
            self._unpin_held(core)

    def _unpin_held(self, core: StateCore) -> None:
        """:meth:`release` of a lease held group by group."""
        runs: list[PinRun] = []
        for held in self._held:
            state = held.state
            count = held.pinned.size
            if held.alone:
                unpin_unmoved(state, held.pinned, held.epochs[:count], held.run)
                if core.pins_observed and count:
                    given = given_back(state, held.pinned, held.epochs[:count], held.run)
                    if held.one_run and given.size == count:  # as its take told it: a run
                        runs.append((held.group, int(given[0]), count, -1))
                    else:
                        core.tell_pins(held.group, given.copy(), -1)
                continue
            still = state.epoch[held.pinned] == held.epochs[:count]
            try:
                core.unpin(held.group, held.pinned[still])
            except StateError:
                # Someone released pins behind the lease's back (an unbalanced unpin of an
                # index's target): give back what can be, block by block (a rare path).
                for block in held.pinned[still].tolist():
                    with contextlib.suppress(StateError):
                        core.unpin(held.group, [block])
        if runs:
            core.tell_pin_runs(runs)

    def mark_expired(self) -> None:
        self._expired_on_release = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if self._probed is not None:
            answers = self._probed.answers
            blocks = int((answers[:, HI] - answers[:, LO]).sum())
        else:
            blocks = sum(held.pinned.size for held in self._held)
        status = "released" if self._released else "open"
        return f"Lease({self.tokens} tokens, {blocks} blocks pinned, {status})"


def _check(state: GroupState, held: _Held) -> None:
    """LeaseLost naming the first block of ``held`` whose epoch moved, that is no longer
    readable, or that a lookup has since seen failing its checksum (its bytes are not what
    was written: the read must not happen). (Its form needs no check of its own: every row
    that changes a readable block's form bumps its epoch.) Where no block of the group has
    changed and no failure was recorded in it since the lease was taken, none of them did:
    O(1)."""
    if state.changes == held.changes:
        return
    first = first_moved(state, held.ids, held.epochs)
    if first < 0:
        return
    block = int(held.ids[first])
    epoch, code = int(state.epoch[block]), int(state.states[block])
    if epoch != int(held.epochs[first]):
        why = "its content moved"
    elif not state.table.readable[code]:
        why = "it is no longer readable"
    else:
        why = "a lookup saw it fail its checksum"
    raise LeaseLost(why, group=state.name, block=block, old_epoch=int(held.epochs[first]),
                    new_epoch=epoch, state=state.table.state_name(code))
