"""Count how a serving load lays out each prompt's blocks: runs of consecutive block ids per
lease, in a steady state where every commit must give back other prompts' blocks for room.

A lookup confirms the next block of a run without the hash table, and a lease pins a group's
blocks by whole chunks only when they are one run, so the number of runs per prompt says how
much of those fast paths a load keeps. Prints one JSON object.

Usage: ``python tools/block_runs.py [--model NAME] [--blocks N] [--requests R] [--seed S]``.

Each request is a prompt of 2 048 to 12 000 tokens, half of them after a shared 4 096-token
prefix, committed into a device pool of ``N`` blocks per group (no host tier: room is made by
evicting the least recently used blocks), looked up and leased. Per group: the median, mean
and largest number of runs of consecutive ids among the leased blocks, and how many steps
between neighbouring blocks went down by one (a batch handed back reversed).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from kvfsm import CoreConfig, Engine, shipped_models

#: Prompt lengths are drawn from this range, in tokens, and token ids below VOCABULARY.
SHORTEST, LONGEST = 2048, 12000
SHARED_PREFIX = 4096
VOCABULARY = 50_000


def block_runs(model: str = "dense", blocks: int = 2000, requests: int = 300,
               seed: int = 1) -> dict[str, object]:
    """Runs of consecutive ids per lease and group over ``requests`` commit, lookup and
    lease steps on one engine of ``blocks`` device blocks per group."""
    rng = np.random.default_rng(seed)
    engine = Engine(shipped_models()[model],
                    CoreConfig(device_blocks=blocks, host_blocks=0, backend="numpy"))
    shared = rng.integers(0, VOCABULARY, SHARED_PREFIX)
    runs: dict[str, list[int]] = {name: [] for name in engine.core.groups}
    descending = dict.fromkeys(engine.core.groups, 0)
    try:
        for _ in range(requests):
            own = rng.integers(0, VOCABULARY, int(rng.integers(SHORTEST, LONGEST)))
            text = np.concatenate([shared, own]) if rng.random() < 0.5 else own
            prompt = engine.prompt(text)
            engine.commit(prompt)
            with engine.lease(engine.lookup(prompt), prompt) as lease:
                for name in lease.groups:
                    ids = lease.blocks(name)
                    if ids.size:
                        steps = np.diff(ids)
                        runs[name].append(int((steps != 1).sum()) + 1)
                        descending[name] += int((steps == -1).sum())
    finally:
        engine.close()
    return {
        "model": model, "blocks": blocks, "requests": requests, "seed": seed,
        "groups": {name: {"leases": len(counts),
                          "runs_median": statistics.median(counts) if counts else None,
                          "runs_mean": round(statistics.fmean(counts), 2) if counts else None,
                          "runs_max": max(counts, default=None),
                          "descending_steps": descending[name]}
                   for name, counts in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dense", choices=sorted(shipped_models()))
    parser.add_argument("--blocks", type=int, default=2000, help="device blocks per group")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(block_runs(args.model, args.blocks, args.requests, args.seed), indent=1))


if __name__ == "__main__":
    main()
