"""A JSON Lines log of every state change of a core, written in batches, for replay.

The first line is a header naming the model and, per group, the lifecycle it follows, a digest
of that lifecycle's compiled table, the capacity of each tier and the block count (and the
blocks not free at epoch 0 when the log was attached). Then one line per batch that moved, one
per reported read of a group's arrays, and one per lease's reads told as runs (a run of
consecutive ids at one epoch per group), each with a sequence number. A lease taken in one pass
writes a take line (its read joins it where nothing was logged between them, and so does its
give-back after that) and a give_back line naming it, a few bytes where its runs would repeat.
On the hot path a batch costs one tuple of the arrays the core hands over, appended to a list;
lines are formatted and written every ``flush_every`` records and on :meth:`EventLog.flush`,
:meth:`EventLog.close` or context exit. A lease's runs are buffered as numbers (a lease whose
every group read one run, as its take's small answer array, a row per group), and a read of
arrays that are one run is formatted as it is recorded, so the buffer never keeps a lease's id
or epoch arrays alive.

Every write ends with a chain line (``{"type":"chain","lines":n,"digest":...}``): the xxh3-128
of the previous chain digest (the header line's own hash for the first) followed by the bytes
of the ``n`` lines written since, so a replay refuses a log with a line dropped, added, changed
or renumbered, or cut after its last chain line.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TextIO

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm._jit import kernel
from kvfsm.fsm import CompiledTable
from kvfsm.lookup._buffers import FIRST_EPOCH, FIRST_ID, HI, LO
from kvfsm.obs._read_lines import (
    GIVE_BACK,
    GIVE_BACK_LINE,
    LEASE,
    LEASE_LINE,
    PINS,
    PINS_LINE,
    READ,
    READS,
    READS_LINE,
    TAKE,
    TAKE_LINE,
    TAKE_READ,
    TAKE_READ_LINE,
    name_table,
    reads_line,
    reads_lines,
    run_read_line,
)
from kvfsm.spec import Event
from kvfsm.spec._vocabulary import POOLED_TIERS
from kvfsm.state import GroupState, StateCore

#: What the header's ``format`` says, and the version of the line layout below it.
FORMAT: Final = "kvfsm-eventlog"
VERSION: Final = 5
#: Versions :func:`~kvfsm.obs.replay` reads (1 never wrote runs; 2 wrote a lease's runs as a
#: read line per group, never as one reads line; before 4 no chain lines; before 5 no pin,
#: pins, take, take_read, lease, give_back, check_failed, write or refs lines, and no pins in the
#: header's ``start``).
READABLE_VERSIONS: Final = frozenset({1, 2, 3, 4, 5})
#: The first version whose lines are chained.
CHAINED_VERSION: Final = 4
#: The ``type`` of a chain line.
CHAIN: Final = "chain"
#: Batches buffered before they are written, unless told otherwise.
FLUSH_EVERY: Final = 1024
#: The ``type`` of a line after the header.
MOVE: Final = "move"
#: Pins of one group's ids (``delta`` each), and a lease's pins as runs over its groups.
PIN: Final = "pin"
#: Blocks a lookup saw fail their checksum, at their epochs.
CHECK_FAILED: Final = "check_failed"
#: Content written into blocks (the sub-blocks of a mask), and index references set.
WRITE: Final = "write"
REFS: Final = "refs"

_COMPACT: Final = (",", ":")


def chain_digest(previous: bytes, segment: bytes) -> bytes:
    """The chain digest after ``segment`` (the bytes of the lines since the last chain line)
    following ``previous`` (the last chain digest, or :func:`chain_start` of the header)."""
    return xxhash.xxh3_128_digest(previous + segment)


def chain_start(header_line: bytes) -> bytes:
    """The chain's first ``previous``: the hash of the header line (newline included)."""
    return xxhash.xxh3_128_digest(header_line)


def chain_line(lines: int, digest: bytes) -> str:
    return f'{{"type":"{CHAIN}","lines":{lines},"digest":"{digest.hex()}"}}\n'


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
    # Pins held when the log was attached (a pinned block is readable, so started): a replay
    # counts the pin lines from them.
    pins = state.pin_counts(started.astype(np.intp))
    return {
        "lifecycle": table.name,
        "table": table_digest(table),
        "blocks": state.n_blocks,
        "slots": {tier.spec_name: pool.capacity for tier, pool in state.pools.items()
                  if tier in POOLED_TIERS},
        "copies": {tier.spec_name: count for tier, count in state.stored.items()},
        "start": {"ids": started.tolist(),
                  "states": [names[s] for s in state.states[started].tolist()],
                  "epochs": state.epoch[started].tolist(), "pins": pins.tolist()},
    }


def header(core: StateCore) -> dict[str, Any]:
    """The header line of a log of ``core`` as it is now."""
    return {"format": FORMAT, "version": VERSION, "model": core.model.name,
            "groups": {name: _group_header(state) for name, state in core.groups.items()}}


#: A buffered line: (type, group, event or None, ids, from, to, epochs); reads have no
#: event, from or to.
_Record = tuple[str, str, Event | None, NDArray[np.intp], NDArray[np.uint8] | None,
                NDArray[np.uint8] | None, NDArray[np.uint32]]
#: A buffered lease's reads, one line: per group, ``count`` consecutive ids from ``first``
#: at one epoch, ``(group, first, count, epoch)`` (a list, told that way by ``read_runs``).
_Runs = list[tuple[str, int, int, int]]
#: A buffered line of a lease taken in one pass, one run at one epoch per group holding
#: blocks: ``(names, answers, count, kind, delta)``, the groups' names, the take's answer
#: rows (:meth:`~kvfsm.state.StateCore.record_lease_runs`), how many of them hold blocks,
#: the line's kind (READS_LINE, TAKE_LINE, TAKE_READ_LINE, LEASE_LINE, or PINS_LINE of
#: ``delta`` pins each). A give-back of a take line: ``((), None, take line's seq,
#: GIVE_BACK_LINE, 0)``.
_Leased = tuple[tuple[str, ...], NDArray[np.int64] | None, int, int, int]
_LEASED_FIELDS: Final = 5
#: Numbers in a row handed to the compiled formatter: group, first id, count, last number
#: (a give-back's one row: its take's number where a run's first id is).
_ROW_COLUMNS: Final = 4
_ROW_FIRST_ID: Final = 1
#: A buffered lease's pins, one line: ``(PINS, runs)``, each run ``(group, first, count,
#: delta)`` (formatted with the batch: a lease's take and give-back only append it).
_PinRuns = tuple[str, Sequence[tuple[str, int, int, int]]]
_PIN_FIELDS: Final = 2
#: Takes whose give-back may still name them, kept at most (a lease given back in part, after
#: a block moved under it, never names its take): past this many the log forgets them all,
#: and their give-backs list their runs (as a give-back of a take it never saw does).
OPEN_TAKES_KEPT: Final = 1 << 16


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
    ``r`` in ``firsts[r]``, its length in ``counts[r]``. A lease's read is usually one run:
    a branch-free pass (which vectorizes) says so first; else one pass writes each run as it
    ends."""
    size = values.size
    if size == 0:
        found[0] = 0
        return
    start = values[0]
    off = 0
    for i in range(size):
        off |= values[i] - (start + i * step)
    if off == 0:
        firsts[0], counts[0], found[0] = start, size, 1
        return
    runs = 0
    begin = 0
    for i in range(1, size):
        if values[i] != values[i - 1] + step:
            firsts[runs] = values[begin]
            counts[runs] = i - begin
            runs += 1
            begin = i
    firsts[runs] = values[begin]
    counts[runs] = size - begin
    found[0] = runs + 1


def _one_run_example() -> tuple[object, ...]:
    return (np.zeros(1, dtype=np.intp), np.zeros(1, dtype=np.uint32), np.empty(2, np.int64))


def _one_run_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """Reads of a few blocks: mostly consecutive ids at one epoch, now and then a gap, a
    repeat or a second epoch."""
    size = int(rng.integers(0, 10))
    ids = int(rng.integers(0, 50)) + np.arange(size)
    epochs = np.full(size, int(rng.integers(0, 4)), dtype=np.uint32)
    if size and rng.random() < 0.4:
        ids[int(rng.integers(0, size))] += int(rng.integers(-2, 3))
    if size and rng.random() < 0.4:
        epochs[int(rng.integers(0, size))] += np.uint32(1)
    return ids.astype(np.intp), epochs, np.empty(2, np.int64)


def _one_run_twin(ids: NDArray[np.intp], epochs: NDArray[np.uint32],
                  out: NDArray[np.int64]) -> None:
    out[0] = bool((ids == ids[0] + np.arange(ids.size)).all()) if ids.size else True
    out[1] = bool((epochs == epochs[0]).all()) if epochs.size else True


@kernel(example=_one_run_example, twin=_one_run_twin, inputs=_one_run_inputs)
def one_run_kernel(ids: NDArray[np.intp], epochs: NDArray[np.uint32],
                   out: NDArray[np.int64]) -> None:
    """``out[0]``: ``ids`` are consecutive; ``out[1]``: ``epochs`` are all one value (a
    lease's usual read, written as one run of each). Branch-free passes, which vectorize."""
    off = 0
    for i in range(ids.size):
        off |= ids[i] - (ids[0] + i)
    differ = 0
    for i in range(epochs.size):
        differ |= epochs[i] ^ epochs[0]
    out[0], out[1] = off == 0, differ == 0


def _one_run_line(seq: int, group_json: str, ids: NDArray[np.intp],
                  epochs: NDArray[np.uint32], answer: NDArray[np.int64]) -> str | None:
    """The line of a read of consecutive ids at one epoch (a lease's usual read), written
    as one run of each without building either list; None for any other read."""
    if ids.size > 2 and ids.size == epochs.size:
        one_run_kernel(ids, epochs, answer)
        if answer[0] and answer[1]:
            return run_read_line(seq, group_json, int(ids[0]), ids.size, int(epochs[0]))
    return None


def _pins_line(seq: int, group_json: dict[str, str],
               runs: Sequence[tuple[str, int, int, int]]) -> str:
    """The line of a lease's pins: ``[group, first id, count, delta]`` per run."""
    body = ",".join(f"[{group_json[group]},{first},{count},{delta}]"
                    for group, first, count, delta in runs)
    return f'{{"seq":{seq},"type":"{PINS}","runs":[{body}]}}'


def _read_line(seq: int, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> str:
    """The line of any read: ids and epochs each as a list, or as ``[first, count]`` runs
    when fewer numbers spell it."""
    line: dict[str, Any] = {"seq": seq, "type": READ, "group": group}
    _put_runs(line, "ids", ids, step=1)
    _put_runs(line, "epochs", epochs, step=0)
    return json.dumps(line, separators=_COMPACT)


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
        #: Each group's name as JSON (a read line is formatted around it).
        self._group_json: dict[str, str] = {}
        #: Records not written yet, a line each: a tuple of arrays, a lease's runs or answer
        #: rows, or a line already formatted.
        self._buffer: list[_Record | _Runs | _Leased | _PinRuns | str] = []
        #: The takes written as take lines and not given back yet, by their answer rows'
        #: ``id``: ``(answers, seq)`` (the array kept, so its ``id`` names no other).
        self._takes: dict[int, tuple[NDArray[np.int64], int]] = {}
        #: The take whose record is the buffer's last (its answer rows, sequence number and
        #: kind, TAKE_LINE or TAKE_READ_LINE), put in ``_takes`` only once another record
        #: follows it or it is written: the usual lease is read and given back before then,
        #: and joins its line at no cost of the dict.
        self._last_take: NDArray[np.int64] | None = None
        self._last_take_seq = 0
        self._last_kind = TAKE_LINE
        #: Each group's place in the core's order, and the names as JSON packed for the
        #: compiled formatter (:func:`~kvfsm.obs._read_lines.reads_lines`).
        self._group_code: dict[str, int] = {}
        self._name_bytes, self._name_starts = name_table([])
        #: The group places of each order of names a lease's answer rows came in.
        self._codes_of: dict[tuple[str, ...], NDArray[np.int64]] = {}
        #: The answer array of the run check (used under the lock).
        self._answer = np.empty(2, dtype=np.int64)
        self._lock = threading.Lock()
        self._error: OSError | None = None
        #: The last chain digest written (the header line's hash before any).
        self._chain = b""
        #: Lines after the header recorded so far (written or buffered).
        self.records = 0
        #: Seconds spent formatting and writing batches (on whichever call filled the
        #: buffer, or flush/close): what the log costs beyond the buffering each record does.
        self.write_seconds = 0.0

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
        self._group_json = {name: json.dumps(name) for name in core.groups}
        self._group_code = {name: code for code, name in enumerate(core.groups)}
        self._name_bytes, self._name_starts = name_table(list(self._group_json.values()))
        # Buffered with the records: it reaches the file with the first flush.
        first = json.dumps(header(core), separators=_COMPACT) + "\n"
        self._file.write(first)
        self._chain = chain_start(first.encode("utf-8"))
        core.add_observer(self)
        self._core = core

    # -- the observer (hot path: one tuple per batch) ---------------------------------------

    def moved(self, group: str, event: Event, ids: NDArray[np.intp],
              before: NDArray[np.uint8], after: NDArray[np.uint8],
              epochs: NDArray[np.uint32]) -> None:
        with self._lock:
            if self._file is not None and self._error is None:
                self._append((MOVE, group, event, ids, before, after, epochs))

    def read(self, group: str, ids: NDArray[np.intp], epochs: NDArray[np.uint32]) -> None:
        with self._lock:
            if self._file is None or self._error is not None:
                return
            # A read of one run at one epoch (a lease validated) is formatted now, while its
            # arrays are in cache, and buffered as its line: the buffer then keeps no lease's
            # arrays alive until the next write. Any other read keeps its arrays until then.
            line = _one_run_line(self.records, self._group_json[group], ids, epochs,
                                 self._answer)
            self._append(line if line is not None else
                         (READ, group, None, ids, None, None, epochs))

    def read_runs(self, runs: Sequence[tuple[str, int, int, int]]) -> None:
        """A lease's reads, each of ``count`` consecutive ids from ``first``, all at
        ``epoch``, given as ``(group, first, count, epoch)`` (what a validated lease that
        found them so reports): buffered as numbers (nothing kept alive), one reads line
        formatted with the batch; nothing for no run."""
        with self._lock:
            if self._file is None or self._error is not None or not runs:
                return
            self._append(list(runs))

    def read_answer_runs(self, names: tuple[str, ...], answers: NDArray[np.int64],
                         count: int) -> None:
        """A lease's read of one run at one epoch in each of ``count`` groups, as the answer
        rows of its take (:meth:`~kvfsm.state.StateCore.record_lease_runs`): buffered as they
        are (a small array the lease never changes), one reads line formatted with the
        batch; nothing where no group holds blocks."""
        with self._lock:
            if self._file is None or self._error is not None or not count:
                return
            buffer = self._buffer
            if self._last_take is not None:
                if self._last_take is answers and self._last_kind == TAKE_LINE:
                    # The read of this lease's take, with nothing logged since: the take's
                    # line says both (it names the epochs read), one line fewer.
                    buffer[-1] = (names, answers, count, TAKE_READ_LINE, 0)
                    self._last_kind = TAKE_READ_LINE
                    return
                self._settle_take()
            buffer.append((names, answers, count, READS_LINE, 0))
            self.records += 1
            if len(buffer) >= self.flush_every:  # _write_if_full, a frame fewer per lease
                self._write_if_full()

    def pinned(self, group: str, ids: NDArray[np.intp], delta: int) -> None:
        """Each of ``ids`` gained ``delta`` pins: one pin line, formatted now (ids as runs
        where fewer numbers spell them)."""
        with self._lock:
            if self._file is None or self._error is not None:
                return
            line: dict[str, Any] = {"seq": self.records, "type": PIN, "group": group,
                                    "delta": delta}
            _put_runs(line, "ids", ids, step=1)
            self._append(json.dumps(line, separators=_COMPACT))

    def pinned_runs(self, runs: Sequence[tuple[str, int, int, int]]) -> None:
        """A lease's pins, ``(group, first, count, delta)`` runs of consecutive ids: buffered
        as they are (numbers only), one pins line formatted with the batch."""
        with self._lock:
            if self._file is None or self._error is not None or not runs:
                return
            self._append((PINS, runs))

    def pinned_answer_runs(self, names: tuple[str, ...], answers: NDArray[np.int64],
                           count: int, delta: int) -> None:
        """A lease's pins taken (``delta`` 1) or given back (-1), one run per group holding
        blocks, as the answer rows of its take (as :meth:`read_answer_runs`; a give-back
        this way returns every pin the take took): buffered as they are, formatted with the
        batch in the same compiled pass. A take is a take line (its read, if logged next,
        joins it: take_read); its give-back a give_back line naming it (or, if its take_read
        is the last line, makes that a lease line), or a pins line where this log wrote no
        take line of it (attached since, or forgotten: :data:`OPEN_TAKES_KEPT`)."""
        with self._lock:
            if self._file is None or self._error is not None or not count:
                return
            buffer = self._buffer
            record: _Leased
            if self._last_take is answers and delta == -1:
                # Its take is the last line, nothing logged since.
                self._last_take = None
                if self._last_kind == TAKE_READ_LINE:  # one lease line says all three
                    buffer[-1] = (names, answers, count, LEASE_LINE, 0)
                    return
                record = ((), None, self._last_take_seq, GIVE_BACK_LINE, 0)
            else:
                if self._last_take is not None:
                    self._settle_take()
                if delta == 1:
                    self._last_take, self._last_take_seq = answers, self.records
                    self._last_kind = TAKE_LINE
                    record = (names, answers, count, TAKE_LINE, 0)
                else:
                    taken = self._takes.pop(id(answers), None) if delta == -1 else None
                    record = (names, answers, count, PINS_LINE, delta) if taken is None else \
                        ((), None, taken[1], GIVE_BACK_LINE, 0)
            buffer.append(record)
            self.records += 1
            if len(buffer) >= self.flush_every:
                self._write_if_full()

    def checks_failed(self, group: str, ids: NDArray[np.intp],
                      epochs: NDArray[np.uint32]) -> None:
        """A lookup saw ``ids`` fail their checksum at ``epochs``: one check_failed line."""
        self._line({"type": CHECK_FAILED, "group": group, "ids": ids.tolist(),
                    "epochs": epochs.tolist()})

    def written(self, group: str, ids: NDArray[np.intp], sub_mask: int) -> None:
        """Content was written into sub-blocks ``sub_mask`` of ``ids``: one write line."""
        self._line({"type": WRITE, "group": group, "ids": ids.tolist(), "sub_blocks": sub_mask})

    def indexed(self, group: str, ids: NDArray[np.intp], targets: NDArray[np.int32],
                epochs: NDArray[np.uint32]) -> None:
        """Index blocks ``ids`` point at ``targets`` at ``epochs`` now: one refs line."""
        self._line({"type": REFS, "group": group, "ids": ids.tolist(),
                    "targets": targets.tolist(), "epochs": epochs.tolist()})

    def _line(self, fields: dict[str, Any]) -> None:
        """Buffer a line of ``fields`` formatted now, numbered next."""
        with self._lock:
            if self._file is None or self._error is not None:
                return
            self._append(json.dumps({"seq": self.records, **fields}, separators=_COMPACT))

    def _settle_take(self) -> None:
        """Keep the last take where its give-back finds it (the lock is held; a record is
        about to follow it, or the buffer to be written)."""
        takes = self._takes
        if len(takes) >= OPEN_TAKES_KEPT:
            takes.clear()
        answers = self._last_take
        assert answers is not None
        takes[id(answers)] = (answers, self._last_take_seq)
        self._last_take = None

    def _append(self, record: _Record | _Runs | _PinRuns | str) -> None:
        """Buffer one record (the lock is held), writing the buffer once it is full."""
        if self._last_take is not None:
            self._settle_take()
        self._buffer.append(record)
        self.records += 1
        self._write_if_full()

    def _write_if_full(self) -> None:
        """Write the buffer once it holds ``flush_every`` records (the lock is held)."""
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
        if self._last_take is not None:  # the buffer is about to be written
            self._settle_take()
        started = time.perf_counter()
        try:
            self._write_buffer()
        finally:
            self.write_seconds += time.perf_counter() - started

    def _write_buffer(self) -> None:
        """:meth:`_write` of a buffer holding records, to an open file."""
        assert self._file is not None
        seq = self.records - len(self._buffer)
        lines: list[str] = []
        group_json = self._group_json
        # Leases' answer rows in a row (their pins and reads), formatted together in one
        # compiled pass.
        leased: list[Any] = []
        for record in self._buffer:
            if isinstance(record, tuple) and len(record) == _LEASED_FIELDS:
                leased.append(record)
                continue
            if leased:
                seq = self._leased_lines(leased, seq, lines)
                leased.clear()
            if isinstance(record, str):
                lines.append(record)  # formatted when recorded
                seq += 1
                continue
            if isinstance(record, tuple) and len(record) == _PIN_FIELDS:
                lines.append(_pins_line(seq, group_json, record[1]))
                seq += 1
                continue
            if isinstance(record, list):  # a lease's runs, one per group
                lines.append(reads_line(seq, [(group_json[group], first, count, epoch)
                                              for group, first, count, epoch in record]))
                seq += 1
                continue
            kind, group, event, ids, before, after, epochs = record
            if event is not None and before is not None and after is not None:
                names = self._names[group]
                lines.append(json.dumps(
                    {"seq": seq, "type": kind, "group": group, "event": event.spec_name,
                     "ids": ids.tolist(), "from": names[before].tolist(),
                     "to": names[after].tolist(), "epochs": epochs.tolist()},
                    separators=_COMPACT))
            else:
                # A read is usually a lease's blocks: long runs of consecutive ids at one
                # epoch, written as runs when that is shorter.
                # (not one run at one epoch: :meth:`read` formatted those at once)
                lines.append(_read_line(seq, group, ids, epochs))
            seq += 1
        if leased:
            self._leased_lines(leased, seq, lines)
        self._buffer.clear()
        text = "\n".join(lines) + "\n"
        self._chain = chain_digest(self._chain, text.encode("utf-8"))
        self._file.write(text + chain_line(text.count("\n"), self._chain))
        self._file.flush()

    def _leased_lines(self, leased: Sequence[_Leased], seq: int, lines: list[str]) -> int:
        """Append the lines of leases taken in one pass (:data:`_Leased`: reads, takes,
        pins, give-backs; a line per record, a run per group holding blocks, numbered from
        ``seq``) as one piece; the next number."""
        codes_of = self._codes_of
        codes = []
        answers_of = []
        # Per record: its kind, rows (a give-back: one, its take's number) and a run's last
        # number where that is not an epoch (a pins line's delta); one pass over the records,
        # the rest array operations.
        kinds_of = []
        row_counts = []
        deltas = []
        taken_seqs = []
        for names, answers, count, kind, delta in leased:
            kinds_of.append(kind)
            if answers is None:  # a give-back: its one row is the take's number
                row_counts.append(1)
                taken_seqs.append(count)
                continue
            known = codes_of.get(names)
            if known is None:
                known = codes_of[names] = np.array([self._group_code[name] for name in names],
                                                   dtype=np.int64)
            codes.append(known)
            answers_of.append(answers)
            row_counts.append(count)
            deltas.append(delta)
        kinds = np.array(kinds_of, dtype=np.int64)
        ends = np.cumsum(row_counts, dtype=np.int64)
        run_rows = np.zeros((0, _ROW_COLUMNS), dtype=np.int64)
        if answers_of:
            answers = np.concatenate(answers_of)
            counts = answers[:, HI] - answers[:, LO]
            holding = counts > 0
            # A run's last number: an epoch, or a pins line's delta.
            last = answers[:, FIRST_EPOCH]
            runs_kinds = kinds[kinds != GIVE_BACK_LINE]
            if (runs_kinds == PINS_LINE).any():
                rows_per = [known.size for known in codes]
                last = np.where(np.repeat(runs_kinds == PINS_LINE, rows_per),
                                np.repeat(np.array(deltas, dtype=np.int64), rows_per), last)
            run_rows = np.stack((np.concatenate(codes)[holding], answers[holding, FIRST_ID],
                                 counts[holding], last[holding]), axis=1)
        rows = run_rows
        if taken_seqs:  # each give-back's one row among the others: its take's number
            rows = np.zeros((int(ends[-1]), _ROW_COLUMNS), dtype=np.int64)
            given = np.zeros(rows.shape[0], dtype=bool)
            given[ends[kinds == GIVE_BACK_LINE] - 1] = True
            rows[given, _ROW_FIRST_ID] = taken_seqs
            rows[~given] = run_rows
        # Each run record holds blocks in ``count`` groups (none is buffered without).
        assert int(ends[-1]) == rows.shape[0], "a lease's count is its groups holding blocks"
        lines.append(reads_lines(rows, ends, seq, self._name_bytes, self._name_starts, kinds))
        return seq + len(leased)

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
                self._takes.clear()
                self._last_take = None
            if file is not None:
                file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


__all__ = ["CHECK_FAILED", "FLUSH_EVERY", "FORMAT", "GIVE_BACK", "LEASE", "MOVE",
           "OPEN_TAKES_KEPT", "PIN", "PINS", "READ", "READABLE_VERSIONS", "READS", "REFS", "TAKE",
           "TAKE_READ", "VERSION", "WRITE",
           "EventLog", "header", "runs", "table_digest"]
