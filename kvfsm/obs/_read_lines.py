"""The event log's lines for the reads of validated leases: each lease's runs of consecutive ids
at one epoch on one line, formatted many leases at a time in one compiled pass.

A serving loop validates a lease before every kernel read, and each lease reports one such run
per group it holds. Formatted one f-string at a time, those lines cost about a microsecond
each, as much as the rest of a validate; written as bytes by a compiled loop over all the
leases a batch buffered, a fraction of that. A lease's runs share one line (``"type":
"reads"``) rather than a read line per group: a third of the bytes for a model of three
groups, and the bytes are most of what a write costs. The text is the same either way:
:func:`reads_line` is the format, and the pass's twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel

#: The ``type`` of a line of one group's read (ids and epochs as lists or runs).
READ: Final = "read"
#: The ``type`` of a line of a lease's reads: ``[group, first id, count, epoch]`` per group.
READS: Final = "reads"
#: The ``type`` of a line of a lease's pins: ``[group, first id, count, delta]`` per group.
PINS: Final = "pins"
#: The ``type`` of a lease's take: one pin on each block of ``[group, first id, count,
#: epoch]`` per group (the blocks are at that epoch); with the read of those blocks at once
#: (nothing logged between the take and its read); and the give-back of every pin a take
#: line took (``"take"``: that line's sequence number).
TAKE: Final = "take"
TAKE_READ: Final = "take_read"
GIVE_BACK: Final = "give_back"
#: The ``type`` of a whole lease, nothing logged while it was held: a take_read line and the
#: give-back of its pins at once.
LEASE: Final = "lease"
#: A run this long or longer is written as ``[first, count]`` runs on a read line; shorter
#: ones as lists (fewer characters either way).
_RUNS_FROM: Final = 3

def _run_pieces(kind: str) -> tuple[str, str, str, str]:
    """The constant pieces of a line of runs of type ``kind``, in the order the pass writes
    them: before the sequence number, before the first run, between runs, at the end."""
    return ('{"seq":', f',"type":"{kind}","runs":[[', '],[', ']]}')


#: The pieces of each kind of line the pass writes; a line's kind is the index of its first
#: piece (READS_LINE, PINS_LINE, TAKE_LINE, TAKE_READ_LINE, LEASE_LINE, GIVE_BACK_LINE).
_PIECES: Final = _run_pieces(READS)
_KINDS: Final = (_PIECES, _run_pieces(PINS), _run_pieces(TAKE), _run_pieces(TAKE_READ),
                 _run_pieces(LEASE),
                 # One number, the take's sequence number, where the others have runs (its
                 # third piece is never written).
                 ('{"seq":', f',"type":"{GIVE_BACK}","{TAKE}":', "", "}"))
READS_LINE: Final = 0
PINS_LINE: Final = len(_PIECES)
TAKE_LINE: Final = 2 * len(_PIECES)
TAKE_READ_LINE: Final = 3 * len(_PIECES)
LEASE_LINE: Final = 4 * len(_PIECES)
GIVE_BACK_LINE: Final = 5 * len(_PIECES)
_ALL_PIECES: Final = tuple(piece for pieces in _KINDS for piece in pieces)
_PIECE_BYTES: Final = np.frombuffer("".join(_ALL_PIECES).encode("ascii"),
                                    dtype=np.uint8).copy()
_PIECE_STARTS: Final = np.cumsum([0, *(len(piece) for piece in _ALL_PIECES)]).astype(np.int64)
#: Characters of the constant pieces of the longest kind of line.
_LINE_PIECE_CHARS: Final = max(len("".join(pieces)) for pieces in _KINDS)
#: Characters of the longest int64 (its sign included).
_INT_CHARS: Final = 20
_NEWLINE: Final = ord("\n")
_COMMA: Final = ord(",")
_MINUS: Final = ord("-")
_ZERO: Final = ord("0")
#: Numbers in a run of a reads line: first id, count, epoch.
_NUMBERS_PER_RUN: Final = 3

#: A run of a lease's read: ``(group as JSON, first id, count, epoch)``.
JsonRun = tuple[str, int, int, int]


def run_read_line(seq: int, group_json: str, first: int, count: int, epoch: int) -> str:
    """The read line of ``count`` consecutive ids from ``first``, all at ``epoch``, as the
    general formatter writes it (runs where they are shorter) without building it."""
    if count >= _RUNS_FROM:
        return (f'{{"seq":{seq},"type":"{READ}","group":{group_json},'
                f'"ids_runs":[[{first},{count}]],"epochs_runs":[[{epoch},{count}]]}}')
    ids = ",".join(str(first + i) for i in range(count))
    epochs = ",".join([str(epoch)] * count)
    return (f'{{"seq":{seq},"type":"{READ}","group":{group_json},"ids":[{ids}],'
            f'"epochs":[{epochs}]}}')


def reads_line(seq: int, runs: Sequence[JsonRun], kind: str = READS) -> str:
    """The line of a lease's reads (at least one run): per group, ``count`` consecutive ids
    from ``first``, all at ``epoch``; or of another ``kind`` of runs (pins, take,
    take_read, lease), the last number of each run as that kind says."""
    spelled = "],[".join(f"{group_json},{first},{count},{epoch}"
                         for group_json, first, count, epoch in runs)
    return f'{{"seq":{seq},"type":"{kind}","runs":[[{spelled}]]}}'


def give_back_line(seq: int, take: int) -> str:
    """The line of a give-back of every pin the take line numbered ``take`` took."""
    return f'{{"seq":{seq},"type":"{GIVE_BACK}","{TAKE}":{take}}}'


def _put_int(out: NDArray[np.uint8], at: int, value: int) -> int:
    """Write ``value`` in decimal at ``out[at:]``; the position after it."""
    if value < 0:
        out[at] = _MINUS
        at += 1
        value = -value
    start = at
    while True:
        out[at] = _ZERO + value % 10
        at += 1
        value //= 10
        if value == 0:
            break
    low, high = start, at - 1
    while low < high:  # the digits went in lowest first
        out[low], out[high] = out[high], out[low]
        low += 1
        high -= 1
    return at


def _put_piece(out: NDArray[np.uint8], at: int, source: NDArray[np.uint8],
               starts: NDArray[np.int64], which: int) -> int:
    """Copy piece ``which`` of ``source`` (``source[starts[which]:starts[which + 1]]``) to
    ``out[at:]``; the position after it."""
    for k in range(starts[which], starts[which + 1]):
        out[at] = source[k]
        at += 1
    return at


def _lines_example() -> tuple[object, ...]:
    return (np.zeros((1, 4), dtype=np.int64), np.ones(1, dtype=np.int64),
            np.zeros(1, dtype=np.int64), 0, _PIECE_BYTES[:2],
            np.array([0, 2], np.int64), _PIECE_BYTES, _PIECE_STARTS,
            np.zeros(256, dtype=np.uint8), np.zeros(1, dtype=np.int64))


def _lines_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A few groups' JSON names and leases' reads or pins lines of one to three runs each, at
    small and huge ids, counts, epochs, deltas and sequence numbers."""
    names = [f'"g{i}{"x" * int(rng.integers(0, 4))}"' for i in range(int(rng.integers(1, 4)))]
    lines = int(rng.integers(0, 5))
    ends = np.cumsum(rng.integers(1, 4, lines)).astype(np.int64)
    size = int(ends[-1]) if lines else 0
    top = int(rng.choice([10, 1 << 31, 1 << 62]))
    rows = np.stack([rng.integers(0, len(names), size), rng.integers(0, top, size),
                     rng.integers(1, top, size), rng.integers(0, top, size)], axis=1)
    name_bytes, name_starts = name_table(names)
    kinds = rng.choice([READS_LINE, PINS_LINE, TAKE_LINE, TAKE_READ_LINE, LEASE_LINE,
                        GIVE_BACK_LINE], lines).astype(np.int64)
    return (rows.astype(np.int64).reshape(-1, 4), ends, kinds, int(rng.integers(0, top)),
            name_bytes,
            name_starts, _PIECE_BYTES, _PIECE_STARTS,
            np.zeros(line_bound(lines, size, name_starts), dtype=np.uint8),
            np.zeros(1, dtype=np.int64))


def _reads_lines_twin(rows: NDArray[np.int64], ends: NDArray[np.int64],
                      kinds: NDArray[np.int64], seq: int,
                      name_bytes: NDArray[np.uint8], name_starts: NDArray[np.int64],
                      pieces: NDArray[np.uint8], piece_starts: NDArray[np.int64],
                      out: NDArray[np.uint8], written: NDArray[np.int64]) -> None:
    names = [name_bytes[name_starts[g]:name_starts[g + 1]].tobytes().decode("ascii")
             for g in range(name_starts.size - 1)]
    texts = [pieces[piece_starts[i]:piece_starts[i + 1]].tobytes().decode("ascii")
             for i in range(piece_starts.size - 1)]
    table = rows.tolist()
    lines, start = [], 0
    for k, end in enumerate(ends.tolist()):
        head, runs_open, between, close = texts[kinds[k]:kinds[k] + len(_PIECES)]
        if kinds[k] == GIVE_BACK_LINE:  # the take's number, from the line's first row
            body = str(table[start][1])
        else:
            body = between.join(f"{names[group]},{first},{count},{last}"
                                for group, first, count, last in table[start:end])
        lines.append(f"{head}{seq + k}{runs_open}{body}{close}")
        start = end
    data = np.frombuffer("\n".join(lines).encode("ascii"), dtype=np.uint8)
    out[:data.size] = data
    written[0] = data.size


@kernel(example=_lines_example, twin=_reads_lines_twin, inputs=_lines_inputs,
        calls=(_put_int, _put_piece))
def reads_lines_kernel(rows: NDArray[np.int64], ends: NDArray[np.int64],
                       kinds: NDArray[np.int64], seq: int,
                       name_bytes: NDArray[np.uint8], name_starts: NDArray[np.int64],
                       pieces: NDArray[np.uint8], piece_starts: NDArray[np.int64],
                       out: NDArray[np.uint8], written: NDArray[np.int64]) -> None:
    """The reads lines of leases, numbered from ``seq``, as :func:`reads_line` writes them,
    joined by newlines into ``out``: lease ``k``'s runs are rows ``[ends[k - 1], ends[k])``
    (from 0 for the first; at least one each), each ``(group, first id, count, epoch)``
    where group ``g``'s JSON name is ``name_bytes[name_starts[g]:name_starts[g + 1]]``;
    ``written[0]``: the bytes written. Line ``k`` is a reads line, or a pins line (its runs'
    last numbers pin deltas), a take, take_read or lease line (epochs), as ``kinds[k]``
    (READS_LINE, PINS_LINE, TAKE_LINE, TAKE_READ_LINE, LEASE_LINE) says: the index of its
    first piece in ``pieces``; or a give_back line (GIVE_BACK_LINE) of one row, whose first
    id is the take line's sequence number."""
    at = 0
    start = 0
    for k in range(ends.size):
        if k > 0:
            out[at] = _NEWLINE
            at += 1
        base = kinds[k]
        at = _put_piece(out, at, pieces, piece_starts, base)
        at = _put_int(out, at, seq + k)
        at = _put_piece(out, at, pieces, piece_starts, base + 1)
        if base == GIVE_BACK_LINE:
            # One number where the others have runs: the take's, its first row's first id.
            at = _put_int(out, at, rows[start, 1])
            at = _put_piece(out, at, pieces, piece_starts, base + 3)
            start = ends[k]
            continue
        for r in range(start, ends[k]):
            if r > start:
                at = _put_piece(out, at, pieces, piece_starts, base + 2)
            at = _put_piece(out, at, name_bytes, name_starts, rows[r, 0])
            out[at] = _COMMA
            at = _put_int(out, at + 1, rows[r, 1])
            out[at] = _COMMA
            at = _put_int(out, at + 1, rows[r, 2])
            out[at] = _COMMA
            at = _put_int(out, at + 1, rows[r, 3])
        at = _put_piece(out, at, pieces, piece_starts, base + 3)
        start = ends[k]
    written[0] = at


def name_table(names_json: list[str]) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """Groups' names as JSON (ASCII: ``json.dumps`` escapes the rest) packed for
    :func:`reads_lines_kernel`: their bytes end to end and where each starts (and the end)."""
    encoded = [name.encode("ascii") for name in names_json]
    starts = np.cumsum([0, *(len(name) for name in encoded)]).astype(np.int64)
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), starts


def line_bound(lines: int, runs: int, name_starts: NDArray[np.int64]) -> int:
    """Bytes enough for ``lines`` reads lines of ``runs`` runs in all, of these groups (and
    the newlines between)."""
    longest_name = int(np.diff(name_starts).max()) if name_starts.size > 1 else 0
    per_line = _LINE_PIECE_CHARS + _INT_CHARS + 1
    per_run = longest_name + _NUMBERS_PER_RUN * (_INT_CHARS + 1) + len(_PIECES[2])
    return max(lines * per_line + runs * per_run, 1)


def reads_lines(rows: NDArray[np.int64], ends: NDArray[np.int64], seq: int,
                name_bytes: NDArray[np.uint8], name_starts: NDArray[np.int64],
                kinds: NDArray[np.int64] | None = None) -> str:
    """The lines of leases' reads (see :func:`reads_lines_kernel`) numbered from ``seq``,
    joined by newlines (no newline after the last; empty for no lease); ``kinds``: per line,
    its kind (see :func:`reads_lines_kernel`; None: all reads lines)."""
    if not ends.size:
        return ""
    out = np.empty(line_bound(ends.size, rows.shape[0], name_starts), dtype=np.uint8)
    written = np.empty(1, dtype=np.int64)
    if kinds is None:
        kinds = np.full(ends.size, READS_LINE, dtype=np.int64)
    reads_lines_kernel(rows, ends, kinds, seq, name_bytes, name_starts, _PIECE_BYTES,
                       _PIECE_STARTS, out, written)
    return out[:int(written[0])].tobytes().decode("ascii")


__all__ = ["GIVE_BACK", "GIVE_BACK_LINE", "LEASE", "LEASE_LINE", "PINS", "PINS_LINE", "READ",
           "READS", "READS_LINE",
           "TAKE", "TAKE_LINE", "TAKE_READ", "TAKE_READ_LINE", "JsonRun", "give_back_line",
           "line_bound", "name_table", "reads_line", "reads_lines", "reads_lines_kernel",
           "run_read_line"]
