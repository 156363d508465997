"""Hypothesis profiles: the built-in ``ci`` profile loads itself when CI=true; ``long`` is for
deliberate fuzzing runs (``HYPOTHESIS_PROFILE=long python -m pytest -q``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvfsm._jit import settings as jit
from tests import kernel_twins

settings.register_profile(
    "long",
    max_examples=5_000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)

# With compiled kernels off, tests run the lookup's and the lease's NumPy reference instead of
# the kernels' plain-Python source: a second implementation to compare with, and fast.
kernel_twins.install()

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


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; on a loaded 2-core machine torch's own threads
    contend and a forward takes 30 times longer. Restores the setting afterwards."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def config() -> Any:
    """The tiny GPT-OSS config (the serve tests' model)."""
    from kvfsm.serve import tiny_config

    return tiny_config("gpt_oss")


@pytest.fixture(scope="module")
def model() -> Any:
    """The tiny GPT-OSS model, seeded."""
    from kvfsm.serve import tiny_model

    return tiny_model("gpt_oss", seed=0)


@pytest.fixture(scope="module")
def master() -> Iterator[Any]:
    """A Mooncake master on 127.0.0.1 for one test module (skips, or fails under CI=true,
    where it cannot start)."""
    from tests.remote_servers import start_mooncake_master

    server = start_mooncake_master()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Any]:
    """A redis-server on 127.0.0.1 for one test module (skips, or fails under CI=true)."""
    from tests.remote_servers import start_redis_server

    server = start_redis_server()
    yield server
    server.stop()
