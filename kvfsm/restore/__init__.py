"""The data path of stored tiers: restore plans executed with real copies, and spills into
disk and remote tiers, on worker threads, every block's transition completed by ``fire``."""

from kvfsm.restore._executor import (
    GroupOutcome,
    RestoreExecutor,
    RestoreListener,
    RestoreTicket,
    SpillJob,
)
from kvfsm.restore._health import StoreTimeouts, TierHealth
from kvfsm.restore._keys import KeyMaker

__all__ = ["GroupOutcome", "KeyMaker", "RestoreExecutor", "RestoreListener", "RestoreTicket",
           "SpillJob", "StoreTimeouts", "TierHealth"]
