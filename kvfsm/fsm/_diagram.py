"""Diagrams of lifecycles via `transitions`' GraphMachine, and the generated docs page per spec.

Mermaid text needs nothing beyond `transitions`; DOT text needs the pure-Python `graphviz`
package; PNG and SVG need pygraphviz (its wheels bundle the graphviz library). The ``diagrams``
extra installs both.
"""

from __future__ import annotations

import importlib
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
_INSTALL_HINT: Final = 'pip install "kvfsm[diagrams]"'


def _require_engine(fmt: str, engine: Engine) -> None:
    """Refuse ``fmt`` when the package of its engine is missing. Checked here because
    `transitions` would otherwise fall back, with only a log warning, to the next engine down
    (pygraphviz -> graphviz -> mermaid) and draw the wrong format."""
    if engine == "mermaid":
        return
    try:
        importlib.import_module(engine)
    except ImportError as exc:
        # Missing outright, or installed but broken (say, a shared library it links is gone).
        missing = getattr(exc, "name", None) == engine
        why = "is not installed" if missing else f"fails to import: {exc}"
        raise KvfsmError(
            f"diagram format {fmt!r} needs the Python package {engine!r}, which {why}; "
            f"install it with: {_INSTALL_HINT}"
        ) from exc


class _Model:
    """A bare model object for GraphMachine to attach ``get_graph`` to."""


def _graph(lifecycle: Lifecycle, fmt: str) -> Any:
    engine = _ENGINES[fmt]
    _require_engine(fmt, engine)
    try:
        from transitions.extensions import GraphMachine
    except ImportError as exc:  # pragma: no cover - transitions always ships it
        raise KvfsmError(f"transitions' GraphMachine unavailable: {exc}") from exc
    model = _Model()
    try:
        machine = GraphMachine(
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
        raise KvfsmError(
            f"diagram format {fmt!r}: the {engine} engine of transitions does not load ({exc}); "
            f"install it with: {_INSTALL_HINT}"
        ) from exc
    # The package imported above, yet transitions may still have fallen back (its backend
    # module caught the import failure when it was first imported).
    backend = getattr(machine.graph_cls, "__module__", "")
    if not backend.endswith(f".diagrams_{engine}"):
        raise KvfsmError(
            f"diagram format {fmt!r}: transitions drew with {backend or 'another backend'} "
            f"instead of its {engine} engine; install it with: {_INSTALL_HINT}"
        )
    return model.get_graph()  # type: ignore[attr-defined]


def diagram(lifecycle: Lifecycle, fmt: str) -> bytes:
    """The diagram of ``lifecycle`` in ``fmt`` (one of :data:`FORMATS`), as bytes."""
    if fmt not in FORMATS:
        raise KvfsmError(f"unknown diagram format {fmt!r}; expected one of {list(FORMATS)}")
    graph = _graph(lifecycle, fmt)
    if fmt == "mermaid":
        return str(graph.draw(None)).encode("utf-8")
    # Top to bottom, the way blocks sink through the tiers: left to right (transitions'
    # default) draws a lifecycle as one strip some 10 times wider than high.
    graph.graph_attr["rankdir"] = "TB"
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
