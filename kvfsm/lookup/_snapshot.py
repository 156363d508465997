"""A verdict's snapshot of the core: what explaining it later reads besides the pass output.

A verdict is explained when first read (:mod:`kvfsm.lookup._explained`), maybe after the core
changed, so before the lookup returns each group copies it into its output's snapshot rows."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.lookup._buffers import (
    flag_start,
    out_offsets,
    snapshot_at,
)
from kvfsm.state import FAILED


def _take_snapshot_example() -> tuple[object, ...]:
    """The call site's types: a fresh pass output, read-only states and checks."""
    out = np.zeros(out_offsets(1, 1)[3], dtype=np.int64)
    return (out, 1, 1, read_only(np.zeros(1, dtype=np.uint8)),
            read_only(np.zeros(1, dtype=np.uint8)), True)


@kernel(example=_take_snapshot_example,
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
            kept_failed[i] = record_failed and check[block] == FAILED
