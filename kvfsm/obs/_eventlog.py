"""A JSON Lines log of every state change of a core, written in batches, for replay.

The first line is a header naming the model and, per group, the lifecycle it follows, a digest
of that lifecycle's compiled table, the capacity of each tier and the block count (and the
blocks not free at epoch 0 when the log was attached). Then one line per batch that moved and
one per reported read, each with a sequence number. On the hot path a batch costs one tuple of
the arrays the core hands over, appended to a list; lines are formatted and written every
``flush_every`` batches and on :meth:`EventLog.flush`, :meth:`EventLog.close` or context exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TextIO

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm._jit import kernel
from kvfsm.fsm import CompiledTable
from kvfsm.spec import Event
from kvfsm.spec._vocabulary import POOLED_TIERS
from kvfsm.state import GroupState, StateCore

#: What the header's ``format`` says, and the version of the line layout below it.
FORMAT: Final = "kvfsm-eventlog"
VERSION: Final = 2
#: Versions :func:`~kvfsm.obs.replay` reads (1 never wrote runs).
READABLE_VERSIONS: Final = frozenset({1, 2})
#: Batches buffered before they are written, unless told otherwise.
FLUSH_EVERY: Final = 1024
#: The ``type`` of a line after the header.
MOVE: Final = "move"
READ: Final = "read"

_COMPACT: Final = (",", ":")


def table_digest(table: CompiledTable) -> str:
    """SHA-256 of what a replay relies on in a compiled table: the states (name, slots,
    residency, content, form, flags) and every row (source, event, destination, guards,
    effects), in order. Docs and spec-file layout do not enter it."""
    lifecycle = table.lifecycle
    canonical = {
        "initial": lifecycle.initial,
        "states": [[s.name, [t.spec_name for t in s.slots],
                    None if s.residency is None else s.residency.spec_name, s.content.value,
                    s.form.value, s.readable, s.hashed, s.in_flight]
                   for s in lifecycle.states],
        "rows": [[r.source, r.event.spec_name, r.dest, [str(c) for c in r.guards],
                  [str(c) for c in r.effects]] for r in lifecycle.rows],
    }
    text = json.dumps(canonical, sort_keys=True, separators=_COMPACT)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _group_header(state: GroupState) -> dict[str, Any]:
    table = state.table
    # Blocks not where every block starts (free at epoch 0): the replay starts from them.
    started = np.flatnonzero((state.states != table.initial) | (state.epoch != 0))
    names = table.lifecycle.state_names
    return {
        "lifecycle": table.name,
        "table": table_digest(table),
        "blocks": state.n_blocks,
        "slots": {tier.spec_name: pool.capacity for tier, pool in state.pools.items()
                  if tier in POOLED_TIERS},
        "copies": {tier.spec_name: count for tier, count in state.stored.items()},
        "start": {"ids": started.tolist(),
                  "states": [names[s] for s in state.states[started].tolist()],
                  "epochs": state.epoch[started].tolist()},
    }


def header(core: StateCore) -> dict[str, Any]:
    """The header line of a log of ``core`` as it is now."""
    return {"format": FORMAT, "version": VERSION, "model": core.model.name,
            "groups": {name: _group_header(state) for name, state in core.groups.items()}}


#: A buffered line: (type, group, event or None, ids, from, to, epochs); reads have no
#: event, from or to.
_Record = tuple[str, str, Event | None, NDArray[np.intp], NDArray[np.uint8] | None,
                NDArray[np.uint8] | None, NDArray[np.uint32]]


def _runs_example() -> tuple[object, ...]:
    return (np.zeros(1, dtype=np.int64), 1, np.empty(1, dtype=np.int64),
            np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64))


def _runs_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Short runs of consecutive or repeated values, with jumps between them."""
    size = int(rng.integers(0, 12))
    step = int(rng.integers(0, 2))
    values = np.cumsum(np.where(rng.random(size) < 0.7, step, rng.integers(-3, 4, size)))
    return (values.astype(np.int64), step, np.empty(size, dtype=np.int64),
            np.empty(size, dtype=np.int64), np.empty(1, dtype=np.int64))


def _runs_twin(values: NDArray[np.int64], step: int, firsts: NDArray[np.int64],
               counts: NDArray[np.int64], found: NDArray[np.int64]) -> None:
    """:func:`runs_kernel` as array operations."""
    if not values.size:
        found[0] = 0
        return
    starts = np.concatenate([np.zeros(1, dtype=np.int64),
                             np.flatnonzero(np.diff(values) != step) + 1])
    found[0] = starts.size
    firsts[: starts.size] = values[starts]
    counts[: starts.size] = np.diff(np.append(starts, values.size))


@kernel(example=_runs_example, twin=_runs_twin, inputs=_runs_inputs)
def runs_kernel(values: NDArray[np.int64], step: int, firsts: NDArray[np.int64],
                counts: NDArray[np.int64], found: NDArray[np.int64]) -> None:
    """``found[0]`` runs of ``values``, each continuing by ``step``: the first value of run
    ``r`` in ``firsts[r]``, its length in ``counts[r]`` (one pass)."""
    runs = 0
    for i in range(values.size):
        if runs > 0 and values[i] == values[i - 1] + step:
            counts[runs - 1] += 1
        else:
            firsts[runs] = values[i]
            counts[runs] = 1
            runs += 1
    found[0] = runs


def _run_arrays(values: NDArray[Any], step: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The first values and lengths of ``values``' runs continuing by ``step``."""
    wide = values.astype(np.int64, copy=False)  # ids are int64 already: no copy
    firsts, counts = np.empty(wide.size, np.int64), np.empty(wide.size, np.int64)
    found = np.empty(1, dtype=np.int64)
    runs_kernel(wide, step, firsts, counts, found)
    count = int(found[0])
    return firsts[:count], counts[:count]


def runs(values: NDArray[Any], step: int) -> NDArray[np.int64]:
    """``values`` as ``[first, count]`` rows: each run continues by ``step`` (1: consecutive
    ids, 0: a repeated value)."""
    firsts, counts = _run_arrays(values, step)
    return np.stack([firsts, counts], axis=1)


def _put_runs(line: dict[str, Any], key: str, values: NDArray[Any], *, step: int) -> None:
    """``line[key]`` as a list, or ``line[key + "_runs"]`` as ``[first, count]`` pairs when
    fewer numbers spell it."""
    if values.size > 2:
        firsts, counts = _run_arrays(values, step)
        if 2 * firsts.size < values.size:
            line[f"{key}_runs"] = [list(pair) for pair in zip(firsts.tolist(), counts.tolist(),
                                                              strict=True)]
            return
    line[key] = values.tolist()


class EventLog:
    """A core observer writing every moved batch and reported read to ``path`` as JSON Lines.

    The file is created (truncated) now; :meth:`attach` (``Engine(event_log=...)`` calls it)
    writes the header and starts observing. Records are buffered and written every
    ``flush_every`` batches. A write that fails while the core is moving blocks is kept and
    raised by the next :meth:`flush` or :meth:`close`, and the log stops recording (a move
    must never fail because its log could not be written).
    """

    def __init__(self, path: str | os.PathLike[str], *, flush_every: int = FLUSH_EVERY
                 ) -> None:
        if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
            raise KvfsmError(f"EventLog: flush_every must be an int >= 1, got {flush_every!r}")
        self.path = Path(path)
        self.flush_every = flush_every
        self._file: TextIO | None = self.path.open("w", encoding="utf-8")
        self._core: StateCore | None = None
        self._names: dict[str, NDArray[np.object_]] = {}
        self._buffer: list[_Record] = []
        self._lock = threading.Lock()
        self._error: OSError | None = None
        #: Lines after the header recorded so far (written or buffered).
        self.records = 0

    def __repr__(self) -> str:
        return f"EventLog({str(self.path)!r})"

    @property
    def closed(self) -> bool:
        return self._file is None

    def attach(self, core: StateCore) -> None:
        """Write the header for ``core`` and record its moves from now on (once per log)."""
        if self._file is None:
            raise KvfsmError(f"{self.path}: the event log is closed")
        if self._core is not None:
            raise KvfsmError(f"{self.path}: the event log is already attached to a core "
                             f"({self._core.model.name}); use one log per core")
        self._names = {name: np.array(state.table.lifecycle.state_names, dtype=object)
                       for name, state in core.groups.items()}
        # Buffered with the records: it reaches the file with the first flush.
        self._file.write(json.dumps(header(core), separators=_COMPACT) + "\n")
        core.add_observer(self)
        self._core = core

    # -- the observer (hot path: one tuple per batch) ---------------------------------------

    def moved(self, group: str, event: Event, ids: NDArray[np.intp],
              before: NDArray[np.uint8], after: NDArray[np.uint8],
              epochs: NDArray[np.uint32]) -> None:
        self._record((MOVE, group, event, ids, before, after, epochs))

    def read(self, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> None:
        self._record((READ, group, None, ids, None, None, epochs))

    def _record(self, record: _Record) -> None:
        with self._lock:
            if self._file is None or self._error is not None:
                return
            self._buffer.append(record)
            self.records += 1
            if len(self._buffer) >= self.flush_every:
                try:
                    self._write()
                except OSError as exc:  # raised from flush()/close(), never into a fire
                    self._error = exc

    # -- writing -----------------------------------------------------------------------------

    def _write(self) -> None:
        """Format and write the buffered records (the lock is held)."""
        if not self._buffer or self._file is None:
            return
        first = self.records - len(self._buffer)
        lines = []
        for seq, (kind, group, event, ids, before, after, epochs) in enumerate(
                self._buffer, first):
            line: dict[str, Any] = {"seq": seq, "type": kind, "group": group}
            if event is not None and before is not None and after is not None:
                names = self._names[group]
                line["event"] = event.spec_name
                line["ids"] = ids.tolist()
                line["from"] = names[before].tolist()
                line["to"] = names[after].tolist()
                line["epochs"] = epochs.tolist()
            else:
                # A read is usually a lease's blocks: long runs of consecutive ids at one
                # epoch, written as runs when that is shorter.
                _put_runs(line, "ids", ids, step=1)
                _put_runs(line, "epochs", epochs, step=0)
            lines.append(json.dumps(line, separators=_COMPACT))
        self._buffer.clear()
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()

    def flush(self) -> None:
        """Write every buffered record now; raises a write error kept from the hot path."""
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._write()

    def close(self) -> None:
        """Flush, stop observing and close the file (again: nothing)."""
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            if self._core is not None:
                self._core.remove_observer(self)
                self._core = None
            with self._lock:
                file, self._file = self._file, None
                self._buffer.clear()
            if file is not None:
                file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


__all__ = ["FLUSH_EVERY", "FORMAT", "MOVE", "READ", "READABLE_VERSIONS", "VERSION", "EventLog",
           "header", "runs", "table_digest"]
