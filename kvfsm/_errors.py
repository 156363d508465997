"""The exception hierarchy of kvfsm. Every error names what went wrong and where."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs


class KvfsmError(Exception):
    """Base class of every error kvfsm raises on purpose."""


@attrs.frozen
class SpecProblem:
    """One thing wrong with a spec: the file, the table, the row inside it and what is wrong."""

    file: str
    table: str
    row: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.table}: {self.row}: {self.message}"


class SpecError(KvfsmError):
    """A spec file is malformed. ``problems`` lists every problem found, one per line in ``str``."""

    def __init__(self, problems: Sequence[SpecProblem]) -> None:
        self.problems: tuple[SpecProblem, ...] = tuple(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


class TransitionError(KvfsmError):
    """A fire was refused; no state and no memory changed.

    ``ids`` are the offending object ids, ``states`` their state names at the time, ``event`` the
    event name and ``why`` the cause (no such row, or the named guard that said no).
    """

    def __init__(
        self, lifecycle: str, event: str, ids: Iterable[int], states: Iterable[str], why: str
    ) -> None:
        self.lifecycle = lifecycle
        self.event = event
        self.ids: tuple[int, ...] = tuple(int(i) for i in ids)
        self.states: tuple[str, ...] = tuple(states)
        self.why = why
        shown = ", ".join(f"{i} ({s})" for i, s in zip(self.ids[:8], self.states[:8], strict=True))
        more = f" and {len(self.ids) - 8} more" if len(self.ids) > 8 else ""
        super().__init__(f"{lifecycle}: event {event!r} refused for ids {shown}{more}: {why}")


class IllegalTransition(TransitionError):
    """The table has no row for ``(state, event)`` of some ids."""


class GuardRejected(TransitionError):
    """A row exists but one of its guards said no for some ids."""


class BindingError(KvfsmError):
    """A machine was built without an implementation for a guard or effect its table uses."""


class TokenError(KvfsmError, ValueError):
    """Token ids that are not integers in ``[0, 2**63)``, or not one flat sequence of them.

    The message names the first bad position and its value, e.g.
    ``token_ids[3] = 0.5 is not an integer token id``.
    """


class ForeignPromptError(KvfsmError):
    """A prompt was used with an engine (or a block size) it was not made for: its block hashes
    would never match that engine's cache, or it keeps none at the size asked for."""


class EngineClosed(KvfsmError):
    """The engine was closed (``Engine.close``): it answers nothing more and moves no block
    (its restore workers are stopped and its leases released)."""


class LeaseLost(KvfsmError):
    """A lease no longer guarantees the blocks its verdict called usable: it expired or was
    released, or a leased block's content moved (its epoch changed), or it is no longer
    readable in the form the kernel reads. ``group``, ``block``, ``old_epoch``, ``new_epoch``
    and ``state`` name the first such block (None where the whole lease is gone)."""

    def __init__(self, why: str, *, group: str | None = None, block: int | None = None,
                 old_epoch: int | None = None, new_epoch: int | None = None,
                 state: str | None = None) -> None:
        self.why = why
        self.group = group
        self.block = block
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch
        self.state = state
        where = "" if group is None else f"{group}: " if block is None else \
            f"{group} block {block}: "
        epochs = "" if old_epoch is None else f" (epoch {old_epoch} -> {new_epoch})"
        now = "" if state is None else f" (now {state})"
        super().__init__(f"lease lost: {where}{why}{epochs}{now}")
