"""Read a lifecycle spec (TOML) into a validated :class:`Lifecycle`.

Every problem is collected before raising, so one run of ``kvfsm spec check`` shows all of them,
each as ``file: table: row: message``.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfsm._errors import SpecError, SpecProblem
from kvfsm.spec._model import Call, Lifecycle, Row, StateDef
from kvfsm.spec._validate import validate_lifecycle
from kvfsm.spec._vocabulary import (
    EFFECTS,
    EFFECTS_WITH_TIER,
    EVENT_NAMES,
    GUARDS,
    GUARDS_WITH_TIER,
    KIND_NAMES,
    NAME_PATTERN,
    NO_TIER,
    TIER_NAMES,
    Content,
    Event,
    Form,
    GroupKind,
    Tier,
)

_TOP_KEYS = frozenset({"lifecycle", "states", "rows"})
_LIFECYCLE_KEYS = frozenset({"name", "kind", "description", "initial"})
_STATE_KEYS = frozenset(
    {"doc", "slots", "residency", "content", "form", "readable", "hashed", "in_flight"}
)
_ROW_KEYS = frozenset({"source", "event", "dest", "guards", "effects", "doc"})
_ROW_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*rows[ \t]*\]\]", re.MULTILINE)


class _Problems:
    """Collects problems for one file."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[SpecProblem] = []

    def add(self, table: str, row: str, message: str) -> None:
        self.items.append(SpecProblem(self.source, table, row, message))

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecError(self.items)


def read_spec_text(path: Path) -> str:
    """The text of a spec file; a missing, unreadable or non-UTF-8 file is a SpecError."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError([SpecProblem(str(path), "-", "-", f"cannot read: {exc}")]) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([SpecProblem(str(path), "-", "-", f"not UTF-8: {exc}")]) from exc


def load_lifecycle(path: str | Path) -> Lifecycle:
    """Load and validate the lifecycle spec at ``path``; raises :class:`SpecError`."""
    path = Path(path)
    return parse_lifecycle(read_spec_text(path), source=str(path))


def parse_lifecycle(text: str, *, source: str = "<string>") -> Lifecycle:
    """Parse and validate lifecycle spec text; ``source`` names it in error messages."""
    problems = _Problems(source)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        problems.add("-", "-", f"TOML syntax error: {exc}")
        problems.raise_if_any()
        raise AssertionError("unreachable") from exc

    for key in sorted(set(doc) - _TOP_KEYS):
        problems.add(
            key, "-", f"unknown top-level table {key!r}; expected one of {sorted(_TOP_KEYS)}"
        )
    header = _read_header(doc.get("lifecycle"), problems)
    states = _read_states(doc.get("states"), problems)
    row_lines = [text.count("\n", 0, m.start()) + 1 for m in _ROW_HEADER.finditer(text)]
    # Rows are checked against every declared name, so a state with a problem of its own does
    # not also make each row that names it look wrong.
    raw_states = doc.get("states")
    declared = set(raw_states) if isinstance(raw_states, dict) else set()
    rows = _read_rows(doc.get("rows"), declared, row_lines, problems)
    problems.raise_if_any()

    name, kind, description, initial = header
    if initial not in {s.name for s in states}:
        problems.add("lifecycle", "initial", f"initial state {initial!r} is not among the states")
        problems.raise_if_any()
    assert kind is not None  # a missing or unknown kind is a problem raised above
    lifecycle = Lifecycle(
        name=name,
        kind=kind,
        description=description,
        initial=initial,
        states=tuple(states),
        rows=tuple(rows),
        source=source,
        spec_hash=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )
    for table, row, message in validate_lifecycle(lifecycle):
        problems.add(table, row, message)
    problems.raise_if_any()
    return lifecycle


def _typed(
    value: Any, kind: type, table: str, row: str, key: str, problems: _Problems
) -> Any | None:
    """``value`` when it is a ``kind`` (bool is not an int here), else record a problem."""
    if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
        return value
    problems.add(table, row, f"{key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return None


def _name_problem(name: str, what: str) -> str | None:
    """Why ``name`` cannot name a lifecycle or state, or None when it can."""
    if NAME_PATTERN.fullmatch(name):
        return None
    return (
        f"{what} name {name!r} must match {NAME_PATTERN.pattern!r}: lower-case letters, digits "
        "and '_', not starting with a digit (it becomes a diagram node id and a docs anchor)"
    )


def _read_header(raw: Any, problems: _Problems) -> tuple[str, GroupKind | None, str, str]:
    if raw is None:
        problems.add(
            "lifecycle", "-", "missing [lifecycle] table with name, kind, description, initial"
        )
        return ("", None, "", "")
    if not isinstance(raw, dict):
        problems.add("lifecycle", "-", "[lifecycle] must be a table")
        return ("", None, "", "")
    for key in sorted(set(raw) - _LIFECYCLE_KEYS):
        problems.add("lifecycle", key, f"unknown key {key!r}; expected {sorted(_LIFECYCLE_KEYS)}")
    kind: GroupKind | None = None
    if "kind" not in raw:
        problems.add(
            "lifecycle",
            "kind",
            f"missing 'kind': the kind of cache group it is for, one of {list(KIND_NAMES)}",
        )
    else:
        kind = _read_enum(raw["kind"], GroupKind, KIND_NAMES, ("lifecycle", "kind", "kind"),
                          problems)
    out: list[str] = []
    for key in ("name", "description", "initial"):
        if key not in raw:
            what = "initial state" if key == "initial" else key
            problems.add("lifecycle", key, f"missing {what}")
            out.append("")
            continue
        out.append(_typed(raw[key], str, "lifecycle", key, key, problems) or "")
    if "name" in raw and isinstance(raw["name"], str):
        message = _name_problem(raw["name"], "lifecycle")
        if message:
            problems.add("lifecycle", "name", message)
    return (out[0], kind, out[1], out[2])


def _read_enum(
    value: Any,
    parse: Callable[[str], Any],
    allowed: tuple[str, ...],
    where: tuple[str, str, str],
    problems: _Problems,
) -> Any | None:
    table, row, key = where
    if not isinstance(value, str):
        problems.add(table, row, f"{key!r} must be a str, got {type(value).__name__}")
        return None
    if value not in allowed:
        problems.add(
            table, row, f"{key!r}: unknown value {value!r}; expected one of {list(allowed)}"
        )
        return None
    return parse(value)


def _read_states(raw: Any, problems: _Problems) -> list[StateDef]:
    if raw is None:
        problems.add("states", "-", "missing [states] table")
        return []
    if not isinstance(raw, dict) or not raw:
        problems.add("states", "-", "[states] must be a non-empty table of [states.NAME] tables")
        return []
    if len(raw) > 254:
        problems.add("states", "-", f"{len(raw)} states; a compiled table holds at most 254")
    tiers = (*TIER_NAMES,)
    states: list[StateDef] = []
    for declared_name, body in raw.items():
        before = len(problems.items)
        # A bad name is shown quoted, so even one holding a line break stays on its own line.
        bad_name = _name_problem(declared_name, "state")
        name = declared_name if bad_name is None else repr(declared_name)
        if bad_name:
            problems.add("states", name, bad_name)
        if not isinstance(body, dict):
            problems.add("states", name, "must be a table ([states.NAME])")
            continue
        for key in sorted(set(body) - _STATE_KEYS):
            problems.add("states", name, f"unknown key {key!r}; expected {sorted(_STATE_KEYS)}")
        doc = body.get("doc")
        if doc is None:
            problems.add("states", name, "missing 'doc': every state is documented in words")
        else:
            doc = _typed(doc, str, "states", name, "doc", problems)
            if isinstance(doc, str) and not doc.strip():
                problems.add("states", name, "empty 'doc': every state is documented in words")
        slots_raw = body.get("slots", [])
        slots: list[Tier] = []
        if not isinstance(slots_raw, list):
            problems.add(
                "states", name, f"'slots' must be a list of tiers, got {type(slots_raw).__name__}"
            )
        else:
            for item in slots_raw:
                tier = _read_enum(
                    item, lambda v: Tier[v.upper()], tiers, ("states", name, "slots"), problems
                )
                if tier is not None:
                    slots.append(tier)
            if len(set(slots)) != len(slots):
                problems.add("states", name, "'slots' names a tier twice")
        residency = _read_enum(
            body.get("residency", NO_TIER),
            lambda v: None if v == NO_TIER else Tier[v.upper()],
            (*tiers, NO_TIER),
            ("states", name, "residency"),
            problems,
        )
        content = _read_enum(
            body.get("content", "none"),
            Content,
            tuple(c.value for c in Content),
            ("states", name, "content"),
            problems,
        )
        form = _read_enum(
            body.get("form", "none"),
            Form,
            tuple(f.value for f in Form),
            ("states", name, "form"),
            problems,
        )
        flags = {
            key: _typed(body.get(key, False), bool, "states", name, key, problems)
            for key in ("readable", "hashed", "in_flight")
        }
        if len(problems.items) == before:
            states.append(
                StateDef(
                    name=name,
                    doc=doc or "",
                    slots=tuple(sorted(slots)),
                    residency=residency,
                    content=Content(content),
                    form=Form(form),
                    readable=bool(flags["readable"]),
                    hashed=bool(flags["hashed"]),
                    in_flight=bool(flags["in_flight"]),
                )
            )
    return states


def _read_calls(
    raw: Any,
    key: str,
    vocabulary: dict[str, str],
    with_tier: frozenset[str],
    row: str,
    problems: _Problems,
) -> tuple[Call, ...]:
    if not isinstance(raw, list):
        problems.add("rows", row, f"{key!r} must be a list of names, got {type(raw).__name__}")
        return ()
    calls: list[Call] = []
    kind = key[:-1]
    for item in raw:
        if not isinstance(item, str):
            problems.add("rows", row, f"{key!r} entries must be str, got {type(item).__name__}")
            continue
        name, colon, arg = item.partition(":")
        if name not in vocabulary:
            problems.add("rows", row, f"unknown {kind} {name!r}; known: {sorted(vocabulary)}")
            continue
        if name in with_tier:
            if arg not in TIER_NAMES:
                problems.add(
                    "rows",
                    row,
                    f"{kind} {name!r} needs a tier argument ({name}:TIER), "
                    f"one of {list(TIER_NAMES)}; got {item!r}",
                )
                continue
            calls.append(Call(name, arg))
        elif colon:
            problems.add("rows", row, f"{kind} {name!r} takes no argument; got {item!r}")
        else:
            calls.append(Call(name))
    if len(set(calls)) != len(calls):
        problems.add("rows", row, f"{key!r} names the same {kind} twice")
    return tuple(calls)


def _read_rows(
    raw: Any, state_names: set[str], row_lines: list[int], problems: _Problems
) -> list[Row]:
    if raw is None:
        problems.add("rows", "-", "missing [[rows]]: a lifecycle needs transitions")
        return []
    if not isinstance(raw, list) or not raw:
        problems.add("rows", "-", "rows must be a non-empty array of [[rows]] tables")
        return []
    rows: list[Row] = []
    seen: dict[tuple[str, Event], str] = {}
    for position, body in enumerate(raw, start=1):
        line = f" (line {row_lines[position - 1]})" if position <= len(row_lines) else ""
        label = f"#{position}{line}"
        if not isinstance(body, dict):
            problems.add("rows", label, "must be a table ([[rows]])")
            continue
        before = len(problems.items)
        for key in sorted(set(body) - _ROW_KEYS):
            problems.add("rows", label, f"unknown key {key!r}; expected {sorted(_ROW_KEYS)}")
        fields: dict[str, Any] = {}
        for key in ("source", "event", "dest"):
            if key not in body:
                problems.add("rows", label, f"missing {key!r}")
            else:
                fields[key] = _typed(body[key], str, "rows", label, key, problems)
        for key in ("source", "dest"):
            value = fields.get(key)
            if isinstance(value, str) and value not in state_names:
                problems.add("rows", label, f"{key} {value!r} is not a declared state")
        event = None
        if isinstance(fields.get("event"), str):
            event = _read_enum(
                fields["event"], Event.from_name, EVENT_NAMES, ("rows", label, "event"), problems
            )
        guards = _read_calls(
            body.get("guards", []), "guards", dict(GUARDS), GUARDS_WITH_TIER, label, problems
        )
        effects = _read_calls(
            body.get("effects", []), "effects", dict(EFFECTS), EFFECTS_WITH_TIER, label, problems
        )
        doc = _typed(body.get("doc", ""), str, "rows", label, "doc", problems)
        if event is not None and isinstance(fields.get("source"), str):
            key2 = (fields["source"], event)
            if key2 in seen:
                problems.add(
                    "rows",
                    label,
                    f"duplicate (state, event) ({fields['source']}, "
                    f"{event.spec_name}): already defined by row {seen[key2]}",
                )
            else:
                seen[key2] = label
        if len(problems.items) == before and event is not None:
            rows.append(
                Row(
                    position,
                    fields["source"],
                    event,
                    fields["dest"],
                    guards,
                    effects,
                    doc or "",
                    row_lines[position - 1] if line else 0,
                )
            )
    return rows
