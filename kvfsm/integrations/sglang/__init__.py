"""kvfsm's stored tiers as an SGLang HiCache storage backend (SGLang 0.5.23).

Switch it on with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvfsm", "module_path": "kvfsm.integrations.sglang",
"class_name": "KvfsmStorage", "kvfsm_disk_dir": "/path"}`` (or ``kvfsm_mooncake_master`` /
``kvfsm_redis``). ``KvfsmStorage`` imports SGLang and torch, so it is loaded on first use;
the page identity and the per-pool rule need neither.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvfsm.integrations.sglang._identity import PagePool, namespace_digest, page_pool
from kvfsm.integrations.sglang._staging import VerifiedPages
from kvfsm.integrations.sglang._verdict import (
    RestorablePrefix,
    StoragePool,
    pool_for_policy,
    restorable_prefix,
    servable,
)

#: Names loaded from the backend module on first use (they need SGLang and torch).
_LAZY = frozenset({"KvfsmStorage", "tier_from_config"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("kvfsm.integrations.sglang._backend"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KvfsmStorage",
    "PagePool",
    "RestorablePrefix",
    "StoragePool",
    "VerifiedPages",
    "namespace_digest",
    "page_pool",
    "pool_for_policy",
    "restorable_prefix",
    "servable",
    "tier_from_config",
]
