"""``lookup``: from a prompt's block hashes to a :class:`Verdict` (hit is not usable).

Per group a boolean "usable at L" over candidate lengths L (multiples of the LCM of the block
sizes, below the prompt's last token); AND across groups; the largest L wins. A speculative-
decoding drop of the last block is applied once, on the final vector: there is no loop in which
groups shrink each other's candidates.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.spec import Event, Form, GroupDecl, Layout, Tier
from kvfsm.state import GroupState, StateCore
from kvfsm.verify._explained import Explanation, explained_later
from kvfsm.verify._group_eval import GroupEval, evaluate
from kvfsm.verify._group_pass import AFTER, HIT, NOW
from kvfsm.verify._prompt import Prompt
from kvfsm.verify._spans import Spans, spans_for
from kvfsm.verify._statics import Statics, statics_for
from kvfsm.verify._types import (
    Checks,
    DeviceProfile,
    GroupVerdict,
    KernelLayouts,
    LeaseSpans,
    Level,
    Probe,
    ProbedGroup,
    Reason,
    RestoreStep,
    Shortfall,
    Verdict,
)
from kvfsm.verify._why import BY_CODE, listed

_DEFAULT_PROFILE = DeviceProfile()
#: The key of a core's :class:`_Layout` in its ``caches``.
_LAYOUT_KEY = "verify.lookup.layout"
#: Candidate lengths by (count, step), shared read-only: most prompts of a serving load have
#: a few hundred distinct lengths.
_CANDIDATES: dict[tuple[int, int], NDArray[np.int64]] = {}
_MAX_CACHED = 4096


def _candidates(count: int, step: int) -> NDArray[np.int64]:
    """``[0, step, 2 * step, ...]``, ``count`` of them (read-only, cached)."""
    key = (count, step)
    lengths = _CANDIDATES.get(key)
    if lengths is None:
        if len(_CANDIDATES) >= _MAX_CACHED:
            _CANDIDATES.clear()
        lengths = np.arange(count, dtype=np.int64) * step
        lengths.flags.writeable = False
        _CANDIDATES[key] = lengths
    return lengths


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
) -> Verdict:
    """How much of ``prompt`` the core can serve now, after restores, and why not more.

    A lookup writes no state: the checksums it computed are in ``Verdict.checks`` for the
    caller to record (:meth:`StateCore.record_checks`; :class:`~kvfsm.Engine` does).
    ``checksums=False`` leaves out the data checksums of layer 1 (for measuring the metadata
    path alone); every other check still runs.
    """
    if level.__class__ is not Level:
        level = as_level(level)
    if kernel_layouts:
        check_kernel_layouts(core, kernel_layouts)
    layout = _layout_of(core)
    prompt.check_made_for(core.seed, layout.block_sizes, "engine")
    if profile is None:
        profile = _DEFAULT_PROFILE
    n_tokens = prompt.n_tokens
    last = n_tokens - 1 if n_tokens > 1 else 0  # the last prompt token is always computed
    step = layout.step
    count = last // step + 1
    lengths, rows, cached_spans = layout.spans_at(n_tokens, count)
    lease_spans: LeaseSpans | None = cached_spans
    capped = core.restore_budget.capped
    made: list[GroupEval] = []
    # Groups whose blocks point into another group come after it (the index check reads the
    # prompt's blocks of the target group, ``made[target_at]``).
    for group, decl, target_at, known_here, spans in rows:
        high, low = prompt.words(decl.block_size)
        reads = (kernel_layouts.get(decl.name) if kernel_layouts else None) or decl.layout
        if spans.n != high.size:  # the prompt's words end before its tokens: spans of its own
            spans = spans_for(group, high.size, lengths, step)
            lease_spans = None
        made.append(evaluate(
            group, high, low, lengths, level, profile,
            made[target_at] if target_at >= 0 else None, checksums, spans,
            statics_for(group, reads, profile, known_here), capped))
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
    restorable_at = max(restorable_at, usable_at)
    # Candidate index i is i * step tokens.
    usable, restorable, hit = usable_at * step, restorable_at * step, hit_at * step
    final = (count - 1) * step
    # What each group's hash chain covers on its own, in tokens (prefix kinds only).
    if layout.boundary:
        covered = min(min([every[i].chain_tokens for i in layout.prefix_at]), last)
        finest = layout.finest_prefix
        if covered // finest * finest > hit:
            reasons.append(Shortfall(Reason.BLOCK_BOUNDARY, "*", detail=(
                f"the groups' chains reach {covered} tokens together, but usable lengths are "
                f"multiples of {step}, the LCM of their block sizes")))
    if hit == final and hit > 0:
        reasons.append(_prompt_end(hit))
    # Something to explain (a shortfall, a plan): each group's stop, the reasons and the plan
    # are made when first read, from the pass outputs and a snapshot taken now.
    explain = usable < final or restorable > usable
    # One loop over the groups (not one per thing made of them): each group's figures, the
    # checksums it computed, and what a lease reads of it (its name, spans, pass output and
    # hash words, and its change count now: a lease finding it unchanged needs no second look).
    groups, checks, found = [], [], []
    for e in every:
        if not explain:
            groups.append(_group_verdict(e, step, count))
        checked = e.checked
        if checked is not None:
            checks.append(Checks(e.decl.name, *checked))
        found.append((e.decl.name, e.spans, e._out, e.words, e.group.changes))
    if lease_spans is None:
        lease_spans = _lease_spans(layout.names, [e.spans for e in every])
    probe = _probe(layout, prompt, found, usable_at, usable, lease_spans)
    if explain:
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
    # Positional: the fields in declaration order (cheaper than keywords on every lookup).
    return Verdict(n_tokens, hit, usable, restorable, usable, level, tuple(groups),
                   tuple(reasons), (), tuple(checks), probe)


def _explain(every: tuple[GroupEval, ...], step: int, count: int, hit: int, final: int,
             usable: int, restorable: int, head: tuple[Shortfall, ...]) -> Explanation:
    """A verdict's groups, reasons (after ``head``, the prompt-level ones) and plan, from its
    groups' evaluations (frozen at the lookup): why not the hit, and why not the whole prompt
    (the windows of the two differ), each block named once."""
    evals = {e.decl.name: e for e in every}
    reasons = list(head)
    if usable < final:
        at_hit = _shortfalls(evals, hit, usable)  # none where the hit is usable
        reasons += at_hit
        if final != hit:
            at_final = _shortfalls(evals, final, usable)
            if at_hit:  # each block named once (hashing a shortfall is not free)
                named = set(at_hit)
                at_final = [shortfall for shortfall in at_final if shortfall not in named]
            reasons += at_final
    groups = tuple([_group_verdict(e, step, count) for e in every])
    plan = _plan(evals, restorable) if restorable > usable else ()
    return groups, tuple(reasons), plan


@functools.lru_cache(maxsize=_MAX_CACHED)
def _prompt_end(hit: int) -> Shortfall:
    """The shortfall of a prompt hit at every candidate length (a value: shared)."""
    return Shortfall(Reason.PROMPT_END, "*", detail=(
        f"every candidate length hit; tokens from {hit} on are computed, the last one for its "
        "logits"))


#: A group as a lookup of a given prompt length reads it: its state, declaration, the position
#: of the group its blocks point into (-1: none), its statics cache and its spans.
_Row = tuple[GroupState, GroupDecl, int, dict[tuple[int, int], Statics], Spans]


class _Layout:
    """What every lookup of one core reads of its model (fixed at the core's making): the
    groups in lookup order (a group whose blocks point into another after it), each with its
    declaration, the name of the group it points into (None: none) and its statics cache,
    the block sizes a prompt must keep and their LCM, which groups' hash chains are prefixes
    (for the block-boundary reason), and a weak reference to the core (for probes)."""

    __slots__ = ("__weakref__", "_spans", "block_sizes", "boundary", "change_count", "core",
                 "finest_prefix", "groups", "names", "order", "prefix_at", "step")

    def __init__(self, core: StateCore) -> None:
        self.core = weakref.ref(core)
        #: The core's count of changes to any group (read once per lookup, for its probe).
        self.change_count = core.change_count
        self.order = tuple(sorted(core.groups.values(), key=lambda g: g.rule.has_targets))
        statics: tuple[dict[tuple[int, int], Statics], ...] = tuple({} for _ in self.order)
        names = [group.decl.name for group in self.order]
        #: The groups' names in lookup order (one tuple for every probe of this core).
        self.names = tuple(names)
        #: Per group in lookup order: its state, its declaration, the position in this order
        #: of the group its blocks point into (-1: none; always an earlier one: a model's
        #: sparse index may not point into another sparse index) and its
        #: statics cache.
        self.groups = tuple(
            (group, group.decl,
             names.index(group.decl.target_group) if group.decl.target_group else -1,
             known_here)
            for group, known_here in zip(self.order, statics, strict=True))
        self.block_sizes = tuple(sorted({g.block_size for g in core.model.groups}))
        self.step = core.model.lcm_block_size
        self.prefix_at = tuple(i for i, g in enumerate(self.order) if g.rule.prefix_hit)
        self.finest_prefix = min((self.order[i].decl.block_size for i in self.prefix_at),
                                 default=0)
        #: A prefix group's chain may reach past the last candidate length it covers.
        self.boundary = bool(self.prefix_at) and self.step > self.finest_prefix
        #: By prompt length in tokens: the candidate lengths, each group's spans over them
        #: (a serving load repeats prompt lengths; one look-up instead of one per group), and
        #: what a lease reads of those spans.
        self._spans: dict[int, tuple[NDArray[np.int64], tuple[_Row, ...], LeaseSpans]] = {}

    def spans_at(self, n_tokens: int, count: int
                 ) -> tuple[NDArray[np.int64], tuple[_Row, ...], LeaseSpans]:
        """The ``count`` candidate lengths of a prompt of ``n_tokens``; per group in lookup
        order its row of :attr:`groups` with its spans over them added, for the blocks such a
        prompt has; and every group's bounds and output offsets (:func:`_lease_spans`: what a
        lease's one-pass take reads). Cached."""
        known = self._spans.get(n_tokens)
        if known is None:
            if len(self._spans) >= _MAX_CACHED:
                self._spans.clear()
            lengths = _candidates(count, self.step)
            rows = tuple(
                (group, decl, target_at, known_here,
                 spans_for(group, n_tokens // decl.block_size, lengths, self.step))
                for group, decl, target_at, known_here in self.groups)
            known = self._spans[n_tokens] = (lengths, rows, _lease_spans(
                self.names, [row[4] for row in rows]))
        return known


def _lease_spans(names: tuple[str, ...], spans: list[Spans]) -> LeaseSpans:
    """Per group in lookup order, the first and the end prompt block it needs at each
    candidate length (``bounds[g, 0]``, ``bounds[g, 1]``), and where its pass output holds
    ids, epochs and the count of blocks that are one run at one epoch (``offsets[g]``): what
    a lease's one-pass take reads of the spans, in two arrays (read-only)."""
    bounds = np.stack([each.bounds[::2] for each in spans])
    offsets = np.stack([each.out_words for each in spans])
    bounds.flags.writeable = offsets.flags.writeable = False
    return LeaseSpans(names, bounds, offsets)


#: The layout last asked for and its core, both weakly: most processes serve one engine,
#: whose lookups then skip the core's caches; a dropped engine is not kept.
_LAST_LAYOUT: tuple[weakref.ref[StateCore], weakref.ref[_Layout]] | None = None


def _layout_of(core: StateCore) -> _Layout:
    """The core's :class:`_Layout` (kept in the core's ``caches``)."""
    global _LAST_LAYOUT
    last = _LAST_LAYOUT
    if last is not None and last[0]() is core:
        layout = last[1]()
        if layout is not None:
            return layout
    known = core.caches.get(_LAYOUT_KEY)
    if not isinstance(known, _Layout):
        known = _Layout(core)
        core.caches[_LAYOUT_KEY] = known
    _LAST_LAYOUT = (known.core, weakref.ref(known))
    return known


def _common_lasts(evals: tuple[GroupEval, ...]) -> tuple[int, int, int]:
    """Per per-length row (HIT, NOW, AFTER): the last candidate index where every group's
    row holds (0 when none). No group's holds past its own last, so where all hold at the
    least of those, that is it; else the rows (not prefixes: windows, snapshots) are ANDed."""
    first = evals[0].largest
    for e in evals:
        if e.largest != first:
            break
    else:
        return first  # each holds at its own last (or all are 0): the common case
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
    """The groups' per-length rows ``row`` ANDed (a fresh array)."""
    out: NDArray[np.bool_] = evals[0].row(row).copy()
    for e in evals[1:]:
        out &= e.row(row)
    return out


#: Per group, what a lookup's probe keeps of it: its name, spans, pass output, hash words and
#: change count at the lookup.
_Found = tuple[str, Spans, NDArray[np.int64], tuple[NDArray[np.uint64], NDArray[np.uint64]], int]


class _LookupProbe(Probe):
    """A lookup's :class:`Probe`: its per-group views are made from its pass outputs
    (``passes``) at its candidate ``at`` when a lease first asks for them (most leases read
    the outputs directly; many verdicts are never leased). Made by :func:`_probe` without
    the base class's keyword constructor or a closure per lookup (a third of a microsecond
    of a short prompt's lookup)."""

    __slots__ = ()

    @property
    def groups(self) -> tuple[ProbedGroup, ...]:
        made = self._groups
        if made is None:
            made = self._groups = _probed_groups(self.passes or (), self.at)
        return made


def _probed_groups(found: Sequence[_Found], at: int) -> tuple[ProbedGroup, ...]:
    """Per group, the blocks needed at candidate ``at``, as its pass output holds them."""
    made = []
    for name, spans, out, (high, low), changes in found:
        lo, cut, hi = spans.bounds[:, at].tolist()
        ids_at, epochs_at, bytes_at, _ = spans.out_at
        ids = out[ids_at + lo : ids_at + hi]
        if _IDS_VIEWED:
            ids = ids.view(np.intp)
        epochs = out[epochs_at:bytes_at].view(np.uint32)[lo:hi]
        last_words = (high.item(hi - 1), low.item(hi - 1)) if hi > lo else None
        made.append(ProbedGroup(name, lo, cut, hi, ids, epochs, last_words, changes))
    return tuple(made)


_new_probe = object.__new__


def _probe(layout: _Layout, prompt: Prompt, found: list[_Found], at: int, tokens: int,
           lease_spans: LeaseSpans) -> Probe:
    """Per group, the blocks needed at candidate ``at`` (``tokens`` long), as found: until a
    lease asks, the verdict keeps only each group's pass output, with its ids and epochs,
    its hash words and needed spans, not the lookup's other arrays."""
    probe = _new_probe(_LookupProbe)
    probe.core, probe.tokens, probe.prompt, probe.exact = layout.core, tokens, prompt, True
    probe.passes, probe.at, probe.spans = found, at, lease_spans
    # The core's change count now: a lease finding it unchanged needs no second look.
    probe.changes = layout.change_count.total
    probe._groups = probe._make = None
    return probe


#: The pass output holds ids as int64; where that is not ``intp`` they are viewed as it.
_IDS_VIEWED: Final = np.dtype(np.intp) != np.dtype(np.int64)


def _admitted(core: StateCore, evals: tuple[GroupEval, ...]) -> NDArray[np.bool_] | bool:
    """Per candidate length: the restores every group's plan begins there fit, together, the
    core-wide room in operations and bytes (each group checked its own share alone), so the
    verdict never offers a plan the admission gate would refuse. True where nothing is capped
    or at most one group restores."""
    budget = core.restore_budget
    if not budget.capped:
        return True
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
            first = e.first_failing(probe)
            if first is not None:
                stop = e.reason(*first)
        if stop is None:
            stop = e.rule.unservable or Reason.NOT_CACHED
    # A value: shared between the group's verdicts (kept with its statics, which are the
    # group's own: no other declaration can hit them).
    known_here = e.verdicts
    key = (hit, usable, restorable, stop)
    known = known_here.get(key)
    if known is None:
        if len(known_here) >= _MAX_CACHED:
            known_here.clear()
        decl = e.decl
        known = known_here[key] = GroupVerdict(decl.name, decl.kind, decl.block_size, hit,
                                               usable, restorable, stop)
    return known


def _shortfalls(evals: dict[str, GroupEval], length: int, usable: int) -> list[Shortfall]:
    """Every block-level reason why the prompt is not usable at ``length`` (the hit): per
    group and reason its first :data:`MAX_LISTED` blocks, in block order (every failing
    block classified at once: a miss of thousands of blocks lists a few dozen)."""
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
    """The restores (paths from the table) that make every block needed at ``length`` usable:
    the blocks' states in one gather, each distinct state's path, name and tier once."""
    steps: list[RestoreStep] = []
    for name, e in evals.items():
        index, compressed = e.failing(length)
        if not index.size:
            continue
        ids = e.ids[index]
        table, states_at, _, _ = e.frozen()
        states = states_at[index]
        paths = e.paths
        # Per (state, needed compressed): the step's state name, tier and path.
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
