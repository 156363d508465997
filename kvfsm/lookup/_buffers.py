"""The one owner of the lookup's and the lease's buffer layouts: the group pass's output and
``consts``, the span rows, and the lease's address table and answer rows.

Readers, compiled or not, find parts only through these names, so a layout changes here alone;
compiled callers list these functions in ``calls``, which stamps their disk cache with this file."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._addressed import matrix_at, vector_at
from kvfsm._jit import inlined
from kvfsm.state._core import LeasedRun

Bools = NDArray[np.bool_]

# Indices of the output's scalars; ``asked`` (one per candidate length) follows them.
#: Blocks from the prompt's start that the hash chain finds, before the first miss.
CHAIN_BLOCKS: Final = 0
#: 1 when a readable block was never checked at its epoch (CHECKS_RECORDED mode only).
NEEDS_CHECKSUMS: Final = 1
#: 1 when the plan changes what is usable somewhere.
PLAN_CHANGES: Final = 2
#: 1 when ``asked`` is written (the caller keeps it), else 0.
ASKED_KEPT: Final = 3
#: Last candidate index where ``hit`` / ``now`` / ``after`` is True (0 when none).
LARGEST_HIT: Final = 4
LARGEST_NOW: Final = 5
LARGEST_AFTER: Final = 6
#: 1 when every block of the prompt is usable now in the form ``P_SETTLED_FORM`` names.
ALL_SETTLED: Final = 7
#: Restores the plan asks for over the whole prompt (0 where it changes nothing).
RESTORES_TOTAL: Final = 8
#: CHAIN_BLOCKS where they are consecutive ids at one epoch, else 0: a lease then pins one run
#: without reading their ids and epochs again.
ONE_RUN_BLOCKS: Final = 9
N_SCALARS: Final = 10

# Indices of ``consts``: a group's fixed parameters, then the tables at the offsets named.
#: The sub-block mask of a whole block.
P_FULL_SUB_MASK: Final = 0
#: Restored blocks land aligned (the device pool's construction guarantees it).
P_ALIGNED: Final = 1
#: Block sizes of the index's target group and of this group (an index only).
P_TARGET_SIZE: Final = 2
P_OWN_SIZE: Final = 3
#: The form this group's kind settles in: 1 compressed, 0 raw (for ALL_SETTLED).
P_SETTLED_FORM: Final = 4
#: Offsets of the tables: per layout id, the kernel accepts it; per state, its restore-path
#: code and whether a raw / compressed restore begins there; per target state, hashed (alive).
P_LAYOUT_OK_AT: Final = 5
P_CODE_AT: Final = 6
P_RESTORES_RAW_AT: Final = 7
P_RESTORES_CMP_AT: Final = 8
P_HASHED_AT: Final = 9
#: The flag row (NOW_RAW or NOW_CMP) of the index's target group that says "settled".
P_HISTORY_SETTLED_ROW: Final = 10
N_PARAMS: Final = 11

#: The group pass's fixed arrays as one address table, in :func:`fixed_arrays`' order.
FIXED_KINDS: Final[tuple[tuple[type[np.generic], int], ...]] = (
    (np.uint64, 1), (np.uint64, 1), (np.uint64, 1), (np.bool_, 1), (np.uint8, 1),
    (np.uint32, 1), (np.int32, 1), (np.uint16, 1), (np.uint8, 1), (np.uint8, 1),
    (np.int32, 2), (np.uint32, 2), (np.uint32, 1), (np.uint8, 1), (np.int32, 1),
    (np.int64, 1))


@inlined
def fixed_arrays(fixed: NDArray[np.int64]) -> tuple[NDArray[Any], ...]:
    """The pass's address table's arrays: hash slots, block words, mapped; per block state,
    epoch, position, sub-blocks, layout, check; index refs (targets, epochs); the target group's
    epochs, states, positions; ``consts``."""
    return (vector_at(fixed, 0, np.uint64), vector_at(fixed, 1, np.uint64),
            vector_at(fixed, 2, np.uint64), vector_at(fixed, 3, np.bool_),
            vector_at(fixed, 4, np.uint8), vector_at(fixed, 5, np.uint32),
            vector_at(fixed, 6, np.int32), vector_at(fixed, 7, np.uint16),
            vector_at(fixed, 8, np.uint8), vector_at(fixed, 9, np.uint8),
            matrix_at(fixed, 10, np.int32), matrix_at(fixed, 11, np.uint32),
            vector_at(fixed, 12, np.uint32), vector_at(fixed, 13, np.uint8),
            vector_at(fixed, 14, np.int32), vector_at(fixed, 15, np.int64))


# Rows of ``spans``: per candidate length, blocks ``[lo, cut)`` compressed and ``[cut, hi)``
# raw, and 1 where the kind can serve the length with every needed block inside.
SPAN_LO, SPAN_CUT, SPAN_HI, SPAN_BASE = range(4)
N_SPAN_ROWS: Final = 4

# Flag rows, each ``max(n, count)`` long: per-block rows, then per-length rows.
NOW_RAW, NOW_CMP, AFTER_RAW, AFTER_CMP, FIT, SETTLED_OK = range(6)
N_PER_BLOCK: Final = 6
HIT, NOW, AFTER = range(3)
N_PER_LENGTH: Final = 3
N_FLAGS: Final = N_PER_BLOCK + N_PER_LENGTH


def pack_consts(full_sub_mask: int, aligned: bool, target_size: int, own_size: int,
                settled_compressed: bool, layout_ok: Bools, code: NDArray[np.uint8],
                restores: Bools, hashed: Bools, target_settled_compressed: bool = False
                ) -> NDArray[np.int64]:
    """Read-only ``consts``: the parameters, then the tables (``restores``: raw then compressed)."""
    tables = (layout_ok, code, restores[0], restores[1], hashed)
    offsets = N_PARAMS + np.cumsum([0] + [table.size for table in tables[:-1]])
    consts = np.concatenate([
        np.array([full_sub_mask, aligned, target_size, own_size, settled_compressed],
                 dtype=np.int64), offsets.astype(np.int64),
        np.array([NOW_CMP if target_settled_compressed else NOW_RAW], dtype=np.int64),
        *(table.astype(np.int64) for table in tables)])
    consts.setflags(write=False)
    return consts


def out_offsets(n: int, count: int) -> tuple[int, int, int, int]:
    """Word offsets in the output for ``n`` blocks and ``count`` lengths: ids, epochs (uint32, two a
    word), bytes (facts, flag rows, snapshot), total size; scalars at 0, ``asked`` at N_SCALARS."""
    ids_at = N_SCALARS + count
    epochs_at = ids_at + n
    bytes_at = epochs_at + (n + 1) // 2
    return ids_at, epochs_at, bytes_at, \
        bytes_at + (snapshot_at(n, count) + SNAPSHOT_ROWS * n + 7) // 8


#: Rows after the flags, per block as at the lookup: state (0: missing), recorded check failed.
SNAPSHOT_STATE, SNAPSHOT_FAILED = range(2)
SNAPSHOT_ROWS: Final = 2


def flag_start(n: int, count: int, row: int) -> int:
    """Where flag row ``row`` starts in the output's bytes."""
    return n + row * max(n, count)


def snapshot_at(n: int, count: int) -> int:
    """Where the snapshot rows start in the output's bytes: after the last flag row."""
    return flag_start(n, count, N_FLAGS)


def snapshot_rows(out: NDArray[np.int64], n: int, count: int) -> NDArray[np.uint8]:
    """The snapshot rows of ``out`` as a ``[SNAPSHOT_ROWS, n]`` view."""
    _, _, bytes_at, _ = out_offsets(n, count)
    at = snapshot_at(n, count)
    rows: NDArray[np.uint8] = out[bytes_at:].view(np.uint8)[at : at + SNAPSHOT_ROWS * n]
    return rows.reshape(SNAPSHOT_ROWS, n)


@inlined
def out_parts(out: NDArray[np.int64], n: int, count: int
               ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                          NDArray[np.uint32], NDArray[np.uint8], Bools, int]:
    """The parts of ``out``: scalars, asked, ids, epochs, facts, flag rows (one vector), width."""
    ids_at, epochs_at, bytes_at, _ = out_offsets(n, count)
    width = max(n, count)
    raw_bytes = out[bytes_at:].view(np.uint8)
    return (out[:N_SCALARS], out[N_SCALARS:ids_at], out[ids_at:epochs_at],
            out[epochs_at:bytes_at].view(np.uint32), raw_bytes[:n],
            raw_bytes[n : n + N_FLAGS * width].view(np.bool_), width)


@inlined
def flag_row(rows: Bools, row: int, width: int) -> Bools:
    """Flag row ``row`` of ``rows`` (each ``width`` long)."""
    return rows[row * width : (row + 1) * width]


@inlined
def history_parts(history: NDArray[np.int64], n_history: int, count: int,
                   consts: NDArray[np.int64]) -> tuple[NDArray[np.int64], Bools]:
    """The index's target group's block ids and settled row, from its pass output."""
    _, _, ids, _, _, rows, width = out_parts(history, n_history, count)
    return ids, flag_row(rows, consts[P_HISTORY_SETTLED_ROW], width)[:n_history]


# -- the lease exchange ----

#: Answer row per group: the pinning touch's ``out`` (an id outside the group, first at the pin
#: limit, how pinned, one run at one epoch), first id and epoch read, prompt blocks ``[lo, hi)``.
OUTSIDE: Final = 0
FULL: Final = 1
PINNED_AS: Final = 2
ONE_READ: Final = 3
FIRST_ID: Final = 4
FIRST_EPOCH: Final = 5
LO: Final = 6
HI: Final = 7
ANSWER_COLUMNS: Final = 8
#: Columns of a probed lease's fixed facts per group (``fixed[g]``).
SHIFT: Final = 0
TARGET: Final = 1
BLOCK: Final = 2
TARGET_BLOCK: Final = 3
FIXED_COLUMNS: Final = 4
#: ``result[0]`` of :func:`take_probed_loop`: every group pinned and touched.
TAKEN: Final = -1


def answer_runs(names: tuple[str, ...], answers: NDArray[np.int64]) -> list[LeasedRun]:
    """``(names[g], first id, count, epoch)`` per group holding blocks, for observers without
    the answer-rows methods."""
    return [(names[g], row[FIRST_ID], row[HI] - row[LO], row[FIRST_EPOCH])
            for g, row in enumerate(answers.tolist()) if row[HI] > row[LO]]


def probed_ids(out: NDArray[np.int64], at_ids: int, at_epochs: int, lo: int, hi: int
                ) -> tuple[NDArray[np.int64], NDArray[np.uint32]]:
    """The ids and epochs a group pass wrote to ``out`` for prompt blocks ``[lo, hi)``."""
    return out[at_ids + lo:at_ids + hi], out[at_epochs:].view(np.uint32)[lo:hi]


#: A lease's address table per group (dtypes: LEASE_KINDS): states, each state's recency list, use
#: stamps, list links, heads, tails, block and chunk pins, epochs, record of a run linked in order.
STATES, LIST_OF_STATE, LAST_USE, PREV, NEXT, HEAD, TAIL, PINS, CHUNK_PINS, EPOCH, \
    LINKED_RUN = range(11)
LEASE_KINDS: Final[tuple[tuple[type[np.generic], int], ...]] = (
    (np.uint8, 1), (np.int8, 1), (np.uint32, 1), (np.int32, 1), (np.int32, 1), (np.int32, 1),
    (np.int32, 1), (np.uint16, 1), (np.uint16, 1), (np.uint32, 1), (np.int64, 1))
N_LEASE_ARRAYS: Final = len(LEASE_KINDS)
