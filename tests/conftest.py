"""Hypothesis profiles: the built-in ``ci`` profile loads itself when CI=true; ``long`` is for
deliberate fuzzing runs (``HYPOTHESIS_PROFILE=long python -m pytest -q``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from kvfsm._jit import settings as jit

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


@pytest.fixture(params=["numba", "numpy"])
def jit_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with compiled kernels and once with their NumPy twins (the compiled run
    is skipped where numba is unavailable)."""
    backend: str = request.param
    if backend == "numba" and not jit.available:
        pytest.skip("numba is not installed (or KVFSM_JIT=0)")
    with jit.using(backend == "numba"):
        yield backend
