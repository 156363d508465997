"""The README stays true: its Python snippets (embedding, tiers, gates) run as written, one after
the other as a reader would paste them, with only the tiers' example addresses pointed at a
directory and a Mooncake master of this machine; its quickstart's test command is what CI runs,
and CI installs the main job from the quickstart's first command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from tests.remote_servers import start_mooncake_master

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: The addresses the README's tiers snippet names for a reader's machines.
DISK_DIR, MASTER = '"/var/cache/kvfsm"', '"10.0.0.5:50051"'


def test_the_python_snippets_run_as_written(tmp_path: Path) -> None:
    blocks = BLOCK.findall(README)
    assert len(blocks) == 3
    assert all(DISK_DIR in code and MASTER in code for code in blocks[1:2])
    master = start_mooncake_master()
    try:
        namespace: dict[str, object] = {
            "__name__": "readme", "token_ids": np.arange(1000, 1000 + 300)}
        for number, code in enumerate(blocks, start=1):
            code = code.replace(DISK_DIR, repr(str(tmp_path))).replace(
                MASTER, repr(master.address))
            exec(compile(code, f"README python block #{number}", "exec"), namespace)
        engine = namespace["engine"]
        engine.close()  # type: ignore[attr-defined]
    finally:
        master.stop()


def test_the_quickstart_test_command_is_what_ci_runs() -> None:
    """The README's test line installs exactly as .ci/run does, then runs the same pytest."""
    (line,) = [line for line in README.splitlines()
               if line.startswith("python3 -m venv") and "python -m pytest -q" in line]
    install = line.split("pip install ", 1)[1].split(" && ")[0]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"pip install --quiet {install}" in ci
    assert ci.rstrip().endswith("python -m pytest -q")


def test_ci_installs_the_main_job_from_the_quickstarts_first_command() -> None:
    """.ci/run reads the quickstart's first command out of README.md (the line its pattern
    finds is that command) and runs its install into .venv-main, whose demo the tests run."""
    quickstart = README[README.index("## Quickstart"):]
    block = quickstart[quickstart.index("```bash\n") + len("```bash\n"):]
    first = next(line for line in block.splitlines() if line and not line.startswith("#"))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    pattern = re.search(r"grep -m1 -E '([^']+)' README\.md", ci)
    assert pattern, ".ci/run does not read the main job's line out of README.md"
    found = subprocess.run(["grep", "-m1", "-E", pattern.group(1), "README.md"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == first
    assert first.endswith(" && kvfsm demo") and "pip install" in first and " -e " not in first
    assert "${main_install//.venv/.venv-main}" in ci
    assert 'export KVFSM_MAIN_VENV="$PWD/.venv-main"' in ci
