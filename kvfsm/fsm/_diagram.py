"""Diagrams of lifecycles via `transitions`' GraphMachine, and the generated docs page per spec.

Mermaid text needs nothing beyond `transitions`; DOT text needs the pure-Python `graphviz`
package; PNG and SVG need pygraphviz (system graphviz), installed by the ``diagrams`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

from kvfsm._errors import KvfsmError
from kvfsm.fsm._reference import transitions_rows
from kvfsm.spec._model import Lifecycle

FORMATS: Final = ("mermaid", "dot", "png", "svg")
Engine = Literal["mermaid", "graphviz", "pygraphviz"]
_ENGINES: Final[dict[str, Engine]] = {
    "mermaid": "mermaid",
    "dot": "graphviz",
    "png": "pygraphviz",
    "svg": "pygraphviz",
}
_HASH_MARK: Final = "kvfsm spec sha256:"


class _Model:
    """A bare model object for GraphMachine to attach ``get_graph`` to."""


def _graph(lifecycle: Lifecycle, engine: Engine) -> Any:
    try:
        from transitions.extensions import GraphMachine
    except ImportError as exc:  # pragma: no cover - transitions always ships it
        raise KvfsmError(f"transitions' GraphMachine unavailable: {exc}") from exc
    model = _Model()
    try:
        GraphMachine(
            model=model,
            states=list(lifecycle.state_names),
            transitions=transitions_rows(lifecycle, None),
            initial=lifecycle.initial,
            auto_transitions=False,
            show_conditions=True,
            graph_engine=engine,
            title=lifecycle.name,
        )
    except ImportError as exc:
        extra = "pip install 'kvfsm[diagrams]'" + (
            " (pygraphviz needs the system graphviz library)" if engine == "pygraphviz" else ""
        )
        raise KvfsmError(f"{engine} engine not installed for this diagram format: {extra}") from exc
    return model.get_graph()  # type: ignore[attr-defined]


def diagram(lifecycle: Lifecycle, fmt: str) -> bytes:
    """The diagram of ``lifecycle`` in ``fmt`` (one of :data:`FORMATS`), as bytes."""
    if fmt not in FORMATS:
        raise KvfsmError(f"unknown diagram format {fmt!r}; expected one of {list(FORMATS)}")
    graph = _graph(lifecycle, _ENGINES[fmt])
    if fmt == "mermaid":
        return str(graph.draw(None)).encode("utf-8")
    if fmt == "dot":
        return str(graph.source).encode("utf-8")
    data = graph.draw(None, prog="dot", format=fmt)
    if fmt == "svg":
        # Rendered bytes differ across graphviz versions; the spec hash says which spec drew them.
        text = bytes(data).decode("utf-8")
        head, sep, rest = text.partition("?>")
        mark = f"\n<!-- {_HASH_MARK} {lifecycle.spec_hash} -->"
        return (head + sep + mark + rest if sep else mark + text).encode("utf-8")
    return bytes(data)


def svg_spec_hash(svg: str) -> str | None:
    """The spec hash recorded in an SVG written by :func:`diagram`."""
    _, sep, rest = svg.partition(_HASH_MARK)
    return rest.split()[0] if sep else None


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def lifecycle_page(lifecycle: Lifecycle) -> str:
    """The markdown page documenting ``lifecycle``: words, diagram, states and rows tables."""
    spec_file = Path(lifecycle.source).name
    mermaid = diagram(lifecycle, "mermaid").decode("utf-8").rstrip()
    lines = [
        f"<!-- Generated from specs/lifecycles/{spec_file} by `python tools/regen_docs.py`; "
        "do not edit. -->",
        f"<!-- {_HASH_MARK} {lifecycle.spec_hash} -->",
        f"# Lifecycle `{lifecycle.name}`",
        "",
        _cell(lifecycle.description),
        "",
        f"Initial (free) state: `{lifecycle.initial}`. "
        f"Tiers: {', '.join(t.spec_name for t in lifecycle.tiers) or 'none'}.",
        "",
        "## Diagram",
        "",
        "```mermaid",
        mermaid,
        "```",
        "",
        f"Rendered: [{lifecycle.name}.svg]({lifecycle.name}.svg)",
        "",
        "## States",
        "",
        "| state | slots | residency | content | form | readable | hashed | in flight | meaning |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: ""}
    for s in lifecycle.states:
        lines.append(
            f"| `{s.name}` | {', '.join(t.spec_name for t in s.slots)} | "
            f"{s.residency.spec_name if s.residency is not None else ''} | {s.content.value} | "
            f"{s.form.value} | {yes[s.readable]} | {yes[s.hashed]} | {yes[s.in_flight]} | "
            f"{_cell(s.doc)} |"
        )
    lines += [
        "",
        "## Transitions",
        "",
        "| # | source | event | dest | guards | effects | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in lifecycle.rows:
        lines.append(
            f"| {r.index} | `{r.source}` | `{r.event.spec_name}` | `{r.dest}` | "
            f"{', '.join(f'`{c}`' for c in r.guards)} | "
            f"{', '.join(f'`{c}`' for c in r.effects)} | {_cell(r.doc)} |"
        )
    return "\n".join(lines) + "\n"
