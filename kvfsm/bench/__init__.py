"""Benchmarks behind ``kvfsm bench``; each reports figures measured in one run."""

from kvfsm.bench._fsm import bench_fsm

__all__ = ["bench_fsm"]
