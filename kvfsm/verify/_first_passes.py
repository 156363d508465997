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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm.verify._group_eval import GroupEval, _new_eval
from kvfsm.verify._group_pass import (
    CHECKS_IGNORED,
    CHECKS_RECORDED,
    group_pass_first,
)
from kvfsm.verify._lookup_layout import MAX_CACHED, LookupLayout, Row, make_probe
from kvfsm.verify._prompt import Prompt
from kvfsm.verify._statics import statics_for
from kvfsm.verify._types import (
    DeviceProfile,
    GroupVerdict,
    LeaseSpans,
    Level,
    Reason,
    Shortfall,
    Verdict,
    full_verdict,
)

#: The levels compared against on every lookup (module globals read faster than members).
_FULL: Final = Level.FULL
_FAST: Final = Level.FAST
#: :func:`group_pass_first`'s entry point bound to its argument types (every first pass
#: makes its arguments alike), on the first compiled call.
_entry: list[Callable[..., int]] = []


@functools.lru_cache(maxsize=MAX_CACHED)
def prompt_end(hit: int) -> Shortfall:
    """The shortfall of a prompt hit at every candidate length (a value: shared)."""
    return Shortfall(Reason.PROMPT_END, "*", detail=(
        f"every candidate length hit; tokens from {hit} on are computed, the last one for its "
        "logits"))


def first_passes(layout: LookupLayout, prompt: Prompt, n_tokens: int, rows: tuple[Row, ...],
                 lengths: NDArray[np.int64], level: Level, profile: DeviceProfile,
                 checksums: bool, lease_spans: LeaseSpans, may_end_here: bool
                 ) -> Verdict | list[GroupEval] | None:
    """Each group's first pass, for a lookup of ``prompt`` (``n_tokens`` long) over the
    candidate ``lengths``, whose layout has no index, under an uncapped budget, with compiled
    kernels on.

    The verdict where the passes say it all: ``may_end_here`` (the lookup asks nothing more,
    such as a speculative-decoding drop), and every group usable now at the last candidate
    length and hit as far, no checksum to compute or recompute, no alignment to check here,
    nothing the plan changes. Else every group's evaluation, in ``rows``' order, made on its
    first pass's output (the general lookup goes on from them). None where some group's pass
    cannot be run so (its arrays not laid out for an address table, a prompt whose words end
    before its tokens): the general lookup runs every pass itself."""
    mode = CHECKS_RECORDED if checksums else CHECKS_IGNORED
    says_all = may_end_here and not (checksums and level is _FULL)  # FULL recomputes them
    last = lengths.size - 1
    run = _entry[0] if _entry else None
    passed = []
    found = []
    for group, decl, _, known_here, spans in rows:
        words = prompt.words(decl.block_size)
        high, low = words
        statics = statics_for(group, decl.layout, profile, known_here)
        fixed = statics.fixed
        if fixed is None or spans.n != high.size:
            return None
        out = np.empty(spans.out_size, dtype=np.int64)
        if run is None:
            run = _bound(high, low, fixed, spans.rows, spans.prefix_step, mode, out)
        if run(high, low, fixed, spans.rows, spans.prefix_step, mode, out) != last or \
                not (statics.aligned or (level is _FAST and statics.restore_aligned)):
            says_all = False
        passed.append((group, words, spans, statics, out))
        if says_all:  # what the probe keeps (built here: a second loop costs more)
            found.append((decl.name, spans, out, words, group.changes))
    if not says_all:
        made = []
        for group, (high, low), spans, statics, out in passed:
            # Made without the constructor's checks and keywords, as the general lookup does.
            evaluation = _new_eval(GroupEval)
            evaluation._evaluate(group, high, low, lengths, level, profile, None, checksums,
                                 spans, statics, False, out)
            made.append(evaluation)
        return made
    # Usable now at the last candidate length, the hit as far, nothing to restore: the
    # prompt-end reason (where above 0) and the probe a lease reads.
    usable = last * layout.step
    figures = layout.whole.get(usable)
    if figures is None:
        figures = _figures(layout, rows, usable)
    return full_verdict(n_tokens, usable, level, *figures,
                        make_probe(layout, prompt, found, last, usable, lease_spans))


def _bound(*args: Any) -> Callable[..., int]:
    """:func:`group_pass_first`'s entry point for ``args``' types, bound once and kept."""
    if not _entry:
        _entry.append(group_pass_first.entry(*args))
    return _entry[0]


def _figures(layout: LookupLayout, rows: tuple[Row, ...], usable: int
             ) -> tuple[tuple[GroupVerdict, ...], tuple[Shortfall, ...]]:
    """Each group's figures (hit, usable and restorable all ``usable``, no stop) and the
    reasons of a verdict usable to the end of its prompt, made and kept in the layout."""
    if len(layout.whole) >= MAX_CACHED:
        layout.whole.clear()
    known = layout.whole[usable] = (
        tuple([GroupVerdict(decl.name, decl.kind, decl.block_size, usable, usable, usable,
                            None) for _, decl, _, _, _ in rows]),
        (prompt_end(usable),) if usable > 0 else ())
    return known


__all__ = ["first_passes", "prompt_end"]
