"""Compare two checkouts of kvfsm on one hot path: two persistent worker processes, one per
checkout, timed in alternated bursts.

Usage: ``python tools/ab_bench.py BEFORE AFTER [--path lookup|lease] [--observed]
[--model NAME] [--tokens N] [--cached-fraction F] [--bursts 30] [--per-burst 100]
[--json]``. ``BEFORE`` and
``AFTER`` are directories holding a ``kvfsm`` package (a checkout, or ``git worktree add
/tmp/before <rev>``); each worker runs with its checkout first on ``sys.path`` and builds its
own engine over the same committed prompt.

Why: on a shared machine the speed of everything moves by tens of percent for minutes at a
time, so two medians taken one after the other cannot resolve a change of a few percent. Here
the two sides take turns (ABBA...) within seconds, each burst of one side is compared with the
neighbouring burst of the other, and what is reported is the spread of those per-burst
comparisons. Two identical checkouts give the noise floor (run it: on the development machine
the median per-burst ratio of a lookup stayed within 1-2 % of 1).

Paths:

- ``lookup``: ``Engine.lookup(prompt, level=STANDARD)`` (checksums verified by a first FULL
  lookup; with ``--observed``, metrics and an event log attached). Per burst, each side's
  median time of ``--per-burst`` calls; reported: each side's median over bursts, and the
  per-burst ratio after / before (quartiles; below 1: AFTER is faster).
- ``lease``: what a lease adds to a lookup, as a server runs it: each round times a plain
  lookup and ``Engine.lookup_and_lease`` plus ``validate`` and ``release``, in a random order;
  per burst the median of the rounds' differences. With ``--observed``, metrics and an event
  log are attached to the engine for the leased path and detached for the plain one (what
  ``kvfsm bench lookup`` calls ``observability_overhead``). Reported: each side's median
  overhead (µs and as a share of its plain lookup) and the per-burst difference after - before
  in µs (quartiles; below 0: AFTER costs less).

Progress goes to stderr; the report to stdout. The tool installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PATHS = ("lookup", "lease")
VOCABULARY = 100_000
#: Blocks of headroom in the pool beyond the prompt's.
SPARE_BLOCKS = 8
#: Untimed calls a worker makes before its first burst (compiles, fills caches).
WARMUP_CALLS = 50


# -- the worker (runs inside a checkout) ----------------------------------------------------

def _engine_and_calls(model: str, tokens: int, observed: bool, root: Path,
                      cached: float = 1.0
                      ) -> tuple[Callable[[], None], Callable[[], None], Callable[[bool], None],
                                 int]:
    """On an engine over a committed prompt (its first ``cached`` share only, below 1: a
    partial hit): the lookup, the leased lookup (validated and released), the switch
    attaching (True) or detaching metrics and log (a no-op without ``observed``), and the
    tokens the lookup finds usable. The same paths as ``kvfsm bench lookup`` times, written
    out here: a worker imports kvfsm from the checkout under test, which may predate any
    helper the bench has."""
    import numpy as np

    from kvfsm import CoreConfig, Engine, EngineMetrics, EventLog, Level, shipped_models

    decl = shipped_models()[model]
    finest = min(group.block_size for group in decl.groups)
    config = CoreConfig(device_blocks=tokens // finest + SPARE_BLOCKS, host_blocks=0,
                        backend="numpy")
    metrics = log = None
    if observed:
        from prometheus_client import CollectorRegistry

        metrics = EngineMetrics(CollectorRegistry())
        log = EventLog(root / "events.jsonl")
    engine = Engine(decl, config, metrics=metrics, event_log=log)
    text = np.random.default_rng(0).integers(0, VOCABULARY, tokens + 1)
    prompt = engine.prompt(text)
    engine.commit(prompt if cached >= 1.0 else engine.prompt(text[:int(tokens * cached)]))
    usable = engine.lookup(prompt, level=Level.FULL).usable_tokens  # checksums verified
    observers = tuple(each for each in (log, metrics) if each is not None)

    def observe(on: bool) -> None:
        if not observers or (engine.metrics is not None) == on:
            return
        for observer in observers:
            (engine.core.add_observer if on else engine.core.remove_observer)(observer)
        engine.metrics = metrics if on else None

    def plain() -> None:
        engine.lookup(prompt, level=Level.STANDARD)

    def leased() -> None:
        _, lease = engine.lookup_and_lease(prompt, level=Level.STANDARD)
        try:
            lease.validate()
        finally:
            lease.release()

    return plain, leased, observe, usable


def _timed(call: Callable[[], None]) -> float:
    """Seconds of one call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def worker(model: str, tokens: int, path: str, observed: bool, cpu: int | None,
           cached: float = 1.0) -> None:
    """Serve bursts: read a round count per line on stdin, answer one JSON line per burst.
    ``cpu``: the one CPU to run on (both workers share it: the cores of a shared machine can
    differ in speed by half, and a worker the scheduler placed on the slower one would read
    slower throughout)."""
    import numpy as np

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})

    with tempfile.TemporaryDirectory(prefix="kvfsm-ab-") as root:
        plain, leased, observe, usable = _engine_and_calls(model, tokens, observed,
                                                           Path(root), cached)
        calls = (plain, leased)
        for _ in range(WARMUP_CALLS):
            for at, call in enumerate(calls):
                observe(at == 1)
                call()
        # The lookup path: observed (metrics and log on) where asked, else plain.
        observe(path == "lookup" and observed)
        order = np.random.default_rng(1)
        for line in sys.stdin:
            rounds = int(line)
            if path == "lookup":
                samples = [_timed(plain) for _ in range(rounds)]
                print(json.dumps({"median": statistics.median(samples), "usable": usable}),
                      flush=True)
                continue
            offs, differences = [], []
            for _ in range(rounds):
                took = [0.0, 0.0]
                for at in order.permutation(2).tolist():
                    observe(at == 1)  # outside the timing
                    took[at] = _timed(calls[at])
                offs.append(took[0])
                differences.append(took[1] - took[0])
            print(json.dumps({"median": statistics.median(offs), "usable": usable,
                              "overhead": statistics.median(differences)}), flush=True)


# -- the driver ------------------------------------------------------------------------------

def _spawn(checkout: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--path", args.path,
               "--model", args.model, "--tokens", str(args.tokens), "--cached-fraction",
               repr(args.cached)]
    if args.cpu is not None:
        command += ["--cpu", str(args.cpu)]
    if args.observed:
        command.append("--observed")
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=str(checkout))


def _quartiles(values: Sequence[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[len(ordered) // 4], statistics.median(ordered),
            ordered[(3 * len(ordered)) // 4]]


def compare(before: Path, after: Path, *, path: str = "lookup", observed: bool = False,
            model: str = "deepseek_v4_like", tokens: int = 131_072, bursts: int = 30,
            per_burst: int = 100, cpu: int | None = -1, cached: float = 1.0,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Alternated bursts of the two checkouts' workers; the report (see the module doc).
    ``cpu``: the CPU both workers run on (-1: the last this process may use; None: wherever
    the scheduler puts them). ``cached``: the share of the prompt committed (in (0, 1]; below
    1 every lookup is a partial hit)."""
    if cpu == -1:
        cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    for checkout in (before, after):
        if not (checkout / "kvfsm" / "__init__.py").is_file():
            raise SystemExit(f"ab_bench: {checkout} holds no kvfsm package")
    if path not in PATHS:
        raise SystemExit(f"ab_bench: path must be one of {PATHS}, got {path!r}")
    if bursts < 1 or per_burst < 1 or tokens < 2:
        raise SystemExit("ab_bench: bursts and per-burst must be >= 1 and tokens >= 2")
    if not 0.0 < cached <= 1.0:
        raise SystemExit(f"ab_bench: the cached fraction must be in (0, 1], got {cached}")
    args = argparse.Namespace(path=path, observed=observed, model=model, tokens=tokens, cpu=cpu,
                              cached=cached)
    sides = {"before": _spawn(before, args), "after": _spawn(after, args)}
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for burst in range(bursts):
            for name in (("before", "after") if burst % 2 else ("after", "before")):
                worker_process = sides[name]
                assert worker_process.stdin is not None and worker_process.stdout is not None
                worker_process.stdin.write(f"{per_burst}\n")
                worker_process.stdin.flush()
                answer = worker_process.stdout.readline()
                if not answer:
                    raise SystemExit(f"ab_bench: the {name} worker stopped (exit code "
                                     f"{worker_process.wait()})")
                results[name].append(json.loads(answer))
            if progress is not None:
                progress(f"ab_bench: burst {burst + 1}/{bursts}")
    finally:
        for worker_process in sides.values():
            if worker_process.stdin is not None:
                worker_process.stdin.close()
            worker_process.wait()
    report: dict[str, Any] = {"path": path, "observed": observed, "model": model,
                              "tokens": tokens, "cached_fraction": cached, "bursts": bursts,
                              "per_burst": per_burst, "cpu": cpu}
    for name in ("before", "after"):
        report[f"{name}_lookup_us"] = statistics.median(
            each["median"] for each in results[name]) * 1e6
        # The tokens each side's lookup found usable (a partial hit's below ``tokens``).
        report[f"{name}_usable_tokens"] = results[name][0]["usable"]
    if path == "lookup":
        report["ratio_after_before_quartiles"] = _quartiles(
            [a["median"] / b["median"] for b, a in zip(results["before"], results["after"],
                                                        strict=True)])
        return report
    for name in ("before", "after"):
        report[f"{name}_overhead_us"] = statistics.median(
            each["overhead"] for each in results[name]) * 1e6
        report[f"{name}_overhead_share"] = statistics.median(
            each["overhead"] / each["median"] for each in results[name])
    report["overhead_after_minus_before_us_quartiles"] = [value * 1e6 for value in _quartiles(
        [a["overhead"] - b["overhead"] for b, a in zip(results["before"], results["after"],
                                                        strict=True)])]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", nargs="?", type=Path)
    parser.add_argument("after", nargs="?", type=Path)
    parser.add_argument("--path", choices=PATHS, default="lookup")
    parser.add_argument("--observed", action="store_true",
                        help="metrics and an event log on for the leased path (lease) or "
                             "every lookup (lookup)")
    parser.add_argument("--model", default="deepseek_v4_like")
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--cached-fraction", type=float, default=1.0,
                        help="share of the prompt committed (below 1: partial hits)")
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--per-burst", type=int, default=100)
    parser.add_argument("--cpu", type=int, default=-1,
                        help="the CPU both workers run on (-1: the last one allowed; "
                             "pass another to compare cores)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.tokens, args.path, args.observed,
               None if args.cpu < 0 else args.cpu, args.cached_fraction)
        return 0
    if args.before is None or args.after is None:
        parser.error("give the two checkouts, BEFORE and AFTER")
    report = compare(args.before.resolve(), args.after.resolve(), path=args.path,
                     observed=args.observed, model=args.model, tokens=args.tokens,
                     bursts=args.bursts, per_burst=args.per_burst, cpu=args.cpu,
                     cached=args.cached_fraction,
                     progress=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            shown = [round(each, 4) for each in value] if isinstance(value, list) else \
                round(value, 4) if isinstance(value, float) else value
            print(f"{key}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
