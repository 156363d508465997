"""Compiled kernels for the few loops NumPy cannot express in a handful of array operations.

A kernel is a plain Python function over NumPy arrays and scalars, written so that numba can
compile it (``nopython`` mode, no Python objects), writing its answer into an ``out`` array.
:func:`kernel` wraps it in one :class:`Kernel` object that also owns

* its *twin*: a vectorized NumPy implementation with the same signature (writing into the
  same ``out``), or else its plain-Python function, which serves when numba is not installed,
  ``KVFSM_JIT=0`` is set, or a test turns compiled kernels off (``settings.using(False)``);
  the lookup's and the lease's kernels run their Python source, and the tests keep their
  NumPy reference (``tests/kernel_twins.py``);
* its *inputs*: a generator of random valid arguments, with which one differential test
  (``tests/test_jit.py``) runs every registered kernel compiled, as its twin and as plain
  Python, and requires equal answers.

Calling the kernel dispatches once on :attr:`JitSettings.enabled`; call sites just call it.
numba is imported and the kernel compiled on first use (or by :func:`warm_up`, which says on
stderr when that takes a while: the first use on a machine), and the machine code is cached on
disk: ``__pycache__`` beside the source, or numba's user cache directory where the package is
read-only, or (a locked-down install with no writable home either) a per-user directory under
the system's temporary directory (``NUMBA_CACHE_DIR`` set here, one warning); where no directory
is writable at all the kernels compile without a disk cache, on every start (one warning).

Why not always NumPy: a probe chain or a per-row "any reference bad" is a short loop per key. As
array operations it costs a dozen passes over the batch, each allocating; compiled it is one
pass with early exits, several times faster on the lookup's hot path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np

#: Environment variable that disables compiled kernels when set to 0 / false / no / off.
ENV_VAR = "KVFSM_JIT"
_OFF = frozenset({"0", "false", "no", "off"})
#: numba's own setting of where its disk cache lives (read when numba is imported).
CACHE_ENV: Final = "NUMBA_CACHE_DIR"
#: A kernel whose compile (or cache load) took longer than this is being compiled for real:
#: :func:`warm_up` then says so on stderr (loading from the cache takes milliseconds).
SLOW_COMPILE_S: Final = 0.5
_log = logging.getLogger("kvfsm")


def _writable(directory: Path) -> bool:
    """``directory`` exists and this process may create files in it, or it can be made."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def _cache_dir() -> None:
    """Before numba is imported: where neither the package's ``__pycache__`` nor the user's
    cache directory is writable (a read-only install run by a user without a writable home),
    point numba's cache at a per-user directory under the temporary directory, so kernels
    compile once per machine instead of failing ("no locator available")."""
    if os.environ.get(CACHE_ENV):
        return
    here = Path(__file__).resolve().parent / "__pycache__"
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
    if _writable(here) or _writable(home):
        return
    fallback = Path(tempfile.gettempdir()) / f"kvfsm-numba-cache-{os.getuid()}"
    if _writable(fallback):
        os.environ[CACHE_ENV] = str(fallback)
        _log.warning("kvfsm: neither %s nor %s is writable; compiled kernels are cached in %s "
                     "(set %s to choose another place)", here, home, fallback, CACHE_ENV)


def _numba_installed() -> bool:
    """numba is installed and the environment does not disable it (found, not imported)."""
    if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
        return False
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _numba() -> Any:
    """The numba module, or None when disabled by the environment or not importable (numba is a
    dependency, but a platform may lack its wheels). Imported once, on first need: importing
    it costs a quarter of a second that commands without lookups should not pay."""
    if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
        return None
    _cache_dir()
    try:
        import numba
    except ImportError:
        return None
    return numba


@functools.cache
def _no_disk_cache(why: str) -> None:
    """Warn once that kernels compile without a disk cache (every start pays the compile)."""
    _log.warning("kvfsm: compiled kernels cannot be cached on disk (%s); they are compiled on "
                 "every start. Set %s to a writable directory to cache them.", why, CACHE_ENV)


class JitSettings:
    """Whether kernels run compiled or uncompiled (their twins) (tests flip ``enabled`` to run
    both)."""

    #: Kernels run compiled: a plain attribute (every kernel call reads it, and a property is
    #: a Python call each time; a class with ``__getattr__`` loses CPython's fast attribute
    #: reads), set where numba is installed without importing it (a quarter of a second that
    #: commands without lookups should not pay). :func:`warm_up` turns it off where numba is
    #: installed but fails to import; :meth:`__setattr__` refuses turning it on where numba
    #: is unavailable.
    enabled: bool

    def __init__(self) -> None:
        object.__setattr__(self, "enabled", _numba_installed())

    def __setattr__(self, name: str, value: object) -> None:
        if name == "enabled" and value and not self.available:
            raise ValueError(f"compiled kernels are unavailable (numba missing or {ENV_VAR}=0)")
        object.__setattr__(self, name, value)

    @property
    def available(self) -> bool:
        """numba can be imported and the environment does not disable it."""
        return _numba() is not None

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

#: ``example()``: arguments of the call site's types; ``inputs(rng)``: random valid arguments.
Example = Callable[[], tuple[Any, ...]]
Inputs = Callable[[np.random.Generator], tuple[Any, ...]]


class Kernel:
    """A kernel: ``python`` is the function itself (a slow loop, numba's source), ``compiled``
    its numba version (compiled on first use), ``twin`` its vectorized NumPy version; calling
    the kernel runs the compiled version when :attr:`JitSettings.enabled`, else the twin.
    ``example()`` gives small arguments of the call site's exact types (for :func:`warm_up`),
    ``inputs(rng)`` random valid arguments (for the differential test; None: the test takes
    them from ``tests/kernel_inputs.py``, or leaves the kernel out). ``calls``: the plain
    functions its body calls (compiled into it; see :func:`kernel`)."""

    def __init__(self, function: Callable[..., Any], *, example: Example,
                 twin: Callable[..., Any] | None = None, inputs: Inputs | None = None,
                 calls: tuple[Callable[..., Any], ...] = ()) -> None:
        self.python = function
        self.twin = function if twin is None else twin
        self.example = example
        self.inputs = inputs
        self.calls = calls
        self.__doc__ = function.__doc__
        self.__name__ = function.__name__
        self._compiled: Callable[..., Any] | None = None

    def _compiled_or_off(self) -> Callable[..., Any] | None:
        """The compiled version, or None where numba was found installed but fails to import:
        compiled kernels are then turned off (every call site falls back to the twins),
        whether or not an engine's :func:`warm_up` found it first."""
        if self._compiled is None and not settings.available:
            settings.enabled = False
            return None
        return self._compiled or self.compiled

    @property
    def compiled(self) -> Callable[..., Any]:
        if self._compiled is None:
            numba = _numba()
            if numba is None:
                raise RuntimeError(f"kernel {self.__name__} cannot be compiled: numba is missing "
                                   f"or {ENV_VAR}=0 (calling the kernel runs its twin)")
            for each in self.calls:
                _callable_from_kernels(numba, each)
            # Compiled code's version of array_at (kernels taking arrays by address).
            from kvfsm import _addressed
            _addressed.register(numba)
            try:
                compiled = numba.njit(cache=True, nogil=True)(self.python)
            except RuntimeError as exc:  # numba found no writable place for its cache
                _no_disk_cache(str(exc))
                compiled = numba.njit(cache=False, nogil=True)(self.python)
            else:
                if not _stamp_callees(compiled, self):
                    compiled = numba.njit(cache=False, nogil=True)(self.python)
            self._compiled = compiled
        return self._compiled

    def entry(self, *args: Any) -> Callable[..., Any]:
        """The compiled version for exactly the types of ``args`` (compiled now if no version
        has them), called without numba's matching of argument types (some 35 ns an
        argument): only for a call site whose arguments are checked to have those types
        before each call (the one-pass lease, ``LeaseArrays.take``). An argument of another
        dtype, layout or dimension would be read as the bound type, unchecked; every other
        call goes through :attr:`run`. The twin where numba fails to import."""
        dispatcher: Any = self._compiled_or_off()  # a numba Dispatcher
        if dispatcher is None:
            return self.twin  # numba fails to import: the twin takes the same arguments
        typeof = _numba().typeof
        call: Callable[..., Any] = dispatcher.compile(tuple(typeof(arg) for arg in args))
        return call

    @property
    def run(self) -> Callable[..., Any]:
        """What a call runs now: the compiled version (numba's dispatcher, which matches every
        call's argument types and compiles a version for types it has not seen) where kernels
        run compiled, else the twin. For a hot call site: calling the kernel itself repacks
        every argument once more."""
        if settings.enabled:
            return self._compiled or self._compiled_or_off() or self.twin
        return self.twin

    def __call__(self, *args: Any) -> Any:
        # The one dispatch: a property read, as call sites did before kernels owned their twins.
        # A kernel's answer is in its ``out``; the few that also return one return it here.
        if settings.enabled:
            return (self._compiled or self._compiled_or_off() or self.twin)(*args)
        return self.twin(*args)

    def __repr__(self) -> str:
        return f"<kernel {self.__name__}>"


def _stamp(path: str) -> tuple[float, int]:
    """A source file's modification time and size (what numba's disk cache stamps)."""
    st = os.stat(path)
    return st.st_mtime, st.st_size


def _stamp_callees(dispatcher: Any, each: Kernel) -> bool:
    """Make ``dispatcher``'s disk cache stale when a file of ``each``'s callees changes, not
    only the kernel's own file (numba stamps its cache with that file alone, and would load a
    kernel compiled with an older callee). False where numba's cache keeps its stamp
    elsewhere than this numba version does: the kernel is then compiled without a disk cache
    (correct, only slower to start)."""
    own = each.python.__code__.co_filename
    files = sorted({callee.__code__.co_filename for callee in each.calls} - {own})
    if not files:
        return True
    cache_file: Any = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    stamp = getattr(cache_file, "_source_stamp", None)
    if stamp is None:
        return False
    try:
        cache_file._source_stamp = (stamp, *[(path, *_stamp(path)) for path in files])
    except OSError:  # a callee's file cannot be read: nothing to stamp it with
        return False
    return True


#: Plain functions compiled kernels may call (registered with numba once each).
_CALLABLE: set[Callable[..., Any]] = set()
_Function = TypeVar("_Function", bound=Callable[..., Any])


#: Plain functions compiled kernels call per element, inlined into each caller (see
#: :func:`inlined`).
_INLINED: set[Callable[..., Any]] = set()


def inlined(function: _Function) -> _Function:
    """Mark a plain function that kernels call (``calls``) once per element to be compiled
    into each caller's own code (numba's ``inline="always"``): a call per block of a long
    prompt costs otherwise some 10 % of a pass. Only for small functions: inlining every
    callee would triple the first compile."""
    _INLINED.add(function)
    return function


def _callable_from_kernels(numba: Any, function: Callable[..., Any]) -> None:
    """Let compiled code call ``function`` (numba compiles it into each caller); from Python
    it stays the plain function."""
    if function not in _CALLABLE:
        if function in _INLINED:
            numba.extending.register_jitable(inline="always")(function)
        else:
            numba.extending.register_jitable(function)
        _CALLABLE.add(function)


def read_only(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` made read-only, for examples: numba compiles a separate version for read-only
    arrays (a lifecycle table's per-state facts, a machine's state view)."""
    array.flags.writeable = False
    return array


#: Every kernel, for :func:`warm_up` and the differential test.
_KERNELS: list[Kernel] = []


def kernel(*, example: Example, twin: Callable[..., Any] | None = None,
           inputs: Inputs | None = None, calls: tuple[Callable[..., Any], ...] = ()
           ) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorator making a :class:`Kernel` and registering it in ``_KERNELS``.

    ``example()`` returns small arguments of exactly the types the call site passes (numba
    compiles one version per argument types), so :func:`warm_up` compiles the version the hot
    path will use. ``twin`` is the NumPy implementation, taking the same arguments and writing
    the same answer into ``out`` (None: a loop with no vectorized form, whose plain-Python
    function serves as its twin). ``inputs(rng)`` returns random valid arguments (from a
    ``numpy.random.Generator``), varied enough that a twin differing from the kernel on some
    valid input shows in a few hundred draws; the lookup's and the lease's kernels have
    theirs in ``tests/kernel_inputs.py`` instead (test code kept out of the package).

    ``calls`` names the plain functions (numba-compilable, like a kernel's body) that the
    kernel's body calls, so one compiled pass can run another kernel's loop. numba's disk
    cache checks only the body's file: the files of callees defined elsewhere are added to the
    kernel's cache stamp (:func:`_stamp_callees`), so a changed callee compiles it again."""

    def decorate(function: Callable[..., Any]) -> Kernel:
        wrapped = Kernel(function, example=example, twin=twin, inputs=inputs, calls=calls)
        _KERNELS.append(wrapped)
        return wrapped

    return decorate


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel, so no request pays for it. Cheap once
    done: each call then runs a kernel on a few elements. The first time on a machine it
    compiles for some seconds: a kernel that takes long prints one line on stderr saying so."""
    if not settings.enabled:
        return
    if not settings.available:  # installed, but it fails to import: the twins serve
        settings.enabled = False
        return
    told = False
    for done, each in enumerate(_KERNELS):
        started = time.perf_counter()
        each.compiled(*each.example())
        if not told and time.perf_counter() - started > SLOW_COMPILE_S:
            told = True
            print(f"kvfsm: compiling {len(_KERNELS) - done} lookup kernels (first use on this "
                  "machine, about 20 s; cached on disk afterwards) ...", file=sys.stderr,
                  flush=True)
