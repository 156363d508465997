"""A small serving loop over a transformers model: one request at a time, three cache policies.

``serve(model, engine, requests, mode)`` runs every request (a prompt and a number of tokens to
generate greedily) and answers a :class:`Result` per request. ``mode`` says what is reused across
requests:

* ``"nocache"``: nothing. Every prompt is prefilled from its first token; the reference.
* ``"naive"``: what a hit-only engine reuses. It takes the verdict's ``hit_tokens`` (every
  group's blocks present in the prefix hash map, by the kind's rule: every block for full
  attention, the window's blocks for a sliding window; from ``kvfsm.lookup.lookup``, which
  writes no state, so this engine never learns of a failed checksum) and rebuilds the cache from
  the bytes those blocks hold **whatever their state** (:func:`hit_bytes`): the device slot's
  bytes when the block holds one (resident, spilling, or a restore in flight whose copy may not
  have landed), else the bytes of the first lower tier holding it: a host copy, or a disk file or
  remote value read raw, without looking at its header or checksum (a short value is
  zero-filled). It fires no event and verifies nothing. Only a value that is not there at all is
  noticed (a read error): that request is then recomputed from its first token.
* ``"kvfsm"``: what kvfsm says is usable. ``Engine.lookup`` (at ``level``); when
  ``restorable_tokens > usable_tokens`` the verdict's plan is restored (:func:`restore_plan`:
  ``Engine.restore`` makes device room, lands host copies at once and loads disk and remote
  copies on its workers, each verified before use; ``RestoreTicket.wait`` then waits up to
  ``restore_timeout`` seconds; a copy that is missing, corrupt, foreign or late is rolled back or
  forgotten, a load still running stays pending), and the prompt is looked up again; the cache
  is rebuilt from the pools at the final ``usable_tokens`` (:meth:`CacheAdapter.rebuild`, which
  reads only readable blocks).

In both caching modes only the tokens from the reused length on are forwarded, the prompt's
blocks are committed (:meth:`CacheAdapter.store` with ``computed_from`` the reused length: a
block the adapter has no content for costs only itself; a commit the pools cannot make room for
is skipped, never fatal), and then ``max_new_tokens`` tokens are decoded greedily on the request's
own cache (decode tokens are not committed). Memory pressure comes from the engine's pool
sizes: ``Engine.commit`` gives back least recently used blocks, spilled device -> host, and
with stored tiers attached host -> disk -> remote (``Engine.spill_down``), else evicted.

With ``intact=True`` a caching loop also measures, after the hook and just before the lookup,
what each request could have reused: :func:`intact_tokens`, an oracle that reads every copy of
the prompt's blocks (pool slots, disk files, remote values) and checks their bytes against
their checksums without asking the verdict (:attr:`Result.intact_tokens`; its time counts in
neither the request's wall time nor its bookkeeping).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, get_args

import attrs
import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.lookup import Level, Verdict, lookup
from kvfsm.restore import GroupOutcome
from kvfsm.serve._adapter import CacheAdapter
from kvfsm.serve._stores import observed, read_value, value_name
from kvfsm.spec import Event, Tier
from kvfsm.state import GroupState, Prompt, StateCore, StateError
from kvfsm.tiers import HEADER_BYTES, BlockKey, LoadStatus, verify

if TYPE_CHECKING:
    from transformers import DynamicCache

Mode = Literal["nocache", "naive", "kvfsm"]
MODES: tuple[str, ...] = get_args(Mode)

#: Called before a request is looked up (e.g. to inject faults): ``(engine, request) ->``
#: descriptions of what it did.
Hook = Callable[[Engine, "Request"], Sequence[str]]

#: Seconds ``kvfsm`` mode waits for a plan's disk and remote loads before it recomputes what
#: has not landed (a local load of a request's blocks takes milliseconds).
RESTORE_TIMEOUT_S: Final = 0.5
#: The tiers whose copies load on workers.
STORED_TIERS: Final = (Tier.DISK, Tier.REMOTE)


def _token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens)


@attrs.frozen
class Request:
    """One prompt to serve: its id, its token ids, and how many tokens to generate."""

    rid: str
    tokens: tuple[int, ...] = attrs.field(converter=_token_tuple)
    max_new_tokens: int = 4


@attrs.frozen
class RestoreOutcome:
    """What restoring a verdict's plan did, counted by step."""

    #: Steps whose whole path fired: the copy landed and verified (or none was needed, e.g. a
    #: compression finished).
    restored: int = 0
    #: Rolled back with the copy kept (the tier did not answer, a late read, a step refused for
    #: lack of room): the block stays a hit; this request recomputes from it.
    failed: int = 0
    #: The copy was gone or bad for good (missing, corrupt, foreign; a host copy failing its
    #: checksum): the block is forgotten and recomputed.
    lost: int = 0
    #: Loads still running when the wait ended: not readable for this request (a later lookup
    #: settles them).
    pending: int = 0
    #: The executor's line for each step refused on the way.
    notes: tuple[str, ...] = ()


class StepOutcome(NamedTuple):
    """What became of one step of a restore plan."""

    group: str
    #: The group's kind (``full``, ``sliding_window``, ...).
    kind: str
    #: Tier the block's copy was in (``host``, ``disk``, ``remote``; ``device`` for a block
    #: already there that only needs finishing, e.g. a compression; ``-`` for none).
    tier: str
    #: ``restored``, ``failed``, ``lost`` or ``pending`` (see :class:`RestoreOutcome`).
    outcome: str
    #: The load status (``OK``, ``MISSING``, ``CORRUPT``, ``FOREIGN``, ``FAILED``, ``LATE``),
    #: ``CORRUPT`` for a host or in-flight copy failing its checksum at ``restore_done``,
    #: ``"<event> refused"`` for another refused step, empty while pending.
    status: str


@attrs.frozen(eq=False)
class Result:
    """What serving one request did and produced."""

    rid: str
    mode: str
    prompt_tokens: int
    #: The first lookup's numbers (0 in ``nocache`` mode, which looks nothing up).
    hit_tokens: int
    usable_tokens: int
    restorable_tokens: int
    #: Tokens taken from the cache instead of computed.
    reused_tokens: int
    #: The greedy tokens generated.
    tokens: tuple[int, ...]
    #: Logits at the last prompt position (the first decode step), float32 [vocab].
    logits: NDArray[np.float32]
    #: Wall time of the whole request, seconds.
    wall_s: float
    restore: RestoreOutcome = RestoreOutcome()
    #: What the hook did before this request.
    events: tuple[str, ...] = ()
    #: Groups not committed for this prompt, and why.
    store_skipped: tuple[str, ...] = ()
    #: The first verdict's shortfall reasons (``Reason`` values, one per shortfall, in the
    #: verdict's order; empty in ``nocache`` mode).
    reasons: tuple[str, ...] = ()
    #: One :class:`StepOutcome` per step of the restored plan, in plan order.
    steps: tuple[StepOutcome, ...] = ()
    #: Of :attr:`reasons`, those of shortfalls on blocks inside the hit (a group's block whose
    #: first token is below ``hit_tokens``): why hit tokens were not usable right away.
    hit_reasons: tuple[str, ...] = ()
    #: :attr:`hit_reasons` with the group of each shortfall: ``(group, reason)``.
    hit_shortfalls: tuple[tuple[str, str], ...] = ()
    #: Seconds spent in kvfsm's bookkeeping for this request: lookups, restores (waiting for
    #: their loads included) and the commit, without model forwards and without the adapter's
    #: tensor copies (slicing the cache into block payloads) or cache rebuilds.
    bookkeeping_s: float = 0.0
    #: ``naive`` mode: a hit block's stored value was not there to read (a read error), so the
    #: whole prompt was recomputed.
    read_error: str = ""
    #: The largest prefix whose blocks all had an intact copy somewhere just before the lookup
    #: (:func:`intact_tokens`, which does not ask the verdict); None where not measured (a
    #: loop made without ``intact=True``, or ``nocache`` mode).
    intact_tokens: int | None = None


def restore_plan(engine: Engine, verdict: Verdict, prompt: Prompt | None = None, *,
                 timeout: float | None = None) -> tuple[RestoreOutcome, tuple[StepOutcome, ...]]:
    """Restore ``verdict.plan`` through ``engine.restore`` and wait up to ``timeout`` seconds
    for its loads (``None``: until they end). Host copies land at once; disk and remote copies
    load on the engine's workers and are verified (header and checksum) before a byte is used;
    a copy that fails is rolled back or forgotten, so the next lookup recomputes from it. Loads
    still running when the wait ends stay pending (their blocks are not readable). Returns the
    counts and one :class:`StepOutcome` per step, its load status read from the engine's
    :class:`~kvfsm.serve._stores.ObservedTier` (else inferred from the group's statuses)."""
    kinds = {decl.name: decl.kind.value for decl in engine.model.groups}
    keys: dict[tuple[str, int], BlockKey] = {}
    by_group: dict[str, list[int]] = {}
    for step in verdict.plan:
        if step.tier in STORED_TIERS and step.tier in engine.tiers:
            by_group.setdefault(step.group, []).append(step.block_id)
    for name, ids in by_group.items():
        for block, key in zip(ids, engine.restorer.keys.keys(name, np.array(ids, np.intp)),
                              strict=True):
            keys[(name, block)] = key
    ticket = engine.restore(verdict, prompt)
    outcomes = ticket.wait(timeout=timeout)
    refused: dict[tuple[str, int], str] = {}
    for note in ticket.notes:
        where, _, rest = note.partition(": ")
        group, _, number = where.partition(" block id ")
        if number.isdigit():
            refused.setdefault((group, int(number)), rest.split(" refused", 1)[0])
    steps = []
    counts = {"restored": 0, "failed": 0, "lost": 0, "pending": 0}
    for step in verdict.plan:
        found = outcomes.get(step.group, GroupOutcome(step.group))
        tier = "-" if step.tier is None else step.tier.spec_name
        block = step.block_id
        if block in found.restored:
            outcome, status = "restored", "OK"
        elif block in found.pending:
            outcome, status = "pending", ""
        elif block in found.lost or block in found.failed:
            outcome = "lost" if block in found.lost else "failed"
            status = _load_status(engine, step.tier, keys.get((step.group, block)), found,
                                  outcome)
        elif (step.group, block) in refused:
            event = refused[(step.group, block)]
            # A copy that arrived different from its checksum is invalidated: lost.
            outcome, status = (("lost", "CORRUPT") if event == Event.RESTORE_DONE.spec_name
                               else ("failed", f"{event} refused"))
        else:
            outcome, status = "failed", "not started"
        counts[outcome] += 1
        steps.append(StepOutcome(step.group, kinds.get(step.group, "?"), tier, outcome, status))
    return RestoreOutcome(**counts, notes=ticket.notes), tuple(steps)


def _load_status(engine: Engine, tier: Tier | None, key: BlockKey | None,
                 found: GroupOutcome, outcome: str) -> str:
    """The load status of one failed or lost step: what its tier recorded for its key, else
    the group's statuses that fit the outcome."""
    store = None if tier is None else observed(engine.tiers, tier)
    if store is not None and key is not None:
        status = store.status_of(key)
        if status is not None:
            return status.name
    fits = sorted(name for name in found.statuses if name != "OK"
                  and LoadStatus[name].lost == (outcome == "lost"))
    return "/".join(fits) or "?"


def _reasons(verdict: Verdict
             ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The verdict's reason values, those of shortfalls on blocks inside its hit, and the
    latter with their groups."""
    sizes = {group.name: group.block_size for group in verdict.groups}
    inside = tuple((s.group, s.reason.value) for s in verdict.reasons if s.group in sizes
                   and 0 <= s.block_index * sizes[s.group] < verdict.hit_tokens)
    return (tuple(s.reason.value for s in verdict.reasons),
            tuple(reason for _group, reason in inside), inside)


class MissingValue(KvfsmError):
    """A hit block's stored value is not there to read (``naive`` mode's read error)."""


def hit_bytes(engine: Engine | StateCore) -> Callable[[str, NDArray[np.intp]], NDArray[np.uint8]]:
    """The ``naive`` mode's reader: for each hashed block, the bytes of its device slot if it
    holds one, else of the first lower tier holding it, whatever its state and checksum. A copy
    only on disk or remote (``engine`` an :class:`Engine` with stored tiers) is read raw: the
    payload after the 128-byte header, header and checksum never looked at, a short value
    zero-filled; a value that is not there at all is a :class:`MissingValue`."""
    core = engine.core if isinstance(engine, Engine) else engine
    stored = dict(engine.tiers) if isinstance(engine, Engine) else {}

    def read(name: str, ids: NDArray[np.intp]) -> NDArray[np.uint8]:
        group = core.group(name)
        width = group.decl.payload_bytes
        out = np.zeros((ids.size, width), dtype=np.uint8)
        done = np.zeros(ids.size, dtype=np.bool_)
        for tier in Tier:
            if tier in group.pools:
                slots = group.slot[tier][ids]
                take = (slots >= 0) & ~done
                if take.any():
                    out[take] = group.pools[tier].read(slots[take])
                    done |= take
            elif tier in group.stored and tier in stored and isinstance(engine, Engine):
                take = group.holds(tier)[ids] & ~done
                if not take.any():
                    continue
                rows = np.flatnonzero(take)
                for row, key in zip(rows.tolist(), engine.restorer.keys.keys(name, ids[rows]),
                                    strict=True):
                    value = read_value(stored[tier], key)
                    if value is None:
                        raise MissingValue(f"{name} block id {int(ids[row])}: no value on "
                                           f"{tier.spec_name} ({value_name(stored[tier], key)})")
                    payload = np.frombuffer(value, np.uint8)[HEADER_BYTES:HEADER_BYTES + width]
                    out[row, :payload.size] = payload
                done |= take
        if not done.all():
            raise KvfsmError(f"{name}: hashed blocks {ids[~done].tolist()} hold no slot")
        return out

    return read


def _intact_blocks(engine: Engine, group: GroupState, ids: NDArray[np.intp]
                   ) -> NDArray[np.bool_]:
    """Per block id of ``group`` (-1: not in the hash map, never intact): whether some copy
    of its bytes is intact. A device or host slot whose bytes hash (xxh3-64) to the checksum
    its pool recorded; else a disk file or remote value, read raw as :func:`hit_bytes` reads it,
    whose header verifies against the block's key and whose payload against the header's
    checksum (whether or not the core still counts that copy)."""
    intact = np.zeros(ids.size, dtype=np.bool_)
    for tier, pool in group.pools.items():
        slots = np.where(ids >= 0, group.slot[tier][np.maximum(ids, 0)], -1)
        rows = np.flatnonzero((slots >= 0) & ~intact)
        if not rows.size:
            continue
        data = np.ascontiguousarray(pool.read(slots[rows]))  # a copy, one gather
        recorded = pool.checksum[slots[rows]]
        for i, row in enumerate(rows.tolist()):
            intact[row] = xxhash.xxh3_64_intdigest(memoryview(data[i])) == int(recorded[i])
    width = group.decl.payload_bytes
    for tier in STORED_TIERS:
        store = engine.tiers.get(tier)
        rows = np.flatnonzero((ids >= 0) & ~intact)
        if store is None or tier not in group.stored or not rows.size:
            continue
        for row, key in zip(rows.tolist(), engine.restorer.keys.keys(group.name, ids[rows]),
                            strict=True):
            value = read_value(store, key)
            if value is not None:
                view = memoryview(value)
                status, _sum = verify(key, view[:HEADER_BYTES], view[HEADER_BYTES:], width)
                intact[row] = status == LoadStatus.OK
    return intact


def intact_tokens(engine: Engine, prompt: Prompt) -> int:
    """The largest ``L`` (a multiple of the model's LCM block size, below the prompt's length)
    whose blocks are all intact, found without asking the verdict: for every group, every block
    its kind needs at ``L`` (``rule.needed``) is in the hash map and has some intact copy
    (:func:`_intact_blocks`), and a recurrent group can serve ``L`` (a snapshot there). What a
    request could have reused had every intact copy been restored; 0 when nothing is."""
    core = engine.core
    lengths = np.arange(0, prompt.n_tokens, engine.model.lcm_block_size, dtype=np.int64)
    ok = np.ones(lengths.size, dtype=np.bool_)
    with engine.lock:
        for name, group in core.groups.items():
            decl = group.decl
            high, low = prompt.words(decl.block_size)
            good = _intact_blocks(engine, group, core.lookup_words(name, high, low))
            # Blocks [0, i) all intact, per i: a run [lo, hi) is intact when the counts agree.
            runs = np.concatenate([[0], np.cumsum(good)])
            needed = group.rule.needed(decl, lengths)
            ok &= runs[needed.hi] - runs[needed.lo] == needed.hi - needed.lo
            if needed.servable is not None:
                ok &= needed.servable
    return int(lengths[ok].max())


class ServeLoop:
    """A request queue and a step function: :meth:`step` serves the next request."""

    def __init__(
        self,
        model: Any,
        engine: Engine | None,
        mode: Mode,
        *,
        level: Level | str | None = None,
        hook: Hook | None = None,
        restore_timeout: float | None = RESTORE_TIMEOUT_S,
        intact: bool = False,
    ) -> None:
        if mode not in MODES:
            raise KvfsmError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if engine is None and mode != "nocache":
            raise KvfsmError(f"mode {mode!r} needs an engine")
        self.model = model
        self.engine = engine
        self.mode: Mode = mode
        self.level = level
        self.hook = hook
        #: Seconds to wait for a restore plan's disk and remote loads (None: until they end).
        self.restore_timeout = restore_timeout
        #: Measure each request's :attr:`Result.intact_tokens` (:func:`intact_tokens`) just
        #: before its lookup, after the hook: a measurement, kept out of the request's wall
        #: and bookkeeping times.
        self.intact = bool(intact)
        #: Seconds the current request spent measuring its intact tokens.
        self._oracle_s = 0.0
        self.adapter = None if engine is None else CacheAdapter(engine, model.config)
        #: Seconds the adapter spent slicing payloads out of caches since the last reset
        #: (subtracted from the commit's time in ``Result.bookkeeping_s``).
        self._copy_s = 0.0
        if self.adapter is not None:
            self._time_payload_copies(self.adapter)
        #: Where the model's weights live: inputs and rebuilt caches go there.
        self.device = getattr(model, "device", None)
        self.queue: deque[Request] = deque()

    def _time_payload_copies(self, adapter: CacheAdapter) -> None:
        """Time the adapter's payload slicing (its tensor copies), on this loop's own adapter
        instance only; an adapter without ``_payload`` has its copies counted as bookkeeping."""
        sliced = getattr(adapter, "_payload", None)
        if sliced is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return sliced(*args, **kwargs)
            finally:
                self._copy_s += time.perf_counter() - start

        setattr(adapter, "_payload", timed)  # noqa: B010 - an instance attribute, not the class

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def run(self) -> list[Result]:
        """Serve every queued request, in order."""
        results = []
        while self.queue:
            results.append(self.step())
        return results

    def step(self) -> Result:
        """Serve the next queued request."""
        import torch

        request = self.queue.popleft()
        self._oracle_s = 0.0
        start = time.perf_counter()
        with torch.no_grad():
            result = self._serve(request)
        return attrs.evolve(result, wall_s=time.perf_counter() - start - self._oracle_s)

    def _serve(self, request: Request) -> Result:
        from transformers import DynamicCache

        events: tuple[str, ...] = ()
        if self.hook is not None and self.engine is not None:
            events = tuple(self.hook(self.engine, request))
        tokens = request.tokens
        numbers = (0, 0, 0)
        restore = RestoreOutcome()
        prompt: Prompt | None = None
        reasons: tuple[str, ...] = ()
        hit_reasons: tuple[str, ...] = ()
        shortfalls: tuple[tuple[str, str], ...] = ()
        steps: tuple[StepOutcome, ...] = ()
        read_error = ""
        bookkeeping = 0.0
        intact: int | None = None
        if self.mode == "nocache" or self.engine is None or self.adapter is None:
            cache: DynamicCache = DynamicCache(config=self.model.config)
            reused = 0
        else:
            engine, adapter = self.engine, self.adapter
            clock = time.perf_counter()
            prompt = engine.prompt(tokens)
            if self.intact:  # a measurement, not bookkeeping: the clock stops meanwhile
                bookkeeping += time.perf_counter() - clock
                oracle = time.perf_counter()
                intact = intact_tokens(engine, prompt)
                self._oracle_s = time.perf_counter() - oracle
                clock = time.perf_counter()
            if self.mode == "naive":
                verdict = lookup(engine.core, prompt, level=Level.FAST, checksums=False)
                bookkeeping += time.perf_counter() - clock
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                reasons, hit_reasons, shortfalls = _reasons(verdict)
                reused = verdict.hit_tokens
                try:
                    cache = adapter.rebuild_unchecked(prompt, reused, hit_bytes(engine),
                                                      device=self.device)
                except MissingValue as why:  # a read error: recompute the whole prompt
                    read_error = str(why)
                    reused = 0
                    cache = adapter.new_cache()
            else:
                verdict = engine.lookup(prompt, level=self.level)
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                reasons, hit_reasons, shortfalls = _reasons(verdict)
                if verdict.restorable_tokens > verdict.usable_tokens and verdict.plan:
                    restore, steps = restore_plan(engine, verdict, prompt,
                                                  timeout=self.restore_timeout)
                    verdict = engine.lookup(prompt, level=self.level)
                bookkeeping += time.perf_counter() - clock
                reused = verdict.usable_tokens
                cache = adapter.rebuild(prompt, reused, verdict=verdict, device=self.device)
        logits = self._forward(cache, tokens[reused:], reused)
        skipped: tuple[str, ...] = ()
        if self.adapter is not None and prompt is not None:
            self._copy_s = 0.0
            clock = time.perf_counter()
            try:
                stored = self.adapter.store(prompt, cache, computed_from=reused)
                skipped = tuple(f"{name}: {why}" for name, why in stored.skipped.items())
            except StateError as why:
                skipped = (f"all groups: {why}",)
            bookkeeping += max(time.perf_counter() - clock - self._copy_s, 0.0)
        first = logits.clone()
        generated = self._decode(cache, logits, len(tokens), request.max_new_tokens)
        return Result(request.rid, self.mode, len(tokens), *numbers, reused, generated,
                      first.cpu().numpy().astype(np.float32), 0.0, restore, events, skipped,
                      reasons=reasons, steps=steps, hit_reasons=hit_reasons,
                      hit_shortfalls=shortfalls, bookkeeping_s=bookkeeping,
                      read_error=read_error, intact_tokens=intact)

    def _forward(self, cache: DynamicCache, tokens: Sequence[int], start: int) -> Any:
        """Forward ``tokens`` at positions ``start``.. on ``cache``; the last position's logits.
        With an adapter, through :meth:`CacheAdapter.prefill`: a cache it handed out and has
        not stored yet is forwarded in chunks ending where its state must be captured
        (recurrent checkpoints, block ends of sliding layers that do not record)."""
        import torch

        if self.adapter is not None:
            return self.adapter.prefill(self.model, cache, tokens, start, device=self.device)[-1]
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), dtype=torch.long,
                                 device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
        return out.logits[0, -1].float()

    def _decode(self, cache: DynamicCache, logits: Any, position: int,
                count: int) -> tuple[int, ...]:
        out: list[int] = []
        for step in range(count):
            token = int(logits.argmax())
            out.append(token)
            if step + 1 < count:
                logits = self._forward(cache, [token], position + step)
        return tuple(out)


def serve(
    model: Any,
    engine: Engine | None,
    requests: Iterable[Request],
    mode: Mode,
    *,
    level: Level | str | None = None,
    hook: Hook | None = None,
    restore_timeout: float | None = RESTORE_TIMEOUT_S,
    intact: bool = False,
) -> list[Result]:
    """Serve ``requests`` in order on ``model`` with ``engine``'s cache, reusing what ``mode``
    allows (see the module docstring); one :class:`Result` per request, with its
    :attr:`Result.intact_tokens` measured where ``intact``."""
    loop = ServeLoop(model, engine, mode, level=level, hook=hook,
                     restore_timeout=restore_timeout, intact=intact)
    for request in requests:
        loop.submit(request)
    return loop.run()
