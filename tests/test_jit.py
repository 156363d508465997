"""Compiled kernels: same answers as their NumPy twins and their plain-Python source (one
differential test for every registered kernel), compiled before the first request, and a clean
NumPy fallback when numba is missing or disabled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Imported for their kernels: each registers itself in _KERNELS.
import kvfsm
import kvfsm.lookup._group_pass
import kvfsm.lookup._lease_pass
import kvfsm.lookup._snapshot
import kvfsm.state._hashtable
import kvfsm.state._touch
from kvfsm._addressed import AddressTable
from kvfsm._jit import _KERNELS, Kernel, warm_up
from kvfsm._jit import settings as jit
from kvfsm.lookup import Level
from kvfsm.spec._shipped import shipped_specs_dir
from tests import kernel_inputs
from tests.lookup_models import DEEPSEEK, FOUR, GPT_OSS, PROMPTS, drive, engine

# The hash kernel's plain-Python runs wrap uint64 arithmetic on purpose (the hash is defined
# modulo 2**64); NumPy warns about each wrap.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning")

needs_numba = pytest.mark.skipif(not jit.available, reason="numba is not installed")


#: Every kernel of the lookup path; each must give random inputs for the differential test.
LOOKUP_KERNELS = {
    kvfsm.state._hashtable.probe_kernel,
    kvfsm.lookup._group_pass.group_pass,
    kvfsm.lookup._snapshot.take_snapshot,
}


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (the environment decides numba's use at import)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, env={**os.environ, **env}, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@needs_numba
@settings(max_examples=60, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, FOUR, GPT_OSS]))
def test_compiled_and_numpy_lookups_agree(data: st.DataObject, decl: object) -> None:
    """For any state the drive reaches (scrambled index references included), the verdict is
    the same whether the probes and reference checks run compiled or as NumPy arrays, at every
    level."""
    eng = engine(decl, device=24, host=6)  # type: ignore[arg-type]
    drive(eng, data, data.draw(st.integers(1, 12), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="lookup prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    level = data.draw(st.sampled_from(list(Level)), label="level")
    with jit.using(False):
        expected = eng.lookup(prompt, level=level)
    assert eng.lookup(prompt, level=level) == expected


@needs_numba
def test_warm_up_compiles_the_version_every_lookup_uses() -> None:
    """After warm-up, lookups over a model with every kind of group (hits, misses, a spilled
    block) compile nothing more: no request pays for compiling."""
    warm_up()
    # By kernel, not name: two modules may each have a loop of the same name.
    compiled = {id(each): set(each.compiled.signatures)  # type: ignore[attr-defined]
                for each in _KERNELS}
    eng = engine(FOUR)
    text = PROMPTS[0]
    eng.commit(eng.prompt(text))
    eng.core.fire("history", [0], "spill_begin")
    for prompt in (text, PROMPTS[1], text[:40]):
        eng.lookup(prompt)
    for each in _KERNELS:
        assert set(each.compiled.signatures) == compiled[id(each)], each.__name__  # type: ignore[attr-defined]


def test_importing_kvfsm_does_not_import_numba() -> None:
    """numba costs a quarter of a second to import: only a lookup (or warm-up) pays it."""
    assert _python("import sys, kvfsm; print('numba' in sys.modules)") == "False"


def test_disabled_by_environment_falls_back_to_numpy() -> None:
    out = _python("""
        import sys
        import numpy as np
        from kvfsm import Engine, shipped_models
        from kvfsm._jit import settings
        from kvfsm.state import CoreConfig
        eng = Engine(shipped_models()["deepseek_v4_like"],
                     CoreConfig(device_blocks=64, host_blocks=0, backend="numpy"))
        text = np.arange(400)
        eng.commit(eng.prompt(text))
        try:
            settings.enabled = True
        except ValueError as error:
            refused = "unavailable" in str(error)
        print(settings.backend, eng.lookup(text).usable_tokens, "numba" in sys.modules, refused)
    """, KVFSM_JIT="0")
    assert out == "numpy 384 False True"


def test_a_numba_that_fails_to_import_leaves_the_numpy_twins_serving(tmp_path: Path) -> None:
    """numba found installed but failing to import (a broken wheel): kernels start enabled
    (found without importing it), an engine's warm-up finds the failure and turns them off,
    and lookups answer through the NumPy twins."""
    broken = tmp_path / "numba"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a broken numba')\n")
    out = _python("""
        import numpy as np
        from kvfsm import Engine, shipped_models
        from kvfsm._jit import settings
        from kvfsm.state import CoreConfig
        found = settings.enabled
        eng = Engine(shipped_models()["deepseek_v4_like"],
                     CoreConfig(device_blocks=64, host_blocks=0, backend="numpy"))
        text = np.arange(400)
        eng.commit(eng.prompt(text))
        print(found, settings.enabled, settings.backend, eng.lookup(text).usable_tokens)
    """, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    assert out == "True False numpy 384"
    # Without an engine's warm-up: the first kernel call finds it, and the
    # twins serve from then on.
    out = _python("""
        from kvfsm._jit import settings
        from kvfsm.state._hashtable import probe_kernel
        args = probe_kernel.example()
        found = settings.enabled
        probe_kernel(*args)
        print(found, settings.enabled, probe_kernel.run is probe_kernel.twin, args[5].tolist())
    """, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    assert out == "True False True [-1]"


def test_a_locked_down_install_compiles_once_caches_in_tmp_and_says_so() -> None:
    """A read-only install run with no writable home (numba finds no place for its disk cache:
    "no locator available" before) gives a working engine: the kernels cache in a per-user
    directory under the temporary directory, with one warning, the first start says on stderr
    that it is compiling, and a second start loads them. As root (who may write anywhere) the
    install and home are a read-only bind mount in a mount namespace of their own."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="kvfsm-ro-"))
    cache = Path(tempfile.gettempdir()) / f"kvfsm-numba-cache-{os.geteuid()}"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        # An installed wheel's layout: the package with its specs inside (kvfsm/_specs).
        shutil.copytree(Path(kvfsm.__file__).parent, root / "kvfsm",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(shipped_specs_dir(), root / "kvfsm" / "_specs")
        (root / "home").mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA", "XDG"))}
        env |= {"HOME": str(root / "home"), "PYTHONPATH": str(root), "KVFSM_JIT": "1"}
        script = ("from kvfsm import Engine, CoreConfig; e = Engine('dense', CoreConfig()); "
                  "import numpy as np; e.commit(e.prompt(np.arange(33))); "
                  "print(e.lookup(np.arange(33)).usable_tokens)")
        command = [sys.executable, "-c", script]
        if os.geteuid() == 0:
            bind = f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && exec \"$@\""
            command = ["unshare", "-m", "--propagation", "private", "sh", "-c", bind, "-",
                       *command]
        else:
            for path in [root, *root.rglob("*")]:
                path.chmod(0o555 if path.is_dir() else 0o444)
        runs = [subprocess.run(command, env=env, cwd=root, capture_output=True, text=True,
                               timeout=600, check=False) for _ in range(2)]
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    first, second = runs
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split() == ["32"]
    assert "no locator" not in first.stderr
    assert first.stderr.count("compiled kernels are cached in") == 1
    assert "compiling" in first.stderr and "first use" in first.stderr
    assert second.returncode == 0 and second.stdout.split() == ["32"], second.stderr[-2000:]
    assert "compiling" not in second.stderr  # loaded from the cache it made


def test_reading_whether_kernels_are_compiled_is_an_attribute_read() -> None:
    """``settings.enabled`` is read on every kernel call: a plain attribute (no property, no
    ``__getattr__``), still refusing to be turned on where numba is unavailable."""
    assert "enabled" in vars(jit) and "enabled" not in vars(type(jit))
    assert not hasattr(type(jit), "__getattr__")


def test_without_numba_a_kernel_runs_its_twin_and_compiling_says_why() -> None:
    out = _python("""
        import sys
        from kvfsm.state._hashtable import probe_kernel
        args = probe_kernel.example()
        probe_kernel(*args)
        try:
            probe_kernel.compiled
        except RuntimeError as error:
            print(args[5].tolist(), "numba" in sys.modules, "KVFSM_JIT=0" in str(error))
    """, KVFSM_JIT="off")
    assert out == "[-1] False True"


def _copied(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Fresh copies of the array arguments (read-only ones stay read-only: numba compiles a
    separate version for them, and the call sites pass them so)."""
    def copy(value: Any) -> Any:
        if isinstance(value, tuple):  # a kernel over several groups takes tuples of arrays
            return tuple(copy(each) for each in value)
        if isinstance(value, AddressTable):  # what it addresses, copied (a kernel writes it)
            return value.deep_copy()
        if not isinstance(value, np.ndarray):
            return value
        fresh = value.copy()
        fresh.flags.writeable = value.flags.writeable
        return fresh

    return tuple(copy(value) for value in args)


def _written(function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every argument after ``function`` ran on copies of ``args`` (``out`` included), then
    what it returned (as a list of ints where it returned numbers)."""
    fresh = _copied(args)
    returned = function(*fresh)
    if isinstance(returned, tuple):
        returned = [int(each) for each in returned]
    return (*fresh, returned)


def _arrays_of(args: tuple[Any, ...]) -> list[Any]:
    """The arguments with tuples (of a kernel over several groups) opened, in order, and an
    address table as the arrays it addresses (their contents are compared, not where they
    lie)."""
    return [inner for value in args
            for inner in (_arrays_of(value) if isinstance(value, tuple)
                          else list(value.held) if isinstance(value, AddressTable)
                          else [value])]


#: Random valid inputs per kernel: the lookup's and the lease's from tests/kernel_inputs.py,
#: the others' as their kernels register them.
INPUTS: dict[Kernel, Callable[[np.random.Generator], tuple[object, ...]]] = {
    **{each: each.inputs for each in _KERNELS if each.inputs is not None},
    kvfsm.state._hashtable.probe_kernel: kernel_inputs.probe_inputs,
    kvfsm.lookup._group_pass.group_pass: kernel_inputs.group_pass_inputs,
    kvfsm.lookup._snapshot.take_snapshot: kernel_inputs.take_snapshot_inputs,
    kvfsm.state._touch.touch_kernel: kernel_inputs.touch_kernel_inputs,
    kvfsm.lookup._lease_pass.first_moved_kernel: kernel_inputs.moved_inputs,
    kvfsm.lookup._lease_pass.take_probed_kernel: kernel_inputs.take_probed_inputs,
    kvfsm.lookup._lease_pass.unpin_probed_kernel: kernel_inputs.unpin_probed_inputs,
}


def test_every_lookup_kernel_has_a_twin_and_inputs() -> None:
    assert set(INPUTS) >= LOOKUP_KERNELS
    for each in LOOKUP_KERNELS:
        assert each.twin is not each.python, each.__name__


@pytest.mark.parametrize("each", [
    pytest.param(each, id=each.__name__, marks=pytest.mark.skipif(
        each not in INPUTS, reason=f"{each.__name__} has no random inputs"))
    for each in _KERNELS])
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_kernel_agrees_compiled_as_twin_and_as_python(each: Kernel, seed: int) -> None:
    """For random valid inputs, the plain-Python function, the NumPy twin, the compiled version
    (where numba is available) and the kernel called either way leave the same arguments:
    ``out`` the same, and the inputs as they were (or changed alike)."""
    args = INPUTS[each](np.random.default_rng(seed))
    runs: dict[str, Callable[..., None]] = {
        "python": each.python, "twin": each.twin, "call, numpy": each}
    with jit.using(False):
        results = {name: _written(run, args) for name, run in runs.items()}
    if jit.available:
        results["compiled"] = _written(each.compiled, args)
        with jit.using(True):
            results["call, numba"] = _written(each, args)
    expected = _arrays_of(results.pop("python"))
    for name, got in results.items():
        for i, (want, value) in enumerate(zip(expected, _arrays_of(got), strict=True)):
            if isinstance(want, np.ndarray):
                assert value.dtype == want.dtype and value.tolist() == want.tolist(), \
                    f"{each.__name__} {name}: argument {i} differs from the Python function's"
        assert got[-1] == expected[-1], \
            f"{each.__name__} {name}: returned {got[-1]!r}, the Python function {expected[-1]!r}"


@needs_numba
def test_python_and_compiled_kernels_agree_on_their_examples() -> None:
    """The uncompiled function is the compiled one's source; on the examples both write the
    same answer."""
    for each in _KERNELS:
        slow, fast = each.example(), each.example()
        each.python(*slow)
        each(*fast)
        for a, b in zip(_arrays_of(slow), _arrays_of(fast), strict=True):
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b), each.__name__


@needs_numba
@pytest.mark.parametrize("decl", [DEEPSEEK, FOUR, GPT_OSS], ids=lambda decl: decl.name)
def test_lookups_of_prompts_made_every_way_match_the_numpy_lookup(decl: Any) -> None:
    """Every way a prompt is made (a list, arrays of several dtypes, a tensor, tokens
    appended in pieces) gives, at every level, the NumPy twin's verdict."""
    eng = engine(decl, device=48, host=8)
    text = PROMPTS[0]
    eng.commit(eng.prompt(text[:200]))
    torch = pytest.importorskip("torch")
    grown = eng.prompt(text[:7])
    for start in range(7, text.size, 45):
        grown.extend(text[start : start + 45])
    made = [eng.prompt(text.tolist()), eng.prompt(text.astype(np.int32)),
            eng.prompt(text.astype(np.uint16)), eng.prompt(torch.from_numpy(text)), grown,
            text[:100], text[:16]]
    for prompt in made:
        for level in Level:
            with jit.using(False):
                expected = eng.lookup(prompt, level=level)
            assert eng.lookup(prompt, level=level) == expected


@needs_numba
def test_a_kernel_cached_on_disk_is_compiled_again_when_a_callee_in_another_file_changes(
        tmp_path: Path) -> None:
    """numba stamps its disk cache with the kernel's own file; a kernel calling a function
    of another file (the group pass calls the hash table's probe) is compiled again when that
    file changes, not loaded with the old callee."""
    (tmp_path / "callee_file.py").write_text("def step(x):\n    return x + 1\n")
    (tmp_path / "kernel_file.py").write_text(textwrap.dedent("""
        import numpy as np
        from kvfsm._jit import kernel
        from callee_file import step

        @kernel(example=lambda: (np.zeros(1, np.int64),), calls=(step,))
        def bump(out):
            out[0] = step(out[0])
        """))
    code = """
        import sys, numpy as np
        sys.path.insert(0, sys.argv[1])
        import kernel_file
        out = np.zeros(1, np.int64)
        kernel_file.bump.compiled(out)
        print(out[0])
        """
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}

    def run() -> str:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
                                capture_output=True, text=True, env={**os.environ, **env},
                                check=False, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert run() == "1"
    assert run() == "1"  # loaded from the disk cache
    assert any((tmp_path / "cache").rglob("*.nbi"))
    (tmp_path / "callee_file.py").write_text("def step(x):\n    return x + 2\n")
    assert run() == "2"


def test_using_restores_the_setting_even_after_an_error() -> None:
    before = jit.enabled
    with pytest.raises(KeyError), jit.using(False):
        assert jit.backend == "numpy"
        raise KeyError("boom")
    assert jit.enabled == before
