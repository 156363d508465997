"""A verdict's snapshot of the core: what explaining it later reads besides the pass output.

A verdict is explained when first read (:mod:`kvfsm.lookup._explained`), maybe after the core
changed, so before the lookup returns each group copies what it will read into its output's
snapshot rows (:func:`~kvfsm.lookup._buffers.snapshot_rows`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.lookup._buffers import (
    N_SCALARS,
    SNAPSHOT_FAILED,
    SNAPSHOT_STATE,
    flag_start,
    out_offsets,
    out_views,
    snapshot_at,
    snapshot_rows,
)
from kvfsm.state import FAILED

_FAILED = FAILED


def _take_snapshot_twin(out: NDArray[np.int64], n: int, count: int,
                        states: NDArray[np.uint8], check: NDArray[np.uint8],
                        record_failed: bool) -> None:
    """:func:`take_snapshot` as array operations (the reference)."""
    _, _, ids, _, _, _ = out_views(out, n, count)
    rows = snapshot_rows(out, n, count)
    found = ids >= 0
    safe = np.where(found, ids, 0)
    rows[SNAPSHOT_STATE] = np.where(found, states[safe], 0)
    rows[SNAPSHOT_FAILED] = found & (check[safe] == _FAILED) if record_failed else 0


def _take_snapshot_example() -> tuple[object, ...]:
    """The call site's types: a fresh pass output, read-only states and checks."""
    out = np.zeros(out_offsets(1, 1)[3], dtype=np.int64)
    out[N_SCALARS + 1] = 0  # block 0
    return (out, 1, 1, read_only(np.zeros(1, dtype=np.uint8)),
            read_only(np.zeros(1, dtype=np.uint8)), True)


@kernel(example=_take_snapshot_example, twin=_take_snapshot_twin,
        calls=(out_offsets, snapshot_at, flag_start))
def take_snapshot(out: NDArray[np.int64], n: int, count: int, states: NDArray[np.uint8],
                  check: NDArray[np.uint8], record_failed: bool) -> None:
    """Into the snapshot rows of ``out``, per prompt block: its state (0 where missing) and,
    with ``record_failed``, whether its recorded check is FAILED (else 0)."""
    ids_at, _, bytes_at, _ = out_offsets(n, count)
    at = snapshot_at(n, count)
    raw = out[bytes_at:].view(np.uint8)
    kept_states = raw[at : at + n]
    kept_failed = raw[at + n : at + 2 * n]
    for i in range(n):
        block = out[ids_at + i]
        if block < 0:
            kept_states[i] = 0
            kept_failed[i] = 0
        else:
            kept_states[i] = states[block]
            kept_failed[i] = record_failed and check[block] == _FAILED
