"""Whole-table checks the TOML structure cannot express: graph shape and row/state consistency.

These are the checks the `transitions` library does not make: unreachable states, dead ends,
leaks (no way back to the free state), effects that disagree with what the states declare, and
the structure the lifecycle's kind needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvfsm.spec._vocabulary import Content, Form, GroupKind, Tier

if TYPE_CHECKING:
    from kvfsm.spec._model import Lifecycle, Row, StateDef

Finding = tuple[str, str, str]


def validate_lifecycle(lifecycle: Lifecycle) -> Iterator[Finding]:
    """Yield ``(table, row, message)`` for every semantic problem of ``lifecycle``."""
    yield from _check_states(lifecycle)
    yield from _check_graph(lifecycle)
    yield from _check_kind(lifecycle)
    for row in lifecycle.rows:
        yield from _check_row(lifecycle.state(row.source), lifecycle.state(row.dest), row)


def _check_states(lifecycle: Lifecycle) -> Iterator[Finding]:
    for state in lifecycle.states:
        if state.residency is not None and state.residency not in state.slots:
            yield (
                "states",
                state.name,
                f"residency {state.residency.spec_name!r} holds no slot: add it to 'slots'",
            )
        if state.residency is None and state.content is not Content.NONE:
            yield ("states", state.name, "has content but residency 'none'")
        if (state.content is Content.NONE) != (state.form is Form.NONE):
            yield ("states", state.name, "form must be 'none' exactly when content is 'none'")
        if state.hashed and state.content is not Content.COMPLETE:
            yield (
                "states",
                state.name,
                "hashed = true needs content = 'complete': "
                "no block is reachable by hash unless its content is complete",
            )
        if state.readable and (
            state.residency is not Tier.DEVICE or state.content is not Content.COMPLETE
        ):
            yield (
                "states",
                state.name,
                "readable = true needs residency 'device' and content 'complete'",
            )
    initial = lifecycle.state(lifecycle.initial)
    if initial.slots or initial.hashed or initial.content is not Content.NONE:
        yield (
            "lifecycle",
            "initial",
            f"initial state {initial.name!r} must hold no slot, "
            "no content and no hash: it is the free state",
        )


def _check_kind(lifecycle: Lifecycle) -> Iterator[Finding]:
    """What every kind, and each kind in particular, needs of the states and rows."""
    kind = lifecycle.kind.value
    readable_forms = {state.form for state in lifecycle.states if state.readable}
    if not readable_forms:
        yield ("lifecycle", "kind", "no readable state: a block that can never be read is useless")
    if lifecycle.kind is GroupKind.COMPRESSED:
        for form in (Form.RAW, Form.COMPRESSED):
            if readable_forms and form not in readable_forms:
                yield (
                    "lifecycle",
                    "kind",
                    f"kind {kind!r} needs a readable state of form {form.value!r}: a block is "
                    "read raw until it is compressed, and compressed after",
                )
    if lifecycle.kind is GroupKind.SPARSE_INDEX:
        # An index is only as good as its targets: whatever makes it readable re-checks them.
        for row in lifecycle.rows:
            src, dst = lifecycle.state(row.source), lifecycle.state(row.dest)
            guarded = any(call.name == "targets_current" for call in row.guards)
            if dst.readable and not src.readable and not guarded:
                yield (
                    "rows",
                    row.label,
                    f"makes a {kind} block readable without guard 'targets_current': it could "
                    "be read while pointing at blocks that changed meanwhile",
                )


def _reach(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _check_graph(lifecycle: Lifecycle) -> Iterator[Finding]:
    forward: dict[str, set[str]] = {}
    backward: dict[str, set[str]] = {}
    for row in lifecycle.rows:
        forward.setdefault(row.source, set()).add(row.dest)
        backward.setdefault(row.dest, set()).add(row.source)
    reachable = _reach(lifecycle.initial, forward)
    returns = _reach(lifecycle.initial, backward)
    for state in lifecycle.state_names:
        if state not in reachable:
            yield ("states", state, f"unreachable from initial state {lifecycle.initial!r}")
        if not forward.get(state):
            yield ("states", state, "dead end: no row leaves this state")
        elif state not in returns:
            yield ("states", state, f"leak: no path from here back to {lifecycle.initial!r}")


def _effect_tiers(row: Row, name: str) -> set[Tier]:
    return {call.tier for call in row.effects if call.name == name and call.tier is not None}


def _check_row(src: StateDef, dst: StateDef, row: Row) -> Iterator[Finding]:
    taken = _effect_tiers(row, "take_slot")
    returned = _effect_tiers(row, "return_slot")
    need_take = set(dst.slots) - set(src.slots)
    need_return = set(src.slots) - set(dst.slots)
    names = {call.name for call in row.effects}
    for tier in sorted(need_take - taken):
        yield (
            "rows",
            row.label,
            f"{dst.name!r} holds a {tier.spec_name} slot that "
            f"{src.name!r} does not: add effect 'take_slot:{tier.spec_name}'",
        )
    for tier in sorted(taken - need_take):
        yield (
            "rows",
            row.label,
            f"effect 'take_slot:{tier.spec_name}' but {dst.name!r} "
            f"declares no new {tier.spec_name} slot",
        )
    for tier in sorted(need_return - returned):
        yield (
            "rows",
            row.label,
            f"{src.name!r} holds a {tier.spec_name} slot that "
            f"{dst.name!r} does not: add effect 'return_slot:{tier.spec_name}' (else it leaks)",
        )
    for tier in sorted(returned - need_return):
        yield (
            "rows",
            row.label,
            f"effect 'return_slot:{tier.spec_name}' but {dst.name!r} "
            f"still declares a {tier.spec_name} slot",
        )
    if src.hashed and not dst.hashed and "drop_hash" not in names:
        yield ("rows", row.label, "leaves a hashed state for an unhashed one: add 'drop_hash'")
    if not src.hashed and dst.hashed and "publish_hash" not in names:
        yield ("rows", row.label, "enters a hashed state: add 'publish_hash'")
    if "publish_hash" in names and not dst.hashed:
        yield ("rows", row.label, f"'publish_hash' but {dst.name!r} is not hashed")
    if "drop_hash" in names and dst.hashed:
        yield ("rows", row.label, f"'drop_hash' but {dst.name!r} is hashed")
    if src.hashed and "bump_epoch" in names and "invalidate_dependents" not in names:
        yield ("rows", row.label, "bumps the epoch of hashed content: add 'invalidate_dependents' "
               "so no readable index keeps pointing at the old epoch")
    moved = (src.residency, src.content, src.form) != (dst.residency, dst.content, dst.form)
    if moved and "bump_epoch" not in names:
        yield (
            "rows",
            row.label,
            "content or location changes: add 'bump_epoch' so leases "
            "taken before this row see the change",
        )
