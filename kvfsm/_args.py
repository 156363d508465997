"""Checks of the plain arguments the public API takes (counts, tiers, flags, priorities): a bad
one is a :class:`KvfsmError` naming the argument and what it must be, raised before anything
changes."""

from __future__ import annotations

import math

import numpy as np

from kvfsm._errors import KvfsmError
from kvfsm.spec import Tier
from kvfsm.spec._vocabulary import TIER_NAMES


def _as_int(value: object) -> int | None:
    """``value`` as an int where it is an integer (Python or NumPy, not a bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    return None


def count(name: str, value: object) -> int:
    """``value`` as a count (an int >= 0)."""
    known = _as_int(value)
    if known is None or known < 0:
        raise KvfsmError(f"{name} must be an int >= 0, got {value!r}")
    return known


def positive(name: str, value: object) -> int:
    """``value`` as an int >= 1."""
    known = _as_int(value)
    if known is None or known < 1:
        raise KvfsmError(f"{name} must be an int >= 1, got {value!r}")
    return known


def integer(name: str, value: object) -> int:
    """``value`` as an int (any sign)."""
    known = _as_int(value)
    if known is None:
        raise KvfsmError(f"{name} must be an int, got {value!r}")
    return known


def flag(name: str, value: object) -> bool:
    """``value`` as a bool (True or False, not any truthy value)."""
    if not isinstance(value, bool | np.bool_):
        raise KvfsmError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def seconds(name: str, value: object) -> float:
    """``value`` as a finite number of seconds >= 0."""
    number = float(value) if isinstance(value, int | float | np.integer | np.floating) \
        and not isinstance(value, bool | np.bool_) else math.nan
    if not math.isfinite(number) or number < 0:
        raise KvfsmError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return number


def tier(name: str, value: object) -> Tier:
    """``value`` as a :class:`Tier`: the member, its number or its name (any case)."""
    if isinstance(value, Tier):
        return value
    if isinstance(value, str) and value.lower() in TIER_NAMES:
        return Tier[value.upper()]
    known = _as_int(value)
    if known is not None and known in {int(each) for each in Tier}:
        return Tier(known)
    raise KvfsmError(f"{name} must be a tier, one of {list(TIER_NAMES)}, got {value!r}")
