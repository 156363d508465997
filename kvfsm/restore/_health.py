"""Whether a stored tier answers, and how long a caller waits for it.

A store that stops answering (killed, frozen, black-holed) must cost its own restores and
spills, never other calls, and must not be hammered: every load, put or presence question that
fails or runs out of time backs the tier off (nothing is asked of it until ``retry_at``, the
wait doubling from ``backoff_first_s`` up to ``backoff_max_s``). A remote tier (``probed``) then
gets no loads or spills until it has answered a presence question again, bounded by
``presence_s``: a lookup's, or a probe the engine sends once the back-off is over, so a call
into a store that still hangs is one short question, never a load or a put that holds a worker
(and the caller waiting for it) until the client's own timeout. The cap is what bounds the time
from a store's return to the first good restore.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs

from kvfsm import _args
from kvfsm.spec import Tier

_log = logging.getLogger("kvfsm.restore")


def _seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    _args.seconds(f"StoreTimeouts.{attribute.name}", value)


@attrs.frozen
class StoreTimeouts:
    """How long calls wait on stored tiers (seconds), and how a failing tier backs off."""

    #: A lookup's question "which of these blocks does the store hold?" (asked without the
    #: engine's lock): past it the lookup answers from what the core knows.
    presence_s: float = attrs.field(default=0.05, validator=_seconds)
    #: A commit, offload or spill waits this long (without the engine's lock) for the copies
    #: that make room below; what has not landed by then is evicted rather than waited for.
    spill_wait_s: float = attrs.field(default=2.0, validator=_seconds)
    #: First and longest pause of a tier after a failure (doubling in between).
    backoff_first_s: float = attrs.field(default=0.05, validator=_seconds)
    backoff_max_s: float = attrs.field(default=0.5, validator=_seconds)


@attrs.define
class TierHealth:
    """One stored tier's record of failures: ``down()`` while it is backing off."""

    tier: Tier
    timeouts: StoreTimeouts
    clock: Callable[[], float] = time.monotonic
    #: After a failure, loads and spills wait for an answer (a presence question) rather than
    #: for the back-off's end alone (a remote tier; a disk tier has nothing cheap to ask).
    probed: bool = False
    #: Told ``(tier, up)`` whenever the tier goes down or comes back (metrics).
    listeners: list[Callable[[Tier, bool], None]] = attrs.field(factory=list)
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None

    @property
    def up(self) -> bool:
        return self.failures == 0

    def down(self) -> bool:
        """True while nothing should be asked of the tier (backing off after a failure)."""
        return self.failures > 0 and self.clock() < self.retry_at

    def usable(self) -> bool:
        """Whether loads and spills may start now: the tier answered since its last failure,
        or (not ``probed``) its back-off is over."""
        return self.failures == 0 or (not self.probed and self.clock() >= self.retry_at)

    def probe_due(self) -> bool:
        """A ``probed`` tier that failed, whose back-off is over: ask it a presence question
        before any load or spill."""
        return self.probed and self.failures > 0 and self.clock() >= self.retry_at

    def wait_s(self) -> float:
        """Seconds until the tier may be asked again (0 when it may now)."""
        return max(0.0, self.retry_at - self.clock()) if self.failures else 0.0

    def failed(self, why: str) -> None:
        """A call failed or ran out of time: back off (longer each time, up to the cap)."""
        first = self.failures == 0
        self.failures += 1
        # The doubling stops at the cap (2 ** n of a store down for hours overflows a float).
        pause = min(self.timeouts.backoff_first_s * 2.0 ** min(self.failures - 1, 64),
                    self.timeouts.backoff_max_s)
        self.retry_at = self.clock() + pause
        self.last_error = why
        if first:
            _log.warning("kvfsm: the %s tier is not answering (%s); its restores and spills "
                         "back off, those blocks are recomputed meanwhile", self.tier.spec_name,
                         why)
            self._tell(False)

    def answered(self) -> None:
        """A call succeeded: the tier is up again."""
        if self.failures:
            _log.info("kvfsm: the %s tier answers again after %d failed calls",
                      self.tier.spec_name, self.failures)
            self.failures = 0
            self.retry_at = 0.0
            self.last_error = None
            self._tell(True)

    def _tell(self, up: bool) -> None:
        for listener in self.listeners:
            listener(self.tier, up)
