"""Run every ``kvfsm bench`` measurement in one process and print one JSON object.

Usage: ``python tools/bench.py [--quick]`` (``--quick``: small sizes, for a smoke run).
Figures are ratios and rates measured in this run; compare runs on the same machine only.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfsm.bench import bench_fsm, bench_lookup, bench_state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    blocks = 20_000 if args.quick else 1_000_000
    tokens = 4_096 if args.quick else 131_072
    report = {
        "fsm": bench_fsm(blocks=blocks),
        "state": bench_state(blocks=blocks),
        "lookup": bench_lookup(tokens=tokens),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
