"""tools/code_size.py: the size of the lookup and the lease that docs/performance.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_counts_every_file_of_the_lookup_and_lease() -> None:
    """Every line of the files is counted once; code lines are fewer (docstrings, comments and
    blank lines left out); the longest function is one of theirs, no longer than its file."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "code_size.py"), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    files = report["files"]
    assert "kvfsm/lookup/_lookup.py" in files and "kvfsm/state/_touch.py" in files
    lines = sum(len((ROOT / name).read_text(encoding="utf-8").splitlines()) for name in files)
    assert report["lookup_lease_lines"] == lines
    assert 0 < report["code_lines"] < lines
    longest = report["longest_function"]
    assert longest["file"] in files
    assert 0 < longest["lines"] <= len((ROOT / longest["file"]).read_text().splitlines())
    assert f"def {longest['name']}(" in (ROOT / longest["file"]).read_text(encoding="utf-8")
