"""The size of kvfsm's hot path: the lookup and the lease (``kvfsm/lookup/``, with the touch and
the prompt they run on in ``kvfsm/state/``), in lines, and its longest function.

Usage: ``python tools/code_size.py [--json]``. Reports ``lookup_lease_lines`` (every line of
those files: code, docstrings, comments, blanks), ``code_lines`` (without docstrings,
comments and blank lines) and ``longest_function`` (its ``name``, ``file`` and ``lines``,
nested functions counted apart).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The files of the lookup and the lease.
FILES = (*sorted(str(path.relative_to(ROOT)) for path in (ROOT / "kvfsm" / "lookup").glob("*.py")),
         "kvfsm/state/_touch.py", "kvfsm/state/_prompt.py")


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The line numbers of every module, class and function docstring."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            first = node.body[0]
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _code_lines(source: str, tree: ast.Module) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docs = _docstring_lines(tree)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comment_only = {token.start[0] for token in tokens
                    if token.type == tokenize.COMMENT and not token.line[:token.start[1]].strip()}
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and number not in docs and number not in comment_only)


def measure(files: tuple[str, ...] = FILES) -> dict[str, Any]:
    """The report (see the module docstring) of ``files``, paths relative to the repository."""
    total = code = 0
    longest: dict[str, Any] = {"name": "", "file": "", "lines": 0}
    for name in files:
        source = (ROOT / name).read_text(encoding="utf-8")
        tree = ast.parse(source)
        total += len(source.splitlines())
        code += _code_lines(source, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                nested = sum((inner.end_lineno or 0) - inner.lineno + 1
                             for inner in ast.walk(node) if inner is not node
                             and isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef))
                lines = (node.end_lineno or node.lineno) - node.lineno + 1 - nested
                if lines > longest["lines"]:
                    longest = {"name": node.name, "file": name, "lines": lines}
    return {"files": list(files), "lookup_lease_lines": total, "code_lines": code,
            "longest_function": longest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    report = measure()
    if parser.parse_args().json:
        print(json.dumps(report, indent=2))
        return
    longest = report["longest_function"]
    print(f"{len(report['files'])} files: {report['lookup_lease_lines']} lines, "
          f"{report['code_lines']} of code; longest function {longest['name']} "
          f"({longest['file']}) {longest['lines']} lines")


if __name__ == "__main__":
    main()
