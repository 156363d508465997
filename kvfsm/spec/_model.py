"""Frozen values a lifecycle spec is loaded into."""

from __future__ import annotations

import attrs

from kvfsm.spec._vocabulary import Content, Event, Form, GroupKind, Tier


@attrs.frozen
class Call:
    """A guard or effect named by a row, with its optional argument (``has_room:host``)."""

    name: str
    arg: str | None = None

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    @property
    def tier(self) -> Tier | None:
        """The tier argument, for the calls that take one."""
        return None if self.arg is None else Tier[self.arg.upper()]


@attrs.frozen
class StateDef:
    """One lifecycle state and what it means for the block's memory and readers."""

    name: str
    doc: str
    #: Tiers in which an object in this state holds a slot.
    slots: tuple[Tier, ...]
    #: The tier holding the authoritative content, or None when there is none.
    residency: Tier | None
    content: Content
    form: Form
    #: A kernel may read the content now, from the device.
    readable: bool
    #: The object is reachable through the prefix hash map.
    hashed: bool
    #: An asynchronous operation (write, compress, spill, restore) is running.
    in_flight: bool


@attrs.frozen
class Row:
    """One transition: in ``source``, ``event`` moves to ``dest`` if every guard passes."""

    index: int
    source: str
    event: Event
    dest: str
    guards: tuple[Call, ...]
    effects: tuple[Call, ...]
    doc: str = ""
    #: Line of the row's ``[[rows]]`` header in the spec file (0 when unknown).
    line: int = 0

    @property
    def label(self) -> str:
        """How error messages and traces name this row."""
        where = f"line {self.line}, " if self.line else ""
        return f"#{self.index} ({where}{self.source} --{self.event.spec_name}--> {self.dest})"


@attrs.frozen
class Lifecycle:
    """A validated lifecycle table of one cache-object kind.

    ``initial`` is also the free state: every object starts there and must always be able to get
    back there (anything else is a leak).
    """

    name: str
    #: The kind of cache group this lifecycle is for; a model group must have the same kind.
    kind: GroupKind = attrs.field(validator=attrs.validators.instance_of(GroupKind))
    description: str
    initial: str
    states: tuple[StateDef, ...]
    rows: tuple[Row, ...]
    #: Where the spec was read from (a path, or ``<string>``).
    source: str
    #: SHA-256 of the spec file's bytes; docs and diagrams record it to detect drift.
    spec_hash: str

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(state.name for state in self.states)

    def state(self, name: str) -> StateDef:
        """The state called ``name``; raises ``KeyError`` when there is none."""
        for state in self.states:
            if state.name == name:
                return state
        raise KeyError(f"{self.name}: no state {name!r}")

    @property
    def events(self) -> tuple[Event, ...]:
        """The events this kind uses, in event-id order."""
        return tuple(sorted({row.event for row in self.rows}))

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers any state of this kind holds slots in, fastest first."""
        return tuple(sorted({tier for state in self.states for tier in state.slots}))
