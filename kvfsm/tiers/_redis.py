"""``RedisTier``: block copies in a Redis or Valkey server, shared by every engine that uses it.

A second, smaller remote backend beside Mooncake, so the ``StoredTier`` contract is not shaped by
one store: plain strings under ``prefix + key.name``, each ``encode_header(...) + payload``,
written with ``SET ... NX`` in a pipeline, read with ``MGET`` (one per ``MGET_BYTES``), checked
with ``EXISTS`` and dropped with ``DEL``. RESP moves a value as one bulk string, so a put joins
header and payload (one copy). A load sends its ``MGET`` on a pooled ``redis`` connection and
reads the reply off that connection's socket itself, each payload straight into its ``out``
(``recv_into``): the ``redis`` parser buffers a whole multi-megabyte reply and copies each value
three times, which made ``MGET`` slower than one ``GET`` per key (measured: 0.62 of it; now 1.1).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvfsm.spec._vocabulary import Tier
from kvfsm.tiers._client import ClientTier
from kvfsm.tiers._contract import (
    HEADER_BYTES,
    BlockKey,
    LoadResult,
    LoadStatus,
    TierConnectError,
    TierError,
    encode_header,
    verify,
)
from kvfsm.tiers._health import Health
from kvfsm.tiers._mooncake import byte_view

#: Default seconds a read may take before its bytes are not trusted (LATE).
DEFAULT_READ_DEADLINE_S: Final = 5.0
#: Default bound on each socket read or write of a call: a Redis answers in milliseconds, and a
#: multi-megabyte ``MGET`` reply arrives over many reads, each bounded on its own.
DEFAULT_SOCKET_TIMEOUT_S: Final = 10.0
#: Default bound on opening a connection, and on the construction's ``PING`` answering.
DEFAULT_CONNECT_TIMEOUT_S: Final = 1.0
#: Default bound on the ``PING`` that calls send first while the server is failing: short, as a
#: call answers FAILED / False at once when it goes unanswered.
DEFAULT_PROBE_TIMEOUT_S: Final = 0.5
_LINE_CHUNK: Final = 4096
#: Payload bytes asked for per ``MGET`` of a load (measured: 8 MiB replies beat one huge one).
MGET_BYTES: Final = 8 << 20


class _Reply:
    """Reads one RESP2 reply off a socket: short lines through a small buffer, bulk strings
    straight into the caller's memory."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._at = 0

    def line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n", self._at)) < 0:
            del self._buffer[:self._at]
            self._at = 0
            chunk = self._sock.recv(_LINE_CHUNK)
            if not chunk:
                raise ConnectionError("the server closed the connection mid-reply")
            self._buffer += chunk
        line = bytes(self._buffer[self._at:end])
        self._at = end + 2
        return line

    def bulk_into(self, *views: memoryview) -> None:
        """Fill ``views`` in turn with the next bytes, then eat the bulk string's CRLF."""
        for view in (*views, memoryview(bytearray(2))):
            take = min(len(self._buffer) - self._at, view.nbytes)
            view[:take] = self._buffer[self._at:self._at + take]
            self._at += take
            while take < view.nbytes:
                got = self._sock.recv_into(view[take:])
                if not got:
                    raise ConnectionError("the server closed the connection mid-reply")
                take += got


class RedisTier(ClientTier):
    """A ``StoredTier`` over the ``redis`` client (any Redis 6+ or Valkey server).

    * **No silent overwrite.** Every put is ``SET key value NX``. A key that already holds a
      value is read back and verified: whole, this key's, of the same checksum → True
      (content-addressed: same key, same content); anything else is replaced by a plain ``SET``
      (an atomic remove-and-write; Redis has no leases to refuse it) → True. A value that
      vanished between the two steps is written again with ``NX``.
    * **Empty reads.** ``MGET`` answers None for a missing key → MISSING.
    * **Wrong values.** A value failing ``verify`` (torn, flipped, of another length) is
      CORRUPT, another key's whole value FOREIGN; both are then deleted, best effort.
    * **Deadlines.** ``lease_s`` is the read deadline (Redis grants no leases): a batch whose
      ``MGET`` took longer than that from start to finish (by ``clock``) answers LATE for every
      key, even where bytes verify (the value may have been replaced meanwhile). A read past
      ``socket_timeout_s`` is FAILED.
    * **Server down.** Connection errors, timeouts and error replies are FAILED (load) / False
      (put, remove, contains), never an exception; the client reconnects on the next call, so
      the tier works again as soon as the server is back (a restarted server without
      persistence has lost every key: MISSING). Every socket read and write of a call is
      bounded by ``socket_timeout_s`` and every connect by ``connect_timeout_s``, so a frozen
      server (``kill -STOP``) costs a call ``socket_timeout_s``, never a hang.
    * **Health.** :attr:`available` turns False (one warning on the ``kvfsm.tiers`` logger,
      :attr:`last_error` saying what failed) when the server does not answer a call (refused,
      reset, timed out, a reply that does not parse), and True (one info line) at the next call
      that it answers. While it is False each call first sends a ``PING`` bounded by
      ``probe_timeout_s`` and answers FAILED / False at once if that goes unanswered.
    * **Evictions.** With ``maxmemory`` and an ``allkeys-*`` policy the server drops values to
      make room; a key evicted (or deleted by anyone) before ``load_into`` is MISSING.

    Building one sends ``PING`` (connect and answer each bounded by ``connect_timeout_s``):
    nothing listening, a silent listener, a frozen server or another server's port is a
    :class:`TierConnectError` naming the address and what answered.
    """

    tier = Tier.REMOTE

    def __init__(self, address: str, *, prefix: str = "kvfsm/",
                 lease_s: float = DEFAULT_READ_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic,
                 socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise TierError(f"RedisTier needs the `redis` client ({exc}); install it with: "
                            "pip install 'redis>=5'") from exc
        for name, seconds in (("socket_timeout_s", socket_timeout_s),
                              ("connect_timeout_s", connect_timeout_s),
                              ("probe_timeout_s", probe_timeout_s)):
            if not seconds > 0:
                raise ValueError(f"RedisTier {name} must be > 0 seconds, got {seconds!r}")
        self.address = address
        self.prefix = prefix
        self.lease_s = lease_s
        self._clock = clock
        self._probe_timeout_s = probe_timeout_s
        self._health = Health(f"RedisTier({address})")
        self._redis = redis
        # OSError covers ConnectionError; ValueError is a reply that does not parse.
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError, ValueError)
        if "://" not in address:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise TierError(f"address must be 'host:port' or a redis:// URL, got "
                                f"{address!r}")

        def connect(socket_timeout: float, connect_timeout: float) -> Any:
            # No retries inside the client: a failed call is FAILED now, and the next one
            # reconnects.
            options: dict[str, Any] = {"socket_timeout": socket_timeout,
                                       "socket_connect_timeout": connect_timeout,
                                       "retry": Retry(NoBackoff(), 0), "protocol": 2}
            if "://" in address:
                return redis.Redis.from_url(address, **options)
            return redis.Redis(host=host, port=int(port), **options)

        self._connect = connect
        refused = self._ping(connect_timeout_s)
        if refused is not None:
            raise TierConnectError("Redis server", address, refused)
        self._client = connect(socket_timeout_s, connect_timeout_s)

    def close(self) -> None:
        """Close the connections; the stored values stay on the server."""
        super().close()

    # -- plumbing ------------------------------------------------------------------------------

    def _ping(self, timeout_s: float) -> str | None:
        """None if the server answers ``PING`` on a new connection, each step bounded by
        ``timeout_s``; else what was found there instead (for an error message)."""
        redis = self._redis
        probe = self._connect(timeout_s, timeout_s)
        try:
            answer = probe.ping()
        except redis.TimeoutError as exc:
            return (f"no answer to PING within {timeout_s:g} s ({exc}): a silent or frozen "
                    "server, or not Redis")
        except redis.AuthenticationError as exc:
            return f"it refused the credentials ({exc})"
        except redis.ConnectionError as exc:
            if "connecting" in str(exc):
                return f"nothing answers there ({exc})"
            return f"it closed the connection without answering PING ({exc}): not Redis?"
        except redis.ResponseError as exc:
            return f"it refused PING ({exc})"
        except self._errors as exc:
            return f"it answered PING with something that is not Redis's protocol ({exc})"
        finally:
            probe.close()
        if answer is not True:
            return f"it answered PING with {answer!r}, not PONG"
        return None

    def _usable(self) -> bool:
        """True unless the server is failing and still does not answer a short ``PING``."""
        if self._health.available:
            return True
        refused = self._ping(self._probe_timeout_s)
        if refused is None:
            return True
        self._health.failed(refused)
        return False

    def _failed(self, exc: Exception) -> None:
        self._health.failed(f"{type(exc).__name__}: {exc}")

    def _pipeline(self, command: str, calls: Sequence[tuple[Any, ...]],
                  **options: Any) -> list[Any] | None:
        """Run ``command(*args, **options)`` for each args in one pipeline; per call its reply
        (an exception object for an error reply), or None if the server did not answer."""
        client = self.client
        try:
            pipe = client.pipeline(transaction=False)
            for args in calls:
                getattr(pipe, command)(*args, **options)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            self._failed(exc)
            return None
        self._health.ok()
        return replies

    def _read(self, keys: Sequence[BlockKey], names: list[str],
              arrays: Sequence[NDArray[np.uint8]]) -> list[tuple[LoadStatus, int]] | None:
        """``MGET`` the values (one per ``MGET_BYTES``) and verify each in place (payload in
        ``arrays[i]``); per key (status, checksum), or None if the server did not answer."""
        pool = self.client.connection_pool
        conn: Any = None
        found: list[tuple[LoadStatus, int]] = []
        try:
            try:
                conn = pool.get_connection()
            except TypeError:  # redis < 5.3 wants a command name
                conn = pool.get_connection("MGET")
            first = 0
            while first < len(keys):
                last, size = first, 0
                while last < len(keys) and (last == first or size < MGET_BYTES):
                    size += arrays[last].nbytes
                    last += 1
                conn.send_command("MGET", *names[first:last])
                self._parse(_Reply(conn._sock), keys[first:last], arrays[first:last], found)
                first = last
        except self._errors as exc:
            self._failed(exc)
            if conn is not None:
                conn.disconnect()  # a reply read halfway leaves the connection unusable
            return None
        finally:
            if conn is not None:
                pool.release(conn)
        self._health.ok()
        return found

    @staticmethod
    def _parse(reply: _Reply, keys: Sequence[BlockKey], arrays: Sequence[NDArray[np.uint8]],
               found: list[tuple[LoadStatus, int]]) -> None:
        if reply.line() != b"*%d" % len(keys):
            raise ConnectionError("unexpected reply to MGET")
        head = np.empty(HEADER_BYTES, np.uint8)
        for key, out in zip(keys, arrays, strict=True):
            line = reply.line()
            if line in (b"$-1", b"_"):  # RESP2, RESP3 null
                found.append((LoadStatus.MISSING, 0))
                continue
            if line[:1] != b"$":
                raise ConnectionError(f"unexpected bulk header {line[:40]!r}")
            length, n = int(line[1:]), out.nbytes
            if length == HEADER_BYTES + n:
                reply.bulk_into(head.data, out.data)
                found.append(verify(key, head.data, out, n))
                continue
            whole = memoryview(bytearray(length))  # another length: torn or foreign
            reply.bulk_into(whole)
            status, _ = verify(key, whole[:HEADER_BYTES], whole[HEADER_BYTES:], n)
            found.append((LoadStatus.CORRUPT if status == LoadStatus.OK else status, 0))

    # -- the contract --------------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        if not len(keys) == len(payloads) == len(checksums):
            raise ValueError("put needs as many payloads and checksums as keys")
        done = np.zeros(len(keys), np.bool_)
        arrays = [byte_view(p, writable=False) for p in payloads]
        if len(keys) == 0 or not self._usable():
            return done
        names = self._names(keys)
        values = [b"".join((encode_header(key, a.nbytes, int(c)), a.data))
                  for key, a, c in zip(keys, arrays, checksums, strict=True)]
        replies = self._pipeline("set", list(zip(names, values, strict=True)), nx=True)
        if replies is None:
            return done
        done[:] = [r is True for r in replies]
        held = [i for i, r in enumerate(replies) if r is None]  # NX refused: a value is there
        if not held:
            return done
        scratch = [np.empty(arrays[i].nbytes, np.uint8) for i in held]
        found = self._read([keys[i] for i in held], [names[i] for i in held], scratch)
        if found is None:
            return done
        keep: list[int] = []
        replace: list[int] = []
        again: list[int] = []
        for i, (status, checksum) in zip(held, found, strict=True):
            if status == LoadStatus.OK and checksum == int(checksums[i]):
                keep.append(i)
            else:
                (again if status == LoadStatus.MISSING else replace).append(i)
        done[keep] = True
        for chosen, options in ((replace, {}), (again, {"nx": True})):
            if chosen:
                written = self._pipeline("set", [(names[i], values[i]) for i in chosen],
                                         **options)
                if written is not None:
                    done[chosen] = [r is True for r in written]
        return done

    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        if len(keys) != len(outs):
            raise ValueError("load_into needs as many output buffers as keys")
        arrays = [byte_view(o, writable=True) for o in outs]
        status = np.full(len(keys), LoadStatus.FAILED, np.uint8)
        checksum = np.zeros(len(keys), np.uint64)
        if len(keys) == 0 or not self._usable():
            return LoadResult(status, checksum)
        names = self._names(keys)
        start = self._clock()
        found = self._read(keys, names, arrays)
        if found is None:
            return LoadResult(status, checksum)
        if self._clock() - start > self.lease_s:
            status[:] = LoadStatus.LATE
            return LoadResult(status, checksum)
        status[:] = [f[0] for f in found]
        checksum[:] = [f[1] for f in found]
        bad = [(names[i],) for i, (f, _) in enumerate(found)
               if f in (LoadStatus.CORRUPT, LoadStatus.FOREIGN)]
        if bad:
            self._pipeline("delete", bad)
        return LoadResult(status, checksum)

    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        if len(keys) == 0 or not self._usable():
            return np.zeros(len(keys), np.bool_)
        replies = self._pipeline("exists", [(name,) for name in self._names(keys)])
        if replies is None:
            return np.zeros(len(keys), np.bool_)
        return np.array([r == 1 for r in replies], np.bool_)

    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        if len(keys) == 0 or not self._usable():
            return np.zeros(len(keys), np.bool_)
        replies = self._pipeline("delete", [(name,) for name in self._names(keys)])
        if replies is None:
            return np.zeros(len(keys), np.bool_)
        return np.array([isinstance(r, int) for r in replies], np.bool_)
