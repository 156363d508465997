"""Prometheus metrics of one engine: lookups and their tokens, shortfalls, restores, state
transitions, lease refusals and admission waits.

Names follow Prometheus conventions (base units, ``_total`` counters, ``_seconds``
histograms) and the serving demo's exposition (``kvfsm_lookups``, ``kvfsm_hit_tokens``,
``kvfsm_restores``, ...). prometheus-client is optional: it is imported when an
:class:`EngineMetrics` is built, which says how to install it when it is missing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.obs._lookup_tallies import LookupTallies
from kvfsm.spec import Event, GroupKind, Tier

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvfsm.lookup import Verdict

#: Upper bounds (seconds) of the restore latency histogram: a host copy takes well under a
#: millisecond, a remote fetch of a long prefix seconds.
RESTORE_SECONDS_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                  0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Upper bounds (seconds) of the admission wait histogram: a request waiting for restore
#: budget waits for other restores to finish.
ADMISSION_WAIT_SECONDS_BUCKETS: Final = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5,
                                         1.0, 5.0, 10.0, 30.0)

INSTALL_HINT: Final = 'pip install "kvfsm[metrics]"'


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise KvfsmError(f"EngineMetrics needs prometheus-client: {INSTALL_HINT}") from None
    return prometheus_client


def _name(value: object) -> str:
    """A label value: a tier or event's spec name, an enum's value, else the string."""
    if isinstance(value, Tier | Event):
        return value.spec_name
    if isinstance(value, GroupKind):
        return value.value
    return str(value)


def _count(value: int, what: str) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
        raise KvfsmError(f"EngineMetrics.{what}: count must be an int >= 0, got {value!r}")
    return int(value)


def _seconds(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating) \
            or not value >= 0 or value == float("inf"):
        raise KvfsmError(f"EngineMetrics.{what}: seconds must be a finite number >= 0, "
                         f"got {value!r}")
    return float(value)


class EngineMetrics:
    """The metrics of one engine, registered in ``registry`` (prometheus-client's default
    registry when None) under ``namespace``.

    ``Engine(metrics=...)`` attaches it to the engine's core (transitions) and reports every
    lookup; restores, lease refusals and admission waits are reported by whoever runs them.
    One set per registry and namespace: a second is a :class:`KvfsmError`.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 namespace: str = "kvfsm") -> None:
        prom = _prometheus()
        if registry is not None and not isinstance(registry, prom.CollectorRegistry):
            raise KvfsmError(f"EngineMetrics: registry must be a prometheus_client "
                             f"CollectorRegistry or None, got {type(registry).__name__}")
        self.registry = prom.REGISTRY if registry is None else registry
        self.namespace = namespace
        made: list[Any] = []

        def registered(make: Callable[[], Any]) -> Any:
            try:
                made.append(make())
            except ValueError as exc:  # already registered: take back what this one added
                for done in made:
                    self.registry.unregister(done)
                raise KvfsmError(f"EngineMetrics: {exc}; give each engine its own registry "
                                 "or namespace") from None
            return made[-1]

        def metric(kind: Any, name: str, doc: str, labels: tuple[str, ...] = (),
                   **extra: Any) -> Any:
            return registered(lambda: kind(name, doc, list(labels), namespace=namespace,
                                           registry=self.registry, **extra))

        def collector(tallies: LookupTallies) -> LookupTallies:
            self.registry.register(tallies)
            return tallies

        counter, histogram = prom.Counter, prom.Histogram
        # The lookup counters (lookups, prompt, hit and usable tokens, shortfalls): plain
        # numbers a scrape collects, not five counter increments on every lookup.
        self._lookup_tallies: LookupTallies = registered(
            lambda: collector(LookupTallies(namespace)))
        self.restores = metric(counter, "restores", "Blocks restored, by group, state kind, "
                               "tier the copy came from and outcome.",
                               ("group", "kind", "tier", "outcome"))
        self.restore_duration = metric(histogram, "restore_duration_seconds",
                                       "Restore latency per batch, by the tier the copies "
                                       "came from.", ("tier",),
                                       buckets=RESTORE_SECONDS_BUCKETS)
        self.transitions = metric(counter, "transitions", "Block state transitions, by group "
                                  "and event.", ("group", "event"))
        self.lease_refusals = metric(counter, "lease_refusals", "Read leases refused, by "
                                     "group.", ("group",))
        self.admission_wait = metric(histogram, "admission_wait_seconds",
                                     "Time requests waited for restore admission.",
                                     buckets=ADMISSION_WAIT_SECONDS_BUCKETS)
        self.tier_up = metric(prom.Gauge, "tier_up", "1 while a stored tier answers, 0 while "
                              "it backs off after failed calls, by tier.", ("tier",))
        self.tier_failures = metric(counter, "tier_failures", "Times a stored tier stopped "
                                    "answering (went from up to backing off), by tier.",
                                    ("tier",))
        # Labelled children by key: a transition batch or a lookup costs a dict lookup and
        # an inc per labelled figure (``labels()`` costs several times more).
        self._moves: dict[tuple[str, Event], Any] = {}
        self._lock = threading.Lock()

    # -- what the engine and its data path report ---------------------------------------------

    def observe_lookup(self, verdict: Verdict) -> None:
        """One lookup's verdict: its tokens and its shortfalls by reason and group."""
        self._lookup_tallies.observe(verdict)

    def observe_restore(self, group: str, kind: GroupKind | str, tier: Tier | str,
                        outcome: str, count: int, seconds: float) -> None:
        """``count`` blocks of ``group`` (of ``kind``) restored from ``tier`` with
        ``outcome`` in ``seconds`` (one batch)."""
        self.observe_restores(group, kind, tier, {outcome: count}, seconds)

    def observe_restores(self, group: str, kind: GroupKind | str, tier: Tier | str,
                         outcomes: Mapping[str, int], seconds: float) -> None:
        """One batch of restores of ``group`` (of ``kind``) from ``tier`` that took
        ``seconds``: blocks per outcome (the engine reports load statuses in lower case:
        ``ok`` made readable, ``missing``, ``corrupt``, ``foreign``, ``failed``, ``late``)."""
        counts = {outcome: _count(count, "observe_restores")
                  for outcome, count in outcomes.items()}
        took = _seconds(seconds, "observe_restores")
        for outcome, blocks in counts.items():
            self.restores.labels(group, _name(kind), _name(tier), outcome).inc(blocks)
        self.restore_duration.labels(_name(tier)).observe(took)

    def observe_lease_refusal(self, group: str, count: int = 1) -> None:
        self.lease_refusals.labels(group).inc(_count(count, "observe_lease_refusal"))

    def observe_admission_wait(self, seconds: float) -> None:
        self.admission_wait.observe(_seconds(seconds, "observe_admission_wait"))

    def observe_tier(self, tier: Tier | str, up: bool) -> None:
        """A stored tier answers (``up``) or stopped answering and backs off."""
        self.tier_up.labels(_name(tier)).set(1 if up else 0)
        if not up:
            self.tier_failures.labels(_name(tier)).inc()

    # -- a core observer (transitions) --------------------------------------------------------

    def moved(self, group: str, event: Event, ids: NDArray[np.intp],
              before: NDArray[np.uint8], after: NDArray[np.uint8],
              epochs: NDArray[np.uint32]) -> None:
        child = self._moves.get((group, event))
        if child is None:
            with self._lock:
                child = self._moves.setdefault(
                    (group, event), self.transitions.labels(group, event.spec_name))
        child.inc(ids.shape[0])

    #: Reads are not counted here (lease outcomes are): the core tells none (a lease with no
    #: other observer then gathers no read to report).
    observes_reads = False

    def read(self, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> None:
        """Never called (:attr:`observes_reads`); here for the observer protocol."""

    def exposition(self) -> bytes:
        """The registry's metrics in the Prometheus text format."""
        data: bytes = _prometheus().generate_latest(self.registry)
        return data


__all__ = ["ADMISSION_WAIT_SECONDS_BUCKETS", "INSTALL_HINT", "RESTORE_SECONDS_BUCKETS",
           "EngineMetrics"]
