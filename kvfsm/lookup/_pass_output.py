"""One group pass's output read back: its parts, the blocks failing at a length and why. It
reads only what the pass wrote and the snapshot :meth:`PassOutput.freeze` took before the lookup
returned, never the core's state now."""

from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from kvfsm._reasons import Reason
from kvfsm.fsm import CompiledTable
from kvfsm.kinds import KindRule
from kvfsm.kinds._sparse_index import current_references, stale_rows
from kvfsm.lookup._block_facts import FOUND
from kvfsm.lookup._buffers import (
    FIT,
    N_PER_BLOCK,
    NOW,
    NOW_CMP,
    NOW_RAW,
    SNAPSHOT_FAILED,
    SNAPSHOT_STATE,
    flag_start,
    snapshot_rows,
)
from kvfsm.lookup._paths import RestorePaths
from kvfsm.lookup._snapshot import take_snapshot
from kvfsm.lookup._spans import Spans
from kvfsm.lookup._statics import Statics
from kvfsm.lookup._why import Codes, reason_codes
from kvfsm.spec import GroupDecl
from kvfsm.state import GroupState

Bools = NDArray[np.bool_]


class Frozen(NamedTuple):
    """The core as explaining a group's verdict reads it, as at the lookup: the table, each
    block's state (0 where missing), whether its recorded check failed (None: not read), and for
    an index whether each failing row has a stale or dead reference (None: no index)."""

    table: CompiledTable
    states: NDArray[np.uint8]
    failed_checks: Bools | None
    stale: Bools | None


class PassOutput:
    """One group's pass output and how to read it back (set by ``GroupEval``, which runs it)."""

    #: Everything the last pass wrote (:func:`~kvfsm.lookup._buffers.out_offsets`).
    _out: NDArray[np.int64]
    _raw: NDArray[np.uint8] | None
    n: int
    lengths: NDArray[np.int64]
    spans: Spans
    decl: GroupDecl
    #: After :meth:`detach`, ``group`` and ``_statics`` are a record of what explaining reads.
    group: GroupState
    _statics: Statics
    #: The index's target group's evaluation (None: not an index, or detached).
    _history: PassOutput | None
    _has_index: bool
    #: The pass read the recorded checks, not the caller's answers (one seen failing stays failed).
    _recorded_checks: bool
    #: Layer 4 per block, where the pools do not guarantee alignment.
    align_ok: Bools | None = None
    #: Layer 1 per block, where this lookup computed data checksums.
    checksum_ok: Bools | None = None
    _needs: dict[int, tuple[int, int, int, bool]] | None = None
    #: Added by :meth:`freeze`: the table, an index's stale rows, whether the checks were copied.
    _snapshot: tuple[CompiledTable, Bools | None, bool] | None = None
    _frozen: Frozen | None = None

    @property
    def rule(self) -> KindRule:
        """The rule of the group's kind."""
        return self.group.rule

    @property
    def paths(self) -> RestorePaths:
        """The restore paths of the group's table (as this lookup used them)."""
        return self._statics.paths

    def _bytes(self) -> NDArray[np.uint8]:
        """The byte part of the output: a fact byte per block, then the flag rows."""
        raw = self._raw
        if raw is None:
            raw = self._raw = self._out[self.spans.out_at[2]:].view(np.uint8)
        return raw

    def _flag_row(self, row: int, length: int) -> Bools:
        """Flag row ``row`` (of N_FLAGS), its first ``length`` entries."""
        start = flag_start(self.n, self.lengths.size, row)
        flags: Bools = self._bytes()[start : start + length].view(np.bool_)
        return flags

    @property
    def ids(self) -> NDArray[np.intp]:
        """Per block: its id in the group, -1 where its hash is not in the map."""
        ids_at, epochs_at, _, _ = self.spans.out_at
        return self._out[ids_at:epochs_at].view(np.intp)

    @property
    def facts(self) -> NDArray[np.uint8]:
        """Per block: its fact bits (:mod:`kvfsm.lookup._block_facts`)."""
        return self._bytes()[: self.n]

    @property
    def now(self) -> Bools:
        """Per candidate length: usable now."""
        return self.row(NOW)

    def row(self, row: int) -> Bools:
        """Per-length row ``row`` (HIT, NOW, AFTER)."""
        return self._flag_row(N_PER_BLOCK + row, self.lengths.size)

    def holds(self, row: int, at: int) -> bool:
        """Per-length row ``row`` (HIT, NOW, AFTER) at candidate index ``at``."""
        return bool(self._bytes()[flag_start(self.n, self.lengths.size, N_PER_BLOCK + row) + at])

    @property
    def fit(self) -> Bools | None:
        """Per block: every reference of its index row holds (None: not an index)."""
        return self._flag_row(FIT, self.n) if self._has_index else None

    def _need(self, length: int) -> tuple[int, int, int, bool]:
        """Blocks ``[lo, hi)`` needed at ``length`` (not clipped to the prompt's), those before
        ``cut`` compressed, and whether the kind can serve ``length`` at all (cached)."""
        needs = self._needs
        if needs is None:
            needs = self._needs = {}
        known = needs.get(length)
        if known is not None:
            return known
        lengths = self.lengths
        at = int(lengths.searchsorted(length))
        if at < lengths.size and lengths[at] == length:
            lo, cut, hi = self.spans.needed[:, at].tolist()
            servable = self.spans.servable
            known = lo, cut, hi, servable is None or bool(servable[at])
        else:
            need = self.rule.needed(self.decl, np.array([length], dtype=np.int64))
            known = int(need.lo[0]), int(need.cut[0]), int(need.hi[0]), \
                need.servable is None or bool(need.servable[0])
        needs[length] = known
        return known

    def servable(self, length: int) -> bool:
        """The kind can serve ``length`` at all (whatever its blocks)."""
        return self._need(length)[3]

    def _forms(self, length: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Blocks needed at ``length`` as ``(start, end, flag row)``: compressed, then raw."""
        lo, cut, hi, _ = self._need(length)
        cut = min(max(cut, lo), hi)
        return (lo, cut, NOW_CMP), (cut, hi, NOW_RAW)

    def failing(self, length: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Needed blocks at ``length`` not usable now, in order, and whether each is needed
        compressed (a block past the prompt's end is missing)."""
        n = self.n
        parts = []
        forms = self._forms(length)
        for start, end, row in forms:
            inside_end = min(end, n)
            if start < inside_end:
                usable = self._flag_row(row, inside_end)[start:]
                parts.append(start + np.flatnonzero(~usable))
            if max(start, n) < end:
                parts.append(np.arange(max(start, n), end))
        if not parts:
            index = np.zeros(0, dtype=np.int64)
        else:
            index = (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(
                np.int64, copy=False)
        return index, index < forms[0][1]  # before the compressed blocks' end

    def freeze(self) -> None:
        """Take the snapshot :meth:`reason_codes` reads of the core. A lookup takes it before
        it returns, so reasons and plans made later say what was so at the lookup."""
        if self._snapshot is not None:
            return
        group = self.group
        record_failed = self.checksum_ok is None and self._recorded_checks
        take_snapshot(self._out, self.n, self.lengths.size, group.states, group.check,
                      record_failed)
        stale = None
        fit = self.fit
        if fit is not None:
            stale = np.zeros(self.n, dtype=np.bool_)
            rows = np.flatnonzero(~fit)
            blocks = self.ids[rows]
            rows, blocks = rows[blocks >= 0], blocks[blocks >= 0]  # found, references failed
            if rows.size:
                target = group.target
                assert target is not None
                targets, epochs = group.refs_target[blocks], group.refs_epoch[blocks]
                stale[rows] = stale_rows(targets, epochs, current_references(
                    targets, epochs, target_epoch=target.epoch, target_states=target.states,
                    hashed=target.table.hashed))
        self._snapshot = (group.table, stale, record_failed)

    def frozen(self) -> Frozen:
        """The snapshot (:meth:`freeze`, taken now where the lookup did not)."""
        frozen = self._frozen
        if frozen is not None:
            return frozen
        self.freeze()
        assert self._snapshot is not None
        table, stale, record_failed = self._snapshot
        rows = snapshot_rows(self._out, self.n, self.lengths.size)
        failed = rows[SNAPSHOT_FAILED].view(np.bool_) if record_failed else None
        frozen = self._frozen = Frozen(table, rows[SNAPSHOT_STATE], failed, stale)
        return frozen

    def detach(self) -> None:
        """Let go of the group's live state and its statics' arrays and pool, after
        :meth:`freeze`: a verdict explained later holds the output and snapshot, not the core."""
        self.freeze()
        kept = self._statics.kept  # read later only by the names the group and statics share
        self.group = cast(GroupState, kept)
        self._statics = cast(Statics, kept)
        self._history = None

    def missing_reason(self) -> Reason:
        """Why a needed block not in the hash map fails: the kind's reason where the group
        holds some block of the prompt, else ``NOT_CACHED``."""
        missing = self.rule.missing
        if missing is Reason.NOT_CACHED or missing is None:
            return Reason.NOT_CACHED
        held = self.n > 0 and bool((self.facts[:self.n] & FOUND).any())
        return missing if held else Reason.NOT_CACHED

    def reason_codes(self, index: NDArray[np.int64], compressed: Bools) -> Codes:
        """Reason codes (:data:`~kvfsm.lookup._why.BY_CODE`; 0: usable) of blocks ``index``."""
        frozen = self.frozen()
        return reason_codes(
            index, compressed, n=self.n, facts=self.facts, states=frozen.states,
            table=frozen.table, paths=self.paths, missing=self.missing_reason(),
            fit=self.fit if frozen.stale is not None else None,
            stale=frozen.stale, align_ok=self.align_ok, checksum_ok=self.checksum_ok,
            failed_checks=frozen.failed_checks)
