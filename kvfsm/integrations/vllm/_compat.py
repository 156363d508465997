"""Keeps vLLM's CPU worker start-up working in a process where numba is loaded.

vLLM's CPU build (0.32) registers its Triton kernel overrides when a worker starts
(``vllm.triton_utils.dispatcher._rebind_kernels``): it walks every loaded module's namespace and
calls ``vars(value).get("kernel")`` on each value that ``hasattr(value, "__dict__")``. numba's
``llvmlite.binding.ffi.lib`` answers every attribute through ``__getattr__`` (it duck-types a
ctypes library), ``__dict__`` included, with a function wrapper, so the walk fails with
``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and the worker does not
start. numba is imported by kvfsm's compiled kernels on their first use, so any vLLM engine
started in a process after kvfsm ran a lookup (a second ``LLM`` in a test or a benchmark, an
engine started beside an embedding kvfsm) hit it.

:func:`guard_llvmlite` makes that wrapper refuse dunder names (``AttributeError``, as a plain
object without them would), which is all the walk needs; llvmlite looks up only its C
functions, never a dunder, through it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: Set on the patched ``__getattr__`` so the guard is applied once.
_GUARDED = "_kvfsm_dunder_guard"


def guard_llvmlite() -> bool:
    """Make ``llvmlite.binding.ffi.lib`` refuse dunder attribute names (see the module
    docstring). True when the guard is in place, False where llvmlite is not installed."""
    if importlib.util.find_spec("llvmlite") is None:
        return False
    from llvmlite.binding import ffi  # type: ignore[import-untyped,unused-ignore]

    wrapper = ffi._lib_wrapper
    original = wrapper.__getattr__
    if getattr(original, _GUARDED, False):
        return True

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    setattr(__getattr__, _GUARDED, True)
    wrapper.__getattr__ = __getattr__
    return True
