"""The lookup and the lease: how much of a prompt is usable now (a hit is not a usable cache),
and the pins that keep it so while a kernel reads it."""

from kvfsm.lookup._lease import DEFAULT_LEASE_TTL_S, Lease
from kvfsm.lookup._lease_book import NO_EXPIRY, LeaseBook, check_ttl
from kvfsm.lookup._lookup import as_level, lookup
from kvfsm.lookup._paths import RestorePaths, restore_paths
from kvfsm.lookup._types import (
    Checks,
    DeviceProfile,
    GroupVerdict,
    KernelLayouts,
    LeaseSpans,
    Level,
    Probe,
    ProbedGroup,
    Reason,
    RestoreStep,
    Shortfall,
    Verdict,
)

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "NO_EXPIRY",
    "Checks",
    "DeviceProfile",
    "GroupVerdict",
    "KernelLayouts",
    "Lease",
    "LeaseBook",
    "LeaseSpans",
    "Level",
    "Probe",
    "ProbedGroup",
    "Reason",
    "RestorePaths",
    "RestoreStep",
    "Shortfall",
    "Verdict",
    "as_level",
    "check_ttl",
    "lookup",
    "restore_paths",
]
