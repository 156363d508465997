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
from kvfsm._errors import GuardRejected, IllegalTransition, KvfsmError
from kvfsm.serve._adapter import CacheAdapter
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore, StateError
from kvfsm.verify import Level, Prompt, Verdict, lookup

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
    for step in verdict.plan:
        ids = [step.block_id]
        for event in step.path:
            try:
                core.fire(step.group, ids, event)
            except (GuardRejected, IllegalTransition) as why:
                refused += 1
                notes.append(f"{step.group} block {step.block_index} (id {step.block_id}): "
                             f"{event.spec_name} refused: {why}")
                if event is Event.RESTORE_DONE:
                    core.fire(step.group, ids, Event.RESTORE_FAIL, masked=True)
                    core.fire(step.group, ids, Event.INVALIDATE, masked=True)
                break
        else:
            done += 1
    return PlanOutcome(done, refused, tuple(notes))


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
        #: Where the model's weights live: inputs and rebuilt caches go there.
        self.device = getattr(model, "device", None)
        self.queue: deque[Request] = deque()

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
        if self.mode == "nocache" or self.engine is None or self.adapter is None:
            cache: DynamicCache = DynamicCache(config=self.model.config)
            reused = 0
        else:
            engine, adapter = self.engine, self.adapter
            prompt = engine.prompt(tokens)
            if self.mode == "naive":
                verdict = lookup(engine.core, prompt, level=Level.FAST, checksums=False)
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                reused = verdict.hit_tokens
                cache = adapter.rebuild_unchecked(prompt, reused, hit_bytes(engine.core),
                                                  device=self.device)
            else:
                verdict = engine.lookup(prompt, level=self.level)
                numbers = (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens)
                if verdict.restorable_tokens > verdict.usable_tokens and verdict.plan:
                    plan = execute_plan(engine, verdict, prompt)
                    verdict = engine.lookup(prompt, level=self.level)
                reused = verdict.usable_tokens
                cache = adapter.rebuild(prompt, reused, verdict=verdict, device=self.device)
        logits = self._forward(cache, tokens[reused:], reused)
        skipped: tuple[str, ...] = ()
        if self.adapter is not None and prompt is not None:
            try:
                stored = self.adapter.store(prompt, cache)
                skipped = tuple(f"{name}: {why}" for name, why in stored.skipped.items())
            except StateError as why:
                skipped = (f"all groups: {why}",)
        first = logits.clone()
        generated = self._decode(cache, logits, len(tokens), request.max_new_tokens)
        return Result(request.rid, self.mode, len(tokens), *numbers, reused, generated,
                      first.cpu().numpy().astype(np.float32), 0.0, plan, events, skipped)

    def _forward(self, cache: DynamicCache, tokens: Sequence[int], start: int) -> Any:
        """Forward ``tokens`` at positions ``start``.. on ``cache``; the last position's logits."""
        import torch

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
