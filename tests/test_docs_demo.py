"""docs/demo.md shows a run of the current code: the figures of ``kvfsm demo --json`` (the
README's main job) that are the same on every run are the ones in docs/demo/report.json, which
the page's report was written with."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvfsm.cli import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: What a demo run gives the same on every run (token counts, rates, wrong outputs); times
#: and the logits' float noise vary.
FIXED = ("requests", "prompt_tokens", "hit_rate", "usable_rate", "naive_wrong", "kvfsm_wrong",
         "tokens_reused", "tokens_restored", "tokens_recomputed", "intact_tokens",
         "lost_tokens", "late_tokens", "lost_reuse", "clean_lost_reuse")


def _fixed(figures: dict[str, Any]) -> dict[str, Any]:
    out = {key: figures.get(key) for key in FIXED}
    out["models"] = {name: {key: model.get(key) for key in FIXED}
                     for name, model in figures["models"].items()}
    return out


def test_docs_demo_matches_a_run_of_the_main_job(tmp_path: Path) -> None:
    """Regenerate docs/demo.md and docs/demo/ with ``kvfsm demo -o <dir>`` when this fails."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["demo", "--json", "-q", "-o", str(tmp_path)]) == 0
    ran = json.loads(stdout.getvalue())
    documented = json.loads((DOCS / "demo" / "report.json").read_text(encoding="utf-8"))
    assert _fixed(ran) == _fixed(documented)
    page = (DOCS / "demo.md").read_text(encoding="utf-8")
    assert f"{ran['naive_wrong']} |" in page and f"{ran['requests']} |" in page
