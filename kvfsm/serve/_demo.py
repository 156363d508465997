"""The serving part of ``kvfsm demo``: every model ``kvfsm.serve`` serves, three modes, one
faulted workload, compared request by request with recomputing everything.

For each served model (:func:`served_models`, DeepSeek-V4 first), in this order:

1. ``nocache`` on the workload: the reference tokens and first-step logits.
2. ``naive`` and ``kvfsm`` on the faulted workload (:mod:`kvfsm.serve._workload`: the same
   fault schedule applied by a hook to each engine, just before the chosen requests).
3. ``naive`` and ``kvfsm`` on the same workload without faults, to show that kvfsm is not merely
   conservative: with nothing wrong it reuses every token a hit-only engine reuses.

In both caching modes each request's intact tokens are measured just before its lookup
(``ServeLoop(intact=True)``, :func:`kvfsm.serve._loop.intact_tokens`): the report's lost reuse.

Each caching run gets a fresh engine with the same pool sizes (:class:`Pools`: tight enough
that the working set spills device -> host -> disk -> remote and later prompts restore from
every tier) and its own stored tiers (:mod:`kvfsm.serve._stores`): a disk tier in a temporary
directory, removed afterwards, and the run's remote store (``settings.remote``: Mooncake or
Redis on 127.0.0.1, started once per demo and stopped at its end), each engine keying its values
in its own namespace. ``kvfsm`` mode looks up at ``Level.FULL`` (device checksums recomputed),
so silent device damage is seen too, and restores through ``Engine.restore``.
:mod:`kvfsm.serve._report` turns the runs into the report, plots, metrics and JSON.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import attrs

from kvfsm import _args
from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.lookup import Level
from kvfsm.obs import EngineMetrics, EventLog, ReplayResult, replay
from kvfsm.serve._adapter import CacheAdapter, CacheAdapterError
from kvfsm.serve._declare import declare
from kvfsm.serve._loop import Mode, Request, Result, ServeLoop
from kvfsm.serve._stores import (
    REMOTE_CHOICES,
    RemoteStore,
    choose_remote,
    engine_tiers,
    namespace,
    remote_store,
)
from kvfsm.serve._workload import (
    DEFAULT_SIZE,
    QUICK_SIZE,
    Workload,
    WorkloadSize,
    demo_workload,
)
from kvfsm.spec import ModelDecl, Tier, shipped_lifecycles
from kvfsm.state import CoreConfig
from kvfsm.tiers import StoredTier

#: The order the demo serves models in (when ``kvfsm.serve`` serves them).
DEMO_ORDER: Final = ("deepseek_v4", "qwen3_next", "gpt_oss")

#: The one line a missing optional package turns into.
INSTALL_HINT: Final = 'pip install "kvfsm[serve]"'

#: Runs per model, in order: (workload, mode). The reference runs once: faults never reach
#: ``nocache`` mode (it has no engine).
RUNS: Final[tuple[tuple[str, Mode], ...]] = (
    ("reference", "nocache"),
    ("faulted", "naive"),
    ("faulted", "kvfsm"),
    ("clean", "naive"),
    ("clean", "kvfsm"),
)

@attrs.frozen
class Pools:
    """Blocks per cache group in each tier. Disk and remote count the copies the core keeps
    track of there (a group whose lifecycle stops above a tier has none)."""

    device: int
    host: int
    disk: int = 0
    remote: int = 0

    def config(self, tiers: Collection[str] = (), salt: str = "") -> CoreConfig:
        """The engine's config: disk and remote blocks only for the stored ``tiers`` it has."""
        return CoreConfig(device_blocks=self.device, host_blocks=self.host,
                          disk_blocks=self.disk if "disk" in tiers else 0,
                          remote_blocks=self.remote if "remote" in tiers else 0,
                          cache_salt=salt, backend="numpy")

    def figures(self) -> dict[str, int]:
        return {"device_blocks": self.device, "host_blocks": self.host,
                "disk_blocks": self.disk, "remote_blocks": self.remote}


#: Blocks per group: less device room than the workload's working set, and little host and
#: disk room, so commits spill least recently used blocks down every tier (device -> host ->
#: disk -> remote) and later prompts restore them from each.
POOLS: Final = Pools(64, 48, 16, 256)
QUICK_POOLS: Final = Pools(16, 24, 8, 64)


#: Prefix of the kvfsm-mode engines' metrics in the demo's ``metrics.prom`` (the demo's own
#: figures are ``kvfsm_*``).
ENGINE_METRICS_NAMESPACE = "kvfsm_engine"


def require_serve_packages() -> None:
    """A :class:`KvfsmError` naming the install line when a package the demo needs is missing."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            return True

    missing = [name for name in ("torch", "transformers", "matplotlib", "prometheus_client",
                                 "tqdm") if absent(name)]
    if missing:
        raise KvfsmError(f"the serving demo needs {', '.join(missing)}: {INSTALL_HINT}")


def engine_for(model_type: str, pools: Pools,
               tiers: Mapping[Tier | str, StoredTier] | None = None, salt: str = "", *,
               metrics: EngineMetrics | None = None, event_log: EventLog | None = None
               ) -> Engine:
    """An engine for the tiny ``model_type`` with ``pools``; disk and remote blocks only where
    ``tiers`` gives a tier for them; reporting to ``metrics`` and ``event_log`` where given."""
    from kvfsm.serve._tiny import tiny_config

    tiers = tiers or {}
    names = [name if isinstance(name, str) else name.spec_name for name in tiers]
    return Engine(declare(tiny_config(model_type)), pools.config(names, salt), tiers=tiers,
                  metrics=metrics, event_log=event_log)


def stored_tiers_of(model: ModelDecl) -> tuple[Tier, ...]:
    """The stored tiers (disk, remote) some group of ``model`` keeps blocks in, by lifecycle."""
    lifecycles = shipped_lifecycles()
    kept = {tier for decl in model.groups if decl.lifecycle in lifecycles
            for tier in lifecycles[decl.lifecycle].tiers}
    return tuple(tier for tier in (Tier.DISK, Tier.REMOTE) if tier in kept)


def served_models(wanted: Sequence[str] = DEMO_ORDER) -> tuple[list[str], dict[str, str]]:
    """The models of ``wanted`` that ``kvfsm.serve`` serves end to end (its cache adapter takes
    every group of their declaration), in :data:`DEMO_ORDER`; and the others, with why not."""
    from kvfsm.serve._tiny import tiny_config

    served: list[str] = []
    skipped: dict[str, str] = {}
    for model_type in sorted(wanted, key=lambda t: DEMO_ORDER.index(t)
                             if t in DEMO_ORDER else len(DEMO_ORDER)):
        try:
            CacheAdapter(engine_for(model_type, Pools(1, 0)), tiny_config(model_type))
        except (CacheAdapterError, NotImplementedError) as why:
            skipped[model_type] = str(why)
            continue
        served.append(model_type)
    return served, skipped


@attrs.frozen(eq=False)
class ModelRun:
    """Everything one model's part of the demo produced."""

    model_type: str
    #: ``(name, kind)`` of each cache group of the model's declaration.
    groups: tuple[tuple[str, str], ...]
    workload: Workload
    pools: Pools
    #: The stored tiers its engines had (``disk``, ``remote``).
    tiers: tuple[str, ...]
    #: (workload, mode) -> one result per request, in request order.
    runs: Mapping[tuple[str, str], tuple[Result, ...]]
    #: Wall time of this model's whole part (model build, warm-up and every run), seconds.
    wall_s: float


def _model_types(instance: object, attribute: attrs.Attribute[tuple[str, ...]],
                 value: tuple[str, ...]) -> None:
    if not isinstance(value, tuple) or not all(isinstance(each, str) for each in value):
        raise KvfsmError(f"DemoSettings.models must be a tuple of model types (e.g. "
                         f"{DEMO_ORDER}), got {value!r}")


def _seed(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    _args.count("DemoSettings.seed", value)


def _remote(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in REMOTE_CHOICES:
        raise KvfsmError(f"DemoSettings.remote must be one of {list(REMOTE_CHOICES)}, got "
                         f"{value!r}")


@attrs.frozen
class DemoSettings:
    models: tuple[str, ...] = attrs.field(default=DEMO_ORDER, validator=_model_types)
    seed: int = attrs.field(default=0, validator=_seed)
    size: WorkloadSize = DEFAULT_SIZE
    pools: Pools = POOLS
    #: The remote store: ``auto``, ``mooncake``, ``redis`` or ``none`` (``--remote``).
    remote: str = attrs.field(default="auto", validator=_remote)


def quick_settings() -> DemoSettings:
    """A small workload and pools for tests (a few seconds per model)."""
    return DemoSettings(size=QUICK_SIZE, pools=QUICK_POOLS)


@attrs.frozen(eq=False)
class DemoRun:
    """The demo's answer: one :class:`ModelRun` per served model, the models left out and why,
    and the wall time of everything."""

    models: tuple[ModelRun, ...]
    skipped: Mapping[str, str]
    wall_s: float
    #: The remote backend the run used (None: none) and the line saying why.
    remote: str | None = None
    remote_note: str = ""
    #: What the kvfsm-mode engines reported (lookups, restores by kind, tier and outcome,
    #: transitions, ...): exported beside the demo's own figures.
    engine_metrics: EngineMetrics | None = None
    #: Per kvfsm-mode run whose transitions were logged (``model/workload``): the log
    #: replayed through the lifecycle tables afterwards.
    replays: Mapping[str, ReplayResult] = attrs.field(factory=dict)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (torch's own threads contend on a small machine);
    the previous setting is restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: Called once per served request: ``(model type, workload, mode) ->``.
Progress = Callable[[str, str, str], None]


def _serve(model: Any, engine: Engine | None, workload: Workload, mode: Mode, faulted: bool,
           tick: Callable[[], None]) -> tuple[Result, ...]:
    # Each caching request's intact tokens measured (after the hook, before the lookup): what
    # it could have reused, for the report's lost reuse.
    loop = ServeLoop(model, engine, mode, level=Level.FULL if mode == "kvfsm" else None,
                     hook=workload.hook() if faulted else None, intact=engine is not None)
    for request in workload.requests:
        loop.submit(request)
    out = []
    while loop.queue:
        out.append(loop.step())
        tick()
    return tuple(out)


def _warm_up(model: Any, model_type: str, workload: Workload) -> None:
    """Serve two short requests in every mode on a throwaway engine: the first forwards and
    the compiled lookup kernels (numba compiles on first use) are paid here, not in the runs."""
    first = workload.requests[0].tokens
    requests = [Request("warm0", first, 2), Request("warm1", first + first[:3], 2)]
    for mode in ("nocache", "naive", "kvfsm"):
        engine = None if mode == "nocache" else engine_for(model_type, Pools(16, 8))
        try:
            loop = ServeLoop(model, engine, mode, level=Level.FULL if mode == "kvfsm" else None)
            for request in requests:
                loop.submit(request)
            loop.run()
        finally:
            if engine is not None:
                engine.close()


def _run(model: Any, model_type: str, settings: DemoSettings, workload: Workload, name: str,
         mode: Mode, remote: RemoteStore | None, use_remote: bool,
         tick: Callable[[], None], metrics: EngineMetrics | None = None,
         events: Path | None = None) -> tuple[Result, ...]:
    """One run on a fresh engine with its own stored tiers (closed and removed afterwards),
    its state invariants checked at the end; a kvfsm-mode run's transitions logged into
    ``events`` (a JSONL file) where given."""
    if mode == "nocache":
        return _serve(model, None, workload, mode, False, tick)
    observed = mode == "kvfsm"
    with engine_tiers(remote, use_remote=use_remote) as tiers, contextlib.ExitStack() as stack:
        log = stack.enter_context(EventLog(events)) if observed and events is not None \
            else None
        engine = engine_for(model_type, settings.pools, tiers,
                            namespace(model_type, name, mode),
                            metrics=metrics if observed else None, event_log=log)
        try:
            results = _serve(model, engine, workload, mode, name == "faulted", tick)
        finally:
            engine.close()
        problems = engine.core.check_invariants()
        if problems:
            raise KvfsmError(f"{model_type} {name} {mode}: state invariants broken: "
                             f"{problems[:3]}")
    return results


def run_model(model_type: str, settings: DemoSettings, progress: Progress | None = None, *,
              remote: RemoteStore | None = None, metrics: EngineMetrics | None = None,
              events: Path | None = None) -> ModelRun:
    """One model's part of the demo (see the module docstring), its engines given the running
    ``remote`` store (None: disk only), its kvfsm-mode engines reporting to ``metrics`` and
    logging their transitions into ``events/<model>-<workload>.jsonl`` (None: no logs)."""
    from kvfsm.serve._tiny import tiny_model

    start = time.perf_counter()
    model = tiny_model(model_type, seed=settings.seed)
    declared = engine_for(model_type, Pools(1, 0)).model
    kept = stored_tiers_of(declared)
    use_remote = remote is not None and Tier.REMOTE in kept
    tiers = tuple(t for t in kept if t is Tier.DISK or use_remote)
    workload = demo_workload(declared, settings.seed, settings.size, tiers=tiers)
    _warm_up(model, model_type, workload)
    runs: dict[tuple[str, str], tuple[Result, ...]] = {}
    for name, mode in RUNS:
        def tick(name: str = name, mode: str = mode) -> None:
            if progress is not None:
                progress(model_type, name, mode)

        runs[(name, mode)] = _run(model, model_type, settings, workload, name, mode, remote,
                                  use_remote, tick, metrics,
                                  None if events is None else events_file(events, model_type,
                                                                          name))
    groups = tuple((decl.name, decl.kind.value) for decl in declared.groups)
    return ModelRun(model_type, groups, workload, settings.pools,
                    tuple(t.spec_name for t in tiers), MappingProxyType(runs),
                    time.perf_counter() - start)


def events_file(events: Path, model_type: str, workload: str) -> Path:
    """Where the kvfsm-mode run of ``model_type`` on ``workload`` logs its transitions."""
    return events / f"{model_type}-{workload}.jsonl"


def run_demo(settings: DemoSettings, *, progress_bar: bool | None = None,
             events: Path | None = None) -> DemoRun:
    """Every served model of ``settings.models``, with the remote store of ``settings.remote``
    started first and stopped at the end (also on an error or Ctrl-C); a tqdm progress bar on
    stderr (``None``: only when stderr is a terminal)."""
    from prometheus_client import CollectorRegistry
    from tqdm import tqdm

    if events is not None:
        events.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # The engines' own metrics, under their own prefix beside the demo's figures.
    metrics = EngineMetrics(CollectorRegistry(), namespace=ENGINE_METRICS_NAMESPACE)
    backend, note = choose_remote(settings.remote)
    served, skipped = served_models(settings.models)
    per_model = len(RUNS) * len(demo_workload(engine_for(served[0], Pools(1, 0)).model,
                                              settings.seed, settings.size).requests) \
        if served else 0
    results = []
    with remote_store(backend if served else None) as remote, one_torch_thread(), \
            tqdm(total=per_model * len(served), unit="req",
                 disable=None if progress_bar is None else not progress_bar,
                 leave=False, dynamic_ncols=True) as bar:
        def progress(model_type: str, workload: str, mode: str) -> None:
            bar.set_description(f"{model_type} {workload}/{mode}", refresh=False)
            bar.update()

        for model_type in served:
            results.append(run_model(model_type, settings, progress, remote=remote,
                                     metrics=metrics, events=events))
    # Every logged run re-fired through the lifecycle tables: a real run's log must replay.
    replays = {} if events is None else {
        f"{run.model_type}/{name}": replay(events_file(events, run.model_type, name))
        for run in results for name, mode in RUNS if mode == "kvfsm"}
    return DemoRun(tuple(results), MappingProxyType(skipped), time.perf_counter() - start,
                   backend, note, metrics, MappingProxyType(replays))
