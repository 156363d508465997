"""Engine metrics: after a known workload every counter equals what the verdicts and the core
said; the exposition parses; misuse and a missing prometheus-client are clear errors."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvfsm import CoreConfig, Engine, EngineMetrics, KvfsmError
from kvfsm.spec import GroupKind, Tier
from tests.test_obs_eventlog import Recorder, run_workload


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_counters_equal_what_the_verdicts_and_the_core_said(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    _, verdicts = run_workload(tmp_path, metrics=EngineMetrics(registry))
    assert value(registry, "kvfsm_lookups_total", level="standard") == len(verdicts)
    assert value(registry, "kvfsm_prompt_tokens_total") == sum(v.prompt_tokens for v in verdicts)
    assert value(registry, "kvfsm_hit_tokens_total") == sum(v.hit_tokens for v in verdicts)
    assert value(registry, "kvfsm_usable_tokens_total") == sum(v.usable_tokens
                                                               for v in verdicts)
    shortfalls = Counter((s.reason.value, s.group) for v in verdicts for s in v.reasons)
    assert shortfalls  # the workload has blocks to restore
    for (reason, group), count in shortfalls.items():
        assert value(registry, "kvfsm_shortfalls_total", reason=reason, group=group) == count


def test_transitions_count_every_block_moved(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    seen = Recorder()

    class Both(EngineMetrics):
        def moved(self, *args: object) -> None:
            seen.moved(*args)  # type: ignore[arg-type]
            metrics.moved(*args)  # type: ignore[arg-type]

    run_workload(tmp_path, metrics=Both(CollectorRegistry()))
    moved: Counter[tuple[str, str]] = Counter()
    for group, event, ids, *_ in seen.moves:
        moved[group, event.spec_name] += len(ids)
    assert {"allocate", "spill_begin", "restore_done", "evict"} <= {e for _, e in moved}
    for (group, event), count in moved.items():
        assert value(registry, "kvfsm_transitions_total", group=group, event=event) == count


def test_the_metrics_take_no_reads_so_a_lease_gathers_none_for_them() -> None:
    """Metrics count moves, not reads: an engine with metrics and no other observer reports
    no reads observed (a validated lease then gathers no read to report)."""
    eng = Engine("dense", CoreConfig(device_blocks=64, backend="numpy"),
                 metrics=EngineMetrics(CollectorRegistry()))
    assert eng.core.observed and not eng.core.reads_observed
    prompt = eng.prompt(np.arange(65))
    eng.commit(prompt)
    with eng.lease(eng.lookup(prompt), prompt) as lease:
        lease.validate()


def test_restores_lease_refusals_and_admission_waits() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    metrics.observe_restore("attn", GroupKind.FULL, Tier.DISK, "restored", 5, 0.002)
    metrics.observe_restore("attn", "full", "disk", "lost", 1, 0.02)
    metrics.observe_restore("attn", "full", Tier.HOST, "restored", 3, 0.0001)
    metrics.observe_lease_refusal("attn")
    metrics.observe_lease_refusal("attn", 2)
    metrics.observe_admission_wait(0.5)
    metrics.observe_admission_wait(0)
    restores = "kvfsm_restores_total"
    assert value(registry, restores, group="attn", kind="full", tier="disk",
                 outcome="restored") == 5
    assert value(registry, restores, group="attn", kind="full", tier="disk",
                 outcome="lost") == 1
    assert value(registry, restores, group="attn", kind="full", tier="host",
                 outcome="restored") == 3
    assert value(registry, "kvfsm_restore_duration_seconds_count", tier="disk") == 2
    assert value(registry, "kvfsm_restore_duration_seconds_sum", tier="disk") == \
        pytest.approx(0.022)
    assert value(registry, "kvfsm_lease_refusals_total", group="attn") == 3
    assert value(registry, "kvfsm_admission_wait_seconds_count") == 2
    assert value(registry, "kvfsm_admission_wait_seconds_sum") == pytest.approx(0.5)


def test_bad_figures_are_refused_and_change_nothing() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    with pytest.raises(KvfsmError, match="count must be an int >= 0"):
        metrics.observe_restore("attn", "full", "disk", "restored", -1, 0.1)
    with pytest.raises(KvfsmError, match="seconds must be a finite number >= 0"):
        metrics.observe_restore("attn", "full", "disk", "restored", 1, -0.1)
    with pytest.raises(KvfsmError, match="seconds must be a finite number >= 0"):
        metrics.observe_admission_wait(float("nan"))
    with pytest.raises(KvfsmError, match="count must be an int >= 0"):
        metrics.observe_lease_refusal("attn", True)  # type: ignore[arg-type]
    assert value(registry, "kvfsm_restores_total", group="attn", kind="full", tier="disk",
                 outcome="restored") == 0
    assert value(registry, "kvfsm_restore_duration_seconds_count", tier="disk") == 0
    assert value(registry, "kvfsm_admission_wait_seconds_count") == 0


def test_the_exposition_parses_with_conventional_names(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    run_workload(tmp_path, metrics=metrics)
    metrics.observe_restore("attn", "full", "host", "restored", 1, 0.001)
    metrics.observe_admission_wait(0.01)
    families = {f.name: f for f in text_string_to_metric_families(
        metrics.exposition().decode("utf-8"))}
    assert {name: families[name].type for name in (
        "kvfsm_lookups", "kvfsm_prompt_tokens", "kvfsm_hit_tokens", "kvfsm_usable_tokens",
        "kvfsm_shortfalls", "kvfsm_restores", "kvfsm_transitions", "kvfsm_lease_refusals",
        "kvfsm_restore_duration_seconds", "kvfsm_admission_wait_seconds")} == {
        **dict.fromkeys(("kvfsm_lookups", "kvfsm_prompt_tokens", "kvfsm_hit_tokens",
                         "kvfsm_usable_tokens", "kvfsm_shortfalls", "kvfsm_restores",
                         "kvfsm_transitions", "kvfsm_lease_refusals"), "counter"),
        "kvfsm_restore_duration_seconds": "histogram",
        "kvfsm_admission_wait_seconds": "histogram"}
    assert any(s.name == "kvfsm_transitions_total" and s.value > 0
               for s in families["kvfsm_transitions"].samples)


def test_one_set_per_registry_and_namespace() -> None:
    registry = CollectorRegistry()
    first = EngineMetrics(registry)
    with pytest.raises(KvfsmError, match="its own registry or namespace"):
        EngineMetrics(registry)
    first.observe_lease_refusal("attn")  # the first set is whole and still counts
    assert value(registry, "kvfsm_lease_refusals_total", group="attn") == 1
    EngineMetrics(registry, namespace="other").observe_lease_refusal("attn")
    assert value(registry, "other_lease_refusals_total", group="attn") == 1


@pytest.mark.parametrize("registry", ["default", {}, 5])
def test_a_registry_that_is_not_one_is_named(registry: object) -> None:
    with pytest.raises(KvfsmError, match="registry must be a prometheus_client"):
        EngineMetrics(registry)  # type: ignore[arg-type]


def test_a_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(KvfsmError, match=r'pip install "kvfsm\[metrics\]"'):
        EngineMetrics()


def test_lookup_counters_add_up_from_many_threads() -> None:
    """The lookup figures kept as plain numbers lose no lookup when threads report at once,
    and a scrape shows them as counters."""
    import threading

    from kvfsm import CoreConfig, Engine

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    eng = Engine("dense", CoreConfig(device_blocks=64, backend="numpy"))
    prompt = eng.prompt(range(100))
    eng.commit(prompt)
    verdict = eng.lookup(prompt)
    threads = [threading.Thread(target=lambda: [metrics.observe_lookup(verdict)
                                                for _ in range(500)]) for _ in range(4)]
    for each in threads:
        each.start()
    for each in threads:
        each.join()
    assert value(registry, "kvfsm_lookups_total", level=verdict.level.value) == 2000
    assert value(registry, "kvfsm_usable_tokens_total") == 2000 * verdict.usable_tokens
    families = {family.name: family.type
                for family in text_string_to_metric_families(metrics.exposition().decode())}
    assert families["kvfsm_lookups"] == families["kvfsm_hit_tokens"] == "counter"
