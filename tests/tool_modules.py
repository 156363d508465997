"""The scripts of ``tools/`` loaded as modules, for their tests (``tools`` is no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a fresh module named ``tools_<name>``."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
