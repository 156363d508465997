"""Where the shipped specs are, and how paths given on the command line expand to spec files."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

from kvfsm._errors import KvfsmError
from kvfsm.spec._loader import load_lifecycle
from kvfsm.spec._model import Lifecycle


def shipped_specs_dir() -> Path:
    """The ``specs`` folder: inside the wheel (``kvfsm/_specs``) or beside the package in a
    source checkout / editable install."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "_specs", package.parent / "specs"):
        if (candidate / "lifecycles").is_dir():
            return candidate
    raise KvfsmError(f"shipped specs not found next to {package}; reinstall kvfsm")


def spec_files(paths: Iterable[str | Path]) -> list[Path]:
    """Every ``*.toml`` under the given files and folders, sorted, without repeats."""
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.update(p for p in path.rglob("*.toml") if p.is_file())
        elif path.exists():
            found.add(path)
        else:
            raise KvfsmError(f"{path}: no such file or folder")
    return sorted(found)


def shipped_lifecycles() -> dict[str, Lifecycle]:
    """Every shipped lifecycle, by name (loaded once; the values are frozen)."""
    return dict(_shipped_lifecycles())


@functools.cache
def _shipped_lifecycles() -> dict[str, Lifecycle]:
    out: dict[str, Lifecycle] = {}
    for path in spec_files([shipped_specs_dir() / "lifecycles"]):
        lifecycle = load_lifecycle(path)
        out[lifecycle.name] = lifecycle
    return out
