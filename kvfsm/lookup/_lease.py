"""Leases: the blocks a verdict called usable stay usable until the kernel has read them.

Every row that moves a block bumps its epoch and is guarded by ``no_pins``. A lease pins
exactly the blocks the kernel reads at the verdict's ``usable_tokens`` (an index's targets
too) and records their epochs, so :meth:`Lease.validate` proves nothing it covers moved, and
the pins make sure nothing could. Leases expire (``ttl_s``) so a dead reader cannot hold
blocks forever. Every lease operation takes the owner's lock.

A lease holds the lookup's probe (its ids and epochs are views of the pass outputs) and the
answer rows of its take; an index's targets outside what it holds of their group are pinned
through the core's ``pin`` and kept beside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NoReturn

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.lookup._buffers import (
    FIRST_EPOCH,
    FIRST_ID,
    FULL,
    HI,
    LO,
    ONE_READ,
    OUTSIDE,
    PINNED_AS,
    answer_runs,
    probed_ids,
)
from kvfsm.lookup._lease_pass import LeaseArrays, first_moved
from kvfsm.lookup._lookup_layout import LookupProbe
from kvfsm.state import MAX_PINS, StateCore, StateError
from kvfsm.state._core import LeasedRead, LeasedRun, PinRun
from kvfsm.state._group import GroupState
from kvfsm.state._touch import ONE_BY_ONE, run_chunks

if TYPE_CHECKING:
    from kvfsm.lookup._lease_book import LeaseBook

IdArray = NDArray[np.intp]
#: Blocks pinned through the core's ``pin`` as an index's targets: ``(group, ids, epochs)``.
Targets = tuple[tuple[str, IdArray, NDArray[np.uint32]], ...]

#: Seconds a lease holds its pins unless released first: far longer than one kernel launch
#: reads, short enough that a reader that died stops holding blocks soon.
DEFAULT_LEASE_TTL_S: Final = 10.0


class Lease:
    """The blocks of one verdict, pinned and recorded at their epochs until released.

    Use it as a context manager or call :meth:`release` (idempotent). :meth:`validate` right
    before a read raises :class:`~kvfsm.LeaseLost` unless every leased block is still at its
    epoch and readable in the kernel's form; ``valid`` says the same as a bool. A validated
    lease keeps its pins past its ttl until the reader's next call on it, so no block goes to
    another prompt under a read in progress; one never validated expires at its ttl.
    """

    __slots__ = ("_answers", "_arrays", "_book", "_expired_on_release", "_holding", "_one_runs",
                 "_probe", "_released", "_targets", "_views", "expires_at", "reading", "tokens")

    def __init__(self, book: LeaseBook, tokens: int, arrays: LeaseArrays, probe: LookupProbe,
                 answers: NDArray[np.int64], holding: int, one_runs: bool,
                 expires_at: float) -> None:
        self._book = book
        #: The prefix length the lease covers (the verdict's ``usable_tokens``).
        self.tokens = tokens
        #: When the lease expires, on the book's monotonic clock.
        self.expires_at = expires_at
        # The take: the groups' arrays, the lookup's probe, the answer rows, the groups
        # holding blocks, and whether each holds one run at one epoch.
        self._arrays, self._probe, self._answers = arrays, probe, answers
        self._holding, self._one_runs = holding, one_runs
        self._targets: Targets = ()
        #: Per group: first prompt block, ids and epochs held (made when first read).
        self._views: dict[str, tuple[int, IdArray, NDArray[np.uint32]]] | None = None
        self._released = False
        self._expired_on_release = False
        #: A validate passed: a read is in progress (the pins outlive the ttl).
        self.reading = False

    @property
    def groups(self) -> tuple[str, ...]:
        return self._arrays.names

    def blocks(self, group: str) -> IdArray:
        """The block ids of ``group`` the lease pinned, in prompt order."""
        return self._view(group)[1].copy()

    def indices(self, group: str) -> NDArray[np.int64]:
        """The prompt block indices of :meth:`blocks` of ``group`` (block ``i`` covers tokens
        ``[i * block_size, (i + 1) * block_size)``)."""
        first, ids, _ = self._view(group)
        return np.arange(first, first + ids.size, dtype=np.int64)

    def epochs(self, group: str) -> NDArray[np.uint32]:
        """The epochs recorded for :meth:`blocks` of ``group``."""
        return self._view(group)[2].copy()

    def _view(self, group: str) -> tuple[int, IdArray, NDArray[np.uint32]]:
        if self._views is None:
            self._views = {name: (row[LO], *self._held(g, row)) for g, (name, row)
                           in enumerate(zip(self.groups, self._answers.tolist(), strict=True))}
        if group not in self._views:
            raise KvfsmError(f"no group {group!r} in this lease; groups: {list(self.groups)}")
        return self._views[group]

    def _held(self, g: int, row: list[int]) -> tuple[IdArray, NDArray[np.uint32]]:
        """The ids and epochs group ``g`` holds (answer row ``row``): views of the pass output."""
        probe = self._probe
        offsets = probe.spans.offsets[g]
        ids, epochs = probed_ids(probe.outs[g], int(offsets[0]), int(offsets[1]), row[LO],
                                 row[HI])
        return ids.view(np.intp), epochs

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
        block it covers is at its recorded epoch, readable in the kernel's form, and not seen
        failing its checksum since (an expired lease's pins are released here)."""
        book = self._book
        with book.lock:
            if self._released or book.clock() >= self.expires_at:
                if not self._released:
                    self.mark_expired()
                    self.release()
                lost = LeaseLost(
                    f"the lease expired (its ttl ran out at {self.expires_at:.3f} on the "
                    "monotonic clock) and its pins were released; look up again"
                    if self._expired_on_release else "the lease was released")
                book.refused(lost)
                raise lost
            # No change since the take: no block it holds moved.
            if self._arrays.change_count.total != self._probe.changes:
                try:
                    self._check()
                except LeaseLost as lost:
                    book.refused(lost)
                    raise
            self.reading = True
            core = book.core
            if core.reads_observed:  # the read about to happen, for the event log's replay
                if self._one_runs and not self._targets:
                    core.record_lease_runs(self._arrays.names, self._answers, self._holding,
                                           answer_runs)
                else:
                    core.record_leased_reads(*self._reads())

    def _reads(self) -> tuple[list[LeasedRead], list[LeasedRun]]:
        """The read a validated lease reports: each group's blocks as a run or as arrays."""
        reads: list[LeasedRead] = []
        runs: list[LeasedRun] = []
        names = self._arrays.names
        for g, row in enumerate(self._answers.tolist()):
            count = row[HI] - row[LO]
            if count <= 0:
                continue
            if row[ONE_READ]:
                runs.append((names[g], row[FIRST_ID], count, row[FIRST_EPOCH]))
                continue
            ids, epochs = self._held(g, row)
            reads.append((names[g], ids, epochs, False))
        reads += [(name, ids, epochs, False) for name, ids, epochs in self._targets]
        return reads, runs

    def _check(self) -> None:
        """LeaseLost naming the first block held (of groups changed since the take, and the
        targets) that moved off its epoch, is no longer readable, or was seen failing its
        checksum. Its form needs no check: a row changing a readable block's form bumps it."""
        names, groups = self._arrays.names, self._arrays.groups
        held = [(groups[g], *self._held(g, row)) for g, row in enumerate(self._answers.tolist())
                if self._probe.changed(g, groups[g])]
        held += [(groups[names.index(name)], ids, epochs) for name, ids, epochs in self._targets]
        for state, ids, epochs in held:
            first = first_moved(state, ids, epochs)
            if first < 0:
                continue
            block = int(ids[first])
            epoch, code = int(state.epoch[block]), int(state.states[block])
            if epoch != int(epochs[first]):
                why = "its content moved"
            elif not state.table.readable[code]:
                why = "it is no longer readable"
            else:
                why = "a lookup saw it fail its checksum"
            raise LeaseLost(why, group=state.name, block=block, old_epoch=int(epochs[first]),
                            new_epoch=epoch, state=state.table.state_name(code))

    def release(self) -> None:
        """Give back the lease's pins (idempotent, thread-safe). A block whose epoch moved lost
        its pin with its content: it is skipped, never unpinned under another owner."""
        book = self._book
        with book.lock:
            book.forget(self)
            if self._released:
                return
            self._released = True
            core = book.core
            self.unpin()
            if self._targets:
                self._unpin_targets(core)
            if core.pins_observed:
                self.tell_pins(core, -1)

    def unpin(self, groups: int | None = None) -> None:
        """Give back the pins of every group (or of the first ``groups``), not the targets'."""
        probe = self._probe
        self._arrays.unpin(probe.outs, probe.spans.offsets, self._answers,
                           len(probe.outs) if groups is None else groups)

    def _unpin_targets(self, core: StateCore) -> None:
        """Give back the targets' pins through the core's ``unpin``, but not on blocks whose
        epoch moved (their pin went with their content) or whose pins are gone."""
        for name, ids, epochs in self._targets:
            state = core.group(name)
            kept = ids[(state.epoch[ids] == epochs) & (state.block_pins[ids] > 0)]
            if kept.size:
                core.unpin(name, kept)

    def tell_pins(self, core: StateCore, delta: int) -> None:
        """Tell ``core``'s pin observers of the pins taken (``delta`` 1) or given back (-1,
        after :meth:`unpin`; after a change, only those given back: :func:`given_back`)."""
        names, groups, answers = self._arrays.names, self._arrays.groups, self._answers
        # Nothing changed since the take: every pin taken is given back.
        whole = delta > 0 or self._arrays.change_count.total == self._probe.changes
        if whole and self._one_runs:
            core.tell_lease_pins(names, answers, self._holding, delta, answer_runs)
            return
        runs: list[PinRun] = []
        for g, row in enumerate(answers.tolist()):
            count = row[HI] - row[LO]
            if count <= 0:
                continue
            state = groups[g]
            ids, epochs = self._held(g, row)
            if whole or not self._probe.changed(g, state):
                if row[ONE_READ]:
                    runs.append((names[g], row[FIRST_ID], count, delta))
                    continue
            else:
                ids = given_back(state, ids, epochs, row[PINNED_AS])
            core.tell_pins(names[g], ids.copy(), delta)
        core.tell_pin_runs(runs)

    def hold_targets(self, core: StateCore) -> None:
        """Pin the distinct blocks this lease's index groups point at outside what it holds of
        their targets (unchanged since the lookup checked every reference), recording
        ``(group, ids, epochs)``. Where one cannot be pinned, every pin is given back first."""
        names, answers = self._arrays.names, self._answers.tolist()
        made: list[tuple[str, IdArray, NDArray[np.uint32]]] = []
        try:
            for g, state in enumerate(self._arrays.groups):
                target = state.target
                if target is None:
                    continue
                at = names.index(target.name)
                held = self._held(at, answers[at])[0]
                ids = target.without(target.distinct(state.index_targets(
                    self._held(g, answers[g])[0])), held)
                if ids.size:
                    core.pin(target.name, ids)
                    made.append((target.name, ids, target.epoch[ids].copy()))
        except Exception:
            for name, ids, _ in made:
                core.unpin(name, ids)
            self.unpin()
            raise
        self._targets = tuple(made)

    def refuse(self, stop: int) -> NoReturn:
        """Give back the pins of the groups before ``stop``, then raise why ``stop`` refused:
        a KvfsmError (an id outside its group) or a StateError (a block at ``MAX_PINS``)."""
        self.unpin(stop)
        state, row = self._arrays.groups[stop], self._answers[stop].tolist()
        ids, _ = self._held(stop, row)
        if row[OUTSIDE] >= 0:
            raise KvfsmError(f"{state.name}: block ids must lie in [0, {state.n_blocks}), got "
                             f"{int(ids[row[OUTSIDE]])}")
        raise StateError(f"{state.name}: more than {MAX_PINS} pins on one block (block "
                         f"{int(ids[row[FULL]])}); nothing was pinned")

    def mark_expired(self) -> None:
        self._expired_on_release = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        answers = self._answers
        blocks = int((answers[:, HI] - answers[:, LO]).sum())
        status = "released" if self._released else "open"
        return f"Lease({self.tokens} tokens, {blocks} blocks pinned, {status})"


def given_back(state: GroupState, ids: IdArray, epochs: NDArray[np.uint32],
               run: int = ONE_BY_ONE) -> IdArray:
    """The blocks of ``ids`` whose pin a give-back returns (``run``: how they were pinned), for
    pin observers: all but those pinned alone that moved off ``epochs`` (a chunk's go with it)."""
    moved = state.epoch[ids] != epochs
    if not moved.any():
        return ids
    kept = ~moved
    if run != ONE_BY_ONE:
        kept |= run_chunks(ids, state.pin_shift)[0]
    given: IdArray = ids[kept]
    return given
