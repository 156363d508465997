"""Gates between a verdict and the kernel's read: what must still hold when the bytes are used."""

from kvfsm.gates._admission import Action, AdmissionConfig, AdmissionGate, Decision
from kvfsm.gates._graph import (
    GraphRegistry,
    GraphSignature,
    GraphVerdict,
    GroupSignature,
    SignatureError,
    check_graph,
)
from kvfsm.gates._lease import DEFAULT_LEASE_TTL_S, Lease
from kvfsm.gates._lease_book import NO_EXPIRY, LeaseBook, check_ttl

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "NO_EXPIRY",
    "Action",
    "AdmissionConfig",
    "AdmissionGate",
    "Decision",
    "GraphRegistry",
    "GraphSignature",
    "GraphVerdict",
    "GroupSignature",
    "Lease",
    "LeaseBook",
    "SignatureError",
    "check_graph",
    "check_ttl",
]
