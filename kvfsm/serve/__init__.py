"""Serving real hybrid-attention architectures with kvfsm.

Declarations from transformers configs (``declare``, ``declaration_toml``; see
``kvfsm/serve/_declare.py`` and docs/models.md for the group conventions), the packing order of
the packed recurrent groups, and tiny deterministic stand-in models for tests and demos.
``CacheAdapter`` commits a transformers cache into an engine's pools and rebuilds one from them
(one codec per group kind: K/V blocks, packed recurrent snapshots, compressed entries; prompts
prefilled in chunks ending at each capture point), ``serve`` runs requests with no reuse,
hit-only reuse or kvfsm's verdict (restoring from host, disk and remote tiers), and the fault
injectors damage a live engine deterministically, per kind and per stored tier. Seeded
workloads (chat over a shared system prompt, questions over long documents) with fault
schedules across a model's cache groups, and the ``kvfsm demo`` run and report built on them
(``run_demo``, ``demo_figures``, ``write_outputs``; the remote store it starts: ``RemoteStore``,
``choose_remote``), close the loop.

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
    delete_disk_file,
    evict_compressed_block,
    evict_remote_value,
    evict_snapshot,
    evict_window_block,
    flip_device_bytes,
    flip_disk_byte,
    plant_foreign_value,
    restore_in_flight,
    slow_remote,
    spill_block,
    stale_snapshot,
    truncate_disk_file,
)
from kvfsm.serve._loop import (
    MODES,
    MissingValue,
    Request,
    RestoreOutcome,
    Result,
    ServeLoop,
    StepOutcome,
    hit_bytes,
    restore_plan,
    serve,
)
from kvfsm.serve._report import demo_figures, metrics_text, write_outputs
from kvfsm.serve._stores import REMOTE_CHOICES, ObservedTier, RemoteStore, choose_remote
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
    "REMOTE_CHOICES",
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
    "MissingValue",
    "ModelRun",
    "ObservedTier",
    "RemoteStore",
    "Request",
    "RestoreOutcome",
    "Result",
    "ServeLoop",
    "Snapshots",
    "StepOutcome",
    "Stored",
    "Workload",
    "WorkloadSize",
    "chat",
    "checkpoint_block",
    "choose_remote",
    "compressed_block",
    "compression_incomplete",
    "corrupt_host_copy",
    "declaration_toml",
    "declare",
    "deepseek_v4_overlap_shapes",
    "delete_disk_file",
    "demo_figures",
    "demo_workload",
    "document_qa",
    "evict_compressed_block",
    "evict_remote_value",
    "evict_snapshot",
    "evict_window_block",
    "fault_schedule",
    "flip_device_bytes",
    "flip_disk_byte",
    "hit_bytes",
    "metrics_text",
    "plant_foreign_value",
    "qwen3_next_state_shapes",
    "restore_in_flight",
    "restore_plan",
    "run_demo",
    "serve",
    "served_models",
    "slow_remote",
    "spill_block",
    "stale_snapshot",
    "tiny_config",
    "tiny_model",
    "truncate_disk_file",
    "write_outputs",
]
