"""The verdict: a prefix hit is not a usable cache."""

from kvfsm.verify._lookup import as_level, lookup
from kvfsm.verify._paths import RestorePaths, restore_paths
from kvfsm.verify._prompt import Prompt
from kvfsm.verify._types import (
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
    "Checks",
    "DeviceProfile",
    "GroupVerdict",
    "KernelLayouts",
    "LeaseSpans",
    "Level",
    "Probe",
    "ProbedGroup",
    "Prompt",
    "Reason",
    "RestorePaths",
    "RestoreStep",
    "Shortfall",
    "Verdict",
    "as_level",
    "lookup",
    "restore_paths",
]
