"""Benchmarks behind ``kvfsm bench``; each reports figures measured in one run."""

from kvfsm.bench._fsm import bench_fsm
from kvfsm.bench._lookup import LENGTHS, POOL_SIZES, bench_lookup
from kvfsm.bench._restore import bench_restore, restore_table
from kvfsm.bench._state import bench_state

__all__ = ["LENGTHS", "POOL_SIZES", "bench_fsm", "bench_lookup", "bench_restore", "bench_state",
           "restore_table"]
