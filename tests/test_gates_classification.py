"""Gate 2, classification, proven for every shipped lifecycle.

A block is only ever used as what its lifecycle state says it is. The compiled table
(``kvfsm/fsm/_compiled.py``) gives each state a ``form`` (raw, compressed or none), a
``residency`` (the tier of the authoritative content), ``complete``/``partial`` content,
``in_flight``, ``restoring``/``loading`` (content coming in) and ``readable``; the restore paths
(``kvfsm/lookup/_paths.py``) are derived from it. Four properties, each checked three ways: on
the tables of every shipped lifecycle, every state exhaustively; on verdicts of randomized cores
(Hypothesis); and on a corrupted copy of a table or a hand-written wrong path, which the same
checker must report (so no property holds vacuously).

1. **Forms.** Compression is one way: no row takes a compressed-form state to a raw-form state.
   A restore path to raw form passes only raw-form states; a path from a compressed-form state
   passes only compressed-form states; every path to a form ends in a readable state of that
   form. In a verdict, each block the usable prefix reads compressed is in a readable
   compressed-form state and each block read raw in a readable raw-form state; ``core.read``
   asserting the other form is refused.
2. **Residency.** Only device-resident, complete states are readable: host, disk and remote
   (stored-tier) copies are hash hits that never count as resident. No verdict counts a block
   usable unless its state is readable and device-resident.
3. **In flight.** States with content coming in (restoring, loading) or being written (partial)
   are never readable, so never usable in a verdict, and ``core.read`` refuses them. The tables
   do keep two in-flight states readable on purpose: a spill from the device (the device copy
   stays authoritative until ``spill_done``) and an in-place compression (the raw form stays
   authoritative until ``compress_done``). What makes that safe is checked too: every row that
   takes a readable state's content away (to a state not readable, or of another form) is
   guarded by ``no_pins``, so it cannot complete under a reader.
4. **Restore paths are paths of the table.** Each plan step's path, fired from the block's
   current state, is a sequence of rows of the spec, keeps the content complete the whole way
   (a restore never drops content: recomputation is not restoration), ends in a readable
   device state of the form the block is needed in, and is as short as any such sequence
   (the distance is computed here from the spec's rows by a different algorithm).
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm.fsm import FORM_CODE, FORM_COMPRESSED, FORM_RAW, INVALID, CompiledTable
from kvfsm.lookup import Level, RestorePaths, Verdict, lookup, restore_paths
from kvfsm.lookup._paths import READABLE_COMPRESSED, READABLE_RAW
from kvfsm.spec import Content, Event, Form, GroupKind, Lifecycle, ModelDecl, Row, StateDef, Tier
from kvfsm.spec._vocabulary import DISCOVER_EVENT
from kvfsm.state import CoreConfig, Prompt, StateCore, StateError
from tests.lookup_models import (
    DEEPSEEK,
    FOUR,
    GPT_OSS,
    HISTORY,
    HISTORY_SWA,
    PROMPTS,
    drive,
    engine,
    group,
    history_by_hand,
    model,
    tokens,
)
from tests.strategies import shipped, shortest_paths, table_of

LIFECYCLES = sorted(shipped())
FORMS = (Form.RAW, Form.COMPRESSED)
NO_PINS = "no_pins"


# -- ground truth from the spec ------------------------------------------------------------


def _spec_rows(lifecycle: Lifecycle) -> dict[tuple[str, Event], Row]:
    return {(row.source, row.event): row for row in lifecycle.rows}


def _usable_in(state: StateDef, form: Form) -> bool:
    """A kernel may read the state now, in ``form``: readable, complete, on the device."""
    return state.readable and state.residency is Tier.DEVICE and \
        state.content is Content.COMPLETE and state.form is form


def _distances(lifecycle: Lifecycle, form: Form) -> dict[str, int]:
    """Per state, the fewest spec rows to a state usable in ``form`` keeping the content
    complete; absent when none. Relaxed backwards from the targets over the rows until nothing
    changes (not the breadth-first search the library derives its paths with)."""
    states = {s.name: s for s in lifecycle.states}
    dist = {name: 0 for name, s in states.items() if _usable_in(s, form)}
    changed = True
    while changed:
        changed = False
        for row in lifecycle.rows:
            source, dest = states[row.source], states[row.dest]
            if source.content is not Content.COMPLETE or dest.content is not Content.COMPLETE:
                continue
            if row.dest in dist and dist[row.dest] + 1 < dist.get(row.source, 1 << 30):
                dist[row.source] = dist[row.dest] + 1
                changed = True
    return dist


# -- the checkers ----------------------------------------------------------------------------


def path_problems(lifecycle: Lifecycle, start: str, form: Form,
                  path: tuple[Event, ...] | None) -> list[str]:
    """Property 4 for one path (None: the derivation says there is none)."""
    where = f"{lifecycle.name}: {form.value} path from {start!r}"
    shortest = _distances(lifecycle, form).get(start)
    if path is None:
        return [] if shortest is None else [f"{where}: none derived, but {shortest} rows reach"]
    rows, states = _spec_rows(lifecycle), {s.name: s for s in lifecycle.states}
    state, out = start, list[str]()
    for event in path:
        row = rows.get((state, event))
        if row is None:
            return [*out, f"{where}: no row for {event.spec_name!r} in {state!r}"]
        state = row.dest
        if states[state].content is not Content.COMPLETE:
            out.append(f"{where}: passes {state!r}, which drops the content")
    if not _usable_in(states[state], form):
        out.append(f"{where}: ends in {state!r}, not usable as {form.value}")
    if shortest is None or len(path) > shortest:
        out.append(f"{where}: {len(path)} rows, shortest is {shortest}")
    return out


def table_path_problems(table: CompiledTable, paths: RestorePaths) -> list[str]:
    """Property 4 for every state and form of a table."""
    return [problem for state in range(table.n_states) for form in FORMS
            for problem in path_problems(table.lifecycle, table.state_name(state), form,
                                         paths.path(state, form))]


def _walk(table: CompiledTable, start: int, path: tuple[Event, ...]) -> list[int]:
    """The states a path visits through the compiled table, ``start`` first."""
    visited = [start]
    for event in path:
        nxt = int(table.next_state[visited[-1], event])
        if nxt == INVALID:
            break
        visited.append(nxt)
    return visited


def form_problems(table: CompiledTable, paths: RestorePaths) -> list[str]:
    """Property 1 on a table: compression is one way, and paths keep to their form."""
    name, form = table.name, table.form
    formless = table.readable & (form != FORM_RAW) & (form != FORM_COMPRESSED)
    out = [f"{name}: {table.state_name(int(s))!r} is readable with no form"
           for s in np.flatnonzero(formless)]
    for source, event in zip(*np.nonzero(table.next_state != INVALID), strict=True):
        dest = int(table.next_state[source, event])
        if form[source] == FORM_COMPRESSED and form[dest] == FORM_RAW:
            out.append(f"{name}: {Event(int(event)).spec_name!r} decompresses "
                       f"{table.state_name(int(source))!r} into {table.state_name(dest)!r}")
    for start in range(table.n_states):
        for wanted in FORMS:
            path = paths.path(start, wanted)
            if path is None:
                continue
            visited = _walk(table, start, path)
            forms = {int(form[s]) for s in visited}
            where = f"{name}: {wanted.value} path from {table.state_name(start)!r}"
            if wanted is Form.RAW and forms != {FORM_RAW}:
                out.append(f"{where} passes a state not raw")
            if form[start] == FORM_COMPRESSED and forms != {FORM_COMPRESSED}:
                out.append(f"{where} passes a state not compressed")
            if form[visited[-1]] != FORM_CODE[wanted]:
                out.append(f"{where} ends in form {int(form[visited[-1]])}")
    return out


def residency_problems(table: CompiledTable, paths: RestorePaths) -> list[str]:
    """Property 2 on a table: only device-resident complete states are readable, and the
    restore-path code calls nothing else readable."""
    out = []
    code_readable = (paths.code & (READABLE_RAW | READABLE_COMPRESSED)) != 0
    for s in range(table.n_states):
        where = f"{table.name}: {table.state_name(s)!r}"
        device = int(table.residency[s]) == Tier.DEVICE and bool(table.holds_slot[s, Tier.DEVICE])
        if table.readable[s] and not (device and table.complete[s]):
            out.append(f"{where} is readable but resident in tier {int(table.residency[s])}")
        if code_readable[s] and not (table.readable[s] and device):
            out.append(f"{where}: the lookup's code calls it readable")
    return out


def in_flight_problems(table: CompiledTable) -> list[str]:
    """Property 3 on a table: content coming in or being written is never readable, and no
    row takes a readable state's content away from a pinned reader."""
    out = []
    incoming = table.restoring | table.loading | table.partial | table.writable
    for s in np.flatnonzero(table.readable & table.in_flight & incoming):
        out.append(f"{table.name}: {table.state_name(int(s))!r} is in flight with its content "
                   "not yet on the device, yet readable")
    for source in np.flatnonzero(table.readable):
        for event in Event:
            dest = int(table.next_state[source, event])
            if dest == INVALID:
                continue
            if table.readable[dest] and table.form[dest] == table.form[source]:
                continue
            row = table.lifecycle.rows[int(table.row_of[source, event])]
            if NO_PINS not in {str(guard) for guard in row.guards}:
                out.append(f"{table.name}: row {row.label} takes the content from readers "
                           "without no_pins")
    return out


def read_problems(core: StateCore, name: str) -> list[str]:
    """Properties 1 and 3 through ``core.read``: every block of the group is read exactly when
    its spec state is readable, and only in its own form."""
    group = core.group(name)
    out = []
    for block in range(group.n_blocks):
        state = group.table.lifecycle.states[int(group.states[block])]
        where = f"{name} block {block} ({state.name})"
        try:
            core.read(name, [block])
            if not state.readable:
                out.append(f"{where}: read, but not readable")
        except StateError:
            if state.readable:
                out.append(f"{where}: readable, but read refused")
        for form in FORMS:
            if state.readable and form is state.form:
                continue
            with contextlib.suppress(StateError):
                core.read(name, [block], form=form)
                out.append(f"{where}: read as {form.value}")
    return out


def verdict_problems(core: StateCore, prompt: Prompt, verdict: Verdict) -> list[str]:
    """Properties 1 to 4 on a verdict, judged by the spec's states (not the compiled arrays
    the lookup read): every block the usable prefix needs is readable on the device, complete,
    in the form its kind reads it, not in flight with content coming in; every plan step's
    path is a shortest path of the spec from the block's state to the form it is needed in,
    and names the tier the block is in."""
    out: list[str] = []
    for name, held in core.groups.items():
        states = held.table.lifecycle.states
        decl, rule = held.decl, held.rule
        high, low = prompt.words(decl.block_size)
        need = rule.needed(decl, np.array([verdict.usable_tokens], dtype=np.int64))
        lo, cut, hi = int(need.lo[0]), int(need.cut[0]), int(need.hi[0])
        ids = core.lookup_words(name, high[lo:hi], low[lo:hi])
        for index, block in zip(range(lo, hi), ids.tolist(), strict=True):
            where = f"{name} block {index} (usable at {verdict.usable_tokens})"
            if block < 0:
                out.append(f"{where}: not found")
                continue
            state = states[int(held.states[block])]
            form = Form.COMPRESSED if index < cut else Form.RAW
            if state.in_flight and (state.residency is not Tier.DEVICE
                                    or state.content is not Content.COMPLETE):
                out.append(f"{where}: {state.name!r} is in flight, content not on the device")
            if not _usable_in(state, form):
                out.append(f"{where}: {state.name!r} is not readable as {form.value} on the "
                           f"device (form {state.form.value}, residency {state.residency})")
        after = rule.needed(decl, np.array([verdict.restorable_tokens], dtype=np.int64))
        for step in (s for s in verdict.plan if s.group == name):
            state_id = int(held.states[step.block_id])
            state = states[state_id]
            if state.name != step.state:
                out.append(f"{name} step {step.block_index}: names {step.state!r}, block is "
                           f"in {state.name!r}")
            form = Form.COMPRESSED if step.block_index < int(after.cut[0]) else Form.RAW
            out += path_problems(held.table.lifecycle, state.name, form, step.path)
            if step.tier is not state.residency:
                out.append(f"{name} step {step.block_index}: tier {step.tier}, block resident "
                           f"in {state.residency}")
    return out


# -- the tables, every state of every shipped lifecycle --------------------------------------


@pytest.mark.parametrize("name", LIFECYCLES)
def test_every_lifecycle_keeps_forms_apart(name: str) -> None:
    table = table_of(name)
    assert form_problems(table, restore_paths(table)) == []


@pytest.mark.parametrize("name", LIFECYCLES)
def test_every_lifecycle_reads_only_device_resident_states(name: str) -> None:
    table = table_of(name)
    assert residency_problems(table, restore_paths(table)) == []
    stored = np.isin(table.residency, [Tier.HOST, Tier.DISK, Tier.REMOTE])
    assert not (table.readable & stored).any()


@pytest.mark.parametrize("name", LIFECYCLES)
def test_every_lifecycle_never_reads_content_in_flight(name: str) -> None:
    assert in_flight_problems(table_of(name)) == []


@pytest.mark.parametrize("name", LIFECYCLES)
def test_every_restore_path_is_a_shortest_path_of_the_table(name: str) -> None:
    table = table_of(name)
    assert table_path_problems(table, restore_paths(table)) == []


def test_the_tables_exercise_every_property() -> None:
    """The properties are not vacuous on the shipped tables: some lifecycle compresses, has
    stored tiers, keeps an in-flight state readable, and has non-empty restore paths."""
    tables = [table_of(name) for name in LIFECYCLES]
    assert any((t.form == FORM_COMPRESSED).any() for t in tables)
    assert any(np.isin(t.residency, [Tier.DISK, Tier.REMOTE]).any() for t in tables)
    assert any((t.readable & t.in_flight).any() for t in tables)
    assert any((t.restoring & t.in_flight).any() for t in tables)
    assert any(restore_paths(t).path(s, f) for t in tables for s in range(t.n_states)
               for f in FORMS)


# -- cores: a block in every state of every lifecycle ----------------------------------------

_EXTRA = {
    GroupKind.FULL: "",
    GroupKind.SLIDING_WINDOW: "window = 32",
    GroupKind.COMPRESSED: "sub_blocks = 4",
    GroupKind.SPARSE_INDEX: 'target_group = "history"\ntop_k = 4',
    GroupKind.RECURRENT: "checkpoint_interval = 32",
}


def _model_for(lifecycle: Lifecycle) -> ModelDecl:
    """A model whose group ``g`` follows ``lifecycle`` (an index also gets its history)."""
    block = 64 if lifecycle.kind is GroupKind.COMPRESSED else 16
    groups = [group("g", lifecycle.kind.value, lifecycle.name, block, _EXTRA[lifecycle.kind])]
    if lifecycle.kind is GroupKind.SPARSE_INDEX:
        groups.insert(0, HISTORY)
    return model(f"t_{lifecycle.name}", *groups)


def _core_for(lifecycle: Lifecycle) -> StateCore:
    return StateCore(_model_for(lifecycle), CoreConfig(
        device_blocks=40, host_blocks=40, disk_blocks=40, remote_blocks=40, backend="numpy"),
        lifecycles=shipped())


def _walk_to(core: StateCore, name: str, target: str, position: int, high: int,
             low: int) -> int:
    """A block with this identity taken from free to ``target`` along the spec's shortest
    path, the data path played where a row needs it (bytes written, a stored copy loaded)."""
    group = core.group(name)
    payload = np.full((1, group.decl.payload_bytes), position % 251, dtype=np.uint8)
    discovered = {event: tier for tier, event in DISCOVER_EVENT.items()}
    block = -1
    for event in shortest_paths(group.table.lifecycle)[target]:
        if event is Event.ALLOCATE:
            block = int(core.allocate(name, [position], [high], [low])[0])
        elif event in discovered:
            block = int(core.discover(name, [position], [high], [low], discovered[event])[0])
        else:
            if event is Event.RESTORE_DONE and group.table.loading[group.states[block]]:
                core.record_loaded(name, [block], [xxhash.xxh3_64_intdigest(payload[0])],
                                   payload)
            core.fire(name, [block], event)
            if event is Event.WRITE_BEGIN:
                core.write(name, [block], payload)
    return block


@pytest.mark.parametrize("name", LIFECYCLES)
def test_every_state_is_read_exactly_as_its_table_says(name: str) -> None:
    """A block in each state of the lifecycle (free ones included): ``core.read`` serves it
    only when its state is readable, and only in that state's form."""
    lifecycle = shipped()[name]
    core = _core_for(lifecycle)
    reached = set()
    for index, state in enumerate(lifecycle.state_names):
        block = _walk_to(core, "g", state, index, index + 1, 7)
        if block >= 0:
            reached.add(core.describe("g", block).state)
    assert reached == set(lifecycle.state_names) - {lifecycle.initial}
    assert read_problems(core, "g") == []


@st.composite
def _walked(draw: st.DrawFn, name: str) -> tuple[StateCore, Prompt]:
    """A core whose prompt blocks, in every group, were each taken to a drawn state of its
    lifecycle (mostly readable ones, else anything from free to restoring from remote), and
    the prompt."""
    core = _core_for(shipped()[name])
    sizes = tuple(g.block_size for g in core.model.groups)
    tokens = draw(st.integers(1, 4 * core.model.lcm_block_size + 1), label="tokens")
    prompt = Prompt(core.seed, sizes, np.arange(tokens) * 7 + 3)
    for gname, state in core.groups.items():
        lifecycle = state.table.lifecycle
        # Mostly readable states (so prefixes are often usable), else any state at all.
        readable = st.sampled_from([s.name for s in lifecycle.states if s.readable])
        states = st.one_of(readable, readable, readable, st.sampled_from(lifecycle.state_names))
        high, low = prompt.words(state.decl.block_size)
        for index in range(high.size):
            target = draw(states, label=f"{gname} {index}")
            _walk_to(core, gname, target, index, int(high[index]), int(low[index]))
    return core, prompt


@pytest.mark.parametrize("name", LIFECYCLES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_verdicts_on_cores_in_any_states_classify_every_block(name: str,
                                                              data: st.DataObject) -> None:
    """For any mix of states of the lifecycle's blocks (every state reachable, stored tiers
    included), a verdict's usable prefix reads only device-resident readable blocks in the
    form its kind needs, never a block with content in flight, and every plan step is a
    shortest content-keeping path of the spec to that form (properties 1 to 4)."""
    core, prompt = data.draw(_walked(name))
    for level in Level:
        verdict = lookup(core, prompt, level=level)
        assert verdict_problems(core, prompt, verdict) == []
    assert read_problems(core, "g") == []


@settings(max_examples=40, deadline=None)
@given(data=st.data(), decl=st.sampled_from([DEEPSEEK, GPT_OSS, FOUR]))
def test_verdicts_on_driven_engines_classify_every_block(data: st.DataObject,
                                                         decl: ModelDecl) -> None:
    """The same on engines driven through their API (commits, events, corrupted host copies,
    flipped device bytes, strict device profiles, scrambled index references), with prompt
    blocks then moved a step from usable (spilled, restoring, compressing)."""
    eng = engine(decl, device=24, host=6)
    drive(eng, data, data.draw(st.integers(0, 6), label="steps"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    prompt = eng.prompt(text[: data.draw(st.integers(1, text.size), label="length")])
    with contextlib.suppress(KvfsmError):
        eng.commit(prompt)
    for _ in range(data.draw(st.integers(0, 6), label="moves")):
        name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
        live = eng.core.lookup_words(name, *prompt.words(eng.core.group(name).decl.block_size))
        live = live[live >= 0]
        if live.size:
            block = data.draw(st.sampled_from(live.tolist()), label="block")
            for event in data.draw(st.sampled_from([
                    (Event.SPILL_BEGIN,), (Event.SPILL_BEGIN, Event.SPILL_DONE),
                    (Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN),
                    (Event.COMPRESS_BEGIN,)]), label="events"):
                if not eng.core.fire(name, [block], event, masked=True).all():
                    break
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert verdict_problems(eng.core, prompt, verdict) == []
    for name in eng.core.groups:
        assert read_problems(eng.core, name) == []


# -- each property can fire ------------------------------------------------------------------


def _corrupt(table: CompiledTable, column: str, state: str, value: Any) -> CompiledTable:
    """A copy of ``table`` with one state's entry of a per-state column changed."""
    array = getattr(table, column).copy()
    array[table.state_id(state)] = value
    return attrs.evolve(table, **{column: array})


def _with_row(table: CompiledTable, source: str, event: Event, dest: str) -> CompiledTable:
    """A copy of ``table`` with one more transition (reusing row 0's guards and effects)."""
    next_state, row_of = table.next_state.copy(), table.row_of.copy()
    next_state[table.state_id(source), event] = table.state_id(dest)
    row_of[table.state_id(source), event] = 0
    return attrs.evolve(table, next_state=next_state, row_of=row_of)


def test_a_decompressing_row_is_reported() -> None:
    table = _with_row(table_of("compressed"), "compressed", Event.WRITE_FAIL, "raw")
    problems = form_problems(table, RestorePaths(table))
    assert any("decompresses 'compressed' into 'raw'" in p for p in problems), problems
    assert any("raw path from 'host' passes a state not raw" in p for p in problems), problems


def test_a_readable_state_of_no_form_or_off_the_device_is_reported() -> None:
    table = _corrupt(table_of("full_kv"), "readable", "disk", True)
    problems = residency_problems(table, RestorePaths(table))
    assert any("'disk' is readable but resident in tier 2" in p for p in problems), problems
    assert any("'disk': the lookup's code calls it readable" in p for p in problems)
    table = _corrupt(table_of("full_kv"), "readable", "allocated", True)
    assert any("'allocated' is readable with no form" in p
               for p in form_problems(table, RestorePaths(table)))


def test_content_in_flight_made_readable_is_reported() -> None:
    for state in ("restoring_host", "restoring_remote", "writing"):
        problems = in_flight_problems(_corrupt(table_of("full_kv"), "readable", state, True))
        assert any(f"{state!r} is in flight" in p for p in problems), (state, problems)


def test_a_row_taking_content_from_readers_without_no_pins_is_reported() -> None:
    lifecycle = shipped()["full_kv"]
    rows = tuple(attrs.evolve(row, guards=()) if (row.source, row.event) ==
                 ("spilling_host", Event.SPILL_DONE) else row for row in lifecycle.rows)
    table = attrs.evolve(table_of("full_kv"), lifecycle=attrs.evolve(lifecycle, rows=rows))
    problems = in_flight_problems(table)
    assert any("spilling_host --spill_done--> host" in p for p in problems), problems


class _HandWritten(RestorePaths):
    """Restore paths with one entry replaced by a hand-written one."""

    def __init__(self, table: CompiledTable, state: str, form: Form,
                 path: tuple[Event, ...] | None) -> None:
        super().__init__(table)
        self.paths[form][table.state_id(state)] = path


@pytest.mark.parametrize(("state", "form", "path", "words"), [
    ("host", Form.RAW, (Event.RESTORE_BEGIN,), "ends in 'restoring_host'"),
    ("host", Form.RAW, (Event.RESTORE_DONE,), "no row for 'restore_done' in 'host'"),
    ("host", Form.RAW, (Event.RESTORE_BEGIN, Event.RESTORE_FAIL, Event.RESTORE_BEGIN,
                        Event.RESTORE_DONE), "4 rows, shortest is 2"),
    ("host", Form.RAW, None, "none derived, but 2 rows reach"),
    ("device", Form.RAW, (Event.EVICT, Event.ALLOCATE, Event.WRITE_BEGIN, Event.WRITE_DONE),
     "passes 'free', which drops the content"),
])
def test_a_hand_written_wrong_path_is_reported(state: str, form: Form,
                                               path: tuple[Event, ...] | None,
                                               words: str) -> None:
    table = table_of("full_kv")
    problems = table_path_problems(table, _HandWritten(table, state, form, path))
    assert any(words in p for p in problems), problems


def _spilled_dense() -> tuple[Any, Prompt]:
    eng = engine(model("t_dense_graph", group("attn", "full", "full_kv", 16)))
    text = PROMPTS[0][:161]
    prompt = eng.prompt(text)
    eng.commit(prompt)
    ids = eng.core.lookup_words("attn", *prompt.words(16))[[2, 5]]
    eng.core.fire("attn", ids, Event.SPILL_BEGIN)
    eng.core.fire("attn", ids, Event.SPILL_DONE)
    return eng, prompt


def test_a_verdict_with_a_hand_written_plan_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup's path derivation replaced by a hand-written, one-row-short restore."""
    eng, prompt = _spilled_dense()
    good = eng.lookup(prompt)
    assert good.plan and verdict_problems(eng.core, prompt, good) == []
    def wrong(table: CompiledTable) -> RestorePaths:
        return _HandWritten(table, "host", Form.RAW, (Event.RESTORE_BEGIN,))

    monkeypatch.setattr("kvfsm.lookup._statics.restore_paths", wrong)
    # A fresh engine: restore paths follow from the table alone, so an engine that looked up
    # before keeps the paths it derived then.
    eng, prompt = _spilled_dense()
    problems = verdict_problems(eng.core, prompt, eng.lookup(prompt))
    assert any("ends in 'restoring_host'" in p for p in problems), problems


@pytest.mark.parametrize(("state", "column", "value", "words"), [
    ("host", "readable", True, "'host' is not readable as raw on the device"),
    ("restoring_host", "readable", True, "'restoring_host' is in flight"),
])
def test_a_verdict_over_a_corrupted_table_is_reported(
        monkeypatch: pytest.MonkeyPatch, state: str, column: str, value: Any,
        words: str) -> None:
    """The lookup (and ``core.read``) given a corrupted copy of the table: a host copy called
    readable, a restore in flight called readable. The checkers judge by the spec and report
    each."""
    eng, prompt = _spilled_dense()
    ids = eng.core.lookup_words("attn", *prompt.words(16))
    if state == "restoring_host":
        eng.core.fire("attn", ids[[2, 5]], Event.RESTORE_BEGIN)
    group = eng.core.group("attn")
    monkeypatch.setattr(group, "table", _corrupt(group.table, column, state, value))
    # No data checksums: a host block called readable has no device slot to hash.
    verdict = lookup(eng.core, prompt, checksums=False)
    problems = verdict_problems(eng.core, prompt, verdict)
    assert any(words in p for p in problems), (verdict, problems)
    if state == "restoring_host":  # holds a device slot, so the corrupted read goes through
        assert any(f"({state}): read, but not readable" in p
                   for p in read_problems(eng.core, "attn"))


def test_a_raw_block_called_compressed_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """History block 1 left raw; the lookup and ``core.read`` given a table that calls the raw
    state compressed would serve it as compressed history."""
    eng = engine(HISTORY_SWA)
    text = tokens(321)
    history_by_hand(eng, text, {1: "raw"})
    prompt = eng.prompt(text)
    assert eng.lookup(prompt).usable_tokens == 64
    group = eng.core.group("history")
    monkeypatch.setattr(group, "table", _corrupt(group.table, "form", "raw", FORM_COMPRESSED))
    verdict = lookup(eng.core, prompt, checksums=False)
    assert verdict.usable_tokens == 320
    problems = verdict_problems(eng.core, prompt, verdict)
    assert any("block 1 (usable at 320): 'raw' is not readable as compressed" in p
               for p in problems), problems
    assert any("(raw): read as compressed" in p for p in read_problems(eng.core, "history"))
