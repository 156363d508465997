"""docs/performance.md against the tools that make its figures: every command the page names
exists and answers ``--help``, every report key it quotes is one its command writes, and no
figure was left as a placeholder. (The commands themselves run at tiny sizes in their own test
files: tests/test_bench_lookup.py, tests/test_bench_pools.py, tests/test_peer_bench.py,
tests/test_bench_restore.py; tests/test_vllm_*.py run the real vLLM the overhead tool drives.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"

#: The source files whose reports a command's keys come from.
SOURCES = {
    "kvfsm bench lookup": ["kvfsm/bench/_lookup.py", "kvfsm/bench/_pools.py"],
    "kvfsm bench restore": ["kvfsm/bench/_restore.py"],
    "tools/peer_bench.py": ["tools/peer_bench.py"],
    "tools/vllm_overhead.py": ["tools/vllm_overhead.py"],
    "tools/bench_hashing.py": ["tools/bench_hashing.py"],
    "tools/ab_bench.py": ["tools/ab_bench.py"],
    "tools/code_size.py": ["tools/code_size.py"],
}


def _section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _rows(section: str) -> list[list[str]]:
    """The body rows of the section's first table, cells stripped."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _command(cell: str) -> str:
    """The command a table cell names (``kvfsm bench lookup --json`` -> its SOURCES key)."""
    for command in SOURCES:
        if command in cell:
            return command
    raise AssertionError(f"docs/performance.md names a command no test knows: {cell!r}")


def test_every_target_quotes_a_key_its_command_writes() -> None:
    """Each row of the targets table names a command and a report key; the key is a string
    the command's source writes into its report."""
    rows = _rows(_section("Targets"))
    assert rows, "the targets table is empty"
    for target, command_cell, key_cell, now, met in rows:
        sources = "".join((ROOT / path).read_text(encoding="utf-8")
                          for path in SOURCES[_command(command_cell)])
        keys = re.findall(r"`([a-z_]+)`", key_cell)
        assert keys, f"target {target!r} quotes no key"
        for key in keys:
            assert f'"{key}' in sources or f"'{key}" in sources, (target, key)
        assert now, f"target {target!r} has no figure"
        assert met.startswith(("yes", "no")), (target, met)


@pytest.mark.parametrize("row", range(len(_rows(_section("The commands")))))
def test_every_command_of_the_page_answers_help(row: int) -> None:
    """Each command of the commands table exists and prints its usage."""
    cell = _rows(_section("The commands"))[row][0]
    command = _command(cell)
    if command.startswith("kvfsm "):
        argv = [sys.executable, "-m", "kvfsm", "bench", "--help"]
        sub = command.split()[-1]
    else:
        argv, sub = [sys.executable, str(ROOT / command), "--help"], "usage"
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sub in done.stdout, (command, done.stdout[:500])


def test_no_figure_is_left_a_placeholder() -> None:
    """Every figure of the page was filled in from a run."""
    text = PAGE.read_text(encoding="utf-8")
    assert "⟨" not in text and "TBD" not in text
