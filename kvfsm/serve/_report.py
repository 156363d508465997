"""The serving demo's figures and what is written from them: the short report printed per
model, report.md, the PNG plots, the Prometheus text exposition and the JSON.

Definitions (every rate is over the prompt tokens of the workload's requests):

* **hit rate**: tokens of each prompt whose blocks a prefix-hash lookup finds (the classic hit,
  every group's hash chain present), on kvfsm's first lookup of each request.
* **usable rate** (*usable now*): tokens kvfsm says are reusable right now, on the same first
  lookup, before any restore (``naive``: what that verdict, at FAST and without checksums, says
  of the hit-only engine's own state).
* **reused rate** (*reused after restores*): tokens taken from the cache instead of computed
  (kvfsm: after its restore plan ran; naive: the hit, unless a read error made it recompute).
* **reused / restored / recomputed** (kvfsm, a partition of the prompt tokens): taken from the
  cache as they were; taken from the cache after the verdict's restore plan ran; forwarded
  through the model.
* **intact tokens** of a request: the largest prefix length whose every needed block had an
  intact copy somewhere just before the lookup (after the fault hook), by an oracle that does
  not ask the verdict (:func:`kvfsm.serve._loop.intact_tokens`).
* **lost tokens** of a request: its intact tokens minus the tokens it reused, where positive
  (intact but not reused), except for a request whose restore still had loads running when
  its wait ended: a store slower than the request's restore budget (``restore_timeout``) is
  waited out, not waited for, and those tokens are **late tokens** (``late_reuse``: late over
  intact). **lost_reuse**: the lost tokens of a workload's requests over their intact tokens
  (0 to 1): intact cache kvfsm did not reuse; **lost rate**: the lost tokens over the prompt
  tokens.
  **reused_beyond_intact**: tokens reused past the intact length (kvfsm: copies its lookup
  found in a stored tier for blocks the core had forgotten; naive: bytes reused that no intact
  copy backed, i.e. damaged ones).
* **restores** (kvfsm): the restore plans' steps by group kind, tier the copy came from (host,
  disk, remote; ``device`` for a block already there that only needs finishing), outcome
  (``restored``, ``failed``: rolled back with the copy kept, ``lost``: the copy gone or bad
  and forgotten, ``pending``: still loading when the wait ended) and load status (``OK``,
  ``MISSING``, ``CORRUPT``, ``FOREIGN``, ``FAILED``, ``LATE``).
* **wrong output**: a request whose greedy tokens differ from the ``nocache`` run's, or whose
  first-step logits differ from them by more than :data:`LOGIT_TOLERANCE`.
* **overhead_vs_naive**: kvfsm's bookkeeping time (lookups, restores and the waits for their
  loads, commits and the spills they cause; not the model's forwards nor the adapter's tensor
  copies) over the kvfsm runs' serving wall time.
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
    return not any(word in line for word in ("no fault", "not cached", "cannot", "refused",
                                             ", no ", "not there", "not on the device"))


#: Restore outcomes and tiers, in the order the report shows them.
OUTCOMES: Final = ("restored", "failed", "lost", "pending")
TIERS: Final = ("host", "disk", "remote")


def _restores(results: Iterable[Result]) -> list[dict[str, Any]]:
    """The restore steps of ``results`` counted by (kind, tier, outcome, status)."""
    counts: Counter[tuple[str, str, str, str]] = Counter(
        (step.kind, step.tier, step.outcome, step.status) for r in results for step in r.steps)
    order = {name: i for i, name in enumerate(OUTCOMES)}
    return [{"kind": kind, "tier": tier, "outcome": outcome, "status": status, "count": count}
            for (kind, tier, outcome, status), count in sorted(
                counts.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 9),
                                                kv[0][3]))]


def restores_by_tier(restores: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tier (host, disk, remote, then any other a step named, e.g. ``device``): the steps
    per outcome and the load statuses seen."""
    out: dict[str, dict[str, Any]] = {
        tier: {**dict.fromkeys(OUTCOMES, 0), "statuses": {}} for tier in TIERS}
    for r in restores:
        entry = out.setdefault(r["tier"], {**dict.fromkeys(OUTCOMES, 0), "statuses": {}})
        entry[r["outcome"]] = entry.get(r["outcome"], 0) + r["count"]
        if r["status"]:
            entry["statuses"][r["status"]] = entry["statuses"].get(r["status"], 0) + r["count"]
    for entry in out.values():
        entry["statuses"] = dict(sorted(entry["statuses"].items()))
    return out


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _intact(result: Result) -> int:
    """A caching request's intact tokens (a run made without the oracle counts none)."""
    return result.intact_tokens or 0


def _short(result: Result) -> int:
    """Intact tokens the request did not reuse (0 where it reused at least its intact
    length)."""
    return max(_intact(result) - result.reused_tokens, 0)


def late_tokens(result: Result) -> int:
    """The intact tokens not reused by a request whose restore still had loads running when
    its wait ended (the store answered after the request's restore budget)."""
    return _short(result) if result.restore.pending else 0


def lost_tokens(result: Result) -> int:
    """Intact tokens the request did not reuse although nothing it waited for was late."""
    return 0 if result.restore.pending else _short(result)


def _reuse_figures(results: Sequence[Result]) -> dict[str, Any]:
    """One caching run's reuse, side by side with the other mode's: hit, usable now, reused
    after restores, intact and lost (see the module docstring)."""
    prompt = sum(r.prompt_tokens for r in results)
    hit = sum(r.hit_tokens for r in results)
    usable = sum(r.usable_tokens for r in results)
    reused = sum(r.reused_tokens for r in results)
    intact = sum(map(_intact, results))
    lost = sum(map(lost_tokens, results))
    late = sum(map(late_tokens, results))
    return {
        "hit_tokens": hit, "usable_tokens": usable, "reused_tokens": reused,
        "intact_tokens": intact, "lost_tokens": lost, "late_tokens": late,
        "lost_reuse": _ratio(lost, intact), "late_reuse": _ratio(late, intact),
        "reused_beyond_intact": sum(max(r.reused_tokens - _intact(r), 0) for r in results),
        "hit_rate": _ratio(hit, prompt), "usable_rate": _ratio(usable, prompt),
        "reused_rate": _ratio(reused, prompt), "lost_rate": _ratio(lost, prompt),
    }


#: The per-workload keys a model's reuse figures repeat from the kvfsm run's side-by-side
#: entry.
_REUSE_KEYS: Final = ("reused_tokens", "intact_tokens", "lost_tokens", "lost_reuse",
                      "late_tokens", "late_reuse", "reused_beyond_intact", "reused_rate",
                      "lost_rate")


def _workload_figures(kvfsm: Sequence[Result], naive: Sequence[Result],
                      reference: Sequence[Result]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in kvfsm)
    modes = {"naive": _reuse_figures(naive), "kvfsm": _reuse_figures(kvfsm)}
    direct, restored, recomputed = (sum(column) for column in
                                    zip(*map(_sources, kvfsm), strict=True))
    restores = _restores(kvfsm)
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
        **{key: modes["kvfsm"][key] for key in _REUSE_KEYS},
        "modes": modes,
        "naive_tokens_reused": sum(r.reused_tokens for r in naive),
        "naive_wrong": sum(map(is_wrong, naive, reference)),
        "naive_wrong_tokens": sum(n.tokens != r.tokens for n, r in zip(naive, reference,
                                                                       strict=True)),
        "naive_read_errors": sum(bool(r.read_error) for r in naive),
        "kvfsm_wrong": sum(map(is_wrong, kvfsm, reference)),
        "max_logit_diff": max(map(logit_diff, kvfsm, reference), default=0.0),
        "naive_max_logit_diff": max(map(logit_diff, naive, reference), default=0.0),
        "restores": restores,
        "restores_by_tier": restores_by_tier(restores),
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


def _fault_outcomes(run: ModelRun) -> list[dict[str, Any]]:
    """Per fault of the schedule: what it did in the kvfsm run, what kvfsm saw (the hit
    shortfall reasons, the restore steps' statuses) and whether either engine went wrong."""
    reference = {r.rid: r for r in run.runs[("reference", "nocache")]}
    naive = {r.rid: r for r in run.runs[("faulted", "naive")]}
    kvfsm = {r.rid: r for r in run.runs[("faulted", "kvfsm")]}
    out = []
    nth: Counter[str] = Counter()
    for fault in run.workload.faults:
        k, n, ref = kvfsm[fault.before], naive[fault.before], reference[fault.before]
        index = nth[fault.before]
        nth[fault.before] += 1
        line = k.events[index] if index < len(k.events) else ""
        # On the faulted group: the reasons its hit blocks were not usable, then how its
        # restores that did not land failed.
        seen: Counter[str] = Counter(dict.fromkeys(
            (reason for group, reason in k.hit_shortfalls if group == fault.group), 1))
        seen.update(f"{s.tier} {s.outcome} {s.status}".strip() for s in k.steps
                    if s.group == fault.group and s.outcome != "restored")
        out.append({
            "request": fault.before, "group": fault.group, "kind": fault.kind,
            "injector": fault.injector, "landed": _fault_landed(line),
            "kvfsm_saw": dict(sorted(seen.items())),
            "naive_wrong": is_wrong(n, ref), "naive_read_error": bool(n.read_error),
            "kvfsm_wrong": is_wrong(k, ref),
        })
    return out


def _faults_by_injector(outcomes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The fault outcomes summed per injector (schedule order of first use)."""
    rows: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        row = rows.setdefault(o["injector"], {"injector": o["injector"], "kinds": [],
                                              "faults": 0, "landed": 0, "naive_wrong": 0,
                                              "naive_read_errors": 0, "kvfsm_wrong": 0,
                                              "kvfsm_saw": Counter()})
        if o["kind"] not in row["kinds"]:
            row["kinds"].append(o["kind"])
        row["faults"] += 1
        row["landed"] += o["landed"]
        row["naive_wrong"] += o["naive_wrong"]
        row["naive_read_errors"] += o["naive_read_error"]
        row["kvfsm_wrong"] += o["kvfsm_wrong"]
        row["kvfsm_saw"].update(o["kvfsm_saw"])
    for row in rows.values():
        row["kvfsm_saw"] = dict(sorted(row["kvfsm_saw"].items()))
    return list(rows.values())


def _lost_requests(results: Sequence[Result]) -> list[dict[str, Any]]:
    """The kvfsm requests that reused fewer tokens than were intact: what each lost and what
    its lookup and restores said (the first verdict's shortfalls, the restore steps that did
    not land)."""
    return [{"request": r.rid, "intact_tokens": _intact(r), "reused_tokens": r.reused_tokens,
             "lost_tokens": lost_tokens(r), "late_tokens": late_tokens(r),
             "usable_tokens": r.usable_tokens,
             "restorable_tokens": r.restorable_tokens, "reasons": sorted(set(r.reasons)),
             "restores_not_landed": dict(sorted(Counter(
                 f"{s.group} {s.tier} {s.outcome} {s.status}".strip()
                 for s in r.steps if s.outcome != "restored").items())),
             "events": list(r.events)}
            for r in results if _short(r)]


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
    outcomes = _fault_outcomes(run)
    return {
        "model": run.model_type,
        "groups": dict(run.groups),
        "pools": run.pools.figures(),
        "stored_tiers": list(run.tiers),
        "requests": faulted["requests"],
        "prompt_tokens": faulted["prompt_tokens"],
        "faults": len(run.workload.faults),
        "faults_landed": sum(map(_fault_landed, events)),
        "faults_by_kind": [{"kind": kind, "injector": injector, "count": count}
                           for (kind, injector), count in sorted(by_kind.items())],
        "faults_by_injector": _faults_by_injector(outcomes),
        "fault_outcomes": outcomes,
        **{key: faulted[key] for key in (
            "hit_rate", "usable_rate", "tokens_reused", "tokens_restored", "tokens_recomputed",
            "naive_tokens_reused", "naive_wrong", "naive_wrong_tokens", "naive_read_errors",
            "kvfsm_wrong", "max_logit_diff", "naive_max_logit_diff", "restores",
            "restores_by_tier", *_REUSE_KEYS, "modes")},
        "top_reasons": _reasons(run.runs[("faulted", "kvfsm")])[:TOP_REASONS],
        "lost_requests": _lost_requests(run.runs[("faulted", "kvfsm")]),
        "clean": {key: clean[key] for key in (
            "hit_rate", "usable_rate", "tokens_reused", "tokens_restored", "tokens_recomputed",
            "reuse_of_hit", "naive_tokens_reused", "naive_wrong", "kvfsm_wrong",
            "max_logit_diff", "restores", "restores_by_tier", *_REUSE_KEYS, "modes")},
        "clean_lost_requests": _lost_requests(run.runs[("clean", "kvfsm")]),
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
        "remote": demo.remote or "none",
        "remote_note": demo.remote_note,
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
        "intact_tokens": sum(m["intact_tokens"] for m in per),
        "lost_tokens": sum(m["lost_tokens"] for m in per),
        "late_tokens": sum(m["late_tokens"] for m in per),
        "lost_reuse": _ratio(sum(m["lost_tokens"] for m in per),
                             sum(m["intact_tokens"] for m in per)),
        "late_reuse": _ratio(sum(m["late_tokens"] for m in per),
                             sum(m["intact_tokens"] for m in per)),
        "clean_lost_reuse": _ratio(sum(m["clean"]["lost_tokens"] for m in per),
                                   sum(m["clean"]["intact_tokens"] for m in per)),
        "restores_by_tier": restores_by_tier(r for m in per for r in m["restores"]),
        "clean_restores_by_tier": restores_by_tier(r for m in per
                                                   for r in m["clean"]["restores"]),
        "faults": sum(m["faults"] for m in per),
        "faults_landed": sum(m["faults_landed"] for m in per),
        "bookkeeping_s": bookkeeping,
        "overhead_vs_naive": _ratio(bookkeeping, serving),
        "wall_s": demo.wall_s,
        "event_logs": {run: {"accepted": result.accepted, "moves": result.moves,
                             "blocks_moved": result.blocks_moved, "reads": result.reads,
                             "violation": None if result.violation is None
                             else str(result.violation)}
                       for run, result in demo.replays.items()},
        "event_logs_rejected": sum(not result.accepted for result in demo.replays.values()),
    }


# -- text ------------------------------------------------------------------------------------

def _outcomes_text(entry: Mapping[str, Any]) -> str:
    return ", ".join(f"{entry[o]} {o}" for o in OUTCOMES if entry.get(o))


def _restores_text(restores: Sequence[Mapping[str, Any]]) -> str:
    """Per (kind, tier): its outcomes, the failures' statuses in parentheses."""
    if not restores:
        return "none"
    by_source: dict[tuple[str, str], dict[str, Counter[str]]] = {}
    for r in restores:
        per = by_source.setdefault((r["kind"], r["tier"]), {})
        per.setdefault(r["outcome"], Counter())[r["status"]] += r["count"]
    parts = []
    for (kind, tier), per in by_source.items():
        said = []
        for outcome in [o for o in OUTCOMES if o in per] + [o for o in per if o not in OUTCOMES]:
            statuses = per[outcome]
            why = ", ".join(f"{status} {n}" if len(statuses) > 1 else status
                            for status, n in sorted(statuses.items())
                            if status and status != "OK")
            said.append(f"{sum(statuses.values())} {outcome}" + (f" ({why})" if why else ""))
        parts.append(f"{kind} from {tier}: {', '.join(said)}")
    return "; ".join(parts)


def _tiers_text(by_tier: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for tier, entry in by_tier.items():
        counts = _outcomes_text(entry)
        parts.append(f"{tier} {counts or 'none'}")
    return "; ".join(parts)


def _faults_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per injector: how often, what kvfsm saw on the faulted group, how often naive was
    wrong."""
    if not rows:
        return "none"
    return "; ".join(f"{row['injector']} x{row['faults']} ("
                     + (", ".join(row["kvfsm_saw"]) or "nothing") + f"; {row['naive_wrong']})"
                     for row in rows)


def _lost_text(lost: Sequence[Mapping[str, Any]]) -> str:
    """Per request that lost intact tokens: how many of how many, and the restores that did
    not land (what kept them from being reused)."""
    if not lost:
        return "none"
    return "; ".join(f"{r['request']} {r['lost_tokens'] or r['late_tokens']} of "
                     f"{r['intact_tokens']} {'late ' if r['late_tokens'] else ''}("
                     + (", ".join(f"{k} {n}" if n > 1 else k
                                  for k, n in r["restores_not_landed"].items())
                        or "no restore failed") + ")" for r in lost)


def _reasons_text(reasons: Sequence[Mapping[str, Any]]) -> str:
    if not reasons:
        return "none (every hit token was usable)"
    return ", ".join(f"{r['reason']} ({r['requests']} req)" for r in reasons)


def reuse_lines(m: Mapping[str, Any]) -> list[str]:
    """The side-by-side reuse of one model: per workload and mode, hit, usable now (before
    restores), reused after restores and lost (intact, not reused), in % of prompt tokens."""
    lines = [f"  {'% of prompt tokens':<22}{'hit rate':>10}{'usable rate now':>17}"
             f"{'reused after restores':>23}{'lost':>7}   lost_reuse (lost / intact tokens)"]
    for workload, figures in (("faulted", m), ("clean", m["clean"])):
        for mode in ("naive", "kvfsm"):
            f = figures["modes"][mode]
            beyond = (f"; {f['reused_beyond_intact']:,} reused tokens not intact"
                      if mode == "naive" and f["reused_beyond_intact"] else "")
            late = (f"; {f['late_tokens']:,} late (a store slower than the wait)"
                    if f["late_tokens"] else "")
            lines.append(f"    {workload + ', ' + mode:<20}{f['hit_rate']:>10.1%}"
                         f"{f['usable_rate']:>17.1%}{f['reused_rate']:>23.1%}"
                         f"{f['lost_rate']:>7.1%}   {f['lost_reuse']:.4f} ({f['lost_tokens']:,} / "
                         f"{f['intact_tokens']:,}){late}{beyond}")
    return lines


def model_lines(model_type: str, m: Mapping[str, Any]) -> list[str]:
    """The short report of one model."""
    clean = m["clean"]
    groups = ", ".join(f"{name} ({kind})" for name, kind in m["groups"].items())
    return [
        f"{pretty(model_type)} [{groups}]",
        f"  {m['requests']} requests, {m['prompt_tokens']:,} prompt tokens, "
        f"{m['faults']} faults injected ({m['faults_landed']} landed on cached blocks)",
        *reuse_lines(m),
        f"  kvfsm tokens: {m['tokens_reused']:,} reused, {m['tokens_restored']:,} restored, "
        f"{m['tokens_recomputed']:,} recomputed (naive reused {m['naive_tokens_reused']:,})",
        f"  wrong outputs vs nocache: naive {m['naive_wrong']}/{m['requests']} "
        f"({m['naive_wrong_tokens']} with other greedy tokens; {m['naive_read_errors']} "
        f"recomputed after a read error), kvfsm {m['kvfsm_wrong']}/{m['requests']}; max "
        f"|dlogit| naive {m['naive_max_logit_diff']:.2e}, kvfsm {m['max_logit_diff']:.2e}",
        f"  restores by tier (stored tiers: {', '.join(m['stored_tiers']) or 'none'}): "
        f"{_tiers_text(m['restores_by_tier'])}",
        f"  restores: {_restores_text(m['restores'])}",
        f"  why hit tokens were not usable: {_reasons_text(m['top_reasons'])}",
        f"  intact tokens kvfsm did not reuse (faulted): {_lost_text(m['lost_requests'])}",
        f"  faults (what kvfsm saw; naive wrong): {_faults_text(m['faults_by_injector'])}",
        f"  without faults: kvfsm reused {clean['reuse_of_hit']:.0%} of the hit after restores "
        f"({clean['tokens_reused'] + clean['tokens_restored']:,} tokens; naive "
        f"{clean['naive_tokens_reused']:,}), wrong: kvfsm {clean['kvfsm_wrong']}, "
        f"naive {clean['naive_wrong']}; restores by tier: "
        f"{_tiers_text(clean['restores_by_tier'])}",
        f"  bookkeeping {m['bookkeeping_s']:.2f} s = {m['overhead_vs_naive']:.1%} of kvfsm "
        f"serving wall {m['serve_wall_s']['kvfsm']:.1f} s; model total {m['wall_s']:.1f} s",
    ]


def replay_text(figures: Mapping[str, Any]) -> str | None:
    """What replaying the kvfsm runs' event logs found (None: none logged)."""
    logs = figures.get("event_logs") or {}
    if not logs:
        return None
    moved = sum(entry["blocks_moved"] for entry in logs.values())
    rejected = {run: entry["violation"] for run, entry in logs.items() if not entry["accepted"]}
    if not rejected:
        return (f"{len(logs)} kvfsm runs replayed through the lifecycle tables, all accepted "
                f"({moved:,} block transitions)")
    return (f"{len(rejected)} of {len(logs)} kvfsm runs REJECTED by replay: "
            + "; ".join(f"{run}: {why}" for run, why in rejected.items()))


def summary_lines(figures: Mapping[str, Any]) -> list[str]:
    """The short report printed per model, then the models not served and the totals."""
    lines = []
    for model_type, m in figures["models"].items():
        lines += model_lines(model_type, m)
    for model_type, why in figures["skipped"].items():
        lines.append(f"{pretty(model_type)}: not served yet ({why})")
    lines.append(figures["remote_note"])
    replayed = replay_text(figures)
    if replayed is not None:
        lines.append(f"event logs: {replayed}")
    lines.append(
        f"total: {figures['requests']} requests, hit rate {figures['hit_rate']:.1%}, usable "
        f"rate now {figures['usable_rate']:.1%}; kvfsm lost_reuse {figures['lost_reuse']:.4f} "
        f"faulted, {figures['clean_lost_reuse']:.4f} clean; wrong outputs naive "
        f"{figures['naive_wrong']}, kvfsm "
        f"{figures['kvfsm_wrong']}; max |dlogit| kvfsm {figures['max_logit_diff']:.2e}; "
        f"restores by tier {_tiers_text(figures['restores_by_tier'])}; overhead "
        f"{figures['overhead_vs_naive']:.1%}; {figures['wall_s']:.0f} s")
    return lines


def _steps_text(result: Result) -> str:
    """A request's restore steps, e.g. ``host 4, disk 1 lost CORRUPT``."""
    counts: Counter[tuple[str, str, str]] = Counter(
        (step.tier, step.outcome, step.status) for step in result.steps)
    return ", ".join(f"{tier} {n}" + ("" if outcome == "restored" else
                                      f" {outcome} {status}".rstrip())
                     for (tier, outcome, status), n in counts.items())


def _per_request_table(run: ModelRun) -> list[str]:
    reference = run.runs[("reference", "nocache")]
    naive = run.runs[("faulted", "naive")]
    kvfsm = run.runs[("faulted", "kvfsm")]
    lines = ["| request | prompt | hit | usable | intact | reused | restored | recomputed | lost | "
             "restores (tier, outcome) | naive \\|Δlogit\\| | kvfsm \\|Δlogit\\| | fault before "
             "it |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|---|"]
    for ref, n, k in zip(reference, naive, kvfsm, strict=True):
        direct, restored, recomputed = _sources(k)
        mark = " ✗" if is_wrong(n, ref) else " (read error)" if n.read_error else ""
        fault = "; ".join(k.events).replace("|", "\\|") or ""
        lines.append(f"| {k.rid} | {k.prompt_tokens} | {k.hit_tokens} | {k.usable_tokens} | "
                     f"{_intact(k)} | {direct} | {restored} | {recomputed} | {lost_tokens(k)} | "
                     f"{_steps_text(k)} | "
                     f"{logit_diff(n, ref):.1e}{mark} | {logit_diff(k, ref):.1e} | {fault} |")
    return lines


def _restores_table(figures: Mapping[str, Any]) -> list[str]:
    """Restore steps per model and tier (faulted workload), outcomes and load statuses."""
    lines = ["| model | tier | restored | failed | lost | pending | load statuses |",
             "|---|---|--:|--:|--:|--:|---|"]
    rows = [(pretty(t), m["restores_by_tier"]) for t, m in figures["models"].items()]
    rows.append(("**total**", figures["restores_by_tier"]))
    for name, by_tier in rows:
        for tier, entry in by_tier.items():
            statuses = ", ".join(f"{k} {v}" for k, v in entry["statuses"].items()) or "-"
            lines.append(f"| {name} | {tier} | " + " | ".join(str(entry[o]) for o in OUTCOMES)
                         + f" | {statuses} |")
    return lines


def _faults_table(m: Mapping[str, Any]) -> list[str]:
    """Per injector: how often it landed, what kvfsm saw, and who went wrong."""
    lines = ["| fault | on | landed | kvfsm saw (hit shortfalls; restore failures) | "
             "naive wrong | naive read error | kvfsm wrong |",
             "|---|---|--:|---|--:|--:|--:|"]
    for row in m["faults_by_injector"]:
        saw = ", ".join(f"{k} {v}" if v > 1 else k for k, v in row["kvfsm_saw"].items()) or "-"
        lines.append(f"| {row['injector']} | {', '.join(row['kinds'])} | "
                     f"{row['landed']}/{row['faults']} | {saw} | {row['naive_wrong']} | "
                     f"{row['naive_read_errors']} | {row['kvfsm_wrong']} |")
    return lines


def report_markdown(demo: DemoRun, figures: Mapping[str, Any], *, command: str = "kvfsm demo",
                    image_prefix: str = "") -> str:
    """report.md: the totals, then per model its figures, plots and per-request table."""
    out = [
        "# kvfsm demo: a prefix hit is not a usable cache",
        "",
        f"Generated by `{command}`: tiny real transformers models (seeded random weights, CPU), "
        "each served three ways on one seeded workload (multi-turn chat over a shared system "
        "prompt, then many questions over a few long documents, then every user's last chat "
        "turn; prompt lengths odd, never a multiple of a block size) with faults injected "
        "before some requests:",
        "",
        "* **nocache**: every prompt recomputed; the reference tokens and logits.",
        "* **naive**: reuses the prefix *hit*, reading whatever bytes the hit blocks hold (a "
        "disk file or remote value read raw: header and checksum never looked at).",
        "* **kvfsm**: reuses what the verdict says is *usable* (FULL verification), after "
        "restoring what its plan can (host copies at once; disk and remote copies loaded and "
        "verified on worker threads).",
        "",
        f"Stored tiers: every engine spills device -> host -> disk (its own temporary "
        f"directory) -> remote. {figures['remote_note']}.",
        "",
        "A request's output is *wrong* when its greedy tokens differ from nocache's or its "
        f"first-step logits differ by more than {LOGIT_TOLERANCE:g}. A hit-only engine never "
        "learns that a block is damaged, so one fault keeps spoiling every later request that "
        "reuses the block; kvfsm sees it on the first lookup (a failed checksum, a state that "
        "is not readable) or when the copy loads (its header or checksum fails: `CORRUPT`, "
        "another block's value: `FOREIGN`, gone: `MISSING`), drops or restores it, and "
        "recomputes what it cannot restore. A restore is *lost* when its copy was bad or gone "
        "(the block is forgotten and recomputed), *failed* when it was rolled back with the "
        "copy kept, *pending* when its load outlived the wait (recomputed this time, usable "
        "once it lands).",
        "",
        "Reuse side by side, in % of the prompt tokens: the prefix *hit*; what the first "
        "verdict called *usable now*, before any restore; what was *reused after restores* "
        "(taken from the cache instead of computed); and what was *lost*: intact tokens not "
        "reused, where a request's *intact tokens* are the longest prefix whose every needed "
        "block had an intact copy somewhere (device, host, disk file or remote value, its bytes "
        "matching the checksum recorded for them) just before its lookup, found by an oracle "
        "that does not ask the verdict. *lost_reuse* is the lost tokens over the intact tokens "
        "(0 to 1). Tokens a request did not reuse because a load was still running when its "
        "restore wait ended (a store answering after the request's budget: it recomputes rather "
        "than waits, and the copy lands for later requests) are counted apart as *late*. A "
        "hit-only engine may reuse more than is intact: those are the damaged bytes behind its "
        "wrong outputs.",
        "",
        "| model | workload | engine | hit rate | usable rate now | reused after restores | "
        "lost | lost_reuse | late tokens | intact tokens | reused tokens |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for model_type, m in figures["models"].items():
        for workload, per in (("faulted", m), ("clean", m["clean"])):
            for mode in ("naive", "kvfsm"):
                f = per["modes"][mode]
                out.append(f"| {pretty(model_type)} | {workload} | {mode} | {f['hit_rate']:.1%} | "
                           f"{f['usable_rate']:.1%} | {f['reused_rate']:.1%} | "
                           f"{f['lost_rate']:.1%} | {f['lost_reuse']:.4f} | "
                           f"{f['late_tokens']:,} | {f['intact_tokens']:,} | "
                           f"{f['reused_tokens']:,} |")
    out += [
        "",
        "| model | requests | hit rate | usable rate now | reused | restored | recomputed | "
        "lost_reuse | naive wrong | kvfsm wrong | max \\|Δlogit\\| kvfsm | overhead |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for model_type, m in figures["models"].items():
        out.append(f"| {pretty(model_type)} | {m['requests']} | {m['hit_rate']:.1%} | "
                   f"{m['usable_rate']:.1%} | {m['tokens_reused']:,} | {m['tokens_restored']:,} | "
                   f"{m['tokens_recomputed']:,} | {m['lost_reuse']:.4f} | {m['naive_wrong']} | "
                   f"{m['kvfsm_wrong']} | {m['max_logit_diff']:.1e} | "
                   f"{m['overhead_vs_naive']:.1%} |")
    out.append(f"| **total** | {figures['requests']} | {figures['hit_rate']:.1%} | "
               f"{figures['usable_rate']:.1%} | {figures['tokens_reused']:,} | "
               f"{figures['tokens_restored']:,} | {figures['tokens_recomputed']:,} | "
               f"{figures['lost_reuse']:.4f} | {figures['naive_wrong']} | "
               f"{figures['kvfsm_wrong']} | {figures['max_logit_diff']:.1e} | "
               f"{figures['overhead_vs_naive']:.1%} |")
    out += ["", f"Wall time of the whole demo: {figures['wall_s']:.0f} s. *Overhead* is kvfsm's "
            "bookkeeping (lookups, restores and the waits for their loads, commits and the "
            "spills they cause; not the forwards nor the adapter's tensor copies) over the "
            "kvfsm runs' serving wall time.", ""]
    replayed = replay_text(figures)
    if replayed is not None:
        out += ["Every kvfsm run logged each block transition (`events/*.jsonl`) and the demo "
                "re-fired each log through the lifecycle tables, as `kvfsm replay` does: "
                f"{replayed}.", ""]
    if figures["skipped"]:
        out += ["Not served yet: " + "; ".join(f"{pretty(t)} ({why})"
                                              for t, why in figures["skipped"].items()), ""]
    out += [f"![hit, usable now, reused after restores and lost, naive and kvfsm, per model]"
            f"({image_prefix}overview.png)", "",
            "Restores of the faulted workload by tier the copy came from (kvfsm runs):", "",
            *_restores_table(figures), ""]
    runs = {run.model_type: run for run in demo.models}
    for model_type, m in figures["models"].items():
        run = runs[model_type]
        pools = m["pools"]
        out += [f"## {pretty(model_type)}", "", "```", *model_lines(model_type, m), "```", "",
            f"Pools per group: {pools['device_blocks']} device, {pools['host_blocks']} host, "
            f"{pools['disk_blocks']} disk and {pools['remote_blocks']} remote blocks (stored "
            f"tiers: {', '.join(m['stored_tiers']) or 'none'}; a group whose lifecycle stops "
            "above a tier keeps nothing there).", "",
            "Faults (faulted workload, the same schedule for naive and kvfsm):", "",
            *_faults_table(m), "",
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
    kvfsm found usable now, what kvfsm reused after its restores, and its intact tokens (a
    black tick: what it could have reused); the faulted workload above, the clean one below."""
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
        ax.plot(x + 0.27, [_intact(r) for r in kvfsm], "_", color="black", ms=9, mew=1.5,
                label="intact (could have been reused)")
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
        ax.legend(fontsize=7, loc="upper left", ncols=6)
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


#: Colours of the restore outcomes in the plots.
_OUTCOME_COLORS: Final = {"restored": "#2ca02c", "failed": "#ff7f0e", "lost": "#d62728",
                          "pending": "#7f7f7f"}


#: The side-by-side reuse figures the overview plots per engine: (key, label, shade, hatch).
_REUSE_BARS: Final = (("hit_rate", "hit", 0.35, ""), ("usable_rate", "usable now", 0.6, ""),
                      ("reused_rate", "reused after restores", 0.85, ""),
                      ("lost_rate", "lost", 0.0, "////"))  # white, hatched in colour
#: Each engine's colour in the overview (naive red, kvfsm green).
_ENGINE_COLORS: Final = {"naive": (0.84, 0.15, 0.16), "kvfsm": (0.17, 0.63, 0.17)}


def _shade(color: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    """``color`` mixed with white: ``amount`` 1 is the colour itself, 0 white."""
    r, g, b = color
    return (1 - amount * (1 - r), 1 - amount * (1 - g), 1 - amount * (1 - b))


def _plot_reuse(ax: Any, per: Sequence[Mapping[str, Any]], names: Sequence[str],
                workload: str) -> None:
    """Per model, naive and kvfsm side by side: hit, usable now, reused after restores and
    lost, in % of prompt tokens (``workload``: ``faulted`` or ``clean``)."""
    bars = len(_REUSE_BARS) * len(_ENGINE_COLORS)
    width = 0.9 / bars
    for e, (mode, color) in enumerate(_ENGINE_COLORS.items()):
        for b, (key, label, amount, hatch) in enumerate(_REUSE_BARS):
            offset = (e * len(_REUSE_BARS) + b - (bars - 1) / 2) * width
            values = [100 * (m if workload == "faulted" else m["clean"])["modes"][mode][key]
                      for m in per]
            drawn = ax.bar(np.arange(len(per)) + offset, values, width * 0.95,
                           color=_shade(color, amount), edgecolor=color, lw=0.5,
                           hatch=hatch, label=f"{mode}: {label}")
            ax.bar_label(drawn, fmt="%.0f", fontsize=6)
    ax.set_xticks(np.arange(len(per)), names)
    ax.set_ylim(0, 125)
    ax.set_ylabel("% of prompt tokens")
    ax.set_title(f"{workload} workload: hit, usable now, reused after restores, lost "
                 "(intact, not reused)", fontsize=10)
    ax.legend(fontsize=6.5, ncols=2, loc="upper left")


def plot_overview(figures: Mapping[str, Any], path: Path) -> None:
    """Per model: naive and kvfsm side by side (hit, usable now before restores, reused after
    restores, lost) on the faulted and the clean workload; wrong outputs of naive vs kvfsm; and
    the faulted kvfsm run's restore steps per tier by outcome."""
    from matplotlib.figure import Figure

    models = list(figures["models"])
    per = [figures["models"][t] for t in models]
    fig = Figure(figsize=(15, 7.6), dpi=100, layout="constrained")
    (faulted, clean), (right, tiers) = fig.subplots(2, 2, width_ratios=[1, 1])
    x = np.arange(len(models))
    names = [pretty(t) for t in models]
    _plot_reuse(faulted, per, names, "faulted")
    _plot_reuse(clean, per, names, "clean")
    for offset, key, color in ((-0.2, "naive_wrong", "#d62728"), (0.2, "kvfsm_wrong", "#2ca02c")):
        bars = right.bar(x + offset, [m[key] for m in per], 0.4, color=color,
                         label=key.split("_")[0])
        right.bar_label(bars, fontsize=8)
    right.set_xticks(x, names)
    right.set_ylim(0, 1.2 * max([m["naive_wrong"] for m in per] + [1]))
    right.set_ylabel("requests")
    right.set_title("wrong outputs vs recomputing (faulted workload)", fontsize=10)
    right.legend(fontsize=7)
    _plot_restores_by_tier(tiers, per, names)
    fig.savefig(path)


def _plot_restores_by_tier(ax: Any, per: Sequence[Mapping[str, Any]], names: Sequence[str]
                           ) -> None:
    """Per model, one bar per tier (host, disk, remote), stacked by restore outcome."""
    width = 0.26
    top = 1
    for i, m in enumerate(per):
        for j, tier in enumerate(TIERS):
            entry = m["restores_by_tier"].get(tier, {})
            bottom = 0
            for outcome in OUTCOMES:
                value = entry.get(outcome, 0)
                if value:
                    ax.bar(i + (j - 1) * width, value, width * 0.92, bottom=bottom,
                           color=_OUTCOME_COLORS[outcome])
                bottom += value
            top = max(top, bottom)
            ax.text(i + (j - 1) * width, bottom, tier, ha="center", va="bottom", fontsize=7,
                    rotation=90)
    for outcome in OUTCOMES:
        ax.bar([0], [0], color=_OUTCOME_COLORS[outcome], label=outcome)
    ax.set_xticks(np.arange(len(per)), names)
    ax.set_ylim(0, 1.35 * top)
    ax.set_ylabel("restore steps")
    ax.set_title("kvfsm restores by tier, faulted (host, disk, remote)", fontsize=10)
    ax.legend(fontsize=7, ncols=4, loc="upper left")


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
        "intact": counter("kvfsm_intact_tokens", "Prompt tokens whose every needed block had "
                          "an intact copy somewhere just before the lookup (the oracle)."),
        "lost": counter("kvfsm_lost_tokens", "Intact prompt tokens not reused."),
        "wrong": counter("kvfsm_wrong_outputs", "Requests whose greedy tokens or first "
                         "logits differ from recomputing everything."),
        "bookkeeping": counter("kvfsm_bookkeeping_seconds", "Time in lookups, plan "
                               "execution and commits (no forwards, no tensor copies)."),
        "serve": counter("kvfsm_serve_seconds", "Wall time serving requests."),
    }
    restores = counter("kvfsm_restores", "Restore plan steps by group kind, source tier "
                       "(host, disk, remote), outcome (restored, failed, lost, pending) and "
                       "load status.", ["model", "workload", "kind", "tier", "outcome",
                                        "status"])
    read_errors = counter("kvfsm_read_errors", "Requests a hit-only engine recomputed because "
                          "a hit block's stored value was not there.")
    shortfalls = counter("kvfsm_shortfalls", "Shortfalls in first verdicts by reason.",
                         ["model", "workload", "mode", "reason"])
    faults = counter("kvfsm_faults_injected", "Faults injected by group kind and injector "
                     "(stored-tier ones: flip_disk_byte, truncate_disk_file, delete_disk_file, "
                     "evict_remote_value, plant_foreign_value, slow_remote).",
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
                "intact": sum(map(_intact, results)),
                "lost": sum(map(lost_tokens, results)),
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
            if mode == "naive":
                read_errors.add_metric(labels, sum(bool(r.read_error) for r in results))
            if mode == "kvfsm":
                for r in _restores(results):
                    restores.add_metric([model, workload, r["kind"], r["tier"], r["outcome"],
                                         r["status"] or "none"], r["count"])
        for (kind, injector), count in sorted(Counter(
                (f.kind, f.injector) for f in run.workload.faults).items()):
            faults.add_metric([model, kind, injector], count)
        wall.add_metric([model], run.wall_s)
    yield from families.values()
    yield from (restores, read_errors, shortfalls, faults, logit, wall)


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
    if demo.engine_metrics is not None:  # what the kvfsm engines themselves counted
        data += demo.engine_metrics.exposition()
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
