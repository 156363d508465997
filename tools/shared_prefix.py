"""Cross-engine reuse of shared prefixes on the tiny real models, measured: a second engine on the
same Mooncake Store, and an engine restarted on the same disk directory.

Usage: ``python -m tools.shared_prefix [--models deepseek_v4,qwen3_next,gpt_oss] [--documents 2]
[--doc-tokens 500] [--questions 3] [--rounds 9] [--new-tokens 4]``, from the repository root (so
that this checkout's ``kvfsm`` is imported, here and in the worker process). It starts a
``mooncake_master`` on 127.0.0.1 and prints one JSON object on stdout; progress goes to stderr.
The tool installs nothing.

Per model (``kvfsm.serve.tiny_model(model, seed=0)``, one torch thread everywhere), the workload
is ``--documents`` random documents of ``--doc-tokens`` tokens, each followed by questions of 4
to 39 tokens (seeded). Engine A, in this process, serves ``--questions`` questions per document
(``serve`` in ``kvfsm`` mode) and then pushes every block of every cache group down the tiers
(``Engine.offload``, ``Engine.spill_down``). Engine B runs in a worker process (this file with
``--worker``), with its own disk tier:

* ``restart``: A has a disk tier only, pushes its blocks to disk and is closed; B opens the same
  directory and serves A's prompts again.
* ``shared``: A has a disk tier and a Mooncake tier and pushes its blocks to the store; B (a
  disk tier of its own, the same master) serves *other* questions over the same documents while A
  stays up (a Mooncake value lives in the segment of the client that put it).

Figures per scenario (``models.<model>.<scenario>``):

* Tokens of B's prompts (``serve`` in ``kvfsm`` mode): ``restored_tokens`` (reused, and not
  usable at B's first lookup of the prompt: made usable by restores from the stored tier, each
  copy loaded and verified; ``restored_blocks`` counts the blocks loaded, every group's),
  ``device_tokens`` (usable from B's own device at its first lookup, e.g. a document B restored
  for an earlier question), ``recomputed_tokens``;
  ``expected_tokens`` is what A could reuse of the same prompts from its own device before
  pushing its blocks down, ``lost_tokens`` what B reused less. ``outputs_match``: B's greedy
  tokens equal recomputing's and its first-step logits are within ``TOLERANCE`` of them
  (``max_logit_delta``). ``a_states``: the states A's blocks were in once pushed down.
* ``ttft``: B's time to first token on one new question per document whose prefix is only in
  the stored tier, against recomputing the same prompts, in paired rounds (their order
  alternated round by round, garbage collection off while timing). Restored: on a fresh engine
  over the same tiers (made outside the timing), ``Engine.lookup`` (which discovers the stored
  copies), ``Engine.restore(verdict, prompt).wait()`` and ``lookup``, ``CacheAdapter.rebuild``
  at the usable length, the rest of the prompt forwarded through ``CacheAdapter.prefill`` (in
  chunks ending at the capture points, as ``serve`` does, so that the prompt's new blocks could
  be committed), argmax. Recomputed: one forward of the whole prompt on an empty
  ``DynamicCache`` (last position's logits only), argmax. ``ratio`` is the median over rounds of
  restored / recomputed (below 1: restoring is faster; ``ratio_quartiles`` its spread);
  ``restored_ms`` and ``recompute_ms`` are medians per prompt, ``restored_parts_ms`` the
  restored path's parts (first lookup; restore, wait and lookup; rebuild; prefill of the rest);
  ``reused_tokens`` per round, against ``expected_tokens`` (A's usable length of the same
  prompts); ``max_logit_delta`` between the two paths' first-step logits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's kvfsm and tests.line_worker

import kvfsm  # noqa: E402
from kvfsm import CoreConfig, Engine  # noqa: E402
from kvfsm.spec import Tier  # noqa: E402
from kvfsm.tiers import DiskTier, MooncakeMaster, MooncakeTier, StoredTier, TierError  # noqa: E402
from tests.line_worker import LineWorker  # noqa: E402

MODELS: Final = ("deepseek_v4", "qwen3_next", "gpt_oss")
#: First-step logits of a reused prefix against recomputing (the serve tests' tolerance).
TOLERANCE: Final = 1e-4
#: Seconds a restore is waited for (far beyond what it takes: a slow load never shortens reuse).
RESTORE_TIMEOUT_S: Final = 30.0
#: Seconds to wait for one answer of the worker.
ANSWER_TIMEOUT_S: Final = 600.0
QUESTION_TOKENS: Final = (4, 40)
SEGMENT_BYTES: Final = 64 << 20
DISK_BYTES: Final = 1 << 30
BLOCK: Final = 16

Requests = list[tuple[str, list[int], int]]


def progress(line: str) -> None:
    print(f"shared prefix: {line}", file=sys.stderr, flush=True)


# -- the workload ----------------------------------------------------------------------------------


def workload(documents: int, doc_tokens: int, questions: int, new_tokens: int, seed: int = 0
             ) -> dict[str, Requests]:
    """``a``: A's questions, ``b``: other questions over the same documents (B's, shared),
    ``ttft``: one more question per document (timed); documents interleaved."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, doc_tokens).tolist() for _ in range(documents)]
    out: dict[str, Requests] = {}
    for name, count in (("a", questions), ("b", questions), ("ttft", 1)):
        out[name] = [(f"{name}{q}.{d}",
                      [*docs[d], *rng.integers(0, 1000, int(rng.integers(*QUESTION_TOKENS)))
                       .tolist()], new_tokens)
                     for q in range(count) for d in range(documents)]
    return out


def blocks_for(requests: Mapping[str, Requests]) -> int:
    """Blocks per group that hold every prompt of the workload (distinct or not)."""
    return max(64, sum(len(tokens) // BLOCK + 1 for reqs in requests.values()
                       for _, tokens, _ in reqs))


def engine_for(decl: Any, tiers: Mapping[str, StoredTier], salt: str, blocks: int) -> Engine:
    return Engine(decl, CoreConfig(
        device_blocks=blocks, host_blocks=blocks, disk_blocks=blocks if "disk" in tiers else 0,
        remote_blocks=blocks if "remote" in tiers else 0, cache_salt=salt, backend="numpy"),
        tiers=dict(tiers))


def mooncake_tier(address: str, prefix: str) -> MooncakeTier:
    return MooncakeTier(address, prefix=prefix, global_segment_bytes=SEGMENT_BYTES,
                        local_buffer_bytes=16 << 20)


# -- the worker (engine B) -------------------------------------------------------------------------


class _Served:
    """Engine B's side: one model, its tiers and engines (in the worker process)."""

    def __init__(self, model_type: str, salt: str, blocks: int, tiers: dict[str, StoredTier]
                 ) -> None:
        from kvfsm.serve import declare, tiny_config, tiny_model

        self.model = tiny_model(model_type, seed=0)
        self.decl = declare(tiny_config(model_type))
        self.salt, self.blocks, self.tiers = salt, blocks, tiers

    def engine(self) -> Engine:
        return engine_for(self.decl, self.tiers, self.salt, self.blocks)

    def serve(self, requests: Requests) -> dict[str, Any]:
        from kvfsm.serve._loop import Request, serve

        reqs = [Request(rid, tokens, new) for rid, tokens, new in requests]
        reference = serve(self.model, None, reqs, "nocache")
        engine = self.engine()
        try:
            served = serve(self.model, engine, reqs, "kvfsm", restore_timeout=RESTORE_TIMEOUT_S)
            invariants = engine.core.check_invariants()
        finally:
            engine.close()
        return {"results": [{"rid": r.rid, "prompt_tokens": r.prompt_tokens,
                             "usable_tokens": r.usable_tokens, "reused_tokens": r.reused_tokens,
                             "restored_blocks": r.restore.restored,
                             "tiers": sorted({s.tier for s in r.steps
                                              if s.outcome == "restored"})}
                            for r in served],
                "outputs_match": all(r.tokens == ref.tokens for r, ref in
                                     zip(served, reference, strict=True)),
                "max_logit_delta": max(float(np.abs(r.logits - ref.logits).max())
                                       for r, ref in zip(served, reference, strict=True)),
                "invariants": invariants}

    def ttft(self, requests: Requests, rounds: int) -> dict[str, Any]:
        """Paired rounds of the restored and the recomputed path over ``requests``."""
        import torch

        from kvfsm.serve import CacheAdapter

        model = self.model
        prompts = [tokens for _, tokens, _ in requests]

        def recompute() -> tuple[float, list[Any], int]:
            from transformers import DynamicCache

            firsts, spent = [], 0.0
            for tokens in prompts:
                start = time.perf_counter()
                cache = DynamicCache(config=model.config)
                ids = torch.tensor([tokens], dtype=torch.long)
                positions = torch.arange(len(tokens), dtype=torch.long)[None]
                logits = model(input_ids=ids, position_ids=positions, cache=cache,
                               use_cache=True, logits_to_keep=1).logits[0, -1].float()
                int(logits.argmax())
                spent += time.perf_counter() - start
                firsts.append(logits)
            return spent, firsts, 0

        def restored() -> tuple[float, list[Any], int]:
            engine = self.engine()
            adapter = CacheAdapter(engine, model.config)
            firsts, spent, reused = [], 0.0, 0
            try:
                for tokens in prompts:
                    start = time.perf_counter()
                    prompt = engine.prompt(tokens)
                    verdict = engine.lookup(prompt)
                    looked = time.perf_counter()
                    if verdict.restorable_tokens > verdict.usable_tokens and verdict.plan:
                        engine.restore(verdict, prompt).wait(timeout=RESTORE_TIMEOUT_S)
                        verdict = engine.lookup(prompt)
                    loaded = time.perf_counter()
                    length = verdict.usable_tokens
                    cache = adapter.rebuild(prompt, length, verdict=verdict)
                    rebuilt = time.perf_counter()
                    logits = adapter.prefill(model, cache, tokens[length:], length)[-1]
                    int(logits.argmax())
                    end = time.perf_counter()
                    spent += end - start
                    parts["lookup"] += looked - start
                    parts["restore"] += loaded - looked
                    parts["rebuild"] += rebuilt - loaded
                    parts["prefill"] += end - rebuilt
                    firsts.append(logits)
                    reused += length
            finally:
                engine.close()
            return spent, firsts, reused

        #: Seconds of the restored path's parts (first lookup, with discovery; restore and
        #: wait, and the lookup after; rebuild; prefill of the rest), each round's sum.
        parts = dict.fromkeys(("lookup", "restore", "rebuild", "prefill"), 0.0)
        split: list[dict[str, float]] = []
        paths: dict[str, Callable[[], tuple[float, list[Any], int]]] = {
            "restored": restored, "recompute": recompute}
        times: dict[str, list[float]] = {"restored": [], "recompute": []}
        reused_per_round, delta = [], 0.0
        with torch.no_grad():
            for round_ in range(rounds):
                order = ("restored", "recompute") if round_ % 2 == 0 else \
                    ("recompute", "restored")
                firsts: dict[str, list[Any]] = {}
                for name in order:
                    gc.collect()
                    gc.disable()
                    try:
                        spent, firsts[name], reused = paths[name]()
                    finally:
                        gc.enable()
                    times[name].append(spent)
                    if name == "restored":
                        reused_per_round.append(reused)
                        split.append(dict(parts))
                        parts.update(dict.fromkeys(parts, 0.0))
                delta = max(delta, *(float((a - b).abs().max()) for a, b in
                                     zip(firsts["restored"], firsts["recompute"], strict=True)))
        return {"restored_s": times["restored"], "recompute_s": times["recompute"],
                "reused_tokens": reused_per_round, "max_logit_delta": delta,
                "restored_parts_s": split}


def worker_main(argv: Sequence[str]) -> int:
    """The worker: JSON commands on stdin, one JSON answer line each on stdout.

    ``open`` (model, salt, blocks, disk, address, prefix), ``serve`` (requests), ``ttft``
    (requests, rounds), ``close``, ``exit``."""
    import torch

    torch.set_num_threads(1)
    remotes: dict[tuple[str, str], MooncakeTier] = {}
    current: _Served | None = None
    disk: DiskTier | None = None

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        say({"ready": True, "pid": os.getpid(), "kvfsm": str(Path(kvfsm.__file__).parent)})
        for line in sys.stdin:
            command = json.loads(line)
            op = command.get("op")
            if op == "exit":
                break
            if op == "open":
                disk = DiskTier(command["disk"], capacity_bytes=DISK_BYTES, fsync=False)
                tiers: dict[str, StoredTier] = {"disk": disk}
                if command.get("address"):
                    key = (command["address"], command["prefix"])
                    if key not in remotes:
                        remotes[key] = mooncake_tier(*key)
                    tiers["remote"] = remotes[key]
                current = _Served(command["model"], command["salt"], command["blocks"], tiers)
                say({"opened": True})
            elif op == "serve" and current is not None:
                say(current.serve(command["requests"]))
            elif op == "ttft" and current is not None:
                say(current.ttft(command["requests"], command["rounds"]))
            elif op == "close":
                if disk is not None:
                    disk.close()
                current = disk = None
                say({"closed": True})
            else:
                say({"error": f"unexpected command {command!r}"})
    finally:
        if disk is not None:
            disk.close()
        for remote in remotes.values():
            remote.close()
    return 0


class Worker(LineWorker):
    """The worker process, driven from here; ended by ``close()``."""

    def __init__(self, log_path: Path) -> None:
        root = Path(kvfsm.__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        super().__init__([sys.executable, str(Path(__file__).resolve()), "--worker"], log_path,
                         cwd=root, env=env, timeout_s=ANSWER_TIMEOUT_S)
        if Path(self.ready["kvfsm"]).resolve() != Path(kvfsm.__file__).resolve().parent:
            self.close()
            raise RuntimeError(f"the worker imported another kvfsm: {self.ready['kvfsm']}")

    def answer(self) -> dict[str, Any]:
        answer = super().answer()
        if "error" in answer:
            raise RuntimeError(f"the worker: {answer['error']}")
        return answer


# -- engine A and the figures ----------------------------------------------------------------------


def _request_objects(requests: Requests) -> list[Any]:
    from kvfsm.serve._loop import Request

    return [Request(rid, tokens, new) for rid, tokens, new in requests]


def push_down(engine: Engine, requests: Requests, to: Tier) -> dict[str, list[str]]:
    """Every cached block of ``requests`` in every group moved down to ``to`` (offloaded to
    host, then spilled down); the states they are in afterwards, per group."""
    states: dict[str, list[str]] = {}
    for name, group in engine.core.groups.items():
        size = group.decl.block_size
        found = [engine.core.lookup_words(name, *engine.prompt(tokens).words(size))
                 for _, tokens, _ in requests]
        ids = np.unique(np.concatenate(found))
        ids = ids[ids >= 0]
        engine.offload(name, ids)
        for upper in (Tier.HOST, Tier.DISK):
            if upper < to:
                engine.spill_down(name, upper, int(ids.size))
        states[name] = sorted({engine.core.describe(name, int(i)).state for i in ids.tolist()})
    return states


def _median_ms(seconds: Sequence[float], prompts: int) -> float:
    return round(statistics.median(seconds) / prompts * 1e3, 3)


def figures(served: dict[str, Any], expected: Sequence[int], ttft: dict[str, Any],
            ttft_expected: int, prompts: int, states: Mapping[str, list[str]]) -> dict[str, Any]:
    results = served["results"]
    reused = sum(r["reused_tokens"] for r in results)
    restored = sum(r["reused_tokens"] - r["usable_tokens"] for r in results)
    total = sum(r["prompt_tokens"] for r in results)
    ratios = [a / b for a, b in zip(ttft["restored_s"], ttft["recompute_s"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "prompts": len(results), "prompt_tokens": total, "reused_tokens": reused,
        "restored_tokens": restored, "device_tokens": reused - restored,
        "restored_blocks": sum(r["restored_blocks"] for r in results),
        "recomputed_tokens": total - reused, "expected_tokens": sum(expected),
        "lost_tokens": sum(expected) - reused,
        "restored_from": sorted({t for r in results for t in r["tiers"]}),
        "outputs_match": served["outputs_match"] and served["max_logit_delta"] <= TOLERANCE,
        "max_logit_delta": served["max_logit_delta"],
        "a_states": dict(states), "invariants": served["invariants"],
        "ttft": {
            "prompts": prompts, "rounds": len(ratios),
            "restored_ms": _median_ms(ttft["restored_s"], prompts),
            "restored_parts_ms": {part: _median_ms([r[part] for r in ttft["restored_parts_s"]],
                                                   prompts)
                                  for part in ("lookup", "restore", "rebuild", "prefill")},
            "recompute_ms": _median_ms(ttft["recompute_s"], prompts),
            "ratio": round(statistics.median(ratios), 4),
            "ratio_quartiles": [round(quartiles[0], 4), round(quartiles[-1], 4)],
            "reused_tokens": ttft_expected if set(ttft["reused_tokens"]) == {ttft_expected}
            else ttft["reused_tokens"],
            "expected_tokens": ttft_expected,
            "max_logit_delta": ttft["max_logit_delta"],
        },
    }


@contextlib.contextmanager
def engine_a(decl: Any, tiers: dict[str, StoredTier], salt: str, blocks: int
             ) -> Iterator[Engine]:
    """Engine A over ``tiers``; on exit the engine and its tiers are closed."""
    try:
        engine = engine_for(decl, tiers, salt, blocks)
    except BaseException:
        for tier in tiers.values():
            tier.close()
        raise
    try:
        yield engine
    finally:
        engine.close()
        for tier in tiers.values():
            tier.close()


def a_serves(model: Any, engine: Engine, work: dict[str, Requests], b_prompts: Requests,
             to: Tier) -> tuple[list[int], int, dict[str, list[str]]]:
    """A serves its questions and pushes every block down to ``to``. Answers what A could
    reuse of each of ``b_prompts`` and of the timed prompts (all of them together) from its own
    device before that, and the states its blocks are in after."""
    import torch

    from kvfsm.serve._loop import serve

    with torch.no_grad():
        serve(model, engine, _request_objects(work["a"]), "kvfsm")
    expected = [engine.lookup(tokens).usable_tokens for _, tokens, _ in b_prompts]
    ttft_expected = sum(engine.lookup(tokens).usable_tokens for _, tokens, _ in work["ttft"])
    return expected, ttft_expected, push_down(engine, work["a"], to)


def b_serves(worker: Worker, b_prompts: Requests, work: dict[str, Requests], rounds: int,
             **opened: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """B (the worker, its engine ``opened`` so) serves ``b_prompts``, then the timed rounds."""
    worker.ask(op="open", **opened)
    try:
        served = worker.ask(op="serve", requests=b_prompts)
        ttft = worker.ask(op="ttft", requests=work["ttft"], rounds=rounds)
    finally:
        worker.ask(op="close")
    return served, ttft


def run_model(model_type: str, work: dict[str, Requests], worker: Worker, master: MooncakeMaster,
              rounds: int, scratch: Path, run_id: str) -> dict[str, Any]:
    from kvfsm.serve import declare, tiny_config, tiny_model

    model = tiny_model(model_type, seed=0)
    decl = declare(tiny_config(model_type))
    blocks = blocks_for(work)
    out: dict[str, Any] = {}
    timed = f"then {rounds} timed rounds of {len(work['ttft'])} prompts"

    # A restart: A pushes every block to disk and is closed; B opens A's directory.
    salt = f"tools/shared_prefix/{run_id}/{model_type}/restart"
    a_dir = scratch / f"{model_type}-restart-a"
    progress(f"{model_type} restart: engine A serves {len(work['a'])} prompts")
    with engine_a(decl, {"disk": DiskTier(a_dir, capacity_bytes=DISK_BYTES, fsync=False)},
                  salt, blocks) as a:
        expected, ttft_expected, states = a_serves(model, a, work, work["a"], Tier.DISK)
    progress(f"{model_type} restart: a restarted engine serves them again, {timed}")
    served, ttft = b_serves(worker, work["a"], work, rounds, model=model_type, salt=salt,
                            blocks=blocks, disk=str(a_dir))
    out["restart"] = {"tier": "disk", **figures(served, expected, ttft, ttft_expected,
                                                 len(work["ttft"]), states)}

    # A second engine: A pushes every block to the store and stays up while B reads.
    salt = f"tools/shared_prefix/{run_id}/{model_type}/shared"
    prefix = f"kvfsm-shared-prefix/{run_id}/"
    progress(f"{model_type} shared: engine A serves {len(work['a'])} prompts")
    with engine_a(decl, {"disk": DiskTier(scratch / f"{model_type}-shared-a",
                                          capacity_bytes=DISK_BYTES, fsync=False),
                         "remote": mooncake_tier(master.address, prefix)}, salt, blocks) as a:
        expected, ttft_expected, states = a_serves(model, a, work, work["b"], Tier.REMOTE)
        progress(f"{model_type} shared: engine B serves {len(work['b'])} other questions, "
                 f"{timed}")
        served, ttft = b_serves(worker, work["b"], work, rounds, model=model_type, salt=salt,
                                blocks=blocks, disk=str(scratch / f"{model_type}-shared-b"),
                                address=master.address, prefix=prefix)
    out["shared"] = {"tier": "remote (Mooncake Store)",
                     **figures(served, expected, ttft, ttft_expected, len(work["ttft"]), states)}
    return out


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvfsm-shared-prefix-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(models: Sequence[str], documents: int, doc_tokens: int, questions: int, rounds: int,
        new_tokens: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    work = workload(documents, doc_tokens, questions, new_tokens)
    run_id = f"{os.getpid()}-{time.monotonic_ns()}"
    report: dict[str, Any] = {
        "settings": {"models": list(models), "documents": documents, "doc_tokens": doc_tokens,
                     "questions": questions, "rounds": rounds, "new_tokens": new_tokens,
                     "question_tokens": list(QUESTION_TOKENS), "torch_threads": 1},
        "store": "Mooncake Store (mooncake_master on 127.0.0.1)", "models": {}}
    master = MooncakeMaster()
    master.start()
    try:
        with _scratch() as scratch:
            worker = Worker(scratch / "worker.log")
            try:
                for model_type in models:
                    report["models"][model_type] = run_model(
                        model_type, work, worker, master, rounds, scratch, run_id)
            finally:
                worker.close()
    finally:
        master.stop()
    return report


def _models(text: str) -> list[str]:
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    for name in chosen:
        if name not in MODELS:
            raise argparse.ArgumentTypeError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if not chosen:
        raise argparse.ArgumentTypeError("no model given")
    return chosen


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=_models, default=list(MODELS))
    parser.add_argument("--documents", type=_positive, default=2)
    parser.add_argument("--doc-tokens", type=_positive, default=500)
    parser.add_argument("--questions", type=_positive, default=3,
                        help="questions per document served by A (and other ones by B)")
    parser.add_argument("--rounds", type=_positive, default=9, help="timed rounds per scenario")
    parser.add_argument("--new-tokens", type=_positive, default=4)
    args = parser.parse_args(argv)
    if args.doc_tokens < BLOCK:
        parser.error(f"--doc-tokens must be at least a block ({BLOCK})")
    try:
        report = run(args.models, args.documents, args.doc_tokens, args.questions, args.rounds,
                     args.new_tokens)
    except TierError as exc:  # no mooncake_master, or no client library
        print(f"shared prefix: cannot run the Mooncake Store here: {exc}", file=sys.stderr)
        return 2
    report["command"] = " ".join(["python -m tools.shared_prefix", *argv])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
