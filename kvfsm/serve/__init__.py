"""Serving real hybrid-attention architectures with kvfsm.

Declarations from transformers configs (``declare``, ``declaration_toml``; see
``kvfsm/serve/_declare.py`` and docs/models.md for the group conventions), the packing order of
the packed recurrent groups, and tiny deterministic stand-in models for tests and demos.
``CacheAdapter`` commits a transformers cache into an engine's pools and rebuilds one from them
(one codec per group kind: K/V blocks, packed recurrent snapshots, compressed entries; prompts
prefilled in chunks ending at each capture point), ``serve`` runs requests with no reuse,
hit-only reuse or kvfsm's verdict, and the fault injectors damage a live engine
deterministically, per kind. Seeded workloads (chat over a shared system prompt, questions over
long documents) with fault schedules across a model's cache groups, and the ``kvfsm demo`` run
and report built on them (``run_demo``, ``demo_figures``, ``write_outputs``), close the loop.

Nothing here imports transformers or torch until a function that needs them is called.
"""

from kvfsm.serve._adapter import (
    CODECS,
    CacheAdapter,
    CacheAdapterError,
    Codec,
    Entries,
    KVBlocks,
    LayerGroup,
    Snapshots,
    Stored,
)
from kvfsm.serve._declare import (
    declaration_toml,
    declare,
    deepseek_v4_overlap_shapes,
    qwen3_next_state_shapes,
)
from kvfsm.serve._demo import DEMO_ORDER, DemoRun, DemoSettings, ModelRun, run_demo, served_models
from kvfsm.serve._faults import (
    checkpoint_block,
    compressed_block,
    compression_incomplete,
    corrupt_host_copy,
    evict_compressed_block,
    evict_snapshot,
    evict_window_block,
    flip_device_bytes,
    restore_in_flight,
    spill_block,
    stale_snapshot,
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
from kvfsm.serve._report import demo_figures, metrics_text, write_outputs
from kvfsm.serve._tiny import SUPPORTED_MODEL_TYPES, tiny_config, tiny_model
from kvfsm.serve._workload import (
    Fault,
    FaultHook,
    Workload,
    WorkloadSize,
    chat,
    demo_workload,
    document_qa,
    fault_schedule,
)

__all__ = [
    "CODECS",
    "DEMO_ORDER",
    "MODES",
    "SUPPORTED_MODEL_TYPES",
    "CacheAdapter",
    "CacheAdapterError",
    "Codec",
    "DemoRun",
    "DemoSettings",
    "Entries",
    "Fault",
    "FaultHook",
    "KVBlocks",
    "LayerGroup",
    "ModelRun",
    "PlanOutcome",
    "Request",
    "Result",
    "ServeLoop",
    "Snapshots",
    "Stored",
    "Workload",
    "WorkloadSize",
    "chat",
    "checkpoint_block",
    "compressed_block",
    "compression_incomplete",
    "corrupt_host_copy",
    "declaration_toml",
    "declare",
    "deepseek_v4_overlap_shapes",
    "demo_figures",
    "demo_workload",
    "document_qa",
    "evict_compressed_block",
    "evict_snapshot",
    "evict_window_block",
    "execute_plan",
    "fault_schedule",
    "flip_device_bytes",
    "hit_bytes",
    "metrics_text",
    "qwen3_next_state_shapes",
    "restore_in_flight",
    "run_demo",
    "serve",
    "served_models",
    "spill_block",
    "stale_snapshot",
    "tiny_config",
    "tiny_model",
    "write_outputs",
]
