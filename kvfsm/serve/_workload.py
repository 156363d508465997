"""Seeded serving workloads and fault schedules for the demo (and anyone measuring ``serve``).

Two request streams, both generated from a seed, every prompt of odd length (so never a
multiple of any block size, which are powers of two):

* :func:`chat`: multi-turn chat. Every user's conversation starts with one shared system
  prompt; each turn's prompt is the user's whole history so far (earlier messages and the
  assistant's replies) plus a new message. Turns are served round robin over the users, so a
  user's history waits while the others' evict or spill it.
* :func:`document_qa`: many questions over a few long documents; each prompt is a document
  followed by one question, the questions of all documents interleaved.

:func:`demo_workload` serves the chat's turns but the last, then the documents, then every
user's last turn: by then the documents have pushed the chat histories down the tiers (host,
disk, remote), so the last turns restore from each.

:func:`fault_schedule` then chooses, among the requests that reuse a prefix of an earlier one,
which get a fault injected just before they are looked up, cycling through every (group,
injector) pair the model's cache groups admit (:data:`INJECTORS_BY_KIND`; stored-tier injectors
only for the stored tiers the engines have, :data:`NEEDS_TIER`), the injectors that damage bytes
first. :class:`FaultHook` applies a schedule as ``serve``'s ``hook``: each fault lands on a block
the request is about to reuse (inside its prefix hit, at the position the group's kind reads: a
middle block of full or compressed history, the last block of a sliding window or a recurrent
snapshot); a stored-tier fault first moves that block down to its tier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Final

import attrs
import numpy as np

from kvfsm._engine import Engine
from kvfsm.lookup import Level, lookup
from kvfsm.serve import _faults as faults
from kvfsm.serve._loop import Request
from kvfsm.spec import GroupKind, ModelDecl, Tier

#: An injector applied to a request's blocks: ``(engine, tokens, group, index) -> what it did``.
Injector = Callable[[Engine, Sequence[int], str, int], str]


def _flip_whole_block(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
    decl = engine.core.group(group).decl
    values = (decl.payload_bytes - decl.layout.padding) // decl.itemsize
    return faults.flip_device_bytes(engine, tokens, index=index, group=group, values=values)


def _corrupt_host_copy(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
    return faults.corrupt_host_copy(engine, tokens, index=index, group=group)


def _restore_in_flight(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
    return faults.restore_in_flight(engine, tokens, index=index, group=group)


def _spill(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
    return faults.spill_block(engine, tokens, index=index, group=group)


def _evict_window(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
    return faults.evict_window_block(engine, tokens, index=index, group=group)


def _kind_injector(name: str) -> Injector | None:
    """An injector of :mod:`kvfsm.serve._faults` taking ``(engine, prompt, *, index, group)``,
    if that module has it (the per-kind ones arrive with the kinds they damage)."""
    inject = getattr(faults, name, None)
    if inject is None:
        return None

    def apply(engine: Engine, tokens: Sequence[int], group: str, index: int) -> str:
        line: str = inject(engine, tokens, index=index, group=group)
        return line

    return apply


def _stored_injector(name: str) -> Injector:
    """A stored-tier injector of :mod:`kvfsm.serve._faults` (all of them exist)."""
    inject = _kind_injector(name)
    if inject is None:
        raise AttributeError(f"kvfsm.serve._faults has no {name}")
    return inject


@attrs.frozen
class InjectorSpec:
    """One fault kind: its injector, and whether it damages bytes (a hit-only engine that
    reuses the block reads wrong data) or only moves state (the bytes stay right)."""

    name: str
    apply: Injector
    damages: bool


FLIP_DEVICE: Final = InjectorSpec("flip_device_bytes", _flip_whole_block, True)
CORRUPT_HOST: Final = InjectorSpec("corrupt_host_copy", _corrupt_host_copy, True)
RESTORE_IN_FLIGHT: Final = InjectorSpec("restore_in_flight", _restore_in_flight, True)
SPILL: Final = InjectorSpec("spill_block", _spill, False)
EVICT_WINDOW: Final = InjectorSpec("evict_window_block", _evict_window, False)
# Stored tiers: the block is moved down to disk or remote first, then its copy there damaged
# (a hit-only reader reads it as it is), removed (a read error: it recomputes), or slowed.
FLIP_DISK: Final = InjectorSpec("flip_disk_byte", _stored_injector("flip_disk_byte"), True)
TRUNCATE_DISK: Final = InjectorSpec("truncate_disk_file",
                                    _stored_injector("truncate_disk_file"), True)
DELETE_DISK: Final = InjectorSpec("delete_disk_file", _stored_injector("delete_disk_file"),
                                  False)
EVICT_REMOTE: Final = InjectorSpec("evict_remote_value", _stored_injector("evict_remote_value"),
                                   False)
PLANT_FOREIGN: Final = InjectorSpec("plant_foreign_value",
                                    _stored_injector("plant_foreign_value"), True)
SLOW_REMOTE: Final = InjectorSpec("slow_remote", _stored_injector("slow_remote"), False)

#: The stored tier each stored-tier injector needs (a schedule for engines without that tier
#: leaves it out).
NEEDS_TIER: Final[Mapping[str, Tier]] = MappingProxyType({
    FLIP_DISK.name: Tier.DISK, TRUNCATE_DISK.name: Tier.DISK, DELETE_DISK.name: Tier.DISK,
    EVICT_REMOTE.name: Tier.REMOTE, PLANT_FOREIGN.name: Tier.REMOTE,
    SLOW_REMOTE.name: Tier.REMOTE,
})


def _specs(*specs: InjectorSpec | tuple[str, bool]) -> tuple[InjectorSpec, ...]:
    """``specs`` with each ``(name, damages)`` resolved by :func:`_kind_injector` (left out
    when :mod:`kvfsm.serve._faults` does not have it)."""
    out = []
    for spec in specs:
        if isinstance(spec, InjectorSpec):
            out.append(spec)
            continue
        name, damages = spec
        inject = _kind_injector(name)
        if inject is not None:
            out.append(InjectorSpec(name, inject, damages))
    return tuple(out)


#: The injectors each kind of cache group admits, in the order a schedule uses them: damage
#: first, memory and stored tiers alternating.
INJECTORS_BY_KIND: Final[Mapping[GroupKind, tuple[InjectorSpec, ...]]] = MappingProxyType({
    GroupKind.FULL: (CORRUPT_HOST, FLIP_DISK, FLIP_DEVICE, PLANT_FOREIGN, TRUNCATE_DISK,
                     RESTORE_IN_FLIGHT, EVICT_REMOTE, DELETE_DISK, SLOW_REMOTE, SPILL),
    GroupKind.SLIDING_WINDOW: (FLIP_DEVICE, CORRUPT_HOST, EVICT_WINDOW, SPILL),
    # a snapshot of the wrong checkpoint (silent), or none at the checkpoint
    GroupKind.RECURRENT: _specs(FLIP_DEVICE, FLIP_DISK, ("stale_snapshot", True), CORRUPT_HOST,
                                TRUNCATE_DISK, ("evict_snapshot", False), DELETE_DISK, SPILL),
    # a block caught mid-compression (the plan finishes it), or evicted
    GroupKind.COMPRESSED: _specs(FLIP_DEVICE, FLIP_DISK, CORRUPT_HOST, TRUNCATE_DISK,
                                 ("compression_incomplete", False), DELETE_DISK,
                                 ("evict_compressed_block", False), SPILL),
    GroupKind.SPARSE_INDEX: (FLIP_DEVICE, SPILL),
})

#: Kinds whose prefix needs every block up to it (a fault lands on a middle block); the others
#: read the last blocks (a window, a snapshot at the prefix's end).
_WHOLE_HISTORY: Final = frozenset({GroupKind.FULL, GroupKind.COMPRESSED, GroupKind.SPARSE_INDEX})


@attrs.frozen
class Fault:
    """One fault: applied to ``group`` just before request ``before`` is looked up."""

    before: str
    group: str
    kind: str
    injector: str
    damages: bool


def _odd(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A length in [lo, hi] made odd."""
    n = int(rng.integers(lo, hi + 1))
    return n if n % 2 else n + 1


def _draw(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def chat(seed: int, *, users: int = 4, turns: int = 4, system_tokens: int = 96,
         message_tokens: tuple[int, int] = (12, 40), reply_tokens: tuple[int, int] = (16, 48),
         max_new_tokens: int = 8, vocab: int = 1000) -> list[Request]:
    """Multi-turn chat over a shared system prompt, turns round robin over the users; request
    ids ``u{user}t{turn}``, every prompt of odd length."""
    rng = np.random.default_rng([seed, 1])
    system = _draw(rng, system_tokens, vocab)
    history = [list(system) for _ in range(users)]
    requests = []
    for turn in range(turns):
        for user in range(users):
            message = _draw(rng, int(rng.integers(message_tokens[0], message_tokens[1] + 1)),
                            vocab)
            if (len(history[user]) + len(message)) % 2 == 0:
                message.append(int(rng.integers(0, vocab)))
            prompt = history[user] + message
            requests.append(Request(f"u{user}t{turn}", prompt, max_new_tokens))
            reply = _draw(rng, int(rng.integers(reply_tokens[0], reply_tokens[1] + 1)), vocab)
            history[user] = prompt + reply
    return requests


def document_qa(seed: int, *, documents: int = 3, questions: int = 5,
                document_tokens: tuple[int, int] = (320, 480),
                question_tokens: tuple[int, int] = (8, 32), max_new_tokens: int = 8,
                vocab: int = 1000) -> list[Request]:
    """``questions`` questions over each of ``documents`` long documents, interleaved in a
    seeded order (each document's first question reads it cold); request ids
    ``d{document}q{question}``, every prompt of odd length."""
    rng = np.random.default_rng([seed, 2])
    docs = [_draw(rng, int(rng.integers(document_tokens[0], document_tokens[1] + 1)), vocab)
            for _ in range(documents)]
    order = [(d, q) for q in range(questions) for d in range(documents)]
    head, tail = order[:documents], order[documents:]
    tail = [tail[i] for i in rng.permutation(len(tail))]
    requests = []
    for d, q in head + tail:
        question = _draw(rng, int(rng.integers(question_tokens[0], question_tokens[1] + 1)),
                         vocab)
        if (len(docs[d]) + len(question)) % 2 == 0:
            question.append(int(rng.integers(0, vocab)))
        requests.append(Request(f"d{d}q{q}", docs[d] + question, max_new_tokens))
    return requests


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    x = np.asarray(a[:n])
    y = np.asarray(b[:n])
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if differ.size else n


def reusing(requests: Sequence[Request], min_tokens: int) -> list[str]:
    """Ids of the requests that share at least ``min_tokens`` prompt tokens with an earlier one
    (a cache can serve part of them)."""
    out = []
    for i, request in enumerate(requests):
        if any(shared_prefix(request.tokens, earlier.tokens) >= min_tokens
               for earlier in requests[:i]):
            out.append(request.rid)
    return out


#: The stored tiers a demo engine has unless told otherwise.
ALL_STORED: Final = (Tier.DISK, Tier.REMOTE)


def fault_pairs(model: ModelDecl, tiers: Collection[Tier] = ALL_STORED
                ) -> list[tuple[str, GroupKind, InjectorSpec]]:
    """Every ``(group, kind, injector)`` the model's groups admit (stored-tier injectors only
    for the stored ``tiers`` the engines have), in the order a schedule uses them: first every
    group's first (damaging) injector, then every group's second, and so on. The n-th group of a
    kind starts n injectors into its kind's list, so groups of one kind get different faults."""
    seen: dict[GroupKind, int] = {}
    per_group = []
    for decl in model.groups:
        specs = tuple(spec for spec in INJECTORS_BY_KIND.get(decl.kind, ())
                      if spec.name not in NEEDS_TIER or NEEDS_TIER[spec.name] in tiers)
        turn = seen.get(decl.kind, 0)
        seen[decl.kind] = turn + 1
        if specs:
            turn %= len(specs)
            specs = specs[turn:] + specs[:turn]
        per_group.append((decl.name, decl.kind, specs))
    depth = max((len(specs) for _, _, specs in per_group), default=0)
    return [(name, kind, specs[i]) for i in range(depth) for name, kind, specs in per_group
            if i < len(specs)]


def fault_schedule(model: ModelDecl, requests: Sequence[Request], seed: int, *,
                   fraction: float = 0.5, tiers: Collection[Tier] = ALL_STORED
                   ) -> tuple[Fault, ...]:
    """Faults before a seeded ``fraction`` of the requests that reuse an earlier prompt's
    blocks (at least two of the model's largest blocks), one per chosen request, cycling
    through :func:`fault_pairs` (for engines with the stored ``tiers``) so every group kind the
    model has is hit."""
    pairs = fault_pairs(model, tiers)
    candidates = reusing(requests, 2 * model.lcm_block_size)
    if not pairs or not candidates:
        return ()
    rng = np.random.default_rng([seed, 3])
    count = max(1, min(len(candidates), round(fraction * len(candidates))))
    chosen = set(rng.choice(len(candidates), size=count, replace=False).tolist())
    picked = [rid for i, rid in enumerate(candidates) if i in chosen]
    out = []
    for i, rid in enumerate(picked):
        name, kind, spec = pairs[i % len(pairs)]
        out.append(Fault(rid, name, kind.value, spec.name, spec.damages))
    return tuple(out)


_BY_NAME: Final = {spec.name: spec for specs in INJECTORS_BY_KIND.values() for spec in specs}


def apply_fault(engine: Engine, request: Request, fault: Fault) -> str:
    """Apply ``fault`` to the block of ``fault.group`` that ``request`` is about to reuse: inside
    its prefix hit (a lookup that writes no state), a middle block for kinds that read all of
    the history, the last needed block for the others. One line saying what happened."""
    spec = _BY_NAME[fault.injector]
    hit = lookup(engine.core, engine.prompt(request.tokens), level=Level.FAST,
                 checksums=False).hit_tokens
    if hit == 0:
        return f"{fault.group}: {fault.injector}: nothing of the prompt cached, no fault"
    state = engine.core.group(fault.group)
    needed = state.rule.needed(state.decl, np.array([hit], dtype=np.int64))
    lo, hi = int(needed.lo[0]), int(needed.hi[0])
    if hi <= lo:
        return f"{fault.group}: {fault.injector}: no block needed at {hit} tokens, no fault"
    index = (lo + hi) // 2 if state.decl.kind in _WHOLE_HISTORY else hi - 1
    return f"{fault.injector}: {spec.apply(engine, request.tokens, fault.group, index)}"


class FaultHook:
    """``serve``'s ``hook`` applying a fault schedule; :attr:`applied` keeps what each did."""

    def __init__(self, schedule: Sequence[Fault]) -> None:
        self.by_request: dict[str, list[Fault]] = {}
        for fault in schedule:
            self.by_request.setdefault(fault.before, []).append(fault)

    def __call__(self, engine: Engine, request: Request) -> list[str]:
        return [apply_fault(engine, request, fault)
                for fault in self.by_request.get(request.rid, ())]


@attrs.frozen
class Workload:
    """Requests and the faults to inject before some of them."""

    name: str
    requests: tuple[Request, ...]
    faults: tuple[Fault, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def hook(self) -> FaultHook:
        """A fresh hook applying :attr:`faults` (one per served run)."""
        return FaultHook(self.faults)


@attrs.frozen
class WorkloadSize:
    """How big the demo's workload is."""

    users: int = 4
    turns: int = 4
    documents: int = 3
    questions: int = 4
    document_tokens: tuple[int, int] = (256, 384)
    max_new_tokens: int = 16
    #: Of the requests that reuse an earlier prompt's blocks, the share a fault comes before.
    fault_fraction: float = 0.75


#: The demo's embedded default, and a quick one for tests.
DEFAULT_SIZE: Final = WorkloadSize()
QUICK_SIZE: Final = WorkloadSize(users=2, turns=3, documents=2, questions=3,
                                 document_tokens=(96, 160), max_new_tokens=4)


def demo_workload(model: ModelDecl, seed: int = 0, size: WorkloadSize = DEFAULT_SIZE, *,
                  tiers: Collection[Tier] = ALL_STORED) -> Workload:
    """The demo's workload for ``model``: the chat's turns but the last, then the document
    questions, then the chat's last turn (every user comes back after the documents pushed
    their histories down the tiers), with a fault schedule over the model's groups (for
    engines with the stored ``tiers``)."""
    talk = chat(seed, users=size.users, turns=size.turns, max_new_tokens=size.max_new_tokens)
    last = f"t{size.turns - 1}"
    requests = [r for r in talk if not r.rid.endswith(last)]
    requests += document_qa(seed, documents=size.documents, questions=size.questions,
                            document_tokens=size.document_tokens,
                            max_new_tokens=size.max_new_tokens)
    requests += [r for r in talk if r.rid.endswith(last)]
    return Workload("chat + document QA + chat", tuple(requests),
                    fault_schedule(model, requests, seed, fraction=size.fault_fraction,
                                   tiers=tiers))
