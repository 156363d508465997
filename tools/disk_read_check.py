"""Throughput of ``DiskTier.load_into`` against a raw ``os.open`` + ``os.readv`` of the same
files into a preallocated array (64 values of 1 MiB, in page cache). Not a test: run it by hand,
``python tools/disk_read_check.py``."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import xxhash

from kvfsm.tiers import HEADER_BYTES, BlockKey, DiskTier

COUNT, SIZE, ROUNDS, REPEATS = 64, 1 << 20, 5, 12


def main() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (COUNT, SIZE), dtype=np.uint8)
    keys = [BlockKey(b"m" * 16, 1, 2, 3, i, i * 16, i * 16 + 16) for i in range(COUNT)]
    with tempfile.TemporaryDirectory() as root:
        tier = DiskTier(root, capacity_bytes=2 * COUNT * (SIZE + HEADER_BYTES), fsync=False)
        sums = np.array([xxhash.xxh3_64_intdigest(row) for row in data], dtype=np.uint64)
        assert tier.put(keys, list(data), sums).all()
        paths = [os.path.join(root, k.name + ".kvb") for k in keys]
        outs = np.zeros((COUNT, SIZE), dtype=np.uint8)
        raw = np.zeros((COUNT, SIZE + HEADER_BYTES), dtype=np.uint8)
        rows, views = list(outs), [row.data for row in raw]

        def tier_read() -> None:
            assert tier.load_into(keys, rows).ok.all()

        def raw_read() -> None:
            for path, view in zip(paths, views, strict=True):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.readv(fd, [view])
                finally:
                    os.close(fd)

        best: dict[str, float] = {}
        for _ in range(REPEATS):  # alternate, keep the best of each: the least disturbed
            for name, fn in (("raw", raw_read), ("tier", tier_read)):
                fn()  # warm
                start = time.perf_counter()
                for _ in range(ROUNDS):
                    fn()
                took = (time.perf_counter() - start) / ROUNDS
                best[name] = min(best.get(name, took), took)
        assert np.array_equal(outs, data)
        gib = COUNT * SIZE / (1 << 30)
        for name, took in best.items():
            print(f"{name:5s} {gib / took:6.2f} GiB/s ({took * 1e3:.2f} ms per batch)")
        print(f"ratio tier/raw: {best['raw'] / best['tier']:.3f}")


if __name__ == "__main__":
    main()
