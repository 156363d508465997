"""A serving engine in its own process, for ``tests/test_serve_shared.py`` (not a test module).

    python -m tests.serve_worker --model gpt_oss --salt SALT --disk DIR \
        [--address HOST:PORT --prefix PREFIX]

Run from the repository root (``-m``, so that the checkout's ``kvfsm`` is the one imported). It
builds the tiny seeded model of ``--model`` (``kvfsm.serve.tiny_model(model, seed=0)``: the same
weights as any other process building it), an engine of :func:`engine_for` with a disk tier in
``DIR`` and, given ``--address``, a Mooncake Store tier on that master (values keyed under
``--prefix``), prints ``{"ready": true, "pid": ...}`` and answers one JSON command per stdin line
with one JSON line on stdout:

* ``{"op": "serve", "requests": [[rid, tokens, max_new_tokens], ...]}``: ``serve`` in ``kvfsm``
  mode (``Level.FULL``; restores waited for up to :data:`RESTORE_TIMEOUT_S`). The answer has one
  :func:`result_json` per request and the core's invariant problems (none expected).
* ``{"op": "exit"}`` (or the end of stdin): close everything and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any, Final

from kvfsm import CoreConfig, Engine
from kvfsm.spec import Tier
from kvfsm.tiers import DiskTier, MooncakeTier, StoredTier

#: Seconds a request waits for its restores: far beyond what they take, so that on a busy
#: machine a slow load never shortens what is reused (the tests compare reuse exactly).
RESTORE_TIMEOUT_S: Final = 30.0
#: Memory a Mooncake client lends the store for the values it puts.
SEGMENT_BYTES: Final = 64 << 20
#: What a disk tier may hold: far more than the engine's disk blocks, so the tier's own cap
#: never evicts.
DISK_BYTES: Final = 1 << 30


def engine_for(decl: Any, tiers: Mapping[str, StoredTier], salt: str) -> Engine:
    """An engine with room for every block of the tests' workloads on device and host (nothing
    is given back while serving) and in each stored tier of ``tiers``."""
    return Engine(decl, CoreConfig(
        device_blocks=96, host_blocks=96, disk_blocks=256 if "disk" in tiers else 0,
        remote_blocks=256 if "remote" in tiers else 0, cache_salt=salt, backend="numpy"),
        tiers=dict(tiers))


def mooncake_tier(address: str, prefix: str, lease_s: float | None = None) -> MooncakeTier:
    options: dict[str, Any] = {} if lease_s is None else {"lease_s": lease_s}
    return MooncakeTier(address, prefix=prefix, global_segment_bytes=SEGMENT_BYTES,
                        local_buffer_bytes=16 << 20, **options)


def result_json(result: Any) -> dict[str, Any]:
    """A ``serve`` Result as JSON: its numbers, greedy tokens, first-step logits (float32 values
    written exactly) and restore steps."""
    return {"rid": result.rid, "prompt_tokens": result.prompt_tokens,
            "hit_tokens": result.hit_tokens, "usable_tokens": result.usable_tokens,
            "restorable_tokens": result.restorable_tokens,
            "reused_tokens": result.reused_tokens, "tokens": list(result.tokens),
            "logits": [float(x) for x in result.logits.tolist()],
            "steps": [list(step) for step in result.steps],
            "restore": {"restored": result.restore.restored, "failed": result.restore.failed,
                        "lost": result.restore.lost, "pending": result.restore.pending}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--salt", required=True)
    parser.add_argument("--disk", required=True)
    parser.add_argument("--address")
    parser.add_argument("--prefix", default="kvfsm/")
    args = parser.parse_args(argv)

    import torch

    from kvfsm.lookup import Level
    from kvfsm.serve import declare, tiny_config, tiny_model
    from kvfsm.serve._loop import Request, serve

    torch.set_num_threads(1)
    model = tiny_model(args.model, seed=0)
    tiers: dict[str, StoredTier] = {"disk": DiskTier(args.disk, capacity_bytes=DISK_BYTES,
                                                     fsync=False)}
    if args.address:
        tiers["remote"] = mooncake_tier(args.address, args.prefix)
    engine = engine_for(declare(tiny_config(args.model)), tiers, args.salt)

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        say({"ready": True, "pid": os.getpid(),
             "remote": Tier.REMOTE in engine.tiers})
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "exit":
                break
            if command.get("op") == "serve":
                requests = [Request(rid, tokens, new) for rid, tokens, new in command["requests"]]
                results = serve(model, engine, requests, "kvfsm", level=Level.FULL,
                                restore_timeout=RESTORE_TIMEOUT_S)
                say({"results": [result_json(r) for r in results],
                     "invariants": engine.core.check_invariants()})
            else:
                say({"error": f"unknown command {command!r}"})
    finally:
        engine.close()
        for tier in tiers.values():
            tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
