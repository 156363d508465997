"""Bounded exhaustive checker: every reachable configuration of a small pool, every invariant.

Objects of one kind are interchangeable, so a configuration is a count per (state, pinned)
bucket rather than a tuple per object: permutations collapse and a pool of a few objects is
explored completely in well under a second. Guards are read abstractly: ``has_room:T`` compares
the slots in use in tier T with the bound's capacity, ``no_pins`` looks at the pin bit, and any
other guard may pass (the environment decides), so every row it protects is explored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import attrs
import numpy as np

from kvfsm.fsm._compiled import INVALID, CompiledTable
from kvfsm.spec._model import Call
from kvfsm.spec._vocabulary import Event, Tier

Config = tuple[int, ...]

DEFAULT_CAPACITY: MappingProxyType[Tier, int] = MappingProxyType(
    {Tier.DEVICE: 2, Tier.HOST: 1, Tier.DISK: 1, Tier.REMOTE: 1}
)


@attrs.frozen
class Bounds:
    """The size of the pool the checker explores."""

    objects: int = 3
    capacity: Mapping[Tier, int] = DEFAULT_CAPACITY
    #: Model readers pinning readable objects (and releasing them).
    pins: bool = True


@attrs.frozen
class View:
    """What an invariant sees of one configuration."""

    table: CompiledTable
    bounds: Bounds
    #: ``[n_states]`` objects per state, unpinned and pinned.
    unpinned: np.ndarray
    pinned: np.ndarray

    @property
    def per_state(self) -> np.ndarray:
        total: np.ndarray = self.unpinned + self.pinned
        return total

    def slots_used(self, tier: Tier) -> int:
        return int(self.per_state[self.table.holds_slot[:, tier]].sum())


@attrs.frozen
class Invariant:
    """A named property every reachable configuration must have."""

    name: str
    doc: str
    holds: Callable[[View], bool]


@attrs.frozen
class Violation:
    invariant: str
    doc: str
    #: Shortest sequence of steps from the empty pool to the bad configuration.
    trace: tuple[str, ...]
    final: str

    def __str__(self) -> str:
        steps = "\n".join(f"  {n}. {step}" for n, step in enumerate(self.trace, start=1))
        return (
            f"invariant {self.invariant!r} violated ({self.doc})\n"
            f"shortest trace ({len(self.trace)} steps):\n{steps or '  (initial)'}\n"
            f"  -> {self.final}"
        )


@attrs.frozen
class CheckResult:
    lifecycle: str
    bounds: Bounds
    configurations: int
    transitions: int
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def _capacity_ok(view: View) -> bool:
    return all(view.slots_used(t) <= view.bounds.capacity.get(t, 0) for t in Tier)


def _pinned_readable(view: View) -> bool:
    return not bool(view.pinned[~view.table.readable].any())


def _hashed_complete(view: View) -> bool:
    return not bool(view.per_state[view.table.hashed & ~view.table.complete].any())


def _spilled_off_device(view: View) -> bool:
    table = view.table
    spilled = (table.residency > int(Tier.DEVICE)) & ~table.in_flight
    return not bool(view.per_state[spilled & table.holds_slot[:, Tier.DEVICE]].any())


BUILTIN_INVARIANTS: tuple[Invariant, ...] = (
    Invariant("slot_capacity", "slots in use never exceed a tier's capacity", _capacity_ok),
    Invariant(
        "pinned_is_readable",
        "a pinned object is never evicted, freed or moved from under its reader",
        _pinned_readable,
    ),
    Invariant(
        "hashed_is_complete",
        "no object is reachable by hash unless its content is complete",
        _hashed_complete,
    ),
    Invariant(
        "spilled_holds_no_device_slot",
        "an object spilled to a lower tier holds no device slot",
        _spilled_off_device,
    ),
)

#: Name of the liveness check: from every reachable configuration the pool can drain to free.
NO_LEAK = "no_leak"


class _Explorer:
    def __init__(self, table: CompiledTable, bounds: Bounds) -> None:
        self.table = table
        self.bounds = bounds
        self.n_states = table.n_states
        self.readable = table.readable.tolist()
        self.holds = table.holds_slot.tolist()
        self.next_state = table.next_state.tolist()
        self.rows = table.lifecycle.rows
        self.row_of = table.row_of.tolist()

    def view(self, config: Config) -> View:
        counts = np.array(config, dtype=np.int64).reshape(self.n_states, 2)
        return View(self.table, self.bounds, counts[:, 0].copy(), counts[:, 1].copy())

    def used(self, config: Config, tier: Tier) -> int:
        return sum(
            config[2 * s] + config[2 * s + 1] for s in range(self.n_states) if self.holds[s][tier]
        )

    def guard_passes(self, call: Call, config: Config, pinned: int) -> bool:
        if call.name == "has_room" and call.tier is not None:
            return self.used(config, call.tier) < self.bounds.capacity.get(call.tier, 0)
        if call.name == "no_pins":
            return pinned == 0
        return True

    def successors(self, config: Config) -> Iterable[tuple[Config, str]]:
        names = self.table.lifecycle.state_names
        for bucket, count in enumerate(config):
            if not count:
                continue
            state, pinned = divmod(bucket, 2)
            who = f"an object in {names[state]!r}" + (" (pinned)" if pinned else "")
            for event in Event:
                dest = self.next_state[state][event]
                if dest == INVALID:
                    continue
                row = self.rows[self.row_of[state][event]]
                if not all(self.guard_passes(c, config, pinned) for c in row.guards):
                    continue
                yield (
                    self._move(config, bucket, 2 * dest + pinned),
                    (f"{who}: {event.spec_name} -> {names[dest]!r}"),
                )
            if self.bounds.pins and not pinned and self.readable[state]:
                yield self._move(config, bucket, bucket + 1), f"{who}: pin"
            if pinned:
                yield self._move(config, bucket, bucket - 1), f"{who}: unpin"

    @staticmethod
    def _move(config: Config, src: int, dst: int) -> Config:
        out = list(config)
        out[src] -= 1
        out[dst] += 1
        return tuple(out)

    def describe(self, config: Config) -> str:
        names = self.table.lifecycle.state_names
        parts = []
        for bucket, count in enumerate(config):
            if count:
                state, pinned = divmod(bucket, 2)
                parts.append(f"{count}x {names[state]}" + (" (pinned)" if pinned else ""))
        used = ", ".join(
            f"{t.spec_name} {self.used(config, t)}/{self.bounds.capacity.get(t, 0)}"
            for t in self.table.lifecycle.tiers
        )
        return "; ".join(parts) + (f" | slots {used}" if used else "")


def check_lifecycle(
    table: CompiledTable,
    bounds: Bounds | None = None,
    invariants: Iterable[Invariant] = BUILTIN_INVARIANTS,
    *,
    liveness: bool = True,
) -> CheckResult:
    """Explore every configuration reachable from an all-free pool and check ``invariants``.

    Reports the first violation of each invariant with its shortest trace (breadth-first).
    With ``liveness``, also reports :data:`NO_LEAK` when some reachable configuration cannot
    drain back to every object free and unpinned.
    """
    bounds = bounds or Bounds()
    explorer = _Explorer(table, bounds)
    start = [0] * (2 * table.n_states)
    start[2 * table.initial] = bounds.objects
    origin: Config = tuple(start)
    parent: dict[Config, tuple[Config, str] | None] = {origin: None}
    reverse: dict[Config, list[Config]] = {}
    invariants = tuple(invariants)
    found: dict[str, Violation] = {}
    queue = deque([origin])
    edges = 0

    def trace_to(config: Config) -> tuple[str, ...]:
        steps: list[str] = []
        link = parent[config]
        while link is not None:
            config, label = link
            steps.append(label)
            link = parent[config]
        return tuple(reversed(steps))

    while queue:
        config = queue.popleft()
        view = explorer.view(config)
        for inv in invariants:
            if inv.name not in found and not inv.holds(view):
                found[inv.name] = Violation(
                    inv.name, inv.doc, trace_to(config), explorer.describe(config)
                )
        for nxt, label in explorer.successors(config):
            edges += 1
            reverse.setdefault(nxt, []).append(config)
            if nxt not in parent:
                parent[nxt] = (config, label)
                queue.append(nxt)

    if liveness:
        drains = {origin}
        back = deque([origin])
        while back:
            for prev in reverse.get(back.popleft(), ()):
                if prev not in drains:
                    drains.add(prev)
                    back.append(prev)
        stuck = [c for c in parent if c not in drains]
        if stuck:
            worst = min(stuck, key=lambda c: len(trace_to(c)))
            found[NO_LEAK] = Violation(
                NO_LEAK,
                "every reachable configuration can drain back to all objects free",
                trace_to(worst),
                explorer.describe(worst) + " (cannot drain back to free)",
            )
    return CheckResult(table.name, bounds, len(parent), edges, tuple(found.values()))
