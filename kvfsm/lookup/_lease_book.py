"""The book of one engine's leases: it hands them out (from a lookup's probe, looking the prompt
up again where that probe is stale), keeps the open ones, and releases the expired.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Final

import numpy as np

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.lookup._buffers import ANSWER_COLUMNS, TAKEN
from kvfsm.lookup._lease import DEFAULT_LEASE_TTL_S, Lease
from kvfsm.lookup._lease_pass import LeaseArrays
from kvfsm.lookup._lookup_layout import LookupProbe
from kvfsm.lookup._types import Level, Verdict
from kvfsm.state import Prompt, StateCore

#: The next expiry when no lease is open.
NO_EXPIRY: Final = float("inf")

#: The owner's lookup at a level, capped at a token count, checksums recorded, probe fresh.
LookUp = Callable[[Prompt, Level, int], Verdict]


class LeaseBook:
    """Hands out the leases of one core and keeps the open ones (one per engine).

    ``lock`` is the owner's lock (reentrant); every method takes it. ``clock`` is monotonic.
    ``look_up`` is the owner's lookup (:data:`LookUp`), for a verdict whose probe is stale.
    """

    def __init__(self, core: StateCore, lock: threading.RLock, look_up: LookUp,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.lock = lock
        self.look_up = look_up
        self.clock = clock
        self._open: dict[int, Lease] = {}
        #: Told of every refusal (a lease not granted, a validate that failed): metrics.
        self.on_refusal: Callable[[LeaseLost], None] | None = None
        #: The earliest expiry among open leases (the book's own to change).
        self.next_expiry = NO_EXPIRY
        #: The core's groups' arrays in its lookups' order (made on the first take).
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
        """Pin the blocks the kernel reads at ``verdict.usable_tokens`` of ``prompt`` and
        record their epochs; where the verdict's probe is not this core's lookup of
        ``prompt``, or is stale, look ``prompt`` up again.

        Raises (nothing pinned) :class:`~kvfsm.LeaseLost` where the new lookup finds fewer
        usable tokens; KvfsmError where the verdict covers more tokens than the prompt has;
        :class:`StateError` where a block holds ``MAX_PINS`` (earlier groups stay marked used).
        """
        if ttl_s is not DEFAULT_LEASE_TTL_S:  # check_ttl's own first test
            check_ttl(ttl_s)
        tokens = verdict.usable_tokens
        with self.lock:
            probe = verdict.probe
            # A lookup's own probe (its arrays as the take reads them) of this prompt here.
            if probe.__class__ is LookupProbe and probe.prompt is prompt and \
                    probe.tokens == tokens and probe.core() is self.core:
                lease = self._take_probed(probe, tokens, ttl_s)
                if lease is not None:
                    return lease
            if tokens > prompt.n_tokens:
                raise KvfsmError(f"the verdict covers {tokens} tokens but the prompt has only "
                                 f"{prompt.n_tokens}: not this prompt's verdict")
            again = self.look_up(prompt, verdict.level, tokens)
            if again.usable_tokens == tokens and again.probe.__class__ is LookupProbe:
                lease = self._take_probed(again.probe, tokens, ttl_s)
                if lease is not None:
                    return lease
            lost = _lost(self.core, tokens, again)
            self.refused(lost)
            raise lost

    def _take_probed(self, probe: LookupProbe, tokens: int, ttl_s: float) -> Lease | None:
        """The lease of ``tokens`` on this core's ``probe``, targets too; None where a group
        changed since the lookup. Raises as :meth:`Lease.refuse` where a group refused."""
        spans = probe.spans
        arrays = self._arrays
        if arrays is None or arrays.names is not spans.names:
            # The core's groups in the lookups' order, kept while lookups pass this same tuple.
            arrays = self._arrays = LeaseArrays(
                [self.core.group(name) for name in spans.names], spans.names)
        if arrays.change_count.total != probe.changes:
            return None
        answers = np.empty((len(probe.outs), ANSWER_COLUMNS), dtype=np.int64)
        clock = arrays.clock
        stop, touched, one_runs, outside = arrays.take(
            probe.outs, spans.bounds, spans.offsets, probe.at, clock.now + 1, answers)
        clock.now += touched  # the ticks the pass took
        lease = Lease(self, tokens, arrays, probe, answers, touched, one_runs == touched,
                      self.clock() + ttl_s)
        if stop != TAKEN:
            lease.refuse(stop)
        core = self.core
        if outside:
            lease.hold_targets(core)
        if core.pins_observed:  # told once taken: a refused take pinned nothing
            lease.tell_pins(core, 1)
        self._open[id(lease)] = lease
        if lease.expires_at < self.next_expiry:
            self.next_expiry = lease.expires_at
        return lease

    def forget(self, lease: Lease) -> None:
        """Stop counting ``lease`` as open (the lock held; :meth:`Lease.release` unpins)."""
        self._open.pop(id(lease), None)

    def reap(self) -> int:
        """Release the pins of every expired lease never validated (a validated one keeps them
        until its reader's next call); returns how many. O(1) before the earliest expiry."""
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
                lease.release()
            self.next_expiry = min((lease.expires_at for lease in self._open.values()
                                    if not lease.reading), default=NO_EXPIRY)
            return len(expired)

    def release_all(self) -> int:
        """Release every open lease (an engine closing); returns how many."""
        with self.lock:
            open_leases = list(self._open.values())
            for lease in open_leases:
                lease.release()
            self.next_expiry = NO_EXPIRY
            return len(open_leases)


def check_ttl(ttl_s: float) -> None:
    """A KvfsmError unless ``ttl_s`` is a finite number of seconds above 0."""
    if ttl_s is not DEFAULT_LEASE_TTL_S and (
            not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not ttl_s > 0
            or not math.isfinite(ttl_s)):
        raise KvfsmError(f"lease ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")


def _lost(core: StateCore, tokens: int, again: Verdict) -> LeaseLost:
    """Why a verdict of ``tokens`` is no longer served: the first reason of ``again`` (the
    lookup now), with its group, block and state where it names one."""
    first = next((each for each in again.reasons if each.group != "*"),
                 again.reasons[0] if again.reasons else None)
    if first is None:
        return LeaseLost(f"the verdict's {tokens} tokens are no longer usable, only "
                         f"{again.usable_tokens}; look up again")
    at = f" at prompt block {first.block_index}" if first.block_index >= 0 else ""
    detail = f" ({first.detail})" if first.detail else ""
    group = None if first.group == "*" else core.group(first.group)
    block = first.block_id if group is not None and first.block_id >= 0 else None
    return LeaseLost(f"the verdict's {tokens} tokens are no longer usable, only "
                     f"{again.usable_tokens}: {first.reason.value}{at}{detail}; look up again",
                     group=None if group is None else group.name, block=block,
                     state=None if group is None or block is None
                     else group.table.state_name(int(group.states[block])))
