"""The event log's lines for reads of one run of consecutive ids at one epoch (what a validated
lease reports), formatted many at a time in one compiled pass.

A serving loop validates a lease before every kernel read, and each lease reports one such run
per group it holds. Formatted one f-string at a time, those lines cost about a microsecond
each, as much as the rest of a validate; written as bytes by a compiled loop over all the
runs a batch buffered, some 0.2 µs. The text is the same either way: :func:`run_read_line` is
the format, and the pass's twin.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel

#: The ``type`` of a read line.
READ: Final = "read"
#: A run this long or longer is written as ``[first, count]`` runs; shorter ones as lists
#: (fewer characters either way).
_RUNS_FROM: Final = 3

#: The constant pieces of a read line, in the order the pass writes them.
_PIECES: Final = ('{"seq":', f',"type":"{READ}","group":', ',"ids_runs":[[',
                  ']],"epochs_runs":[[', ']]}', ',"ids":[', '],"epochs":[', ']}')
_PIECE_BYTES: Final = np.frombuffer("".join(_PIECES).encode("ascii"), dtype=np.uint8).copy()
_PIECE_STARTS: Final = np.cumsum([0, *(len(piece) for piece in _PIECES)]).astype(np.int64)
#: Characters of the longest int64 (its sign included).
_INT_CHARS: Final = 20
_NEWLINE: Final = ord("\n")
_COMMA: Final = ord(",")
_MINUS: Final = ord("-")
_ZERO: Final = ord("0")
#: Numbers in a line at most: seq, then ids and epochs (two each below _RUNS_FROM, else a
#: first and a count each).
_NUMBERS_PER_LINE: Final = 1 + 2 * 2


def run_read_line(seq: int, group_json: str, first: int, count: int, epoch: int) -> str:
    """The line of a read of ``count`` consecutive ids from ``first``, all at ``epoch``, as
    the general formatter writes it (runs where they are shorter) without building it."""
    if count >= _RUNS_FROM:
        return (f'{{"seq":{seq},"type":"{READ}","group":{group_json},'
                f'"ids_runs":[[{first},{count}]],"epochs_runs":[[{epoch},{count}]]}}')
    ids = ",".join(str(first + i) for i in range(count))
    epochs = ",".join([str(epoch)] * count)
    return (f'{{"seq":{seq},"type":"{READ}","group":{group_json},"ids":[{ids}],'
            f'"epochs":[{epochs}]}}')


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
    return (np.zeros((1, 4), dtype=np.int64), 0, _PIECE_BYTES[:2], np.array([0, 2], np.int64),
            _PIECE_BYTES, _PIECE_STARTS, np.zeros(256, dtype=np.uint8),
            np.zeros(1, dtype=np.int64))


def _lines_inputs(rng: np.random.Generator) -> tuple[object, ...]:
    """A few groups' JSON names and runs of every length class (one, two, many ids), at
    small and huge ids, epochs and sequence numbers."""
    names = [f'"g{i}{"x" * int(rng.integers(0, 4))}"' for i in range(int(rng.integers(1, 4)))]
    size = int(rng.integers(0, 8))
    top = int(rng.choice([10, 1 << 31, 1 << 62]))
    rows = np.stack([rng.integers(0, len(names), size), rng.integers(0, top, size),
                     rng.integers(1, 6, size), rng.integers(0, top, size)], axis=1)
    name_bytes, name_starts = name_table(names)
    return (rows.astype(np.int64), int(rng.integers(0, top)), name_bytes, name_starts,
            _PIECE_BYTES, _PIECE_STARTS, np.zeros(line_bound(rows.shape[0], name_starts),
                                                  dtype=np.uint8), np.zeros(1, dtype=np.int64))


def _run_lines_twin(rows: NDArray[np.int64], seq: int, name_bytes: NDArray[np.uint8],
                    name_starts: NDArray[np.int64], pieces: NDArray[np.uint8],
                    piece_starts: NDArray[np.int64], out: NDArray[np.uint8],
                    written: NDArray[np.int64]) -> None:
    names = [name_bytes[name_starts[g]:name_starts[g + 1]].tobytes().decode("ascii")
             for g in range(name_starts.size - 1)]
    text = "\n".join(run_read_line(seq + r, names[group], first, count, epoch)
                     for r, (group, first, count, epoch) in enumerate(rows.tolist()))
    data = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    out[:data.size] = data
    written[0] = data.size


@kernel(example=_lines_example, twin=_run_lines_twin, inputs=_lines_inputs,
        calls=(_put_int, _put_piece))
def run_lines_kernel(rows: NDArray[np.int64], seq: int, name_bytes: NDArray[np.uint8],
                     name_starts: NDArray[np.int64], pieces: NDArray[np.uint8],
                     piece_starts: NDArray[np.int64], out: NDArray[np.uint8],
                     written: NDArray[np.int64]) -> None:
    """The lines of the reads ``rows`` (``(group, first id, count, epoch)`` each; group
    ``g``'s JSON name is ``name_bytes[name_starts[g]:name_starts[g + 1]]``), numbered from
    ``seq``, as :func:`run_read_line` writes them, joined by newlines into ``out``;
    ``written[0]``: the bytes written."""
    at = 0
    for r in range(rows.shape[0]):
        group, first, count, epoch = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
        if r > 0:
            out[at] = _NEWLINE
            at += 1
        at = _put_piece(out, at, pieces, piece_starts, 0)
        at = _put_int(out, at, seq + r)
        at = _put_piece(out, at, pieces, piece_starts, 1)
        at = _put_piece(out, at, name_bytes, name_starts, group)
        if count >= _RUNS_FROM:
            at = _put_piece(out, at, pieces, piece_starts, 2)
            at = _put_int(out, at, first)
            out[at] = _COMMA
            at = _put_int(out, at + 1, count)
            at = _put_piece(out, at, pieces, piece_starts, 3)
            at = _put_int(out, at, epoch)
            out[at] = _COMMA
            at = _put_int(out, at + 1, count)
            at = _put_piece(out, at, pieces, piece_starts, 4)
            continue
        at = _put_piece(out, at, pieces, piece_starts, 5)
        for k in range(count):
            if k > 0:
                out[at] = _COMMA
                at += 1
            at = _put_int(out, at, first + k)
        at = _put_piece(out, at, pieces, piece_starts, 6)
        for k in range(count):
            if k > 0:
                out[at] = _COMMA
                at += 1
            at = _put_int(out, at, epoch)
        at = _put_piece(out, at, pieces, piece_starts, 7)
    written[0] = at


def name_table(names_json: list[str]) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """Groups' names as JSON (ASCII: ``json.dumps`` escapes the rest) packed for
    :func:`run_lines_kernel`: their bytes end to end and where each starts (and the end)."""
    encoded = [name.encode("ascii") for name in names_json]
    starts = np.cumsum([0, *(len(name) for name in encoded)]).astype(np.int64)
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), starts


def line_bound(lines: int, name_starts: NDArray[np.int64]) -> int:
    """Bytes enough for ``lines`` read lines of these groups (and the newlines between)."""
    longest_name = int(np.diff(name_starts).max()) if name_starts.size > 1 else 0
    per_line = _PIECE_BYTES.size + longest_name + _NUMBERS_PER_LINE * (_INT_CHARS + 1) + 1
    return max(lines, 1) * per_line


def run_lines(rows: NDArray[np.int64], seq: int, name_bytes: NDArray[np.uint8],
              name_starts: NDArray[np.int64]) -> str:
    """The lines of ``rows`` (see :func:`run_lines_kernel`) numbered from ``seq``, joined by
    newlines (no newline after the last; empty for no rows)."""
    if not rows.shape[0]:
        return ""
    out = np.empty(line_bound(rows.shape[0], name_starts), dtype=np.uint8)
    written = np.empty(1, dtype=np.int64)
    run_lines_kernel(rows, seq, name_bytes, name_starts, _PIECE_BYTES, _PIECE_STARTS, out,
                     written)
    return out[:int(written[0])].tobytes().decode("ascii")


__all__ = ["READ", "line_bound", "name_table", "run_lines", "run_lines_kernel", "run_read_line"]
