"""Pages whose stored copy was just read and verified, kept so the read that follows is a copy.

SGLang asks whether pages exist (``batch_exists``) and then reads them (``batch_get``). A page
is reported only after its stored copy was read and verified, so the bytes that check read are
kept here, bounded, and the read takes them instead of going to the tier again. A stored name
is content-addressed (the chained hash of the prefix, the model, the layout), so bytes verified
under it stay that name's content even if the tier drops the copy meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
from numpy.typing import NDArray


class VerifiedPages:
    """Verified payloads by stored name, least recently used first, at most
    ``capacity_bytes`` in all (0 keeps nothing). Safe to share between threads."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"VerifiedPages capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._pages: OrderedDict[str, NDArray[np.uint8]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def add(self, name: str, payload: NDArray[np.uint8]) -> None:
        """Keep ``payload`` (owned from now on: not copied) as ``name``'s verified bytes,
        dropping the least recently used pages beyond the capacity."""
        if payload.nbytes > self._capacity:
            return
        with self._lock:
            old = self._pages.pop(name, None)
            if old is not None:
                self._used -= old.nbytes
            self._pages[name] = payload
            self._used += payload.nbytes
            while self._used > self._capacity:
                _, dropped = self._pages.popitem(last=False)
                self._used -= dropped.nbytes

    def get(self, name: str) -> NDArray[np.uint8] | None:
        """``name``'s verified bytes (read-only use), or None."""
        with self._lock:
            payload = self._pages.get(name)
            if payload is not None:
                self._pages.move_to_end(name)
            return payload

    def clear(self) -> None:
        """Forget every page."""
        with self._lock:
            self._pages.clear()
            self._used = 0

    @property
    def bytes_used(self) -> int:
        """Bytes of the pages kept."""
        with self._lock:
            return self._used
