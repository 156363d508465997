"""Lifecycle specs: the vocabulary, the frozen values, and the loader/validator."""

from kvfsm.spec._loader import load_lifecycle, parse_lifecycle
from kvfsm.spec._model import Call, Lifecycle, Row, StateDef
from kvfsm.spec._shipped import shipped_lifecycles, shipped_specs_dir, spec_files
from kvfsm.spec._vocabulary import (
    EFFECTS,
    GUARDS,
    Content,
    Event,
    Form,
    Tier,
)

__all__ = [
    "EFFECTS",
    "GUARDS",
    "Call",
    "Content",
    "Event",
    "Form",
    "Lifecycle",
    "Row",
    "StateDef",
    "Tier",
    "load_lifecycle",
    "parse_lifecycle",
    "shipped_lifecycles",
    "shipped_specs_dir",
    "spec_files",
]
