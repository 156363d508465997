"""A small serving loop over a transformers model: one request at a time, three cache policies.

``serve(model, engine, requests, mode)`` runs every request (a prompt and a number of tokens to
generate greedily) and answers a :class:`Result` per request. ``mode`` says what is reused across
requests:

* ``"nocache"``: nothing. Every prompt is prefilled from its first token; the reference.
* ``"naive"``: what a hit-only engine reuses. It takes the verdict's ``hit_tokens`` (every
  group's blocks present in the prefix hash map, by the kind's rule: every block for full
  attention, the window's blocks for a sliding window; from ``kvfsm.verify.lookup``, which
  writes no state, so this engine never learns of a failed checksum) and rebuilds the cache from
  the bytes those blocks hold **whatever their state**: the device slot's bytes when the block
  holds one (resident, spilling, or a restore in flight whose copy may not have landed), else
  the bytes of the first lower tier holding it (host, disk, remote: a spilled copy loaded back
  without checking its checksum). It fires no event and verifies nothing.
* ``"kvfsm"``: what kvfsm says is usable. ``Engine.lookup`` (at ``level``); when
  ``restorable_tokens > usable_tokens`` the verdict's plan is executed (:func:`execute_plan`:
  device room for its restores is made first, as ``Engine.commit`` makes it, then every step's
  events are fired in order through ``engine.core.fire``; a restore whose bytes fail their
  checksum on arrival is rolled back with ``restore_fail`` and its copy dropped with
  ``invalidate``, so it is recomputed), and the prompt is looked up again; the cache is rebuilt
  from the pools at the final ``usable_tokens`` (:meth:`CacheAdapter.rebuild`, which reads only
  readable blocks).

In both caching modes only the tokens from the reused length on are forwarded, the prompt's
blocks are committed (:meth:`CacheAdapter.store`; a commit the pools cannot make room for is
skipped, never fatal), and then ``max_new_tokens`` tokens are decoded greedily on the request's
own cache (decode tokens are not committed). Memory pressure comes from the engine's pool
sizes: ``Engine.commit`` gives back least recently used blocks (spilled where a tier has room).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.serve._adapter import CacheAdapter
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore, StateError
from kvfsm.verify import Level, Prompt, RestoreStep, Verdict, lookup

if TYPE_CHECKING:
    from transformers import DynamicCache

Mode = Literal["nocache", "naive", "kvfsm"]
MODES: tuple[str, ...] = get_args(Mode)

#: Called before a request is looked up (e.g. to inject faults): ``(engine, request) ->``
#: descriptions of what it did.
Hook = Callable[[Engine, "Request"], Sequence[str]]


def _token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens)


@attrs.frozen
class Request:
    """One prompt to serve: its id, its token ids, and how many tokens to generate."""

    rid: str
    tokens: tuple[int, ...] = attrs.field(converter=_token_tuple)
    max_new_tokens: int = 4


@attrs.frozen
class PlanOutcome:
    """What executing a verdict's restore plan did."""

    #: Steps whose whole path fired.
    done: int = 0
    #: Steps refused on the way (e.g. a restore whose bytes failed their checksum).
    refused: int = 0
    #: One line per refused step.
    notes: tuple[str, ...] = ()


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
    plan: PlanOutcome = PlanOutcome()
    #: What the hook did before this request.
    events: tuple[str, ...] = ()
    #: Groups not committed for this prompt, and why.
    store_skipped: tuple[str, ...] = ()
    #: The first verdict's shortfall reasons (``Reason`` values, one per shortfall, in the
    #: verdict's order; empty in ``nocache`` mode).
    reasons: tuple[str, ...] = ()
    #: The executed plan's steps as ``(group, group kind, tier restored from, outcome)``;
    #: outcome ``"done"``, or ``"<event> refused"`` for a step refused on the way (e.g.
    #: ``"restore_done refused"``: the bytes that arrived failed their checksum). Tier is
    #: ``"-"`` for a step that restores from no tier.
    steps: tuple[tuple[str, str, str, str], ...] = ()
    #: Of :attr:`reasons`, those of shortfalls on blocks inside the hit (a group's block whose
    #: first token is below ``hit_tokens``): why hit tokens were not usable right away.
    hit_reasons: tuple[str, ...] = ()
    #: Seconds spent in kvfsm's bookkeeping for this request: lookups, plan execution and the
    #: commit, without model forwards and without the adapter's tensor copies (slicing the
    #: cache into block payloads) or cache rebuilds.
    bookkeeping_s: float = 0.0


def execute_plan(engine: Engine, verdict: Verdict, prompt: Prompt | None = None) -> PlanOutcome:
    """Fire every step of ``verdict.plan``, its events in order.

    Restores need device slots: before firing, each group gets the room its restores take the
    way ``Engine.commit`` makes room, giving back least recently used unpinned blocks (spilled
    to host where there is room, else evicted), never one of ``prompt``'s own blocks. A step
    refused on the way stops there; a refused ``restore_done`` (the bytes that arrived do not
    match the recorded checksum) is rolled back (``restore_fail``) and the block's copy dropped
    (``invalidate``), so the block is recomputed and committed afresh rather than retried."""
    core = engine.core
    for name in {step.group for step in verdict.plan}:
        wanted = sum(Event.RESTORE_BEGIN in step.path for step in verdict.plan
                     if step.group == name)
        keep = _own_blocks(engine, name, prompt, verdict)
        engine.give_back(name, wanted - core.group(name).pools[Tier.DEVICE].free, keep)
    done = refused = 0
    notes: list[str] = []
    # Steps of one group with the same path fire together, one batch per event (masked: a
    # refused block drops out of its batch), in plan order: targets' groups before indexes'.
    batches: dict[tuple[str, tuple[Event, ...]], list[RestoreStep]] = {}
    for step in verdict.plan:
        batches.setdefault((step.group, step.path), []).append(step)
    for (group, path), steps in batches.items():
        ids = np.array([step.block_id for step in steps], dtype=np.intp)
        alive = np.ones(ids.size, dtype=np.bool_)
        for event in path:
            moved = core.fire(group, ids[alive], event, masked=True)
            failed = np.flatnonzero(alive)[~moved]
            state = core.group(group)
            for index in failed.tolist():
                step = steps[index]
                row = state.table.row(int(state.states[step.block_id]), event)
                why = "no row for its state" if row is None else \
                    "a guard said no (one of " + ", ".join(str(c) for c in row.guards) + ")"
                notes.append(f"{group} block {step.block_index} (id {step.block_id}): "
                             f"{event.spec_name} refused: {why}")
            if failed.size and event is Event.RESTORE_DONE:
                core.fire(group, ids[failed], Event.RESTORE_FAIL, masked=True)
                core.fire(group, ids[failed], Event.INVALIDATE, masked=True)
            alive[failed] = False
        done += int(alive.sum())
        refused += int((~alive).sum())
    return PlanOutcome(done, refused, tuple(notes))


def _reasons(verdict: Verdict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The verdict's reason values, and those of shortfalls on blocks inside its hit."""
    sizes = {group.name: group.block_size for group in verdict.groups}
    inside = tuple(s.reason.value for s in verdict.reasons if s.group in sizes
                   and 0 <= s.block_index * sizes[s.group] < verdict.hit_tokens)
    return tuple(s.reason.value for s in verdict.reasons), inside


def _step_outcomes(engine: Engine, verdict: Verdict,
                   outcome: PlanOutcome) -> tuple[tuple[str, str, str, str], ...]:
    """``(group, kind, tier, outcome)`` of each step of ``verdict.plan`` after
    :func:`execute_plan` answered ``outcome`` (whose notes name each refused step)."""
    kinds = {decl.name: decl.kind.value for decl in engine.model.groups}
    out = []
    for step in verdict.plan:
        where = f"{step.group} block {step.block_index} (id {step.block_id}): "
        note = next((n for n in outcome.notes if n.startswith(where)), None)
        result = "done" if note is None else note[len(where):].split(":", 1)[0]
        out.append((step.group, kinds.get(step.group, "?"),
                    "-" if step.tier is None else step.tier.spec_name, result))
    return tuple(out)


def _own_blocks(engine: Engine, name: str, prompt: Prompt | None,
                verdict: Verdict) -> NDArray[np.intp]:
    """Block ids of ``name`` that belong to the prompt (its hashed blocks) or to the plan."""
    planned = np.array([s.block_id for s in verdict.plan if s.group == name], dtype=np.intp)
    if prompt is None:
        return planned
    high, low = prompt.words(engine.core.group(name).decl.block_size)
    found = engine.core.lookup_words(name, high, low)
    return np.concatenate([planned, found[found >= 0]])


def hit_bytes(core: StateCore) -> Callable[[str, NDArray[np.intp]], NDArray[np.uint8]]:
    """The ``naive`` mode's reader: for each hashed block, the bytes of its device slot if it
    holds one, else of the first lower tier holding it, whatever its state and checksum."""

    def read(name: str, ids: NDArray[np.intp]) -> NDArray[np.uint8]:
        group = core.group(name)
        out = np.zeros((ids.size, group.decl.payload_bytes), dtype=np.uint8)
        done = np.zeros(ids.size, dtype=np.bool_)
        for tier in Tier:
            if tier not in group.pools:
                continue
            slots = group.slot[tier][ids]
            take = (slots >= 0) & ~done
            if take.any():
                out[take] = group.pools[tier].read(slots[take])
                done |= take
        if not done.all():
            raise KvfsmError(f"{name}: hashed blocks {ids[~done].tolist()} hold no slot")
        return out

    return read


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
        start = time.perf_counter()
        with torch.no_grad():
            result = self._serve(request)
        return attrs.evolve(result, wall_s=time.perf_counter() - start)

    def _serve(self, request: Request) -> Result:
        from transformers import DynamicCache

        events: tuple[str, ...] = ()
        if self.hook is not None and self.engine is not None:
            events = tuple(self.hook(self.engine, request))
        tokens = request.tokens
        numbers = (0, 0, 0)
        plan = PlanOutcome()
        prompt: Prompt | None = None
        reasons: tuple[str, ...] = ()
        hit_reasons: tuple[str, ...] = ()
        steps: tuple[tuple[str, str, str, str], ...] = ()
        bookkeeping = 0.0
        if self.mode == "nocache" or self.engine is None or self.adapter is None:
            cache: DynamicCache = DynamicCache(config=self.model.config)
            reused = 0
        else:
            engine, adapter = self.engine, self.adapter
            clock = time.perf_counter()
            prompt = engine.prompt(tokens)
            if self.mode == "naive":
                verdict = lookup(engine.core, prompt, level=Level.FAST, checksums=False)
                bookkeeping += time.perf_counter() - clock
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                reasons, hit_reasons = _reasons(verdict)
                reused = verdict.hit_tokens
                cache = adapter.rebuild_unchecked(prompt, reused, hit_bytes(engine.core),
                                                  device=self.device)
            else:
                verdict = engine.lookup(prompt, level=self.level)
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                reasons, hit_reasons = _reasons(verdict)
                if verdict.restorable_tokens > verdict.usable_tokens and verdict.plan:
                    plan = execute_plan(engine, verdict, prompt)
                    steps = _step_outcomes(engine, verdict, plan)
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
                stored = self.adapter.store(prompt, cache)
                skipped = tuple(f"{name}: {why}" for name, why in stored.skipped.items())
            except StateError as why:
                skipped = (f"all groups: {why}",)
            bookkeeping += max(time.perf_counter() - clock - self._copy_s, 0.0)
        first = logits.clone()
        generated = self._decode(cache, logits, len(tokens), request.max_new_tokens)
        return Result(request.rid, self.mode, len(tokens), *numbers, reused, generated,
                      first.cpu().numpy().astype(np.float32), 0.0, plan, events, skipped,
                      reasons=reasons, steps=steps, hit_reasons=hit_reasons,
                      bookkeeping_s=bookkeeping)

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
) -> list[Result]:
    """Serve ``requests`` in order on ``model`` with ``engine``'s cache, reusing what ``mode``
    allows (see the module docstring); one :class:`Result` per request."""
    loop = ServeLoop(model, engine, mode, level=level, hook=hook)
    for request in requests:
        loop.submit(request)
    return loop.run()
