"""tools/store_outage.py and tools/blackhole.py: the black-hole proxy forwards, swallows without a
word either way (no reset, no EOF: the client's read times out) and forwards again after the hole
(connections open during it stay silent, or get their bytes, by mode); and a very short run of the
outage tool on Redis goes through every phase and reports them in its JSON shape. No absolute time
is asserted: the figures are the tool's to report, on a box shared with other work."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.doc_figures import KEY, lookup, page, section
from tests.remote_servers import unavailable
from tests.tool_modules import load_tool

SILENT_S = 0.3
WAIT_S = 10.0


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("store_outage")


@pytest.fixture(scope="module")
def blackhole() -> ModuleType:
    return load_tool("blackhole")


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server on 127.0.0.1; its port."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield port
    server.close()


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def echoes(sock: socket.socket, data: bytes) -> bool:
    sock.settimeout(WAIT_S)
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            return False
        got += chunk
    return got == data


def silent(sock: socket.socket, data: bytes = b"") -> bool:
    """Nothing comes back within SILENT_S (and the connection is not closed)."""
    if data:
        sock.sendall(data)
    sock.settimeout(SILENT_S)
    try:
        sock.recv(4096)
    except TimeoutError:
        return True
    return False


@pytest.mark.parametrize("mode", ["drop", "hold"])
def test_the_black_hole_swallows_in_silence_then_forwards_again(
        blackhole: ModuleType, echo: int, mode: str) -> None:
    with blackhole.BlackHole(echo, mode=mode) as hole, contextlib.ExitStack() as stack:
        before = stack.enter_context(connect(hole.address))
        assert echoes(before, b"ping")
        hole.swallow()
        assert silent(before, b"lost?")  # neither an answer nor an EOF
        during = stack.enter_context(connect(hole.address))  # still accepted
        assert silent(during, b"anyone?")
        hole.heal()
        after = stack.enter_context(connect(hole.address))
        assert echoes(after, b"back")
        if mode == "drop":  # their state was lost with the path: silent for good
            assert silent(before, b"again") and silent(during, b"again")
        else:  # their bytes were held and go on now
            for sock, held in ((before, b"lost?"), (during, b"anyone?")):
                sock.settimeout(WAIT_S)
                assert sock.recv(4096) == held


def test_the_black_hole_in_its_own_process(blackhole: ModuleType, echo: int) -> None:
    with blackhole.BlackHoleProcess(echo) as hole, contextlib.ExitStack() as stack:
        assert echoes(stack.enter_context(connect(hole.address)), b"ping")
        hole.swallow()
        assert silent(stack.enter_context(connect(hole.address)), b"anyone?")
        hole.heal()
        assert echoes(stack.enter_context(connect(hole.address)), b"back")


@pytest.fixture(scope="module")
def short_run(tool: ModuleType) -> dict[str, Any]:
    """The tool's report of 1 s phases on Redis, with the lock's statistics."""
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        unavailable(f"the redis client does not import ({exc})")
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tool.main(["--store", "redis", "--threads", "4", "--normal-s", "1", "--frozen-s", "1",
                   "--blackhole-s", "1", "--killed-s", "0.5", "--warmup-s", "1",
                   "--lock-stats"])
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def test_a_short_run_goes_through_every_phase(short_run: dict[str, Any]) -> None:
    """1 s phases on Redis: every phase ran and is reported with the same fields; the targets
    are judged (not asserted: times on a shared box are the report's business)."""
    report = short_run
    assert report["command"].startswith("python -m tools.store_outage --store redis")
    run = report["runs"]["redis"]
    names = [row["phase"] for row in run["phases"]]
    assert names == ["normal", "frozen", "after_frozen", "blackhole", "after_blackhole",
                     "killed", "after_killed"]
    for row in run["phases"]:
        assert row["seconds"] > 0
        assert set(row["resident_lookup"]) >= {"count", "median_ms", "p99_ms", "median_ratio",
                                              "p99_ratio"}
        assert set(row["ops_by_kind"]) == {"resident", "stored", "commit"}
        assert ("first_good_restore_s" in row) == row["phase"].startswith("after_")
        assert set(row["cpu_cores"]) == {"engine_process", "proxy_process", "box_busy",
                                         "box_cores"}
        assert 0 < row["engine_lock"]["held_share"] < 1  # the lock was taken, not held all along
    normal = run["phases"][0]
    assert normal["resident_lookup"]["count"] > 0 and normal["ops"] > 0
    assert normal["resident_lookup"]["median_ratio"] == 1.0 and normal["ops_ratio"] == 1.0
    assert normal["store_restores"]["succeeded"] > 0  # restores from the store ran
    assert normal["resident_lookup"]["not_fully_usable"] == 0
    assert set(run["republished_after_return_s"]) == {"after_frozen", "after_blackhole",
                                                      "after_killed"}
    targets = run["targets"]
    assert set(targets) == {
        *(f"{p}.{t}" for p in ("frozen", "blackhole", "killed")
          for t in ("lookup_median_within_2x", "lookup_p99_within_2x",
                    "throughput_at_least_80pct")),
        *(f"after_{p}.first_good_restore_within_1s" for p in ("frozen", "blackhole",
                                                             "killed")),
        "all_met"}
    assert run["threads_still_running_at_stop"] == 0
    assert run["errors"] == 0, run["error_examples"]  # no engine call raised for the store


def test_the_keys_docs_tiers_quotes_are_in_each_phase(short_run: dict[str, Any]) -> None:
    """docs/tiers.md's measured outages: the page names this tool's command, and every report
    key it gives its table's figures and the lock's figures under is in the phases the figure
    is for, as a number (a time after a return may be None: nothing before the next outage)."""
    text = " ".join(section(page("tiers.md"), "Measured: `tools/store_outage.py`").split())
    assert "python -m tools.store_outage --store both" in text
    phases = short_run["runs"]["redis"]["phases"]
    for what, rows in (("normal", phases[:1]),
                       ("outages", [r for r in phases if not r["phase"].startswith(
                           ("normal", "after_"))]),
                       ("after", [r for r in phases if r["phase"].startswith("after_")]),
                       ("lock", phases)):
        quoted = re.search(rf"\b{what}: (.*?)(?:;|\.(?: |$))", text)
        assert quoted, f"the page names no keys for {what}"
        keys = KEY.findall(quoted.group(1))
        assert keys, what
        for row in rows:
            for key in keys:
                value = lookup(row, key)
                assert isinstance(value, float | int) or (what == "after" and value is None), (
                    what, key, value)
