"""Restore paths derived from the lifecycle table, never hand-written (classification gate). Per
state and form: the shortest event sequence to a readable state of that form with the content
complete the whole way (paths through ``free`` are recomputation, not restoration). A path
completing a spill in flight (``spill_done``) is taken only where no other is as short: the spill
is its owner's to finish, and its copy may not be there yet. From ``spilling_disk`` (host copy
still authoritative) the plan cancels the spill and restores from the host."""

from __future__ import annotations

import functools
from collections import deque

import numpy as np
from numpy.typing import NDArray

from kvfsm.fsm import FORM_CODE, FORM_COMPRESSED, FORM_RAW, INVALID, CompiledTable
from kvfsm.spec import Event, Form

#: Bits of :attr:`RestorePaths.code`.
READABLE_RAW, READABLE_COMPRESSED, REACHES_RAW, REACHES_COMPRESSED = 1, 2, 4, 8


class RestorePaths:
    """Per state: the shortest content-preserving path to a readable state of each form."""

    def __init__(self, table: CompiledTable) -> None:
        self.form = table.form
        complete = table.complete.tolist()
        self.paths: dict[Form, list[tuple[Event, ...] | None]] = {}
        self.reachable: dict[Form, NDArray[np.bool_]] = {}
        #: Per form, per state: the path begins a restore (what the admission gate counts).
        self.restores: dict[Form, NDArray[np.bool_]] = {}
        for form in (Form.RAW, Form.COMPRESSED):
            targets = set(np.flatnonzero(table.readable & (table.form == FORM_CODE[form])).tolist())
            paths = [_shortest(table, start, targets, complete)
                     for start in range(table.n_states)]
            self.paths[form] = paths
            self.reachable[form] = np.array([p is not None for p in paths], dtype=np.bool_)
            self.restores[form] = np.array([p is not None and Event.RESTORE_BEGIN in p
                                            for p in paths], dtype=np.bool_)
        #: ``restores`` as one read-only ``[2, n_states]`` array (raw, then compressed).
        self.restores_by_form = np.stack([self.restores[Form.RAW],
                                          self.restores[Form.COMPRESSED]])
        self.restores_by_form.setflags(write=False)
        readable = table.readable
        self.code = (  # one code per state: every per-state fact in a single gather
            (readable & (self.form == FORM_RAW)) * READABLE_RAW
            | (readable & (self.form == FORM_COMPRESSED)) * READABLE_COMPRESSED
            | self.reachable[Form.RAW] * REACHES_RAW
            | self.reachable[Form.COMPRESSED] * REACHES_COMPRESSED
        ).astype(np.uint8)

    def path(self, state: int, form: Form) -> tuple[Event, ...] | None:
        return self.paths[form][state]


#: Events in try order: the first found of equally short paths wins, so ``spill_done`` last.
_EVENT_ORDER = (*(event for event in Event if event is not Event.SPILL_DONE), Event.SPILL_DONE)


def _shortest(
    table: CompiledTable, start: int, targets: set[int], complete: list[bool]
) -> tuple[Event, ...] | None:
    if start in targets:
        return ()
    if not complete[start]:
        return None
    seen: dict[int, tuple[Event, ...]] = {start: ()}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for event in _EVENT_ORDER:
            nxt = int(table.next_state[state, event])
            if nxt == INVALID or nxt in seen or not complete[nxt]:
                continue
            path = (*seen[state], event)
            if nxt in targets:
                return path
            seen[nxt] = path
            queue.append(nxt)
    return None


@functools.lru_cache(maxsize=64)
def restore_paths(table: CompiledTable) -> RestorePaths:
    """The (cached) restore paths of one compiled table."""
    return RestorePaths(table)
