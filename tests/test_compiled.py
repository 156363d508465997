"""Tests of the compiled lifecycle tables: every shipped spec compiles to dense, read-only tables
that say exactly what its rows and states say, no more and no less."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvfsm.fsm import (
    FORM_CODE,
    FORM_COMPRESSED,
    FORM_NONE,
    FORM_RAW,
    INVALID,
    NO_ROW,
    CompiledTable,
    compile_lifecycle,
)
from kvfsm.spec import Content, Event, Form, Tier, shipped_specs_dir, spec_files

from .strategies import shipped, table_of

NAMES = tuple(shipped())
FULL_KV = "full_kv"


@pytest.fixture(params=NAMES)
def table(request: pytest.FixtureRequest) -> CompiledTable:
    return table_of(request.param)


def spec_cells(table: CompiledTable) -> dict[tuple[int, Event], int]:
    """``(source id, event) -> row position`` for every row of the spec, ids by declaration."""
    ids = {name: index for index, name in enumerate(table.lifecycle.state_names)}
    return {(ids[row.source], row.event): pos for pos, row in enumerate(table.lifecycle.rows)}


def test_every_shipped_spec_file_is_compiled() -> None:
    files = spec_files([shipped_specs_dir() / "lifecycles"])
    assert len(NAMES) == len(files) > 0
    assert FULL_KV in NAMES


def test_next_state_shape_and_dtype(table: CompiledTable) -> None:
    n_states = len(table.lifecycle.states)
    assert table.next_state.shape == (n_states, len(Event))
    assert table.next_state.dtype == np.uint8
    assert table.row_of.shape == (n_states, len(Event))
    assert table.n_states == n_states


def test_state_ids_follow_declaration_order(table: CompiledTable) -> None:
    names = table.lifecycle.state_names
    assert dict(table.state_ids) == {name: index for index, name in enumerate(names)}
    for index, name in enumerate(names):
        assert table.state_id(name) == index
        assert table.state_name(index) == name
    assert table.initial == names.index(table.lifecycle.initial)
    assert table.name == table.lifecycle.name


def test_unknown_state_name_raises_key_error_naming_lifecycle(table: CompiledTable) -> None:
    with pytest.raises(KeyError, match=table.name):
        table.state_id("no_such_state")


def test_invalid_is_never_a_state_id(table: CompiledTable) -> None:
    assert table.n_states < INVALID


def test_invalid_exactly_where_the_spec_has_no_row(table: CompiledTable) -> None:
    cells = spec_cells(table)
    for state in range(table.n_states):
        for event in Event:
            has_row = (state, event) in cells
            assert (table.next_state[state, event] == INVALID) != has_row, (state, event)
            assert (table.row_of[state, event] == NO_ROW) != has_row, (state, event)
            assert (table.row(state, event) is None) != has_row, (state, event)


def test_every_spec_row_is_present(table: CompiledTable) -> None:
    for position, row in enumerate(table.lifecycle.rows):
        source = table.state_id(row.source)
        assert table.next_state[source, row.event] == table.state_id(row.dest), row.label
        assert table.row_of[source, row.event] == position, row.label
        assert table.row(source, row.event) == row


def test_row_of_is_consistent_with_next_state(table: CompiledTable) -> None:
    rows = table.lifecycle.rows
    for state in range(table.n_states):
        for event in Event:
            index = int(table.row_of[state, event])
            if index == NO_ROW:
                continue
            row = rows[index]
            assert (row.source, row.event) == (table.state_name(state), event)
            assert table.next_state[state, event] == table.state_id(row.dest)


def test_per_state_flags_match_the_spec(table: CompiledTable) -> None:
    states = table.lifecycle.states
    assert table.readable.tolist() == [s.readable for s in states]
    assert table.hashed.tolist() == [s.hashed for s in states]
    assert table.in_flight.tolist() == [s.in_flight for s in states]
    for flags in (table.readable, table.hashed, table.in_flight):
        assert flags.dtype == np.bool_
        assert flags.shape == (len(states),)


def test_slots_and_residency_match_the_spec(table: CompiledTable) -> None:
    states = table.lifecycle.states
    assert table.holds_slot.shape == (len(states), len(Tier))
    assert table.holds_slot.dtype == np.bool_
    for index, state in enumerate(states):
        for tier in Tier:
            assert table.holds_slot[index, tier] == (tier in state.slots), (state.name, tier)
        expected = -1 if state.residency is None else int(state.residency)
        assert table.residency[index] == expected, state.name


def test_form_codes() -> None:
    assert (FORM_NONE, FORM_RAW, FORM_COMPRESSED) == (0, 1, 2)
    assert dict(FORM_CODE) == {Form.NONE: 0, Form.RAW: 1, Form.COMPRESSED: 2}
    with pytest.raises(TypeError):
        FORM_CODE[Form.RAW] = 3  # type: ignore[index]


def test_per_state_content_columns_match_the_spec(table: CompiledTable) -> None:
    states = table.lifecycle.states
    assert table.complete.tolist() == [s.content is Content.COMPLETE for s in states]
    assert table.partial.tolist() == [s.content is Content.PARTIAL for s in states]
    assert table.writable.tolist() == [
        s.content is Content.PARTIAL and s.residency is Tier.DEVICE for s in states
    ]
    assert table.form.tolist() == [FORM_CODE[s.form] for s in states]
    assert table.restoring.tolist() == [
        s.in_flight and s.residency not in (None, Tier.DEVICE) and Tier.DEVICE in s.slots
        for s in states
    ]
    for flags in (table.complete, table.partial, table.writable, table.restoring):
        assert flags.dtype == np.bool_
        assert flags.shape == (len(states),)
    assert table.form.dtype == np.int8 and table.form.shape == (len(states),)


def test_named_columns_of_full_kv() -> None:
    """The columns say, by state name, what code used to work out by hand."""
    table = table_of(FULL_KV)

    def named(column: np.ndarray) -> set[str]:
        return {table.state_name(int(i)) for i in np.flatnonzero(column)}

    assert named(table.writable) == {"writing"}
    assert named(table.partial) == {"writing"}
    assert named(table.restoring) == {"restoring_host", "restoring_disk", "restoring_remote"}
    assert named(table.form == FORM_NONE) == {"free", "allocated", "invalid"}
    assert named(table.form == FORM_COMPRESSED) == set()
    assert "device" in named(table.complete) and "host" in named(table.complete)


def test_compressed_form_column() -> None:
    table = table_of("compressed")
    assert table.form[table.state_id("raw")] == FORM_RAW
    assert table.form[table.state_id("compressing")] == FORM_RAW
    assert table.form[table.state_id("compressed")] == FORM_COMPRESSED
    assert table.form[table.state_id("disk")] == FORM_COMPRESSED


COLUMNS = (
    "next_state", "row_of", "readable", "hashed", "in_flight", "holds_slot", "residency",
    "complete", "partial", "writable", "form", "restoring",
)


@pytest.mark.parametrize("field", COLUMNS)
def test_tables_are_read_only(table: CompiledTable, field: str) -> None:
    array = getattr(table, field)
    before = array.copy()
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[0] = array[0]
    np.testing.assert_array_equal(array, before)


def test_state_ids_mapping_is_read_only(table: CompiledTable) -> None:
    with pytest.raises(TypeError):
        table.state_ids["intruder"] = 0  # type: ignore[index]
    assert "intruder" not in table.state_ids


def test_table_fields_cannot_be_rebound(table: CompiledTable) -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        table.next_state = np.zeros_like(table.next_state)  # type: ignore[misc]


def test_compiling_twice_gives_equal_tables(table: CompiledTable) -> None:
    again = compile_lifecycle(table.lifecycle)
    for field in COLUMNS:
        np.testing.assert_array_equal(getattr(again, field), getattr(table, field), field)
    assert dict(again.state_ids) == dict(table.state_ids)
