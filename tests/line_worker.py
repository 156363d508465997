"""A helper process spoken to in JSON lines: one command a line on its stdin, one answer a line
on its stdout, its stderr to a log file. The two-engine tests (tests/test_two_engines.py,
tests/test_serve_shared.py) and ``tools/shared_prefix.py`` drive their second engine this way.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self

#: Lines of the worker's log an error quotes.
LOG_TAIL_LINES = 30
#: Seconds a worker that is told to exit has before it is killed.
EXIT_WAIT_S = 30


class WorkerSilent(RuntimeError):
    """The worker gave no answer in time (or exited); the message ends with its log's tail."""


class LineWorker:
    """``argv`` started with pipes, its stderr in ``log_path``; its first answer (its ready
    line) is ``ready``. Always ended by :meth:`close` (or the context manager): told to exit,
    killed if it does not."""

    def __init__(self, argv: Sequence[str], log_path: Path, *, cwd: Path, timeout_s: float,
                 env: Mapping[str, str] | None = None,
                 preexec_fn: Callable[[], Any] | None = None) -> None:
        self.log_path, self.timeout_s = log_path, timeout_s
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        try:
            self.process = subprocess.Popen(
                list(argv), cwd=cwd, env=None if env is None else dict(env),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                preexec_fn=preexec_fn)
        except BaseException:
            self._log.close()
            raise
        try:
            self.ready = self.answer()
        except BaseException:
            self.close()
            raise

    def tail(self) -> str:
        """The last lines of the worker's log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def answer(self) -> dict[str, Any]:
        """The worker's next answer line, or :class:`WorkerSilent` after ``timeout_s``."""
        stdout = self.process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], self.timeout_s)
        line = stdout.readline() if readable else ""
        if not line:
            raise WorkerSilent(f"the worker gave no answer (exit code {self.process.poll()}); "
                               f"its log ends with:\n{self.tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        """Send ``command`` as one line; its answer."""
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()
        return self.answer()

    def close(self) -> None:
        process = self.process
        try:
            if process.poll() is None and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    process.stdin.close()
                process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
            self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
