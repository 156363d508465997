"""Real remote-store servers for the tests that need them: a Mooncake master and a Redis server
on 127.0.0.1 (the ``master`` and ``redis_server`` fixtures of ``conftest.py`` start one per
module and stop it after). Where a binary or client library is
missing the tests skip, except under ``CI=true``, where they fail (CI installs everything)."""

from __future__ import annotations

import os
import time
from typing import Any, NoReturn

import pytest

from kvfsm.tiers import MooncakeMaster, RedisServer, TierError


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true, where the remote-tier tests must run")
    pytest.skip(reason)


class Clock:
    """``time.monotonic`` that can be told to jump ``step`` seconds on every call."""

    def __init__(self) -> None:
        self.step = 0.0
        self._offset = 0.0

    def __call__(self) -> float:
        self._offset += self.step
        return time.monotonic() + self._offset


def start_mooncake_master(**options: Any) -> MooncakeMaster:
    """A running master (its client library importable), or the test skips / fails."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        unavailable(f"the Mooncake client does not import ({exc})")
    server = MooncakeMaster(**options)
    try:
        server.start()
    except TierError as exc:
        unavailable(str(exc))
    return server


def start_redis_server(**options: Any) -> RedisServer:
    """A running redis-server (redis-py importable), or the test skips / fails."""
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        unavailable(f"the redis client does not import ({exc})")
    server = RedisServer(**options)
    try:
        server.start()
    except TierError as exc:
        unavailable(str(exc))
    return server
