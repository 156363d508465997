"""Restores in flight across every group of a core, and the caps that bound them.

The tables' ``admission_open`` guard asks a group's :meth:`GroupState.restore_budget`, which is
the least of the group's own cap on restores in flight and this core-wide room: operations
(blocks restoring) and bytes (their payloads). Every fire keeps the counts (a block entering a
restoring state adds itself, one leaving subtracts itself), so reading the room is O(1). The caps
are data the admission gate (``kvfsm.gates``) moves as it measures tier bandwidth and free
memory; the guard enforces whatever they are when a restore begins, so no plan, however stale,
can push the counts past them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvfsm._errors import KvfsmError


class RestoreBudget:
    """Core-wide restores in flight (blocks and payload bytes) and their caps (None: none)."""

    def __init__(self, max_ops: int | None = None, max_bytes: int | None = None) -> None:
        self.max_ops: int | None = None
        self.max_bytes: int | None = None
        self.ops = 0
        self.bytes = 0
        self.set_caps(max_ops, max_bytes)

    def set_caps(self, max_ops: int | None, max_bytes: int | None) -> None:
        """Set both caps (None lifts one). Restores already in flight stay; new ones begin
        only while there is room under the new caps."""
        for name, value in (("max_ops", max_ops), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise KvfsmError(f"restore budget: {name} must be a non-negative int or None, "
                                 f"got {value!r}")
        self.max_ops, self.max_bytes = max_ops, max_bytes

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Both caps lifted inside, put back on exit whatever happens: for a lookup asking
        what its plan would be without them (a lookup fires nothing). The caller must hold
        the core's lock (the engine's), so no restore begins meanwhile."""
        caps = self.max_ops, self.max_bytes
        self.max_ops = self.max_bytes = None
        try:
            yield
        finally:
            self.max_ops, self.max_bytes = caps

    @property
    def capped(self) -> bool:
        return self.max_ops is not None or self.max_bytes is not None

    def room(self, payload_bytes: int) -> int | None:
        """How many more blocks of ``payload_bytes`` may begin restoring (None: no cap)."""
        if self.max_ops is None and self.max_bytes is None:
            return None  # every lookup asks: the common case answers first
        ops, nbytes = self.ops_room(), self.bytes_room()
        by_bytes = None if nbytes is None else nbytes // max(payload_bytes, 1)
        if ops is None or by_bytes is None:
            return by_bytes if ops is None else ops
        return min(ops, by_bytes)

    def ops_room(self) -> int | None:
        return None if self.max_ops is None else max(self.max_ops - self.ops, 0)

    def bytes_room(self) -> int | None:
        return None if self.max_bytes is None else max(self.max_bytes - self.bytes, 0)

    def moved(self, blocks: int, payload_bytes: int) -> None:
        """``blocks`` (negative: fewer) of ``payload_bytes`` each entered restoring states."""
        self.ops += blocks
        self.bytes += blocks * payload_bytes

    def __repr__(self) -> str:
        return (f"RestoreBudget(ops={self.ops}/{self.max_ops}, "
                f"bytes={self.bytes}/{self.max_bytes})")
