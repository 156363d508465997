"""The serving demo: seeded workloads and fault schedules, the figures it reports and the files
it writes, on a quick run of every model kvfsm.serve serves."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfsm import KvfsmError
from kvfsm.cli import main
from kvfsm.serve import DemoSettings, declare, tiny_config
from kvfsm.serve import _workload as workload
from kvfsm.spec import GroupKind

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("prometheus_client")
pytest.importorskip("tqdm")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL_TYPES = ("deepseek_v4", "qwen3_next", "gpt_oss")
KEYS = ("requests", "hit_rate", "usable_rate", "naive_wrong", "kvfsm_wrong", "max_logit_diff",
        "tokens_reused", "tokens_recomputed", "wall_s", "overhead_vs_naive")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``kvfsm demo --quick --json`` once: its folder and its JSON. The folder holds an
    earlier run's outputs first (a model this run does not serve among them): they go, a
    file of the user's stays."""
    out = tmp_path_factory.mktemp("demo")
    (out / "events").mkdir()
    stale = [out / "events" / "llama-faulted.jsonl", out / "llama_token_sources.png",
             out / "report.md"]
    for path in stale:
        path.write_text("from an earlier run")
    (out / "notes.txt").write_text("the user's")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["demo", "--quick", "--json", "-q", "-o", str(out)])
    assert code == 0
    assert not any(path.exists() for path in stale[:2])
    assert stale[2].read_text() != "from an earlier run"
    assert (out / "notes.txt").read_text() == "the user's"
    return out, json.loads(stdout.getvalue())


def served() -> list[str]:
    from kvfsm.serve._demo import served_models

    return served_models()[0]


# -- workloads (no model) --------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("seed", -1), ("seed", "7"), ("seed", True), ("models", "gpt_oss"),
    ("models", ["gpt_oss"]), ("remote", "s3"),
])
def test_demo_settings_name_a_bad_field(field: str, value: object) -> None:
    """A seed NumPy would refuse only once the workload is drawn, a model list given as one
    string (read as its letters), an unknown remote store: refused when the settings are
    made, naming the field."""
    with pytest.raises(KvfsmError, match=f"DemoSettings.{field}"):
        DemoSettings(**{field: value})  # type: ignore[arg-type]


def test_the_demo_refuses_a_negative_seed_before_it_writes_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["demo", "--quick", "--seed", "-1", "-o", str(out)]) == 2
    assert "DemoSettings.seed must be an int >= 0" in capsys.readouterr().err
    assert not out.exists()  # no folder, no diagrams


def test_workloads_are_seeded_odd_and_share_prefixes() -> None:
    chat = workload.chat(3, users=3, turns=3)
    assert chat == workload.chat(3, users=3, turns=3)
    assert chat != workload.chat(4, users=3, turns=3)
    assert all(len(r.tokens) % 2 == 1 for r in chat)  # never a multiple of a block size
    system = chat[0].tokens[:96]
    assert all(r.tokens[:96] == system for r in chat)
    by_id = {r.rid: r.tokens for r in chat}
    for user in range(3):  # each turn extends the user's previous prompt
        assert by_id[f"u{user}t1"][: len(by_id[f"u{user}t0"])] == by_id[f"u{user}t0"]
    qa = workload.document_qa(3, documents=2, questions=3)
    assert all(len(r.tokens) % 2 == 1 for r in qa)
    assert [r.rid for r in qa[:2]] == ["d0q0", "d1q0"]  # each document read cold first
    assert len(workload.reusing(qa, 32)) == 4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fault_schedule_covers_every_group_kind(model_type: str) -> None:
    model = declare(tiny_config(model_type))
    work = workload.demo_workload(model, seed=0)
    kinds = {decl.kind.value for decl in model.groups}
    assert {fault.kind for fault in work.faults} == kinds
    assert {fault.group for fault in work.faults} == {decl.name for decl in model.groups}
    assert any(fault.damages for fault in work.faults)
    reusing = set(workload.reusing(work.requests, 2 * model.lcm_block_size))
    assert {fault.before for fault in work.faults} <= reusing
    assert workload.demo_workload(model, seed=0) == work


def test_fault_pairs_put_damage_first() -> None:
    pairs = workload.fault_pairs(declare(tiny_config("gpt_oss")))
    assert [(name, spec.name) for name, _kind, spec in pairs[:2]] == [
        ("full", "corrupt_host_copy"), ("sliding", "flip_device_bytes")]
    assert all(spec.damages for _name, _kind, spec in pairs[:4])
    assert {kind for _name, kind, _spec in pairs} == {GroupKind.FULL, GroupKind.SLIDING_WINDOW}


STORED = {"flip_disk_byte", "truncate_disk_file", "delete_disk_file", "evict_remote_value",
          "plant_foreign_value", "slow_remote"}
REMOTE_ONLY = {"evict_remote_value", "plant_foreign_value", "slow_remote"}


def test_fault_pairs_include_the_stored_tiers_the_engines_have() -> None:
    from kvfsm.spec import Tier

    full = {spec.name for _n, _k, spec in workload.fault_pairs(declare(tiny_config("gpt_oss")))}
    assert full >= STORED  # the full group reaches disk and remote
    disk_only = {spec.name for _n, _k, spec in workload.fault_pairs(
        declare(tiny_config("gpt_oss")), (Tier.DISK,))}
    assert disk_only >= STORED - REMOTE_ONLY and not disk_only & REMOTE_ONLY
    deepseek = workload.fault_pairs(declare(tiny_config("deepseek_v4")))
    assert {spec.name for _n, _k, spec in deepseek} & STORED == STORED - REMOTE_ONLY
    # groups of one kind start at different injectors
    firsts = {name: spec.name for name, kind, spec in deepseek[:5]}
    assert firsts["csa"] != firsts["csa_index"] != firsts["hca"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_default_schedule_has_stored_tier_faults(model_type: str) -> None:
    model = declare(tiny_config(model_type))
    names = {fault.injector for fault in workload.demo_workload(model, seed=0).faults}
    assert {"flip_disk_byte", "truncate_disk_file"} <= names, names
    if any(decl.kind is GroupKind.FULL for decl in model.groups):
        assert REMOTE_ONLY | {"delete_disk_file"} <= names, names


# -- the serving loop's new result fields ----------------------------------------------------

def test_results_carry_reasons_steps_and_bookkeeping(model: Any, config: Any) -> None:
    from kvfsm import Engine
    from kvfsm.serve import Request, serve
    from kvfsm.state import CoreConfig

    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 1000, 101)]
    requests = [Request("a", tokens, 2), Request("b", [*tokens, 7, 8], 2)]
    hook = workload.FaultHook([workload.Fault("b", "full", "full", "corrupt_host_copy", True)])
    engine = Engine(declare(config), CoreConfig(device_blocks=16, host_blocks=8,
                                                backend="numpy"))
    first, second = serve(model, engine, requests, "kvfsm", level="full", hook=hook)
    assert "corrupt_host_copy" in second.events[0] and "flipped" in second.events[0]
    assert ("full", "full", "host", "lost", "CORRUPT") in second.steps
    assert "not_resident" in second.reasons and "not_resident" in second.hit_reasons
    assert second.usable_tokens < second.hit_tokens
    assert first.steps == () and "not_cached" in first.reasons and first.hit_reasons == ()
    for result in (first, second):
        assert 0 < result.bookkeeping_s < result.wall_s
    (plain,) = serve(model, None, requests[:1], "nocache")
    assert (plain.reasons, plain.steps, plain.bookkeeping_s) == ((), (), 0.0)


# -- the quick demo --------------------------------------------------------------------------

def test_quick_demo_json_has_the_figures(quick: tuple[Path, dict[str, Any]]) -> None:
    _out, figures = quick
    for key in KEYS:
        assert key in figures, key
    assert list(figures["models"]) == served()  # DeepSeek-V4 first, once served
    for model_type, m in figures["models"].items():
        for key in KEYS:
            assert key in m, (model_type, key)
        assert m["tokens_reused"] + m["tokens_restored"] + m["tokens_recomputed"] == \
            m["prompt_tokens"]
    assert figures["requests"] == sum(m["requests"] for m in figures["models"].values())
    assert figures["kvfsm_wrong"] == 0 < figures["naive_wrong"]
    assert 0 < figures["overhead_vs_naive"] < 1 and figures["wall_s"] > 0
    assert figures["remote"] in ("mooncake", "redis", "none") and figures["remote_note"]


def test_quick_demo_restores_from_disk_and_remote(quick: tuple[Path, dict[str, Any]]) -> None:
    """Memory pressure alone (the clean workload) spills down every tier and later prompts
    restore from each; the faulted workload too."""
    _out, figures = quick
    remote = figures["remote"] != "none"
    for key in ("restores_by_tier", "clean_restores_by_tier"):
        by_tier = figures[key]
        assert by_tier["host"]["restored"] > 0 and by_tier["disk"]["restored"] > 0, key
        assert (by_tier["remote"]["restored"] > 0) == remote, key
    for model_type, m in figures["models"].items():
        assert "disk" in m["stored_tiers"], model_type
        assert m["clean"]["restores_by_tier"]["disk"]["restored"] > 0, model_type
        if remote and "full" in m["groups"].values():
            assert "remote" in m["stored_tiers"], model_type
            assert m["clean"]["restores_by_tier"]["remote"]["restored"] > 0, model_type
        for r in m["restores"]:
            assert r["outcome"] in ("restored", "failed", "lost", "pending"), r
            assert (r["status"] == "OK") == (r["outcome"] == "restored"), r


def test_quick_demo_stored_tier_faults_fool_only_naive(
        quick: tuple[Path, dict[str, Any]]) -> None:
    """The schedule has stored-tier faults; every one landed, kvfsm saw each (a copy that did
    not verify) and was never wrong, while naive was wrong after some of them."""
    _out, figures = quick
    outcomes = [o for m in figures["models"].values() for o in m["fault_outcomes"]
                if o["injector"] in STORED]
    assert {o["injector"] for o in outcomes} >= {"flip_disk_byte"} | (
        {"plant_foreign_value"} if figures["remote"] != "none" else set())
    for o in outcomes:
        assert o["landed"] and not o["kvfsm_wrong"], o
        assert any(status in saw for saw in o["kvfsm_saw"]
                   for status in ("CORRUPT", "FOREIGN", "MISSING", "pending")), o
    assert any(o["naive_wrong"] for o in outcomes)
    statuses = {s for m in figures["models"].values()
                for s in m["restores_by_tier"]["disk"]["statuses"]}
    assert "CORRUPT" in statuses


def test_kvfsm_is_never_wrong_and_naive_is(quick: tuple[Path, dict[str, Any]]) -> None:
    _out, figures = quick
    for model_type, m in figures["models"].items():
        assert m["kvfsm_wrong"] == 0, model_type
        assert m["max_logit_diff"] <= 1e-4, model_type
        assert m["naive_wrong"] > 0, model_type
        assert m["usable_rate"] < m["hit_rate"], model_type
        assert m["faults_landed"] > 0, model_type
        clean = m["clean"]  # not merely conservative: every hit token reused, as naive does
        assert clean["kvfsm_wrong"] == clean["naive_wrong"] == 0, model_type
        assert clean["reuse_of_hit"] == 1.0, model_type
        assert clean["tokens_reused"] + clean["tokens_restored"] == \
            clean["naive_tokens_reused"], model_type


def test_quick_demo_lost_reuse(quick: tuple[Path, dict[str, Any]]) -> None:
    """Lost reuse (intact tokens, by the oracle, not reused): none without faults, where kvfsm
    reuses every intact token; a fraction in [0, 1] with faults, every lost request listed.
    kvfsm never reuses a token past the intact length here (each engine has its own stored
    values), while naive reuses damaged bytes past it."""
    _out, figures = quick
    assert figures["clean_lost_reuse"] == 0
    assert 0 <= figures["lost_reuse"] <= 1
    for model_type, m in figures["models"].items():
        clean = m["clean"]
        assert clean["lost_reuse"] == clean["lost_tokens"] == 0, model_type
        assert clean["intact_tokens"] == clean["reused_tokens"] > 0, model_type
        assert m["clean_lost_requests"] == [], model_type
        assert 0 <= m["lost_reuse"] <= 1, model_type
        assert m["lost_tokens"] == sum(r["lost_tokens"] for r in m["lost_requests"])
        assert m["lost_reuse"] == pytest.approx(m["lost_tokens"] / m["intact_tokens"])
        assert m["reused_beyond_intact"] == 0, model_type
        assert m["modes"]["naive"]["reused_beyond_intact"] > 0, model_type
        for r in m["lost_requests"]:
            assert 0 < r["lost_tokens"] == r["intact_tokens"] - r["reused_tokens"], r
        print(f"\n{model_type}: lost_reuse faulted {m['lost_reuse']:.4f} "
              f"({m['lost_tokens']} of {m['intact_tokens']} intact tokens), clean "
              f"{clean['lost_reuse']:.4f}")


def test_quick_demo_headline_shows_reuse_after_restores(
        quick: tuple[Path, dict[str, Any]]) -> None:
    """The headline puts naive and kvfsm side by side: hit, usable now (before restores),
    reused after restores and lost. Without faults kvfsm's usable-now understates what it
    reuses: after its restores it reuses the whole hit, as naive does."""
    out, figures = quick
    for model_type, m in figures["models"].items():
        for per in (m, m["clean"]):
            for mode in ("naive", "kvfsm"):
                f = per["modes"][mode]
                assert {"hit_rate", "usable_rate", "reused_rate", "lost_rate",
                        "lost_reuse"} <= set(f), (model_type, mode)
        kvfsm, naive = m["clean"]["modes"]["kvfsm"], m["clean"]["modes"]["naive"]
        assert kvfsm["usable_rate"] < kvfsm["reused_rate"] == kvfsm["hit_rate"], model_type
        assert kvfsm["reused_tokens"] == naive["reused_tokens"], model_type
        assert m["modes"]["kvfsm"]["hit_rate"] == m["hit_rate"], model_type
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| model | workload | engine | hit rate | usable rate now | reused after restores |" \
        in report
    assert "reused after restores" in report and "lost_reuse" in report
    assert "intact tokens kvfsm did not reuse (faulted): " in report


def test_quick_demo_writes_report_plots_and_diagrams(
        quick: tuple[Path, dict[str, Any]]) -> None:
    out, figures = quick
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# kvfsm demo")
    assert "kvfsm demo --quick" in report
    names = ["overview.png"] + [f"{t}_{plot}.png" for t in figures["models"]
                                for plot in ("hit_vs_usable", "token_sources")]
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name})" in report, name
    assert sorted(p.stem for p in out.glob("*.mmd")) == [
        "compressed", "full_kv", "recurrent", "sliding_window", "sparse_index"]
    assert json.loads((out / "report.json").read_text())["kvfsm_wrong"] == 0


def test_quick_demo_metrics_parse(quick: tuple[Path, dict[str, Any]]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    out, figures = quick
    families = {f.name: f for f in text_string_to_metric_families(
        (out / "metrics.prom").read_text(encoding="utf-8"))}
    for name in ("kvfsm_lookups", "kvfsm_hit_tokens", "kvfsm_usable_tokens",
                 "kvfsm_restores", "kvfsm_shortfalls", "kvfsm_bookkeeping_seconds"):
        assert families[name].type == "counter", name
        assert all(s.name == f"{name}_total" for s in families[name].samples), name
    assert families["kvfsm_max_logit_diff"].type == "gauge"
    # The kvfsm-mode engines' own metrics, beside the demo's figures.
    for name in ("kvfsm_engine_lookups", "kvfsm_engine_hit_tokens", "kvfsm_engine_restores",
                 "kvfsm_engine_transitions", "kvfsm_engine_shortfalls"):
        assert families[name].type == "counter", name
    assert families["kvfsm_engine_restore_duration_seconds"].type == "histogram"

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if all(s.labels.get(k) == v for k, v in labels.items()))

    for model_type, m in figures["models"].items():
        run = {"model": model_type, "workload": "faulted", "mode": "kvfsm"}
        prompt = value("kvfsm_prompt_tokens", **run)
        assert prompt == m["prompt_tokens"]
        assert value("kvfsm_hit_tokens", **run) / prompt == pytest.approx(m["hit_rate"],
                                                                         rel=1e-5)
        assert value("kvfsm_usable_tokens", **run) / prompt == pytest.approx(
            m["usable_rate"], rel=1e-5)
        assert value("kvfsm_wrong_outputs", **run) == 0
        assert value("kvfsm_intact_tokens", **run) == m["intact_tokens"]
        assert value("kvfsm_lost_tokens", **run) == m["lost_tokens"]
        assert value("kvfsm_wrong_outputs", model=model_type, workload="faulted",
                     mode="naive") == m["naive_wrong"]
        assert value("kvfsm_restores", model=model_type, workload="faulted") == sum(
            r["count"] for r in m["restores"])
        assert value("kvfsm_lookups", **run) >= m["requests"]
    engine_lookups = sum(s.value for s in families["kvfsm_engine_lookups"].samples
                         if s.name == "kvfsm_engine_lookups_total")
    assert engine_lookups == sum(s.value for s in families["kvfsm_lookups"].samples
                                 if s.labels["mode"] == "kvfsm")
    tiers = {s.labels["tier"] for s in families["kvfsm_engine_restores"].samples}
    assert "host" in tiers
    restores = families["kvfsm_restores"].samples
    assert restores and set(restores[0].labels) == {"model", "workload", "kind", "tier",
                                                    "outcome", "status"}
    assert {s.labels["tier"] for s in restores} >= {"host", "disk"}
    assert "kvfsm_read_errors" in families
    assert {"reason"} <= set(families["kvfsm_shortfalls"].samples[0].labels)


def test_demo_without_a_remote_tier_runs_on_disk_alone() -> None:
    import attrs

    from kvfsm.serve._demo import quick_settings, run_demo
    from kvfsm.serve._report import demo_figures

    settings = attrs.evolve(quick_settings(), models=("gpt_oss",), remote="none")
    figures = demo_figures(run_demo(settings, progress_bar=False))
    assert figures["remote"] == "none" and "No remote tier" in figures["remote_note"]
    m = figures["models"]["gpt_oss"]
    assert m["stored_tiers"] == ["disk"]
    assert not {f["injector"] for f in m["fault_outcomes"]} & REMOTE_ONLY
    assert m["restores_by_tier"]["remote"]["restored"] == 0
    assert m["clean"]["restores_by_tier"]["disk"]["restored"] > 0
    assert m["kvfsm_wrong"] == 0 and m["clean"]["reuse_of_hit"] == 1.0


def test_demo_cli_remote_option(tmp_path: Path) -> None:
    """``kvfsm demo --remote none`` (the option is parsed in kvfsm/cli.py)."""
    from kvfsm.cli import build_parser

    _args, unknown = build_parser().parse_known_args(["demo", "--remote", "none"])
    if unknown:
        pytest.skip("kvfsm/cli.py has no `kvfsm demo --remote` yet")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["demo", "--quick", "--json", "-q", "--model", "gpt_oss", "--remote", "none",
                     "-o", str(tmp_path)])
    assert code == 0
    figures = json.loads(stdout.getvalue())
    assert figures["remote"] == "none" and "No remote tier" in figures["remote_note"]
    assert "kvfsm demo --quick --model gpt_oss --remote none" in (
        tmp_path / "report.md").read_text(encoding="utf-8")


def test_quick_demo_logs_every_kvfsm_run_and_its_logs_replay(
        quick: tuple[Path, dict[str, Any]]) -> None:
    """Each kvfsm-mode run of the demo (clean and faulted workloads, every model) writes its
    transitions to events/<model>-<workload>.jsonl; the demo replays each through the lifecycle
    tables and all are accepted; a log tampered with afterwards is rejected."""
    from kvfsm.obs import replay

    out, figures = quick
    logs = figures["event_logs"]
    assert set(logs) == {f"{model}/{workload}" for model in figures["models"]
                         for workload in ("clean", "faulted")}
    assert figures["event_logs_rejected"] == 0
    assert all(entry["accepted"] and entry["blocks_moved"] > 0 for entry in logs.values())
    # The kvfsm runs' rebuilds read the blocks they reuse: logged, and checked by the replay.
    assert all(entry["reads"] > 0 for entry in logs.values())
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "re-fired each log through the lifecycle tables" in report
    some = sorted((out / "events").glob("*.jsonl"))[0]
    lines = some.read_text(encoding="utf-8").splitlines()
    move = next(i for i, line in enumerate(lines) if '"type":"move"' in line and i > 0)
    record = json.loads(lines[move])
    record["to"][0] = record["from"][0]  # a transition the table does not have
    lines[move] = json.dumps(record, separators=(",", ":"))
    tampered = out / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = replay(tampered)
    assert not result.accepted and result.violation is not None
    assert result.violation.line == move + 1
