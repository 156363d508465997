"""kvfsm: the state core of a KV cache, where a prefix hit is never mistaken for a usable cache.

The public surface is re-exported here; everything else lives in private modules.
"""

from kvfsm._engine import Engine, VerifyPolicy
from kvfsm._errors import (
    BindingError,
    EngineClosed,
    ForeignPromptError,
    GuardRejected,
    IllegalTransition,
    KvfsmError,
    LeaseLost,
    SpecError,
    SpecProblem,
    TokenError,
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
from kvfsm.gates import GraphSignature, GroupSignature, SignatureError
from kvfsm.lookup import DeviceProfile, Lease, Level, Reason, Verdict
from kvfsm.obs import EngineMetrics, EventLog
from kvfsm.spec import (
    Event,
    Lifecycle,
    ModelDecl,
    Tier,
    load_lifecycle,
    load_model,
    parse_lifecycle,
    shipped_lifecycles,
    shipped_models,
)
from kvfsm.state import (
    BlockInfo,
    CoreConfig,
    InvariantViolation,
    PrefixHashes,
    Prompt,
    StateCore,
    StateError,
    explore_core,
)

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "BlockInfo",
    "Bounds",
    "CheckResult",
    "CompiledTable",
    "CoreConfig",
    "DeviceProfile",
    "Engine",
    "EngineClosed",
    "EngineMetrics",
    "Event",
    "EventLog",
    "ForeignPromptError",
    "GraphSignature",
    "GroupSignature",
    "GuardRejected",
    "IllegalTransition",
    "Invariant",
    "InvariantViolation",
    "KvfsmError",
    "Lease",
    "LeaseLost",
    "Level",
    "Lifecycle",
    "Machine",
    "ModelDecl",
    "PrefixHashes",
    "Prompt",
    "Reason",
    "ReferenceMachine",
    "SignatureError",
    "SpecError",
    "SpecProblem",
    "StateCore",
    "StateError",
    "Tier",
    "TokenError",
    "TransitionError",
    "Verdict",
    "VerifyPolicy",
    "Violation",
    "__version__",
    "check_lifecycle",
    "compile_lifecycle",
    "diagram",
    "explore_core",
    "load_lifecycle",
    "load_model",
    "parse_lifecycle",
    "shipped_lifecycles",
    "shipped_models",
]
