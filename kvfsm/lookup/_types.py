"""The values a lookup answers with: reasons, per-group detail, the restore plan, the verdict."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import NamedTuple

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm import _args
from kvfsm._errors import KvfsmError
from kvfsm._reasons import MAX_LISTED
from kvfsm._reasons import Reason as Reason  # re-exported: reasons live below the kinds
from kvfsm.spec import Event, GroupKind, Layout, Tier


class Level(enum.Enum):
    """How much verification a lookup does. Reduced levels skip only provably redundant work."""

    #: Every layer on every block, checksums recomputed over the device bytes.
    FULL = "full"
    #: Checksums only of blocks not already verified at their current epoch.
    STANDARD = "standard"
    #: As STANDARD, and the alignment layer is skipped where the pools guarantee it by
    #: construction (pool alignment a multiple of the profile's).
    FAST = "fast"


def _alignment(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _args.positive(f"DeviceProfile.{attribute.name}", value)


def _profile_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise KvfsmError(f"DeviceProfile.name must be a non-empty str, got {value!r}")


@attrs.frozen
class DeviceProfile:
    """What the hardware demands of a block the kernel reads."""

    name: str = attrs.field(default="gpu", validator=_profile_name)
    #: Every block's first byte must sit at a multiple of this.
    base_alignment: int = attrs.field(default=256, validator=_alignment)
    #: Every block's stride must be a multiple of this.
    size_alignment: int = attrs.field(default=16, validator=_alignment)


@attrs.frozen
class Shortfall:
    """One reason, where it applies: the group, the block index in the prompt and its id."""

    reason: Reason
    group: str
    block_index: int = -1
    block_id: int = -1
    detail: str = ""


@attrs.frozen
class RestoreStep:
    """Make one block usable: fire ``path`` (derived from the lifecycle table) on it."""

    group: str
    block_index: int
    block_id: int
    state: str
    tier: Tier | None
    path: tuple[Event, ...]


@attrs.frozen
class GroupVerdict:
    name: str
    kind: GroupKind
    block_size: int
    #: Contiguous hash hit of this group alone, in tokens.
    hit_tokens: int
    #: Largest candidate length this group alone can serve now / after restores.
    usable_tokens: int
    restorable_tokens: int
    #: Why this group stops where it does (None when it covers the whole candidate range).
    stop: Reason | None


@attrs.frozen(eq=False)
class Checks:
    """The checksums one lookup computed over one group's blocks, for the core to record."""

    group: str
    block_ids: NDArray[np.intp]
    passed: NDArray[np.bool_]


class ProbedGroup(NamedTuple):
    """What a lookup saw of one group at the verdict's usable length: prompt blocks ``[lo,
    hi)`` (``[lo, cut)`` read compressed, ``[cut, hi)`` raw), their ids and epochs, and the
    hash words of block ``hi - 1`` (equal words: the same prefix). Compared by identity."""

    group: str
    lo: int
    cut: int
    hi: int
    ids: NDArray[np.intp]
    epochs: NDArray[np.uint32]
    last_words: tuple[int, int] | None
    #: The group's ``changes`` at the lookup (-1: not known).
    changes: int = -1

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)


class LeaseSpans(NamedTuple):
    """What a lease's take reads of a lookup's spans (read-only, shared per prompt length)."""

    names: tuple[str, ...]
    bounds: NDArray[np.int64]
    offsets: NDArray[np.int64]


class Probe:
    """The blocks a verdict called usable, as its lookup found them: ``core`` a weak reference
    to the core, ``prompt`` the prompt looked up, ``groups`` what it saw of each group.
    ``exact``: made by a lookup, whose lease pins the blocks in one pass while the core's change
    count is still ``changes`` (-1 here); a probe made by hand is leased through a new lookup."""

    __slots__ = ("_groups", "changes", "core", "prompt", "tokens")
    exact = False

    def __init__(self, core: Callable[[], object], tokens: int,
                 groups: tuple[ProbedGroup, ...], prompt: object = None) -> None:
        self.core, self.tokens, self.prompt, self.changes = core, tokens, prompt, -1
        self._groups: tuple[ProbedGroup, ...] | None = groups

    @property
    def groups(self) -> tuple[ProbedGroup, ...]:
        assert self._groups is not None
        return self._groups

    def __repr__(self) -> str:
        return f"Probe(tokens={self.tokens})"


# Not slotted: ExplainedLater fills fields in the instance's __dict__.
@attrs.frozen(slots=False)
class Verdict:
    """The answer to "can this prefix be reused right now, after which restores, or not"."""

    prompt_tokens: int
    #: The classic prefix-hash hit (every group's hash chain present), what other engines report.
    hit_tokens: int
    #: Reusable right now: every group agrees, every layer passed.
    usable_tokens: int
    #: Reusable after executing ``plan``.
    restorable_tokens: int
    #: First token to compute when not waiting for restores (== usable_tokens).
    recompute_from: int
    level: Level
    groups: tuple[GroupVerdict, ...]
    reasons: tuple[Shortfall, ...]
    plan: tuple[RestoreStep, ...]
    #: Checksums computed by this lookup (``Engine.lookup`` records them).
    checks: tuple[Checks, ...] = attrs.field(default=(), repr=False, eq=False)
    #: The usable blocks as the lookup found them (None: made by hand; a lease looks up again).
    probe: Probe | None = attrs.field(default=None, repr=False, eq=False)

    def group(self, name: str) -> GroupVerdict:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"no group {name!r} in this verdict; groups: "
                       f"{[group.name for group in self.groups]}")

    def summary(self) -> str:
        """A few lines for a person: the numbers, the reasons by count, the plan's size."""
        head = (f"Verdict({self.level.name}): {self.prompt_tokens} prompt tokens, hit "
                f"{self.hit_tokens}, usable {self.usable_tokens}, restorable "
                f"{self.restorable_tokens}")
        lines = [head]
        counts: dict[tuple[Reason, str], int] = {}
        for shortfall in self.reasons:
            key = (shortfall.reason, shortfall.group)
            counts[key] = counts.get(key, 0) + 1
        if counts:  # at MAX_LISTED blocks per group and reason there may be more
            lines.append("  reasons: " + ", ".join(
                f"{reason.value}" + (f" ({group})" if group != "*" else "")
                + (f" x{count}" if 1 < count < MAX_LISTED else "")
                + (f" ({count}+ blocks, the first {count} listed)" if count >= MAX_LISTED
                   else "")
                for (reason, group), count in counts.items()))
        if self.plan:
            by_group: dict[str, int] = {}
            for step in self.plan:
                by_group[step.group] = by_group.get(step.group, 0) + 1
            lines.append("  plan: " + ", ".join(f"{count} steps on {group}"
                                                for group, count in by_group.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def reasons_of(self, reason: Reason) -> tuple[Shortfall, ...]:
        return tuple(s for s in self.reasons if s.reason is reason)

    @property
    def reason_set(self) -> frozenset[Reason]:
        return frozenset(s.reason for s in self.reasons)


KernelLayouts = Mapping[str, Layout]
