"""The serving demo's figures and what is written from them: the short report printed per
model, report.md, the PNG plots, the Prometheus text exposition and the JSON.

Definitions (every rate is over the prompt tokens of the workload's requests):

* **hit rate**: tokens of each prompt whose blocks a prefix-hash lookup finds (the classic hit,
  every group's hash chain present), on kvfsm's first lookup of each request.
* **usable rate**: tokens kvfsm says are reusable right now, on the same first lookup.
* **reused / restored / recomputed** (kvfsm, a partition of the prompt tokens): taken from the
  cache as they were; taken from the cache after the verdict's restore plan ran; forwarded
  through the model.
* **wrong output**: a request whose greedy tokens differ from the ``nocache`` run's, or whose
  first-step logits differ from them by more than :data:`LOGIT_TOLERANCE`.
* **overhead_vs_naive**: kvfsm's bookkeeping time (lookups, plan execution, commits; not the
  model's forwards nor the adapter's tensor copies) over the kvfsm runs' serving wall time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from kvfsm.serve._loop import Result

if TYPE_CHECKING:
    from prometheus_client import Metric

    from kvfsm.serve._demo import DemoRun, ModelRun

#: Largest first-step logit difference from ``nocache`` that still counts as the same output.
LOGIT_TOLERANCE: Final = 1e-3

#: Shortfall reasons shown per model.
TOP_REASONS: Final = 5

_PRETTY: Final = {"gpt_oss": "GPT-OSS", "qwen3_next": "Qwen3-Next", "deepseek_v4": "DeepSeek-V4"}


def pretty(model_type: str) -> str:
    return _PRETTY.get(model_type, model_type)


def logit_diff(a: Result, b: Result) -> float:
    return float(np.abs(a.logits.astype(np.float64) - b.logits.astype(np.float64)).max())


def is_wrong(result: Result, reference: Result) -> bool:
    diff = logit_diff(result, reference)
    return result.tokens != reference.tokens or not diff <= LOGIT_TOLERANCE  # NaN is wrong


def _sources(result: Result) -> tuple[int, int, int]:
    """(reused as found, restored, recomputed) tokens of one kvfsm-mode result."""
    direct = min(result.reused_tokens, result.usable_tokens)
    restored = result.reused_tokens - direct
    return direct, restored, result.prompt_tokens - result.reused_tokens


def _fault_landed(line: str) -> bool:
    return not any(word in line for word in ("no fault", "not cached", "cannot", "refused"))


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _workload_figures(kvfsm: Sequence[Result], naive: Sequence[Result],
                      reference: Sequence[Result]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in kvfsm)
    direct, restored, recomputed = (sum(column) for column in
                                    zip(*map(_sources, kvfsm), strict=True))
    restores: Counter[tuple[str, str, str]] = Counter(
        (kind, tier, outcome) for r in kvfsm for _group, kind, tier, outcome in r.steps)
    hit = sum(r.hit_tokens for r in kvfsm)
    return {
        "requests": len(kvfsm),
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "usable_tokens": sum(r.usable_tokens for r in kvfsm),
        "hit_rate": _ratio(hit, prompt),
        "usable_rate": _ratio(sum(r.usable_tokens for r in kvfsm), prompt),
        "tokens_reused": direct,
        "tokens_restored": restored,
        "tokens_recomputed": recomputed,
        "reuse_of_hit": _ratio(direct + restored, hit),
        "naive_tokens_reused": sum(r.reused_tokens for r in naive),
        "naive_wrong": sum(map(is_wrong, naive, reference)),
        "naive_wrong_tokens": sum(n.tokens != r.tokens for n, r in zip(naive, reference,
                                                                       strict=True)),
        "kvfsm_wrong": sum(map(is_wrong, kvfsm, reference)),
        "max_logit_diff": max(map(logit_diff, kvfsm, reference), default=0.0),
        "naive_max_logit_diff": max(map(logit_diff, naive, reference), default=0.0),
        "restores": [{"kind": kind, "tier": tier, "outcome": outcome, "count": count}
                     for (kind, tier, outcome), count in sorted(restores.items())],
        "bookkeeping_s": sum(r.bookkeeping_s for r in kvfsm),
        "kvfsm_wall_s": sum(r.wall_s for r in kvfsm),
        "naive_bookkeeping_s": sum(r.bookkeeping_s for r in naive),
        "naive_wall_s": sum(r.wall_s for r in naive),
    }


def _reasons(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Why hit tokens were not usable right away: the reasons of shortfalls inside the hit, by
    the requests they appear in (and their count)."""
    seen: Counter[str] = Counter(reason for r in results for reason in set(r.hit_reasons))
    total: Counter[str] = Counter(reason for r in results for reason in r.hit_reasons)
    return [{"reason": reason, "requests": count, "shortfalls": total[reason]}
            for reason, count in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))]


def model_figures(run: ModelRun) -> dict[str, Any]:
    """One model's figures (the JSON under ``models``; see the module docstring)."""
    reference = run.runs[("reference", "nocache")]
    faulted = _workload_figures(run.runs[("faulted", "kvfsm")], run.runs[("faulted", "naive")],
                                reference)
    clean = _workload_figures(run.runs[("clean", "kvfsm")], run.runs[("clean", "naive")],
                              reference)
    kvfsm_runs = [r for key in (("faulted", "kvfsm"), ("clean", "kvfsm"))
                  for r in run.runs[key]]
    naive_runs = [r for key in (("faulted", "naive"), ("clean", "naive")) for r in run.runs[key]]
    bookkeeping = sum(r.bookkeeping_s for r in kvfsm_runs)
    serving = sum(r.wall_s for r in kvfsm_runs)
    events = [line for r in run.runs[("faulted", "kvfsm")] for line in r.events]
    by_kind: Counter[tuple[str, str]] = Counter((f.kind, f.injector)
                                                for f in run.workload.faults)
    return {
        "model": run.model_type,
        "groups": dict(run.groups),
        "pools": {"device_blocks": run.pools[0], "host_blocks": run.pools[1]},
        "requests": faulted["requests"],
        "prompt_tokens": faulted["prompt_tokens"],
        "faults": len(run.workload.faults),
        "faults_landed": sum(map(_fault_landed, events)),
        "faults_by_kind": [{"kind": kind, "injector": injector, "count": count}
                           for (kind, injector), count in sorted(by_kind.items())],
        **{key: faulted[key] for key in (
            "hit_rate", "usable_rate", "tokens_reused", "tokens_restored", "tokens_recomputed",
            "naive_tokens_reused", "naive_wrong", "naive_wrong_tokens", "kvfsm_wrong",
            "max_logit_diff", "naive_max_logit_diff", "restores")},
        "top_reasons": _reasons(run.runs[("faulted", "kvfsm")])[:TOP_REASONS],
        "clean": {key: clean[key] for key in (
            "hit_rate", "usable_rate", "tokens_reused", "tokens_restored", "tokens_recomputed",
            "reuse_of_hit", "naive_tokens_reused", "naive_wrong", "kvfsm_wrong",
            "max_logit_diff", "restores")},
        "bookkeeping_s": bookkeeping,
        "serve_wall_s": {
            "nocache": sum(r.wall_s for r in reference),
            "naive": sum(r.wall_s for r in naive_runs),
            "kvfsm": serving,
        },
        "overhead_vs_naive": _ratio(bookkeeping, serving),
        "naive_bookkeeping_share": _ratio(sum(r.bookkeeping_s for r in naive_runs),
                                          sum(r.wall_s for r in naive_runs)),
        "wall_s": run.wall_s,
    }


def demo_figures(demo: DemoRun) -> dict[str, Any]:
    """The demo's JSON: totals at the top level, one entry per model under ``models``."""
    models = {run.model_type: model_figures(run) for run in demo.models}
    per = list(models.values())
    prompt = sum(m["prompt_tokens"] for m in per)

    def weighted(key: str) -> float:
        return _ratio(sum(m[key] * m["prompt_tokens"] for m in per), prompt)

    bookkeeping = sum(m["bookkeeping_s"] for m in per)
    serving = sum(m["serve_wall_s"]["kvfsm"] for m in per)
    return {
        "models": models,
        "skipped": dict(demo.skipped),
        "requests": sum(m["requests"] for m in per),
        "prompt_tokens": prompt,
        "hit_rate": weighted("hit_rate"),
        "usable_rate": weighted("usable_rate"),
        "naive_wrong": sum(m["naive_wrong"] for m in per),
        "kvfsm_wrong": sum(m["kvfsm_wrong"] for m in per),
        "max_logit_diff": max((m["max_logit_diff"] for m in per), default=0.0),
        "naive_max_logit_diff": max((m["naive_max_logit_diff"] for m in per), default=0.0),
        "tokens_reused": sum(m["tokens_reused"] for m in per),
        "tokens_restored": sum(m["tokens_restored"] for m in per),
        "tokens_recomputed": sum(m["tokens_recomputed"] for m in per),
        "bookkeeping_s": bookkeeping,
        "overhead_vs_naive": _ratio(bookkeeping, serving),
        "wall_s": demo.wall_s,
    }


# -- text ------------------------------------------------------------------------------------

def _restores_text(restores: Sequence[Mapping[str, Any]]) -> str:
    if not restores:
        return "none"
    by_source: dict[tuple[str, str], list[str]] = {}
    for r in restores:
        by_source.setdefault((r["kind"], r["tier"]), []).append(f"{r['count']} {r['outcome']}")
    return "; ".join(f"{kind} from {tier}: {', '.join(outcomes)}"
                     for (kind, tier), outcomes in by_source.items())


def _reasons_text(reasons: Sequence[Mapping[str, Any]]) -> str:
    if not reasons:
        return "none (every hit token was usable)"
    return ", ".join(f"{r['reason']} ({r['requests']} req)" for r in reasons)


def model_lines(model_type: str, m: Mapping[str, Any]) -> list[str]:
    """The short report of one model."""
    clean = m["clean"]
    groups = ", ".join(f"{name} ({kind})" for name, kind in m["groups"].items())
    return [
        f"{pretty(model_type)} [{groups}]",
        f"  {m['requests']} requests, {m['prompt_tokens']:,} prompt tokens, "
        f"{m['faults']} faults injected ({m['faults_landed']} landed on cached blocks)",
        f"  hit rate {m['hit_rate']:.1%} vs usable rate {m['usable_rate']:.1%} "
        "(tokens hit / usable now, over prompt tokens)",
        f"  kvfsm tokens: {m['tokens_reused']:,} reused, {m['tokens_restored']:,} restored, "
        f"{m['tokens_recomputed']:,} recomputed (naive reused {m['naive_tokens_reused']:,})",
        f"  wrong outputs vs nocache: naive {m['naive_wrong']}/{m['requests']} "
        f"({m['naive_wrong_tokens']} with other greedy tokens), kvfsm "
        f"{m['kvfsm_wrong']}/{m['requests']}; max |dlogit| naive "
        f"{m['naive_max_logit_diff']:.2e}, kvfsm {m['max_logit_diff']:.2e}",
        f"  restores: {_restores_text(m['restores'])}",
        f"  why hit tokens were not usable: {_reasons_text(m['top_reasons'])}",
        f"  without faults: hit {clean['hit_rate']:.1%}, usable {clean['usable_rate']:.1%}, "
        f"kvfsm reused {clean['reuse_of_hit']:.0%} of the hit after restores "
        f"({clean['tokens_reused'] + clean['tokens_restored']:,} tokens; naive "
        f"{clean['naive_tokens_reused']:,}), wrong: kvfsm {clean['kvfsm_wrong']}, "
        f"naive {clean['naive_wrong']}",
        f"  bookkeeping {m['bookkeeping_s']:.2f} s = {m['overhead_vs_naive']:.1%} of kvfsm "
        f"serving wall {m['serve_wall_s']['kvfsm']:.1f} s; model total {m['wall_s']:.1f} s",
    ]


def summary_lines(figures: Mapping[str, Any]) -> list[str]:
    """The short report printed per model, then the models not served and the totals."""
    lines = []
    for model_type, m in figures["models"].items():
        lines += model_lines(model_type, m)
    for model_type, why in figures["skipped"].items():
        lines.append(f"{pretty(model_type)}: not served yet ({why})")
    lines.append(
        f"total: {figures['requests']} requests, hit rate {figures['hit_rate']:.1%}, usable "
        f"{figures['usable_rate']:.1%}; wrong outputs naive {figures['naive_wrong']}, kvfsm "
        f"{figures['kvfsm_wrong']}; max |dlogit| kvfsm {figures['max_logit_diff']:.2e}; "
        f"overhead {figures['overhead_vs_naive']:.1%}; {figures['wall_s']:.0f} s")
    return lines


def _per_request_table(run: ModelRun) -> list[str]:
    reference = run.runs[("reference", "nocache")]
    naive = run.runs[("faulted", "naive")]
    kvfsm = run.runs[("faulted", "kvfsm")]
    lines = ["| request | prompt | hit | usable | reused | restored | recomputed | naive "
             "\\|Δlogit\\| | kvfsm \\|Δlogit\\| | fault before it |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for ref, n, k in zip(reference, naive, kvfsm, strict=True):
        direct, restored, recomputed = _sources(k)
        mark = " ✗" if is_wrong(n, ref) else ""
        fault = "; ".join(k.events).replace("|", "\\|") or ""
        lines.append(f"| {k.rid} | {k.prompt_tokens} | {k.hit_tokens} | {k.usable_tokens} | "
                     f"{direct} | {restored} | {recomputed} | {logit_diff(n, ref):.1e}{mark} | "
                     f"{logit_diff(k, ref):.1e} | {fault} |")
    return lines


def report_markdown(demo: DemoRun, figures: Mapping[str, Any], *, command: str = "kvfsm demo",
                    image_prefix: str = "") -> str:
    """report.md: the totals, then per model its figures, plots and per-request table."""
    out = [
        "# kvfsm demo: a prefix hit is not a usable cache",
        "",
        f"Generated by `{command}`: tiny real transformers models (seeded random weights, CPU), "
        "each served three ways on one seeded workload (multi-turn chat over a shared system "
        "prompt, then many questions over a few long documents; prompt lengths odd, never a "
        "multiple of a block size) with faults injected before some requests:",
        "",
        "* **nocache**: every prompt recomputed; the reference tokens and logits.",
        "* **naive**: reuses the prefix *hit*, reading whatever bytes the hit blocks hold.",
        "* **kvfsm**: reuses what the verdict says is *usable* (FULL verification), after "
        "executing its restore plan.",
        "",
        "A request's output is *wrong* when its greedy tokens differ from nocache's or its "
        f"first-step logits differ by more than {LOGIT_TOLERANCE:g}. A hit-only engine never "
        "learns that a block is damaged, so one fault keeps spoiling every later request that "
        "reuses the block; kvfsm sees it on the first lookup (a failed checksum, a state that "
        "is not readable), drops or restores it, and recomputes what it cannot restore. A "
        "restore step *refused* at `restore_done` is one whose arriving bytes failed their "
        "checksum: it is rolled back and the block recomputed.",
        "",
        "| model | requests | hit rate | usable rate | reused | restored | recomputed | "
        "naive wrong | kvfsm wrong | max \\|Δlogit\\| kvfsm | overhead |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for model_type, m in figures["models"].items():
        out.append(f"| {pretty(model_type)} | {m['requests']} | {m['hit_rate']:.1%} | "
                   f"{m['usable_rate']:.1%} | {m['tokens_reused']:,} | {m['tokens_restored']:,} | "
                   f"{m['tokens_recomputed']:,} | {m['naive_wrong']} | {m['kvfsm_wrong']} | "
                   f"{m['max_logit_diff']:.1e} | {m['overhead_vs_naive']:.1%} |")
    out.append(f"| **total** | {figures['requests']} | {figures['hit_rate']:.1%} | "
               f"{figures['usable_rate']:.1%} | {figures['tokens_reused']:,} | "
               f"{figures['tokens_restored']:,} | {figures['tokens_recomputed']:,} | "
               f"{figures['naive_wrong']} | {figures['kvfsm_wrong']} | "
               f"{figures['max_logit_diff']:.1e} | {figures['overhead_vs_naive']:.1%} |")
    out += ["", f"Wall time of the whole demo: {figures['wall_s']:.0f} s. *Overhead* is kvfsm's "
            "bookkeeping (lookups, restore plans, commits; not the forwards nor the adapter's "
            "tensor copies) over the kvfsm runs' serving wall time.", ""]
    if figures["skipped"]:
        out += ["Not served yet: " + "; ".join(f"{pretty(t)} ({why})"
                                              for t, why in figures["skipped"].items()), ""]
    out += [f"![hit and usable rates per model]({image_prefix}overview.png)", ""]
    runs = {run.model_type: run for run in demo.models}
    for model_type, m in figures["models"].items():
        run = runs[model_type]
        out += [f"## {pretty(model_type)}", "", "```", *model_lines(model_type, m), "```", "",
            f"Pools: {m['pools']['device_blocks']} device and {m['pools']['host_blocks']} host "
            "blocks per group. Faults: " + ", ".join(
                f"{f['injector']} on {f['kind']} x{f['count']}" for f in m["faults_by_kind"])
            + ".", "",
            f"![hit vs usable per request]({image_prefix}{model_type}_hit_vs_usable.png)", "",
            f"![where the tokens came from]({image_prefix}{model_type}_token_sources.png)", "",
            "<details><summary>Per request (faulted workload; ✗: naive output wrong)</summary>",
            "", *_per_request_table(run), "", "</details>", ""]
    return "\n".join(out)


# -- plots -----------------------------------------------------------------------------------

def _faulted_positions(results: Sequence[Result]) -> list[int]:
    return [i for i, r in enumerate(results) if r.events]


def plot_hit_vs_usable(run: ModelRun, path: Path) -> None:
    """Per request: its prompt (grey), the prefix hit (what a hit-only engine reuses), what
    kvfsm found usable now, and what kvfsm reused after its restores; the faulted workload
    above, the clean one below."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6.4), dpi=100, layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    reference = run.runs[("reference", "nocache")]
    top = 1.32 * max(r.prompt_tokens for r in reference)
    for ax, name in zip(axes, ("faulted", "clean"), strict=True):
        kvfsm = run.runs[(name, "kvfsm")]
        naive = run.runs[(name, "naive")]
        x = np.arange(len(kvfsm))
        ax.bar(x, [r.prompt_tokens for r in kvfsm], 0.9, color="#e8e8e8", label="prompt")
        ax.bar(x - 0.27, [r.hit_tokens for r in kvfsm], 0.27, color="#d62728",
               label="hit (what naive reuses)")
        ax.bar(x, [r.usable_tokens for r in kvfsm], 0.27, color="#1f77b4",
               label="usable now (kvfsm)")
        ax.bar(x + 0.27, [r.reused_tokens for r in kvfsm], 0.27, color="#2ca02c",
               label="reused by kvfsm after restores")
        for i in _faulted_positions(kvfsm):
            ax.axvline(i, color="#ff7f0e", lw=0.9, ls=":")
        wrong = [i for i, (n, ref) in enumerate(zip(naive, reference, strict=True))
                 if is_wrong(n, ref)]
        if wrong:
            ax.plot(wrong, [top * 0.8] * len(wrong), "x", color="#d62728", ms=6,
                    label="naive output wrong")
        ax.set_ylim(0, top)
        ax.set_ylabel("tokens")
        ax.set_title(f"{pretty(run.model_type)}, {name} workload"
                     + (" (dotted: a fault injected before the request)"
                        if name == "faulted" else ""), fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncols=5)
    axes[-1].set_xticks(np.arange(len(reference)), [r.rid for r in reference], rotation=90,
                        fontsize=7)
    axes[-1].set_xlabel("request, in serving order")
    fig.savefig(path)


def plot_token_sources(run: ModelRun, path: Path) -> None:
    """Per request of the faulted workload, where kvfsm's prompt tokens came from."""
    from matplotlib.figure import Figure

    kvfsm = run.runs[("faulted", "kvfsm")]
    direct, restored, recomputed = (np.array(c) for c in zip(*map(_sources, kvfsm),
                                                               strict=True))
    fig = Figure(figsize=(10, 3.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(kvfsm))
    ax.bar(x, direct, color="#2ca02c", label="reused as found")
    ax.bar(x, restored, bottom=direct, color="#9467bd", label="restored, then reused")
    ax.bar(x, recomputed, bottom=direct + restored, color="#bbbbbb", label="recomputed")
    for i in _faulted_positions(kvfsm):
        ax.axvline(i, color="#ff7f0e", lw=0.8, ls=":")
    ax.set_xticks(x, [r.rid for r in kvfsm], rotation=90, fontsize=7)
    ax.set_ylabel("prompt tokens")
    ax.set_ylim(0, 1.25 * max(r.prompt_tokens for r in kvfsm))
    ax.set_title(f"{pretty(run.model_type)}: where kvfsm's prompt tokens came from (faulted "
                 "workload; dotted: fault injected)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    fig.savefig(path)


def plot_overview(figures: Mapping[str, Any], path: Path) -> None:
    """Per model: hit rate vs usable rate, and wrong outputs of naive vs kvfsm."""
    from matplotlib.figure import Figure

    models = list(figures["models"])
    per = [figures["models"][t] for t in models]
    fig = Figure(figsize=(10, 3.6), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    x = np.arange(len(models))
    names = [pretty(t) for t in models]
    for offset, values, color, label in (
            (-0.3, [m["hit_rate"] for m in per], "#d62728", "hit, faulted"),
            (-0.1, [m["usable_rate"] for m in per], "#1f77b4", "usable now, faulted"),
            (0.1, [m["clean"]["hit_rate"] for m in per], "#ff9896", "hit, no faults"),
            (0.3, [m["clean"]["hit_rate"] * m["clean"]["reuse_of_hit"] for m in per],
             "#98df8a", "kvfsm reused after restores, no faults")):
        bars = left.bar(x + offset, [100 * v for v in values], 0.2, color=color, label=label)
        left.bar_label(bars, fmt="%.0f", fontsize=7)
    left.set_xticks(x, names)
    left.set_ylim(0, 115)
    left.set_ylabel("% of prompt tokens")
    left.set_title("prefix hit vs usable now", fontsize=10)
    left.legend(fontsize=7, ncols=2, loc="upper left")
    for offset, key, color in ((-0.2, "naive_wrong", "#d62728"), (0.2, "kvfsm_wrong", "#2ca02c")):
        bars = right.bar(x + offset, [m[key] for m in per], 0.4, color=color,
                         label=key.split("_")[0])
        right.bar_label(bars, fontsize=8)
    right.set_xticks(x, names)
    right.set_ylim(0, 1.2 * max([m["naive_wrong"] for m in per] + [1]))
    right.set_ylabel("requests")
    right.set_title("wrong outputs vs recomputing", fontsize=10)
    right.legend(fontsize=7)
    fig.savefig(path)


# -- metrics ---------------------------------------------------------------------------------

def _families(demo: DemoRun) -> Iterator[Any]:
    """The demo's figures as Prometheus metric families."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    run_labels = ["model", "workload", "mode"]

    def counter(name: str, doc: str, labels: Sequence[str] = run_labels) -> Any:
        return CounterMetricFamily(name, doc, labels=list(labels))

    families = {
        "requests": counter("kvfsm_requests", "Requests served."),
        "lookups": counter("kvfsm_lookups", "Prefix lookups (a second one after a plan)."),
        "prompt": counter("kvfsm_prompt_tokens", "Prompt tokens of the requests served."),
        "hit": counter("kvfsm_hit_tokens", "Prompt tokens found by the prefix hash "
                       "(first lookup of each request)."),
        "usable": counter("kvfsm_usable_tokens", "Prompt tokens kvfsm found usable now "
                          "(first lookup of each request)."),
        "reused": counter("kvfsm_reused_tokens", "Prompt tokens taken from the cache."),
        "restored": counter("kvfsm_restored_tokens",
                            "Prompt tokens taken from the cache after a restore plan."),
        "recomputed": counter("kvfsm_recomputed_tokens", "Prompt tokens forwarded."),
        "wrong": counter("kvfsm_wrong_outputs", "Requests whose greedy tokens or first "
                         "logits differ from recomputing everything."),
        "bookkeeping": counter("kvfsm_bookkeeping_seconds", "Time in lookups, plan "
                               "execution and commits (no forwards, no tensor copies)."),
        "serve": counter("kvfsm_serve_seconds", "Wall time serving requests."),
    }
    restores = counter("kvfsm_restores", "Restore plan steps by group kind, source tier "
                       "and outcome.", ["model", "workload", "kind", "tier", "outcome"])
    shortfalls = counter("kvfsm_shortfalls", "Shortfalls in first verdicts by reason.",
                         ["model", "workload", "mode", "reason"])
    faults = counter("kvfsm_faults_injected", "Faults injected by group kind and injector.",
                     ["model", "kind", "injector"])
    logit = GaugeMetricFamily("kvfsm_max_logit_diff", "Largest first-step |logit "
                              "difference| from recomputing everything.", labels=run_labels)
    wall = GaugeMetricFamily("kvfsm_demo_wall_seconds", "Wall time of each model's part "
                             "of the demo.", labels=["model"])
    for run in demo.models:
        model = run.model_type
        reference = run.runs[("reference", "nocache")]
        for (workload, mode), results in run.runs.items():
            labels = [model, workload, mode]
            reused = sum(r.reused_tokens for r in results)
            restored = sum(_sources(r)[1] for r in results) if mode == "kvfsm" else 0
            values = {
                "requests": len(results),
                "lookups": 0 if mode == "nocache" else len(results) + sum(
                    bool(r.steps) for r in results),
                "prompt": sum(r.prompt_tokens for r in results),
                "hit": sum(r.hit_tokens for r in results),
                "usable": sum(r.usable_tokens for r in results),
                "reused": reused,
                "restored": restored,
                "recomputed": sum(r.prompt_tokens for r in results) - reused,
                "wrong": sum(map(is_wrong, results, reference)),
                "bookkeeping": sum(r.bookkeeping_s for r in results),
                "serve": sum(r.wall_s for r in results),
            }
            for key, value in values.items():
                families[key].add_metric(labels, value)
            logit.add_metric(labels, max(map(logit_diff, results, reference), default=0.0))
            for reason, count in sorted(Counter(x for r in results
                                                for x in r.reasons).items()):
                shortfalls.add_metric([*labels, reason], count)
            if mode == "kvfsm":
                steps = Counter((kind, tier, outcome) for r in results
                                for _group, kind, tier, outcome in r.steps)
                for (kind, tier, outcome), count in sorted(steps.items()):
                    restores.add_metric([model, workload, kind, tier, outcome], count)
        for (kind, injector), count in sorted(Counter(
                (f.kind, f.injector) for f in run.workload.faults).items()):
            faults.add_metric([model, kind, injector], count)
        wall.add_metric([model], run.wall_s)
    yield from families.values()
    yield from (restores, shortfalls, faults, logit, wall)


def metrics_text(demo: DemoRun) -> bytes:
    """The Prometheus text exposition of the demo's counters, from a private registry."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    class DemoCollector(Collector):
        def collect(self) -> Iterable[Metric]:
            return list(_families(demo))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DemoCollector())
    data: bytes = generate_latest(registry)
    return data


# -- everything -----------------------------------------------------------------------------

def write_outputs(demo: DemoRun, figures: Mapping[str, Any], out_dir: Path, *,
                  command: str = "kvfsm demo") -> list[Path]:
    """report.md, report.json, metrics.prom and the PNGs into ``out_dir``; the paths written."""
    import json

    written = []
    for run in demo.models:
        for name, draw in (("hit_vs_usable", plot_hit_vs_usable),
                           ("token_sources", plot_token_sources)):
            path = out_dir / f"{run.model_type}_{name}.png"
            draw(run, path)
            written.append(path)
    if demo.models:
        path = out_dir / "overview.png"
        plot_overview(figures, path)
        written.append(path)
    report = out_dir / "report.md"
    report.write_text(report_markdown(demo, figures, command=command), encoding="utf-8")
    data = out_dir / "report.json"
    data.write_text(json.dumps(to_json(figures), indent=2) + "\n", encoding="utf-8")
    metrics = out_dir / "metrics.prom"
    metrics.write_bytes(metrics_text(demo))
    return [*written, report, data, metrics]


def to_json(value: Any) -> Any:
    """``value`` with floats rounded to 6 significant digits and non-finite ones as strings."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return float(f"{value:.6g}")
    if isinstance(value, Mapping):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(item) for item in value]
    return value
