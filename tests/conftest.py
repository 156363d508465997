"""Hypothesis profiles: the built-in ``ci`` profile loads itself when CI=true; ``long`` is for
deliberate fuzzing runs (``HYPOTHESIS_PROFILE=long python -m pytest -q``)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "long",
    max_examples=5_000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)

if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
