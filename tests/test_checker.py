"""The bounded exhaustive checker: clean on the shipped specs, finds seeded bugs."""

from __future__ import annotations

import pytest

from kvfsm.fsm import (
    NO_LEAK,
    Bounds,
    Invariant,
    check_lifecycle,
    compile_lifecycle,
)
from kvfsm.spec import Tier, parse_lifecycle, shipped_lifecycles, shipped_specs_dir

FULL_KV = (shipped_specs_dir() / "lifecycles" / "full_kv.toml").read_text(encoding="utf-8")


def _without(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.mark.parametrize("name", sorted(shipped_lifecycles()))
def test_shipped_specs_are_clean(name: str) -> None:
    table = compile_lifecycle(shipped_lifecycles()[name])
    result = check_lifecycle(table)
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.configurations > 1
    assert result.transitions >= result.configurations - 1


def test_evict_without_no_pins_is_caught_with_the_shortest_trace() -> None:
    broken = _without(
        FULL_KV,
        'event = "evict"\ndest = "free"\nguards = ["no_pins"]\n',
        'event = "evict"\ndest = "free"\n',
    )
    result = check_lifecycle(compile_lifecycle(parse_lifecycle(broken)))
    (violation,) = [v for v in result.violations if v.invariant == "pinned_is_readable"]
    assert violation.trace == (
        "an object in 'free': allocate -> 'allocated'",
        "an object in 'allocated': write_begin -> 'writing'",
        "an object in 'writing': write_done -> 'device'",
        "an object in 'device': pin",
        "an object in 'device' (pinned): evict -> 'free'",
    )
    assert "free (pinned)" in violation.final
    assert "shortest trace (5 steps)" in str(violation)


def test_allocation_without_room_guard_overflows_the_device_tier() -> None:
    broken = _without(
        FULL_KV,
        'guards = ["has_room:device"]\neffects = ["take_slot:device", "clear_sub_blocks"]',
        'effects = ["take_slot:device", "clear_sub_blocks"]',
    )
    table = compile_lifecycle(parse_lifecycle(broken))
    result = check_lifecycle(table, Bounds(objects=3))
    (violation,) = [v for v in result.violations if v.invariant == "slot_capacity"]
    assert len(violation.trace) == 3  # three allocations, the third one over capacity 2
    assert "device 3/2" in violation.final


def test_no_violation_when_the_pool_cannot_overflow() -> None:
    """Same broken spec, but the pool is too small to overflow: nothing to report."""
    broken = _without(
        FULL_KV,
        'guards = ["has_room:device"]\neffects = ["take_slot:device", "clear_sub_blocks"]',
        'effects = ["take_slot:device", "clear_sub_blocks"]',
    )
    table = compile_lifecycle(parse_lifecycle(broken))
    assert check_lifecycle(table, Bounds(objects=2)).ok


def test_a_configuration_that_cannot_drain_is_a_leak() -> None:
    """A spill that can only finish when the host has room it is itself holding gets stuck."""
    broken = _without(
        FULL_KV,
        'source = "spilling_host"\nevent = "spill_done"\ndest = "host"\nguards = ["no_pins"]',
        'source = "spilling_host"\nevent = "spill_done"\ndest = "host"\n'
        'guards = ["no_pins", "has_room:host"]',
    )
    broken = _without(
        broken,
        '[[rows]]\nsource = "spilling_host"\nevent = "spill_fail"\ndest = "device"\n'
        'effects = ["return_slot:host"]\n',
        "",
    )
    result = check_lifecycle(
        compile_lifecycle(parse_lifecycle(broken)),
        Bounds(objects=1, capacity={Tier.DEVICE: 1, Tier.HOST: 1}),
    )
    (violation,) = [v for v in result.violations if v.invariant == NO_LEAK]
    assert violation.trace[-1] == "an object in 'device': spill_begin -> 'spilling_host'"
    assert "cannot drain" in violation.final


def test_custom_invariants_are_checked() -> None:
    """A caller's invariant is evaluated on every reachable configuration."""
    table = compile_lifecycle(shipped_lifecycles()["full_kv"])
    never_on_disk = Invariant(
        "never_on_disk",
        "nothing reaches disk",
        lambda view: view.per_state[table.state_id("disk")] == 0,
    )
    result = check_lifecycle(table, invariants=[never_on_disk], liveness=False)
    (violation,) = result.violations
    assert violation.invariant == "never_on_disk"
    # The shortest way there: a copy found on disk (a spill takes four steps).
    assert violation.trace == ("an object in 'free': discover_disk -> 'disk'",)


def test_more_objects_explore_more_configurations() -> None:
    table = compile_lifecycle(shipped_lifecycles()["compressed"])
    small = check_lifecycle(table, Bounds(objects=2))
    large = check_lifecycle(table, Bounds(objects=3))
    assert small.ok and large.ok
    assert large.configurations > small.configurations
