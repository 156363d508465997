"""A TCP proxy on 127.0.0.1 that can turn into a black hole: it keeps accepting connections and
silently stops forwarding in both directions, as a network path that drops every packet.

Used by ``tools/store_outage.py`` (a remote store's client connects through it from the start)
and its test. Two ways a hole ends, as real ones do:

* ``"drop"`` (default): the connections that were open while the hole lasted stay silent for
  good, as behind a middlebox (a NAT, a load balancer, a stateful firewall) that lost their
  state: whatever a client sends on them is swallowed and nothing ever answers, until the
  client gives up and closes them. Connections made after the hole forward at once.
* ``"hold"``: bytes wait while the hole lasts and are delivered after it, as TCP retransmits
  them across a partition that heals before the connection gives up.

Either way a connection made during the hole is accepted (the client's connect succeeds) and
answered by nothing. A store that is down (nothing listens upstream) shows as a connection the
proxy closes at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Final

_HOST: Final = "127.0.0.1"
_CHUNK: Final = 1 << 16
MODES: Final = ("drop", "hold")


class _Pair:
    """One client connection and its upstream connection (None until made)."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        #: Swallowed for good (``"drop"``): nothing is forwarded on it any more.
        self.dead = False
        self.lock = threading.Lock()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()

    def drop_upstream(self) -> None:
        """Forget the upstream side (the client is left hanging)."""
        with self.lock:
            self.dead = True
            upstream, self.upstream = self.upstream, None
        if upstream is not None:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                upstream.close()


class BlackHole:
    """A proxy from :attr:`address` to ``127.0.0.1:upstream_port``; :meth:`swallow` opens the
    hole, :meth:`heal` closes it (see the module for ``mode``)."""

    def __init__(self, upstream_port: int, *, mode: str = "drop") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.upstream_port = upstream_port
        self.mode = mode
        self._listener = socket.create_server((_HOST, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        #: Set while bytes flow (no hole).
        self._flowing = threading.Event()
        self._flowing.set()
        self._pairs: set[_Pair] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name="blackhole-accept")
        self._accepter.start()

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    @property
    def swallowing(self) -> bool:
        return not self._flowing.is_set()

    def swallow(self) -> None:
        """Open the hole: from now on nothing is forwarded either way."""
        self._flowing.clear()
        if self.mode == "drop":
            with self._lock:
                pairs = list(self._pairs)
            for pair in pairs:
                pair.drop_upstream()

    def heal(self) -> None:
        """Close the hole: new connections forward again (``"hold"``: held bytes go on)."""
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._serve, args=(pair,), daemon=True,
                             name="blackhole-pair").start()

    def _serve(self, pair: _Pair) -> None:
        if self.swallowing:
            if self.mode == "drop":
                pair.dead = True
            else:
                self._flowing.wait()
        if not pair.dead:
            try:
                upstream = socket.create_connection((_HOST, self.upstream_port), timeout=2.0)
            except OSError:  # nothing listens: the store is down, say so at once
                self._forget(pair)
                return
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with pair.lock:
                if pair.dead:  # the hole opened meanwhile
                    upstream.close()
                else:
                    pair.upstream = upstream
        if pair.upstream is not None:
            threading.Thread(target=self._pump, args=(pair, False), daemon=True,
                             name="blackhole-down").start()
        self._pump(pair, True)

    def _pump(self, pair: _Pair, from_client: bool) -> None:
        """Forward one direction until either side closes; swallow while the hole lasts."""
        source = pair.client if from_client else pair.upstream
        if source is None:
            return
        while True:
            try:
                data = source.recv(_CHUNK)
            except OSError:
                data = b""
            if not data:
                break
            if self.swallowing and self.mode == "drop":
                pair.drop_upstream()
            if not pair.dead:
                self._flowing.wait()  # "hold": delivered once the hole heals
            target = pair.upstream if from_client else pair.client
            if pair.dead or target is None:
                if from_client:
                    continue  # swallowed: keep draining what the client sends
                return  # the upstream side of a dead pair is gone
            try:
                target.sendall(data)
            except OSError:
                break
        if pair.dead and not from_client:
            return  # never tell the client anything about a swallowed connection
        self._forget(pair)

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)
        pair.close()
