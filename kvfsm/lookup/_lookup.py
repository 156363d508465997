"""``lookup``: from a prompt's block hashes to a :class:`Verdict` (hit is not usable). Per group
a boolean "usable at L" over candidate lengths L (multiples of the LCM of the block sizes, below
the prompt's last token); AND across groups; the largest L wins. A speculative-decoding drop of
the last block applies once, to the final vectors: no loop of groups shrinking each other's."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.lookup._buffers import AFTER, HIT, NOW
from kvfsm.lookup._explained import Explanation, explained_later
from kvfsm.lookup._group_eval import GroupEval, _new_eval
from kvfsm.lookup._lookup_layout import (
    MAX_CACHED,
    Found,
    HeldKey,
    LookupLayout,
    layout_of,
    lease_spans_of,
    make_probe,
)
from kvfsm.lookup._spans import spans_for
from kvfsm.lookup._statics import statics_for
from kvfsm.lookup._types import (
    Checks,
    DeviceProfile,
    GroupVerdict,
    KernelLayouts,
    LeaseSpans,
    Level,
    Reason,
    RestoreStep,
    Shortfall,
    Verdict,
)
from kvfsm.lookup._why import BY_CODE, listed
from kvfsm.spec import Event, Form, GroupKind, Layout, Tier
from kvfsm.state import StateCore
from kvfsm.state._prompt import Prompt

_DEFAULT_PROFILE = DeviceProfile()


@functools.lru_cache(maxsize=MAX_CACHED)
def prompt_end(hit: int) -> Shortfall:
    """The shortfall of a prompt hit at every candidate length (a value: shared)."""
    return Shortfall(Reason.PROMPT_END, "*", detail=(
        f"every candidate length hit; tokens from {hit} on are computed, the last one for its "
        "logits"))


@functools.lru_cache(maxsize=MAX_CACHED)
def held_to(groups: HeldKey, usable: int) -> tuple[GroupVerdict, ...]:
    """Shared verdicts of ``groups`` (name, kind's name, block size) held to ``usable``, no stop."""
    return tuple([GroupVerdict(name, GroupKind[kind], block_size, usable, usable, usable, None)
                  for name, kind, block_size in groups])


def _largest(vector: np.ndarray, below: int | None = None) -> int:
    """Index of the last True entry (below ``below`` when given); 0 when none."""
    limit = vector.size if below is None else below
    hits = np.flatnonzero(vector[:limit])
    return int(hits[-1]) if hits.size else 0


def as_level(level: Level | str) -> Level:
    """``level`` as a :class:`Level` (its name or value, any case), or a KvfsmError."""
    if isinstance(level, Level):
        return level
    if isinstance(level, str):
        for known in Level:
            if level.lower() in (known.value, known.name.lower()):
                return known
    raise KvfsmError(f"unknown verification level {level!r}; levels: "
                     f"{[known.name for known in Level]}")


def check_kernel_layouts(core: StateCore, kernel_layouts: KernelLayouts | None) -> None:
    """``kernel_layouts`` maps groups of the core to Layouts."""
    if kernel_layouts is not None and not isinstance(kernel_layouts, Mapping):
        raise KvfsmError(f"kernel_layouts must map group names to Layouts, got "
                         f"{type(kernel_layouts).__name__}")
    for name, layout in (kernel_layouts or {}).items():
        core.group(name)  # names the groups when it does not exist
        if not isinstance(layout, Layout):
            raise KvfsmError(f"kernel_layouts[{name!r}] must be a Layout, got {layout!r}")


def lookup(
    core: StateCore,
    prompt: Prompt,
    *,
    level: Level | str = Level.FULL,
    kernel_layouts: KernelLayouts | None = None,
    profile: DeviceProfile | None = None,
    drop_last_block: bool = False,
    checksums: bool = True,
    max_tokens: int | None = None,
) -> Verdict:
    """How much of ``prompt`` the core can serve now, after restores, and why not more.

    A lookup writes no state: the checksums it computed are in ``Verdict.checks`` for the caller
    to record (:meth:`StateCore.record_checks`; :class:`~kvfsm.Engine` does). ``checksums=False``
    leaves out layer 1's data checksums; every other check still runs. ``max_tokens`` caps the
    candidate lengths (none past it is looked at)."""
    if level.__class__ is not Level:
        level = as_level(level)
    if max_tokens is not None and (max_tokens.__class__ is not int or max_tokens < 0):
        raise KvfsmError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
    if kernel_layouts:
        check_kernel_layouts(core, kernel_layouts)
    layout = layout_of(core)
    prompt.check_made_for(core.seed, layout.block_sizes, "engine")
    return lookup_checked(core, layout, prompt, level, kernel_layouts,
                          _DEFAULT_PROFILE if profile is None else profile, drop_last_block,
                          checksums, max_tokens)


def lookup_checked(core: StateCore, layout: LookupLayout, prompt: Prompt, level: Level,
                   kernel_layouts: KernelLayouts | None, profile: DeviceProfile,
                   drop_last_block: bool, checksums: bool, max_tokens: int | None = None
                   ) -> Verdict:
    """:func:`lookup` of arguments already checked: ``level`` a Level, ``kernel_layouts``
    naming the core's groups, ``prompt`` made for the core (:meth:`Prompt.check_made_for`),
    ``layout`` the core's :func:`layout_of` and ``max_tokens`` None or an int >= 0."""
    n_tokens = prompt.n_tokens
    last = n_tokens - 1 if n_tokens > 1 else 0  # the last prompt token is always computed
    keep = True  # the candidates of the prompt's length (cached by it)
    if max_tokens is not None and max_tokens < last:
        last, keep = max_tokens, False  # the candidates stop at the cap
    step = layout.step
    count = last // step + 1
    known = layout.by_length.get(n_tokens) if keep else None
    lengths, rows, cached_spans = layout.spans_at(n_tokens, count, keep) if known is None \
        else known
    lease_spans: LeaseSpans | None = cached_spans
    capped = core.restore_budget.capped
    made: list[GroupEval] = []
    checks: list[Checks] = []
    found: list[Found] = []  # a lease's reads; a lookup writes nothing, so counts hold at its end
    outs: list[NDArray[np.int64]] = []
    for group, decl, target_at, known_here, spans in rows:  # index groups after their target
        words = prompt.words(decl.block_size)
        reads = (kernel_layouts.get(decl.name) if kernel_layouts else None) or decl.layout
        if spans.n != words[0].size:  # the prompt's words end before its tokens: own spans
            spans = spans_for(group, words[0].size, lengths)
            lease_spans = None
        evaluation = _new_eval(GroupEval)
        evaluation._evaluate(group, words, lengths, level, profile,
                             made[target_at] if target_at >= 0 else None, checksums,
                             spans, statics_for(group, reads, profile, known_here), capped)
        made.append(evaluation)
        checked = evaluation.checked
        if checked is not None:
            checks.append(Checks(decl.name, *checked))
        found.append((decl.name, spans, evaluation._out, words, group.changes))
        outs.append(evaluation._out)
    every = tuple(made)
    hit_at, usable_at, after_at = _common_lasts(every)
    admitted = _admitted(core, every) if capped else True
    restorable_at = after_at if admitted is True else _largest(_and(every, AFTER) & admitted)
    reasons: list[Shortfall] = []
    if drop_last_block and (usable_at > 0 or restorable_at > 0):
        # Speculative decoding recomputes the last reusable block, now and after a plan alike.
        now, after = _and(every, NOW), _and(every, AFTER) & admitted
        if usable_at > 0:
            usable_at = _largest(now, below=usable_at)
        if restorable_at > 0:
            restorable_at = _largest(after, below=restorable_at)
        reasons.append(Shortfall(Reason.SPEC_DECODE_DROP, "*",
                                 detail="speculative decoding recomputes the last block"))
    if usable_at > restorable_at:
        restorable_at = usable_at
    usable, restorable, hit = usable_at * step, restorable_at * step, hit_at * step
    final = (count - 1) * step
    if layout.boundary:
        boundary = _boundary(layout, [every[i].chain_tokens for i in layout.prefix_at], last,
                             hit)
        if boundary is not None:
            reasons.append(boundary)
    if hit == final and hit > 0:
        reasons.append(prompt_end(hit))
    if lease_spans is None:
        lease_spans = lease_spans_of(layout.names, [e.spans for e in every])
    probe = make_probe(layout, prompt, found, tuple(outs), usable_at, usable, lease_spans)
    if usable < final or restorable > usable:  # explained on first read, from a snapshot now
        for e in every:
            e.freeze()  # every snapshot first: an index's reads its target group
        for e in every:
            e.detach()  # then the core let go
        return explained_later(
            {"prompt_tokens": n_tokens, "hit_tokens": hit, "usable_tokens": usable,
             "restorable_tokens": restorable, "recompute_from": usable, "level": level,
             "checks": tuple(checks), "probe": probe},
            functools.partial(_explain, every, step, count, hit, final, usable, restorable,
                              tuple(reasons)))
    # Usable at the last candidate: every group holds there, with no stop.
    return Verdict(n_tokens, hit, usable, restorable, usable, level,
                   held_to(layout.held_key, usable), tuple(reasons), (), tuple(checks), probe)


def _explain(every: tuple[GroupEval, ...], step: int, count: int, hit: int, final: int,
             usable: int, restorable: int, head: tuple[Shortfall, ...]) -> Explanation:
    """A verdict's groups, reasons (after ``head``) and plan, from the frozen evaluations:
    why not the hit, and why not the whole prompt, each block named once."""
    evals = {e.decl.name: e for e in every}
    reasons = list(head)
    if usable < final:
        at_hit = _shortfalls(evals, hit, usable)  # none where the hit is usable
        reasons += at_hit
        if final != hit:
            at_final = _shortfalls(evals, final, usable)
            if at_hit:
                named = set(at_hit)
                at_final = [shortfall for shortfall in at_final if shortfall not in named]
            reasons += at_final
    groups = tuple([_group_verdict(e, step, count) for e in every])
    plan = _plan(evals, restorable) if restorable > usable else ()
    return groups, tuple(reasons), plan


def _common_lasts(evals: tuple[GroupEval, ...]) -> tuple[int, int, int]:
    """Per row (HIT, NOW, AFTER): the last candidate index where every group's row holds (0:
    none). Rows are not prefixes (windows, snapshots): where the lasts differ, rows are ANDed."""
    first = evals[0].largest
    for e in evals:
        if e.largest != first:
            break
    else:
        return first  # each holds at its own last (or all are 0)
    lasts = []
    for row in (HIT, NOW, AFTER):
        each = [e.largest[row] for e in evals]
        at = min(each)
        # A group holds at its own last (when above 0): only the others are read.
        if at and any(last != at and not e.holds(row, at)
                      for last, e in zip(each, evals, strict=True)):
            at = _largest(_and(evals, row))
        lasts.append(at)
    return lasts[HIT], lasts[NOW], lasts[AFTER]


def _and(evals: tuple[GroupEval, ...], row: int) -> NDArray[np.bool_]:
    """The groups' rows ``row`` ANDed (a fresh array)."""
    out: NDArray[np.bool_] = evals[0].row(row).copy()
    for e in evals[1:]:
        out &= e.row(row)
    return out


def _admitted(core: StateCore, evals: tuple[GroupEval, ...]) -> NDArray[np.bool_] | bool:
    """Per candidate length: every group's restores fit the core-wide room together (each
    group checked only its own share), so no verdict offers a plan the admission gate would
    refuse (the caller checked the budget is capped). True where at most one group restores."""
    budget = core.restore_budget
    asking = [(e.restores_asked, e.decl.payload_bytes) for e in evals
              if e.restores_asked is not None]
    if len(asking) < 2:
        return True
    ops_room, bytes_room = budget.ops_room(), budget.bytes_room()
    fits = np.ones(asking[0][0].size, dtype=np.bool_)
    if ops_room is not None:
        fits &= np.sum([asked for asked, _ in asking], axis=0) <= ops_room
    if bytes_room is not None:
        fits &= np.sum([asked * width for asked, width in asking], axis=0) <= bytes_room
    return fits


def _group_verdict(e: GroupEval, step: int, count: int) -> GroupVerdict:
    """The group's own figures over ``count`` candidate lengths ``step`` apart."""
    largest_hit, largest_now, largest_after = e.largest
    usable, hit = largest_now * step, largest_hit * step
    restorable = largest_after * step if largest_after > largest_now else usable
    stop: Reason | None = None
    if largest_now < count - 1 and not e.holds(NOW, count - 1):
        probe = min(largest_now + 1, count - 1) * step
        if not e.servable(probe):
            stop = e.rule.unservable
        else:
            index, compressed = e.failing(probe)
            if index.size:
                stop = BY_CODE[int(e.reason_codes(index[:1], compressed[:1])[0])]
        if stop is None:
            stop = e.rule.unservable or Reason.NOT_CACHED
    decl = e.decl
    return GroupVerdict(decl.name, decl.kind, decl.block_size, hit, usable, restorable, stop)


def _boundary(layout: LookupLayout, chains: list[int], last: int, hit: int) -> Shortfall | None:
    """The block-boundary shortfall where the prefix groups' chains (in tokens) reach
    together past the hit at a finer block than the step, else None."""
    covered = min(min(chains), last)
    finest = layout.finest_prefix
    if covered // finest * finest <= hit:
        return None
    return Shortfall(Reason.BLOCK_BOUNDARY, "*", detail=(
        f"the groups' chains reach {covered} tokens together, but usable lengths are "
        f"multiples of {layout.step}, the LCM of their block sizes"))


def _shortfalls(evals: dict[str, GroupEval], length: int, usable: int) -> list[Shortfall]:
    """Every block-level reason why the prompt is not usable at ``length``: per group and
    reason its first :data:`MAX_LISTED` blocks, in block order."""
    out: list[Shortfall] = []
    if length <= usable:
        return out
    for name, e in evals.items():
        if not e.servable(length) and e.rule.unservable is not None:
            out.append(Shortfall(e.rule.unservable, name,
                                 detail=e.rule.unservable_detail(e.decl, length)))
            continue
        index, compressed = e.failing(length)
        codes = e.reason_codes(index, compressed)
        shown = listed(codes)
        if not shown.size:
            continue
        ids, n = e.ids, e.n
        for i, code in zip(index[shown].tolist(), codes[shown].tolist(), strict=True):
            why = BY_CODE[code]
            assert why is not None  # listed() leaves out code 0
            out.append(Shortfall(why, name, i, int(ids[i]) if i < n else -1))
    return out


def _plan(evals: dict[str, GroupEval], length: int) -> tuple[RestoreStep, ...]:
    """The restores (paths from the table) that make every block needed at ``length`` usable."""
    steps: list[RestoreStep] = []
    for name, e in evals.items():
        index, compressed = e.failing(length)
        if not index.size:
            continue
        ids = e.ids[index]
        table, states_at, _, _ = e.frozen()
        states = states_at[index]
        paths = e.paths
        known: dict[tuple[int, bool], tuple[str, Tier | None, tuple[Event, ...]]] = {}
        for i, block, state, residency, c in zip(
                index.tolist(), ids.tolist(), states.tolist(),
                table.residency[states].tolist(), compressed.tolist(), strict=True):
            made = known.get((state, c))
            if made is None:
                made = known[state, c] = (
                    table.state_name(state), Tier(residency) if residency >= 0 else None,
                    paths.path(state, Form.COMPRESSED if c else Form.RAW) or ())
            steps.append(RestoreStep(name, i, block, *made))
    return tuple(steps)
