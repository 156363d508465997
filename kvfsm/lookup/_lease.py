"""Leases: the blocks a verdict called usable stay usable until the kernel has read them.

Every row that moves a block bumps its epoch and is guarded by ``no_pins``. A lease pins
exactly the blocks the kernel reads at the verdict's ``usable_tokens`` (an index's targets
too) and records their epochs, so :meth:`Lease.validate` proves nothing it covers moved, and
the pins make sure nothing could. Leases expire (``ttl_s``) so a dead reader cannot hold
blocks forever. Every lease operation takes the owner's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.lookup._buffers import HI, LO, answer_runs
from kvfsm.lookup._lease_probed import ProbedHold

if TYPE_CHECKING:
    from kvfsm.lookup._lease_book import LeaseBook

IdArray = NDArray[np.intp]

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

    __slots__ = ("_book", "_expired_on_release", "_hold", "_released", "_views", "expires_at",
                 "reading", "tokens")

    def __init__(self, book: LeaseBook, tokens: int, hold: ProbedHold,
                 expires_at: float) -> None:
        self._book = book
        #: The prefix length the lease covers (the verdict's ``usable_tokens``).
        self.tokens = tokens
        #: When the lease expires, on the book's monotonic clock.
        self.expires_at = expires_at
        self._hold = hold
        #: Per group: its first prompt block, ids and epochs held (made when first read).
        self._views: dict[str, tuple[int, IdArray, NDArray[np.uint32]]] | None = None
        self._released = False
        self._expired_on_release = False
        #: A validate passed: a read is in progress (the pins outlive the ttl).
        self.reading = False

    @property
    def groups(self) -> tuple[str, ...]:
        return self._hold.arrays.names

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
            self._views = {name: view[:3] for name, view
                           in zip(self.groups, self._hold.views(), strict=True)}
        if group not in self._views:
            raise KvfsmError(f"no group {group!r} in this lease; groups: {list(self.groups)}")
        return self._views[group]

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
                    book.drop(self)
                lost = LeaseLost(
                    f"the lease expired (its ttl ran out at {self.expires_at:.3f} on the "
                    "monotonic clock) and its pins were released; look up again"
                    if self._expired_on_release else "the lease was released")
                book.refused(lost)
                raise lost
            hold = self._hold
            # No change since the take: no block it holds moved.
            if hold.arrays.change_count.total != hold.changes:
                try:
                    hold.check()
                except LeaseLost as lost:
                    book.refused(lost)
                    raise
            self.reading = True
            # The read about to happen, for the event log (replay checks its epochs).
            core = book.core
            if not core.reads_observed:
                return
            if hold.one_runs and not hold.targets:  # report_read's usual case
                core.record_lease_runs(hold.arrays.names, hold.answers, hold.holding,
                                       answer_runs)
            else:
                hold.report_read(core)

    def release(self) -> None:
        """Give back the lease's pins (idempotent; safe from any thread). A block whose epoch
        moved anyway lost its pin with its content: it is skipped, never unpinned under
        another owner."""
        book = self._book
        with book.lock:
            book.forget(self)
            if self._released:
                return
            self._released = True
            core, hold = book.core, self._hold
            hold.unpin()
            if hold.targets:
                hold.unpin_targets(core)
            if not core.pins_observed:
                return
            if hold.one_runs and hold.arrays.change_count.total == hold.changes:
                # tell_pins's usual case: nothing changed since the take
                tellers = core.lease_pin_tellers
                if tellers is None:
                    core.tell_lease_pins(hold.arrays.names, hold.answers, hold.holding, -1,
                                         answer_runs)
                else:
                    for tell in tellers:
                        tell(hold.arrays.names, hold.answers, hold.holding, -1)
            else:
                hold.tell_pins(core, -1)

    def mark_expired(self) -> None:
        self._expired_on_release = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        answers = self._hold.answers
        blocks = int((answers[:, HI] - answers[:, LO]).sum())
        status = "released" if self._released else "open"
        return f"Lease({self.tokens} tokens, {blocks} blocks pinned, {status})"
