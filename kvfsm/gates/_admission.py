"""Gate 1, admission: how many restores may be in flight, and per request whether to restore,
restore part, wait or recompute.

Two halves. **The cap**: the core's :class:`~kvfsm.state.RestoreBudget` bounds restores in
flight in blocks and payload bytes, and the tables' ``admission_open`` guard refuses any
``restore_begin`` past it, whoever fires it; :meth:`AdmissionGate.update_caps` moves the byte cap
with what it measured: the bytes the tiers deliver in ``window_s`` at their measured bandwidth,
and no more than ``memory_fraction`` of the device pools' free bytes (the slots restores land
in). **The choice**: a verdict never offers a plan the cap would refuse (lookups cut the
restorable length where the plan would not fit), so when the cap binds a request can restore
the part that fits now and recompute the rest, wait for restores in flight to drain and then
restore all, or recompute everything. :meth:`AdmissionGate.decide` prices each (restore bytes ÷
measured bandwidth per tier, recompute tokens ÷ measured prefill rate, the wait as the bytes in
flight ÷ bandwidth) and takes the cheapest.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import attrs

from kvfsm._errors import KvfsmError
from kvfsm.lookup import Verdict
from kvfsm.spec import Event, Tier
from kvfsm.state import StateCore


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or not math.isfinite(value):
        raise KvfsmError(f"AdmissionConfig.{attribute.name} must be a positive number, "
                         f"got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise KvfsmError(f"AdmissionConfig.{attribute.name} must be in (0, 1], got {value!r}")


def _optional_count(instance: object, attribute: attrs.Attribute[int | None],
                    value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise KvfsmError(f"AdmissionConfig.{attribute.name} must be an int >= 0 or None, "
                         f"got {value!r}")


#: Bytes per second per tier assumed until a restore from it is measured.
ASSUMED_BANDWIDTH: Mapping[str, float] = {"host": 5e9, "disk": 1e9, "remote": 2e8}


@attrs.frozen
class AdmissionConfig:
    """What the admission gate starts from and how it follows measurements."""

    #: Hard ceilings on restores in flight, in blocks and in payload bytes (None: only what
    #: bandwidth and memory allow).
    max_ops: int | None = attrs.field(default=None, validator=_optional_count)
    max_bytes: int | None = attrs.field(default=None, validator=_optional_count)
    #: Bytes in flight are capped at what the tiers deliver in this long at their measured
    #: bandwidth: a restore admitted now lands within about this time.
    window_s: float = attrs.field(default=0.25, validator=_positive)
    #: At most this share of the device pools' free bytes may be in flight.
    memory_fraction: float = attrs.field(default=0.5, validator=_fraction)
    #: Assumed until measured: bytes per second per stored tier (host copies: ``host``; a
    #: tier left out keeps its :data:`ASSUMED_BANDWIDTH`) and prefill tokens per second.
    bandwidth_bytes_per_s: Mapping[str, float] = attrs.field(
        factory=lambda: dict(ASSUMED_BANDWIDTH))
    prefill_tokens_per_s: float = attrs.field(default=2e4, validator=_positive)
    #: Weight of a new measurement in the running averages.
    smoothing: float = attrs.field(default=0.3, validator=_fraction)

    @bandwidth_bytes_per_s.validator
    def _check_bandwidths(self, attribute: attrs.Attribute[Mapping[str, float]],
                          value: Mapping[str, float]) -> None:
        for name, rate in value.items():
            if name not in ("host", "disk", "remote"):
                raise KvfsmError(f"AdmissionConfig.bandwidth_bytes_per_s: unknown tier "
                                 f"{name!r}; tiers: host, disk, remote")
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0 \
                    or not math.isfinite(rate):
                raise KvfsmError(f"AdmissionConfig.bandwidth_bytes_per_s[{name!r}] must be a "
                                 f"positive number, got {rate!r}")


class Action(enum.Enum):
    """What a request does with its verdict."""

    #: Run the whole plan now (it fits), recompute from its end.
    RESTORE = "restore"
    #: The cap cut the plan: run the part that fits now, recompute the rest.
    PARTIAL = "partial"
    #: Restores in flight hold the cap: wait about ``wait_s``, look up again, restore all.
    WAIT = "wait"
    #: Restoring costs more than computing: reuse what is usable now, recompute from there.
    RECOMPUTE = "recompute"
    #: Nothing to restore: reuse the usable length as it is and compute the rest (a prompt
    #: fully usable, or one with nothing restorable).
    REUSE = "reuse"


@attrs.frozen
class Decision:
    """The admission gate's choice for one request, with the estimates it compared."""

    action: Action
    #: Tokens the request reuses if it follows the choice (after the wait, for WAIT).
    reuse_tokens: int
    #: The verdict whose plan to run now (RESTORE, PARTIAL); for WAIT and RECOMPUTE nothing is
    #: restored now (for RECOMPUTE, compute from ``verdict.usable_tokens``).
    verdict: Verdict
    #: Estimated seconds until the prompt's KV is complete, per action considered.
    estimates: Mapping[Action, float]
    #: For WAIT: the estimated drain time of the restores in flight.
    wait_s: float = 0.0
    #: Bytes the chosen plan restores now.
    restore_bytes: int = 0

    @property
    def restores_now(self) -> bool:
        return self.action in (Action.RESTORE, Action.PARTIAL)

    def __str__(self) -> str:
        """A few lines for a person: the choice, what it reuses, the estimates compared."""
        verdict = self.verdict
        lines = [f"Decision: {self.action.value}, reusing {self.reuse_tokens} of "
                 f"{verdict.prompt_tokens} prompt tokens (usable now {verdict.usable_tokens}, "
                 f"restorable {verdict.restorable_tokens})"]
        if self.estimates:
            lines.append("  estimated seconds until the prompt's KV is complete: " + ", ".join(
                f"{action.value} {seconds:.4g}" for action, seconds in self.estimates.items()))
        if self.restore_bytes:
            lines.append(f"  restores {self.restore_bytes} bytes now")
        if self.action is Action.WAIT:
            lines.append(f"  wait about {self.wait_s:.4g} s for the restores in flight")
        return "\n".join(lines)


_TIER_NAMES = {Tier.HOST: "host", Tier.DISK: "disk", Tier.REMOTE: "remote"}


@attrs.frozen
class PlanCost:
    """What a plan's restores begin and take: blocks, payload bytes, estimated seconds."""

    ops: int
    nbytes: int
    seconds: float


class AdmissionGate:
    """Measures restore bandwidth and prefill rate, sets ``core``'s restore caps from them and
    chooses, per request, between restoring, restoring part, waiting and recomputing."""

    def __init__(self, core: StateCore, config: AdmissionConfig | None = None, *,
                 apply_caps: bool = True) -> None:
        self.core = core
        self.config = config or AdmissionConfig()
        #: Whether :meth:`update_caps` sets the core's caps (False: measure and choose only).
        self.apply_caps = apply_caps
        assumed = {**ASSUMED_BANDWIDTH, **self.config.bandwidth_bytes_per_s}
        self._bandwidth = {tier: float(assumed[name]) for tier, name in _TIER_NAMES.items()}
        #: The tiers restores can come from here (fixed by the core's config): the byte cap
        #: and the drain estimate follow the slowest of them.
        self._tiers = sorted({tier for group in core.groups.values()
                              for tier in (*group.pools, *group.stored)
                              if tier in self._bandwidth}) or [Tier.HOST]
        #: Payload bytes of the widest group's block: the byte cap never goes below one.
        self._widest = max(group.decl.payload_bytes for group in core.groups.values())
        self._prefill = float(self.config.prefill_tokens_per_s)
        self.measured_restores = 0
        self.measured_prefills = 0
        self.update_caps()

    # -- measurements ------------------------------------------------------------------------

    def record_restore(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A restore from ``tier`` moved ``nbytes`` in ``seconds`` (folded into the tier's
        bandwidth; the caps follow at the next :meth:`update_caps`)."""
        if tier not in self._bandwidth:
            raise KvfsmError(f"admission: restores come from host, disk or remote, not "
                             f"{tier.spec_name}")
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return  # nothing measurable (an empty or instantaneous batch)
        self._bandwidth[tier] = self._blend(self._bandwidth[tier], nbytes / seconds)
        self.measured_restores += 1

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The model computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        self._prefill = self._blend(self._prefill, tokens / seconds)
        self.measured_prefills += 1

    def _blend(self, old: float, new: float) -> float:
        weight = self.config.smoothing
        return (1 - weight) * old + weight * new

    def bandwidth(self, tier: Tier) -> float:
        """Bytes per second restores from ``tier`` achieve (measured, else assumed)."""
        return self._bandwidth[tier]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill

    # -- the cap -----------------------------------------------------------------------------

    def free_device_bytes(self) -> int:
        """Bytes of free device slots over every group (where restores land)."""
        return sum(group.pools[Tier.DEVICE].free * group.decl.payload_bytes
                   for group in self.core.groups.values())

    def update_caps(self) -> tuple[int | None, int]:
        """The core's restore caps from the measurements (set on the core where
        ``apply_caps``): bytes in flight at most what the tiers in use deliver in
        ``window_s`` (the slowest tier attached, so a burst from it still lands in time) and
        ``memory_fraction`` of the free device bytes, never above ``max_bytes`` (nor the
        core config's ``max_restore_bytes``); blocks at most ``max_ops`` (and the config's
        ``max_restore_ops``). Returns ``(max_ops, max_bytes)``."""
        by_rate = int(self._slowest() * self.config.window_s)
        by_memory = int(self.free_device_bytes() * self.config.memory_fraction)
        # Room for at least one block of the widest group: a cap below one block would refuse
        # every restore forever, which is recompute-only, not admission.
        max_bytes = max(min(by_rate, by_memory), self._widest)
        ceiling = _least(self.config.max_bytes, self.core.config.max_restore_bytes)
        if ceiling is not None:
            max_bytes = min(max_bytes, ceiling)
        max_ops = _least(self.config.max_ops, self.core.config.max_restore_ops)
        if self.apply_caps:
            self.core.restore_budget.set_caps(max_ops, max_bytes)
        return max_ops, max_bytes

    def _slowest(self) -> float:
        return min(self._bandwidth[tier] for tier in self._tiers)

    # -- the choice --------------------------------------------------------------------------

    def plan_cost(self, verdict: Verdict) -> PlanCost:
        """What the plan's restores begin (blocks, payload bytes) and take at the tiers'
        bandwidths, in one pass over its steps."""
        ops = nbytes = 0
        seconds = 0.0
        for step in verdict.plan:
            if Event.RESTORE_BEGIN in step.path:
                width = self.core.group(step.group).decl.payload_bytes
                ops += 1
                nbytes += width
                if step.tier in self._bandwidth:
                    seconds += width / self._bandwidth[step.tier]
        return PlanCost(ops, nbytes, seconds)

    def fits_drained(self, cost: PlanCost) -> bool:
        """Whether a plan of ``cost`` fits the caps once no restore is in flight."""
        budget = self.core.restore_budget
        return (budget.max_ops is None or cost.ops <= budget.max_ops) and \
            (budget.max_bytes is None or cost.nbytes <= budget.max_bytes)

    def drain_seconds(self) -> float:
        """Estimated seconds until the restores in flight have landed."""
        in_flight = self.core.restore_budget.bytes
        return in_flight / self._slowest() if in_flight else 0.0

    def decide(self, verdict: Verdict, whole: Verdict | None = None) -> Decision:
        """Choose for one request. ``verdict``: the lookup under the current caps (its plan
        fits now); ``whole``: the same lookup with the caps lifted (None: the cap did not cut
        the plan). Costs are seconds until the prompt's KV is complete."""
        compute = self._prefill
        prompt = verdict.prompt_tokens
        estimates: dict[Action, float] = {
            Action.RECOMPUTE: (prompt - verdict.usable_tokens) / compute}
        now_action = Action.RESTORE
        wait_s = 0.0
        if whole is not None and whole.restorable_tokens > verdict.restorable_tokens:
            now_action = Action.PARTIAL
            whole_cost = self.plan_cost(whole)
            if self.fits_drained(whole_cost):  # waiting helps only if the whole plan then fits
                wait_s = self.drain_seconds()
                estimates[Action.WAIT] = wait_s + whole_cost.seconds + \
                    (prompt - whole.restorable_tokens) / compute
        cost = self.plan_cost(verdict)
        if verdict.restorable_tokens > verdict.usable_tokens:
            estimates[now_action] = cost.seconds + \
                (prompt - verdict.restorable_tokens) / compute
        action = min(estimates, key=lambda a: (estimates[a], _PREFERENCE.index(a)))
        if len(estimates) == 1:  # no restore to weigh against computing
            estimates[Action.REUSE] = estimates.pop(Action.RECOMPUTE)
            action = Action.REUSE
        reuse = {Action.RECOMPUTE: verdict.usable_tokens, Action.REUSE: verdict.usable_tokens,
                 Action.WAIT: whole.restorable_tokens if whole is not None else 0,
                 }.get(action, verdict.restorable_tokens)
        return Decision(action, reuse, verdict, estimates,
                        wait_s=wait_s if action is Action.WAIT else 0.0,
                        restore_bytes=cost.nbytes
                        if action in (Action.RESTORE, Action.PARTIAL) else 0)


def _least(first: int | None, second: int | None) -> int | None:
    """The smaller of two optional ceilings (None: no ceiling)."""
    if first is None or second is None:
        return second if first is None else first
    return min(first, second)


#: Ties go to the action that moves less: recompute nothing extra, restore now, then wait.
_PREFERENCE = (Action.RESTORE, Action.PARTIAL, Action.RECOMPUTE, Action.WAIT)
