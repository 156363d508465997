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

:class:`BlackHoleProcess` runs the proxy in a process of its own (``python tools/blackhole.py
--upstream-port P``, told ``swallow`` / ``heal`` on stdin): its threads then never wait for the
GIL of the process under test, nor hold it up (Mooncake's client set-up blocks in C++ holding
the GIL, so an in-process proxy could not even forward its first call).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Final

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
                if pair.dead:  # the hole opened while this chunk was on its way
                    if from_client:
                        continue
                    return
                break
        if pair.dead and not from_client:
            return  # never tell the client anything about a swallowed connection
        self._forget(pair)

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)
        pair.close()


class BlackHoleProcess:
    """A :class:`BlackHole` in a child process; the same ``address``, ``swallow``, ``heal`` and
    ``close``. The child ends with its stdin (this process's end of it closing, or dying)."""

    def __init__(self, upstream_port: int, *, mode: str = "drop") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.upstream_port = upstream_port
        self.mode = mode
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--upstream-port",
             str(upstream_port), "--mode", mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.port = int(self._ask(None))
        self.swallowing = False

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    def _ask(self, command: str | None) -> str:
        stdin, stdout = self._pipes()
        if command is not None:
            stdin.write(command + "\n")
            stdin.flush()
        answer = stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the black-hole proxy exited ({self._process.poll()})")
        return answer

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None
        return stdin, stdout

    def swallow(self) -> None:
        self._ask("swallow")
        self.swallowing = True

    def heal(self) -> None:
        self._ask("heal")
        self.swallowing = False

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OSError):
                self._pipes()[0].close()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        with contextlib.suppress(OSError):
            self._pipes()[1].close()

    def __enter__(self) -> BlackHoleProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    """The child of :class:`BlackHoleProcess`: prints its port, then answers each ``swallow``
    or ``heal`` line with ``ok``; ends with stdin."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--mode", default="drop", choices=MODES)
    args = parser.parse_args()
    with BlackHole(args.upstream_port, mode=args.mode) as hole:
        print(hole.port, flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "swallow":
                hole.swallow()
            elif command == "heal":
                hole.heal()
            else:
                print(f"unknown command {command!r}", file=sys.stderr, flush=True)
                continue
            print("ok", flush=True)


if __name__ == "__main__":
    main()
