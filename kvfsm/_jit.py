"""Compiled kernels for the few loops NumPy cannot express in a handful of array operations.

A kernel is a plain Python function over NumPy arrays and scalars, written so that numba can
compile it (``nopython`` mode, no Python objects), writing its answer into an ``out`` array.
:func:`kernel` wraps it; numba is imported and the kernel compiled on first use (or by
:func:`warm_up`), and the machine code is cached on disk (``__pycache__``, or numba's user cache
directory where the package is read-only). Every kernel has a vectorized NumPy twin at its call
site; the twin serves when numba is not installed or ``KVFSM_JIT=0`` is set, and the test suite
runs both and requires equal answers.

Why not always NumPy: a probe chain or a per-row "any reference bad" is a short loop per key. As
array operations it costs a dozen passes over the batch, each allocating; compiled it is one
pass with early exits, several times faster on the lookup's hot path.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

#: Environment variable that disables compiled kernels when set to 0 / false / no / off.
ENV_VAR = "KVFSM_JIT"
_OFF = frozenset({"0", "false", "no", "off"})


@functools.cache
def _numba() -> Any:
    """The numba module, or None when disabled by the environment or not importable (numba is a
    dependency, but a platform may lack its wheels). Imported once, on first need: importing
    it costs a quarter of a second that commands without lookups should not pay."""
    if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


class JitSettings:
    """Whether call sites use compiled kernels (tests flip ``enabled`` to run both paths)."""

    def __init__(self) -> None:
        self._enabled: bool | None = None

    @property
    def available(self) -> bool:
        """numba can be imported and the environment does not disable it."""
        return _numba() is not None

    @property
    def enabled(self) -> bool:
        if self._enabled is None:
            self._enabled = self.available
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value and not self.available:
            raise ValueError(f"compiled kernels are unavailable (numba missing or {ENV_VAR}=0)")
        self._enabled = value

    @contextlib.contextmanager
    def using(self, enabled: bool) -> Iterator[None]:
        """Compiled kernels on or off for the ``with`` body, restored afterwards."""
        before = self.enabled
        self.enabled = enabled
        try:
            yield
        finally:
            self.enabled = before

    @property
    def backend(self) -> str:
        """``"numba"`` when kernels run compiled, else ``"numpy"``."""
        return "numba" if self.enabled else "numpy"


settings = JitSettings()


class Kernel:
    """A kernel function, compiled on first call. ``python`` is the function itself (a slow
    loop, for tests that compare it with the compiled version and with the NumPy twin)."""

    def __init__(self, function: Callable[..., None],
                 example: Callable[[], tuple[Any, ...]]) -> None:
        self.python = function
        self.example = example
        self.__doc__ = function.__doc__
        self.__name__ = function.__name__
        self._compiled: Callable[..., None] | None = None

    @property
    def compiled(self) -> Callable[..., None]:
        if self._compiled is None:
            numba = _numba()
            if numba is None:
                raise RuntimeError(f"kernel {self.__name__} called without numba; call sites "
                                   "check kvfsm._jit.settings.enabled first")
            self._compiled = numba.njit(cache=True, nogil=True)(self.python)
        return self._compiled

    def __call__(self, *args: Any) -> None:
        (self._compiled or self.compiled)(*args)


def read_only(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` made read-only, for examples: numba compiles a separate version for read-only
    arrays (a lifecycle table's per-state facts, a machine's state view)."""
    array.flags.writeable = False
    return array


#: Every kernel, for :func:`warm_up`.
_KERNELS: list[Kernel] = []


def kernel(example: Callable[[], tuple[Any, ...]]) -> Callable[[Callable[..., None]], Kernel]:
    """Decorator making a :class:`Kernel`. ``example()`` returns small arguments of exactly the
    types the call site passes (numba compiles one version per argument types), so
    :func:`warm_up` compiles the version the hot path will use."""

    def decorate(function: Callable[..., None]) -> Kernel:
        wrapped = Kernel(function, example)
        _KERNELS.append(wrapped)
        return wrapped

    return decorate


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel, so no request pays for it. Cheap once
    done: each call then runs a kernel on a few elements."""
    if not settings.enabled:
        return
    for each in _KERNELS:
        each(*each.example())
