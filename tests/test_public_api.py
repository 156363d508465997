"""The public API is exactly what we say it is."""

from __future__ import annotations

import kvfsm
import kvfsm.fsm
import kvfsm.gates
import kvfsm.kinds
import kvfsm.lookup
import kvfsm.memory
import kvfsm.obs
import kvfsm.spec
import kvfsm.state

EXPECTED = {
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
    "shipped_lifecycles", "CoreConfig", "InvariantViolation", "ModelDecl", "PrefixHashes",
    "StateCore", "StateError", "explore_core", "load_model", "shipped_models",
    "DeviceProfile", "Engine", "Level", "Prompt", "Reason", "Verdict", "VerifyPolicy",
    "BlockInfo", "ForeignPromptError", "TokenError",
    "Lease", "LeaseLost", "EngineClosed",
    "GraphSignature", "GroupSignature", "SignatureError",
    "EngineMetrics", "EventLog",
}


def test_top_level_surface() -> None:
    assert set(kvfsm.__all__) == EXPECTED
    for name in kvfsm.__all__:
        assert hasattr(kvfsm, name), name


def test_subpackages_export_what_they_list() -> None:
    for module in (kvfsm.fsm, kvfsm.spec, kvfsm.state, kvfsm.memory, kvfsm.lookup, kvfsm.kinds,
                   kvfsm.gates, kvfsm.obs):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_public_objects_live_in_private_modules() -> None:
    """Implementation stays private: public names are re-exports from underscore modules."""
    for name in kvfsm.__all__:
        obj = getattr(kvfsm, name)
        module = getattr(obj, "__module__", None)
        if module is not None and module.startswith("kvfsm."):
            assert any(part.startswith("_") for part in module.split(".")[1:]), (name, module)


def test_errors_share_a_base() -> None:
    for name in (
        "BindingError",
        "GuardRejected",
        "IllegalTransition",
        "SpecError",
        "TransitionError",
        "StateError",
        "InvariantViolation",
        "TokenError",
        "ForeignPromptError",
        "LeaseLost",
        "EngineClosed",
        "SignatureError",
    ):
        assert issubclass(getattr(kvfsm, name), kvfsm.KvfsmError)
