"""Timing helpers: medians of repeated runs, measured in one process so ratios are fair; and the
progress lines a long bench prints while it runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

#: Takes one progress line (the CLI prints it to stderr); benches print nothing without one.
ProgressFn = Callable[[str], None]

#: Least seconds between two run-count lines: short measurements stay quiet, long ones show life.
RUN_LINE_INTERVAL_S = 1.0


class Progress:
    """Progress lines of one bench, each prefixed with the bench's name (``bench lookup: ...``)."""

    def __init__(self, bench: str, emit: ProgressFn | None) -> None:
        self._prefix = f"{bench}: "
        self._emit = emit
        self._last_line = time.monotonic()

    def phase(self, what: str) -> None:
        """A line saying what is measured (or built) next."""
        self._say(f"{what}...")

    def runs(self, what: str) -> Callable[[int, int], None]:
        """A callback for :func:`median_seconds` that reports ``what: done/total runs``, at most
        one line per :data:`RUN_LINE_INTERVAL_S`."""

        def report(done: int, total: int) -> None:
            if time.monotonic() - self._last_line >= RUN_LINE_INTERVAL_S:
                self._say(f"{what}: {done}/{total} runs")

        return report

    def _say(self, text: str) -> None:
        if self._emit is not None:
            self._emit(self._prefix + text)
        self._last_line = time.monotonic()


def median_seconds(
    run: Callable[[], object],
    *,
    repeat: int,
    warmup: int = 1,
    on_run: Callable[[int, int], None] | None = None,
) -> float:
    """Median wall time of ``run()`` over ``repeat`` calls after ``warmup`` untimed calls;
    ``on_run(done, repeat)`` is called after each timed call, outside the timed span."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    for done in range(1, repeat + 1):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if on_run is not None:
            on_run(done, repeat)
    return statistics.median(times)
