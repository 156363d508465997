"""What every lookup of one core reads of its model (:class:`LookupLayout`, made once per core),
and the probe a lookup leaves on its verdict for a lease (:func:`make_probe`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvfsm.lookup._spans import Spans, spans_for
from kvfsm.lookup._statics import StaticsCache
from kvfsm.lookup._types import LeaseSpans, Probe, ProbedGroup
from kvfsm.spec import GroupDecl
from kvfsm.state import GroupState, StateCore
from kvfsm.state._prompt import Prompt

#: Entries a lookup cache keeps before it starts again.
MAX_CACHED: Final = 4096
_LAYOUT_KEY = "verify.lookup.layout"

def candidates(count: int, step: int) -> NDArray[np.int64]:
    """``count`` lengths ``[0, step, 2 * step, ...]``, read-only (shared per prompt length)."""
    lengths = np.arange(count, dtype=np.int64) * step
    lengths.flags.writeable = False
    return lengths


#: A group as a lookup of one prompt length reads it: state, declaration, its target group's
#: position (-1: none), statics cache and spans.
Row = tuple[GroupState, GroupDecl, int, StaticsCache, Spans]
#: Per group: its name, its kind's name and its block size (:attr:`LookupLayout.held_key`).
HeldKey = tuple[tuple[str, str, int], ...]


class LookupLayout:
    """What every lookup of one core reads of its model: the groups in lookup order (an index
    after its target), the block sizes and their LCM, the prefix groups, a weak reference."""

    __slots__ = ("__weakref__", "block_sizes", "boundary", "by_length", "change_count", "core",
                 "finest_prefix", "groups", "held_key", "names", "order", "prefix_at", "step")

    def __init__(self, core: StateCore) -> None:
        self.core = weakref.ref(core)
        self.change_count = core.change_count
        self.order = tuple(sorted(core.groups.values(), key=lambda g: g.rule.has_targets))
        statics: tuple[StaticsCache, ...] = tuple({} for _ in self.order)
        names = [group.decl.name for group in self.order]
        #: The groups' names in lookup order (one tuple: leases compare it by identity).
        self.names = tuple(names)
        self.held_key: HeldKey = tuple((group.decl.name, group.decl.kind.name,
                                        group.decl.block_size) for group in self.order)
        #: Per group: a :data:`Row` without spans (a sparse index never targets another).
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
        #: :meth:`spans_at`'s answers by prompt length in tokens.
        self.by_length: dict[int, tuple[NDArray[np.int64], tuple[Row, ...], LeaseSpans]] = {}

    def spans_at(self, n_tokens: int, count: int, keep: bool = True
                 ) -> tuple[NDArray[np.int64], tuple[Row, ...], LeaseSpans]:
        """The ``count`` candidate lengths of a prompt of ``n_tokens``, each group's :data:`Row`
        and :func:`lease_spans_of` them; cached by ``n_tokens`` where ``keep`` (not capped)."""
        known = self.by_length.get(n_tokens) if keep else None
        if known is None:
            lengths = candidates(count, self.step)
            rows = tuple(
                (group, decl, target_at, known_here,
                 spans_for(group, n_tokens // decl.block_size, lengths))
                for group, decl, target_at, known_here in self.groups)
            known = (lengths, rows, lease_spans_of(self.names, [row[4] for row in rows]))
            if keep:
                if len(self.by_length) >= MAX_CACHED:
                    self.by_length.clear()
                self.by_length[n_tokens] = known
        return known


def lease_spans_of(names: tuple[str, ...], spans: list[Spans]) -> LeaseSpans:
    """What a take reads of the spans, read-only: per group the first and end prompt block at
    each length (``bounds[g, 0]``, ``bounds[g, 1]``), and its output's word offsets of ids,
    epochs and ONE_RUN_BLOCKS (``offsets[g]``)."""
    bounds = np.stack([each.bounds[::2] for each in spans])
    offsets = np.stack([each.out_words for each in spans])
    bounds.flags.writeable = offsets.flags.writeable = False
    return LeaseSpans(names, bounds, offsets)


def layout_of(core: StateCore) -> LookupLayout:
    """The core's :class:`LookupLayout` (kept in the core's ``caches``)."""
    known = core.caches.get(_LAYOUT_KEY)
    if not isinstance(known, LookupLayout):
        known = LookupLayout(core)
        core.caches[_LAYOUT_KEY] = known
    return known


#: Per group, what a probe keeps: name, spans, pass output, hash words, change count.
Found = tuple[str, Spans, NDArray[np.int64], tuple[NDArray[np.uint64], NDArray[np.uint64]], int]


class LookupProbe(Probe):
    """A lookup's :class:`Probe` (:func:`make_probe`); its groups' views are made when read."""

    __slots__ = ("at", "outs", "passes", "spans")
    exact = True
    #: Per group ``(name, spans, pass output, words, changes)``, read at candidate ``at``;
    #: ``outs``: the pass outputs.
    passes: Sequence[Found]
    outs: tuple[NDArray[np.int64], ...]
    spans: LeaseSpans
    at: int

    @property
    def groups(self) -> tuple[ProbedGroup, ...]:
        made = self._groups
        if made is None:
            made = self._groups = _probed_groups(self.passes, self.at)
        return made

    def changed(self, g: int, state: GroupState) -> bool:
        """Group ``g`` (``state``) changed since the lookup."""
        _, _, _, _, changes = self.passes[g]
        return state.changes != changes


def _probed_groups(found: Sequence[Found], at: int) -> tuple[ProbedGroup, ...]:
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


def make_probe(layout: LookupLayout, prompt: Prompt, found: list[Found],
               outs: tuple[NDArray[np.int64], ...], at: int, tokens: int,
               lease_spans: LeaseSpans) -> Probe:
    """The probe of the blocks needed at candidate ``at`` (``tokens`` long)."""
    probe = _new_probe(LookupProbe)
    probe.core, probe.tokens, probe.prompt = layout.core, tokens, prompt
    probe.passes, probe.outs, probe.at, probe.spans = found, outs, at, lease_spans
    # A lease finding this count unchanged needs no second look.
    probe.changes = layout.change_count.total
    probe._groups = None
    return probe


#: The pass output holds ids as int64; where that is not ``intp`` they are viewed as it.
_IDS_VIEWED: Final = np.dtype(np.intp) != np.dtype(np.int64)


__all__ = ["MAX_CACHED", "Found", "HeldKey", "LookupLayout", "Row", "candidates", "layout_of",
           "lease_spans_of", "make_probe"]
