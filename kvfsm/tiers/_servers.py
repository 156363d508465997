"""Real store servers on loopback, for tests, benchmarks and single-host runs of remote tiers.

``MooncakeMaster`` runs ``mooncake_master`` (the Mooncake Store's metadata master; values live in
the segments that clients mount) and ``RedisServer`` runs ``redis-server``. Both bind 127.0.0.1
only, on free ports, and are context managers: ``start()`` waits until the server answers,
``stop()`` terminates it (and kills it after a timeout), ``restart()`` brings it back on the same
port so clients can reconnect, ``pause()`` / ``resume()`` freeze and thaw it (a hung server that
still accepts connections), and an ``atexit`` hook stops whatever is still running. A missing
binary is a :class:`TierError` that says how to install it. Servers started from the main thread
also die with their parent (Linux ``PR_SET_PDEATHSIG``), so not even a killed test run leaves one
behind.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Final

from kvfsm.tiers._contract import TierError

_HOST: Final = "127.0.0.1"
#: Default seconds to wait for a server to answer after it is spawned.
READY_TIMEOUT_S: Final = 15.0
#: Seconds to wait for a paused server to be stopped (SIGSTOP is delivered asynchronously).
_PAUSE_TIMEOUT_S: Final = 5.0
_POLL_S: Final = 0.01


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the bind-port-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the thread that spawned it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Server:
    """One server process on loopback; subclasses say how to run it and how to ask if it is up."""

    binary: str = ""
    install_hint: str = ""

    def __init__(self, *, port: int | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                 stop_timeout_s: float = 5.0) -> None:
        self.port = port if port is not None else 0
        self._pick_port = port is None
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._log: IO[bytes] | None = None

    # -- what subclasses say -------------------------------------------------------------------

    def _command(self, executable: str) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    def _pick_ports(self) -> None:
        self.port = free_port()

    # -- life cycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``"127.0.0.1:PORT"``, what a client connects to."""
        return f"{_HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def workdir(self) -> Path:
        """The server's own temporary directory (its working directory and log), made on the
        first start and removed by ``stop()``."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"kvfsm-{self.binary}-"))
        return self._workdir

    @property
    def log_path(self) -> Path:
        """The server's stdout and stderr."""
        return self.workdir / "server.log"

    def executable(self) -> str:
        """The binary next to this Python first (a virtualenv's ``bin``), else on ``PATH``."""
        beside = Path(sys.executable).parent / self.binary
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        found = shutil.which(self.binary)
        if found is None:
            raise TierError(f"`{self.binary}` was not found next to {sys.executable} nor on "
                            f"PATH; install it with: {self.install_hint}")
        return found

    def start(self) -> None:
        """Spawn the server and wait until it answers; retry on a new port if the one picked was
        taken meanwhile. A no-op if it is already running."""
        if self.running:
            return
        executable = self.executable()
        attempts = 3 if self._pick_port else 1
        for attempt in range(attempts):
            if self._pick_port and (attempt > 0 or self.port == 0):
                self._pick_ports()
            if self._spawn(executable):
                atexit.register(self.stop)
                return
        tail = self._log_tail()
        self.stop()
        raise TierError(f"{self.binary} did not answer on {self.address} within "
                        f"{self.ready_timeout_s:g} s; its log ended with:\n{tail}")

    def _spawn(self, executable: str) -> bool:
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        main = threading.current_thread() is threading.main_thread()
        self._process = subprocess.Popen(
            self._command(executable), cwd=self.workdir, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if main and sys.platform == "linux" else None)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if self._answers():
                return True
            time.sleep(0.02)
        self._terminate()
        return False

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``stop_timeout_s``) and wait for it.
        Safe to call twice; stored values of an in-memory server are gone afterwards."""
        self._terminate()
        self._close_log()
        atexit.unregister(self.stop)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def kill(self) -> None:
        """SIGKILL the server at once, as a crash would (``start()`` or ``restart()`` again)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def pause(self) -> None:
        """SIGSTOP the server and wait until it is stopped: it keeps its port and the kernel
        still accepts connections for it, but it answers nothing, as a hung server would
        (``resume()`` thaws it; ``stop()`` also works on a paused server)."""
        process = self._running_process("pause")
        process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + _PAUSE_TIMEOUT_S
        while not _stopped(process.pid):
            if time.monotonic() > deadline:
                raise TierError(f"{self.binary} (pid {process.pid}) did not stop within "
                                f"{_PAUSE_TIMEOUT_S:g} s of SIGSTOP")
            time.sleep(_POLL_S)

    def resume(self) -> None:
        """SIGCONT a paused server: it answers again, with everything it held."""
        self._running_process("resume").send_signal(signal.SIGCONT)

    def _running_process(self, action: str) -> subprocess.Popen[bytes]:
        process = self._process
        if process is None or process.poll() is not None:
            raise TierError(f"cannot {action} {self.binary} on {self.address}: not running")
        return process

    def restart(self) -> None:
        """Stop (if running) and start again on the same port(s), so clients can reconnect."""
        self._terminate()
        pick, self._pick_port = self._pick_port, False
        try:
            self.start()
        finally:
            self._pick_port = pick

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server acts on SIGTERM only once thawed
        process.terminate()
        try:
            process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.address}, {state})"


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (Linux ``/proc``; elsewhere assumed at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def _connects(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((_HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster(_Server):
    """``mooncake_master`` on 127.0.0.1: an RPC port for clients and a metrics port.

    ``lease_ttl_ms`` sets ``--default_kv_lease_ttl``, how long a read keeps a value from being
    removed (the master's default is 10 s; :attr:`lease_s` is what a ``MooncakeTier`` should be
    given). ``extra_args`` are passed through (``--flag=value``)."""

    binary = "mooncake_master"
    install_hint = "pip install mooncake-transfer-engine-non-cuda && apt-get install -y libibverbs1"
    #: The master's own default of ``--default_kv_lease_ttl``.
    DEFAULT_LEASE_TTL_MS: Final = 10_000

    def __init__(self, *, port: int | None = None, metrics_port: int | None = None,
                 lease_ttl_ms: int | None = None, extra_args: tuple[str, ...] = (),
                 ready_timeout_s: float = READY_TIMEOUT_S, stop_timeout_s: float = 5.0) -> None:
        super().__init__(port=port, ready_timeout_s=ready_timeout_s,
                         stop_timeout_s=stop_timeout_s)
        self.metrics_port = metrics_port if metrics_port is not None else 0
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = extra_args

    @property
    def lease_s(self) -> float:
        """Seconds a read's lease lasts on this master."""
        ttl = self.DEFAULT_LEASE_TTL_MS if self.lease_ttl_ms is None else self.lease_ttl_ms
        return ttl / 1000.0

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        while self.metrics_port == self.port:
            self.metrics_port = free_port()

    def _command(self, executable: str) -> list[str]:
        if self.metrics_port == 0:
            self.metrics_port = free_port()
        command = [executable, f"--rpc_address={_HOST}", f"--rpc_port={self.port}",
                   f"--metrics_host={_HOST}", f"--metrics_port={self.metrics_port}"]
        if self.lease_ttl_ms is not None:
            command.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        return command + list(self.extra_args)

    def _answers(self) -> bool:
        return _connects(self.port)


class RedisServer(_Server):
    """``redis-server`` on 127.0.0.1 without persistence (``--save "" --appendonly no``).

    ``maxmemory`` (bytes, or a Redis size such as ``"4mb"``) caps its memory; with the default
    ``maxmemory_policy="allkeys-lru"`` the server then evicts keys to make room, as a shared cache
    would. Readiness is a ``PING`` answered with ``PONG``."""

    binary = "redis-server"
    install_hint = "apt-get install -y redis-server (or any Redis/Valkey 6+ server on PATH)"

    def __init__(self, *, port: int | None = None, maxmemory: int | str | None = None,
                 maxmemory_policy: str = "allkeys-lru", extra_args: tuple[str, ...] = (),
                 ready_timeout_s: float = READY_TIMEOUT_S, stop_timeout_s: float = 5.0) -> None:
        super().__init__(port=port, ready_timeout_s=ready_timeout_s,
                         stop_timeout_s=stop_timeout_s)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = extra_args

    def _command(self, executable: str) -> list[str]:
        command = [executable, "--bind", _HOST, "--port", str(self.port), "--save", "",
                   "--appendonly", "no", "--dir", str(self.workdir)]
        if self.maxmemory is not None:
            command += ["--maxmemory", str(self.maxmemory),
                        "--maxmemory-policy", self.maxmemory_policy]
        return command + list(self.extra_args)

    def _answers(self) -> bool:
        try:
            with socket.create_connection((_HOST, self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False
