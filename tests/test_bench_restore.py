"""``kvfsm bench restore`` reports its figures, every restored block verified (never asserting
times): disk, remote (Mooncake, else Redis, else a reason) and host, at a tiny size."""

from __future__ import annotations

import inspect
import json
import re
from contextlib import ExitStack
from typing import Any

import pytest

from kvfsm import KvfsmError
from kvfsm.bench import _restore as restore_bench
from kvfsm.bench import bench_restore
from kvfsm.cli import main
from kvfsm.tiers import TierError
from tests.doc_figures import page, section, table

BLOCKS, BLOCK_BYTES = 4, 4096
RATES = ("disk_gbps", "raw_disk_gbps", "host_gbps")
REMOTE = ("remote_gbps", "raw_remote_gbps", "remote_ratio", "remote_restore_ms",
          "raw_remote_ms")
KEYS = (*RATES, "disk_ratio", *REMOTE, "remote_store", "remote_skipped", "blocks",
        "block_bytes", "workers", "raw_threads", "disk_verified_blocks",
        "remote_verified_blocks", "host_verified_blocks")


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    return dict(bench_restore(blocks=BLOCKS, block_bytes=BLOCK_BYTES, repeat=2))


def test_bench_restore_figures(figures: dict[str, Any]) -> None:
    assert set(KEYS) <= set(figures)
    assert (figures["blocks"], figures["block_bytes"]) == (BLOCKS, BLOCK_BYTES)
    assert (figures["workers"], figures["raw_threads"]) == (2, 1)
    for key in RATES:
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert figures["disk_ratio"] == pytest.approx(figures["disk_gbps"] / figures["raw_disk_gbps"])
    # Every block of every run came back whole: its load verified and restore_done took it.
    assert figures["disk_verified_blocks"] == BLOCKS
    assert figures["host_verified_blocks"] == BLOCKS
    if figures["remote_store"] is None:  # neither Mooncake nor Redis runs here: say why
        assert figures["remote_skipped"]
        assert all(figures[key] is None for key in REMOTE)
    else:
        assert figures["remote_store"] in ("mooncake", "redis")
        assert figures["remote_skipped"] is None
        for key in REMOTE:
            assert isinstance(figures[key], float) and figures[key] > 0, key
        assert figures["remote_ratio"] == pytest.approx(
            figures["remote_gbps"] / figures["raw_remote_gbps"])
        assert figures["remote_verified_blocks"] == BLOCKS


def test_docs_tiers_speed_quotes_keys_and_defaults_of_the_command(
        figures: dict[str, Any]) -> None:
    """docs/tiers.md's "Speed": each figure of its table is a key of the report, with a number
    (remote ones where a store ran), and the sizes it says a run measures are the defaults."""
    text = section(page("tiers.md"), "Speed")
    assert "`kvfsm bench restore --json`" in text
    rows = table(text, "figure")
    assert rows
    for cell, *_ in rows:
        key = re.match(r"`(\w+)`", cell).group(1)  # type: ignore[union-attr]
        if key.startswith("remote_") and figures["remote_store"] is None:
            continue
        assert isinstance(figures[key], float), key
    prose = " ".join(text.split())
    blocks, mib = map(int, re.search(r"(\d+) blocks of (\d+) MiB", prose).groups())  # type: ignore[union-attr]
    runs = int(re.search(r"best of (\d+) runs", prose).group(1))  # type: ignore[union-attr]
    workers = int(re.search(r"`disk_ratio` \((\d+) workers\)", prose).group(1))  # type: ignore[union-attr]
    defaults = {name: p.default for name, p in inspect.signature(bench_restore).parameters.items()}
    assert (defaults["blocks"], defaults["block_bytes"], defaults["repeat"],
            defaults["workers"]) == (blocks, mib << 20, runs, workers)


def test_bench_restore_on_redis() -> None:
    figures = bench_restore(blocks=2, block_bytes=BLOCK_BYTES, repeat=1, remote="redis")
    if figures["remote_store"] is None:
        pytest.skip(f"redis does not run here: {figures['remote_skipped']}")
    assert figures["remote_store"] == "redis"
    assert figures["remote_verified_blocks"] == 2
    assert figures["raw_remote_into_gbps"] is None  # no zero-copy get in the redis client


def test_no_remote_store_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(name: str, stack: ExitStack, nbytes: int) -> None:
        raise TierError(f"no {name} here")

    monkeypatch.setattr(restore_bench, "_open_store", unavailable)
    figures = bench_restore(blocks=2, block_bytes=BLOCK_BYTES, repeat=1)
    assert figures["remote_store"] is None
    assert figures["remote_skipped"] == "mooncake: no mooncake here; redis: no redis here"
    assert figures["remote_ratio"] is None and figures["remote_gbps"] is None
    assert figures["disk_verified_blocks"] == 2


def test_cli_bench_restore_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "restore", "--blocks", "2", "--block-bytes", "4096", "--remote", "none"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.out)  # progress never reaches stdout
    assert (figures["blocks"], figures["block_bytes"]) == (2, 4096)
    assert figures["remote_ratio"] is None
    assert figures["remote_skipped"] == "not asked for (remote: none)"
    assert "bench restore: disk: spilling 2 blocks of 4096 bytes to a disk tier..." in (
        captured.err.splitlines())
    assert all(line.startswith("bench restore: ") for line in captured.err.splitlines())
    assert main([*argv, "--quiet", "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    table = captured.out.splitlines()
    assert table[0].startswith("bench restore: 2 blocks x 4,096 bytes")
    assert "1 worker thread(s)" in table[0]
    assert any(line.startswith("disk -> device pool") for line in table)
    assert any(line.startswith("remote: not measured: not asked for") for line in table)


def test_bench_restore_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KvfsmError, match="multiple of 64"):
        bench_restore(blocks=2, block_bytes=100)
    with pytest.raises(KvfsmError, match="remote must be"):
        bench_restore(blocks=2, remote="s3")
    assert main(["bench", "restore", "--block-bytes", "1000", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("kvfsm: error: bench restore: block bytes")
