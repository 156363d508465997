"""The remote tiers against real servers: the StoredTier contract on Mooncake Store and on Redis
(round trips, no silent overwrite, corrupt, foreign, missing, removed, late reads), a Mooncake
master killed and restarted, Redis evicting under ``maxmemory``, and a value put by another
process loaded here; construction refusing what is not the store (nothing listening, a silent
listener, the other store's port) within its bound; a frozen store (SIGSTOP) costing each call a
bounded time, reported once as unavailable and once as working again. Servers are started per
module; where a binary or client library is missing the tests skip, except under ``CI=true``,
where they fail."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import xxhash
from numpy.typing import NDArray

from kvfsm.tiers import (
    HEADER_BYTES,
    BlockKey,
    LoadResult,
    LoadStatus,
    MooncakeMaster,
    MooncakeTier,
    RedisServer,
    RedisTier,
    StoredTier,
    TierConnectError,
    TierError,
    encode_header,
)
from kvfsm.tiers._servers import free_port
from tests.remote_servers import (
    Clock,
)

SIZE = 4096
_CHAINS = itertools.count(1)
SEGMENT = 64 << 20


def key(chain: int | None = None, *, start: int = 0, end: int = 16) -> BlockKey:
    """A key no other test uses (unless ``chain`` is given)."""
    return BlockKey(model=b"r" * 16, group=5, layout=9, chain_high=0xFEED,
                    chain_low=next(_CHAINS) if chain is None else chain,
                    token_start=start, token_end=end)


def payload(seed: int, n: int = SIZE) -> NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sums(payloads: list[Any]) -> NDArray[np.uint64]:
    return np.array([xxhash.xxh3_64_intdigest(p) for p in payloads], dtype=np.uint64)


def value(k: BlockKey, data: Any) -> bytes:
    """The stored bytes of ``k`` holding ``data``: header, then payload."""
    return encode_header(k, memoryview(data).nbytes, xxhash.xxh3_64_intdigest(data)) + bytes(data)


def load(tier: StoredTier, keys: list[BlockKey], n: int = SIZE
         ) -> tuple[LoadResult, NDArray[np.uint8]]:
    outs = np.zeros((len(keys), n), dtype=np.uint8)
    return tier.load_into(keys, list(outs)), outs


@dataclass
class Backend:
    """A tier and the raw client beside it: plant (overwrite) a value, read one, drop one."""

    name: str
    tier: StoredTier
    lease_s: float
    clock: Clock
    plant: Callable[[str, bytes], None]
    fetch: Callable[[str], bytes | None]
    drop: Callable[[str], None]

    def raw(self, k: BlockKey) -> str:
        return "kvfsm/" + k.name


@pytest.fixture(scope="module")
def mooncake_backend(master: MooncakeMaster) -> Iterator[Backend]:
    clock = Clock()
    tier = MooncakeTier(master.address, global_segment_bytes=SEGMENT,
                        local_buffer_bytes=16 << 20, lease_s=master.lease_s, clock=clock)
    client = tier.client

    def plant(name: str, data: bytes) -> None:
        assert client.upsert(name, data) == 0

    def fetch(name: str) -> bytes | None:
        return client.get(name) or None

    yield Backend("mooncake", tier, tier.lease_s, clock, plant, fetch,
                  lambda name: client.remove(name, True))  # forced: past any read lease
    tier.close()


@pytest.fixture(scope="module")
def redis_backend(redis_server: RedisServer) -> Iterator[Backend]:
    clock = Clock()
    tier = RedisTier(redis_server.address, clock=clock)
    client = tier.client
    yield Backend("redis", tier, tier.lease_s, clock, lambda name, data: client.set(name, data),
                  client.get, client.delete)
    tier.close()


@pytest.fixture(params=["mooncake", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen: Backend = request.getfixturevalue(f"{request.param}_backend")
    chosen.clock.step = 0.0
    return chosen


# -- the contract, on both backends ----------------------------------------------------------------


def test_round_trip_of_a_batch(backend: Backend) -> None:
    keys = [key() for _ in range(6)]
    data = [payload(i) for i in range(6)]
    mixed: list[Any] = [data[0], bytes(data[1]), bytearray(data[2]), data[3].data, *data[4:]]
    assert backend.tier.put(keys, mixed, sums(data)).all()
    assert backend.fetch(backend.raw(keys[0])) == value(keys[0], data[0])
    result, outs = load(backend.tier, keys)
    assert (result.status == LoadStatus.OK).all()
    assert np.array_equal(outs, np.stack(data))
    assert result.checksum.tolist() == sums(data).tolist()
    assert backend.tier.contains([*keys, key()]).tolist() == [True] * 6 + [False]
    # Same key, same content: a second put keeps the stored value and answers True.
    assert backend.tier.put(keys[:2], data[:2], sums(data[:2])).all()
    assert backend.fetch(backend.raw(keys[1])) == value(keys[1], data[1])


@pytest.mark.parametrize("planted", ["garbage", "other-content", "foreign", "short"])
def test_put_over_another_value_replaces_it(backend: Backend, planted: str) -> None:
    k, good = key(), payload(1)
    bad = {"garbage": bytes(payload(2, HEADER_BYTES + SIZE)),
           "other-content": value(k, payload(3)),
           "foreign": value(key(), payload(4)),
           "short": value(k, good)[:-100]}[planted]
    backend.plant(backend.raw(k), bad)
    assert backend.tier.put([k], [good], sums([good])).all()
    result, outs = load(backend.tier, [k])
    assert result.status.tolist() == [LoadStatus.OK]
    assert np.array_equal(outs[0], good)


def test_flipped_bit_is_corrupt(backend: Backend) -> None:
    keys, data = [key(), key()], [payload(5), payload(6)]
    assert backend.tier.put(keys, data, sums(data)).all()
    for k, at in zip(keys, (HEADER_BYTES + 1000, 40), strict=True):  # payload, header
        stored = bytearray(value(k, data[keys.index(k)]))
        stored[at] ^= 0x10
        backend.plant(backend.raw(k), bytes(stored))
    result, _ = load(backend.tier, keys)
    assert result.status.tolist() == [LoadStatus.CORRUPT] * 2
    assert result.checksum.tolist() == [0, 0]
    if backend.name == "redis":  # no lease there: the bad values are gone
        assert not backend.tier.contains(keys).any()


@pytest.mark.parametrize("size", [SIZE, SIZE // 2])
def test_value_of_another_key_is_foreign(backend: Backend, size: int) -> None:
    mine, other = key(), key()
    backend.plant(backend.raw(mine), value(other, payload(7, size)))
    result, _ = load(backend.tier, [mine])
    assert result.status.tolist() == [LoadStatus.FOREIGN]


def test_wrong_length_is_corrupt(backend: Backend) -> None:
    long, short = key(), key()
    backend.plant(backend.raw(long), value(long, payload(8, SIZE + 64)))
    backend.plant(backend.raw(short), value(short, payload(9))[: HEADER_BYTES + 10])
    result, _ = load(backend.tier, [long, short])
    assert result.status.tolist() == [LoadStatus.CORRUPT] * 2


def test_missing_among_present(backend: Backend) -> None:
    here, data = key(), payload(10)
    assert backend.tier.put([here], [data], sums([data])).all()
    result, outs = load(backend.tier, [key(), here, key()])
    assert result.status.tolist() == [LoadStatus.MISSING, LoadStatus.OK, LoadStatus.MISSING]
    assert np.array_equal(outs[1], data)


def test_removed_between_contains_and_load_is_missing(backend: Backend) -> None:
    keys, data = [key(), key()], [payload(11), payload(12)]
    assert backend.tier.put(keys, data, sums(data)).all()
    assert backend.tier.contains(keys).all()
    backend.drop(backend.raw(keys[0]))
    result, _ = load(backend.tier, keys)
    assert result.status.tolist() == [LoadStatus.MISSING, LoadStatus.OK]


def test_remove_then_missing(backend: Backend) -> None:
    k, data = key(), payload(13)
    assert backend.tier.put([k], [data], sums([data])).all()
    assert backend.tier.remove([k, key()]).tolist() == [True, True]
    assert not backend.tier.contains([k]).any()
    assert load(backend.tier, [k])[0].status.tolist() == [LoadStatus.MISSING]


def test_read_outliving_its_lease_is_late(backend: Backend) -> None:
    keys, data = [key(), key()], [payload(14), payload(15)]
    assert backend.tier.put(keys, data, sums(data)).all()
    backend.clock.step = backend.lease_s + 1.0
    result, _ = load(backend.tier, [*keys, key()])
    assert result.status.tolist() == [LoadStatus.LATE] * 3
    backend.clock.step = 0.0
    assert (load(backend.tier, keys)[0].status == LoadStatus.OK).all()


def test_misuse_raises(backend: Backend) -> None:
    with pytest.raises(ValueError, match="writable"):
        backend.tier.load_into([key()], [bytes(SIZE)])
    with pytest.raises(ValueError, match="as many"):
        backend.tier.load_into([key(), key()], [bytearray(SIZE)])


# -- stores failing, evicting, restarting ----------------------------------------------------------


def test_mooncake_master_killed_then_restarted(master: MooncakeMaster) -> None:
    server = MooncakeMaster()
    server.start()
    try:
        tier = MooncakeTier(server.address, global_segment_bytes=SEGMENT,
                            local_buffer_bytes=16 << 20)
        old, data = [key(), key()], [payload(16), payload(17)]
        assert tier.put(old, data, sums(data)).all()
        server.kill()
        for attempt in range(2):  # the first call finds the master gone, the next are refused
            began = time.monotonic()
            status = load(tier, old)[0].status
            assert set(status.tolist()) <= {LoadStatus.FAILED, LoadStatus.MISSING}
            assert not tier.put([key()], [data[0]], sums(data[:1])).any()
            assert not tier.contains(old).any()
            assert not tier.remove(old).any()
            # A call into a dead master can hang 4 s; once one failed the rest fail at once.
            assert attempt == 0 or time.monotonic() - began < 2.0
            assert not tier.available and tier.last_error
        server.restart()
        fresh, deadline = key(), time.monotonic() + 20
        while not tier.put([fresh], [data[0]], sums(data[:1])).all():
            assert time.monotonic() < deadline, "puts did not work again after the restart"
            time.sleep(0.2)
        result, outs = load(tier, [fresh, *old])
        # The restarted master lost every key it held.
        assert result.status.tolist() == [LoadStatus.OK, LoadStatus.MISSING, LoadStatus.MISSING]
        assert np.array_equal(outs[0], data[0])
        assert tier.available and tier.last_error is None
        tier.close()
    finally:
        server.stop()
    assert not server.running


def test_no_master_is_a_tier_error_at_once(master: MooncakeMaster) -> None:
    began = time.monotonic()
    with pytest.raises(TierError, match="no Mooncake master answers"):
        MooncakeTier(f"127.0.0.1:{free_port()}", global_segment_bytes=SEGMENT)
    assert time.monotonic() - began < 5.0


def test_redis_killed_then_restarted(redis_server: RedisServer) -> None:
    with RedisServer() as server:
        tier = RedisTier(server.address)
        k, data = key(), payload(18)
        assert tier.put([k], [data], sums([data])).all()
        server.kill()
        assert load(tier, [k])[0].status.tolist() == [LoadStatus.FAILED]
        assert not tier.put([key()], [data], sums([data])).any()
        assert not tier.contains([k]).any() and not tier.remove([k]).any()
        assert not tier.available and "refused" in (tier.last_error or "")
        port = server.port
        server.restart()
        assert server.port == port
        assert load(tier, [k])[0].status.tolist() == [LoadStatus.MISSING]
        assert tier.available and tier.last_error is None  # the same tier, not rebuilt
        assert tier.put([k], [data], sums([data])).all()
        assert load(tier, [k])[0].status.tolist() == [LoadStatus.OK]
        tier.close()


def test_redis_load_in_several_mgets(redis_backend: Backend,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfsm.tiers._redis as redis_tier

    monkeypatch.setattr(redis_tier, "MGET_BYTES", 2 * SIZE)  # two values per MGET
    keys, data = [key() for _ in range(5)], [payload(30 + i) for i in range(5)]
    assert redis_backend.tier.put(keys, data, sums(data)).all()
    redis_backend.drop(redis_backend.raw(keys[2]))
    result, outs = load(redis_backend.tier, keys)
    assert result.status.tolist() == [0, 0, LoadStatus.MISSING, 0, 0]
    assert all(np.array_equal(outs[i], data[i]) for i in (0, 1, 3, 4))


def test_redis_over_resp3(redis_server: RedisServer) -> None:
    """A ``redis://`` URL may ask for RESP3, whose null differs; the load reads either."""
    tier = RedisTier(f"redis://{redis_server.address}/0?protocol=3")
    here, data = key(), payload(19)
    assert tier.put([here], [data], sums([data])).all()
    result, outs = load(tier, [key(), here])
    assert result.status.tolist() == [LoadStatus.MISSING, LoadStatus.OK]
    assert np.array_equal(outs[1], data)
    tier.close()


def test_redis_evictions_load_missing(redis_server: RedisServer) -> None:
    size = 256 << 10
    with RedisServer(maxmemory="4mb") as server:
        tier = RedisTier(server.address)
        keys = [key() for _ in range(40)]
        data = [payload(100 + i, size) for i in range(40)]
        for at in range(0, 40, 8):
            assert tier.put(keys[at:at + 8], data[at:at + 8], sums(data[at:at + 8])).all()
        present = tier.contains(keys)
        assert 0 < present.sum() < 40, "the server should have evicted some values"
        statuses: list[int] = []
        for at in range(0, 40, 8):
            result, outs = load(tier, keys[at:at + 8], size)
            statuses += result.status.tolist()
            for j in np.flatnonzero(result.ok):
                assert np.array_equal(outs[j], data[at + j])
        expected = [LoadStatus.OK if p else LoadStatus.MISSING for p in present]
        assert statuses == expected
        tier.close()


# -- construction refuses what is not the store ---------------------------------------------------

#: The bound the refusal tests give construction, and the slack a loaded 2-core box needs.
CONNECT_S = 1.0
SLACK_S = 2.0
#: A frozen store's first call waits for the call timeout (CALL_S); the next ones for a probe
#: only (PROBE_S), so they must end well before CALL_S.
CALL_S = 2.0
PROBE_S = 0.3
PROBE_SLACK_S = 1.0


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A TCP port that accepts connections and never sends a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed at teardown
            while True:
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def _refused(build: Callable[[str], object], address: str) -> tuple[TierConnectError, float]:
    began = time.monotonic()
    with pytest.raises(TierConnectError) as caught:
        build(address)
    return caught.value, time.monotonic() - began


@pytest.mark.parametrize("impostor", ["silent listener", "redis-server", "nothing"])
def test_mooncake_refuses_what_is_not_a_master_in_bounded_time(
        master: MooncakeMaster, redis_server: RedisServer, silent_address: str,
        impostor: str) -> None:
    address = {"silent listener": silent_address, "redis-server": redis_server.address,
               "nothing": f"127.0.0.1:{free_port()}"}[impostor]
    error, took = _refused(lambda a: MooncakeTier(a, global_segment_bytes=SEGMENT,
                                                  connect_timeout_s=CONNECT_S), address)
    assert took < CONNECT_S + SLACK_S
    assert isinstance(error, TierError) and error.address == address
    assert str(error).startswith(f"no Mooncake master answers at {address}: ")
    expected = "connection refused" if impostor == "nothing" else "sent nothing back within 1 s"
    assert expected in error.reason
    # The real master at the same time is still accepted.
    tier = MooncakeTier(master.address, global_segment_bytes=SEGMENT,
                        local_buffer_bytes=16 << 20, connect_timeout_s=CONNECT_S)
    assert tier.available and tier.last_error is None
    tier.close()


@pytest.mark.parametrize("impostor", ["silent listener", "mooncake master", "nothing"])
def test_redis_refuses_what_is_not_redis_in_bounded_time(
        master: MooncakeMaster, redis_server: RedisServer, silent_address: str,
        impostor: str) -> None:
    address = {"silent listener": silent_address, "mooncake master": master.address,
               "nothing": f"127.0.0.1:{free_port()}"}[impostor]
    error, took = _refused(lambda a: RedisTier(a, connect_timeout_s=CONNECT_S), address)
    assert took < 2 * CONNECT_S + SLACK_S  # connecting, then PING, each bounded
    assert error.address == address
    assert str(error).startswith(f"no Redis server answers at {address}: ")
    expected = {"silent listener": "no answer to PING within 1 s",
                "mooncake master": "closed the connection without answering PING",
                "nothing": "Connection refused"}[impostor]
    assert expected in error.reason
    tier = RedisTier(redis_server.address, connect_timeout_s=CONNECT_S)
    assert tier.available and tier.last_error is None
    tier.close()


_CONSTRUCT = """
import sys
from kvfsm.tiers import MooncakeTier
print("building", flush=True)
MooncakeTier({address!r}, connect_timeout_s=600)
"""


def test_ctrl_c_interrupts_a_mooncake_tier_waiting_for_a_silent_master(
        master: MooncakeMaster, silent_address: str) -> None:
    """Construction waits on Python sockets, not in C++: SIGINT (Ctrl-C) ends the wait."""
    child = subprocess.Popen([sys.executable, "-c", _CONSTRUCT.format(address=silent_address)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "building"
        time.sleep(1.0)  # inside the wait for the master's answer
        child.send_signal(signal.SIGINT)
        _out, err = child.communicate(timeout=10)
        assert child.returncode != 0 and "KeyboardInterrupt" in err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# -- a frozen store (SIGSTOP) ----------------------------------------------------------------------


def _health_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvfsm.tiers"]


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    began = time.monotonic()
    result = call()
    return result, time.monotonic() - began


def test_redis_frozen_then_thawed(redis_server: RedisServer,
                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvfsm.tiers")
    with RedisServer() as server:
        tier = RedisTier(server.address, socket_timeout_s=CALL_S, probe_timeout_s=PROBE_S)
        k, data = key(), payload(20)
        assert tier.put([k], [data], sums([data])).all()
        server.pause()
        try:
            status, took = _timed(lambda: load(tier, [k])[0].status.tolist())
            assert status == [LoadStatus.FAILED] and took < CALL_S + SLACK_S
            assert not tier.available and "Timeout" in (tier.last_error or "")
            # While it stays frozen each call costs one short PING, not a socket timeout.
            for call in (lambda: tier.put([key()], [data], sums([data])),
                         lambda: tier.contains([k]), lambda: tier.remove([k])):
                answer, took = _timed(call)
                assert not answer.any() and took < PROBE_S + PROBE_SLACK_S
            status, took = _timed(lambda: load(tier, [k])[0].status.tolist())
            assert status == [LoadStatus.FAILED] and took < PROBE_S + PROBE_SLACK_S
        finally:
            server.resume()
        result, outs = load(tier, [k])
        assert result.status.tolist() == [LoadStatus.OK] and np.array_equal(outs[0], data)
        assert tier.available and tier.last_error is None
        lines = _health_lines(caplog)
        assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]
        assert server.address in lines[0][1] and "failing" in lines[0][1]
        assert "works again" in lines[1][1]
        tier.close()


def test_mooncake_master_frozen_then_thawed(master: MooncakeMaster,
                                            caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured before the bound: every call into a frozen master took Mooncake's 30 s."""
    caplog.set_level(logging.INFO, logger="kvfsm.tiers")
    monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)
    server = MooncakeMaster()
    server.start()
    try:
        tier = MooncakeTier(server.address, global_segment_bytes=SEGMENT,
                            local_buffer_bytes=16 << 20, rpc_timeout_s=CALL_S,
                            probe_timeout_s=PROBE_S)
        assert "MC_RPC_TIMEOUT_MS" not in os.environ  # set only while the client set up
        k, data = key(), payload(21)
        assert tier.put([k], [data], sums([data])).all()
        server.pause()
        try:
            status, took = _timed(lambda: load(tier, [k])[0].status.tolist())
            assert status == [LoadStatus.FAILED] and took < CALL_S + SLACK_S
            assert not tier.available and tier.last_error
            for call in (lambda: tier.put([key()], [data], sums([data])),
                         lambda: tier.contains([k]), lambda: tier.remove([k])):
                answer, took = _timed(call)
                assert not answer.any() and took < PROBE_S + PROBE_SLACK_S
        finally:
            server.resume()
        deadline = time.monotonic() + 20
        result, outs = load(tier, [k])
        while not result.ok.all():  # the client may be reconnecting for a moment
            assert time.monotonic() < deadline, "loads did not work again after the thaw"
            time.sleep(0.2)
            result, outs = load(tier, [k])
        assert np.array_equal(outs[0], data)
        assert tier.available and tier.last_error is None
        lines = _health_lines(caplog)
        assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]
        assert server.address in lines[0][1] and server.address in lines[1][1]
        tier.close()
    finally:
        server.stop()


# -- another engine's copy -------------------------------------------------------------------------

_OTHER_ENGINE = """
import sys, numpy as np, xxhash
from kvfsm.tiers import BlockKey, {cls}
tier = {cls}({address!r}{options})
k = BlockKey(b"r" * 16, 5, 9, 0xFEED, {chain}, 0, 16)
data = np.random.default_rng(77).integers(0, 256, {size}, dtype=np.uint8)
ok = tier.put([k], [data], np.array([xxhash.xxh3_64_intdigest(data)], np.uint64))
print("put", bool(ok.all()), flush=True)
sys.stdin.readline()  # a Mooncake value may live in this process's segment: stay until read
tier.close()
"""


def test_a_value_put_by_another_process_loads_here(backend: Backend) -> None:
    k = key()
    tier = backend.tier
    if isinstance(tier, MooncakeTier):
        cls, address = "MooncakeTier", tier.master_address
        options = f", global_segment_bytes={SEGMENT}"
    else:
        assert isinstance(tier, RedisTier)
        cls, address, options = "RedisTier", tier.address, ""
    code = textwrap.dedent(_OTHER_ENGINE).format(cls=cls, address=address, options=options,
                                                chain=k.chain_low, size=SIZE)
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline().strip() == "put True"
        result, outs = load(tier, [k])
        assert result.status.tolist() == [LoadStatus.OK]
        assert np.array_equal(outs[0], payload(77))
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.wait(timeout=30) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


# -- setup errors ----------------------------------------------------------------------------------


def test_missing_pieces_are_tier_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(TierError, match="pip install mooncake-transfer-engine-non-cuda"):
        MooncakeTier("127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(TierError, match="pip install"):
        RedisTier("127.0.0.1:1")
    monkeypatch.setattr(MooncakeMaster, "binary", "no-such-mooncake-master")
    monkeypatch.setattr(RedisServer, "binary", "no-such-redis-server")
    with pytest.raises(TierError, match="libibverbs1"):
        MooncakeMaster().start()
    with pytest.raises(TierError, match="apt-get install -y redis-server"):
        RedisServer().start()


def test_a_mooncake_client_keeps_quiet_unless_asked(master: MooncakeMaster) -> None:
    """Building and closing a tier prints at most a few lines of the client's own logging on
    stderr (its INFO lines, some 20 per client, are off unless ``MC_LOG_LEVEL`` asks for
    them); a level the user set is left alone."""
    script = ("from kvfsm.tiers import MooncakeTier\n"
              f"MooncakeTier({master.address!r}).close()\n")
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=120, check=True)
    chatty = subprocess.run([sys.executable, "-c", script], env=env | {"MC_LOG_LEVEL": "INFO"},
                            capture_output=True, text=True, timeout=120, check=True)
    assert len(quiet.stderr.splitlines()) <= 3, quiet.stderr
    assert len(chatty.stderr.splitlines()) > 10
