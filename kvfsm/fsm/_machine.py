"""The only place object states change: scalar and batched ``fire`` over a compiled table.

A batch is all-or-nothing by default: every id is checked against the table and every guard
before any effect runs or any state is written, so a refused batch leaves everything as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import BindingError, GuardRejected, IllegalTransition, KvfsmError
from kvfsm.fsm._compiled import INVALID, CompiledTable
from kvfsm.spec._model import Call, Row
from kvfsm.spec._vocabulary import Event

IdArray = NDArray[np.intp]


class GuardFn(Protocol):
    """Vectorized guard: for each id, may the row fire? Sees the whole batch at once, so a
    capacity guard can admit only as many ids as there is room for."""

    def __call__(self, ids: IdArray, call: Call) -> NDArray[np.bool_]: ...


class EffectFn(Protocol):
    """Vectorized effect: the memory work of ``row`` for every id of the batch, run once."""

    def __call__(self, ids: IdArray, call: Call, row: Row) -> None: ...


def _always(ids: IdArray, call: Call) -> NDArray[np.bool_]:
    return np.ones(ids.shape[0], dtype=np.bool_)


def _nothing(ids: IdArray, call: Call, row: Row) -> None:
    return None


def _event_id(event: Event | str | int) -> Event:
    if isinstance(event, str):
        try:
            return Event.from_name(event)
        except KeyError:
            raise KvfsmError(f"unknown event {event!r}") from None
    try:
        return Event(event)
    except ValueError:
        raise KvfsmError(f"unknown event id {event!r}") from None


#: Told, after every fire that moved objects, which ids moved, on which event and from which
#: states: how an owner keeps indexes derived from the states (a free-id stack, counts of
#: operations in flight) in step with every fire, at the cost of the ids moved.
MovedFn = Callable[[IdArray, Event, NDArray[np.uint8]], None]


class Machine:
    """States of ``capacity`` objects of one lifecycle, all starting in the initial state.

    ``guards`` and ``effects`` bind every guard and effect name the table uses to code; a
    missing binding is a :class:`BindingError` at construction unless ``permissive`` is set,
    in which case unbound guards always pass and unbound effects do nothing (for checking the
    table alone).
    """

    def __init__(
        self,
        table: CompiledTable,
        capacity: int,
        *,
        guards: Mapping[str, GuardFn] | None = None,
        effects: Mapping[str, EffectFn] | None = None,
        permissive: bool = False,
        name: str | None = None,
        on_moved: MovedFn | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.table = table
        #: How errors name this machine (the lifecycle's name unless the owner says better).
        self.name = name or table.name
        self._on_moved = on_moved
        self._states = np.full(capacity, table.initial, dtype=np.uint8)
        # One read-only view for every reader (made once: callers ask on hot paths).
        self._states_view = self._states.view()
        self._states_view.setflags(write=False)
        self._guards, self._effects = self._bind(table, guards or {}, effects or {}, permissive)
        rows = table.lifecycle.rows
        # Per row: the bound guards and effects, in declared order.
        self._row_guards: list[list[tuple[Call, GuardFn]]] = [
            [(call, self._guards[call.name]) for call in row.guards] for row in rows
        ]
        self._row_effects: list[list[tuple[Call, EffectFn]]] = [
            [(call, self._effects[call.name]) for call in row.effects] for row in rows
        ]
        self._row_has_work = np.array(
            [bool(row.guards or row.effects) for row in rows], dtype=np.bool_
        )
        # Contiguous per-event columns make the batched gather one cache-friendly take.
        self._next_by_event = [np.ascontiguousarray(table.next_state[:, e]) for e in Event]
        self._row_by_event = [np.ascontiguousarray(table.row_of[:, e]) for e in Event]
        self._next_list: list[list[int]] = table.next_state.tolist()
        self._row_list: list[list[int]] = table.row_of.tolist()
        # Scratch for the duplicate-id check: O(batch) instead of a sort.
        self._scratch = np.zeros(capacity, dtype=np.intp)
        self._arange = np.arange(capacity, dtype=np.intp)
        self._state_names = np.array(table.lifecycle.state_names, dtype=object)

    @staticmethod
    def _bind(
        table: CompiledTable,
        guards: Mapping[str, GuardFn],
        effects: Mapping[str, EffectFn],
        permissive: bool,
    ) -> tuple[dict[str, GuardFn], dict[str, EffectFn]]:
        used_guards = {c.name for row in table.lifecycle.rows for c in row.guards}
        used_effects = {c.name for row in table.lifecycle.rows for c in row.effects}
        missing = sorted((used_guards - set(guards)) | (used_effects - set(effects)))
        if missing and not permissive:
            raise BindingError(
                f"{table.name}: no implementation bound for {missing}; bind them or pass "
                "permissive=True"
            )
        bound_guards: dict[str, GuardFn] = {name: guards.get(name, _always) for name in used_guards}
        bound_effects: dict[str, EffectFn] = {
            name: effects.get(name, _nothing) for name in used_effects
        }
        return bound_guards, bound_effects

    # -- reading ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return int(self._states.shape[0])

    @property
    def states(self) -> NDArray[np.uint8]:
        """A read-only view of every object's state id."""
        return self._states_view

    def state_of(self, obj: int) -> str:
        """The state name of object ``obj``."""
        return self.table.state_name(int(self._states[obj]))

    def ids_in(self, state: str) -> IdArray:
        """The ids of all objects currently in ``state``."""
        return np.flatnonzero(self._states == self.table.state_id(state)).astype(np.intp)

    # -- firing ----------------------------------------------------------------------------

    def fire(self, obj: int, event: Event | str | int) -> int:
        """Fire ``event`` on one object; returns its new state id.

        Raises :class:`IllegalTransition` or :class:`GuardRejected`; nothing changes then.
        """
        ev = _event_id(event)
        if not 0 <= obj < self._states.shape[0]:
            raise KvfsmError(
                f"{self.name}: object id {obj} out of range [0, {self.capacity})"
            )
        state = int(self._states[obj])
        dest = self._next_list[state][ev]
        if dest == INVALID:
            raise IllegalTransition(
                self.name,
                ev.spec_name,
                [obj],
                [self.table.state_name(state)],
                "no row for this state",
            )
        row_index = self._row_list[state][ev]
        if self._row_has_work[row_index]:
            ids = np.array([obj], dtype=np.intp)
            for call, guard in self._row_guards[row_index]:
                if not bool(guard(ids, call)[0]):
                    raise GuardRejected(
                        self.name,
                        ev.spec_name,
                        [obj],
                        [self.table.state_name(state)],
                        f"guard {call} said no",
                    )
            row = self.table.lifecycle.rows[row_index]
            for call, effect in self._row_effects[row_index]:
                effect(ids, call, row)
        self._states[obj] = dest
        if self._on_moved is not None:
            self._on_moved(np.array([obj], dtype=np.intp), ev,
                           np.array([state], dtype=np.uint8))
        return dest

    def fire_batch(
        self, ids: ArrayLike, event: Event | str | int, *, masked: bool = False
    ) -> NDArray[np.bool_]:
        """Fire ``event`` on every object in ``ids`` (distinct); returns which ids moved.

        All-or-nothing unless ``masked``: when any id has no row or fails a guard, nothing
        changes and :class:`IllegalTransition` / :class:`GuardRejected` lists the offending ids
        and states. With ``masked=True`` the ids that can move do, and the rest stay put.
        """
        ev = _event_id(event)
        batch = self._check_ids(ids)
        if batch.size == 0:
            return np.zeros(0, dtype=np.bool_)
        current = self._states[batch]
        low, high = int(current.min()), int(current.max())
        if low == high:
            return self._fire_uniform(batch, current, low, ev, masked)
        dest = self._next_by_event[ev][current]
        ok = dest != INVALID
        if not masked and not ok.all():
            bad = np.flatnonzero(~ok)
            raise IllegalTransition(
                self.name,
                ev.spec_name,
                batch[bad],
                self._names(current[bad]),
                "no row for these states",
            )
        rows = self._row_by_event[ev][current]
        counts = np.bincount(rows[ok].astype(np.intp), minlength=len(self._row_guards))
        by_row = {
            int(r): np.flatnonzero((rows == r) & ok).astype(np.intp)
            for r in np.flatnonzero(counts).tolist()
            if self._row_has_work[r]
        }
        if by_row:
            ok = self._apply_guards(batch, current, by_row, ok, ev, masked)
            self._apply_effects(batch, {r: p[ok[p]] for r, p in by_row.items()})
        self._states[batch[ok]] = dest[ok]
        self._moved(batch, current, ok, ev)
        ok_mask: NDArray[np.bool_] = ok
        return ok_mask

    def _moved(self, batch: IdArray, before: NDArray[np.uint8], ok: NDArray[np.bool_] | None,
               ev: Event) -> None:
        """Tell the owner which ids moved (``ok`` None: all of them) and from where."""
        if self._on_moved is None:
            return
        if ok is None or bool(ok.all()):
            self._on_moved(batch, ev, before)
        elif ok.any():
            self._on_moved(batch[ok], ev, before[ok])

    # -- internals -------------------------------------------------------------------------

    def _fire_uniform(
        self, batch: IdArray, current: NDArray[np.uint8], state: int, ev: Event, masked: bool
    ) -> NDArray[np.bool_]:
        """Every id is in the same state, so one row (or none) applies to all: no per-id
        gathers of next state or row, just the guards, the effects and one scatter."""
        dest = self._next_list[state][ev]
        if dest == INVALID:
            if masked:
                return np.zeros(batch.size, dtype=np.bool_)
            raise IllegalTransition(
                self.name, ev.spec_name, batch, self._names(current), "no row for this state"
            )
        row_index = self._row_list[state][ev]
        ok = np.ones(batch.size, dtype=np.bool_)
        if self._row_has_work[row_index]:
            every = self._arange[: batch.size]
            ok = self._apply_guards(batch, current, {row_index: every}, ok, ev, masked)
            if ok.all():
                self._apply_effects(batch, {row_index: None})
                self._states[batch] = dest
                self._moved(batch, current, None, ev)
                return ok
            self._apply_effects(batch, {row_index: np.flatnonzero(ok).astype(np.intp)})
            self._states[batch[ok]] = dest
            self._moved(batch, current, ok, ev)
            return ok
        self._states[batch] = dest
        self._moved(batch, current, None, ev)
        return ok

    def _names(self, state_ids: NDArray[np.uint8]) -> list[str]:
        names: list[str] = self._state_names[state_ids].tolist()
        return names

    def _check_ids(self, ids: ArrayLike) -> IdArray:
        batch = np.asarray(ids)
        if batch.ndim != 1 or (batch.size and not np.issubdtype(batch.dtype, np.integer)):
            raise KvfsmError(
                f"{self.name}: ids must be a 1-D integer array, got "
                f"shape {batch.shape} dtype {batch.dtype}"
            )
        batch = batch.astype(np.intp, copy=False)
        if batch.size == 0:
            return batch
        low, high = int(batch.min()), int(batch.max())
        if low < 0 or high >= self.capacity:
            raise KvfsmError(
                f"{self.name}: object ids must lie in [0, {self.capacity}), "
                f"got min {low} max {high}"
            )
        if batch.size > self.capacity:
            raise KvfsmError(f"{self.name}: {batch.size} ids for {self.capacity} objects: "
                             "ids appear more than once in one batch")
        if batch.size > 1 and not (batch[1:] > batch[:-1]).all():
            # Not strictly increasing: look for repeats. With duplicates the last scatter wins,
            # so an earlier occurrence reads back another position. O(batch), no sort.
            positions = self._arange[: batch.size]
            self._scratch[batch] = positions
            clash = self._scratch[batch] != positions
            if clash.any():
                dupes = np.unique(batch[clash])
                raise KvfsmError(
                    f"{self.name}: ids appear more than once in one batch: "
                    f"{dupes[:8].tolist()}"
                )
        return batch

    def _apply_guards(
        self,
        batch: IdArray,
        current: NDArray[np.uint8],
        by_row: dict[int, IdArray],
        ok: NDArray[np.bool_],
        ev: Event,
        masked: bool,
    ) -> NDArray[np.bool_]:
        # A guard call is evaluated once over every id whose row names it, so a capacity guard
        # sees the whole demand of the batch even when several rows draw on the same tier.
        by_call: dict[Call, list[IdArray]] = {}
        for row_index, positions in by_row.items():
            for call, _ in self._row_guards[row_index]:
                by_call.setdefault(call, []).append(positions)
        copied = False
        for call in by_call:  # declared order, rows in table order, as scalar fire asks them
            parts = by_call[call]
            positions = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
            if copied:
                positions = positions[ok[positions]]
                if positions.size == 0:
                    continue
            ids = batch if positions.size == batch.size else batch[positions]
            passed = np.asarray(self._guards[call.name](ids, call), dtype=np.bool_)
            if passed.all():
                continue
            failed = positions[~passed]
            if not masked:
                raise GuardRejected(
                    self.name,
                    ev.spec_name,
                    batch[failed],
                    self._names(current[failed]),
                    f"guard {call} said no",
                )
            if not copied:
                ok, copied = ok.copy(), True
            ok[failed] = False
        return ok

    def _apply_effects(self, batch: IdArray, by_row: dict[int, IdArray | None]) -> None:
        """Run each row's effects once, in declared order; ``None`` positions mean every id."""
        for row_index, positions in by_row.items():
            effects = self._row_effects[row_index]
            if not effects or (positions is not None and positions.size == 0):
                continue
            ids = batch if positions is None else batch[positions]
            row = self.table.lifecycle.rows[row_index]
            for call, effect in effects:
                effect(ids, call, row)


def bind_all(
    table: CompiledTable, guard: Callable[[Call], bool] | None = None
) -> dict[str, GuardFn]:
    """Guards for every name the table uses, each answering ``guard(call)`` for the whole batch.

    Handy for tests and the reference comparison: one oracle decides each guard call.
    """
    names = {c.name for row in table.lifecycle.rows for c in row.guards}

    def make() -> GuardFn:
        def fn(ids: IdArray, call: Call) -> NDArray[np.bool_]:
            verdict = True if guard is None else guard(call)
            return np.full(ids.shape[0], verdict, dtype=np.bool_)

        return fn

    return {name: make() for name in names}


__all__: Sequence[str] = ["EffectFn", "GuardFn", "Machine", "MovedFn", "bind_all"]
