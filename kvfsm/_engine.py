"""The embedding API a serving engine calls: prompts, lookups, and committing computed blocks."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Concatenate, Final, ParamSpec, TypeVar

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm import _args
from kvfsm._engine_commit import Committer, PayloadFn, zero_payload
from kvfsm._engine_tiers import EngineTiers, check_tiers
from kvfsm._errors import EngineClosed, KvfsmError, LeaseLost
from kvfsm._jit import warm_up
from kvfsm.fsm import INVALID
from kvfsm.gates import (
    Action,
    AdmissionConfig,
    AdmissionGate,
    Decision,
    GraphRegistry,
    GraphSignature,
)
from kvfsm.lookup import (
    DEFAULT_LEASE_TTL_S,
    NO_EXPIRY,
    DeviceProfile,
    KernelLayouts,
    Lease,
    LeaseBook,
    Level,
    Reason,
    Shortfall,
    Verdict,
    as_level,
    check_ttl,
    lookup,
)
from kvfsm.lookup._lookup import check_kernel_layouts, lookup_checked
from kvfsm.lookup._lookup_layout import layout_of
from kvfsm.obs import EngineMetrics, EventLog
from kvfsm.restore import RestoreExecutor, RestoreTicket, StoreTimeouts
from kvfsm.spec import Event, Lifecycle, ModelDecl, Tier, shipped_models
from kvfsm.state import CoreConfig, Prompt, StateCore
from kvfsm.tiers import StoredTier

_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


def _locked(method: Callable[Concatenate[Engine, _Args], _Result]
            ) -> Callable[Concatenate[Engine, _Args], _Result]:
    """Run an Engine method holding the engine's lock (one caller in the core at a time),
    after releasing the pins of leases whose ttl ran out."""

    @functools.wraps(method)
    def locked(self: Engine, /, *args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        with self._lock:
            self._open()
            self._leases.reap()
            return method(self, *args, **kwargs)

    return locked


#: Most plans one restore call runs (its first and the rounds after failed steps): each
#: round's plan is new, and a prompt's blocks fail in few distinct ways.
MAX_RESTORE_ROUNDS: Final = 8


def _steps(verdict: Verdict) -> frozenset[tuple[str, int, tuple[Event, ...]]]:
    """What a verdict's plan does, to tell one plan from another."""
    return frozenset((step.group, step.block_id, step.path) for step in verdict.plan)


def _restores_per_group(verdict: Verdict) -> dict[str, int]:
    """Device slots ``verdict``'s plan takes, per group."""
    out: dict[str, int] = {}
    for step in verdict.plan:
        if Event.RESTORE_BEGIN in step.path:
            out[step.group] = out.get(step.group, 0) + 1
    return out


def _priority(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _args.integer(f"VerifyPolicy.{attribute.name}", value)


@attrs.frozen
class VerifyPolicy:
    """Which verification level a request priority gets (higher number = more important)."""

    full_at_or_above: int = attrs.field(default=10, validator=_priority)
    fast_below: int = attrs.field(default=0, validator=_priority)

    def level_for(self, priority: int) -> Level:
        if priority >= self.full_at_or_above:
            return Level.FULL
        return Level.FAST if priority < self.fast_below else Level.STANDARD


class Engine:
    """A model's cache state core plus the lookup that turns a prompt into a :class:`Verdict`."""

    def __init__(
        self,
        model: ModelDecl | str,
        config: CoreConfig | None = None,
        *,
        lifecycles: Mapping[str, Lifecycle] | None = None,
        profile: DeviceProfile | None = None,
        policy: VerifyPolicy | None = None,
        tiers: Mapping[Tier | str, StoredTier] | None = None,
        workers: int = 2,
        metrics: EngineMetrics | None = None,
        event_log: EventLog | None = None,
        admission: AdmissionConfig | None = None,
        lease_clock: Callable[[], float] = time.monotonic,
        store_timeouts: StoreTimeouts | None = None,
    ) -> None:
        if not callable(lease_clock):
            raise KvfsmError(f"lease_clock must be a callable returning monotonic seconds, "
                             f"got {lease_clock!r}")
        # Every option checked before anything is made (the restore workers are threads).
        options: tuple[tuple[str, object, type], ...] = (
            ("profile", profile, DeviceProfile), ("policy", policy, VerifyPolicy),
            ("metrics", metrics, EngineMetrics), ("event_log", event_log, EventLog),
            ("admission", admission, AdmissionConfig),
            ("store_timeouts", store_timeouts, StoreTimeouts))
        for name, value, kind in options:
            if value is not None and not isinstance(value, kind):
                raise KvfsmError(f"Engine({name}=...) must be {kind.__name__} or None, got "
                                 f"{type(value).__name__}")
        if tiers is not None and not isinstance(tiers, Mapping):
            raise KvfsmError(f"Engine(tiers=...) must map tier names to stored tiers, got "
                             f"{type(tiers).__name__}")
        _args.positive("Engine(workers=...)", workers)
        if isinstance(model, str):
            models = shipped_models()
            if model not in models:
                raise KvfsmError(f"no shipped model {model!r}; shipped: {sorted(models)} "
                                 "(pass a ModelDecl from load_model for others)")
            model = models[model]
        self.core = StateCore(model, config, lifecycles=lifecycles)
        # One caller in the core at a time (every public method holds it; reentrant, so a
        # method may call another); leases validate and release under it too.
        self._lock = threading.RLock()
        # Leases expire on ``lease_clock`` (monotonic seconds; a test may move its own).
        self._leases = LeaseBook(self.core, self._lock, self._lease_lookup, clock=lease_clock)
        self.tiers = check_tiers(self.core, tiers or {})
        #: Runs restore plans and spills into the stored tiers (host restores need no tier).
        self.restorer = RestoreExecutor(self.core, self.tiers, workers=workers,
                                        make_room=self._make_room, lock=self._lock,
                                        timeouts=store_timeouts)
        self._stored = EngineTiers(self.core, self.tiers, self.restorer, self._lock)
        self._committer = Committer(self.core, self._stored)
        # Compile the lookup's kernels now (or load them from the disk cache), not during the
        # first request.
        warm_up()
        self.model = model
        self.profile = profile or DeviceProfile()
        self.policy = policy or VerifyPolicy()
        self._block_sizes = tuple(g.block_size for g in model.groups)
        # A prompt this engine checked keeps this token (Prompt.checked_for): finding it
        # there, a lookup skips the check (seed, hash function and block sizes never change).
        self._prompt_token = object()
        # The core's lookup layout (made once per core): each lookup passes it on.
        self._layout = layout_of(self.core)
        # Gate 4: the captured graphs' signatures, and the one lookups are checked against.
        self._graphs = GraphRegistry(self.core)
        # Whether a graph is active (set with it, in activate_graph): a lookup reads a flag.
        self._graph_active = False
        #: Set by close(): every later call is an EngineClosed.
        self._closed = False
        #: Reported every lookup and told every transition (None: no metrics).
        self.metrics = metrics
        #: Told every transition and reported read, for replay (None: no log; the caller
        #: closes it).
        self.event_log = event_log
        if event_log is not None:
            event_log.attach(self.core)
        if metrics is not None:
            self.core.add_observer(metrics)
            for tier, health in self.restorer.health.items():
                metrics.observe_tier(tier, True)
                health.listeners.append(metrics.observe_tier)
        #: Gate 1: measures restore bandwidth (every restore batch) and the prefill rate
        #: (:meth:`record_prefill`) and chooses per request (:meth:`plan`); it caps restores
        #: in flight from those measurements only where ``admission`` is given.
        self.admission = AdmissionGate(self.core, admission, apply_caps=admission is not None)
        self.restorer.listeners.append(self._restored)
        self._leases.on_refusal = self._lease_refused

    def prompt(self, token_ids: Sequence[int] | ArrayLike = (), *,
               namespace: str | bytes | None = None,
               content_keys: Sequence[tuple[int, int, str | bytes]] | None = None) -> Prompt:
        """A prompt whose block hashes (every block size of the model) are kept incrementally.

        Give what besides the token ids decides the request's KV, or a request with the same
        ids but other KV is served this one's: ``namespace`` (a LoRA adapter's name, a
        tenant's cache salt; no block is shared across namespaces) and ``content_keys``
        ``(start, end, key)`` (tokens ``[start, end)`` stand for content named by ``key``,
        such as an image's hash). A bad one is a KvfsmError naming it."""
        if self._closed:
            self._open()
        return Prompt(self.core.seed, self._block_sizes, token_ids,
                      hash_function=self.core.config.hash_function, namespace=namespace,
                      content_keys=content_keys)

    def _own(self, prompt: Prompt | Sequence[int] | ArrayLike) -> Prompt:
        """``prompt`` made here (token ids become a prompt), or a ForeignPromptError."""
        if prompt.__class__ is Prompt and prompt.checked_for is self._prompt_token:
            return prompt  # checked here before
        if not isinstance(prompt, Prompt):
            return self.prompt(prompt)
        prompt.check_made_for(self.core.seed, self._block_sizes, "engine",
                              self.core.config.hash_function, self._prompt_token)
        return prompt

    def lookup(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        level: Level | str | None = None,
        priority: int = 0,
        kernel_layouts: KernelLayouts | None = None,
        drop_last_block: bool = False,
    ) -> Verdict:
        """The verdict for ``prompt``; ``level`` defaults to the policy's level for
        ``priority``. The checksums the lookup computed are recorded in the core, so a block
        seen failing is unusable at every level until its content changes."""
        # The engine's lock taken here, not by @_locked: the hottest call skips a frame and
        # the repacking of its keywords.
        with self._lock:
            if self._closed:
                self._open()
            leases = self._leases
            if leases.next_expiry != NO_EXPIRY:  # reap's own first test, without its call
                leases.reap()
            prompt, chosen, drop_last_block = self._lookup_args(
                prompt, level, priority, kernel_layouts, drop_last_block)
            if not self.tiers:
                return self._lookup(prompt, chosen, kernel_layouts, drop_last_block)
            self.restorer.poll()  # loads that finished since: their blocks are readable now
            self._forget_evicted()
            verdict = self._lookup(prompt, chosen, kernel_layouts, drop_last_block, False)
            # The last token is always computed: the longest candidate is below it.
            if verdict.usable_tokens >= (prompt.n_tokens - 1) // self._layout.step \
                    * self._layout.step:
                # Usable to the prompt's end: no stored copy could add to it.
                return self._settled(verdict, prompt, chosen, kernel_layouts, drop_last_block)
        # Copies other engines (or this one before a restart) stored: asked of the tiers
        # without the lock, so a slow store costs this lookup only (up to its deadline).
        self._discovered(prompt)
        with self._lock:
            self.restorer.poll()
            verdict = self._lookup(prompt, chosen, kernel_layouts, drop_last_block, False)
            return self._settled(verdict, prompt, chosen, kernel_layouts, drop_last_block)

    def _settled(self, verdict: Verdict, prompt: Prompt, chosen: Level,
                 kernel_layouts: KernelLayouts | None, drop_last_block: bool) -> Verdict:
        """Under the lock: a tiered engine's ``verdict`` with failed device copies sent back
        to be reloaded, tiers not answering named, and the lookup counted."""
        if verdict.checks and self._reload_failed(verdict):
            # A device copy failed its checksum while an intact stored copy remains: its
            # device slot went back, and the verdict now plans the reload.
            verdict = self._lookup(prompt, chosen, kernel_layouts, drop_last_block, False)
        if verdict.restorable_tokens > verdict.usable_tokens:
            verdict = self._name_down_tiers(verdict)
        if self.metrics is not None:
            self.metrics.observe_lookup(verdict)
        return verdict

    def _name_down_tiers(self, verdict: Verdict) -> Verdict:
        """``verdict`` with a ``TIER_UNAVAILABLE`` shortfall per group whose plan reads a
        stored tier that is not answering (restore skips those steps; the caller
        recomputes)."""
        down = {tier for tier, health in self.restorer.health.items() if not health.usable()}
        if not down:
            return verdict
        counts: dict[tuple[str, Tier], int] = {}
        for step in verdict.plan:
            if step.tier in down:
                key = (step.group, step.tier)
                counts[key] = counts.get(key, 0) + 1
        if not counts:
            return verdict
        named = tuple(Shortfall(Reason.TIER_UNAVAILABLE, group, detail=(
            f"{count} blocks' only copy is in the {tier.spec_name} tier, which is not "
            f"answering ({self.restorer.health[tier].last_error}); they are recomputed until "
            "it answers again")) for (group, tier), count in counts.items())
        fields = attrs.asdict(verdict, recurse=False)
        fields["reasons"] = verdict.reasons + named
        made: Verdict = type(verdict)(**fields)
        return made

    def _lookup_args(self, prompt: Prompt | Sequence[int] | ArrayLike, level: Level | str | None,
                     priority: int, kernel_layouts: KernelLayouts | None,
                     drop_last_block: bool) -> tuple[Prompt, Level, bool]:
        """A lookup's arguments checked (under the lock): the prompt made here, the level."""
        if priority.__class__ is not int:
            priority = _args.integer("priority", priority)
        if drop_last_block.__class__ is not bool:
            drop_last_block = _args.flag("drop_last_block", drop_last_block)
        if level is None:
            chosen = self.policy.level_for(priority)
        else:
            chosen = level if level.__class__ is Level else as_level(level)
        if prompt.__class__ is not Prompt or prompt.checked_for is not self._prompt_token:
            prompt = self._own(prompt)  # _own's first test, inline: the hottest call
        if kernel_layouts:
            check_kernel_layouts(self.core, kernel_layouts)
        assert isinstance(prompt, Prompt)
        return prompt, chosen, drop_last_block

    def _lookup(self, prompt: Prompt, level: Level, kernel_layouts: KernelLayouts | None,
                drop_last_block: bool, observe: bool = True,
                max_tokens: int | None = None) -> Verdict:
        """The verdict of checked arguments (under the lock), its checksums recorded (and
        reported to the metrics where ``observe``: a caller's lookup, not the engine's own)."""
        # Every argument checked (the prompt by _own): the lookup's own checks and keywords
        # skipped, as on every lookup a scheduler makes.
        verdict = lookup_checked(self.core, self._layout, prompt, level,
                                 kernel_layouts, self.profile, drop_last_block, True,
                                 max_tokens)
        if verdict.checks:
            for checks in verdict.checks:
                self.core.record_checks(checks.group, checks.block_ids, checks.passed)
            # A failure recorded counts as a change, but only of blocks this lookup saw fail
            # (none it called usable): its probe is as fresh as before.
            if verdict.probe is not None:
                verdict.probe.changes = self.core.change_count.total
        # Gate 4: checked against the active graph's signature (a GraphVerdict), if any.
        if self._graph_active:
            verdict = self._graphs.apply(prompt, verdict)
        if observe and self.metrics is not None:
            self.metrics.observe_lookup(verdict)
        return verdict

    def _lease_lookup(self, prompt: Prompt, level: Level, max_tokens: int) -> Verdict:
        """The lookup a lease of a stale verdict makes (:class:`LeaseBook`): ``prompt`` at
        ``level``, no candidate past ``max_tokens``."""
        return self._lookup(prompt, level, None, False, False, max_tokens)

    def _reload_failed(self, verdict: Verdict) -> bool:
        """Give back the device slot of each unpinned block ``verdict`` saw failing its
        checksum whose stored copy the table keeps (its eviction lands it back on that
        copy, ``device_disk`` -> ``disk``): the next lookup plans its reload. True where
        any went."""
        moved = False
        for checks in verdict.checks:
            failed = np.asarray(checks.block_ids)[~np.asarray(checks.passed)]
            if not failed.size:
                continue
            group = self.core.group(checks.group)
            table = group.table
            after = table.next_state[group.states[failed], int(Event.EVICT)]
            back = (after != INVALID) & table.hashed[np.where(after != INVALID, after, 0)]
            chosen = failed[back & group.unpinned(failed)]
            if chosen.size:
                moved |= bool(self.core.fire(checks.group, chosen, Event.EVICT,
                                             masked=True).any())
        return moved

    # -- admission (gate 1) ----------------------------------------------------------------

    @_locked
    def plan(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        level: Level | str | None = None,
        priority: int = 0,
        kernel_layouts: KernelLayouts | None = None,
        drop_last_block: bool = False,
    ) -> Decision:
        """Look ``prompt`` up and choose what to do with it by estimated cost (restore bytes
        over measured tier bandwidth, recompute tokens over the measured prefill rate):
        restore the verdict's plan (it always fits the restore caps), restore the part that
        fits now and recompute the rest, wait for restores in flight to drain, or recompute.
        Run ``decision.verdict``'s plan with :meth:`restore` when ``decision.restores_now``."""
        prompt = self._own(prompt)
        verdict = self.lookup(prompt, level=level, priority=priority,
                              kernel_layouts=kernel_layouts, drop_last_block=drop_last_block)
        whole = None
        budget = self.core.restore_budget
        if budget.capped and verdict.restorable_tokens < verdict.hit_tokens:
            # What the plan would be without the caps (a lookup changes nothing; the lock
            # keeps every restore from beginning meanwhile).
            with budget.lifted():
                whole = lookup(self.core, prompt, level=verdict.level,
                               kernel_layouts=kernel_layouts, profile=self.profile,
                               drop_last_block=drop_last_block, checksums=False)
        decision = self.admission.decide(verdict, whole)
        if decision.action is Action.WAIT and self.metrics is not None:
            self.metrics.observe_admission_wait(decision.wait_s)
        return decision

    @_locked
    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The model computed ``tokens`` prompt tokens in ``seconds`` (what :meth:`plan`
        prices recomputation with; a measurement of no tokens or no time is ignored)."""
        self.admission.record_prefill(_args.count("tokens", tokens),
                                      _args.seconds("seconds", seconds))

    def _restored(self, group: str, tier: Tier, outcomes: Mapping[str, int], nbytes: int,
                  seconds: float) -> None:
        """A batch of restores ended (under the lock): measure, count, move the caps."""
        if outcomes.get("OK"):
            self.admission.record_restore(tier, nbytes, seconds)
        if self.metrics is not None:
            self.metrics.observe_restores(
                group, self.core.group(group).decl.kind, tier,
                {status.lower(): count for status, count in outcomes.items()}, seconds)
        if self.admission.apply_caps:
            self.admission.update_caps()

    def _lease_refused(self, lost: LeaseLost) -> None:
        if self.metrics is not None:
            self.metrics.observe_lease_refusal(lost.group or "*")

    # -- captured graphs (gate 4) ----------------------------------------------------------

    @_locked
    def register_graph(self, signature: GraphSignature) -> None:
        """Know the captured graph ``signature`` describes. A signature naming a group the
        model lacks (or leaving one out), a tier the group has no pool in, a layout it does
        not know, or a name already registered is a ``SignatureError``; nothing is
        registered."""
        self._graphs.register(signature)

    @_locked
    def activate_graph(self, name: str | None) -> None:
        """Check every later lookup against the registered graph ``name`` (None: none, the
        engine runs eagerly). Lookups then return a ``GraphVerdict`` carrying a
        ``GRAPH_MISMATCH`` shortfall for whatever does not fit the graph."""
        self._graphs.activate(name)
        self._graph_active = self._graphs.active is not None

    @property
    def graphs(self) -> Mapping[str, GraphSignature]:
        """The registered graph signatures by name (read-only)."""
        return self._graphs.graphs

    @property
    def active_graph(self) -> GraphSignature | None:
        """The graph lookups are checked against, or None."""
        return self._graphs.active

    def replayable(self, verdict: Verdict) -> bool:
        """``verdict`` was checked against the active graph by a lookup and its usable prefix
        and restore plan fit it: the graph may be replayed. False for a verdict taken with
        no graph active, or another, or carrying a ``GRAPH_MISMATCH``: run it eagerly."""
        return self._graphs.replayable(verdict)

    # -- stored tiers ------------------------------------------------------------------------

    def discover(self, prompt: Prompt | Sequence[int] | ArrayLike) -> int:
        """Adopt copies of ``prompt``'s blocks that the stored tiers hold but this core does
        not know (another engine spilled them, or this one before a restart): per group,
        every block some length of the prompt could use by its kind's rule (a full group's
        up to its first hole; windows and snapshots past a hole too), each from the fastest
        tier that has it. They become hash hits to restore; loading verifies them. The tiers
        are asked without the engine's lock, a remote one for at most
        ``StoreTimeouts.presence_s`` (one backing off is not asked). Returns the blocks
        adopted. :meth:`lookup` calls it when tiers are attached."""
        if self._closed:
            self._open()
        with self._lock:
            prompt = self._own(prompt)
        return self._discovered(prompt)[1]

    def _discovered(self, prompt: Prompt) -> tuple[Prompt, int]:
        with self._lock:
            self.restorer.poll()
            self._forget_evicted()
            asks = self._stored.asks(prompt)
        if not asks:
            return prompt, 0
        answers = self._stored.answer(asks, None)
        with self._lock:
            return prompt, self._stored.adopt(prompt, answers)

    def restore(self, verdict: Verdict, prompt: Prompt | None = None) -> RestoreTicket:
        """Start the restores of ``verdict.plan``: device room is made first (never by giving
        back, spilling or forgetting a block of ``prompt`` that its restorable prefix reads;
        its blocks past that prefix may give way), host copies land at once, disk
        and remote copies load on worker threads. ``ticket.wait(group, timeout)`` settles
        them; a block whose copy fails stays unusable and the next lookup recomputes from it.

        Given ``prompt`` (the one ``verdict`` looked up), one call lands the longest intact
        prefix: where a step fails (a corrupt copy, a damaged file), the prompt is looked up
        again and the fallback length's plan (its own window blocks, its snapshot) runs too,
        at once for host copies and within ``ticket.wait`` for loads, round after round while
        each lands less than the last promised. Copies a stored tier must write to make
        device room are waited for without the engine's lock."""
        if self._closed:
            self._open()
        if not isinstance(verdict, Verdict):
            raise KvfsmError(f"restore needs a Verdict (from Engine.lookup), got "
                             f"{type(verdict).__name__}")
        probe = verdict.probe
        if probe is not None and probe.core() is not self.core:
            raise KvfsmError("this verdict was made by another engine's lookup: its plan names "
                             "that engine's blocks; look the prompt up on this engine")
        if prompt is not None:
            with self._lock:
                prompt = self._own(prompt)
            looked_up = None if probe is None else probe.prompt
            if verdict.prompt_tokens != prompt.n_tokens or (
                    isinstance(looked_up, Prompt) and looked_up is not prompt
                    and not self._same_blocks(looked_up, prompt, verdict.prompt_tokens)):
                raise KvfsmError(f"restore: the verdict is for another prompt (of "
                                 f"{verdict.prompt_tokens} tokens; this one has "
                                 f"{prompt.n_tokens}, or other tokens): pass the prompt it "
                                 "looked up")
        # A failed tier the plan reads, its back-off over, answers a presence question first.
        self.restorer.probe({step.tier for step in verdict.plan if step.tier is not None})
        keep = self._stored.restore_keep(verdict, prompt)
        self._stored.make_room(
            lambda: {name: count - self.core.group(name).pools[Tier.DEVICE].free
                     for name, count in _restores_per_group(verdict).items()},
            self._committer.give_back, lambda name: keep.get(name, ()))
        with self._lock:
            self._leases.reap()
            ticket = self._stored.restore(verdict, prompt)
        if prompt is None:
            return ticket
        tried = {_steps(verdict)}
        level = verdict.level

        def replan() -> RestoreTicket | None:
            # Each round's plan differs from every one tried (a failed copy is forgotten, a
            # half-landed one rolled back to be copied again, a longer length given up), so
            # the rounds end; a tier backing off keeps its steps in the plan and ends them.
            with self._lock:
                self.restorer.poll()
                again = self._lookup(prompt, level, None, False, False)
                steps = _steps(again)
                if again.restorable_tokens <= again.usable_tokens or not again.plan \
                        or steps in tried or len(tried) >= MAX_RESTORE_ROUNDS:
                    return None
                tried.add(steps)
                return self._stored.restore(again, prompt)

        return ticket.with_replan(replan)

    def _forget_evicted(self) -> None:
        """Blocks known only in a stored tier whose copy that tier has since evicted (its own
        size cap) are forgotten, so they stop being hits."""
        self._stored.forget_evicted()

    def spill_down(self, group: str, tier: Tier | str, count: int, keep: ArrayLike = ()
                   ) -> int:
        """Move up to ``count`` (an int >= 0) least recently used unpinned blocks resident in
        ``tier`` (a Tier or its name), never one of ``keep``, one tier down (host -> disk,
        disk -> remote) through the stored tiers, making room there first the same way; where
        no tier below takes them, blocks in a stored tier are forgotten (and a disk copy's
        file removed). The copies are written without the engine's lock and waited for up to
        ``StoreTimeouts.spill_wait_s``. Returns the blocks moved, dropped or on their way.
        ``keep`` must be block ids of ``group`` (else a KvfsmError naming it, before anything
        moves)."""
        if self._closed:
            self._open()
        tier, count = _args.tier("tier", tier), _args.count("count", count)
        with self._lock:
            keep = self._keep(group, keep)
        return self._stored.spill_down(group, tier, count, keep)

    def offload(self, group: str, ids: ArrayLike, keep: ArrayLike = ()) -> NDArray[np.bool_]:
        """Move device blocks ``ids`` of ``group`` a tier down now, as a serving engine giving
        its own copy back wants them kept (a hit to restore later): readable ones are spilled
        to host, room made there by moving host's least recently used blocks on to disk and
        remote where attached, else by evicting them; a restored block that kept its stored
        copy (``device_disk``, ``device_remote``) gives its device slot back and stays a hit on
        that copy. Never touches a block of ``keep`` or pinned blocks; costs the blocks moved,
        never the pool (recency lists). Returns per id whether it moved (the rest are where
        they were: not on the device, pinned, in flight, or no tier below took them). ``ids``
        and ``keep`` must be block ids of ``group`` (else a KvfsmError naming what is wrong,
        before anything moves)."""
        if self._closed:
            self._open()
        with self._lock:
            ids = self.core.block_ids(group, ids)
            keep = self._keep(group, keep)
        moved = np.zeros(ids.size, dtype=np.bool_)
        tried = np.zeros(ids.size, dtype=np.bool_)
        # What an offload evicts from host to make room is never one of its own ids (those
        # already on host may still move on down to disk).
        protect = np.concatenate([keep, ids]).astype(np.intp)

        def part(name: str, room: int, protect: ArrayLike) -> int:
            # The next ``room`` ids go now (host has that room); host's oldest then move on
            # down, without the lock, before the next part.
            chosen = np.flatnonzero(~tried)[:room]
            tried[chosen] = True
            moved[chosen] = self._stored.offload(group, ids[chosen], protect)
            return int(moved[chosen].sum())

        self._stored.make_room(lambda: {group: int((~tried).sum())}, part, lambda name: keep)
        with self._lock:
            self._leases.reap()
            rest = np.flatnonzero(~tried)
            moved[rest] = self._stored.offload(group, ids[rest], protect)
            return moved

    def close(self) -> None:
        """Finish running I/O, settle every load and spill, and stop the restore workers (the
        tiers stay open); leases still open are released (their next ``validate`` raises
        LeaseLost). Every later call of the engine is an :class:`~kvfsm.EngineClosed` (a
        second close does nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._leases.release_all()
            self.restorer.close()
            if self.event_log is not None:
                self.event_log.flush()  # the settles the close made are on disk too

    def _open(self) -> None:
        """An EngineClosed once :meth:`close` ran (called under the lock)."""
        if self._closed:
            raise EngineClosed("this engine is closed: it answers nothing more and moves no "
                               "block; make a new Engine")
    # -- leases (time of check vs time of use) -----------------------------------------------

    def lease(self, verdict: Verdict, prompt: Prompt | Sequence[int] | ArrayLike, *,
              ttl_s: float = DEFAULT_LEASE_TTL_S) -> Lease:
        """Pin the blocks ``verdict`` (a lookup of ``prompt``) called usable, exactly those
        the kernel reads at ``usable_tokens``, and record their epochs, for ``ttl_s`` seconds
        at most: call ``lease.validate()`` right before the read, and release the lease
        (``with engine.lease(...) as lease:``) after it. A verdict whose lookup is not fresh
        (the core changed since, another prompt, another engine's) is looked up again first,
        capped at its tokens: :class:`~kvfsm.LeaseLost`, pinning nothing, where that finds
        fewer usable (look up again); to make lookup and lease one step against other
        threads, hold :attr:`lock` across both."""
        if self._closed:
            self._open()
        if not isinstance(verdict, Verdict):
            raise KvfsmError(f"lease needs a Verdict (from Engine.lookup), got "
                             f"{type(verdict).__name__}")
        check_ttl(ttl_s)
        # The lock taken here, not by @_locked, as in lookup: a server leases every verdict.
        with self._lock:
            leases = self._leases
            leases.reap()
            return leases.take(verdict, self._own(prompt), ttl_s=ttl_s)

    def lookup_and_lease(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        level: Level | str | None = None,
        priority: int = 0,
        kernel_layouts: KernelLayouts | None = None,
        drop_last_block: bool = False,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> tuple[Verdict, Lease]:
        """:meth:`lookup` and :meth:`lease` of its verdict as one step under the engine's lock:
        no other thread changes a block between the check and the pins, so the lease holds
        exactly what the verdict called usable (it is never refused for a change since the
        lookup), and it is taken straight from what the lookup found. What a server calls
        for each request it is about to run (validate the lease right before the read,
        release it after). A ``ttl_s`` that is not a number of seconds above 0 is a
        KvfsmError before anything is looked up."""
        if self._closed:
            self._open()
        check_ttl(ttl_s)
        with self._lock:
            verdict = self.lookup(prompt, level=level, priority=priority,
                                  kernel_layouts=kernel_layouts, drop_last_block=drop_last_block)
            # The lookup just made, under this lock, of the prompt it made or checked (its
            # probe's; token ids are not made a prompt twice): nothing changed since, so the
            # book's one-pass take serves it.
            probe = verdict.probe
            made = probe.prompt if probe is not None and isinstance(probe.prompt, Prompt) \
                else self._own(prompt)
            return verdict, self._leases.take(verdict, made, ttl_s=ttl_s)

    @property
    def leases_open(self) -> int:
        """Leases taken and neither released nor expired and reaped (a leak shows here)."""
        with self._lock:
            self._leases.reap()
            return self._leases.open

    @property
    def lock(self) -> threading.RLock:
        """The engine's reentrant lock: every public method holds it. Hold it yourself around
        direct calls into :attr:`core` (``fire``, ``pin``, ...) and ``RestoreTicket.wait``
        (which fires) made while other threads use the engine."""
        return self._lock

    # -- commit ----------------------------------------------------------------------------

    def commit(
        self,
        prompt: Prompt | Sequence[int] | ArrayLike,
        *,
        payload: PayloadFn = zero_payload,
        groups: Sequence[str] | None = None,
        computed_from: int = 0,
        unavailable: Mapping[str, ArrayLike] | None = None,
    ) -> Mapping[str, NDArray[np.intp]]:
        """Cache every complete block of ``prompt`` the model keeps, as a prefill leaves them
        (each kind's rule says which blocks and what follows the write: compressed history
        is compressed, index blocks point at the history before them, recurrent snapshots
        exist only at checkpoints). ``payload(group, block indices)`` gives the content,
        uint8 ``[k, payload_bytes]`` (the default caches zero bytes: for tests and dry runs
        only, never for a model).

        Blocks already cached on the device are kept; ones a lookup saw fail are replaced.
        ``computed_from``: the prefill computed the tokens from there on (what it reused
        before it is not touched); a block it computed that is cached only in a lower tier
        (host, disk, remote; e.g. its copy could not be loaded) is written anew where the
        device has room once the missing blocks have theirs (the fresh copy is readable at
        once). ``unavailable``: per group, prompt block indices the caller has no content for
        (e.g. a window block that slid out before it could be captured): left as they are,
        the group's other blocks are committed.

        All or nothing across groups: when a group lacks device room, unpinned blocks of
        other prompts are given back first (invalid ones, then least recently used ones,
        tail first, spilled where a tier has room, else evicted); if that cannot make enough
        room a :class:`StateError` says where, and no block was allocated or given back.
        (Blocks of the prompt already cached are settled first, e.g. compressed, as the
        prefill does to them anyway: it takes no room, and index blocks are then written
        against the settled history.) Room below (host, the stored tiers) is made first,
        its copies written without the engine's lock. Returns the new block ids per group.
        """
        if self._closed:
            self._open()
        computed_from = _args.count("computed_from", computed_from)
        if not callable(payload):  # before any room is made: bad input changes nothing
            raise KvfsmError(f"commit(payload=...) takes a function (group, block indices) -> "
                             f"uint8 [k, payload_bytes], got {type(payload).__name__}")
        with self._lock:
            prompt = self._own(prompt)
            skip = self._unavailable(unavailable)
            needs = self._committer.device_short(prompt, groups)
        if needs:
            # Device room, host room below it, made ahead without the lock.
            self._stored.make_room(lambda: self._committer.device_short(prompt, groups),
                                   self._committer.give_back,
                                   lambda name: self._committer.own_blocks(prompt, name))
        with self._lock:
            self._leases.reap()
            return self._committer.commit(prompt, payload=payload, groups=groups,
                                          computed_from=computed_from, unavailable=skip)

    def _unavailable(self, unavailable: Mapping[str, ArrayLike] | None
                     ) -> dict[str, NDArray[np.int64]]:
        """``commit(unavailable=...)`` checked: group names and block indices >= 0."""
        if unavailable is None:
            return {}
        if not isinstance(unavailable, Mapping):
            raise KvfsmError(f"commit(unavailable=...) must map group names to block indices, "
                             f"got {type(unavailable).__name__}")
        out = {}
        for name, index in unavailable.items():
            self.core.group(name)  # an unknown group is named as such
            try:
                array = np.asarray(index)
            except (TypeError, ValueError) as exc:
                raise KvfsmError(f"commit(unavailable={{{name!r}: ...}}): {exc}") from None
            if array.size and (array.dtype.kind not in "iu" or array.ndim != 1
                               or int(array.min()) < 0):
                raise KvfsmError(f"commit(unavailable={{{name!r}: ...}}) must be a flat list "
                                 f"of block indices >= 0, got {index!r}")
            out[name] = array.astype(np.int64).ravel()
        return out

    @_locked
    def _make_room(self, group: str, count: int, keep: ArrayLike = ()) -> int:
        """The restore executor's room maker (it holds the lock): a count of 0 or below asks
        for nothing."""
        return self._committer.give_back(group, count, keep)

    def give_back(self, group: str, count: int, keep: ArrayLike = ()) -> int:
        """Free up to ``count`` (an int >= 0) device slots of ``group``: unpinned invalid
        blocks first, then the least recently used unpinned ones, spilled a tier down where
        there is room (still a hit, restorable; host room made by moving host's oldest down
        the stored tiers, waited for without the engine's lock), else evicted; never a block
        of ``keep``. Returns the blocks given back (commit uses it for room; a restore
        executor can too). ``keep`` must be block ids of ``group`` (else a KvfsmError naming
        it, before anything moves)."""
        if self._closed:
            self._open()
        count = _args.count("count", count)
        with self._lock:
            kept = self._keep(group, keep)
        given = [0]

        def give(name: str, asked: int, protect: ArrayLike) -> int:
            done = self._committer.give_back(name, asked, protect)
            given[0] += done
            return done

        self._stored.make_room(lambda: {group: count - given[0]}, give, lambda name: kept)
        with self._lock:
            self._leases.reap()
            return given[0] + self._committer.give_back(group, count - given[0], kept)

    def _same_blocks(self, first: Prompt, second: Prompt, tokens: int) -> bool:
        """The two prompts' blocks within ``tokens`` have the same hashes at every block
        size of the model (so the same tokens, namespace and content keys)."""
        for size in self._block_sizes:
            count = tokens // size
            high, low = first.words(size)
            other_high, other_low = second.words(size)
            if not (np.array_equal(high[:count], other_high[:count])
                    and np.array_equal(low[:count], other_low[:count])):
                return False
        return True

    def _host_free(self, group: str) -> int:
        host = self.core.group(group).pools.get(Tier.HOST)
        return 0 if host is None else host.free

    def _keep(self, group: str, keep: ArrayLike) -> NDArray[np.intp]:
        """``keep`` as block ids of ``group`` (repeats allowed), or a KvfsmError naming it
        (before anything moves: ids that are not integers or name no block are refused, not
        read as other blocks or ignored)."""
        self.core.group(group)  # an unknown group is named as such, not as a bad keep
        try:
            return self.core.block_ids(group, keep, unique=False)
        except KvfsmError as exc:
            raise KvfsmError(f"keep: {exc}") from None
