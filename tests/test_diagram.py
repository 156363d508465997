"""Diagrams come from `transitions`' GraphMachine in every format it can produce here."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from kvfsm import KvfsmError
from kvfsm.fsm import diagram, lifecycle_page, svg_spec_hash
from kvfsm.spec import shipped_lifecycles

LIFECYCLE = shipped_lifecycles()["full_kv"]
INSTALL_HINT = 'pip install "kvfsm[diagrams]"'


def hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` (graphviz or pygraphviz) look uninstalled, to kvfsm and to `transitions`'
    backend module, which imported it (or not) once at its own import."""
    monkeypatch.setitem(sys.modules, package, None)
    backend = importlib.import_module(f"transitions.extensions.diagrams_{package}")
    monkeypatch.setattr(backend, "pgv", None)


def test_mermaid_names_every_state_and_row() -> None:
    text = diagram(LIFECYCLE, "mermaid").decode()
    assert "stateDiagram-v2" in text
    for state in LIFECYCLE.state_names:
        assert f'state "{state}" as {state}' in text
    assert "free --> allocated: allocate [has_room:device]" in text
    # GraphMachine merges rows that share source and dest into one edge ("evict | invalidate").
    edges = {(row.source, row.dest) for row in LIFECYCLE.rows}
    assert text.count("-->") == len(edges) + 1  # plus the arrow into the initial state
    assert "host --> free: evict | invalidate" in text


@pytest.mark.skipif(importlib.util.find_spec("graphviz") is None, reason="graphviz not installed")
def test_dot_is_a_digraph_with_every_row() -> None:
    text = diagram(LIFECYCLE, "dot").decode()
    assert text.startswith("digraph full_kv")
    assert "restore_done [checksum_ok]" in text


@pytest.mark.skipif(
    importlib.util.find_spec("pygraphviz") is None,
    reason="pygraphviz (diagrams extra) not installed",
)
def test_svg_and_png_render() -> None:
    svg = diagram(LIFECYCLE, "svg").decode()
    assert "<svg" in svg
    assert svg_spec_hash(svg) == LIFECYCLE.spec_hash
    png = diagram(LIFECYCLE, "png")
    assert png.startswith(b"\x89PNG")
    # Drawn top to bottom: no lifecycle is a strip many times wider than high (5824 x 580 px
    # for full_kv when drawn left to right).
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width <= 2 * height, (width, height)


def test_unknown_format_is_refused() -> None:
    with pytest.raises(KvfsmError, match="unknown diagram format 'gif'"):
        diagram(LIFECYCLE, "gif")


def test_page_has_a_row_per_state_and_transition() -> None:
    page = lifecycle_page(LIFECYCLE)
    assert f"# Lifecycle `{LIFECYCLE.name}`" in page
    assert "```mermaid" in page
    for state in LIFECYCLE.states:
        assert f"| `{state.name}` |" in page
    for row in LIFECYCLE.rows:
        assert f"| {row.index} | `{row.source}` | `{row.event.spec_name}` | `{row.dest}` |" in page


def test_dot_without_graphviz_is_refused_not_mermaid(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_package(monkeypatch, "graphviz")
    with pytest.raises(KvfsmError) as caught:
        diagram(LIFECYCLE, "dot")
    message = str(caught.value)
    assert "'graphviz'" in message and INSTALL_HINT in message
    assert "\n" not in message


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_rendered_formats_without_pygraphviz_are_refused(
    monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    hide_package(monkeypatch, "pygraphviz")
    with pytest.raises(KvfsmError, match=r"'pygraphviz'.*pip install \"kvfsm\[diagrams\]\""):
        diagram(LIFECYCLE, fmt)

