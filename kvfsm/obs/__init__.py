"""Observability: a JSON Lines log of every state change, its replay through the lifecycle
tables, and Prometheus metrics of an engine (prometheus-client: ``kvfsm[metrics]``)."""

from kvfsm.obs._eventlog import FLUSH_EVERY, EventLog, table_digest
from kvfsm.obs._metrics import EngineMetrics
from kvfsm.obs._replay import CHECKS, ReplayResult, ReplayViolation, replay
from kvfsm.state._group import CoreObserver

__all__ = [
    "CHECKS",
    "FLUSH_EVERY",
    "CoreObserver",
    "EngineMetrics",
    "EventLog",
    "ReplayResult",
    "ReplayViolation",
    "replay",
    "table_digest",
]
