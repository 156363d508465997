"""The logical line: per-group metadata arrays, prefix identity (a prompt's block hashes), and
the core that owns them."""

from kvfsm.state._budget import RestoreBudget
from kvfsm.state._core import BlockInfo, CoreConfig, InvariantViolation, StateCore
from kvfsm.state._explore import CoreCheckResult, CoreViolation, explore_core
from kvfsm.state._group import (
    FAILED,
    MAX_PINS,
    NO_TARGET,
    UNCHECKED,
    VERIFIED,
    GroupState,
    StateError,
)
from kvfsm.state._hashing import (
    HASH_FUNCTIONS,
    PrefixHashes,
    hash_seed,
    join_words,
    split_digest,
)
from kvfsm.state._invariants import CORE_INVARIANTS, CoreInvariant, core_problems
from kvfsm.state._prompt import Prompt

__all__ = [
    "CORE_INVARIANTS",
    "FAILED",
    "HASH_FUNCTIONS",
    "MAX_PINS",
    "NO_TARGET",
    "UNCHECKED",
    "VERIFIED",
    "BlockInfo",
    "CoreCheckResult",
    "CoreConfig",
    "CoreInvariant",
    "CoreViolation",
    "GroupState",
    "InvariantViolation",
    "PrefixHashes",
    "Prompt",
    "RestoreBudget",
    "StateCore",
    "StateError",
    "core_problems",
    "explore_core",
    "hash_seed",
    "join_words",
    "split_digest",
]
