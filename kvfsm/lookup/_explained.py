"""A verdict whose ``groups``, ``reasons`` and ``plan`` are made on first read (most callers read
only the numbers), from the pass outputs and a snapshot taken before the lookup returns
(``PassOutput.freeze``): a later change to the core cannot alter them. Once made they are plain
fields for equality, hashing, ``repr``, ``attrs.evolve`` and pickling."""

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
    """An ``ExplainedLater`` field until made: a non-data descriptor, so ``__dict__`` then wins."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, verdict: ExplainedLater | None, owner: type | None = None) -> Any:
        if verdict is None:
            return self
        verdict.explain()
        return verdict.__dict__[self.name]


class ExplainedLater(Verdict):
    """A :class:`Verdict` whose ``groups``, ``reasons`` and ``plan`` are made on first read."""

    groups = _MadeOnRead("groups")
    reasons = _MadeOnRead("reasons")
    plan = _MadeOnRead("plan")

    def explain(self) -> None:
        """Make the lazy fields if not made (two threads may both: same snapshot, equal values)."""
        fields = self.__dict__
        make: Callable[[], Explanation] | None = fields.get("_explanation")
        if make is None:
            return
        fields["groups"], fields["reasons"], fields["plan"] = make()
        fields.pop("_explanation", None)

    def __getstate__(self) -> dict[str, Any]:
        self.explain()
        return {name: value for name, value in self.__dict__.items() if name != "_explanation"}

    # Equal to a plain Verdict with the same fields (attrs' comparison wants the same class).
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
    """A verdict of ``fields`` (all but :data:`LAZY_FIELDS`); ``explanation`` makes the rest."""
    verdict: ExplainedLater = _new(ExplainedLater)
    made = verdict.__dict__
    made.update(fields)
    made["_explanation"] = explanation
    return verdict
