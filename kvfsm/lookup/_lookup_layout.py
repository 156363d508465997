"""What every lookup of one core reads of its model, made once per core, and the probe a lookup
leaves on its verdict for a lease.

:class:`LookupLayout` holds the groups in lookup order with their declarations and statics
caches, the candidate lengths' step, and per prompt length the groups' spans (a serving load
repeats prompt lengths). :func:`make_probe` keeps, per group, the pass output a lease reads
its blocks from, and makes per-group views only when asked.
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

#: Entries a lookup cache keeps before it starts again (spans by prompt length, shared
#: values).
MAX_CACHED: Final = 4096
#: The key of a core's :class:`LookupLayout` in its ``caches``.
_LAYOUT_KEY = "verify.lookup.layout"

def candidates(count: int, step: int) -> NDArray[np.int64]:
    """``[0, step, 2 * step, ...]``, ``count`` of them (read-only: kept by
    :meth:`LookupLayout.spans_at` for every lookup of a prompt length)."""
    lengths = np.arange(count, dtype=np.int64) * step
    lengths.flags.writeable = False
    return lengths


#: A group as a lookup of a given prompt length reads it: its state, declaration, the position
#: of the group its blocks point into (-1: none), its statics cache and its spans.
Row = tuple[GroupState, GroupDecl, int, StaticsCache, Spans]
#: Per group: its name, its kind's name and its block size (:attr:`LookupLayout.held_key`).
HeldKey = tuple[tuple[str, str, int], ...]


class LookupLayout:
    """What every lookup of one core reads of its model (fixed at the core's making): the
    groups in lookup order (a group whose blocks point into another after it), each with its
    declaration, the name of the group it points into (None: none) and its statics cache,
    the block sizes a prompt must keep and their LCM, which groups' hash chains are prefixes
    (for the block-boundary reason), and a weak reference to the core (for probes)."""

    __slots__ = ("__weakref__", "block_sizes", "boundary", "by_length", "change_count", "core",
                 "finest_prefix", "groups", "held_key", "names", "order", "prefix_at", "step")

    def __init__(self, core: StateCore) -> None:
        self.core = weakref.ref(core)
        #: The core's count of changes to any group (read once per lookup, for its probe).
        self.change_count = core.change_count
        self.order = tuple(sorted(core.groups.values(), key=lambda g: g.rule.has_targets))
        statics: tuple[StaticsCache, ...] = tuple({} for _ in self.order)
        names = [group.decl.name for group in self.order]
        #: The groups' names in lookup order (one tuple for every probe of this core).
        self.names = tuple(names)
        #: Per group in lookup order: its name, its kind's name and its block size, the values
        #: a group verdict holding to a length is made of (strings and ints: a key that hashes
        #: in C, unlike an enum member).
        self.held_key: HeldKey = tuple((group.decl.name, group.decl.kind.name,
                                        group.decl.block_size) for group in self.order)
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
        #: what a lease reads of those spans (made by :meth:`spans_at`; a lookup reads them
        #: here first, a call fewer).
        self.by_length: dict[int, tuple[NDArray[np.int64], tuple[Row, ...], LeaseSpans]] = {}

    def spans_at(self, n_tokens: int, count: int, keep: bool = True
                 ) -> tuple[NDArray[np.int64], tuple[Row, ...], LeaseSpans]:
        """The ``count`` candidate lengths of a prompt of ``n_tokens``; per group in lookup
        order its row of :attr:`groups` with its spans over them added, for the blocks such a
        prompt has; and every group's bounds and output offsets (:func:`lease_spans_of`: what a
        lease's one-pass take reads of the spans). Cached by ``n_tokens`` where ``keep`` (the
        count a prompt of that length has; a capped lookup's fewer are not kept)."""
        known = self.by_length.get(n_tokens) if keep else None
        if known is None:
            lengths = candidates(count, self.step)
            rows = tuple(
                (group, decl, target_at, known_here,
                 spans_for(group, n_tokens // decl.block_size, lengths, self.step))
                for group, decl, target_at, known_here in self.groups)
            known = (lengths, rows, lease_spans_of(self.names, [row[4] for row in rows]))
            if keep:
                if len(self.by_length) >= MAX_CACHED:
                    self.by_length.clear()
                self.by_length[n_tokens] = known
        return known


def lease_spans_of(names: tuple[str, ...], spans: list[Spans]) -> LeaseSpans:
    """Per group in lookup order, the first and the end prompt block it needs at each
    candidate length (``bounds[g, 0]``, ``bounds[g, 1]``), and where its pass output holds
    ids, epochs and the count of blocks that are one run at one epoch (``offsets[g]``): what
    a lease's one-pass take reads of the spans, in two arrays (read-only)."""
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


#: Per group, what a lookup's probe keeps of it: its name, spans, pass output, hash words and
#: change count at the lookup.
Found = tuple[str, Spans, NDArray[np.int64], tuple[NDArray[np.uint64], NDArray[np.uint64]], int]


class LookupProbe(Probe):
    """A lookup's :class:`Probe`: its per-group views are made from its pass outputs
    (``passes``) at its candidate ``at`` when a lease first asks for them (most leases read
    the outputs directly; many verdicts are never leased). Made by :func:`make_probe` without
    the base class's keyword constructor or a closure per lookup (a third of a microsecond
    of a short prompt's lookup)."""

    __slots__ = ()

    @property
    def groups(self) -> tuple[ProbedGroup, ...]:
        made = self._groups
        if made is None:
            made = self._groups = _probed_groups(self.passes or (), self.at)
        return made


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


def make_probe(layout: LookupLayout, prompt: Prompt, found: list[Found], at: int, tokens: int,
           lease_spans: LeaseSpans) -> Probe:
    """Per group, the blocks needed at candidate ``at`` (``tokens`` long), as found: until a
    lease asks, the verdict keeps only each group's pass output, with its ids and epochs,
    its hash words and needed spans, not the lookup's other arrays."""
    probe = _new_probe(LookupProbe)
    probe.core, probe.tokens, probe.prompt, probe.exact = layout.core, tokens, prompt, True
    probe.passes, probe.at, probe.spans = found, at, lease_spans
    # The core's change count now: a lease finding it unchanged needs no second look.
    probe.changes = layout.change_count.total
    probe._groups = probe._make = None
    return probe


#: The pass output holds ids as int64; where that is not ``intp`` they are viewed as it.
_IDS_VIEWED: Final = np.dtype(np.intp) != np.dtype(np.int64)


__all__ = ["MAX_CACHED", "Found", "HeldKey", "LookupLayout", "Row", "candidates", "layout_of",
           "lease_spans_of", "make_probe"]
