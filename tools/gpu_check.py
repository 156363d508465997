"""The GPU check: run the ``gpu``-marked memory tests, then time device <-> host copies.

Run from the repository root on a machine with CuPy and a CUDA device:
``python tools/gpu_check.py [--mib 256] [--repeats 5] [--no-tests]``. Where there is no usable
GPU it prints ``no GPU: skipped`` and exits 0, so CI may call it anywhere. The exit status is
pytest's when the tests ran (0 = all passed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # works from a checkout without an install

from kvfsm.memory import BackendUnavailable, CupyBackend, SlotPool  # noqa: E402
from kvfsm.spec import Tier  # noqa: E402

TEST_FILES = ("tests/test_memory_backend.py", "tests/test_memory_pool.py")


def _time(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, device work included."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _report(label: str, nbytes: int, seconds: float) -> None:
    print(f"  {label:<40} {nbytes / seconds / 1e9:7.2f} GB/s  ({seconds * 1e3:8.2f} ms)")


def bench_raw(backend: CupyBackend, nbytes: int, repeats: int) -> None:
    import cupy

    sync = backend.synchronize
    ramp = cupy.arange(256, dtype=cupy.uint8)
    dev = cupy.tile(ramp, -(-nbytes // 256))[:nbytes]  # a repeating 0..255 ramp, not zeros
    pinned = backend.pinned_host_zeros(nbytes, np.uint8)
    pageable = np.zeros(nbytes, dtype=np.uint8)
    d2h_pinned = _time(lambda: dev.get(out=pinned), sync, repeats)
    if not np.array_equal(pinned[:4096], np.tile(np.arange(256, dtype=np.uint8), 16)):
        raise SystemExit("device -> host copy returned wrong bytes")
    _report("device -> host, pinned", nbytes, d2h_pinned)
    _report("host -> device, pinned", nbytes, _time(lambda: dev.set(pinned), sync, repeats))
    d2h_pageable = _time(lambda: dev.get(out=pageable), sync, repeats)
    _report("device -> host, pageable", nbytes, d2h_pageable)
    h2d_pageable = _time(lambda: dev.set(pageable), sync, repeats)
    _report("host -> device, pageable", nbytes, h2d_pageable)


def bench_pool(backend: CupyBackend, nbytes: int, repeats: int) -> None:
    """The pool path: one batched gather on the device, one copy down, one host scatter."""
    sync = backend.synchronize
    width = 256 * 2**10
    n = max(nbytes // width, 1)
    src = SlotPool(Tier.DEVICE, n, width, backend=backend)
    dst = SlotPool(Tier.HOST, n, width, backend=backend, pinned=True)
    a, b = src.take(np.arange(n)), dst.take(np.arange(n))
    src.typed_view(np.uint8, width)[...] = 7
    src.record_checksum(a[:8])
    seconds = _time(lambda: src.copy_rows_to(a, dst, b), sync, repeats)
    _report(f"SlotPool.copy_rows_to {n} x 256 KiB d->h", n * width, seconds)
    if not dst.verify_checksum(b[:8]).all():
        raise SystemExit("checksums did not survive the pool copy")
    seconds = _time(lambda: dst.copy_rows_to(b, src, a), sync, repeats)
    _report(f"SlotPool.copy_rows_to {n} x 256 KiB h->d", n * width, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=256, help="copy size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per copy")
    parser.add_argument("--no-tests", action="store_true", help="only time the copies")
    args = parser.parse_args(argv)
    try:
        backend = CupyBackend()
    except BackendUnavailable as exc:
        print(f"no GPU: skipped ({exc})")
        return 0
    rc = 0
    if not args.no_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *TEST_FILES]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    nbytes = args.mib * 2**20
    print(f"device <-> host copies of {args.mib} MiB, median of {args.repeats}:")
    bench_raw(backend, nbytes, args.repeats)
    bench_pool(backend, nbytes, args.repeats)
    return rc


if __name__ == "__main__":
    sys.exit(main())
