"""kvfsm: the state core of a KV cache, where a prefix hit is never mistaken for a usable cache.

The public surface is re-exported here; everything else lives in private modules.
"""

from kvfsm._errors import (
    BindingError,
    GuardRejected,
    IllegalTransition,
    KvfsmError,
    SpecError,
    SpecProblem,
    TransitionError,
)
from kvfsm.fsm import (
    Bounds,
    CheckResult,
    CompiledTable,
    Invariant,
    Machine,
    ReferenceMachine,
    Violation,
    check_lifecycle,
    compile_lifecycle,
    diagram,
)
from kvfsm.spec import (
    Event,
    Lifecycle,
    Tier,
    load_lifecycle,
    parse_lifecycle,
    shipped_lifecycles,
)

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "Bounds",
    "CheckResult",
    "CompiledTable",
    "Event",
    "GuardRejected",
    "IllegalTransition",
    "Invariant",
    "KvfsmError",
    "Lifecycle",
    "Machine",
    "ReferenceMachine",
    "SpecError",
    "SpecProblem",
    "Tier",
    "TransitionError",
    "Violation",
    "__version__",
    "check_lifecycle",
    "compile_lifecycle",
    "diagram",
    "load_lifecycle",
    "parse_lifecycle",
    "shipped_lifecycles",
]
