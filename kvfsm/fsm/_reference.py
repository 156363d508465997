"""The same lifecycle as a `transitions` state machine: the reference semantics.

It is slow (~10 µs a trigger) and used only to prove the compiled tables mean what the spec
says, and to draw diagrams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import Machine as _TransitionsMachine
from transitions import MachineError

from kvfsm._errors import GuardRejected, IllegalTransition
from kvfsm.spec._model import Call, Lifecycle
from kvfsm.spec._vocabulary import Event

GuardOracle = Callable[[Call], bool]


def transitions_rows(lifecycle: Lifecycle, oracle: GuardOracle | None) -> list[dict[str, Any]]:
    """The lifecycle's rows in the form `transitions` takes; guards ask ``oracle``."""
    out: list[dict[str, Any]] = []
    for row in lifecycle.rows:
        entry: dict[str, Any] = {
            "trigger": row.event.spec_name,
            "source": row.source,
            "dest": row.dest,
        }
        if row.guards:
            if oracle is None:
                entry["conditions"] = [str(call) for call in row.guards]
            else:
                entry["conditions"] = [_condition(oracle, call) for call in row.guards]
        out.append(entry)
    return out


def _condition(oracle: GuardOracle, call: Call) -> Callable[..., bool]:
    def check(*_: Any, **__: Any) -> bool:
        return oracle(call)

    check.__name__ = str(call)
    return check


class ReferenceMachine:
    """One object driven by a `transitions` machine built from ``lifecycle``.

    ``oracle`` decides every guard call (default: every guard passes).
    """

    def __init__(self, lifecycle: Lifecycle, oracle: GuardOracle | None = None) -> None:
        self.lifecycle = lifecycle
        self._oracle: GuardOracle = oracle or (lambda call: True)
        self._machine = _TransitionsMachine(
            model=self,
            states=list(lifecycle.state_names),
            transitions=transitions_rows(lifecycle, self._oracle),
            initial=lifecycle.initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=False,
        )

    @property
    def current(self) -> str:
        return str(self.state)  # type: ignore[attr-defined]

    def fire(self, event: Event) -> str:
        """Fire ``event``; returns the new state name, raising as the compiled machine does."""
        before = self.current
        try:
            moved = self.trigger(event.spec_name)  # type: ignore[attr-defined]
        except MachineError:
            raise IllegalTransition(
                self.lifecycle.name, event.spec_name, [0], [before], "no row for this state"
            ) from None
        except AttributeError:
            raise IllegalTransition(
                self.lifecycle.name,
                event.spec_name,
                [0],
                [before],
                "event not used by this lifecycle",
            ) from None
        if not moved:
            raise GuardRejected(
                self.lifecycle.name, event.spec_name, [0], [before], "a guard said no"
            )
        return self.current
