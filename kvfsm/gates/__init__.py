"""Gates between a verdict and the kernel's read: admission (reuse, wait or recompute) and the
compiled graph's signature (the layouts the kernel was captured with)."""

from kvfsm.gates._admission import Action, AdmissionConfig, AdmissionGate, Decision
from kvfsm.gates._graph import (
    GraphRegistry,
    GraphSignature,
    GraphVerdict,
    GroupSignature,
    SignatureError,
    check_graph,
)

__all__ = [
    "Action",
    "AdmissionConfig",
    "AdmissionGate",
    "Decision",
    "GraphRegistry",
    "GraphSignature",
    "GraphVerdict",
    "GroupSignature",
    "SignatureError",
    "check_graph",
]
