"""A stored tier seen through a wrapper: tests subclass it to hold, doctor or fail some of its
calls while the rest go to the real tier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm.spec import Tier
from kvfsm.tiers import BlockKey, DiskTier, LoadResult, StoredTier


class Wrapped(StoredTier):
    """A disk tier seen through a wrapper that may hold or doctor its calls (this one passes
    every call through)."""

    tier = Tier.DISK

    def __init__(self, inner: DiskTier) -> None:
        self.inner = inner

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        return self.inner.put(keys, payloads, checksums)

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        return self.inner.load_into(keys, outs)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.contains(keys)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        return self.inner.remove(keys)

    def drain_evicted(self) -> list[BlockKey]:
        return self.inner.drain_evicted()
