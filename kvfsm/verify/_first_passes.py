"""A lookup's first pass over every group, and the verdict when those passes say it all.

Most lookups a scheduler makes are of models without a sparse index, under an uncapped
restore budget, and most of those end with every group usable up to the last candidate
length, nothing to restore, nothing to explain. For them the general lookup's per-group
evaluation objects, scalars and reasons are bookkeeping around one compiled pass a group; at
short prompts that bookkeeping costs more than the passes. Here each group's first pass runs
through :func:`~kvfsm.verify._group_pass.group_pass_first` (seven arguments, its answer
returned), and where every group answers "usable to the end, nothing else to find" the
verdict is made straight from the answers. Anywhere else each group's evaluation is made on
its first pass's output and the general lookup goes on from them, so no pass runs twice: it
stays the reference for every verdict, and the two agree by construction on what the passes
wrote.

The loop over the groups runs inline in :func:`~kvfsm.verify._lookup.lookup_checked` (a
frame and ten arguments fewer on every lookup, a tenth of a short prompt's); this module holds
its parts: the pass's bound entry point, the evaluations made from its outputs, and the
fields of a full verdict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm.state import GroupState
from kvfsm.verify._group_eval import GroupEval, _new_eval
from kvfsm.verify._group_pass import group_pass_first
from kvfsm.verify._lookup_layout import MAX_CACHED, LookupLayout, Row
from kvfsm.verify._spans import Spans
from kvfsm.verify._statics import Statics
from kvfsm.verify._types import (
    DeviceProfile,
    GroupVerdict,
    Level,
    Reason,
    Shortfall,
    full_fields,
)

#: Per group whose first pass ran: its state, hash words, spans, statics and pass output.
Passed = tuple[GroupState, tuple[NDArray[np.uint64], NDArray[np.uint64]], Spans, Statics,
               NDArray[np.int64]]
#: :func:`group_pass_first`'s entry point bound to its argument types (every first pass
#: makes its arguments alike), on the first compiled call.
bound_entry: list[Callable[..., int]] = []


@functools.lru_cache(maxsize=MAX_CACHED)
def prompt_end(hit: int) -> Shortfall:
    """The shortfall of a prompt hit at every candidate length (a value: shared)."""
    return Shortfall(Reason.PROMPT_END, "*", detail=(
        f"every candidate length hit; tokens from {hit} on are computed, the last one for its "
        "logits"))


def first_pass_entry(*args: Any) -> Callable[..., int]:
    """:func:`group_pass_first`'s entry point for the types of ``args`` (a first pass's
    arguments: every one makes them alike), bound on the first call and kept in
    :data:`bound_entry`."""
    if not bound_entry:
        bound_entry.append(group_pass_first.entry(*args))
    return bound_entry[0]


def evaluations(passed: list[Passed], lengths: NDArray[np.int64], level: Level,
                profile: DeviceProfile, checksums: bool) -> list[GroupEval]:
    """Each group's evaluation, in ``passed``'s order, made on its first pass's output (the
    general lookup goes on from them: no pass runs twice)."""
    made = []
    for group, (high, low), spans, statics, out in passed:
        # Made without the constructor's checks and keywords, as the general lookup does.
        evaluation = _new_eval(GroupEval)
        evaluation._evaluate(group, high, low, lengths, level, profile, None, checksums,
                             spans, statics, False, out)
        made.append(evaluation)
    return made


def whole_fields(layout: LookupLayout, rows: tuple[Row, ...], usable: int, level: Level
                 ) -> dict[str, Any]:
    """The fields of a verdict usable to the end of its prompt at ``usable`` tokens and
    ``level`` (:func:`~kvfsm.verify._types.full_fields`: each group's figures all ``usable``
    with no stop, the prompt-end reason where above 0), made and kept in the layout."""
    by_level = layout.whole.get(usable)
    if by_level is None:
        if len(layout.whole) >= MAX_CACHED:
            layout.whole.clear()
        by_level = layout.whole[usable] = {}
    fields = by_level[level] = full_fields(
        usable, level,
        tuple([GroupVerdict(decl.name, decl.kind, decl.block_size, usable, usable, usable,
                            None) for _, decl, _, _, _ in rows]),
        (prompt_end(usable),) if usable > 0 else ())
    return fields


__all__ = ["Passed", "bound_entry", "evaluations", "first_pass_entry", "prompt_end",
           "whole_fields"]
