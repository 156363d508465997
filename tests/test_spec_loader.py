"""Tests of the lifecycle spec loader and validator: a valid spec, the shipped spec, and many
malformed specs, each built by one small textual edit of the valid one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm._errors import SpecError, SpecProblem
from kvfsm.spec import (
    Content,
    Event,
    Form,
    GroupKind,
    Lifecycle,
    Tier,
    load_lifecycle,
    parse_lifecycle,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FULL_KV = REPO_ROOT / "specs" / "lifecycles" / "full_kv.toml"

SOURCE = "mini.toml"

VALID_SPEC = """\
[lifecycle]
name = "mini"
kind = "full"
description = "A minimal KV block lifecycle for the loader tests."
initial = "free"

[states.free]
doc = "No slot, no content, not in the hash map."

[states.allocated]
doc = "A device slot is held but nothing is written yet."
slots = ["device"]

[states.writing]
doc = "A kernel is writing the block into its device slot."
slots = ["device"]
residency = "device"
content = "partial"
form = "raw"
in_flight = true

[states.device]
doc = "Complete on the device: readable and reachable by hash."
slots = ["device"]
residency = "device"
content = "complete"
form = "raw"
readable = true
hashed = true

[[rows]]
source = "free"
event = "allocate"
dest = "allocated"
guards = ["has_room:device"]
effects = ["take_slot:device"]

[[rows]]
source = "allocated"
event = "write_begin"
dest = "writing"
effects = ["bump_epoch"]

[[rows]]
source = "writing"
event = "write_done"
dest = "device"
effects = ["bump_epoch", "publish_hash"]

[[rows]]
source = "writing"
event = "write_fail"
dest = "allocated"
effects = ["bump_epoch"]
doc = "The partial content is forgotten; the slot is kept."

[[rows]]
source = "device"
event = "evict"
dest = "free"
guards = ["no_pins"]
effects = ["drop_hash", "bump_epoch", "invalidate_dependents", "return_slot:device"]

[[rows]]
source = "allocated"
event = "free"
dest = "free"
effects = ["return_slot:device"]
"""

# Text blocks of VALID_SPEC used as anchors by the edits below.
LIFECYCLE_HEADER = """\
[lifecycle]
name = "mini"
kind = "full"
description = "A minimal KV block lifecycle for the loader tests."
initial = "free"
"""
FREE_DOC = 'doc = "No slot, no content, not in the hash map."\n'
ALLOCATED_DOC = 'doc = "A device slot is held but nothing is written yet."\n'
ALLOCATED_SLOTS = ALLOCATED_DOC + 'slots = ["device"]\n'
WRITING_RESIDENCY = 'slots = ["device"]\nresidency = "device"\ncontent = "partial"\n'
DEVICE_LOCATION = 'slots = ["device"]\nresidency = "device"\ncontent = "complete"\n'
ROW1_GUARDS = 'guards = ["has_room:device"]\n'
ROW1_EFFECTS = 'effects = ["take_slot:device"]\n'
ROW2_SOURCE = 'source = "allocated"\nevent = "write_begin"\n'
ROW2_TAIL = 'dest = "writing"\neffects = ["bump_epoch"]\n'
ROW3_EFFECTS = 'effects = ["bump_epoch", "publish_hash"]\n'
ROW5_GUARDS = 'guards = ["no_pins"]\n'
ROW5_EFFECTS = (
    'effects = ["drop_hash", "bump_epoch", "invalidate_dependents", "return_slot:device"]\n'
)
ROW5 = (
    '[[rows]]\nsource = "device"\nevent = "evict"\ndest = "free"\n' + ROW5_GUARDS + ROW5_EFFECTS
)
ROW6_EVENT = 'event = "free"\n'
ROW6_EFFECTS = 'effects = ["return_slot:device"]\n'
KIND = 'kind = "full"\n'


def edit(old: str, new: str, text: str = VALID_SPEC) -> str:
    """``text`` with the one occurrence of ``old`` replaced by ``new``."""
    assert text.count(old) == 1, f"anchor must occur exactly once: {old!r}"
    return text.replace(old, new)


def rename_allocated(toml_string: str) -> str:
    """VALID_SPEC with state ``allocated`` renamed everywhere; ``toml_string`` is the new name as
    a TOML basic string (quotes and escapes included)."""
    text = edit("[states.allocated]", f"[states.{toml_string}]")
    assert text.count('"allocated"') == 4
    return text.replace('"allocated"', toml_string)


def append(extra: str) -> str:
    return VALID_SPEC + "\n" + extra


def row_matches(actual: str, expected: str) -> bool:
    """Row labels are ``#N (...)``: ``#3`` matches ``#3 (line 9)`` but not ``#30``."""
    return actual == expected or actual.startswith(expected + " ")


def find_problem(err: SpecError, table: str, row: str, message: str) -> SpecProblem:
    for problem in err.problems:
        if problem.table == table and row_matches(problem.row, row) and message in problem.message:
            return problem
    listed = "\n".join(str(p) for p in err.problems)
    raise AssertionError(f"no problem ({table}, {row}, ...{message}...) among:\n{listed}")


# ------------------------------------------------------------------------------ valid specs


def test_valid_spec_parses() -> None:
    lifecycle = parse_lifecycle(VALID_SPEC, source=SOURCE)
    assert isinstance(lifecycle, Lifecycle)
    assert lifecycle.name == "mini"
    assert lifecycle.kind is GroupKind.FULL
    assert lifecycle.initial == "free"
    assert lifecycle.source == SOURCE
    assert lifecycle.state_names == ("free", "allocated", "writing", "device")
    assert len(lifecycle.rows) == 6
    assert [row.index for row in lifecycle.rows] == [1, 2, 3, 4, 5, 6]
    assert [(r.source, r.event, r.dest) for r in lifecycle.rows] == [
        ("free", Event.ALLOCATE, "allocated"),
        ("allocated", Event.WRITE_BEGIN, "writing"),
        ("writing", Event.WRITE_DONE, "device"),
        ("writing", Event.WRITE_FAIL, "allocated"),
        ("device", Event.EVICT, "free"),
        ("allocated", Event.FREE, "free"),
    ]
    assert [str(g) for g in lifecycle.rows[0].guards] == ["has_room:device"]
    assert lifecycle.rows[0].guards[0].tier is Tier.DEVICE
    assert [str(e) for e in lifecycle.rows[4].effects] == [
        "drop_hash",
        "bump_epoch",
        "invalidate_dependents",
        "return_slot:device",
    ]
    assert lifecycle.rows[3].doc.startswith("The partial content")
    device = lifecycle.state("device")
    assert device.slots == (Tier.DEVICE,)
    assert device.residency is Tier.DEVICE
    assert device.content is Content.COMPLETE
    assert device.form is Form.RAW
    assert device.readable and device.hashed and not device.in_flight
    free = lifecycle.state("free")
    assert free.slots == () and free.residency is None and free.content is Content.NONE
    assert lifecycle.state("writing").in_flight
    assert lifecycle.tiers == (Tier.DEVICE,)
    assert len(lifecycle.spec_hash) == 64


def test_shipped_full_kv_spec_loads() -> None:
    lifecycle = load_lifecycle(FULL_KV)
    assert lifecycle.name == "full_kv"
    assert lifecycle.initial == "free"
    assert lifecycle.source == str(FULL_KV)
    assert "device" in lifecycle.state_names
    assert lifecycle.rows


# ------------------------------------------------------------------------------ malformed specs

# (id, spec text, expected table, expected row (or its "#N" prefix), message substring)
MALFORMED: list[tuple[str, str, str, str, str]] = [
    (
        "toml-syntax-error",
        edit('initial = "free"\n', 'initial = "free\n'),
        "-", "-", "TOML syntax error",
    ),
    (
        "missing-lifecycle-table",
        edit(LIFECYCLE_HEADER, ""),
        "lifecycle", "-", "missing [lifecycle] table",
    ),
    (
        "lifecycle-not-a-table",
        edit(LIFECYCLE_HEADER, 'lifecycle = "mini"\n'),
        "lifecycle", "-", "[lifecycle] must be a table",
    ),
    (
        "missing-initial-key",
        edit('initial = "free"\n', ""),
        "lifecycle", "initial", "missing initial state",
    ),
    (
        "initial-not-declared",
        edit('initial = "free"\n', 'initial = "empty"\n'),
        "lifecycle", "initial", "initial state 'empty' is not among the states",
    ),
    (
        "missing-kind",
        edit(KIND, ""),
        "lifecycle", "kind", "missing 'kind'",
    ),
    (
        "unknown-kind",
        edit(KIND, 'kind = "full_kv"\n'),
        "lifecycle", "kind", "'kind': unknown value 'full_kv'",
    ),
    (
        "kind-not-a-string",
        edit(KIND, "kind = 1\n"),
        "lifecycle", "kind", "'kind' must be a str, got int",
    ),
    (
        "lifecycle-name-with-punctuation",
        edit('name = "mini"\n', 'name = "mini-kv"\n'),
        "lifecycle", "name", "lifecycle name 'mini-kv' must match",
    ),
    (
        "state-name-empty",
        rename_allocated('""'),
        "states", "''", "state name '' must match '[a-z_][a-z0-9_]*'",
    ),
    (
        "state-name-with-newline",
        rename_allocated('"alloc\\nated"'),
        "states", "'alloc\\nated'", "state name 'alloc\\nated' must match",
    ),
    (
        "state-name-with-trailing-newline",
        rename_allocated('"allocated\\n"'),
        "states", "'allocated\\n'", "state name 'allocated\\n' must match",
    ),
    (
        "state-name-with-arrow",
        rename_allocated('"spill->host"'),
        "states", "'spill->host'", "state name 'spill->host' must match",
    ),
    (
        "state-name-upper-case",
        rename_allocated('"Allocated"'),
        "states", "'Allocated'", "state name 'Allocated' must match",
    ),
    (
        "state-name-leading-digit",
        rename_allocated('"2nd"'),
        "states", "'2nd'", "state name '2nd' must match",
    ),
    (
        "no-readable-state",
        edit("readable = true\n", ""),
        "lifecycle", "kind", "no readable state",
    ),
    (
        "compressed-kind-without-compressed-form",
        edit(KIND, 'kind = "compressed"\n'),
        "lifecycle", "kind", "kind 'compressed' needs a readable state of form 'compressed'",
    ),
    (
        "compressed-kind-without-raw-form",
        edit(
            'content = "complete"\nform = "raw"\n',
            'content = "complete"\nform = "compressed"\n',
            edit(KIND, 'kind = "compressed"\n'),
        ),
        "lifecycle", "kind", "kind 'compressed' needs a readable state of form 'raw'",
    ),
    (
        "sparse-index-readable-without-targets-current",
        edit(KIND, 'kind = "sparse_index"\n'),
        "rows", "#3", "makes a sparse_index block readable without guard 'targets_current'",
    ),
    (
        "unknown-lifecycle-key",
        edit('initial = "free"\n', 'initial = "free"\nversion = 2\n'),
        "lifecycle", "version", "unknown key 'version'",
    ),
    (
        "unknown-top-level-table",
        append("[extras]\nfoo = 1\n"),
        "extras", "-", "unknown top-level table 'extras'",
    ),
    (
        "missing-states",
        edit(
            VALID_SPEC[VALID_SPEC.index("[states.free]") : VALID_SPEC.index("[[rows]]")],
            "",
        ),
        "states", "-", "missing [states] table",
    ),
    (
        "missing-rows",
        VALID_SPEC[: VALID_SPEC.index("[[rows]]")],
        "rows", "-", "missing [[rows]]",
    ),
    (
        "unknown-state-key",
        edit(FREE_DOC, FREE_DOC + 'colour = "red"\n'),
        "states", "free", "unknown key 'colour'",
    ),
    (
        "state-without-doc",
        edit(ALLOCATED_DOC, ""),
        "states", "allocated", "missing 'doc'",
    ),
    (
        "readable-not-bool",
        edit("readable = true\n", 'readable = "yes"\n'),
        "states", "device", "'readable' must be a bool, got str",
    ),
    (
        "slots-not-a-list",
        edit(ALLOCATED_SLOTS, ALLOCATED_DOC + 'slots = "device"\n'),
        "states", "allocated", "'slots' must be a list of tiers, got str",
    ),
    (
        "unknown-tier-in-slots",
        edit(ALLOCATED_SLOTS, ALLOCATED_DOC + 'slots = ["gpu"]\n'),
        "states", "allocated", "'slots': unknown value 'gpu'",
    ),
    (
        "tier-twice-in-slots",
        edit(ALLOCATED_SLOTS, ALLOCATED_DOC + 'slots = ["device", "device"]\n'),
        "states", "allocated", "'slots' names a tier twice",
    ),
    (
        "unknown-residency",
        edit(WRITING_RESIDENCY, 'slots = ["device"]\nresidency = "vram"\ncontent = "partial"\n'),
        "states", "writing", "'residency': unknown value 'vram'",
    ),
    (
        "unknown-content",
        edit('content = "partial"\n', 'content = "half"\n'),
        "states", "writing", "'content': unknown value 'half'",
    ),
    (
        "unknown-event",
        edit(ROW2_SOURCE, 'source = "allocated"\nevent = "begin_write"\n'),
        "rows", "#2", "'event': unknown value 'begin_write'",
    ),
    (
        "unknown-row-source",
        edit(ROW2_SOURCE, 'source = "alloc"\nevent = "write_begin"\n'),
        "rows", "#2", "source 'alloc' is not a declared state",
    ),
    (
        "unknown-row-dest",
        edit(ROW2_TAIL, 'dest = "written"\neffects = ["bump_epoch"]\n'),
        "rows", "#2", "dest 'written' is not a declared state",
    ),
    (
        "row-missing-event",
        edit(ROW2_SOURCE, 'source = "allocated"\n'),
        "rows", "#2", "missing 'event'",
    ),
    (
        "unknown-row-key",
        edit(ROW2_TAIL, ROW2_TAIL + "priority = 1\n"),
        "rows", "#2", "unknown key 'priority'",
    ),
    (
        "unknown-guard",
        edit(ROW5_GUARDS, 'guards = ["no_pinz"]\n'),
        "rows", "#5", "unknown guard 'no_pinz'",
    ),
    (
        "unknown-effect",
        edit(ROW3_EFFECTS, 'effects = ["bump_epoch", "publish_hashes"]\n'),
        "rows", "#3", "unknown effect 'publish_hashes'",
    ),
    (
        "guard-needs-tier",
        edit(ROW1_GUARDS, 'guards = ["has_room"]\n'),
        "rows", "#1", "guard 'has_room' needs a tier argument",
    ),
    (
        "effect-unknown-tier-arg",
        edit(ROW1_EFFECTS, 'effects = ["take_slot:gpu"]\n'),
        "rows", "#1", "effect 'take_slot' needs a tier argument",
    ),
    (
        "effect-takes-no-argument",
        edit(ROW3_EFFECTS, 'effects = ["bump_epoch:device", "publish_hash"]\n'),
        "rows", "#3", "effect 'bump_epoch' takes no argument",
    ),
    (
        "guard-takes-no-argument",
        edit(ROW5_GUARDS, 'guards = ["no_pins:device"]\n'),
        "rows", "#5", "guard 'no_pins' takes no argument",
    ),
    (
        "effects-not-a-list",
        edit(ROW6_EFFECTS, 'effects = "return_slot:device"\n'),
        "rows", "#6", "'effects' must be a list of names, got str",
    ),
    (
        "same-effect-twice",
        edit(ROW3_EFFECTS, 'effects = ["bump_epoch", "publish_hash", "bump_epoch"]\n'),
        "rows", "#3", "'effects' names the same effect twice",
    ),
    (
        "duplicate-state-event",
        edit(ROW6_EVENT, 'event = "write_begin"\n'),
        "rows", "#6",
        "duplicate (state, event) (allocated, write_begin): already defined by row #2",
    ),
    (
        "unreachable-state",
        append(
            '[states.orphan]\ndoc = "Nothing leads here."\n\n'
            '[[rows]]\nsource = "orphan"\nevent = "free"\ndest = "free"\n'
        ),
        "states", "orphan", "unreachable from initial state 'free'",
    ),
    (
        "dead-end-state",
        edit(ROW5, ""),
        "states", "device", "dead end: no row leaves this state",
    ),
    (
        "leak-no-path-back-to-free",
        append(
            '[states.limbo]\ndoc = "Entered, never left for free."\n\n'
            '[[rows]]\nsource = "free"\nevent = "invalidate"\ndest = "limbo"\n\n'
            '[[rows]]\nsource = "limbo"\nevent = "evict"\ndest = "limbo"\n'
        ),
        "states", "limbo", "leak: no path from here back to 'free'",
    ),
    (
        "take-slot-missing",
        edit(ROW1_EFFECTS, "effects = []\n"),
        "rows", "#1", "add effect 'take_slot:device'",
    ),
    (
        "take-slot-not-needed",
        edit(ROW2_TAIL, 'dest = "writing"\neffects = ["bump_epoch", "take_slot:device"]\n'),
        "rows", "#2", "effect 'take_slot:device' but 'writing' declares no new device slot",
    ),
    (
        "return-slot-missing",
        edit(ROW6_EFFECTS, "effects = []\n"),
        "rows", "#6", "add effect 'return_slot:device' (else it leaks)",
    ),
    (
        "hashed-with-partial-content",
        edit(DEVICE_LOCATION, 'slots = ["device"]\nresidency = "device"\ncontent = "partial"\n'),
        "states", "device", "hashed = true needs content = 'complete'",
    ),
    (
        "readable-not-on-device",
        edit(DEVICE_LOCATION, 'slots = ["host"]\nresidency = "host"\ncontent = "complete"\n'),
        "states", "device", "readable = true needs residency 'device'",
    ),
    (
        "residency-without-slot",
        edit(WRITING_RESIDENCY, 'slots = []\nresidency = "device"\ncontent = "partial"\n'),
        "states", "writing", "residency 'device' holds no slot",
    ),
    (
        "content-without-residency",
        edit(ALLOCATED_SLOTS, ALLOCATED_SLOTS + 'content = "partial"\n'),
        "states", "allocated", "has content but residency 'none'",
    ),
    (
        "form-without-content",
        edit(ALLOCATED_SLOTS, ALLOCATED_SLOTS + 'form = "raw"\n'),
        "states", "allocated", "form must be 'none' exactly when content is 'none'",
    ),
    (
        "initial-state-holds-slot",
        edit(FREE_DOC, FREE_DOC + 'slots = ["device"]\n'),
        "lifecycle", "initial", "initial state 'free' must hold no slot",
    ),
    (
        "publish-hash-missing",
        edit(ROW3_EFFECTS, 'effects = ["bump_epoch"]\n'),
        "rows", "#3", "enters a hashed state: add 'publish_hash'",
    ),
    (
        "drop-hash-missing",
        edit(ROW5_EFFECTS,
             'effects = ["bump_epoch", "invalidate_dependents", "return_slot:device"]\n'),
        "rows", "#5", "leaves a hashed state for an unhashed one: add 'drop_hash'",
    ),
    (
        "invalidate-dependents-missing",
        edit(ROW5_EFFECTS, 'effects = ["drop_hash", "bump_epoch", "return_slot:device"]\n'),
        "rows", "#5", "bumps the epoch of hashed content: add 'invalidate_dependents'",
    ),
    (
        "bump-epoch-missing",
        edit(ROW2_TAIL, 'dest = "writing"\neffects = []\n'),
        "rows", "#2", "content or location changes: add 'bump_epoch'",
    ),
]


@pytest.mark.parametrize(
    ("text", "table", "row", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in MALFORMED],
)
def test_malformed_spec_is_rejected(text: str, table: str, row: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    err = info.value
    assert err.problems
    problem = find_problem(err, table, row, message)
    assert problem.file == SOURCE
    assert str(problem).startswith(f"{SOURCE}: ")
    assert str(problem) in str(err)
    for other in err.problems:
        assert str(other).startswith(f"{SOURCE}: ")


def test_enough_malformed_cases() -> None:
    assert len(MALFORMED) >= 20
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)


def test_several_structural_problems_are_reported_together() -> None:
    text = edit(ROW5_GUARDS, 'guards = ["no_pinz"]\n')
    text = edit(ALLOCATED_SLOTS, ALLOCATED_DOC + 'slots = ["gpu"]\n', text)
    text = edit("readable = true\n", 'readable = "yes"\n', text)
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    err = info.value
    assert len(err.problems) >= 3
    find_problem(err, "rows", "#5", "unknown guard 'no_pinz'")
    find_problem(err, "states", "allocated", "'slots': unknown value 'gpu'")
    find_problem(err, "states", "device", "'readable' must be a bool")
    assert len(str(err).splitlines()) == len(err.problems)


def test_several_semantic_problems_are_reported_together() -> None:
    text = edit(ROW1_EFFECTS, "effects = []\n")
    text = edit(ROW3_EFFECTS, 'effects = ["bump_epoch"]\n', text)
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    err = info.value
    assert len(err.problems) >= 2
    find_problem(err, "rows", "#1", "add effect 'take_slot:device'")
    find_problem(err, "rows", "#3", "add 'publish_hash'")


def test_malformed_state_does_not_cascade_into_undeclared_state_errors() -> None:
    text = edit("in_flight = true\n", 'in_flight = "yes"\n')
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    err = info.value
    find_problem(err, "states", "writing", "'in_flight' must be a bool")
    assert [p for p in err.problems if "not a declared state" in p.message] == []


def test_row_label_names_the_line_of_its_header() -> None:
    text = edit(ROW5_GUARDS, 'guards = ["no_pinz"]\n')
    header_lines = [n for n, line in enumerate(text.splitlines(), 1) if line == "[[rows]]"]
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    problem = find_problem(info.value, "rows", "#5", "unknown guard")
    assert problem.row == f"#5 (line {header_lines[4]})"


def test_empty_state_doc_is_rejected() -> None:
    with pytest.raises(SpecError) as info:
        parse_lifecycle(edit(ALLOCATED_DOC, 'doc = ""\n'), source=SOURCE)
    find_problem(info.value, "states", "allocated", "doc")


def test_a_bad_state_name_keeps_every_problem_on_one_line() -> None:
    """A name with a line break is quoted wherever a problem names it, and the state is not
    passed on: nothing downstream (diagrams, docs) ever sees it."""
    text = rename_allocated('"alloc\\nated"')
    writing = "\n\n[states.writing]"
    text = edit(f'slots = ["device"]{writing}', f'slots = ["gpu"]{writing}', text)
    with pytest.raises(SpecError) as info:
        parse_lifecycle(text, source=SOURCE)
    err = info.value
    find_problem(err, "states", "'alloc\\nated'", "state name")
    find_problem(err, "states", "'alloc\\nated'", "'slots': unknown value 'gpu'")
    assert len(str(err).splitlines()) == len(err.problems)
    assert [p for p in err.problems if "not a declared state" in p.message] == []


def test_sparse_index_kind_accepts_rows_guarded_by_targets_current() -> None:
    text = edit(KIND, 'kind = "sparse_index"\n')
    text = edit(
        'dest = "device"\neffects = ["bump_epoch", "publish_hash"]\n',
        'dest = "device"\nguards = ["targets_current"]\neffects = ["bump_epoch", "publish_hash"]\n',
        text,
    )
    assert parse_lifecycle(text, source=SOURCE).kind is GroupKind.SPARSE_INDEX


def test_compressed_kind_accepts_both_readable_forms() -> None:
    text = edit(KIND, 'kind = "compressed"\n') + (
        '\n[states.compressed]\ndoc = "Compressed in place."\nslots = ["device"]\n'
        'residency = "device"\ncontent = "complete"\nform = "compressed"\nreadable = true\n'
        'hashed = true\n\n[[rows]]\nsource = "device"\nevent = "compress_done"\n'
        'dest = "compressed"\neffects = ["bump_epoch", "invalidate_dependents"]\n\n'
        '[[rows]]\nsource = "compressed"\nevent = "evict"\ndest = "free"\n'
        'guards = ["no_pins"]\n' + ROW5_EFFECTS
    )
    assert parse_lifecycle(text, source=SOURCE).kind is GroupKind.COMPRESSED


# ------------------------------------------------------------------------------ files


def test_load_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "missing.toml"
    with pytest.raises(SpecError) as info:
        load_lifecycle(missing)
    (problem,) = info.value.problems
    assert problem.file == str(missing)
    assert "cannot read" in problem.message
    assert str(info.value).startswith(f"{missing}: ")


def test_load_invalid_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(VALID_SPEC.encode("utf-8") + b'\n# \xff\xfe broken "\xc3\x28"\n')
    with pytest.raises(SpecError) as info:
        load_lifecycle(bad)
    (problem,) = info.value.problems
    assert problem.file == str(bad)
    assert "not UTF-8" in problem.message
    assert str(info.value).startswith(f"{bad}: ")


def test_load_valid_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "mini.toml"
    path.write_text(VALID_SPEC, encoding="utf-8")
    lifecycle = load_lifecycle(str(path))
    assert lifecycle.source == str(path)
    assert lifecycle.rows == parse_lifecycle(VALID_SPEC).rows


def test_load_malformed_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(edit(ROW5_GUARDS, 'guards = ["no_pinz"]\n'), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_lifecycle(path)
    problem = find_problem(info.value, "rows", "#5", "unknown guard 'no_pinz'")
    assert str(problem).startswith(f"{path}: rows: #5 ")
