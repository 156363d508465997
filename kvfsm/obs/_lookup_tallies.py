"""The lookup counters of :class:`~kvfsm.obs.EngineMetrics`, kept as plain numbers and handed
to Prometheus when it collects.

Every lookup adds to five figures (lookups by level, prompt, hit and usable tokens, shortfalls
by reason and group). As prometheus-client counters that is five ``inc`` calls, each taking
the counter's lock: some 2 µs on every lookup, a scheduler's hottest call. Here a lookup adds
to numbers under one lock, and a scrape (``collect``) turns them into counter families with
the same names and labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfsm.verify import Verdict


class LookupTallies:
    """A prometheus-client collector of lookup counters under ``namespace``: ``lookups`` (by
    ``level``), ``prompt_tokens``, ``hit_tokens``, ``usable_tokens`` and ``shortfalls`` (by
    ``reason`` and ``group``), each exposed as ``<namespace>_<name>_total``."""

    #: name, help text, label names.
    FAMILIES = (
        ("lookups", "Prefix lookups, by verification level.", ("level",)),
        ("prompt_tokens", "Prompt tokens of the lookups.", ()),
        ("hit_tokens", "Prompt tokens the prefix hash found (the classic hit, every group's "
         "hash chain present).", ()),
        ("usable_tokens", "Prompt tokens kvfsm found usable right now.", ()),
        ("shortfalls", "Shortfalls in verdicts, by reason and group ('*': the whole model).",
         ("reason", "group")),
    )

    def __init__(self, namespace: str) -> None:
        # prometheus-client is optional: imported where an EngineMetrics is made.
        from prometheus_client.core import CounterMetricFamily

        self._family = CounterMetricFamily
        self.namespace = namespace
        #: By family name: label values to count (unlabelled figures under ``()``).
        self._counts: dict[str, dict[tuple[str, ...], int]] = {
            name: ({} if labels else {(): 0}) for name, _, labels in self.FAMILIES}
        self._lock = threading.Lock()

    def observe(self, verdict: Verdict) -> None:
        """One lookup's verdict."""
        counts = self._counts
        with self._lock:
            levels = counts["lookups"]
            level = (verdict.level.value,)
            levels[level] = levels.get(level, 0) + 1
            counts["prompt_tokens"][()] += verdict.prompt_tokens
            counts["hit_tokens"][()] += verdict.hit_tokens
            counts["usable_tokens"][()] += verdict.usable_tokens
            if verdict.reasons:
                shortfalls = counts["shortfalls"]
                for shortfall in verdict.reasons:
                    key = (shortfall.reason.value, shortfall.group)
                    shortfalls[key] = shortfalls.get(key, 0) + 1

    def collect(self) -> Iterator[Any]:
        """The counter families now (prometheus-client calls this on every scrape)."""
        with self._lock:
            snapshot = {name: dict(values) for name, values in self._counts.items()}
        yield from self._families(snapshot)

    def describe(self) -> Iterator[Any]:
        """The families without samples: the registry refuses a second set of these names."""
        yield from self._families({name: {} for name in self._counts})

    def _families(self, counts: dict[str, dict[tuple[str, ...], int]]) -> Iterator[Any]:
        for name, documentation, labels in self.FAMILIES:
            family = self._family(f"{self.namespace}_{name}", documentation,
                                  labels=list(labels))
            for values, count in counts[name].items():
                family.add_metric(list(values), count)
            yield family


__all__ = ["LookupTallies"]
