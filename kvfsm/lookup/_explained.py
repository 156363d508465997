"""A verdict whose explanation is made when first read.

A lookup's numbers (hit, usable, restorable) cost one compiled pass per group; explaining a
shortfall (each group's stop, the first blocks of each reason, the restore plan) costs some
forty array operations and a Python object per listed block, several times the numbers at short
prompts. A scheduler asks about every waiting request every step and mostly reads only the
numbers, so a verdict with something to explain is an :class:`ExplainedLater`: its ``groups``,
``reasons`` and ``plan`` are made on first read, from the lookup's pass outputs and a snapshot
of what else they read (each group's :meth:`~kvfsm.lookup._pass_output.PassOutput.freeze`, taken
before the lookup returns), so a change to the core after the lookup cannot alter them. Once
made they are plain fields: equality, hashing, ``repr``, ``attrs.evolve`` and pickling see the
values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvfsm.lookup._types import GroupVerdict, RestoreStep, Shortfall, Verdict

#: What explaining a verdict makes: its groups, reasons and plan.
Explanation = tuple[tuple[GroupVerdict, ...], tuple[Shortfall, ...], tuple[RestoreStep, ...]]

#: The fields made on first read.
LAZY_FIELDS = ("groups", "reasons", "plan")


class _MadeOnRead:
    """A field of an :class:`ExplainedLater` verdict until it is made: a non-data
    descriptor, so once the value sits in the instance's ``__dict__`` (where attrs' own
    ``__init__`` puts it too) it is read from there directly."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, verdict: ExplainedLater | None, owner: type | None = None) -> Any:
        if verdict is None:
            return self
        verdict.explain()
        return verdict.__dict__[self.name]


class ExplainedLater(Verdict):
    """A :class:`Verdict` whose ``groups``, ``reasons`` and ``plan`` are made on first read
    (see the module's text); every other field is set at the lookup."""

    groups = _MadeOnRead("groups")
    reasons = _MadeOnRead("reasons")
    plan = _MadeOnRead("plan")

    def explain(self) -> None:
        """Make ``groups``, ``reasons`` and ``plan`` now (nothing where they are made). Two
        threads may both make them: from the same snapshot, to equal values."""
        fields = self.__dict__
        make: Callable[[], Explanation] | None = fields.get("_explanation")
        if make is None:
            return
        fields["groups"], fields["reasons"], fields["plan"] = make()
        fields.pop("_explanation", None)

    def __getstate__(self) -> dict[str, Any]:
        self.explain()
        return {name: value for name, value in self.__dict__.items() if name != "_explanation"}

    # A value like any Verdict: equal to a plain one with the same fields (attrs' own
    # comparison wants the same class), hashed and shown as one.
    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Verdict and other.__class__ is not ExplainedLater:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _COMPARED)

    __hash__ = Verdict.__hash__

    def __repr__(self) -> str:
        shown = Verdict.__repr__(self)
        return "Verdict" + shown[shown.index("("):]


#: The fields a Verdict's equality compares.
_COMPARED = tuple(field.name for field in attrs.fields(Verdict) if field.eq)


_new = object.__new__


def explained_later(fields: dict[str, Any], explanation: Callable[[], Explanation]
                    ) -> ExplainedLater:
    """A verdict of ``fields`` (every field but :data:`LAZY_FIELDS`) explained by calling
    ``explanation`` when first read."""
    verdict: ExplainedLater = _new(ExplainedLater)
    made = verdict.__dict__
    made.update(fields)
    made["_explanation"] = explanation
    return verdict
