"""What a lease holds: the lookup's pass outputs (:class:`~kvfsm.lookup.Probe` ``passes``) and
the take's answer rows, with per-group views made only when asked. An index's targets outside
what the lease holds of their group are pinned through the core's ``pin`` and kept beside
(``targets``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError, LeaseLost
from kvfsm.lookup._buffers import (
    FIRST_EPOCH,
    FIRST_ID,
    FULL,
    HI,
    LO,
    ONE_READ,
    OUTSIDE,
    PINNED_AS,
    answer_runs,
    probed_ids,
)
from kvfsm.lookup._lease_pass import LeaseArrays
from kvfsm.lookup._lease_pins import first_moved, given_back
from kvfsm.state import MAX_PINS, StateCore, StateError
from kvfsm.state._core import LeasedRead, LeasedRun, PinRun

IdArray = NDArray[np.intp]
#: A lookup's pass per group: ``(name, spans, out, words, changes)`` (``Probe.passes``).
Passes = Sequence[tuple[str, Any, NDArray[np.int64], Any, int]]
#: Blocks pinned through the core's ``pin`` as an index's targets: ``(group, ids, epochs)``.
Targets = tuple[tuple[str, IdArray, NDArray[np.uint32]], ...]


class ProbedHold(NamedTuple):
    """What a lease holds: the groups' arrays, the lookup's passes and outputs (with where the
    ids and epochs start), the answer rows (:mod:`~kvfsm.lookup._buffers`), the core's change
    count at the take, the groups holding blocks, whether each holds one run at one epoch,
    and the index targets pinned beside."""

    arrays: LeaseArrays
    passes: Passes
    outs: tuple[NDArray[np.int64], ...]
    offsets: NDArray[np.int64]
    answers: NDArray[np.int64]
    changes: int
    holding: int
    one_runs: bool
    targets: Targets
    #: The take read the arrays through the bound entry point (:meth:`LeaseArrays.take`).
    bound: bool

    def unchanged(self) -> bool:
        """No group has changed since the take (so none of its blocks moved)."""
        return self.arrays.change_count.total == self.changes

    def blocks(self, g: int, row: list[int]) -> tuple[NDArray[np.intp], NDArray[np.uint32]]:
        """The ids and epochs group ``g`` holds, as views of the lookup's output."""
        ids, epochs = probed_ids(self.outs[g], int(self.offsets[g][0]),
                                  int(self.offsets[g][1]), row[LO], row[HI])
        return ids.view(np.intp), epochs

    def views(self) -> list[tuple[int, NDArray[np.intp], NDArray[np.uint32], int, bool]]:
        """Per group: its first prompt block, the ids and epochs held (views), how they were
        pinned, and whether they are one run at one epoch."""
        made = []
        for g, row in enumerate(self.answers.tolist()):
            ids, epochs = self.blocks(g, row)
            made.append((row[LO], ids, epochs, row[PINNED_AS], bool(row[ONE_READ])))
        return made

    def report_read(self, core: StateCore) -> None:
        """Tell ``core``'s observers the read a validated lease is about to do."""
        if self.one_runs and not self.targets:
            core.record_lease_runs(self.arrays.names, self.answers, self.holding,
                                   answer_runs)
        else:
            core.record_leased_reads(*self.reads())

    def reads(self) -> tuple[list[LeasedRead], list[LeasedRun]]:
        """The read a validated lease reports: each group's blocks as a run where they are
        one, else as arrays."""
        reads: list[LeasedRead] = []
        runs: list[LeasedRun] = []
        names = self.arrays.names
        for g, row in enumerate(self.answers.tolist()):
            count = row[HI] - row[LO]
            if count <= 0:
                continue
            if row[ONE_READ]:
                runs.append((names[g], row[FIRST_ID], count, row[FIRST_EPOCH]))
                continue
            ids, epochs = self.blocks(g, row)
            reads.append((names[g], ids, epochs, False))
        reads += [(name, ids, epochs, False) for name, ids, epochs in self.targets]
        return reads, runs

    def tell_pins(self, core: StateCore, delta: int) -> None:
        """Tell ``core``'s pin observers of the pins this lease took (``delta`` 1) or gave back
        (-1, after :meth:`unpin`). A give-back after the group changed tells only the pins
        given back (:func:`~kvfsm.lookup._lease_pins.given_back`)."""
        names, groups = self.arrays.names, self.arrays.groups
        # Nothing changed since the take: every pin taken is given back.
        whole = delta > 0 or self.unchanged()
        if whole and self.one_runs:
            core.tell_lease_pins(names, self.answers, self.holding, delta, answer_runs)
            return
        runs: list[PinRun] = []
        for g, row in enumerate(self.answers.tolist()):
            count = row[HI] - row[LO]
            if count <= 0:
                continue
            state = groups[g]
            if whole or state.changes == self.passes[g][4]:
                if row[ONE_READ]:
                    runs.append((names[g], row[FIRST_ID], count, delta))
                    continue
                ids, _ = self.blocks(g, row)
            else:
                ids, epochs = self.blocks(g, row)
                ids = given_back(state, ids, epochs, row[PINNED_AS])
            core.tell_pins(names[g], ids.copy(), delta)
        core.tell_pin_runs(runs)

    def unpin(self, groups: int | None = None) -> None:
        """Give back the pins of every group (or of the first ``groups``), not the targets'."""
        self.arrays.unpin(self.outs, self.offsets, self.answers,
                          len(self.outs) if groups is None else groups, self.bound)

    def unpin_targets(self, core: StateCore) -> None:
        """Give back the targets' pins through the core's ``unpin``, but on blocks whose epoch
        moved (their pin went with their content) or whose pins were released behind the
        lease's back."""
        for name, ids, epochs in self.targets:
            state = core.group(name)
            kept = ids[(state.epoch[ids] == epochs) & (state.block_pins[ids] > 0)]
            if kept.size:
                core.unpin(name, kept)

    def check(self) -> None:
        """LeaseLost naming the first block held that moved off its epoch, is no longer
        readable, or has since been seen failing its checksum. Its form needs no check: every
        row that changes a readable block's form bumps its epoch. Only groups changed since
        the take, and the targets, are looked at."""
        names, groups = self.arrays.names, self.arrays.groups
        held = [(groups[g], ids, epochs) for g, (_, ids, epochs, _, _) in enumerate(self.views())
                if groups[g].changes != self.passes[g][4]]
        held += [(groups[names.index(name)], ids, epochs) for name, ids, epochs in self.targets]
        for state, ids, epochs in held:
            first = first_moved(state, ids, epochs)
            if first < 0:
                continue
            block = int(ids[first])
            epoch, code = int(state.epoch[block]), int(state.states[block])
            if epoch != int(epochs[first]):
                why = "its content moved"
            elif not state.table.readable[code]:
                why = "it is no longer readable"
            else:
                why = "a lookup saw it fail its checksum"
            raise LeaseLost(why, group=state.name, block=block, old_epoch=int(epochs[first]),
                            new_epoch=epoch, state=state.table.state_name(code))


def refuse_probed(hold: ProbedHold, stop: int) -> NoReturn:
    """Give back the pins of the groups before ``stop``, then raise why group ``stop``
    refused the take: a KvfsmError (an id outside its group) or a StateError (a block
    already at ``MAX_PINS``)."""
    hold.unpin(stop)
    state, row = hold.arrays.groups[stop], hold.answers[stop].tolist()
    ids, _ = hold.blocks(stop, row)
    if row[OUTSIDE] >= 0:
        raise KvfsmError(f"{state.name}: block ids must lie in [0, {state.n_blocks}), got "
                         f"{int(ids[row[OUTSIDE]])}")
    raise StateError(f"{state.name}: more than {MAX_PINS} pins on one block (block "
                     f"{int(ids[row[FULL]])}); nothing was pinned")


__all__ = ["ProbedHold", "Targets", "refuse_probed"]
