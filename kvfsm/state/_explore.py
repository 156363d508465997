"""Bounded exhaustive check of the real state core: every reachable configuration of a tiny pool.

The lifecycle checker (:func:`kvfsm.fsm.check_lifecycle`) works on abstract counts; this one
drives an actual :class:`StateCore` (real arrays, real slot pools, real hash map, real effects)
through every operation from every reachable configuration, breadth first, and evaluates
:data:`CORE_INVARIANTS` on each. A refused operation must leave the configuration exactly as it
was. Configurations are abstracted (slot numbers, epochs and hash values are left out; what they
decide - held or not, index current or not, in the map or not - is kept) so the space is finite.

Cores are never copied or restored (that would write state outside ``fire``): a configuration
is reproduced by replaying the operations that led to it from a fresh core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.spec import Event, ModelDecl, Tier
from kvfsm.spec._vocabulary import DISCOVER_EVENT
from kvfsm.state._core import CoreConfig, StateCore
from kvfsm.state._group import NO_TARGET, GroupState
from kvfsm.state._invariants import core_problems

#: ``(operation, group, block, event)``; block -1 and event None where they do not apply.
Action = tuple[str, str, int, Event | None]
Key = bytes


@attrs.frozen
class CoreViolation:
    problem: str
    #: The operations, from a fresh core, that reach the bad configuration (shortest).
    trace: tuple[str, ...]

    def __str__(self) -> str:
        steps = "\n".join(f"  {n}. {step}" for n, step in enumerate(self.trace, start=1))
        return f"{self.problem}\nshortest trace ({len(self.trace)} steps):\n{steps}"


@attrs.frozen
class CoreCheckResult:
    model: str
    configurations: int
    transitions: int
    refusals: int
    #: False when ``max_configurations`` stopped the search before it ran out of new ones.
    complete: bool
    violations: tuple[CoreViolation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def _label(action: Action) -> str:
    op, group, block, event = action
    if op == "fire" and event is not None:
        return f"{group}[{block}]: {event.spec_name}"
    if op in ("allocate", "discover"):
        return f"{group}: {op}" + (f" ({event.spec_name})" if event is not None else "")
    return f"{group}[{block}]: {op}"


def _loads_verify(group: GroupState) -> NDArray[np.bool_]:
    """Per block restoring from a stored tier: the bytes loaded so far match their checksum
    (what decides whether its ``restore_done`` may fire)."""
    loading = np.flatnonzero(group.table.loading[group.states])
    verifies = np.zeros(group.n_blocks, dtype=np.bool_)
    if loading.size:
        slots = group.slot[Tier.DEVICE][loading]
        verifies[loading] = group.pools[Tier.DEVICE].verify_checksum(slots)
    return verifies


def configuration_key(core: StateCore) -> Key:
    """What decides the core's future behaviour, without slot numbers, epochs or hashes."""
    parts: list[bytes] = []
    for group in core.groups.values():
        every = np.arange(group.n_blocks)
        in_map = np.zeros(group.n_blocks, dtype=np.bool_)
        in_map[group.hash_map.entries()[2]] = True
        parts += [
            group.states.tobytes(),
            np.minimum(group.pins, 2).astype(np.uint8).tobytes(),
            (group.sub_blocks == group.full_sub_mask).tobytes(),
            in_map.tobytes(),
            group.refs_target.tobytes(),
            group.targets_current(every).tobytes(),
            group.free_ids[: group.free_top].tobytes(),
            group.copies.tobytes(),
            _loads_verify(group).tobytes(),
        ]
    return b"|".join(parts)


class _Runner:
    def __init__(self, model: ModelDecl, config: CoreConfig) -> None:
        self.model = model
        self.config = config
        self.actions: list[Action] = []
        for name, group in StateCore(model, config).groups.items():
            self.actions.append(("allocate", name, -1, None))
            self.actions += [("discover", name, -1, DISCOVER_EVENT[tier]) for tier in group.stored]
            for block in range(group.n_blocks):
                self.actions += [("fire", name, block, e) for e in Event
                                 if e is not Event.ALLOCATE and e not in DISCOVER_EVENT.values()]
                if group.stored:
                    self.actions.append(("load", name, block, None))
                self.actions += [(op, name, block, None) for op in ("write", "pin", "unpin")]
                if group.target is not None:
                    self.actions.append(("refs", name, block, None))

    def fresh(self, path: tuple[Action, ...]) -> StateCore:
        core = StateCore(self.model, self.config)
        for step, action in enumerate(path):
            self.apply(core, action, step)
        return core

    @staticmethod
    def apply(core: StateCore, action: Action, step: int) -> None:
        op, name, block, event = action
        group = core.group(name)
        if op == "allocate":
            # A distinct identity per allocation: the step that made it in the path.
            core.allocate(name, [step], [step + 1], [step * 31 + 7])
        elif op == "discover" and event is not None:
            tier = next(t for t, e in DISCOVER_EVENT.items() if e is event)
            core.discover(name, [step], [step + 1], [step * 31 + 7], tier)
        elif op == "load":
            # The data path brings a stored copy whose header checksum matches what arrived.
            payload = np.full((1, group.decl.payload_bytes), block + 1, np.uint8)
            core.record_loaded(name, [block], [xxhash.xxh3_64_intdigest(payload[0])], payload)
        elif op == "fire" and event is not None:
            core.fire(name, [block], event)
        elif op == "write":
            core.write(name, [block], np.full((1, group.decl.payload_bytes), block + 1, np.uint8))
        elif op == "pin":
            if group.block_pins[block] >= 1:
                raise KvfsmError("explorer: one pin per block bounds the search")
            core.pin(name, [block])
        elif op == "unpin":
            core.unpin(name, [block])
        elif op == "refs" and group.target is not None:
            complete = group.target.table.complete & group.target.table.hashed
            targets = np.flatnonzero(complete[group.target.states])[: group.refs_target.shape[1]]
            refs = np.full((1, group.refs_target.shape[1]), NO_TARGET, dtype=np.int32)
            refs[0, : targets.size] = targets
            core.set_index_refs(name, [block], refs)


def explore_core(
    model: ModelDecl,
    config: CoreConfig,
    *,
    max_configurations: int = 5_000,
    problems: Callable[[StateCore], list[str]] = core_problems,
) -> CoreCheckResult:
    """Breadth-first over every configuration the core can reach under ``config``'s pools."""
    runner = _Runner(model, config)
    start = StateCore(model, config)
    origin = configuration_key(start)
    paths: dict[Key, tuple[Action, ...]] = {origin: ()}
    queue: deque[Key] = deque([origin])
    found: dict[str, CoreViolation] = {}
    transitions = refusals = 0

    def report(problem: str, path: tuple[Action, ...]) -> None:
        name = problem.split(":", 2)[1].strip() if problem.count(":") >= 2 else problem
        found.setdefault(name, CoreViolation(problem, tuple(_label(a) for a in path)))

    for problem in problems(start):
        report(problem, ())
    while queue and len(paths) <= max_configurations:
        key = queue.popleft()
        path = paths[key]
        core = runner.fresh(path)
        for action in runner.actions:
            try:
                runner.apply(core, action, len(path))
            except KvfsmError:
                refusals += 1
                if configuration_key(core) != key:
                    report(f"refused {_label(action)} changed the configuration", (*path, action))
                    core = runner.fresh(path)
                continue
            except Exception as exc:  # a crash is a finding, with its trace
                report(f"{_label(action)} crashed: {exc!r}", (*path, action))
                core = runner.fresh(path)
                continue
            transitions += 1
            new_key = configuration_key(core)
            if new_key not in paths:
                paths[new_key] = (*path, action)
                queue.append(new_key)
                for problem in problems(core):
                    report(problem, (*path, action))
            if new_key != key:
                core = runner.fresh(path)
    return CoreCheckResult(model.name, len(paths), transitions, refusals, not queue,
                           tuple(found.values()))
