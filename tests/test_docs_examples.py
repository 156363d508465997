"""The docs stay true: the Python blocks of state-core.md, verdict.md, gates.md, leases.md and
observability.md run, and the invariant tables are the code's."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvfsm.fsm import BUILTIN_INVARIANTS, Invariant
from kvfsm.state import CORE_INVARIANTS, CoreInvariant

DOC = Path(__file__).resolve().parents[1] / "docs" / "state-core.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def test_the_doc_has_python_examples() -> None:
    assert len(BLOCK.findall(_text())) >= 5


@pytest.mark.parametrize("doc", [DOC, *(DOC.with_name(name) for name in (
    "verdict.md", "gates.md", "leases.md", "observability.md"))], ids=lambda p: p.name)
def test_python_blocks_run_in_order(doc: Path) -> None:
    # One namespace, as a reader pasting them into one session would have.
    namespace: dict[str, object] = {"__name__": "doc"}
    for number, code in enumerate(BLOCK.findall(doc.read_text(encoding="utf-8")), start=1):
        try:
            exec(compile(code, f"{doc.name} python block #{number}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"{doc}: python block #{number} fails: {type(exc).__name__}: {exc}")


def _table_rows(heading: str) -> dict[str, str]:
    """``| `name` | doc |`` rows of the first table after the line ``heading``."""
    text = _text()
    start = text.index(heading + "\n")
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        found = re.fullmatch(r"\| `(\w+)` \| (.*) \|", line)
        if found:
            rows[found[1]] = found[2]
    return rows


@pytest.mark.parametrize(
    ("heading", "invariants"),
    [
        ("`kvfsm.state.CORE_INVARIANTS`:", CORE_INVARIANTS),
        ("`kvfsm.fsm.BUILTIN_INVARIANTS`:", BUILTIN_INVARIANTS),
    ],
    ids=["core", "builtin"],
)
def test_invariant_tables_match_the_code(
    heading: str, invariants: Sequence[Invariant | CoreInvariant]
) -> None:
    expected = [(inv.name, inv.doc) for inv in invariants]
    assert list(_table_rows(heading).items()) == expected, (
        f"{DOC}: the table after {heading} must list every invariant with its doc, in order"
    )
