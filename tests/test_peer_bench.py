"""tools/peer_bench.py: its report's shape on kvfsm alone, peers that do not import, the paired
rounds' order, the torchvision placeholder and its argument errors. Needs neither vLLM nor
SGLang (where they are importable they are made to look absent)."""

from __future__ import annotations

import importlib
import json
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.tool_modules import load_tool

#: The shortest run the tool accepts that still fills a block (16 tokens) and a bit.
TINY = ["--lengths", "40,64", "--rounds", "2", "--samples", "3", "--hash-tokens", "64"]
ROW_KEYS = {"kvfsm_ms", "kvfsm_full_nochecksum_ms", "vllm_ms", "sglang_ms", "vllm_ratio",
            "sglang_ratio", "vllm_ratio_vs_full_nochecksum", "sglang_ratio_vs_full_nochecksum",
            "vllm_ratio_rounds", "sglang_ratio_rounds", "hit_tokens", "cached_tokens"}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("peer_bench")


@pytest.fixture
def no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM and SGLang fail to import, as where they are not installed."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "sglang", None)


def run_json(tool: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert tool.main([*TINY, "--json", *argv]) == 0
    captured = capsys.readouterr()
    assert "peer bench: " in captured.err  # progress goes to stderr, the report alone to stdout
    report: dict[str, Any] = json.loads(captured.out)
    return report


@pytest.mark.usefixtures("no_peers")
def test_absent_peers_give_null_ratios_with_reasons(
        tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tool, capsys)
    assert set(report) == {"lengths", "hash", "versions", "skipped", "block_tokens",
                           "window_tokens", "rounds", "samples", "cached_fraction"}
    assert report["cached_fraction"] == 1.0
    assert set(report["lengths"]) == {"40", "64"}
    for configs in report["lengths"].values():
        assert set(configs) == {"full", "full_swa"}
        for row in configs.values():
            assert set(row) == ROW_KEYS
            assert row["kvfsm_ms"] > 0 and row["kvfsm_full_nochecksum_ms"] > 0
            assert row["vllm_ratio"] is None and row["sglang_ratio"] is None
            assert row["vllm_ms"] is None and row["sglang_ms"] is None
    assert set(report["skipped"]) == {"vllm", "sglang"}
    assert "vllm" in report["skipped"]["vllm"]
    assert "sglang" in report["skipped"]["sglang"]
    assert report["hash"]["tokens"] == 64
    assert report["hash"]["kvfsm_ms"] > 0 and report["hash"]["vllm_ratio"] is None
    assert "vllm" not in report["versions"] and "kvfsm" in report["versions"]


def test_skip_leaves_a_peer_out_with_that_reason(
        tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tool, capsys, "--skip", "vllm", "--skip", "sglang")
    assert report["skipped"] == {"vllm": "skipped by --skip", "sglang": "skipped by --skip"}


@pytest.mark.usefixtures("no_peers")
def test_kvfsm_finds_the_prompt_minus_its_last_token(
        tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The lookup timed is a full hit: every whole block before the last token."""
    report = run_json(tool, capsys)
    assert report["lengths"]["40"]["full"]["hit_tokens"] == {"kvfsm": 32}
    # 64 tokens: the last token is computed, so the fourth block is not usable.
    assert report["lengths"]["64"]["full_swa"]["hit_tokens"] == {"kvfsm": 48}


@pytest.mark.usefixtures("no_peers")
def test_a_cached_fraction_times_a_partial_hit_of_the_cached_blocks(
        tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--cached-fraction 0.5`` every side caches the prompt's first half in whole
    blocks and looks up all of it: kvfsm finds exactly that half usable; 0 caches nothing."""
    report = run_json(tool, capsys, "--cached-fraction", "0.5")
    assert report["cached_fraction"] == 0.5
    # 40 tokens: half is 20, one whole block; 64: two.
    assert report["lengths"]["40"]["full"]["cached_tokens"] == 16
    assert report["lengths"]["40"]["full"]["hit_tokens"] == {"kvfsm": 16}
    assert report["lengths"]["64"]["full_swa"]["hit_tokens"] == {"kvfsm": 32}
    report = run_json(tool, capsys, "--cached-fraction", "0")
    assert report["lengths"]["64"]["full"]["hit_tokens"] == {"kvfsm": 0}


@pytest.mark.usefixtures("no_peers")
def test_table_names_every_row_and_the_skipped_peers(
        tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main(TINY) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["40"], ["64"])]
    assert [row[:2] for row in rows] == [["40", "full"], ["40", "full_swa"], ["64", "full"],
                                         ["64", "full_swa"]]
    assert "skipped vllm: " in out and "skipped sglang: " in out


def test_rounds_alternate_the_order_of_the_sides(tool: ModuleType) -> None:
    seen: list[str] = []
    calls = {name: (lambda name=name: seen.append(name)) for name in "abc"}
    medians = tool.paired_medians(calls, rounds=3, samples=2, warmup=1)
    timed = seen[3:]  # after one warm-up call each
    assert timed == list("aabbcc" + "ccbbaa" + "aabbcc")
    assert set(medians) == set("abc")
    assert all(len(per_round) == 3 for _, per_round in medians.values())


def test_ratio_is_peer_over_kvfsm(tool: ModuleType) -> None:
    assert tool._ratio(0.02, 0.001) == 20.0  # kvfsm 20 times faster
    assert tool._ratio(None, 0.001) is None
    assert tool._ratio_range([2.0, 6.0], [1.0, 2.0]) == [2.0, 3.0]


def test_torchvision_placeholder_answers_any_name(
        tool: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The placeholder serves imports of its package and submodules, attribute chains and calls
    (what SGLang's config modules do with torchvision at import time)."""

    class Finder(tool._TorchvisionPlaceholder):  # type: ignore[name-defined,misc]
        NAME = "kvfsm_test_placeholder"

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    for name in [m for m in sys.modules if m.startswith(Finder.NAME)]:
        monkeypatch.delitem(sys.modules, name)
    try:
        transforms = importlib.import_module("kvfsm_test_placeholder.transforms")
        functional = importlib.import_module("kvfsm_test_placeholder.transforms.functional")
        assert transforms.InterpolationMode.BICUBIC is transforms.InterpolationMode
        assert functional.resize(1, size=2) is not None
        assert importlib.import_module("kvfsm_test_placeholder").__version__ == "0"
    finally:
        for name in [m for m in sys.modules if m.startswith(Finder.NAME)]:
            del sys.modules[name]


@pytest.mark.parametrize(("argv", "says"), [
    (["--lengths", "1"], "--lengths: each length must be >= 2"),
    (["--lengths", "a,b"], "--lengths: comma-separated token counts"),
    (["--rounds", "0"], "expected a positive integer"),
    (["--cached-fraction", "1.5"], "--cached-fraction: a number from 0 to 1"),
])
def test_bad_arguments_exit_2_saying_which(
        tool: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
