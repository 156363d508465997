"""Regenerate docs/lifecycles/: one markdown page (with a mermaid diagram) and one SVG per spec.

Run from the repository root: ``python tools/regen_docs.py``. SVG needs the ``diagrams`` extra
(pygraphviz and the system graphviz). ``tests/test_docs_sync.py`` fails when a spec changed and
its page or SVG did not.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvfsm.fsm import diagram, lifecycle_page
from kvfsm.spec import load_lifecycle, spec_files

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    out_dir = ROOT / "docs" / "lifecycles"
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in spec_files([ROOT / "specs" / "lifecycles"]):
        lifecycle = load_lifecycle(path)
        page = out_dir / f"{lifecycle.name}.md"
        page.write_text(lifecycle_page(lifecycle), encoding="utf-8")
        svg = out_dir / f"{lifecycle.name}.svg"
        svg.write_bytes(diagram(lifecycle, "svg"))
        print(f"wrote {page.relative_to(ROOT)} and {svg.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
