"""docs/tiers.md's figures against what produces them. Here: the figures the page quotes from
the demo's report (held to a run of ``kvfsm demo`` by tests/test_docs_demo.py), the defaults
its tables give, and the workload it gives for tests/test_serve_shared.py. The measured
sections are held by the tests that run their commands: tests/test_shared_prefix_tool.py
(``tools/shared_prefix.py``), tests/test_store_outage_tool.py (``tools/store_outage.py``) and
tests/test_bench_restore.py (``kvfsm bench restore``)."""

from __future__ import annotations

import inspect
import json
import re

import pytest

import kvfsm.tiers
from kvfsm.restore import StoreTimeouts
from tests.doc_figures import DOCS, NUMBER, numbers, page, section, table

PAGE = page("tiers.md")


def test_lost_reuse_figures_are_the_demo_reports() -> None:
    """Each ``key`` N the lost-reuse passage quotes is the demo report's figure; a lost reuse
    quoted "for every model" is each model's too."""
    text = " ".join(section(PAGE, "Lost reuse, measured").split())
    report = json.loads((DOCS / "demo" / "report.json").read_text(encoding="utf-8"))
    quoted = re.findall(rf"`([a-z_]+)` ({NUMBER.pattern})( for every model)?", text)
    assert {key for key, _, _ in quoted} >= {"lost_reuse", "clean_lost_reuse",
                                              "intact_tokens", "late_tokens"}
    for key, figure, every in quoted:
        assert report[key] == numbers(figure)[0], key
        if every:
            assert all(model[key] == numbers(figure)[0]
                       for model in report["models"].values()), key


def test_store_timeouts_table_gives_the_defaults() -> None:
    rows = table(section(PAGE, "When a store hangs or dies"), "`StoreTimeouts` field")
    assert rows
    defaults = StoreTimeouts()
    for fields, default, _ in rows:
        names = re.findall(r"`(\w+)`", fields)
        assert [getattr(defaults, name) for name in names] == numbers(default), fields


def test_construction_table_gives_each_tiers_default_bound() -> None:
    rows = table(section(PAGE, "Construction: the store must answer"), "tier")
    assert len(rows) == 2
    for cell, *_ in rows:
        name, parameter, value = re.fullmatch(r"`(\w+)\(address, (\w+)=([\d.]+)\)`",
                                              cell).groups()  # type: ignore[union-attr]
        signature = inspect.signature(getattr(kvfsm.tiers, name))
        assert signature.parameters[parameter].default == float(value), cell


def test_running_bounds_are_the_tiers_defaults() -> None:
    """Each ``bound_s`` (N s) of "Timeouts and health while running" is that parameter's
    default on the tier that has it (``rpc_timeout_s``: None takes the module's default)."""
    from kvfsm.tiers import _mooncake

    text = " ".join(section(PAGE, "Timeouts and health while running").split())
    quoted = re.findall(r"`(\w+_s)`,? \(?(?:default )?([\d.]+) s", text)
    assert {name for name, _ in quoted} >= {"socket_timeout_s", "rpc_timeout_s",
                                            "probe_timeout_s"}
    for name, seconds in quoted:
        defaults = {tier.__name__: inspect.signature(tier).parameters[name].default
                    for tier in (kvfsm.tiers.MooncakeTier, kvfsm.tiers.RedisTier)
                    if name in inspect.signature(tier).parameters}
        if defaults.get("MooncakeTier", 0) is None:
            defaults["MooncakeTier"] = _mooncake.DEFAULT_RPC_TIMEOUT_S
        assert defaults and set(defaults.values()) == {float(seconds)}, (name, defaults)


def test_two_engine_serving_figures_are_the_serve_tests() -> None:
    """The workload and tolerance the page gives for tests/test_serve_shared.py are that
    test's."""
    pytest.importorskip("transformers")
    from tests import test_serve_shared as shared

    text = " ".join(section(PAGE, "Two engines sharing one store").split())
    found = re.search(r"Engine A serves (\d+) questions over (\d+) documents of (\d+) and (\d+) "
                      r"tokens \(prompts of (\d+) to (\d+) tokens.*?logits are within ([\de.-]+) "
                      r"of them", text)
    assert found, "the page's serving workload moved"
    questions, documents, *sizes, shortest, longest = map(int, found.groups()[:-1])
    prompts = [len(request.tokens) for request in shared.A_REQUESTS]
    assert (questions, documents) == (len(prompts), len(sizes))
    assert sizes == [len(shared.DOC1), len(shared.DOC2)]
    assert (shortest, longest) == (min(prompts), max(prompts))
    assert float(found.group(7)) == shared.TOLERANCE


def test_format_figures_are_the_codes() -> None:
    """The header's size, the file an 8 KiB payload makes and what it counts on 4 KiB blocks,
    and a block's metadata with every tier in use (32 bytes, and a pin counter per chunk)."""
    from kvfsm import CoreConfig, shipped_models
    from kvfsm.bench._state import logical_arrays
    from kvfsm.state import StateCore
    from kvfsm.tiers._contract import HEADER_BYTES

    text = " ".join(PAGE.split())
    assert f"is a {HEADER_BYTES}-byte header followed by the raw payload" in text
    file_bytes = HEADER_BYTES + 8 * 1024
    counted = -(-file_bytes // 4096) * 4
    assert f"The {file_bytes:,}-byte file".replace(",", " ") + " of an 8 KiB payload counts " \
        f"{counted} KiB on a file system with 4 KiB blocks" in text
    every_tier = CoreConfig(device_blocks=64, host_blocks=64, disk_blocks=64, remote_blocks=64,
                            backend="numpy")
    group = StateCore(shipped_models()["dense"], every_tier).group("attn")
    per_block = {name: array.nbytes / group.n_blocks
                 for name, array in logical_arrays(group).items()}
    assert sum(size for name, size in per_block.items() if name != "chunk_pins") == 32
    assert "in ≤ 32 bytes of metadata" in text
