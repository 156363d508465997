"""Lifecycle specs: the vocabulary, the frozen values, and the loader/validator."""

from kvfsm.spec._loader import load_lifecycle, parse_lifecycle
from kvfsm.spec._model import Call, Lifecycle, Row, StateDef
from kvfsm.spec._models import MAX_BLOCK_BYTES, GroupDecl, Layout, ModelDecl
from kvfsm.spec._models_loader import load_model, parse_model, shipped_models
from kvfsm.spec._shipped import shipped_lifecycles, shipped_specs_dir, spec_files
from kvfsm.spec._vocabulary import (
    EFFECTS,
    GUARDS,
    Content,
    Event,
    Form,
    GroupKind,
    Tier,
)

__all__ = [
    "EFFECTS",
    "GUARDS",
    "MAX_BLOCK_BYTES",
    "Call",
    "Content",
    "Event",
    "Form",
    "GroupDecl",
    "GroupKind",
    "Layout",
    "Lifecycle",
    "ModelDecl",
    "Row",
    "StateDef",
    "Tier",
    "load_lifecycle",
    "load_model",
    "parse_lifecycle",
    "parse_model",
    "shipped_lifecycles",
    "shipped_models",
    "shipped_specs_dir",
    "spec_files",
]
