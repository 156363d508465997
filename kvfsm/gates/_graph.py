"""Gate 4, static graph topology: a captured graph (a CUDA graph, a compiled step) replays only
what it was captured for.

A :class:`GraphSignature` says, per group of the model, what the captured graph reads: at most
how many blocks, from which tiers, under which layouts, and the pool it was captured against
(dtype, tokens per block, byte alignment). After a lookup, :class:`GraphRegistry` checks the
verdict's usable prefix and its restore plan against the active signature: whatever does not
fit becomes a ``Reason.GRAPH_MISMATCH`` shortfall, and the verdict is not replayable (run it
eagerly, or re-plan). The check reads the verdict and the block metadata of the blocks it
relies on, O(those blocks), and changes no state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm._reasons import Reason
from kvfsm.fsm import INVALID
from kvfsm.lookup import RestoreStep, Shortfall, Verdict
from kvfsm.lookup._why import MAX_LISTED
from kvfsm.spec import Layout, Tier
from kvfsm.spec._models import DTYPES
from kvfsm.spec._vocabulary import STORED_TIERS
from kvfsm.state import GroupState, Prompt, StateCore

#: What every graph mismatch tells the caller to do instead of replaying.
INSTEAD = "eager only, or re-plan"


class SignatureError(KvfsmError):
    """A graph signature is malformed or does not match the engine's model; nothing was
    registered."""


def _where(instance: Any) -> str:
    return f"graph group {instance.group!r}" if isinstance(instance, GroupSignature) \
        else "graph signature"


def _non_negative(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SignatureError(f"{_where(instance)}: {attribute.name} must be an int >= 0, "
                             f"got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SignatureError(f"{_where(instance)}: {attribute.name} must be an int >= 1, "
                             f"got {value!r}")


def _power_of_two(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    _positive(instance, attribute, value)
    if value & (value - 1):
        raise SignatureError(f"{_where(instance)}: {attribute.name} must be a power of two "
                             f"(bytes), got {value}")


def _name(instance: Any, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise SignatureError(f"{_where(instance)}: {attribute.name} must be a non-empty str, "
                             f"got {value!r}")


def _dtype(instance: Any, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in DTYPES:
        raise SignatureError(f"{_where(instance)}: unknown dtype {value!r}; expected one of "
                             f"{list(DTYPES)}")


def _tiers(instance: Any, attribute: attrs.Attribute[frozenset[Tier]],
           value: frozenset[Tier]) -> None:
    if not value:
        raise SignatureError(f"{_where(instance)}: tiers is empty; a graph reads at least "
                             "the device")
    for tier in value:
        if not isinstance(tier, Tier):
            raise SignatureError(f"{_where(instance)}: unknown tier {tier!r}; tiers: "
                                 f"{[t.spec_name for t in Tier]}")
        if tier in STORED_TIERS:
            raise SignatureError(f"{_where(instance)}: a kernel cannot read the stored tier "
                                 f"{tier.spec_name!r} (its copies are loaded first)")


def _layouts(instance: Any, attribute: attrs.Attribute[tuple[Layout, ...]],
             value: tuple[Layout, ...]) -> None:
    if not value:
        raise SignatureError(f"{_where(instance)}: layouts is empty")
    for layout in value:
        if not isinstance(layout, Layout):
            raise SignatureError(f"{_where(instance)}: layouts must be Layout values, "
                                 f"got {layout!r}")


def _as_layouts(value: Iterable[Layout]) -> tuple[Layout, ...]:
    return tuple(value)


def _as_groups(value: Iterable[GroupSignature]) -> tuple[GroupSignature, ...]:
    return tuple(value)


def _as_tiers(value: Iterable[Tier | str]) -> frozenset[Tier]:
    """Tiers given as :class:`Tier` or their spec names (``"device"``); others stay as given
    for the validator to name."""
    out: set[Any] = set()
    for tier in value:
        if isinstance(tier, str) and tier.upper() in Tier.__members__:
            out.add(Tier[tier.upper()])
        else:
            out.add(tier)
    return frozenset(out)


@attrs.frozen
class GroupSignature:
    """What a captured graph reads of one group."""

    #: The group's name in the model.
    group: str = attrs.field(validator=_name)
    #: The most blocks of the group the graph reads (its block table's width).
    max_blocks: int = attrs.field(validator=_non_negative)
    #: Element type of the pool the graph was captured against.
    dtype: str = attrs.field(validator=_dtype)
    #: Tokens per block (page size) the graph was captured with.
    page_size: int = attrs.field(validator=_positive)
    #: Byte alignment of the pool's blocks the graph was captured against.
    alignment: int = attrs.field(validator=_power_of_two)
    #: Layouts the graph's kernels read; a block written under another one does not fit.
    layouts: tuple[Layout, ...] = attrs.field(converter=_as_layouts,
                                                  validator=_layouts)
    #: Tiers whose pools the graph reads blocks from (a kernel reads the device).
    tiers: frozenset[Tier] = attrs.field(default=frozenset({Tier.DEVICE}), converter=_as_tiers,
                                         validator=_tiers)

    @classmethod
    def of(cls, group: GroupState, max_blocks: int) -> GroupSignature:
        """The signature of a graph captured against ``group`` as it is now (its pool, the
        layout it writes), reading at most ``max_blocks`` of its blocks from the device."""
        return cls(group.name, max_blocks, group.decl.dtype, group.decl.block_size,
                   group.pools[Tier.DEVICE].alignment, (group.layouts[group.write_layout],))


def _groups(instance: Any, attribute: attrs.Attribute[tuple[GroupSignature, ...]],
            value: tuple[GroupSignature, ...]) -> None:
    if not value:
        raise SignatureError(f"graph signature {instance.name!r}: names no group")
    seen: set[str] = set()
    for group in value:
        if not isinstance(group, GroupSignature):
            raise SignatureError(f"graph signature {instance.name!r}: groups must be "
                                 f"GroupSignature values, got {group!r}")
        if group.group in seen:
            raise SignatureError(f"graph signature {instance.name!r}: group {group.group!r} "
                                 "is named twice")
        seen.add(group.group)


@attrs.frozen
class GraphSignature:
    """The static topology a captured graph was recorded with: one :class:`GroupSignature`
    per group of the model."""

    name: str = attrs.field(validator=_name)
    groups: tuple[GroupSignature, ...] = attrs.field(converter=_as_groups,
                                                       validator=_groups)

    def group(self, name: str) -> GroupSignature:
        for group in self.groups:
            if group.group == name:
                return group
        raise KeyError(f"graph signature {self.name!r} names no group {name!r}; groups: "
                       f"{[g.group for g in self.groups]}")

    @classmethod
    def of(cls, core: StateCore, name: str, max_blocks: Mapping[str, int]) -> GraphSignature:
        """The signature of a graph captured against ``core``'s pools now, reading at most
        ``max_blocks[group]`` blocks of each group (a group not named: none)."""
        return cls(name, tuple(GroupSignature.of(group, max_blocks.get(group.name, 0))
                               for group in core.groups.values()))


@attrs.frozen
class GraphVerdict(Verdict):
    """A verdict checked against a captured graph's signature (``Engine.lookup`` returns one
    while a graph is active): ``reasons`` carries a ``GRAPH_MISMATCH`` shortfall for whatever
    does not fit."""

    #: The signature the verdict was checked against.
    graph: GraphSignature | None = None

    @property
    def replayable(self) -> bool:
        """The usable prefix and the restore plan fit the graph: it may be replayed."""
        return self.graph is not None and \
            not any(s.reason is Reason.GRAPH_MISMATCH for s in self.reasons)


def check_signature(core: StateCore, signature: GraphSignature) -> None:
    """``signature`` fits ``core``'s model: it names every group and only those, each tier it
    reads is pooled for the group, each layout is one the group knows; else a SignatureError
    naming the graph, the group and what is wrong."""
    if not isinstance(signature, GraphSignature):
        raise SignatureError(f"register a GraphSignature, got {signature!r}")
    where = f"graph signature {signature.name!r}"
    groups = core.groups
    for group in signature.groups:
        if group.group not in groups:
            raise SignatureError(f"{where}: unknown group {group.group!r}; the model "
                                 f"{core.model.name!r} has {list(groups)}")
        state = groups[group.group]
        for tier in sorted(group.tiers):
            if tier not in state.pools:
                raise SignatureError(f"{where}: group {group.group!r} has no {tier.spec_name} "
                                     f"pool; pools: {[t.spec_name for t in state.pools]}")
        for layout in group.layouts:
            if layout not in state.layouts:
                raise SignatureError(f"{where}: group {group.group!r}: unknown layout "
                                     f"{layout!r}; the group writes {state.layouts}")
    missing = [name for name in groups if name not in {g.group for g in signature.groups}]
    if missing:
        raise SignatureError(f"{where}: names no signature for groups {missing}; a forward "
                             "reads every group (give max_blocks=0 for one it reads none of)")


def _final_states(group: GroupState, states: NDArray[np.uint8], lo: int,
                  plan: Mapping[int, RestoreStep]) -> NDArray[np.uint8]:
    """The state each block ``lo + i`` is in once its plan step's path (if any) has run."""
    final = states.copy()
    table = group.table
    for index, step in plan.items():
        if lo <= index < lo + final.size:
            state = int(final[index - lo])
            for event in step.path:
                state = int(table.next_state[state, event])
                if state == INVALID:  # not a path of the table: the block is read nowhere
                    break
            final[index - lo] = state
    return final


def check_graph(core: StateCore, prompt: Prompt, verdict: Verdict,
                signature: GraphSignature) -> tuple[Shortfall, ...]:
    """Every way ``verdict``'s usable prefix or restore plan does not fit ``signature``, as
    ``GRAPH_MISMATCH`` shortfalls (none: it fits). The blocks a verdict relies on are, per
    group, those its kind needs at ``usable_tokens`` and at ``restorable_tokens``; each is read
    from the tier it sits in once its plan step has run."""
    out: list[Shortfall] = []
    lengths = np.array(sorted({verdict.usable_tokens, verdict.restorable_tokens}), np.int64)
    plan: dict[str, dict[int, RestoreStep]] = {}
    for step in verdict.plan:
        plan.setdefault(step.group, {})[step.block_index] = step
    graph = f"graph {signature.name!r}"
    for group in core.groups.values():
        name, decl = group.name, group.decl
        sig = signature.group(name)
        pool = group.pools[Tier.DEVICE]
        for what, captured, now in (("dtype", sig.dtype, decl.dtype),
                                    ("page size (tokens per block)", sig.page_size,
                                     decl.block_size),
                                    ("alignment (bytes)", sig.alignment, pool.alignment)):
            if captured != now:
                out.append(Shortfall(Reason.GRAPH_MISMATCH, name, detail=(
                    f"{graph} was captured for {what} {captured!r} of group {name!r}; its "
                    f"pool has {now!r}: {INSTEAD}")))
        need = group.rule.needed(decl, lengths)
        high, low = prompt.words(decl.block_size)
        listed = {"tier": 0, "layout": 0}
        seen: set[tuple[str, int]] = set()
        for length, lo, hi in zip(lengths.tolist(), need.lo.tolist(), need.hi.tolist(),
                                  strict=True):
            hi = min(hi, high.size)
            count = max(hi - lo, 0)
            if count > sig.max_blocks:
                out.append(Shortfall(Reason.GRAPH_MISMATCH, name, detail=(
                    f"{graph} reads at most {sig.max_blocks} blocks of group {name!r}; "
                    f"{length} tokens need {count}: {INSTEAD}")))
            if not count:
                continue
            ids = core.lookup_words(name, high[lo:hi], low[lo:hi])
            found = ids >= 0
            safe = np.where(found, ids, 0)
            final = _final_states(group, group.states[safe], lo, plan.get(name, {}))
            tier = np.where(final == INVALID, -1,
                            group.table.residency[np.where(final == INVALID, 0, final)])
            tier_ok = np.isin(tier, [int(t) for t in sig.tiers])
            layout_ok = np.array([layout in sig.layouts for layout in group.layouts],
                                 dtype=np.bool_)[group.layout_id[safe]]
            for kind, ok in (("tier", tier_ok), ("layout", layout_ok)):
                for i in np.flatnonzero(found & ~ok).tolist():
                    if listed[kind] >= MAX_LISTED:
                        break  # the kind's list is full: the rest are not read
                    index = lo + i
                    if (kind, index) in seen:
                        continue
                    seen.add((kind, index))
                    listed[kind] += 1
                    out.append(Shortfall(Reason.GRAPH_MISMATCH, name, index, int(ids[i]),
                                         detail=_block_detail(graph, group, sig, kind,
                                                              int(tier[i]), int(ids[i]))))
    return tuple(out)


def _block_detail(graph: str, group: GroupState, sig: GroupSignature, kind: str, tier: int,
                  block: int) -> str:
    if kind == "tier":
        where = Tier(tier).spec_name if tier >= 0 else "no tier"
        return (f"{graph} reads group {group.name!r} from "
                f"{sorted(t.spec_name for t in sig.tiers)}; this block is read from {where}: "
                f"{INSTEAD}")
    layout = group.layouts[int(group.layout_id[block])]
    return f"{graph} reads layouts {list(sig.layouts)}; this block is {layout}: {INSTEAD}"


class GraphRegistry:
    """The graph signatures an engine knows, and the one its lookups are checked against."""

    def __init__(self, core: StateCore) -> None:
        self._core = core
        self._graphs: dict[str, GraphSignature] = {}
        self._active: GraphSignature | None = None

    @property
    def graphs(self) -> Mapping[str, GraphSignature]:
        """Registered signatures by name (read-only)."""
        return MappingProxyType(self._graphs)

    @property
    def active(self) -> GraphSignature | None:
        return self._active

    def register(self, signature: GraphSignature) -> None:
        """Add ``signature``; a malformed one, one not matching the model, or a name already
        registered is a SignatureError and registers nothing."""
        check_signature(self._core, signature)
        if signature.name in self._graphs:
            raise SignatureError(f"graph signature {signature.name!r} is already registered")
        self._graphs[signature.name] = signature

    def activate(self, name: str | None) -> None:
        """Check later lookups against the graph ``name`` (None: no graph, eager)."""
        if name is not None and not isinstance(name, str):
            raise SignatureError(f"activate_graph takes a graph's name (a str) or None, got "
                                 f"{type(name).__name__}")
        if name is not None and name not in self._graphs:
            raise SignatureError(f"no graph signature {name!r}; registered: "
                                 f"{sorted(self._graphs)}")
        self._active = None if name is None else self._graphs[name]

    def apply(self, prompt: Prompt, verdict: Verdict) -> Verdict:
        """``verdict`` checked against the active graph (unchanged when none is active)."""
        signature = self._active
        if signature is None:
            return verdict
        fields = attrs.asdict(verdict, recurse=False)
        fields["reasons"] = verdict.reasons + check_graph(self._core, prompt, verdict,
                                                          signature)
        fields["graph"] = signature
        return GraphVerdict(**fields)

    def replayable(self, verdict: Verdict) -> bool:
        """``verdict`` was checked against the active graph and fits it."""
        return isinstance(verdict, GraphVerdict) and verdict.graph is not None and \
            verdict.graph == self._active and verdict.replayable
