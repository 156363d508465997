"""Whether a stored tier's store works, as its calls find it: one state per tier, shared by the
threads calling it, logged only when it changes."""

from __future__ import annotations

import logging
import threading
from typing import Final

#: The logger every tier reports its store's health on.
logger: Final = logging.getLogger("kvfsm.tiers")


class Health:
    """Available until a call finds the store failing (:meth:`failed`), then until a call works
    (:meth:`ok`). Each change logs one line naming ``what`` (the tier and its address): a
    warning when the store starts failing, an info line when it works again; calls in between
    log nothing, so a dead store costs one line, not one per call."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._available = True
        self._error: str | None = None

    @property
    def available(self) -> bool:
        return self._available

    @property
    def last_error(self) -> str | None:
        return self._error

    def ok(self) -> None:
        """A call worked."""
        if self._available:  # the common case, without the lock (a bool read is atomic)
            return
        with self._lock:
            changed, self._available, self._error = not self._available, True, None
        if changed:
            logger.info("%s works again", self.what)

    def failed(self, error: str) -> None:
        """A call found the store failing; ``error`` says how."""
        with self._lock:
            changed, self._available, self._error = self._available, False, error
        if changed:
            logger.warning("%s is failing: %s", self.what, error)
