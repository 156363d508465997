"""Engine A of ``tests/test_two_engines.py``, run in its own process (not a test module).

    python tests/engine_worker.py --backend redis --address 127.0.0.1:6379 --disk DIR

It mounts a disk tier in ``DIR`` and a remote tier (``MooncakeTier`` or ``RedisTier``) on the
store at ``--address``, prints ``{"ready": true, "pid": ...}`` and then answers one JSON command
per stdin line with one JSON line on stdout:

* ``{"op": "spill", "start": S, "blocks": N, "seed": K}``: a fresh ``dense`` engine commits the
  prompt ``token_ids(S, N)`` with :func:`block_content` as each block's bytes and pushes every
  block down, one tier at a time (device -> host -> disk -> remote). The answer names the
  blocks' positions, the xxh3-64 of each block's bytes as the engine read them back, their
  states afterwards (``"remote"`` where the store took them), their store keys and the core's
  invariant problems (none expected).
* ``{"op": "exit"}`` (or the end of stdin): close everything and exit 0.

The process stays alive between commands on purpose: a Mooncake value lives in the segment of
the client that put it, so the reader must read before this process exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, Tier
from kvfsm.state import GroupState
from kvfsm.tiers import DiskTier, MooncakeTier, RedisTier, StoredTier

MODEL = "dense"
GROUP = "attn"
#: Tokens past the last whole block, so a lookup can cover every block (it leaves at least one
#: token of the prompt to compute).
TAIL = 3
#: The most blocks one spill command may commit (the engine's pools are sized for it).
MAX_BLOCKS = 64


def token_ids(start: int, blocks: int, block_size: int = 16) -> NDArray[np.int64]:
    """The prompt of ``blocks`` whole blocks starting at token id ``start``, plus ``TAIL``."""
    return np.arange(start, start + blocks * block_size + TAIL, dtype=np.int64)


def block_content(seed: int, positions: Any, width: int) -> NDArray[np.uint8]:
    """The bytes engine A writes for the blocks at ``positions``: one function of (seed,
    position), so any process can tell what a block of that prompt holds."""
    index = np.asarray(positions, dtype=np.int64).ravel()
    rows = np.empty((index.size, width), dtype=np.uint8)
    for row, position in enumerate(index.tolist()):
        rows[row] = np.random.default_rng([seed, position]).integers(0, 256, width,
                                                                     dtype=np.uint8)
    return rows


def remote_tier(backend: str, address: str, segment_bytes: int) -> StoredTier:
    if backend == "mooncake":
        return MooncakeTier(address, global_segment_bytes=segment_bytes,
                            local_buffer_bytes=16 << 20)
    if backend == "redis":
        return RedisTier(address)
    raise SystemExit(f"unknown backend {backend!r}")


def spill(disk: StoredTier, remote: StoredTier, start: int, blocks: int,
          seed: int) -> dict[str, Any]:
    """Commit one prompt on a fresh engine and push all its blocks down to the remote tier."""
    if not 0 < blocks <= MAX_BLOCKS:
        raise ValueError(f"blocks must be in 1..{MAX_BLOCKS}, got {blocks}")
    config = CoreConfig(device_blocks=MAX_BLOCKS, host_blocks=MAX_BLOCKS,
                        disk_blocks=MAX_BLOCKS, remote_blocks=MAX_BLOCKS, backend="numpy")
    engine = Engine(MODEL, config, tiers={"disk": disk, "remote": remote})
    try:
        size = engine.model.group(GROUP).block_size

        def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
            return block_content(seed, index, group.decl.payload_bytes)

        prompt = engine.prompt(token_ids(start, blocks, size))
        ids = engine.commit(prompt, payload=payload)[GROUP]
        core = engine.core
        sums = [xxhash.xxh3_64_intdigest(row) for row in core.read(GROUP, ids)]
        positions = [core.describe(GROUP, int(i)).position for i in ids.tolist()]
        engine.give_back(GROUP, int(ids.size))  # device -> host
        engine.spill_down(GROUP, Tier.HOST, int(ids.size))  # host -> disk
        engine.spill_down(GROUP, Tier.DISK, int(ids.size))  # disk -> remote
        keys = engine.restorer.keys.keys(GROUP, ids)
        prefix: str = getattr(remote, "prefix", "")
        return {"op": "spill", "block_size": size, "positions": positions, "sums": sums,
                "states": [core.describe(GROUP, int(i)).state for i in ids.tolist()],
                "keys": [prefix + key.name for key in keys],
                "invariants": core.check_invariants()}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["mooncake", "redis"], required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--disk", required=True)
    parser.add_argument("--segment-bytes", type=int, default=64 << 20)
    args = parser.parse_args(argv)
    disk = DiskTier(args.disk, capacity_bytes=1 << 30, fsync=False)
    remote = remote_tier(args.backend, args.address, args.segment_bytes)

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        say({"ready": True, "pid": os.getpid()})
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "exit":
                break
            if command.get("op") == "spill":
                say(spill(disk, remote, int(command["start"]), int(command["blocks"]),
                          int(command["seed"])))
            else:
                say({"error": f"unknown command {command!r}"})
    finally:
        remote.close()
        disk.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
