"""Compiled lifecycle tables, the machine that fires them, the reference, the checker, diagrams."""

from kvfsm.fsm._checker import (
    BUILTIN_INVARIANTS,
    NO_LEAK,
    Bounds,
    CheckResult,
    Invariant,
    View,
    Violation,
    check_lifecycle,
)
from kvfsm.fsm._compiled import (
    FORM_CODE,
    FORM_COMPRESSED,
    FORM_NONE,
    FORM_RAW,
    INVALID,
    NO_ROW,
    CompiledTable,
    compile_lifecycle,
)
from kvfsm.fsm._diagram import FORMATS, diagram, lifecycle_page, svg_spec_hash
from kvfsm.fsm._machine import EffectFn, GuardFn, Machine, bind_all
from kvfsm.fsm._reference import ReferenceMachine

__all__ = [
    "BUILTIN_INVARIANTS",
    "FORMATS",
    "FORM_CODE",
    "FORM_COMPRESSED",
    "FORM_NONE",
    "FORM_RAW",
    "INVALID",
    "NO_LEAK",
    "NO_ROW",
    "Bounds",
    "CheckResult",
    "CompiledTable",
    "EffectFn",
    "GuardFn",
    "Invariant",
    "Machine",
    "ReferenceMachine",
    "View",
    "Violation",
    "bind_all",
    "check_lifecycle",
    "compile_lifecycle",
    "diagram",
    "lifecycle_page",
    "svg_spec_hash",
]
