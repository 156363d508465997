"""Serving real hybrid-attention architectures with kvfsm.

Declarations from transformers configs (``declare``, ``declaration_toml``; see
``kvfsm/serve/_declare.py`` and docs/models.md for the group conventions), the packing order of
the packed recurrent groups, and tiny deterministic stand-in models for tests and demos.
``CacheAdapter`` commits a transformers cache into an engine's pools and rebuilds one from them
(full and sliding-window K/V), ``serve`` runs requests with no reuse, hit-only reuse or kvfsm's
verdict, and the fault injectors damage a live engine deterministically.

Nothing here imports transformers or torch until a function that needs them is called.
"""

from kvfsm.serve._adapter import CacheAdapter, CacheAdapterError, LayerGroup, Stored
from kvfsm.serve._declare import (
    declaration_toml,
    declare,
    deepseek_v4_overlap_shapes,
    qwen3_next_state_shapes,
)
from kvfsm.serve._faults import (
    corrupt_host_copy,
    evict_window_block,
    flip_device_bytes,
    restore_in_flight,
    spill_block,
)
from kvfsm.serve._loop import (
    MODES,
    PlanOutcome,
    Request,
    Result,
    ServeLoop,
    execute_plan,
    hit_bytes,
    serve,
)
from kvfsm.serve._tiny import SUPPORTED_MODEL_TYPES, tiny_config, tiny_model

__all__ = [
    "MODES",
    "SUPPORTED_MODEL_TYPES",
    "CacheAdapter",
    "CacheAdapterError",
    "LayerGroup",
    "PlanOutcome",
    "Request",
    "Result",
    "ServeLoop",
    "Stored",
    "corrupt_host_copy",
    "declaration_toml",
    "declare",
    "deepseek_v4_overlap_shapes",
    "evict_window_block",
    "execute_plan",
    "flip_device_bytes",
    "hit_bytes",
    "qwen3_next_state_shapes",
    "restore_in_flight",
    "serve",
    "spill_block",
    "tiny_config",
    "tiny_model",
]
