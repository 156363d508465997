"""The state core: every group of a model, its pools, and the operations an engine calls.

It is the only writer of the logical line. Lifecycle states move only through the groups'
machines (``fire``); the other methods write data (content, identity, index references, pins,
recency) and check first that the lifecycle state allows it, so a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeVar

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm.fsm import FORM_CODE, compile_lifecycle
from kvfsm.memory import Backend, NumpyBackend, SlotPool, select_backend
from kvfsm.spec import (
    Event,
    Form,
    Layout,
    Lifecycle,
    ModelDecl,
    Tier,
    shipped_lifecycles,
)
from kvfsm.spec._vocabulary import DISCOVER_EVENT, STORED_TIERS
from kvfsm.state._budget import RestoreBudget
from kvfsm.state._group import (
    EVICT_LIST,
    FAILED,
    NO_TARGET,
    PIN_CHUNK_SHIFT,
    RECLAIM_LIST,
    UNCHECKED,
    VERIFIED,
    ChangeCount,
    CoreObserver,
    GroupState,
    IdArray,
    StateError,
)
from kvfsm.state._hashing import XXH3_128, check_hash_function, hash_seed, join_words
from kvfsm.state._recency import Clock
from kvfsm.state._scratch import Scratch

#: The low 64-bit word of a 128-bit key.
_WORD = (1 << 64) - 1


_Shaped = TypeVar("_Shaped", NDArray[np.uint8], NDArray[np.int32])


#: A read a lease reports: ``(group, ids, epochs, one_run)`` (see
#: :meth:`StateCore.record_leased_reads`).
LeasedRead = tuple[str, IdArray, NDArray[np.uint32], bool]
#: A read of ``count`` consecutive ids from ``first``, all at ``epoch``: ``(group, first,
#: count, epoch)``.
LeasedRun = tuple[str, int, int, int]


#: How a lease's answer rows spell its runs (the lease's own decoder,
#: :func:`kvfsm.lookup._buffers.answer_runs`: the core does not read their layout).
AnswerRuns = Callable[[tuple[str, ...], NDArray[np.int64]], list[LeasedRun]]


#: Pins that ``count`` consecutive ids from ``first`` each gained (``delta`` > 0) or gave back
#: (``delta`` < 0): ``(group, first, count, delta)``.
PinRun = tuple[str, int, int, int]
#: An observer told of pins, with its ``pinned(group, ids, delta)``, ``pinned_runs(runs)`` and
#: ``pinned_answer_runs(names, answers, count, delta)`` methods (None where it has none; it
#: has one of the first two at least).
_PinObserver = tuple[CoreObserver, Callable[[str, IdArray, int], None] | None,
                     Callable[[Sequence[PinRun]], None] | None,
                     Callable[[tuple[str, ...], NDArray[np.int64], int, int], None] | None]


def id_runs(group: str, ids: IdArray, delta: int) -> list[PinRun]:
    """``ids`` (repeats allowed) as runs of consecutive ids, each gaining ``delta`` pins."""
    if not ids.size:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).tolist()
    ends = [*breaks.tolist(), int(ids.size)]
    firsts = ids[starts].tolist()
    return [(group, first, end - start, delta)
            for first, start, end in zip(firsts, starts, ends, strict=True)]


#: An observer told of reads, with its ``read_runs`` and ``read_answer_runs`` methods (None
#: where it has none).
_ReadObserver = tuple[CoreObserver, Callable[[Sequence[LeasedRun]], None] | None,
                      Callable[[tuple[str, ...], NDArray[np.int64], int], None] | None]

#: Backends a config may name.
BACKENDS: Final = ("auto", "numpy", "cupy")


def _count(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    """attrs validator: an ``int`` (not a bool) of at least ``minimum``."""

    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise KvfsmError(f"CoreConfig.{attribute.name} must be an int, got {value!r}")
        if value < minimum:
            raise KvfsmError(f"CoreConfig.{attribute.name} must be >= {minimum}, got {value}")

    return check


def _optional_count(instance: object, attribute: attrs.Attribute[int | None],
                    value: int | None) -> None:
    """attrs validator: None (no cap) or an ``int`` >= 0."""
    if value is not None:
        _count(0)(instance, attribute, value)  # type: ignore[arg-type]


#: The largest ``CoreConfig.pin_chunk_blocks`` (a chunk's pins are one uint16 counter; past
#: this a lease's run rarely holds a whole chunk).
MAX_PIN_CHUNK: Final = 1 << 16


def _check_pin_chunk(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _count(1)(instance, attribute, value)
    if value & (value - 1) or value > MAX_PIN_CHUNK:
        raise KvfsmError(f"CoreConfig.pin_chunk_blocks must be a power of two up to "
                         f"{MAX_PIN_CHUNK}, got {value}")


def _check_per_group(instance: object,
                     attribute: attrs.Attribute[Mapping[str, Mapping[str, int]]],
                     value: Mapping[str, Mapping[str, int]]) -> None:
    for group, sizes in value.items():
        for tier_name, count in sizes.items():
            if not isinstance(tier_name, str) or tier_name.upper() not in Tier.__members__:
                raise KvfsmError(f"CoreConfig.per_group[{group!r}]: unknown tier {tier_name!r}; "
                                 f"tiers: {[t.spec_name for t in Tier]}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise KvfsmError(f"CoreConfig.per_group[{group!r}][{tier_name!r}] must be an "
                                 f"int >= 0, got {count!r}")


def _check_hash_function(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    check_hash_function(value, "CoreConfig.hash_function")


def _check_backend(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in BACKENDS:
        raise KvfsmError(f"CoreConfig.backend must be one of {list(BACKENDS)}, got {value!r}")


@attrs.frozen
class CoreConfig:
    """Pool sizes and limits. ``per_group`` overrides slots per tier for named groups."""

    device_blocks: int = attrs.field(default=256, validator=_count(1))
    host_blocks: int = attrs.field(default=0, validator=_count(0))
    #: Blocks per group that may hold a copy on disk / in the remote store (logical ids beyond
    #: the pools: a block known only there has no slot). 0 leaves the tier out.
    disk_blocks: int = attrs.field(default=0, validator=_count(0))
    remote_blocks: int = attrs.field(default=0, validator=_count(0))
    per_group: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict,
                                                             validator=_check_per_group)
    #: Blocks per group that may be restoring at once (the ``admission_open`` guard).
    max_restores_in_flight: int = attrs.field(default=64, validator=_count(0))
    #: Core-wide caps on restores in flight, in blocks and in payload bytes, across every
    #: group (None: no cap); the admission gate moves them at run time (see RestoreBudget).
    max_restore_ops: int | None = attrs.field(default=None, validator=_optional_count)
    max_restore_bytes: int | None = attrs.field(default=None, validator=_optional_count)
    cache_salt: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    backend: str = attrs.field(default="auto", validator=_check_backend)
    #: The block hash (``kvfsm.state.HASH_FUNCTIONS``): "xxh3_128" (fast) or "sha256"
    #: (collision resistant); part of the seed, so engines hashing differently share no block.
    hash_function: str = attrs.field(default=XXH3_128, validator=_check_hash_function)
    #: Consecutive block ids per lease pin chunk (a power of two): a lease over a run of ids
    #: pins the whole chunks inside it once each, its two ends block by block. Small values
    #: let tests with small pools exercise chunk pins.
    pin_chunk_blocks: int = attrs.field(default=1 << PIN_CHUNK_SHIFT,
                                        validator=_check_pin_chunk)

    def slots(self, group: str) -> dict[Tier, int]:
        sizes = {Tier.DEVICE: self.device_blocks, Tier.HOST: self.host_blocks,
                 Tier.DISK: self.disk_blocks, Tier.REMOTE: self.remote_blocks}
        for tier_name, count in self.per_group.get(group, {}).items():
            sizes[Tier[tier_name.upper()]] = int(count)
        return {tier: count for tier, count in sizes.items() if count > 0}


@attrs.frozen
class BlockInfo:
    """What the core records about one block (for callers and debugging)."""

    group: str
    block: int
    state: str
    position: int
    epoch: int
    pins: int
    #: The layout its content was written under.
    layout: Layout
    #: True: its bytes matched their checksum at the current epoch; False: a lookup saw them
    #: fail; None: not checked since the epoch last moved.
    verified: bool | None
    #: The tiers where it holds a slot, with the slot.
    slots: Mapping[Tier, int]
    #: The stored tiers (disk, remote) where it holds a copy, named by its identity.
    stored: tuple[Tier, ...] = ()


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
        if not isinstance(model, ModelDecl):
            raise KvfsmError(f"StateCore needs a ModelDecl (load_model, shipped_models), got "
                             f"{type(model).__name__}")
        if config is not None and not isinstance(config, CoreConfig):
            raise KvfsmError(f"config must be a CoreConfig, got {type(config).__name__}")
        self.model = model
        self.config = config or CoreConfig()
        known = dict(shipped_lifecycles()) if lifecycles is None else dict(lifecycles)
        missing = sorted({g.lifecycle for g in model.groups} - set(known))
        if missing:
            raise KvfsmError(f"{model.name}: groups follow lifecycles {missing} that were not "
                             f"given; lifecycles: {sorted(known)} (pass lifecycles={{name: "
                             "Lifecycle}} for custom ones)")
        unknown = sorted(set(self.config.per_group) - {g.name for g in model.groups})
        if unknown:
            raise KvfsmError(f"CoreConfig.per_group names groups {unknown} that {model.name!r} "
                             f"does not have; groups: {[g.name for g in model.groups]}")
        self.backend = backend or select_backend(self.config.backend)
        host_backend = NumpyBackend()
        self.seed = hash_seed(model.name, model.layout_version, self.config.cache_salt,
                              self.config.hash_function)
        #: The use counter behind ``last_use`` (shared with every group).
        self.clock = Clock()
        #: Changes to any group, ever (shared with every group; see :class:`ChangeCount`).
        self.change_count = ChangeCount()
        #: What the layers above keep per core (a lookup's view of the groups), by their own
        #: keys. Kept here, it goes with the core: a module-level map from cores to values
        #: that hold the core's groups would keep every core it ever saw alive.
        self.caches: dict[str, object] = {}
        #: Told of every moved batch and reported read (shared with every group).
        self._observers: list[CoreObserver] = []
        #: The observers told of reads (those that do not say ``observes_reads = False``),
        #: each with its ``read_runs`` and ``read_answer_runs`` methods or None, found once
        #: when it is attached.
        self._read_observers: list[_ReadObserver] = []
        #: Some attached observer is told of reads (a caller may skip gathering reads to
        #: report when none is). An attribute, not a property: a validated lease reads it
        #: right after a long lookup, where each Python frame costs cache misses.
        self.reads_observed = False
        #: The observers told of pins (those with a ``pinned`` or ``pinned_runs`` method),
        #: with those methods, found once when each is attached.
        self._pin_observers: list[_PinObserver] = []
        #: Some attached observer is told of pins: the pin writers (leases included) gather
        #: nothing to report where none is.
        self.pins_observed = False
        #: The ``checks_failed``, ``written`` and ``indexed`` methods of attached observers
        #: (found once when each is attached; see :class:`CoreObserver`).
        self._failed_observers: list[tuple[CoreObserver, Callable[
            [str, IdArray, NDArray[np.uint32]], None]]] = []
        self._write_observers: list[tuple[CoreObserver, Callable[[str, IdArray, int], None]]] = []
        self._ref_observers: list[tuple[CoreObserver, Callable[
            [str, IdArray, NDArray[np.int32], NDArray[np.uint32]], None]]] = []
        #: Restores in flight across the groups and their caps (shared with every group).
        self.restore_budget = RestoreBudget(self.config.max_restore_ops,
                                            self.config.max_restore_bytes)
        # Working arrays for O(ids) set operations, sized for the largest group, made on use.
        largest = max(sum(self.config.slots(decl.name).values()) for decl in model.groups)
        self._scratch = Scratch(largest)
        groups: dict[str, GroupState] = {}
        for decl in model.groups:
            table = compile_lifecycle(known[decl.lifecycle])
            pools = {}
            stored: dict[Tier, int] = {}
            for tier, count in self.config.slots(decl.name).items():
                if tier not in table.lifecycle.tiers:
                    continue  # the lifecycle never puts this kind there
                if tier in STORED_TIERS:
                    stored[tier] = count  # copies by key: ids to know them by, no bytes here
                    continue
                on_device = tier is Tier.DEVICE
                try:
                    pools[tier] = SlotPool(
                        tier, count, decl.payload_bytes,
                        backend=self.backend if on_device else host_backend,
                        alignment=decl.layout.alignment,
                        pinned=not on_device and self.backend.is_gpu,
                    )
                except MemoryError:
                    raise KvfsmError(
                        f"group {decl.name!r}: no memory for {count} {tier.spec_name} blocks "
                        f"of {decl.block_bytes} bytes ({count * decl.block_bytes} bytes); "
                        "lower the pool sizes in CoreConfig") from None
            if Tier.DEVICE not in pools:
                raise KvfsmError(f"group {decl.name!r}: needs at least one device slot")
            groups[decl.name] = GroupState(
                decl, table, pools,
                max_restores_in_flight=self.config.max_restores_in_flight,
                dependents=self._dependents_of(decl.name),
                stored=stored,
                observers=self._observers,
                budget=self.restore_budget,
                scratch=self._scratch,
                clock=self.clock,
                change_count=self.change_count,
                pin_shift=self.config.pin_chunk_blocks.bit_length() - 1,
            )
        for state in groups.values():
            if state.decl.target_group is not None:
                state.bind_target(groups[state.decl.target_group])
        self.groups: Mapping[str, GroupState] = MappingProxyType(groups)

    # -- lookup helpers --------------------------------------------------------------------

    def group(self, name: str) -> GroupState:
        try:
            return self.groups[name]
        except (KeyError, TypeError):
            raise KvfsmError(f"{self.model.name}: no group {name!r}; "
                             f"groups: {sorted(self.groups)}") from None

    def block_ids(self, group: str, ids: ArrayLike, *, unique: bool = True) -> IdArray:
        """``ids`` as a flat intp array of ``group``'s blocks, or a KvfsmError naming the
        group where they are not integers, lie outside the group or (``unique``) repeat."""
        return self._ids(self.group(group), ids, unique=unique)

    def _ids(self, group: GroupState, ids: ArrayLike, *, unique: bool = True) -> IdArray:
        raw = np.asarray(ids)
        if raw.size and not np.issubdtype(raw.dtype, np.integer):
            raise KvfsmError(f"{group.name}: block ids must be integers, got dtype {raw.dtype}")
        batch = raw.astype(np.intp, copy=False).ravel()
        if batch.size and (batch.min() < 0 or batch.max() >= group.n_blocks):
            raise KvfsmError(f"{group.name}: block ids must lie in [0, {group.n_blocks})")
        if unique and batch.size > 1 and group.distinct(batch).size != batch.size:
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
        state.machine.fire_batch(ids, Event.ALLOCATE)
        state.record_identity(ids, pos, high, low)
        self.touch(group, ids)
        return ids

    def discover(self, group: str, positions: ArrayLike, hash_high: ArrayLike,
                 hash_low: ArrayLike, tier: Tier) -> IdArray:
        """Adopt copies found in the stored ``tier`` (all or nothing): one block per position,
        with its identity, known there and a hash hit, not yet loaded (a restore verifies
        it). Keys already in the hash map are an error: the map serves one block per key."""
        state = self.group(group)
        event = DISCOVER_EVENT.get(Tier(tier))
        if event is None:
            stored = sorted(t.spec_name for t in DISCOVER_EVENT)
            raise KvfsmError(f"{group}: copies are discovered in stored tiers {stored}, "
                             f"not {Tier(tier).spec_name}")
        pos = np.asarray(positions, dtype=np.int32).ravel()
        high = np.asarray(hash_high, dtype=np.uint64).ravel()
        low = np.asarray(hash_low, dtype=np.uint64).ravel()
        if not pos.size == high.size == low.size:
            raise KvfsmError(f"{group}: positions and hashes differ in length")
        if (state.hash_map.lookup(high, low) != -1).any():
            raise StateError(f"{group}: some keys are already blocks here; discover only misses")
        ids = state.pop_free_ids(pos.size)
        if ids.size < pos.size:
            raise StateError(f"{group}: {pos.size} blocks asked, {ids.size} logical ids free")
        # The identity is what publish_hash publishes, so it is written first and put back if
        # the fire is refused (free blocks' identities are never read, but nothing changes).
        saved = (state.position[ids].copy(), state.hash_high[ids].copy(),
                 state.hash_low[ids].copy(), state.sub_blocks[ids].copy(),
                 state.layout_id[ids].copy())
        state.record_identity(ids, pos, high, low)
        state.record_written(ids)
        try:
            state.machine.fire_batch(ids, event)
        except Exception:
            state.restore_identity(ids, *saved)
            raise
        self.touch(group, ids)
        return ids

    def fire(self, group: str, ids: ArrayLike, event: Event | str, *,
             masked: bool = False) -> NDArray[np.bool_]:
        """Fire ``event`` on blocks of ``group`` (use :meth:`allocate` to allocate)."""
        state = self.group(group)
        ev = _event(group, event)
        if ev is Event.ALLOCATE or ev in DISCOVER_EVENT.values():
            raise KvfsmError(f"{group}: use StateCore.allocate / discover, which also record "
                             f"the block's identity, rather than firing {ev.spec_name!r}")
        if masked.__class__ is not bool:
            raise KvfsmError(f"{group}: masked must be True or False, got {masked!r}")
        batch = self._ids(state, ids, unique=False)  # the machine refuses repeats itself
        return state.machine.fire_batch(batch, ev, masked=masked)

    # -- observers -------------------------------------------------------------------------

    def add_observer(self, observer: CoreObserver) -> None:
        """Tell ``observer`` of every batch that moves from now on, whoever fires it (and of
        every read reported by :meth:`record_read`), in the order they happen."""
        if any(known is observer for known in self._observers):
            raise KvfsmError(f"{self.model.name}: observer {observer!r} is already attached")
        self._observers.append(observer)
        if getattr(observer, "observes_reads", True):
            self._read_observers.append((observer, getattr(observer, "read_runs", None),
                                         getattr(observer, "read_answer_runs", None)))
            self.reads_observed = True
        # The optional methods, looked up once: an observer without them (written before
        # they existed) is told of moves and reads only.
        pinned, pinned_runs = getattr(observer, "pinned", None), \
            getattr(observer, "pinned_runs", None)
        if pinned is not None or pinned_runs is not None:
            self._pin_observers.append((observer, pinned, pinned_runs,
                                        getattr(observer, "pinned_answer_runs", None)))
            self.pins_observed = True
        for name, told in (("checks_failed", self._failed_observers),
                           ("written", self._write_observers),
                           ("indexed", self._ref_observers)):
            method = getattr(observer, name, None)
            if method is not None:
                told.append((observer, method))

    def remove_observer(self, observer: CoreObserver) -> None:
        """Stop telling ``observer``; an observer not attached is an error."""
        for index, known in enumerate(self._observers):
            if known is observer:
                del self._observers[index]
                self._read_observers = [each for each in self._read_observers
                                        if each[0] is not observer]
                self.reads_observed = bool(self._read_observers)
                self._pin_observers = [each for each in self._pin_observers
                                       if each[0] is not observer]
                self.pins_observed = bool(self._pin_observers)
                for name in ("_failed_observers", "_write_observers", "_ref_observers"):
                    setattr(self, name, [each for each in getattr(self, name)
                                         if each[0] is not observer])
                return
        raise KvfsmError(f"{self.model.name}: observer {observer!r} is not attached")

    @property
    def observed(self) -> bool:
        """Some observer is attached."""
        return bool(self._observers)

    def tell_pins(self, group: str, ids: IdArray, delta: int) -> None:
        """Tell the pin observers that each of ``ids`` (a copy they may keep; repeats add up)
        gained ``delta`` pins (given back: below 0). For pin writers, after the pins moved;
        callers check :attr:`pins_observed` first (nothing to gather where it is False)."""
        if not ids.size:
            return
        runs: list[PinRun] | None = None
        for _, pinned, pinned_runs, _ in self._pin_observers:
            if pinned is not None:
                pinned(group, ids, delta)
                continue
            assert pinned_runs is not None
            if runs is None:
                runs = id_runs(group, ids, delta)
            pinned_runs(runs)

    def tell_pin_runs(self, runs: Sequence[PinRun]) -> None:
        """Tell the pin observers of pins that moved on runs of consecutive ids
        (``(group, first, count, delta)``, several in one call: a lease's groups): one call
        to an observer with ``pinned_runs``, the ids spelled out for any other."""
        if runs:
            self.tell_pin_runs_to(runs, self._pin_observers)

    def tell_lease_pins(self, names: tuple[str, ...], answers: NDArray[np.int64], count: int,
                        delta: int, answer_runs: AnswerRuns) -> None:
        """:meth:`tell_pin_runs` of a lease holding one run of consecutive ids in each of
        ``count`` groups, given as the answer rows of its one-pass take (as
        :meth:`record_lease_runs`): an observer with ``pinned_answer_runs(names, answers,
        count, delta)`` is handed them as they are (the lease never changes the array), any
        other is told them as runs (decoded by ``answer_runs``)."""
        runs: list[PinRun] | None = None
        for _, _, _, by_answers in self._pin_observers:
            if by_answers is not None:
                by_answers(names, answers, count, delta)
                continue
            if runs is None:
                runs = [(group, first, length, delta)
                        for group, first, length, _ in answer_runs(names, answers)]
        if runs is not None:
            self.tell_pin_runs_to(runs, [each for each in self._pin_observers
                                         if each[3] is None])

    def tell_pin_runs_to(self, runs: Sequence[PinRun],
                         observers: Sequence[_PinObserver]) -> None:
        """:meth:`tell_pin_runs` to ``observers`` only."""
        for _, pinned, pinned_runs, _ in observers:
            if pinned_runs is not None:
                pinned_runs(runs)
                continue
            assert pinned is not None
            for group, first, count, delta in runs:
                pinned(group, np.arange(first, first + count, dtype=np.intp), delta)

    def record_read(self, group: str, ids: ArrayLike) -> None:
        """Tell the observers that ``ids`` were read at their current epochs. Nothing changes
        and nothing is checked here beyond the ids: an event-log replay checks that they
        were readable at those epochs."""
        state = self.group(group)
        batch = self._ids(state, ids, unique=False)
        if self._read_observers and batch.size:
            read, epochs = batch.copy(), state.epoch[batch]
            for observer, _, _ in self._read_observers:
                observer.read(group, read, epochs)

    def record_leased_reads(self, reads: Sequence[LeasedRead],
                            runs: Sequence[LeasedRun] = ()) -> None:
        """:meth:`record_read` of the blocks a lease just validated, per group at the epochs
        it recorded: the ids are the core's own and their epochs known, so nothing is checked
        or gathered again, and the arrays are handed to observers as they are (a lease never
        changes them). Each read is ``(group, ids, epochs, one_run)``; where the caller knows
        a read's ids are consecutive at one epoch (``one_run``), or gives it as a run
        ``(group, first, count, epoch)`` in ``runs``, an observer with a ``read_runs`` method
        is told all of those in one call, with no array to scan (any other observer gets
        them as arrays)."""
        if not self._read_observers:
            return
        # Runs are made once for every observer that takes them.
        every_run = runs if not reads else \
            [*runs, *[(group, int(ids[0]), ids.size, int(epochs[0]))
                      for group, ids, epochs, one_run in reads if one_run and ids.size]]
        for observer, read_runs, _ in self._read_observers:
            for group, ids, epochs, one_run in reads:
                if ids.size and not (one_run and read_runs is not None):
                    observer.read(group, ids, epochs)
            if read_runs is not None:
                if every_run:
                    read_runs(every_run)
                continue
            for group, first, count, epoch in runs:
                observer.read(group, np.arange(first, first + count, dtype=np.intp),
                              np.full(count, epoch, dtype=np.uint32))

    def record_lease_runs(self, names: tuple[str, ...], answers: NDArray[np.int64],
                          count: int, answer_runs: AnswerRuns) -> None:
        """:meth:`record_leased_reads` of a lease whose every group holding blocks holds one
        run of consecutive ids at one epoch, given as the answer rows of its one-pass take
        (``answers[g]``, laid out by :mod:`kvfsm.lookup._lease_pass`; group ``g`` is
        ``names[g]``; ``count`` rows hold blocks). An observer with a
        ``read_answer_runs(names, answers, count)`` method is handed them as they are (the
        array never changes: the lease keeps it); any other is told them as runs, as
        ``answer_runs`` decodes them."""
        runs: list[LeasedRun] | None = None
        for observer, read_runs, read_answer_runs in self._read_observers:
            if read_answer_runs is not None:
                read_answer_runs(names, answers, count)
                continue
            if runs is None:
                runs = answer_runs(names, answers)
            if read_runs is not None:
                read_runs(runs)
                continue
            for group, first, length, epoch in runs:
                observer.read(group, np.arange(first, first + length, dtype=np.intp),
                              np.full(length, epoch, dtype=np.uint32))

    def _dependents_of(self, group: str) -> Callable[[IdArray], None]:
        def invalidate(ids: IdArray) -> None:
            self._invalidate_dependents(group, ids)

        return invalidate

    def _invalidate_dependents(self, group: str, ids: IdArray) -> None:
        """Invalidate every index block that points at one of ``ids`` (an effect). The reverse
        map finds them, so this costs the references to ``ids``, not the pool."""
        if not ids.size:
            return
        for state in self.groups.values():
            if state.target is None or state.target.name != group or state.dependents is None:
                continue
            rows = state.dependents.rows_pointing_at(ids)
            if rows.size:
                candidates = rows[state.event_row(Event.INVALIDATE)[state.states[rows]]]
                if candidates.size:
                    state.machine.fire_batch(candidates, Event.INVALIDATE, masked=True)

    # -- data ------------------------------------------------------------------------------

    def write(self, group: str, ids: ArrayLike, payload: ArrayLike, *,
              sub_block: int | None = None) -> None:
        """Write content into blocks being written (state with partial content on device).

        With ``sub_block`` (compressed groups), ``payload`` is that sub-block's bytes only.
        """
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.writable, "write")
        pool = state.pools[Tier.DEVICE]
        slots = state.slot[Tier.DEVICE][batch]
        data = np.asarray(payload, dtype=np.uint8)
        payload_bytes = state.decl.payload_bytes
        if sub_block is None:
            pool.write(slots, self._rows(group, data, batch.size, payload_bytes))
            state.record_written(batch)
            self._tell_written(group, batch, state.full_sub_mask)
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
        state.record_written(batch, 1 << sub_block)
        self._tell_written(group, batch, 1 << sub_block)

    def _tell_written(self, group: str, ids: IdArray, sub_mask: int) -> None:
        """Tell the observers with a ``written`` method that sub-blocks ``sub_mask`` of
        ``ids`` were written."""
        if self._write_observers and ids.size:
            written = ids.copy()
            for _, method in self._write_observers:
                method(group, written, sub_mask)

    # -- the data path of stored tiers (bytes move between an event's begin and its done) -------

    def restore_rows(self, group: str, ids: ArrayLike) -> list[NDArray[np.uint8]]:
        """Writable views of the device slots of blocks restoring from a stored tier, for a
        loader to read their stored copies straight into (host-memory device pools only; on a
        GPU load into a host buffer and pass it to :meth:`record_loaded`). Nothing is trusted
        until ``restore_done``'s ``checksum_ok`` re-hashes what arrived."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.loading, "load into")
        return state.pools[Tier.DEVICE].row_views(state.slot[Tier.DEVICE][batch])

    def record_loaded(self, group: str, ids: ArrayLike, checksums: ArrayLike,
                      payload: ArrayLike | None = None, *, verified: bool = False) -> None:
        """A loader brought stored copies of blocks restoring from a stored tier: record the
        checksum each copy's header carried (and write ``payload``, ``[k, payload_bytes]``,
        where the bytes were not loaded in place). ``restore_done``'s ``checksum_ok`` then
        re-hashes what arrived, unless ``verified``: the loader hashed these very bytes in
        these very slots after they landed (in place, host memory), which is the same check."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.loading, "record a load into")
        pool = state.pools[Tier.DEVICE]
        slots = state.slot[Tier.DEVICE][batch]
        sums = np.asarray(checksums, dtype=np.uint64).ravel()
        if sums.size != batch.size:
            raise KvfsmError(f"{group}: {batch.size} blocks but {sums.size} checksums")
        if payload is not None:
            data = np.asarray(payload, dtype=np.uint8)
            pool.write(slots, self._rows(group, data, batch.size, state.decl.payload_bytes))
        pool.set_checksums(slots, sums)
        state.record_load_check(batch, verified=verified and payload is None)

    def spill_rows(self, group: str, ids: ArrayLike
                   ) -> tuple[list[NDArray[np.uint8]], NDArray[np.uint64]]:
        """The bytes (views; do not write) and recorded checksums of blocks spilling from a
        host slot into a stored tier, for the data path to store before ``spill_done``."""
        state = self.group(group)
        batch = self._ids(state, ids)
        from_host = (state.table.storing_to >= 0) & (state.table.residency == int(Tier.HOST))
        self._require(state, batch, from_host, "store from host")
        pool = state.pools[Tier.HOST]
        slots = state.slot[Tier.HOST][batch]
        return pool.row_views(slots), pool.checksum[slots].copy()

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
        self.group(group).add_layout(layout)

    def read(self, group: str, ids: ArrayLike, *, form: Form | None = None) -> NDArray[np.uint8]:
        """The bytes of readable blocks; ``form`` asserts how the caller will interpret them."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.readable, "read")
        if form is not None:
            self._require(state, batch, state.table.form == FORM_CODE[form],
                          f"read as {form.value}")
        return state.pools[Tier.DEVICE].read(state.slot[Tier.DEVICE][batch])

    def set_index_refs(self, group: str, ids: ArrayLike, targets: ArrayLike) -> None:
        """Record the target blocks of index blocks being written, at the targets' epochs."""
        state = self.group(group)
        batch = self._ids(state, ids)
        if state.target is None:
            raise KvfsmError(f"{group}: not a sparse-index group")
        self._require(state, batch, state.table.partial, "set index references of")
        top_k = state.refs_target.shape[1]
        refs = self._rows(group, np.asarray(targets, dtype=np.int32), batch.size, top_k,
                          f"index targets (top_k {top_k})")
        if ((refs < NO_TARGET) | (refs >= state.target.n_blocks)).any():
            raise KvfsmError(f"{group}: target ids outside [0, {state.target.n_blocks})")
        state.record_refs(batch, refs)
        if self._ref_observers and batch.size:
            indexed, targets = batch.copy(), refs.copy()
            epochs = state.refs_epoch[batch]  # a gather: a copy already
            for _, method in self._ref_observers:
                method(group, indexed, targets, epochs)

    # -- readers ---------------------------------------------------------------------------

    def pin(self, group: str, ids: ArrayLike) -> None:
        """A reader holds these (readable) blocks; an index also pins its targets."""
        state = self.group(group)
        batch = self._ids(state, ids)
        self._require(state, batch, state.table.readable, "pin")
        targets = state.index_targets(batch)
        if state.target is not None and targets.size:
            self._require(state.target, targets, state.target.table.readable,
                          "pin (as index targets)")
            state.target.add_pins(targets)  # checks its limit before any pin moves
        try:
            state.add_pins(batch, distinct=True)  # _ids refused repeats
        except StateError:
            if state.target is not None and targets.size:
                state.target.add_pins(targets, -1)
            raise
        if self.pins_observed:
            self._tell_block_pins(state, batch, targets, 1)
        self.touch(group, batch)

    def _tell_block_pins(self, state: GroupState, ids: IdArray, targets: IdArray,
                         delta: int) -> None:
        """Tell the pin observers of :meth:`pin` / :meth:`unpin` of ``ids`` in ``state``'s
        group and of ``targets`` (an index's, repeats kept) in its target group."""
        if state.target is not None and targets.size:
            self.tell_pins(state.target.name, targets.copy(), delta)
        self.tell_pins(state.name, ids.copy(), delta)

    def unpin(self, group: str, ids: ArrayLike) -> None:
        state = self.group(group)
        batch = self._ids(state, ids)
        # Only pins taken block by block are given back here (a lease's chunk pins are its own).
        unheld = state.block_pins[batch] == 0
        if unheld.any():
            raise StateError(f"{group}: unpin of unpinned blocks {batch[unheld][:8].tolist()}")
        targets = state.index_targets(batch)
        if state.target is not None and targets.size:
            touched, held = state.target.repeats(targets)
            short = touched[state.target.block_pins[touched] < held]
            if short.size:
                # Someone unpinned a target this index still holds: refuse, never wrap.
                raise StateError(f"{group}: unpinning index blocks would release pins on "
                                 f"{state.target.name} blocks {short[:8].tolist()} that are "
                                 "no longer held (unbalanced unpin)")
            state.target.add_pins(targets, -1, counted=(touched, held))
        state.add_pins(batch, -1, distinct=True)
        if self.pins_observed:
            self._tell_block_pins(state, batch, targets, -1)


    def touch(self, group: str, ids: ArrayLike) -> None:
        """Mark blocks used now (for the LRU eviction order); repeats allowed. One compiled
        pass checks the ids' range, stamps them and moves them in their recency lists."""
        state = self.group(group)
        raw = np.asarray(ids)
        if raw.size and not np.issubdtype(raw.dtype, np.integer):
            raise KvfsmError(f"{state.name}: block ids must be integers, got dtype {raw.dtype}")
        batch = raw.astype(np.intp, copy=False).ravel()
        # Read-only ids would make numba compile the kernel again, mid-request: copy them.
        state.touch(batch if batch.flags.writeable else batch.copy())

    def eviction_candidates(self, group: str, count: int, *,
                            exclude: ArrayLike = ()) -> IdArray:
        """Up to ``count`` device blocks to give back now, none of ``exclude``: unpinned
        blocks left invalid (their slot is only waiting for readers to finish) before unpinned
        readable ones that may be evicted, each kind least recently used first (a block is
        used when touched and when it enters its kind). Costs the blocks returned plus the
        pinned and excluded ones passed over, never the pool (recency lists)."""
        state = self.group(group)
        skip = self._ids(state, exclude, unique=False)
        reclaim = state.oldest(RECLAIM_LIST, count, skip)
        if count - reclaim.size <= 0:
            return reclaim
        chosen = state.oldest(EVICT_LIST, count - reclaim.size, skip)
        return np.concatenate([reclaim, chosen]).astype(np.intp)

    def reclaimable(self, group: str) -> IdArray:
        """Unpinned blocks holding a device slot whose content is no longer trusted or reached
        (``invalid``): the table lets ``free`` return their slot. Least recently used first;
        costs those blocks and the pinned ones among them (a recency list)."""
        state = self.group(group)
        return state.oldest(RECLAIM_LIST, state.n_blocks)

    def hash_key(self, group: str, block: int) -> int:
        state = self.group(group)
        return join_words(int(state.hash_high[block]), int(state.hash_low[block]))

    # -- what the core knows about blocks ---------------------------------------------------

    def describe(self, group: str, block: int) -> BlockInfo:
        """Everything the core records about one block."""
        state = self.group(group)
        index = int(self._ids(state, [block])[0])
        check = int(state.check[index])
        return BlockInfo(
            group=group, block=index, state=state.machine.state_of(index),
            position=int(state.position[index]), epoch=int(state.epoch[index]),
            pins=int(state.pin_counts(np.array([index], dtype=np.intp))[0]),
            layout=state.layouts[int(state.layout_id[index])],
            verified=None if check == UNCHECKED else check == VERIFIED,
            slots={tier: int(slots[index]) for tier, slots in state.slot.items()
                   if slots[index] >= 0},
            stored=tuple(tier for tier in state.stored if state.holds(tier)[index]))

    def blocks_in(self, group: str, states: str | Iterable[str]) -> IdArray:
        """Ids of the blocks in the named lifecycle states (e.g. ``"invalid"``,
        ``"compressing"``)."""
        state = self.group(group)
        names = [states] if isinstance(states, str) else list(states)
        wanted = np.zeros(state.table.n_states, dtype=np.bool_)
        for name in names:
            try:
                wanted[state.table.state_id(name)] = True
            except KeyError:
                raise KvfsmError(f"{group}: lifecycle {state.table.name!r} has no state "
                                 f"{name!r}; states: {list(state.table.state_ids)}") from None
        return np.flatnonzero(wanted[state.states]).astype(np.intp)

    def failed_blocks(self, group: str) -> IdArray:
        """Blocks a lookup saw fail their checksum at their current epoch."""
        return np.flatnonzero(self.group(group).check == FAILED).astype(np.intp)

    def record_checks(self, group: str, ids: ArrayLike, passed: ArrayLike) -> None:
        """Apply checksum results a lookup computed (``Verdict.checks``): a pass is trusted by
        reduced levels until the block's epoch moves; a failure makes the block unusable at
        every level until then."""
        state = self.group(group)
        batch = self._ids(state, ids, unique=False)
        ok = np.asarray(passed, dtype=np.bool_).ravel()
        if ok.size != batch.size:
            raise KvfsmError(f"{group}: {batch.size} ids but {ok.size} results")
        state.record_checks(batch, ok)
        if self._failed_observers and not ok.all():
            failed = batch[~ok]  # a mask: a copy already
            epochs = state.epoch[failed]
            for _, method in self._failed_observers:
                method(group, failed, epochs)

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


def _event(group: str, event: Event | str | int) -> Event:
    """``event`` as an Event, or a KvfsmError naming the group and the known events."""
    try:
        return Event.from_name(event) if isinstance(event, str) else Event(event)
    except (KeyError, ValueError):
        raise KvfsmError(f"{group}: unknown event {event!r}; events: "
                         f"{[e.spec_name for e in Event]}") from None


class InvariantViolation(KvfsmError):
    """The core broke one of its invariants: a bug in kvfsm or in a spec."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(problems))
