"""The committed docs/lifecycles pages and SVGs are those of the current specs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.fsm import lifecycle_page, svg_spec_hash
from kvfsm.spec import load_lifecycle, spec_files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "lifecycles"
SPECS = spec_files([ROOT / "specs" / "lifecycles"])
FIX = "run `python tools/regen_docs.py` and commit docs/lifecycles"


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_page_matches_spec(spec: Path) -> None:
    lifecycle = load_lifecycle(spec)
    page = DOCS / f"{lifecycle.name}.md"
    assert page.exists(), f"{page} missing: {FIX}"
    assert page.read_text(encoding="utf-8") == lifecycle_page(lifecycle), f"{page} stale: {FIX}"


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_svg_was_drawn_from_this_spec(spec: Path) -> None:
    lifecycle = load_lifecycle(spec)
    svg = DOCS / f"{lifecycle.name}.svg"
    assert svg.exists(), f"{svg} missing: {FIX}"
    assert svg_spec_hash(svg.read_text(encoding="utf-8")) == lifecycle.spec_hash, (
        f"{svg} was drawn from another version of {spec.name}: {FIX}"
    )


def test_no_orphan_pages() -> None:
    names = {load_lifecycle(p).name for p in SPECS}
    for page in DOCS.glob("*.md"):
        assert page.stem in names, f"{page} documents no spec: delete it"


def test_a_changed_spec_is_detected(tmp_path: Path) -> None:
    """Editing a spec (even a comment) changes its hash, so the committed page no longer matches."""
    spec = SPECS[0]
    edited = tmp_path / spec.name
    edited.write_text(spec.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    lifecycle = load_lifecycle(edited)
    committed = (DOCS / f"{lifecycle.name}.md").read_text(encoding="utf-8")
    assert committed != lifecycle_page(lifecycle)
