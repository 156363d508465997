"""Prefixes served by one engine and reused by another, on the three tiny real models: an engine
restarted on the same disk directory, and a second engine in another process reading the first
one's blocks from the same Mooncake Store.

Engine A serves questions over two documents (prompt lengths on and off the 16-token block
boundaries) and pushes every block of every cache group down the tiers (``offload``, then
``spill_down``): to disk for a restart, to the remote store for a second engine. Engine B then
serves prompts sharing those prefixes. Each output must be the one recomputing gives (greedy
tokens identical, first-step logits within :data:`TOLERANCE`), and B must reuse, restored from
the stored copies and verified, exactly as many tokens of each prompt as A could reuse from its
own device: no reuse is lost by moving a prefix to another engine. Before every cache kind a
prefix needs was stored (sliding windows stopped at host, compressed history and recurrent
snapshots at disk), B restored nothing of a GPT-OSS or DeepSeek-V4 prefix after a restart, and
nothing of any model's prefix from the store (DeepSeek-V4 could not even attach a remote tier).

The Mooncake master is started per module on 127.0.0.1 (skipped where it cannot run, except under
``CI=true``, where that fails); B runs in ``tests/serve_worker.py``, and A stays up while B reads,
since a Mooncake value lives in the segment of the client that put it.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfsm import Engine
from kvfsm.lookup import Level
from kvfsm.serve import declare, tiny_config, tiny_model
from kvfsm.serve._loop import Request, Result, serve
from kvfsm.spec import Tier
from kvfsm.tiers import DiskTier, MooncakeMaster
from kvfsm.tiers._servers import _die_with_parent
from tests.line_worker import LineWorker
from tests.serve_worker import DISK_BYTES, RESTORE_TIMEOUT_S, engine_for, mooncake_tier

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["deepseek_v4", "qwen3_next", "gpt_oss"]
#: The serve tests' tolerance on first-step logits against recomputing.
TOLERANCE = 1e-4
NEW_TOKENS = 4
#: Seconds to wait for one answer of engine B's process (it imports torch and builds a model).
ANSWER_TIMEOUT_S = 180.0
#: Each test's values go under a key prefix of their own on the module's master.
_RUNS = itertools.count()


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


#: Two documents: 100 tokens (its last block shared by no prompt) and 144 (nine whole blocks).
DOC1, DOC2 = tokens(1, 100), tokens(2, 144)
#: Engine A's questions, the documents interleaved: 112, 153, 128, 160, 105 and 144 tokens.
A_REQUESTS = [
    Request("a1", [*DOC1, *tokens(11, 12)], NEW_TOKENS),
    Request("a2", [*DOC2, *tokens(12, 9)], NEW_TOKENS),
    Request("a3", [*DOC1, *tokens(13, 28)], NEW_TOKENS),
    Request("a4", [*DOC2, *tokens(14, 16)], NEW_TOKENS),
    Request("a5", [*DOC1, *tokens(15, 5)], NEW_TOKENS),
    Request("a6", DOC2, NEW_TOKENS),
]
#: Engine B's: new questions over each document (120, 151, 176 tokens) and one of A's prompts.
B_REQUESTS = [
    Request("b1", [*DOC1, *tokens(21, 20)], NEW_TOKENS),
    Request("b2", [*DOC2, *tokens(22, 7)], NEW_TOKENS),
    Request("b3", A_REQUESTS[2].tokens, NEW_TOKENS),
    Request("b4", [*DOC2, *tokens(24, 32)], NEW_TOKENS),
]
#: B's first prompt over each document: nothing of it is on B's device before.
B_FIRSTS = ("b1", "b2")


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {name: tiny_model(name, seed=0) for name in MODELS}


def delta(a: Result | dict[str, Any], b: Result) -> float:
    logits = a["logits"] if isinstance(a, dict) else a.logits
    return float(np.abs(np.asarray(logits, dtype=np.float32) - b.logits).max())


def block_ids(engine: Engine, requests: Sequence[Request], group: str) -> np.ndarray[Any, Any]:
    """The ids of every block of ``requests``' prompts ``group`` caches."""
    size = engine.core.group(group).decl.block_size
    found = [engine.core.lookup_words(group, *engine.prompt(r.tokens).words(size))
             for r in requests]
    ids: np.ndarray[Any, Any] = np.unique(np.concatenate(found))
    return ids[ids >= 0]


def push_down(engine: Engine, requests: Sequence[Request], to: Tier) -> dict[str, list[str]]:
    """Every cached block of ``requests``, in every group, moved down to ``to``: offloaded from
    the device to host, then spilled host -> disk (-> remote). Answers the states the blocks
    are in afterwards, per group (``[to]`` where all got there)."""
    for name in engine.core.groups:
        ids = block_ids(engine, requests, name)
        engine.offload(name, ids)
        for upper in (Tier.HOST, Tier.DISK):
            if upper < to:
                engine.spill_down(name, upper, int(ids.size))
    return {name: sorted({engine.core.describe(name, int(i)).state
                          for i in block_ids(engine, requests, name).tolist()})
            for name in engine.core.groups}


def usable(engine: Engine, requests: Sequence[Request]) -> list[int]:
    return [engine.lookup(r.tokens, level=Level.FULL).usable_tokens for r in requests]


def check_outputs(reference: Sequence[Result], got: Sequence[Result | dict[str, Any]]) -> None:
    for ref, out in zip(reference, got, strict=True):
        rid, generated = (out["rid"], out["tokens"]) if isinstance(out, dict) else \
            (out.rid, out.tokens)
        assert tuple(generated) == ref.tokens, rid
        assert delta(out, ref) <= TOLERANCE, (rid, delta(out, ref))


def restored_from(result: dict[str, Any], tier: str) -> None:
    """Every step of ``result``'s restore loaded a copy from ``tier`` and verified it."""
    steps = result["steps"]
    assert steps, result["rid"]
    assert {(kind_tier, outcome, status) for _group, _kind, kind_tier, outcome, status
            in steps} == {(tier, "restored", "OK")}, (result["rid"], steps)


def as_json(result: Result) -> dict[str, Any]:
    return {"rid": result.rid, "steps": [list(step) for step in result.steps]}


# -- a restarted engine --------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_a_restarted_engine_reuses_every_prefix_from_disk(models: dict[str, Any], name: str,
                                                          tmp_path: Path) -> None:
    model, decl = models[name], declare(tiny_config(name))
    salt = f"test/restart/{name}/{time.monotonic_ns()}"
    reference = serve(model, None, A_REQUESTS, "nocache")
    disk = DiskTier(tmp_path, capacity_bytes=DISK_BYTES, fsync=False)
    a = engine_for(decl, {"disk": disk}, salt)
    try:
        check_outputs(reference, serve(model, a, A_REQUESTS, "kvfsm", level=Level.FULL))
        expected = usable(a, A_REQUESTS)  # what A reuses of each prompt from its own device
        assert all(length > 0 for length in expected), expected
        states = push_down(a, A_REQUESTS, Tier.DISK)
        assert a.core.check_invariants() == []
    finally:
        a.close()
        disk.close()

    disk = DiskTier(tmp_path, capacity_bytes=DISK_BYTES, fsync=False)
    b = engine_for(decl, {"disk": disk}, salt)
    try:
        served = serve(model, b, A_REQUESTS, "kvfsm", level=Level.FULL,
                       restore_timeout=RESTORE_TIMEOUT_S)
        assert b.core.check_invariants() == []
    finally:
        b.close()
        disk.close()
    check_outputs(reference, served)
    reused = [r.reused_tokens for r in served]
    assert reused == expected, (f"lost reuse {sum(expected) - sum(reused)} tokens; the blocks "
                                f"A left were {states}")
    # The first prompt over each document had nothing on B's device: every token it reused
    # was restored from A's files and verified.
    for first in ("a1", "a2"):
        result = next(r for r in served if r.rid == first)
        assert result.usable_tokens == 0 and result.restorable_tokens == result.reused_tokens
        restored_from(as_json(result), "disk")
    assert states == {group: ["disk"] for group in states}, states


# -- a second engine on the same Mooncake Store ---------------------------------------------------


class Worker(LineWorker):
    """Engine B: ``tests/serve_worker.py`` in a subprocess, ended by ``close()``."""

    def __init__(self, name: str, salt: str, disk: Path, address: str, prefix: str) -> None:
        disk.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        super().__init__(
            [sys.executable, "-m", "tests.serve_worker", "--model", name, "--salt", salt,
             "--disk", str(disk), "--address", address, "--prefix", prefix],
            disk.parent / f"worker-{name}.log", cwd=ROOT, env=env, timeout_s=ANSWER_TIMEOUT_S,
            preexec_fn=_die_with_parent)
        assert self.ready.get("ready") is True and self.ready.get("remote") is True, self.ready

    def serve(self, requests: Sequence[Request]) -> list[dict[str, Any]]:
        answer = self.ask(op="serve", requests=[
            [r.rid, list(r.tokens), r.max_new_tokens] for r in requests])
        assert answer.get("invariants") == [], answer
        results: list[dict[str, Any]] = answer["results"]
        return results


@pytest.fixture(scope="module")
def b_reference(models: dict[str, Any]) -> dict[str, list[Result]]:
    return {name: serve(models[name], None, B_REQUESTS, "nocache") for name in MODELS}


@pytest.mark.parametrize("name", MODELS)
def test_a_second_engine_reuses_the_shared_prefixes_from_mooncake(
        models: dict[str, Any], b_reference: dict[str, list[Result]], name: str,
        master: MooncakeMaster, tmp_path: Path) -> None:
    model, decl = models[name], declare(tiny_config(name))
    salt = f"test/shared/{name}/{time.monotonic_ns()}"
    prefix = f"kvfsm-shared-{next(_RUNS)}/"
    disk = DiskTier(tmp_path / "a", capacity_bytes=DISK_BYTES, fsync=False)
    remote = mooncake_tier(master.address, prefix, master.lease_s)
    a = engine_for(decl, {"disk": disk, "remote": remote}, salt)
    try:
        check_outputs(serve(model, None, A_REQUESTS, "nocache"),
                      serve(model, a, A_REQUESTS, "kvfsm", level=Level.FULL))
        # What A could reuse of B's prompts from its own device: the shared prefixes.
        expected = usable(a, B_REQUESTS)
        assert all(length > 0 for length in expected), expected
        states = push_down(a, A_REQUESTS, Tier.REMOTE)
        assert a.core.check_invariants() == []
        # A stays up while B reads: the values live in A's client's segment.
        worker = Worker(name, salt, tmp_path / "b", master.address, prefix)
        try:
            served = worker.serve(B_REQUESTS)
        finally:
            worker.close()
    finally:
        a.close()
        remote.close()
        disk.close()
    check_outputs(b_reference[name], served)
    reused = [r["reused_tokens"] for r in served]
    assert reused == expected, (f"lost reuse {sum(expected) - sum(reused)} tokens; the blocks "
                                f"A left were {states}")
    by_rid = {r["rid"]: r for r in served}
    for first in B_FIRSTS:
        result = by_rid[first]
        assert result["usable_tokens"] == 0, result["rid"]
        assert result["restorable_tokens"] == result["reused_tokens"], result["rid"]
        restored_from(result, "remote")
    # A's own prompt: the document from B's device, A's question's blocks from the store.
    assert by_rid["b3"]["restore"]["restored"] > 0 and by_rid["b3"]["usable_tokens"] > 0
    restored_from(by_rid["b3"], "remote")
    assert states == {group: ["remote"] for group in states}, states


def test_the_workload_has_prompts_on_and_off_block_boundaries() -> None:
    lengths = [len(r.tokens) for r in (*A_REQUESTS, *B_REQUESTS)]
    assert any(n % 16 == 0 for n in lengths) and any(n % 16 for n in lengths), lengths
