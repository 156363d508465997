"""The state core: every group of a model, its pools, and the operations an engine calls.

It is the only writer of the logical line. Lifecycle states move only through the groups'
machines (``fire``); the other methods write data (content, identity, index references, pins,
recency) and check first that the lifecycle state allows it, so a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm.fsm import compile_lifecycle
from kvfsm.memory import Backend, NumpyBackend, SlotPool, select_backend
from kvfsm.spec import (
    Content,
    Event,
    Form,
    GroupKind,
    Layout,
    Lifecycle,
    ModelDecl,
    Tier,
    shipped_lifecycles,
)
from kvfsm.state._group import NO_TARGET, GroupState, IdArray
from kvfsm.state._hashing import hash_seed, join_words

#: The low 64-bit word of a 128-bit key.
_WORD = (1 << 64) - 1


_Shaped = TypeVar("_Shaped", NDArray[np.uint8], NDArray[np.int32])


class StateError(KvfsmError):
    """An operation is not allowed in the current state of some blocks; nothing changed."""


@attrs.frozen
class CoreConfig:
    """Pool sizes and limits. ``per_group`` overrides slots per tier for named groups."""

    device_blocks: int = 256
    host_blocks: int = 0
    per_group: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    max_restores_in_flight: int = 64
    cache_salt: str = ""
    backend: str = "auto"

    def slots(self, group: str) -> dict[Tier, int]:
        sizes = {Tier.DEVICE: self.device_blocks, Tier.HOST: self.host_blocks}
        for tier_name, count in self.per_group.get(group, {}).items():
            if tier_name.upper() not in Tier.__members__:
                raise KvfsmError(f"CoreConfig.per_group[{group!r}]: unknown tier {tier_name!r}; "
                                 f"tiers: {[t.spec_name for t in Tier]}")
            sizes[Tier[tier_name.upper()]] = int(count)
        return {tier: count for tier, count in sizes.items() if count > 0}


class StateCore:
    """Logical and physical line of every cache group of ``model``."""

    def __init__(
        self,
        model: ModelDecl,
        config: CoreConfig | None = None,
        *,
        lifecycles: Mapping[str, Lifecycle] | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.model = model
        self.config = config or CoreConfig()
        self.backend = backend or select_backend(self.config.backend)
        host_backend = NumpyBackend()
        known = lifecycles if lifecycles is not None else shipped_lifecycles()
        self.seed = hash_seed(model.name, model.layout_version, self.config.cache_salt)
        unknown = sorted(set(self.config.per_group) - {g.name for g in model.groups})
        if unknown:
            raise KvfsmError(f"CoreConfig.per_group names groups {unknown} that {model.name!r} "
                             f"does not have; groups: {[g.name for g in model.groups]}")
        self._tick = 0
        groups: dict[str, GroupState] = {}
        for decl in model.groups:
            table = compile_lifecycle(known[decl.lifecycle])
            pools = {}
            for tier, count in self.config.slots(decl.name).items():
                if tier not in table.lifecycle.tiers:
                    continue  # the lifecycle never puts this kind there
                on_device = tier is Tier.DEVICE
                pools[tier] = SlotPool(
                    tier, count, decl.payload_bytes,
                    backend=self.backend if on_device else host_backend,
                    alignment=decl.layout.alignment,
                    pinned=not on_device and self.backend.is_gpu,
                )
            if Tier.DEVICE not in pools:
                raise KvfsmError(f"group {decl.name!r}: needs at least one device slot")
            groups[decl.name] = GroupState(
                decl, table, pools,
                max_restores_in_flight=self.config.max_restores_in_flight,
                dependents=self._dependents_of(decl.name),
            )
        for state in groups.values():
            if state.decl.kind is GroupKind.SPARSE_INDEX and state.decl.target_group:
                state.target = groups[state.decl.target_group]
        self.groups: Mapping[str, GroupState] = MappingProxyType(groups)

    # -- lookup helpers --------------------------------------------------------------------

    def group(self, name: str) -> GroupState:
        try:
            return self.groups[name]
        except KeyError:
            raise KvfsmError(f"{self.model.name}: no group {name!r}; "
                             f"groups: {sorted(self.groups)}") from None

    def _ids(self, group: GroupState, ids: ArrayLike, *, unique: bool = True) -> IdArray:
        batch = np.asarray(ids, dtype=np.intp).ravel()
        if batch.size and (batch.min() < 0 or batch.max() >= group.n_blocks):
            raise KvfsmError(f"{group.name}: block ids must lie in [0, {group.n_blocks})")
        if unique and batch.size > 1:
            ordered = np.sort(batch)
            if (ordered[1:] == ordered[:-1]).any():
                raise KvfsmError(f"{group.name}: block ids repeat in one call")
        return batch

    def _require(self, group: GroupState, ids: IdArray, allowed: NDArray[np.bool_],
                 what: str) -> None:
        bad = ~allowed[group.states[ids]]
        if bad.any():
            names = [group.table.state_name(int(s)) for s in group.states[ids[bad]][:8]]
            raise StateError(f"{group.name}: cannot {what} blocks {ids[bad][:8].tolist()} "
                             f"in states {names}")

    def lookup_words(self, group: str, hash_high: ArrayLike, hash_low: ArrayLike) -> IdArray:
        """Block id per key given as its two uint64 words, -1 where the key is not in the map."""
        high = np.asarray(hash_high, dtype=np.uint64).ravel()
        low = np.asarray(hash_low, dtype=np.uint64).ravel()
        if high.size != low.size:
            raise KvfsmError(f"{group}: {high.size} high words but {low.size} low words")
        return self.group(group).hash_map.lookup(high, low)

    def lookup_hash(self, group: str, keys: list[int]) -> IdArray:
        """Block id per 128-bit key, -1 where the key is not in the map."""
        count = len(keys)
        high = np.fromiter(((key >> 64) & _WORD for key in keys), dtype=np.uint64, count=count)
        low = np.fromiter((key & _WORD for key in keys), dtype=np.uint64, count=count)
        found = self.lookup_words(group, high, low)
        # A key outside [0, 2**128) is in no map (its words would alias another key's).
        found[np.fromiter((key >> 128 != 0 for key in keys), dtype=np.bool_, count=count)] = -1
        return found

    # -- lifecycle -------------------------------------------------------------------------

    def allocate(
        self, group: str, positions: ArrayLike, hash_high: ArrayLike, hash_low: ArrayLike
    ) -> IdArray:
        """Allocate one block per position (all or nothing) with its identity; returns ids."""
        state = self.group(group)
        pos = np.asarray(positions, dtype=np.int32).ravel()
        high = np.asarray(hash_high, dtype=np.uint64).ravel()
        low = np.asarray(hash_low, dtype=np.uint64).ravel()
        if not pos.size == high.size == low.size:
            raise KvfsmError(f"{group}: positions and hashes differ in length")
        ids = state.pop_free_ids(pos.size)
        if ids.size < pos.size:
            raise StateError(f"{group}: {pos.size} blocks asked, {ids.size} logical ids free")
        moved = state.machine.fire_batch(ids, Event.ALLOCATE)
        state.note_allocated(ids, moved)
        state.position[ids], state.hash_high[ids], state.hash_low[ids] = pos, high, low
        self.touch(group, ids)
        return ids

    def fire(self, group: str, ids: ArrayLike, event: Event | str, *,
             masked: bool = False) -> NDArray[np.bool_]:
        """Fire ``event`` on blocks of ``group`` (use :meth:`allocate` to allocate)."""
        state = self.group(group)
        ev = Event.from_name(event) if isinstance(event, str) else Event(event)
        if ev is Event.ALLOCATE:
            raise KvfsmError(f"{group}: use StateCore.allocate, which also records the block's "
                             "identity, rather than firing 'allocate'")
        batch = self._ids(state, ids, unique=False)  # the machine refuses repeats itself
        moved = state.machine.fire_batch(batch, ev, masked=masked)
        state.note_entered_free(batch[moved])
        return moved

    def _dependents_of(self, group: str) -> Callable[[IdArray], None]:
        def invalidate(ids: IdArray) -> None:
            self._invalidate_dependents(group, ids)

        return invalidate

    def _invalidate_dependents(self, group: str, ids: IdArray) -> None:
        """Invalidate every index block that points at one of ``ids`` (an effect)."""
        for state in self.groups.values():
            if state.target is None or state.target.name != group or not ids.size:
                continue
            points = np.isin(state.refs_target, ids).any(axis=1)
            candidates = np.flatnonzero(points & state.event_row(Event.INVALIDATE)[state.states])
            if candidates.size:
                moved = state.machine.fire_batch(candidates, Event.INVALIDATE, masked=True)
                state.note_entered_free(candidates[moved])

    # -- data ------------------------------------------------------------------------------

    def write(self, group: str, ids: ArrayLike, payload: ArrayLike, *,
              sub_block: int | None = None) -> None:
        """Write content into blocks being written (state with partial content on device).

        With ``sub_block`` (compressed groups), ``payload`` is that sub-block's bytes only.
        """
        state = self.group(group)
        batch = self._ids(state, ids)
        writing = np.array([s.content is Content.PARTIAL and s.residency is Tier.DEVICE
                            for s in state.table.lifecycle.states])
        self._require(state, batch, writing, "write")
        pool = state.pools[Tier.DEVICE]
        slots = state.slot[Tier.DEVICE][batch]
        data = np.asarray(payload, dtype=np.uint8)
        payload_bytes = state.decl.payload_bytes
        if sub_block is None:
            pool.write(slots, self._rows(group, data, batch.size, payload_bytes))
            state.sub_blocks[batch] = state.full_sub_mask
            state.layout_id[batch] = state.write_layout
            return
        parts = state.decl.sub_blocks or 0
        if not 0 <= sub_block < parts:
            raise KvfsmError(f"{group}: sub_block {sub_block} outside [0, {parts})")
        width = -(-payload_bytes // parts)
        start, stop = sub_block * width, min((sub_block + 1) * width, payload_bytes)
        chunk = self._rows(group, data, batch.size, stop - start)
        rows = pool.read(slots)
        rows[:, start:stop] = chunk
        pool.write(slots, rows)
        state.sub_blocks[batch] |= np.uint16(1 << sub_block)
        state.layout_id[batch] = state.write_layout

    @staticmethod
    def _rows(group: str, data: _Shaped, count: int, width: int, what: str = "payload bytes"
              ) -> _Shaped:
        """``data`` as ``[count, width]``, or a KvfsmError naming the group and the shapes."""
        if data.size != count * width:
            raise KvfsmError(f"{group}: {data.size} {what} for {count} blocks; expected shape "
                             f"[{count}, {width}]")
        return data.reshape(count, width)

    def set_write_layout(self, group: str, layout: Layout) -> None:
        """Blocks written from now on are laid out as ``layout`` (e.g. the engine switched
        kernels); lookups compare each block's recorded layout with the reading kernel's."""
        state = self.group(group)
        if layout not in state.layouts:
            if len(state.layouts) >= 255:
                raise KvfsmError(f"{group}: too many layouts")
            state.layouts.append(layout)
        state.write_layout = state.layouts.index(layout)

    def read(self, group: str, ids: ArrayLike, *, form: Form | None = None) -> NDArray[np.uint8]:
        """The bytes of readable blocks; ``form`` asserts how the caller will interpret them."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.readable, "read")
        if form is not None:
            forms = np.array([s.form is form for s in state.table.lifecycle.states])
            self._require(state, batch, forms, f"read as {form.value}")
        return state.pools[Tier.DEVICE].read(state.slot[Tier.DEVICE][batch])

    def set_index_refs(self, group: str, ids: ArrayLike, targets: ArrayLike) -> None:
        """Record the target blocks of index blocks being written, at the targets' epochs."""
        state = self.group(group)
        batch = self._ids(state, ids)
        if state.target is None:
            raise KvfsmError(f"{group}: not a sparse-index group")
        writing = np.array([s.content is Content.PARTIAL for s in state.table.lifecycle.states])
        self._require(state, batch, writing, "set index references of")
        top_k = state.refs_target.shape[1]
        refs = self._rows(group, np.asarray(targets, dtype=np.int32), batch.size, top_k,
                          f"index targets (top_k {top_k})")
        used = refs != NO_TARGET
        if ((refs < NO_TARGET) | (refs >= state.target.n_blocks)).any():
            raise KvfsmError(f"{group}: target ids outside [0, {state.target.n_blocks})")
        state.refs_target[batch] = refs
        state.refs_epoch[batch] = np.where(used, state.target.epoch[np.where(used, refs, 0)], 0)

    # -- readers ---------------------------------------------------------------------------

    def pin(self, group: str, ids: ArrayLike) -> None:
        """A reader holds these (readable) blocks; an index also pins its targets."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.readable, "pin")
        targets = self._index_targets(state, batch)
        if state.target is not None and targets.size:
            self._require(state.target, np.unique(targets), state.target.table.readable,
                          "pin (as index targets)")
            np.add.at(state.target.pins, targets, 1)
        state.pins[batch] += np.uint16(1)
        self.touch(group, batch)

    def unpin(self, group: str, ids: ArrayLike) -> None:
        state = self.group(group)
        batch = self._ids(state, ids)
        if (state.pins[batch] == 0).any():
            raise StateError(f"{group}: unpin of unpinned blocks "
                             f"{batch[state.pins[batch] == 0][:8].tolist()}")
        targets = self._index_targets(state, batch)
        if state.target is not None and targets.size:
            held = np.bincount(targets, minlength=state.target.n_blocks)
            short = np.flatnonzero(state.target.pins < held)
            if short.size:
                # Someone unpinned a target this index still holds: refuse, never wrap.
                raise StateError(f"{group}: unpinning index blocks would release pins on "
                                 f"{state.target.name} blocks {short[:8].tolist()} that are "
                                 "no longer held (unbalanced unpin)")
            np.subtract.at(state.target.pins, targets, 1)
        state.pins[batch] -= np.uint16(1)

    @staticmethod
    def _index_targets(state: GroupState, batch: IdArray) -> IdArray:
        if state.target is None:
            return np.zeros(0, dtype=np.intp)
        refs = state.refs_target[batch].ravel()
        targets: IdArray = refs[refs != NO_TARGET].astype(np.intp)
        return targets

    def touch(self, group: str, ids: ArrayLike) -> None:
        """Mark blocks used now (for the LRU eviction order)."""
        state = self.group(group)
        batch = self._ids(state, ids, unique=False)
        self._tick += 1
        state.last_use[batch] = self._tick

    def eviction_candidates(self, group: str, count: int) -> IdArray:
        """Up to ``count`` least recently used device blocks that may be evicted now."""
        state = self.group(group)
        evictable = state.event_row(Event.EVICT) & state.table.readable
        mask = evictable[state.states] & (state.pins == 0)
        candidates = np.flatnonzero(mask)
        if candidates.size <= count:
            return candidates[np.argsort(state.last_use[candidates], kind="stable")]
        oldest = np.argpartition(state.last_use[candidates], count - 1)[:count]
        chosen = candidates[oldest]
        return chosen[np.argsort(state.last_use[chosen], kind="stable")]

    def hash_key(self, group: str, block: int) -> int:
        state = self.group(group)
        return join_words(int(state.hash_high[block]), int(state.hash_low[block]))

    # -- invariants ------------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """Every invariant violation, as ``group: invariant: detail`` lines (empty when sound)."""
        from kvfsm.state._invariants import core_problems

        return core_problems(self)

    def assert_invariants(self) -> None:
        """Raise :class:`InvariantViolation` listing every violation, if any."""
        problems = self.check_invariants()
        if problems:
            raise InvariantViolation(problems)


class InvariantViolation(KvfsmError):
    """The core broke one of its invariants: a bug in kvfsm or in a spec."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(problems))
