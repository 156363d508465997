"""docs/demo.md shows a run of the current code: the figures of ``kvfsm demo --json`` (the
README's main job) that are the same on every run are the ones in docs/demo/report.json, which
the page's report was written with. Under CI the demo runs as a user runs it: the ``kvfsm``
script of the environment the README's first command installs (``.ci/run`` builds it and names
it in ``KVFSM_MAIN_VENV``); elsewhere it runs in this process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvfsm.cli import main

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: The environment the README's main-job command installed (set by .ci/run).
MAIN_VENV = "KVFSM_MAIN_VENV"
#: Seconds a demo run may take (about two minutes on two busy cores).
DEMO_TIMEOUT_S = 900
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


def _installed(venv: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A program of the environment (``bin/<argv[0]>``), run outside the repository and
    without this checkout on the path: the installed kvfsm, not the source tree."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False)


def _demo(out: Path) -> dict[str, Any]:
    """``kvfsm demo --json -q -o out``: through the README environment's ``kvfsm`` script
    where .ci/run built one (as a user runs it: the remote tier left to ``auto``, which finds
    no client there), else in this process with ``--remote none``, what the README's install
    gives (this environment may hold a remote client and server)."""
    venv = os.environ.get(MAIN_VENV)
    argv = ["demo", "--json", "-q", "-o", str(out)]
    if venv:
        done = _installed(Path(venv), ["kvfsm", *argv], out.parent)
        assert done.returncode == 0, done.stderr[-4000:]
        ran: dict[str, Any] = json.loads(done.stdout)
        return ran
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*argv, "--remote", "none"]) == 0
    ran = json.loads(stdout.getvalue())
    return ran


def test_docs_demo_matches_a_run_of_the_main_job(tmp_path: Path) -> None:
    """Regenerate docs/demo.md and docs/demo/ with ``kvfsm demo -o <dir>`` when this fails."""
    ran = _demo(tmp_path / "demo")
    documented = json.loads((DOCS / "demo" / "report.json").read_text(encoding="utf-8"))
    assert ran["remote"] == documented["remote"], (
        f"this demo ran with remote tier {ran['remote']!r} ({ran.get('remote_note')}); "
        f"docs/demo was written with {documented['remote']!r}")
    assert _fixed(ran) == _fixed(documented)
    page = (DOCS / "demo.md").read_text(encoding="utf-8")
    assert f"{ran['naive_wrong']} |" in page and f"{ran['requests']} |" in page


def test_the_readme_environment_holds_kvfsm_installed_and_the_cpu_torch(
        tmp_path: Path) -> None:
    """The README's main-job command installs kvfsm itself (not an editable link to the
    source tree) and, with torch pinned on the line, the CPU build of that torch."""
    venv = os.environ.get(MAIN_VENV)
    if not venv:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MAIN_VENV} is not set under CI: .ci/run builds the README's "
                        "main-job environment and names it there")
        pytest.skip(f"{MAIN_VENV} names no environment installed by the README's main job")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pinned = re.search(r"^python3 -m venv .*pip install torch==([\d.]+) .*&& kvfsm demo$",
                       readme, re.MULTILINE)
    assert pinned, "the README's main-job line pins no torch"
    done = _installed(Path(venv), ["python", "-c", "import json, kvfsm, torch; print(json.dumps("
                      "{'kvfsm': kvfsm.__file__, 'torch': torch.__version__}))"], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout)
    assert Path(found["kvfsm"]).resolve().is_relative_to(Path(venv).resolve()), found
    assert found["torch"] == f"{pinned.group(1)}+cpu"
