"""A verdict's snapshot of the core: what explaining it later reads besides the lookup's pass
output, copied into that output in one compiled call per group.

A verdict with something to explain is explained when first read
(:mod:`kvfsm.lookup._explained`), maybe after the core has changed, so before the lookup
returns each group keeps what the explanation will read of the core: each prompt block's
lifecycle state and whether its recorded data check had failed. As NumPy gathers that was
four calls a group, most of a partial hit's cost over a full one at short prompts; here it is
one loop into the snapshot rows the pass output leaves room for
(:func:`~kvfsm.lookup._group_pass.snapshot_rows`). The pass itself does not write them: a full
hit, most lookups, never reads them, and two more stores a block slowed its loop by 4-7 % at
131 072 tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only
from kvfsm.lookup._buffers import (
    N_SCALARS,
    SNAPSHOT_FAILED,
    SNAPSHOT_STATE,
    out_offsets,
    out_views,
    snapshot_at,
    snapshot_rows,
)
from kvfsm.state import FAILED

#: Recorded check states as :mod:`kvfsm.state` keeps them (a module global the kernel reads).
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
    """The call site's types: a pass output (fresh int64), the group's states and checks
    (read-only views of the core's arrays)."""
    out = np.zeros(out_offsets(1, 1)[3], dtype=np.int64)
    out[N_SCALARS + 1] = 0  # block 0
    return (out, 1, 1, read_only(np.zeros(1, dtype=np.uint8)),
            read_only(np.zeros(1, dtype=np.uint8)), True)


@kernel(example=_take_snapshot_example, twin=_take_snapshot_twin,
        calls=(out_offsets, snapshot_at))
def take_snapshot(out: NDArray[np.int64], n: int, count: int, states: NDArray[np.uint8],
                  check: NDArray[np.uint8], record_failed: bool) -> None:
    """Into the snapshot rows of a group pass's output ``out`` (``n`` blocks, ``count``
    candidate lengths), per prompt block: its lifecycle state in ``states`` (0 where missing),
    and, with ``record_failed``, whether its recorded check in ``check`` is FAILED (else 0)."""
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
