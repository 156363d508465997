"""vLLM's real v1 scheduler driven with and without kvfsm, on CPU, and what each admits.

Run by ``tests/test_integrations_vllm.py`` in-process where vLLM imports, else as
``$KVFSM_PEERS_PYTHON tests/vllm_scenarios.py OUT.json`` (one interpreter start for every
scenario: importing vLLM takes seconds). Nothing of vLLM is mocked: the scheduler, its
``KVCacheManager`` and block pool, and the KV connector factory are vLLM's own. What stands in
for the GPU is a model runner (:class:`Runner`) that, each step, lets the worker-side connector
load its blocks, then "computes" the scheduled tokens by writing each page's expected bytes
(:func:`page`, a function of the group and the token prefix) into CPU KV tensors, lets the
connector save (``wait_for_save``: kvfsm takes the pages out of those tensors), and returns a
``ModelRunnerOutput``. Nothing hands kvfsm the expected bytes: what it stores is what the
connector read out of the KV tensors.

**Ground truth.** When a request is admitted with ``n`` computed tokens, every page the model
reads at ``n`` (every full-attention block before ``n``; the sliding-window blocks inside the
window; the Mamba state at ``n``) must hold its expected bytes in the KV tensors; an admission
where one does not is *unusable*. Results are JSON: per scenario, per side, the admitted
lengths and the unusable admissions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
import xxhash
from numpy.typing import NDArray

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# The scheduler and the stand-in worker run in this process (the uni executor: vLLM's CPU build
# would pick the multiprocess one otherwise, which kvfsm's connector refuses).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Tokens per block; in the ``mamba`` configuration every group's block (and vLLM's hash
#: block) is ``MAMBA_BLOCK``: one state per block, no sub-block Mamba hits (which the mirror
#: does not follow).
BLOCK = 16
MAMBA_BLOCK = 32
#: The sliding window of the ``swa`` configuration.
WINDOW = 32
KV_HEADS, HEAD_SIZE = 2, 16
#: Elements of the stand-in Mamba state.
STATE = 16
MAX_MODEL_LEN = 2048
VOCABULARY = 1000
CONFIGS = ("full", "swa", "mamba")
#: Layer names per group (one layer stands for each group's layers).
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def block_of(config: str) -> int:
    """Tokens per block (and per hash block) of every group of ``config``."""
    return MAMBA_BLOCK if config == "mamba" else BLOCK


#: The stand-in models (one config dir each); their pages differ for the same tokens.
MODELS = ("tiny-a", "tiny-b")


def page(group: int, tokens: Sequence[int], index: int, nbytes: int, size: int,
         model: str = MODELS[0], salt: str = "") -> NDArray[np.uint8]:
    """The bytes ``model`` writes for block ``index`` (of ``size`` tokens) of ``group`` of a
    request with cache salt ``salt`` (standing for what else makes KV differ for the same
    tokens: a tenant's adapter, say)."""
    seed = xxhash.xxh64_intdigest(model.encode() + np.asarray(
        tokens[:(index + 1) * size], np.int64).tobytes() + salt.encode(), seed=group)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Stub:
    """Names vLLM imports lazily (after the environment variables above are set)."""

    def __init__(self) -> None:
        import torch
        from torch import nn
        from vllm import ModelRegistry
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            LoRAConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        class StubForCausalLM(nn.Module):
            """A weightless model class: named in the config, never instantiated. It declares
            LoRA support (what vLLM checks before it lets a config enable adapters): requests
            may name adapters, whose pages the stand-in runner writes apart."""

            supports_lora: ClassVar[bool] = True
            packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
            embedding_modules: ClassVar[dict[str, str]] = {}

            def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
                super().__init__()

            def embed_input_ids(self, input_ids: Any) -> Any:
                raise NotImplementedError

            def forward(self, input_ids: Any, positions: Any) -> Any:
                raise NotImplementedError

            def compute_logits(self, hidden_states: Any) -> Any:
                raise NotImplementedError

        ModelRegistry.register_model("StubForCausalLM", StubForCausalLM)
        init_none_hash(sha256)
        self.torch = torch
        self.hashers = {size: get_request_block_hasher(size, sha256)
                        for size in (BLOCK, MAMBA_BLOCK)}
        # One config dir per stand-in model: same KV geometry, another model.
        self.model_dirs: dict[str, str] = {}
        for model in MODELS:
            self.model_dirs[model] = tempfile.mkdtemp(prefix=f"kvfsm-vllm-{model}-")
            Path(self.model_dirs[model], "config.json").write_text(json.dumps({
                "architectures": ["StubForCausalLM"], "model_type": "llama",
                "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": KV_HEADS, "num_hidden_layers": 2,
                "vocab_size": VOCABULARY, "max_position_embeddings": MAX_MODEL_LEN,
                "intermediate_size": 128}))
        self.names = dict(
            CacheConfig=CacheConfig, KVTransferConfig=KVTransferConfig, ModelConfig=ModelConfig,
            LoRAConfig=LoRAConfig, LoRARequest=LoRARequest,
            SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig,
            SamplingParams=SamplingParams, FullAttentionSpec=FullAttentionSpec,
            KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec, MambaSpec=MambaSpec,
            SlidingWindowSpec=SlidingWindowSpec, ModelRunnerOutput=ModelRunnerOutput,
            Request=Request, StructuredOutputManager=StructuredOutputManager)

    def __getattr__(self, name: str) -> Any:
        return self.names[name]

    def kv_cache_config(self, config: str, blocks: int) -> Any:
        torch = self.torch
        attn = self.FullAttentionSpec(block_size=block_of(config), num_kv_heads=KV_HEADS,
                                      head_size=HEAD_SIZE, dtype=torch.float16)
        groups = [self.KVCacheGroupSpec([LAYERS[0]], attn)]
        if config == "swa":
            groups.append(self.KVCacheGroupSpec([LAYERS[1]], self.SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                dtype=torch.float16, sliding_window=WINDOW)))
        elif config == "mamba":
            groups.append(self.KVCacheGroupSpec(["model.layers.1.mixer"], self.MambaSpec(
                block_size=MAMBA_BLOCK, shapes=((STATE,),), dtypes=(torch.float32,),
                mamba_cache_mode="align")))
        return self.KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                                  kv_cache_groups=groups)

    def identity(self, model: str = MODELS[0]) -> str:
        """vLLM's model identity of an engine serving ``model`` (what its mirror needs)."""
        from kvfsm.integrations.vllm import model_identity

        return model_identity(self.vllm_config("full", 8, None, None, None, model=model))

    def vllm_config(self, config: str, blocks: int, scheduler_cls: str | None,
                    connector: str | None, kvfsm: dict[str, Any] | None,
                    async_scheduling: bool = False, model: str = MODELS[0],
                    adapters: int = 0) -> Any:
        model_config = self.ModelConfig(model=self.model_dirs[model], skip_tokenizer_init=True,
                                 max_model_len=MAX_MODEL_LEN, dtype="float16")
        cache = self.CacheConfig(block_size=block_of(config), enable_prefix_caching=True,
                                 mamba_cache_mode="align" if config == "mamba" else "none")
        cache.num_gpu_blocks = blocks
        sched = self.SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8,
                                     max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
                                     scheduler_cls=scheduler_cls,
                                     async_scheduling=async_scheduling)
        transfer = None
        if connector is not None:
            module, name = connector.rsplit(".", 1)
            transfer = self.KVTransferConfig(
                kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
                kv_connector_extra_config={"kvfsm": kvfsm or {}})
        lora = self.LoRAConfig(max_loras=adapters, max_lora_rank=8) if adapters else None
        return self.VllmConfig(model_config=model_config, cache_config=cache,
                               scheduler_config=sched, kv_transfer_config=transfer,
                               lora_config=lora,
                               additional_config={"kvfsm": kvfsm} if kvfsm and not connector
                               else {})


class Runner:
    """One vLLM scheduler (of the class its config names) and the stand-in model runner."""

    def __init__(self, stub: Stub, config: str, *, blocks: int = 64,
                 scheduler_cls: str | None = None, connector: str | None = None,
                 kvfsm: dict[str, Any] | None = None, async_scheduling: bool = False,
                 worker_connector: Callable[[Any, Any], Any] | None = None,
                 model: str = MODELS[0], adapters: int = 0) -> None:
        self.stub = stub
        self.config = config
        self.model = model
        self.kv_cache_config = stub.kv_cache_config(config, blocks)
        self.vllm_config = stub.vllm_config(config, blocks, scheduler_cls, connector, kvfsm,
                                            async_scheduling, model=model, adapters=adapters)
        cls = self.vllm_config.scheduler_config.get_scheduler_cls()
        self.block = block_of(config)
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                             structured_output_manager=stub.StructuredOutputManager(
                                 self.vllm_config),
                             block_size=self.block, hash_block_size=self.block)
        self.page_bytes = [self._page_bytes(g.kv_cache_spec)
                           for g in self.kv_cache_config.kv_cache_groups]
        # Block-major CPU KV tensors, one page per block, per layer.
        self.kv = {layer: stub.torch.zeros((blocks, self.page_bytes[i]), dtype=stub.torch.uint8)
                   for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
                   for layer in g.layer_names}
        self.worker = None
        if connector is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            make = worker_connector or (lambda vc, kc: self.scheduler.connector.__class__(
                vc, KVConnectorRole.WORKER, kc))
            self.worker = make(self.vllm_config, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv)
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, str] = {}
        self.admitted: dict[str, int] = {}
        self.unusable: list[str] = []

    @staticmethod
    def _page_bytes(spec: Any) -> int:
        if type(spec).__name__ == "MambaSpec":
            return STATE * 4
        return int(spec.block_size) * 2 * KV_HEADS * HEAD_SIZE * 2

    def add(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None,
            adapter: tuple[str, int, str] | None = None) -> None:
        """Queue a request; ``adapter`` (LoRA name, id, path) makes its pages another
        adapter's, as ``cache_salt`` makes them another tenant's."""
        self.tokens[request_id] = list(tokens)
        self.salts[request_id] = (cache_salt or "") + \
            (f"|lora:{adapter[0]}@{adapter[2]}" if adapter else "")
        self.scheduler.add_request(self.stub.Request(
            request_id=request_id, prompt_token_ids=list(tokens),
            sampling_params=self.stub.SamplingParams(max_tokens=2), pooling_params=None,
            block_hasher=self.stub.hashers[self.block], cache_salt=cache_salt,
            lora_request=self.stub.LoRARequest(*adapter) if adapter else None))

    def _blocks(self, request_id: str) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = \
            self.scheduler.kv_cache_manager.get_blocks(request_id).get_block_ids()
        return ids

    def _needed(self, group: int, n: int) -> list[int]:
        """Block indices of ``group`` the model reads at ``n`` computed tokens."""
        spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        name = type(spec).__name__
        if n == 0:
            return []
        if name == "MambaSpec":
            return [n // spec.block_size - 1]
        if name == "SlidingWindowSpec":
            first = max(n - (spec.sliding_window - 1), 0) // spec.block_size
            return list(range(first, n // spec.block_size))
        return list(range(n // spec.block_size))

    def _check(self, request_id: str, n: int) -> None:
        blocks = self._blocks(request_id)
        tokens = self.tokens[request_id]
        for group, g in enumerate(self.kv_cache_config.kv_cache_groups):
            tensor = self.kv[g.layer_names[0]]
            for index in self._needed(group, n):
                block = blocks[group][index] if index < len(blocks[group]) else 0
                want = page(group, tokens, index, self.page_bytes[group],
                            g.kv_cache_spec.block_size, self.model, self.salts[request_id])
                if block == 0 or not np.array_equal(tensor[block].numpy(), want):
                    self.unusable.append(f"{request_id}@{n}: group {group} block {index}")
                    return

    def _write(self, request_id: str, start: int, end: int) -> None:
        """The forward of tokens ``[start, end)``: every page completed in it is written."""
        blocks = self._blocks(request_id)
        tokens = self.tokens[request_id]
        for group, g in enumerate(self.kv_cache_config.kv_cache_groups):
            size = g.kv_cache_spec.block_size
            for index in range(start // size, min(end, len(tokens)) // size):
                if index < len(blocks[group]) and blocks[group][index] != 0:
                    data = self.stub.torch.from_numpy(
                        page(group, tokens, index, self.page_bytes[group], size, self.model,
                             self.salts[request_id]))
                    for layer in g.layer_names:
                        self.kv[layer][blocks[group][index]].copy_(data)

    def step(self) -> bool:
        """One schedule and one stand-in forward; False when nothing was scheduled."""
        scheduler = self.scheduler
        out = scheduler.schedule()
        worker = self.worker if out.kv_connector_metadata is not None else None
        if worker is not None:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = scheduler.requests[request_id]
            # schedule() has already advanced num_computed_tokens past this step's tokens.
            start = request.num_computed_tokens - out.num_scheduled_tokens[request_id]
            self._write(request_id, max(start, 0), request.num_computed_tokens)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        if worker is not None:
            # After the forward, as vLLM's model runner does: the step's saves read the pages.
            worker.wait_for_save()
            worker.clear_connector_metadata()
        # Checked after the step's writes: a hit on blocks another request of the same batch
        # computes is served (each layer writes the batch's K/V before attending).
        for new in out.scheduled_new_reqs:
            self.admitted[new.req_id] = new.num_computed_tokens
            self._check(new.req_id, new.num_computed_tokens)
        if not ids:
            return False
        errors = self.worker.get_block_ids_with_load_errors() if self.worker else set()
        kv_output = None
        if errors:
            from vllm.v1.outputs import KVConnectorOutput

            kv_output = KVConnectorOutput(invalid_block_ids=errors)
        scheduler.update_from_output(out, self.stub.ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_output))
        return True

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.step() and not self.scheduler.has_unfinished_requests():
                return
        raise RuntimeError("requests did not finish")

    def run(self, waves: Sequence[Sequence[tuple[str, Sequence[int]]]]) -> None:
        for wave in waves:
            for request_id, tokens in wave:
                self.add(request_id, tokens)
            self.drain()


def workload(seed: int, config: str) -> list[list[tuple[str, list[int]]]]:
    """Waves of requests sharing system prompts and documents, long enough to evict."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCABULARY, int(n)).tolist() for n in (96, 160, 300)]
    waves: list[list[tuple[str, list[int]]]] = []
    k = 0
    for wave in range(4):
        batch = []
        for _ in range(3 + wave % 2):
            head = systems[int(rng.integers(len(systems)))]
            tail = rng.integers(0, VOCABULARY, int(rng.integers(5, 90))).tolist()
            batch.append((f"w{wave}r{k}", head + tail))
            k += 1
        waves.append(batch)
    # A repeat of every earlier prompt: the hits the cap must keep.
    waves.append([(f"again{i}", tokens) for i, (_, tokens) in
                  enumerate(r for w in waves for r in w)][:6])
    return waves


#: vLLM's block pool in the no-fault runs: small enough for the workload to evict.
NO_FAULT_BLOCKS = 48


def no_fault(stub: Stub, config: str, scheduler_cls: str, *, async_scheduling: bool = False,
             name: str = "nofault") -> dict[str, Any]:
    """Stock vLLM and vLLM with kvfsm's scheduler on one workload: what each admitted."""
    from kvfsm.integrations import vllm as integration

    sides: dict[str, Any] = {}
    for side, cls in (("stock", None), ("kvfsm", scheduler_cls)):
        integration.unregister(name)
        runner = Runner(stub, config, blocks=NO_FAULT_BLOCKS, scheduler_cls=cls,
                        kvfsm={"name": name, "level": "full"},
                        async_scheduling=async_scheduling)
        runner.run(workload(3, config))
        caps = getattr(runner.scheduler, "kvfsm_caps", None)
        sides[side] = {"admitted": runner.admitted, "unusable": runner.unusable,
                       "capped": None if caps is None else caps.capped,
                       "lookups": None if caps is None else caps.lookups,
                       "class": type(runner.scheduler).__name__}
        mirror = integration.unregister(name)
        if mirror is not None:
            mirror.close()
    return sides


# -- faults in the offloaded store ----------------------------------------------------------

#: The faults, each applied to one offloaded block of the prompt (its index below).
FAULTS = ("corrupt", "torn", "restore_fails", "in_flight", "foreign", "mamba_state_missing")
#: Blocks of the faulted prompt and the block the fault hits.
PROMPT_BLOCKS, FAULT_INDEX = 12, 6


def stored_pages(mirror: Any, tokens: Sequence[int], model: str = MODELS[0]) -> dict[str, int]:
    """kvfsm's device copies of ``tokens``' blocks against the stand-in model's pages
    (:func:`page`): how many are readable, and how many of those differ."""
    from kvfsm.spec import Tier

    engine = mirror.engine
    prompt = engine.prompt(list(tokens))
    counts = {"readable": 0, "differ": 0}
    for group in mirror.groups:
        state = engine.core.group(group.name)
        high, low = prompt.words(group.block_size)
        for index, kid in enumerate(engine.core.lookup_words(group.name, high, low)):
            resident = kid >= 0 and int(state.table.residency[state.states[kid]]) == int(
                Tier.DEVICE) and bool(state.table.readable[state.states[kid]])
            if not resident:
                continue
            data = engine.core.read(group.name, [int(kid)])[0]
            want = page(group.index, tokens, index, data.size, group.block_size, model)
            counts["readable"] += 1
            counts["differ"] += int(not np.array_equal(data, want))
    return counts


def trusting_connector() -> type:
    """A connector that claims every token kvfsm's index holds blocks for and loads whatever
    bytes are there, unchecked: what trusting existence admits (the real-forward tests' own,
    :func:`tests.vllm_forward.trusting_connector`)."""
    from tests.vllm_forward import trusting_connector as made

    return made()


def _apply(fault: str, engine: Any, prompt: Any) -> str:
    """Damage the offloaded copy of block ``FAULT_INDEX`` of ``prompt`` (kvfsm's engine)."""
    from kvfsm.serve import _faults as faults
    from kvfsm.serve._stores import read_value, write_value

    if fault == "corrupt":
        return faults.flip_disk_byte(engine, prompt, index=FAULT_INDEX, group="g0")
    if fault == "torn":
        return faults.truncate_disk_file(engine, prompt, index=FAULT_INDEX, group="g0")
    if fault == "restore_fails":
        return faults.delete_disk_file(engine, prompt, index=FAULT_INDEX, group="g0")
    if fault == "in_flight":
        return faults.restore_in_flight(engine, prompt, index=FAULT_INDEX, group="g0")
    if fault == "foreign":
        from kvfsm.spec import Tier

        found = [faults._sunk(engine, prompt, "g0", i, Tier.DISK, "plant")
                 for i in (FAULT_INDEX - 1, FAULT_INDEX)]
        if any(isinstance(f, str) for f in found):
            return f"not planted: {found}"
        (_, other), (_, key) = found  # type: ignore[misc]
        store = engine.tiers[Tier.DISK]
        value = read_value(store, other)
        write_value(store, key, value)
        return f"g0 block {FAULT_INDEX}: the value of block {FAULT_INDEX - 1} under its key"
    if fault == "mamba_state_missing":
        # The store lost the state at the prompt's last checkpoint (its attention blocks stay).
        return faults.delete_disk_file(engine, prompt, group="g1",
                                       index=faults.checkpoint_block(engine, prompt, "g1"))
    if fault == "none":
        return "no fault"
    raise ValueError(fault)


def faulted(stub: Stub, config: str, fault: str, side: str, directory: str) -> dict[str, Any]:
    """One prompt computed, evicted from vLLM (kvfsm offloads it to host, then disk), one
    block's offloaded copy damaged by ``fault``, then the prompt asked again with a new tail;
    ``side`` is ``stock`` (no connector), ``trusting`` or ``kvfsm``."""
    from kvfsm.integrations import vllm as integration
    from kvfsm.integrations.vllm import Mirror, MirrorSettings
    from kvfsm.serve._faults import sink
    from kvfsm.spec import Tier

    name = f"{config}-{fault}-{side}"
    # In flight: the block must still be on host when its restore begins.
    settings = {"name": name, "level": "standard",
                "host_blocks": 64 if fault == "in_flight" else 4,
                "disk_dir": str(Path(directory, name)), "disk_blocks": 256,
                "restore_wait_s": 2.0}
    connector = {"stock": None, "trusting": "tests.vllm_scenarios.TrustingConnector",
                 "kvfsm": "kvfsm.integrations.vllm.KvfsmConnector"}[side]
    blocks = 64
    # The default mirror: no source of bytes but the connector's saves.
    mirror = Mirror(stub.kv_cache_config(config, blocks),
                    MirrorSettings.from_mapping(settings, "scenario"), identity=stub.identity())
    integration.register(mirror)
    try:
        runner = Runner(stub, config, blocks=blocks,
                        scheduler_cls=None if side == "stock" else
                        "kvfsm.integrations.vllm.KvfsmScheduler",
                        connector=connector, kvfsm=settings)
        rng = np.random.default_rng(11)
        size = block_of(config)
        head = rng.integers(0, VOCABULARY, PROMPT_BLOCKS * size).tolist()
        runner.run([[("first", [*head, 1, 2, 3])]])
        stored = stored_pages(mirror, [*head, 1, 2, 3])
        pool = runner.scheduler.kv_cache_manager.block_pool
        pool.evict_blocks(set(range(1, blocks)))  # vLLM reuses every block: all offloaded
        for tensor in runner.kv.values():
            tensor.zero_()  # ... and other requests overwrite their pages
        engine = mirror.engine
        prompt = engine.prompt([*head, 1, 2, 3])
        for group in mirror.groups:
            high, low = prompt.words(group.block_size)
            for kid in engine.core.lookup_words(group.name, high, low):
                if kid >= 0 and fault != "in_flight":
                    sink(engine, group.name, int(kid), Tier.DISK)
        what = _apply(fault, engine, prompt)
        runner.run([[("again", [*head, 4, 5, 6, 7])]])
        counts = getattr(runner.scheduler.connector, "counts", None)
        return {"admitted": runner.admitted["again"], "unusable": runner.unusable,
                "fault": what, "claims": None if counts is None else attrs.asdict(counts),
                "stored": stored}
    finally:
        integration.unregister(name)
        mirror.close()


#: Requests of the keyed scenarios: id, cache salt, LoRA adapter (name, id, path), tokens
#: after the shared head.
Keyed = tuple[str, str | None, tuple[str, int, str] | None, list[int]]
SALTED: tuple[Keyed, ...] = (
    ("a", "tenant-a", None, [1, 2, 3]), ("b", "tenant-b", None, [4, 5]),
    ("base", None, None, [6, 7]), ("a-again", "tenant-a", None, [8, 9]))
ADAPTERS: tuple[Keyed, ...] = (
    ("a", None, ("lora-a", 1, "/adapters/a"), [1, 2, 3]),
    ("b", None, ("lora-b", 2, "/adapters/b"), [4, 5]), ("base", None, None, [6, 7]),
    ("a-again", None, ("lora-a", 1, "/adapters/a"), [8, 9]))


def keyed(stub: Stub, directory: str, name: str, requests: Sequence[Keyed]
          ) -> dict[str, Any]:
    """Requests with the same tokens under other keys (cache salts: tenants; LoRA adapters),
    each computed after vLLM gave back every block (kvfsm holds them on host and disk): what
    vLLM admitted for each through kvfsm's connector, and whether it was usable."""
    from kvfsm.integrations import vllm as integration
    from kvfsm.integrations.vllm import Mirror, MirrorSettings

    settings = {"name": name, "level": "standard", "host_blocks": 4,
                "disk_dir": str(Path(directory, name)), "disk_blocks": 256,
                "restore_wait_s": 2.0}
    blocks = 64
    adapters = len({adapter for _, _, adapter, _ in requests if adapter})
    mirror = Mirror(stub.kv_cache_config("full", blocks),
                    MirrorSettings.from_mapping(settings, "scenario"), identity=stub.identity())
    integration.register(mirror)
    try:
        runner = Runner(stub, "full", blocks=blocks,
                        scheduler_cls="kvfsm.integrations.vllm.KvfsmScheduler",
                        connector="kvfsm.integrations.vllm.KvfsmConnector", kvfsm=settings,
                        adapters=adapters)
        head = np.random.default_rng(12).integers(0, VOCABULARY, PROMPT_BLOCKS * BLOCK).tolist()
        pool = runner.scheduler.kv_cache_manager.block_pool
        for request_id, salt, adapter, tail in requests:
            runner.add(request_id, [*head, *tail], cache_salt=salt, adapter=adapter)
            runner.drain()
            pool.evict_blocks(set(range(1, blocks)))  # vLLM reuses every block: offloaded
            for tensor in runner.kv.values():
                tensor.zero_()  # ... and other requests overwrite their pages
        counts = runner.scheduler.connector.counts
        return {"admitted": runner.admitted, "unusable": runner.unusable,
                "claims": attrs.asdict(counts), "whole": PROMPT_BLOCKS * BLOCK}
    finally:
        integration.unregister(name)
        mirror.close()


def fault_table(stub: Stub) -> dict[str, Any]:
    """Every fault on every side: what was admitted, and whether it was usable."""
    table: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvfsm-vllm-tiers-") as directory:
        for fault in FAULTS:
            config = "mamba" if fault == "mamba_state_missing" else "full"
            table[fault] = {side: faulted(stub, config, fault, side, directory)
                            for side in ("stock", "trusting", "kvfsm")}
        table["none"] = {side: faulted(stub, "full", "none", side, directory)
                         for side in ("stock", "trusting", "kvfsm")}
    return table


# -- two vLLM engines sharing one Mooncake Store -----------------------------------------------

#: Cases of the shared store: what the consumer engine finds there.
SHARED_CASES = ("same_model", "other_model", "remote_corrupt", "remote_evicted")
#: The namespace a connector that trusts existence names values in: tokens only, no model.
TOKENS_ONLY = "tokens-only"


def _remote_fault(case: str, engine: Any, prompt: Any) -> str:
    """Damage block ``FAULT_INDEX``'s value in the store behind every engine's back."""
    from kvfsm.serve import _faults as faults
    from kvfsm.serve._stores import read_value, write_value
    from kvfsm.spec import Tier

    if case == "remote_evicted":
        return faults.evict_remote_value(engine, prompt, index=FAULT_INDEX, group="g0")
    if case == "remote_corrupt":
        found = faults._sunk(engine, prompt, "g0", FAULT_INDEX, Tier.REMOTE, "flip")
        if isinstance(found, str):
            return found
        _, key = found
        store = engine.tiers[Tier.REMOTE]
        value = bytearray(read_value(store, key) or b"")
        value[-1] ^= 0x80  # the sign bit of the payload's last value
        write_value(store, key, bytes(value))
        return f"g0 block {FAULT_INDEX}: one payload bit of its stored value flipped"
    return "no fault"


def shared_case(stub: Stub, case: str, side: str, master: str, directory: str
                ) -> dict[str, Any]:
    """A producer vLLM engine (kvfsm connector) computes a prompt and kvfsm moves it down to
    a Mooncake Store (device -> host -> disk -> remote); a second vLLM engine of its own
    (own scheduler, mirror, disk and Mooncake client) then asks the prompt with a new tail.
    ``case`` says what the store holds for it (another model's values, a damaged value);
    ``side`` is the consumer's: ``stock`` (no connector), ``trusting`` (a connector naming
    values by tokens alone, so both engines share one namespace) or ``kvfsm``."""
    from kvfsm.integrations import vllm as integration
    from kvfsm.serve._faults import sink
    from kvfsm.spec import Tier

    producer_model = MODELS[1] if case == "other_model" else MODELS[0]
    namespace = TOKENS_ONLY if side == "trusting" else None
    names = {role: f"shared-{case}-{side}-{role}" for role in ("producer", "consumer")}

    def settings(role: str) -> dict[str, Any]:
        return {"name": names[role], "level": "standard", "host_blocks": 4,
                "disk_dir": str(Path(directory, names[role])), "disk_blocks": 256,
                "remote": f"mooncake://{master}", "remote_blocks": 256,
                "namespace": namespace, "restore_wait_s": 5.0}

    connector = {"stock": None, "trusting": "tests.vllm_scenarios.TrustingConnector",
                 "kvfsm": "kvfsm.integrations.vllm.KvfsmConnector"}[side]
    rng = np.random.default_rng(23)
    head = rng.integers(0, VOCABULARY, PROMPT_BLOCKS * BLOCK).tolist()
    try:
        producer = Runner(stub, "full", blocks=64, model=producer_model,
                          scheduler_cls="kvfsm.integrations.vllm.KvfsmScheduler",
                          connector="kvfsm.integrations.vllm.KvfsmConnector",
                          kvfsm=settings("producer"))
        producer.run([[("first", [*head, 1, 2, 3])]])
        mirror = producer.scheduler.connector.kvfsm
        pool = producer.scheduler.kv_cache_manager.block_pool
        pool.evict_blocks(set(range(1, 64)))  # vLLM reuses every block: kvfsm offloads them
        engine = mirror.engine
        prompt = engine.prompt([*head, 1, 2, 3])
        high, low = prompt.words(BLOCK)
        pushed = sum(sink(engine, "g0", int(kid), Tier.REMOTE)
                     for kid in engine.core.lookup_words("g0", high, low) if kid >= 0)
        what = _remote_fault(case, engine, prompt)
        consumer = Runner(stub, "full", blocks=64, model=MODELS[0], connector=connector,
                          scheduler_cls=None if side == "stock" else
                          "kvfsm.integrations.vllm.KvfsmScheduler",
                          kvfsm=settings("consumer"))
        consumer.run([[("again", [*head, 4, 5, 6, 7])]])
        counts = getattr(consumer.scheduler.connector, "counts", None)
        return {"admitted": consumer.admitted["again"], "unusable": consumer.unusable,
                "pushed": pushed, "fault": what,
                "claims": None if counts is None else attrs.asdict(counts)}
    finally:
        for role in ("consumer", "producer"):  # the producer's segment holds the values
            gone = integration.unregister(names[role])
            if gone is not None:
                gone.close()


def shared_store(stub: Stub) -> dict[str, Any]:
    """Every shared-store case on every consumer side, against one Mooncake master."""
    from kvfsm.tiers import MooncakeMaster, TierError

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"the Mooncake client does not import: {exc}"}
    table: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvfsm-vllm-shared-") as directory:
        master = MooncakeMaster()
        try:
            master.start()
        except TierError as exc:
            return {"skipped": str(exc)}
        try:
            for case in SHARED_CASES:
                table[case] = {side: shared_case(stub, case, side, master.address, directory)
                               for side in ("stock", "trusting", "kvfsm")}
        finally:
            master.stop()
    return table


def main(out: str) -> None:
    started = time.perf_counter()
    stub = Stub()
    imported = time.perf_counter() - started
    results: dict[str, Any] = {"import_s": imported, "nofault": {}, "settings": {
        "no_fault_blocks": NO_FAULT_BLOCKS, "no_fault_waves": len(workload(3, "full")),
        "window": WINDOW, "prompt_blocks": PROMPT_BLOCKS}}
    for config in CONFIGS:
        results["nofault"][config] = no_fault(stub, config,
                                              "kvfsm.integrations.vllm.KvfsmScheduler")
    results["nofault"]["mamba_async"] = no_fault(
        stub, "mamba", "kvfsm.integrations.vllm.KvfsmAsyncScheduler", async_scheduling=True)
    results["faults"] = fault_table(stub)
    with tempfile.TemporaryDirectory(prefix="kvfsm-vllm-keyed-") as directory:
        results["salted"] = keyed(stub, directory, "salted", SALTED)
        results["adapters"] = keyed(stub, directory, "adapters", ADAPTERS)
    shared_started = time.perf_counter()
    results["shared"] = shared_store(stub)
    results["shared_s"] = time.perf_counter() - shared_started
    results["total_s"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(results, indent=1))


def __getattr__(name: str) -> Any:
    """``TrustingConnector`` is built on first use (it subclasses a vLLM class)."""
    if name == "TrustingConnector":
        return trusting_connector()
    raise AttributeError(name)


if __name__ == "__main__":
    main(sys.argv[1])
