"""The lookup counters of :class:`~kvfsm.obs.EngineMetrics`, kept as plain numbers and handed
to Prometheus when it collects.

Every lookup adds to five figures (lookups by level, prompt, hit and usable tokens, shortfalls
by reason and group). As prometheus-client counters that is five ``inc`` calls, each taking
the counter's lock: some 2 µs on every lookup, a scheduler's hottest call. Here a lookup adds
to plain numbers under one lock (levels and reasons keyed by identity: no enum hash or value
on the hot path), and a scrape (``collect``) turns them into counter families with the same
names and labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfsm.lookup import Verdict


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

        from kvfsm.lookup import Level, Reason

        self._family = CounterMetricFamily
        self.namespace = namespace
        # Levels and reasons are keyed by identity (enum members are singletons): an enum's
        # hash and ``value`` are Python-level calls, and a lookup pays for each it makes.
        self._level_of = {id(level): level for level in Level}
        self._reason_of = {id(reason): reason for reason in Reason}
        self._lookups: dict[int, int] = {}
        self._prompt_tokens = self._hit_tokens = self._usable_tokens = 0
        self._shortfalls: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def observe(self, verdict: Verdict) -> None:
        """One lookup's verdict."""
        level = id(verdict.level)
        reasons = verdict.reasons
        with self._lock:
            lookups = self._lookups
            lookups[level] = lookups.get(level, 0) + 1
            self._prompt_tokens += verdict.prompt_tokens
            self._hit_tokens += verdict.hit_tokens
            self._usable_tokens += verdict.usable_tokens
            if reasons:
                shortfalls = self._shortfalls
                for shortfall in reasons:
                    key = (id(shortfall.reason), shortfall.group)
                    shortfalls[key] = shortfalls.get(key, 0) + 1

    def collect(self) -> Iterator[Any]:
        """The counter families now (prometheus-client calls this on every scrape)."""
        with self._lock:
            lookups, shortfalls = dict(self._lookups), dict(self._shortfalls)
            tokens = (self._prompt_tokens, self._hit_tokens, self._usable_tokens)
        level_of, reason_of = self._level_of, self._reason_of
        yield from self._families({
            "lookups": {(level_of[level].value,): count for level, count in lookups.items()},
            "prompt_tokens": {(): tokens[0]},
            "hit_tokens": {(): tokens[1]},
            "usable_tokens": {(): tokens[2]},
            "shortfalls": {(reason_of[reason].value, group): count
                           for (reason, group), count in shortfalls.items()},
        })

    def describe(self) -> Iterator[Any]:
        """The families without samples: the registry refuses a second set of these names."""
        yield from self._families({name: {} for name, _, _ in self.FAMILIES})

    def _families(self, counts: dict[str, dict[tuple[str, ...], int]]) -> Iterator[Any]:
        for name, documentation, labels in self.FAMILIES:
            family = self._family(f"{self.namespace}_{name}", documentation,
                                  labels=list(labels))
            for values, count in counts[name].items():
                family.add_metric(list(values), count)
            yield family


__all__ = ["LookupTallies"]
