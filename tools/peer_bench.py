"""Time prefix-cache lookups of vLLM and SGLang beside kvfsm's, on the same prompts.

Usage: ``python tools/peer_bench.py [--lengths 1024,4096,...] [--rounds 7] [--samples 45]
[--cached-fraction 1.0] [--json]``, run with the Python of an environment where the peers are
importable (see the performance docs for its install lines); a peer that does not import is
skipped with the reason, and its ratios are null. The tool installs nothing.

Per prompt length and per configuration (``full``: one full-attention group; ``full_swa``: full
attention plus a sliding window of 4096 tokens), every side caches the same prompt (random token
ids, fixed seed, block/page 16) and is then asked for the longest usable prefix of that prompt.
With ``--cached-fraction F`` below 1 every side caches only the prompt's first ``F`` (whole
blocks) and is asked about the whole prompt: a partial hit, whose lookup also says (kvfsm) why
the rest is not usable.

- kvfsm: ``Engine.lookup(prompt, level=STANDARD)`` on an engine whose blocks a first FULL lookup
  verified (so no data checksum is recomputed: vLLM computes none either); also reported, the
  core's ``verify.lookup(..., level=FULL, checksums=False)`` (every check but the checksums, no
  engine lock or bookkeeping). Hashes: ``engine.prompt(tokens)``, outside the timing.
- vLLM: ``KVCacheManager.get_computed_blocks(request)`` of the v1 scheduler's manager built from a
  hand-made ``KVCacheConfig`` (FullAttentionSpec, plus SlidingWindowSpec for ``full_swa``), the
  blocks of a first request allocated, cached and freed (cached, evictable). Hashes: the
  request's block hashes, computed at request creation as vLLM does, outside the timing.
- SGLang: ``RadixCache.match_prefix`` (page 16, one insert of the prompt), ``full`` only: its
  sliding-window models use another cache class. The key is built outside the timing.

Each side looks up at most the prompt minus its last token (that token is always computed):
vLLM's ``max_cache_hit_length = num_tokens - 1``, SGLang's ``limit = len - 1`` as its scheduler
passes, kvfsm's lookup by construction; all then round down to whole blocks.

Rounds are paired and alternated: each round times every side on the same length, in turn
(ABCD, then DCBA, ...), ``--samples`` calls each; medians over all rounds; a ratio is
``peer_median / kvfsm_median`` (above 1: kvfsm is faster). Garbage left by the set-up is frozen
before timing (``gc.freeze()``, as vLLM's engine does after start-up), so no side pays for
scanning another's objects. Progress goes to stderr; the report (a table, or JSON with
``--json``) to stdout.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
import warnings
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm import Engine
from kvfsm._jit import settings as jit
from kvfsm.lookup import Level, lookup
from kvfsm.spec import ModelDecl, parse_model
from kvfsm.state import CoreConfig

#: Tokens per block (kvfsm, vLLM) and per page (SGLang).
BLOCK_TOKENS = 16
#: The sliding window of the ``full_swa`` configuration, in tokens.
WINDOW_TOKENS = 4096
#: Blocks in each side's pool (the set-up the targets were filed with); grown where a prompt
#: needs more.
POOL_BLOCKS = 70_000
#: Token ids are drawn below this (a vocabulary's size).
VOCABULARY = 100_000
#: Seed of the prompts' token ids.
PROMPT_SEED = 0
DEFAULT_LENGTHS = (1_024, 4_096, 16_384, 65_536, 131_072, 262_144, 524_288)
DEFAULT_ROUNDS = 7
#: Timed calls per side per round.
DEFAULT_SAMPLES = 45
#: Untimed calls per side before the first round (caches, allocators and branch predictors
#: settle; fewer left the first length's kvfsm median visibly high).
WARMUP_CALLS = 20
#: kvfsm's name of the hash function vLLM uses by default.
SHA256 = "sha256"
#: Prompt length of the hashing comparison.
HASH_TOKENS = 131_072
#: Hashing calls per side per round (each is milliseconds long).
HASH_SAMPLES = 5
#: Layer names the hand-made vLLM config gives its groups (one layer stands for them all).
VLLM_LAYER = {"full": "model.layers.0.self_attn", "swa": "model.layers.1.self_attn"}
#: KV heads, head size: the page size vLLM's specs compute (only its bookkeeping uses it).
VLLM_HEADS, VLLM_HEAD_SIZE = 8, 128

CONFIGS = ("full", "full_swa")


# -- the peers' imports ------------------------------------------------------------------------


@attrs.frozen
class Peers:
    """The peer modules that imported (None where not) and why the others did not."""

    vllm: dict[str, Any] | None
    sglang: dict[str, Any] | None
    skipped: dict[str, str]
    versions: dict[str, str]


def _reason(error: BaseException) -> str:
    """One line saying why an import failed."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


def _import_vllm() -> dict[str, Any]:
    """The vLLM names the benchmark uses (raises ImportError, or whatever vLLM raises)."""
    # Scheduler-side only: the CPU target keeps vLLM from looking for a GPU platform, and no
    # hub is reachable.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vllm = importlib.import_module("vllm")
    manager = importlib.import_module("vllm.v1.core.kv_cache_manager")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    spec = importlib.import_module("vllm.v1.kv_cache_interface")
    request = importlib.import_module("vllm.v1.request")
    sampling = importlib.import_module("vllm.sampling_params")
    hashing = importlib.import_module("vllm.utils.hashing")
    torch = importlib.import_module("torch")
    return {
        "version": str(vllm.__version__),
        "KVCacheManager": manager.KVCacheManager,
        "init_none_hash": utils.init_none_hash,
        "get_request_block_hasher": utils.get_request_block_hasher,
        "KVCacheConfig": spec.KVCacheConfig,
        "KVCacheGroupSpec": spec.KVCacheGroupSpec,
        "FullAttentionSpec": spec.FullAttentionSpec,
        "SlidingWindowSpec": spec.SlidingWindowSpec,
        "Request": request.Request,
        "SamplingParams": sampling.SamplingParams,
        "sha256": hashing.sha256,
        "float16": torch.float16,
    }


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``torchvision`` (and its submodules) with a placeholder module.

    SGLang's memory-pool module imports every model config, some of which import torchvision
    transforms at module level; the radix cache never calls them. PyPI's torchvision wheels
    link a CUDA build of torch, so a CPU-only environment has none: this placeholder stands in
    for import only, and only when no torchvision is installed at all."""

    NAME = "torchvision"

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.NAME or fullname.startswith(self.NAME + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _PlaceholderModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        # transformers compares torchvision's version; "0" reads as too old for any feature.
        module.__version__ = "0"  # type: ignore[attr-defined]


class _PlaceholderMeta(type):
    """Any attribute of the placeholder class is the placeholder class again."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_PlaceholderMeta):
    """Stands for any torchvision name: a class, a constant, a function (calls return itself)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return self


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


def _import_sglang() -> dict[str, Any]:
    """The SGLang names the benchmark uses (raises ImportError, or whatever SGLang raises)."""
    if importlib.util.find_spec("sglang") is None:
        raise ModuleNotFoundError("No module named 'sglang'")
    if importlib.util.find_spec(_TorchvisionPlaceholder.NAME) is None:
        sys.meta_path.append(_TorchvisionPlaceholder())
    sglang = importlib.import_module("sglang")
    with warnings.catch_warnings():
        # Its quantization modules warn at import that CUDA is missing: nothing timed uses them.
        warnings.simplefilter("ignore", UserWarning)
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    torch = importlib.import_module("torch")
    return {
        "version": str(getattr(sglang, "__version__", "unknown")),
        "RadixCache": radix.RadixCache,
        "RadixKey": radix.RadixKey,
        "MatchPrefixParams": base.MatchPrefixParams,
        "InsertParams": base.InsertParams,
        "torch": torch,
    }


def import_peers(skip: Sequence[str] = ()) -> Peers:
    """Import each peer not in ``skip``; one that fails is recorded in ``skipped`` with why."""
    skipped: dict[str, str] = {}
    found: dict[str, dict[str, Any] | None] = {}
    for name, load in (("vllm", _import_vllm), ("sglang", _import_sglang)):
        if name in skip:
            skipped[name] = "skipped by --skip"
            found[name] = None
            continue
        try:
            found[name] = load()
        except Exception as error:  # any failure to import means: this peer is not measured
            skipped[name] = _reason(error)
            found[name] = None
    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kvfsm_kernels": jit.backend,
    }
    for package in ("kvfsm", "torch", "numba"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    for name, names in found.items():
        if names is not None:
            versions[name] = names["version"]
    return Peers(vllm=found["vllm"], sglang=found["sglang"], skipped=skipped,
                 versions=versions)


# -- the sides ------------------------------------------------------------------------------------

#: One timed call of one side: a lookup of the prompt the side has cached.
Call = Callable[[], object]


def _group_toml(name: str, kind: str, lifecycle: str, extra: str = "") -> str:
    return f"""
[[groups]]
name = "{name}"
kind = "{kind}"
lifecycle = "{lifecycle}"
block_size = {BLOCK_TOKENS}
shape = [{BLOCK_TOKENS}, 8]
dtype = "float16"
{extra}

[groups.layout]
dim_order = ["block", "token", "dim"]
alignment = 256
padding = 0
"""


def kvfsm_model(config: str) -> ModelDecl:
    """The kvfsm model of a configuration: a full-attention group, and for ``full_swa`` a
    sliding-window group (window :data:`WINDOW_TOKENS`) beside it; tiny blocks (a lookup reads
    no block data at the level timed)."""
    groups = _group_toml("full", "full", "full_kv")
    if config == "full_swa":
        groups += _group_toml("swa", "sliding_window", "sliding_window",
                              f"window = {WINDOW_TOKENS}")
    text = (f'[model]\nname = "peer_bench_{config}"\n'
            f'description = "peer benchmark: {config}"\nlayout_version = 1\n{groups}')
    return parse_model(text, source=f"<peer_bench {config}>")


def pool_blocks(tokens: int, groups: int) -> int:
    """Blocks a pool needs for one prompt of ``tokens`` in every group, at least
    :data:`POOL_BLOCKS`."""
    return max(POOL_BLOCKS, groups * (tokens // BLOCK_TOKENS + 2))


def kvfsm_calls(config: str, tokens: NDArray[np.int64], cached: int | None = None
                ) -> dict[str, Call]:
    """The two kvfsm calls timed: the engine lookup and the core's FULL lookup without
    checksums, on an engine holding the prompt's first ``cached`` tokens (None: all)."""
    model = kvfsm_model(config)
    engine = Engine(model, CoreConfig(device_blocks=pool_blocks(tokens.size, 1), host_blocks=0,
                                      backend="numpy"))
    prompt = engine.prompt(tokens)
    cached = tokens.size if cached is None else cached
    if cached:
        engine.commit(prompt if cached == tokens.size else engine.prompt(tokens[:cached]))
    engine.lookup(prompt, level=Level.FULL)  # verifies the checksums: STANDARD skips them now

    # The arguments made outside the timing, as the peers' request and key are (an enum
    # member's look-up alone is some 50 ns of a 3 us lookup).
    standard, full = Level.STANDARD, Level.FULL

    def engine_lookup() -> object:
        return engine.lookup(prompt, level=standard)

    def core_lookup() -> object:
        return lookup(engine.core, prompt, level=full, checksums=False)

    return {"kvfsm": engine_lookup, "kvfsm_full": core_lookup}


def kvfsm_hit(call: Call) -> int:
    """Tokens a kvfsm call found usable."""
    return int(call().usable_tokens)  # type: ignore[attr-defined]


#: A call returning the tokens a side found usable (checks every side sees the same hit).
HitCall = Callable[[], int]


def vllm_call(names: dict[str, Any], config: str, tokens: list[int], cached: int | None = None
              ) -> tuple[Call, HitCall]:
    """vLLM's ``get_computed_blocks`` on a manager holding the blocks of the prompt's first
    ``cached`` tokens (None: all; cached, freed), and a call returning the tokens it found."""
    spec_args = {"block_size": BLOCK_TOKENS, "num_kv_heads": VLLM_HEADS,
                 "head_size": VLLM_HEAD_SIZE, "dtype": names["float16"]}
    groups = [names["KVCacheGroupSpec"]([VLLM_LAYER["full"]],
                                        names["FullAttentionSpec"](**spec_args))]
    if config == "full_swa":
        groups.append(names["KVCacheGroupSpec"](
            [VLLM_LAYER["swa"]], names["SlidingWindowSpec"](sliding_window=WINDOW_TOKENS,
                                                            **spec_args)))
    blocks = pool_blocks(len(tokens), len(groups))
    kv_config = names["KVCacheConfig"](num_blocks=blocks, kv_cache_tensors=[],
                                       kv_cache_groups=groups)
    manager = names["KVCacheManager"](
        kv_config, max_model_len=len(tokens) + BLOCK_TOKENS,
        scheduler_block_size=BLOCK_TOKENS, hash_block_size=BLOCK_TOKENS, enable_caching=True)
    names["init_none_hash"](names["sha256"])
    hasher = names["get_request_block_hasher"](BLOCK_TOKENS, names["sha256"])

    def request(request_id: str, ids: list[int]) -> Any:
        return names["Request"](request_id, list(ids), names["SamplingParams"](max_tokens=1),
                                None, block_hasher=hasher)

    # The first request's prefill: every block allocated and cached, then freed (its blocks
    # stay in the prefix cache, evictable).
    cached = len(tokens) if cached is None else cached
    if cached:
        first = request("prefill", tokens[:cached])
        if manager.allocate_slots(first, cached) is None:
            raise RuntimeError(f"vLLM: no room for {cached} tokens in {blocks} blocks")
        first.num_computed_tokens = cached
        manager.free(first)
    probe = request("lookup", tokens)

    def get_computed_blocks() -> object:
        return manager.get_computed_blocks(probe)

    def hit() -> int:
        return int(manager.get_computed_blocks(probe)[1])

    return get_computed_blocks, hit


def sglang_call(names: dict[str, Any], tokens: list[int], cached: int | None = None
                ) -> tuple[Call, HitCall]:
    """SGLang's ``RadixCache.match_prefix`` on a tree holding the prompt's first ``cached``
    tokens (None: all; one insert), and a call returning the tokens it found."""
    tree = names["RadixCache"].create_simulated(page_size=BLOCK_TOKENS)
    ids = array("q", tokens)
    torch = names["torch"]
    cached = len(tokens) if cached is None else cached
    if cached:
        tree.insert(names["InsertParams"](key=names["RadixKey"](ids[:cached]),
                                          value=torch.arange(cached, dtype=torch.int64)))
    # The scheduler's key: the whole prompt, capped one token short, no copy.
    params = names["MatchPrefixParams"](key=names["RadixKey"](ids, limit=len(tokens) - 1))

    def match_prefix() -> object:
        return tree.match_prefix(params)

    def hit() -> int:
        return int(tree.match_prefix(params).device_prefix_len)

    return match_prefix, hit


# -- timing -----------------------------------------------------------------------------------


def paired_medians(calls: dict[str, Call], *, rounds: int, samples: int,
                   warmup: int = WARMUP_CALLS) -> dict[str, tuple[float, list[float]]]:
    """Per side: the median seconds over every timed call, and each round's median. Rounds
    run the sides in turn, the order reversed every other round."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    gc.collect()
    gc.freeze()  # the set-up's objects: no collection during the rounds scans them
    times: dict[str, list[float]] = {name: [] for name in calls}
    per_round: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    clock = time.perf_counter
    try:
        for done in range(rounds):
            for name in order if done % 2 == 0 else order[::-1]:
                call = calls[name]
                batch: list[float] = []
                for _ in range(samples):
                    start = clock()
                    call()
                    batch.append(clock() - start)
                times[name].extend(batch)
                per_round[name].append(statistics.median(batch))
    finally:
        gc.unfreeze()
    return {name: (statistics.median(times[name]), per_round[name]) for name in calls}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def _ratio(peer: float | None, ours: float) -> float | None:
    return None if peer is None else round(peer / ours, 3)


def _ratio_range(peer: list[float] | None, ours: list[float]) -> list[float] | None:
    """The lowest and highest per-round ratio: how much the rounds disagreed."""
    if peer is None:
        return None
    ratios = [p / o for p, o in zip(peer, ours, strict=True)]
    return [round(min(ratios), 3), round(max(ratios), 3)]


def cached_tokens(length: int, fraction: float) -> int:
    """The tokens every side caches of a prompt of ``length``: all of it at ``fraction`` 1,
    else its first ``fraction`` in whole blocks."""
    if fraction >= 1:
        return length
    return int(length * fraction) // BLOCK_TOKENS * BLOCK_TOKENS


def measure_length(peers: Peers, config: str, length: int, *, rounds: int, samples: int,
                   progress: Callable[[str], None], cached_fraction: float = 1.0
                   ) -> dict[str, Any]:
    """One length of one configuration: every side's median and the ratios."""
    tokens = np.random.default_rng(PROMPT_SEED).integers(0, VOCABULARY, length)
    as_list = tokens.tolist()
    cached = cached_tokens(length, cached_fraction)
    progress(f"{config} {length}: building the sides")
    calls = kvfsm_calls(config, tokens, cached)
    hits = {"kvfsm": kvfsm_hit(calls["kvfsm"])}
    skipped: dict[str, str] = {}
    if peers.vllm is not None:
        calls["vllm"], hit = vllm_call(peers.vllm, config, as_list, cached)
        hits["vllm"] = hit()
    if peers.sglang is not None:
        if config == "full":
            calls["sglang"], hit = sglang_call(peers.sglang, as_list, cached)
            hits["sglang"] = hit()
        else:
            skipped["sglang"] = ("RadixCache is full attention only (SGLang serves sliding "
                                 "windows with another cache class)")
    if len(set(hits.values())) > 1:
        # A ratio between lookups that found different prefixes compares different work.
        progress(f"{config} {length}: WARNING the sides found different hits: {hits}")
    progress(f"{config} {length}: {rounds} rounds x {samples} calls of {', '.join(calls)}")
    timed = paired_medians(calls, rounds=rounds, samples=samples)
    ours, our_rounds = timed["kvfsm"]
    full, _ = timed["kvfsm_full"]
    vllm, vllm_rounds = timed.get("vllm", (None, None))
    sglang, sglang_rounds = timed.get("sglang", (None, None))
    row: dict[str, Any] = {
        "kvfsm_ms": _ms(ours),
        "kvfsm_full_nochecksum_ms": _ms(full),
        "vllm_ms": _ms(vllm),
        "sglang_ms": _ms(sglang),
        "vllm_ratio": _ratio(vllm, ours),
        "sglang_ratio": _ratio(sglang, ours),
        "vllm_ratio_vs_full_nochecksum": _ratio(vllm, full),
        "sglang_ratio_vs_full_nochecksum": _ratio(sglang, full),
        "vllm_ratio_rounds": _ratio_range(vllm_rounds, our_rounds),
        "sglang_ratio_rounds": _ratio_range(sglang_rounds, our_rounds),
        "hit_tokens": hits,
        "cached_tokens": cached,
    }
    if skipped:
        row["skipped"] = skipped
    progress(f"{config} {length}: kvfsm {row['kvfsm_ms']} ms, vllm x{row['vllm_ratio']}, "
             f"sglang x{row['sglang_ratio']}")
    return row


def _hashing_engine(hash_function: str | None) -> Engine | None:
    """An engine of the ``full`` model hashing with ``hash_function`` (None: the default), or
    None where this kvfsm has no such choice."""
    if hash_function is not None and "hash_function" not in attrs.fields_dict(CoreConfig):
        return None
    config = CoreConfig(device_blocks=BLOCK_TOKENS, host_blocks=0, backend="numpy")
    if hash_function is not None:
        config = attrs.evolve(config, hash_function=hash_function)
    return Engine(kvfsm_model("full"), config)


def measure_hashing(peers: Peers, *, tokens: int, rounds: int,
                    progress: Callable[[str], None]) -> dict[str, Any]:
    """Block hashes of one prompt from a Python list: vLLM's sha256 chain (its request block
    hasher on a request holding none yet) vs kvfsm's ``engine.prompt`` (its default hash, and
    SHA-256 where this kvfsm offers it)."""
    as_list = np.random.default_rng(PROMPT_SEED).integers(0, VOCABULARY, tokens).tolist()
    engine = _hashing_engine(None)
    assert engine is not None
    calls: dict[str, Call] = {"kvfsm": lambda: engine.prompt(as_list)}
    sha_engine = _hashing_engine(SHA256)
    if sha_engine is not None:
        calls["kvfsm_sha256"] = lambda: sha_engine.prompt(as_list)
    if peers.vllm is not None:
        names = peers.vllm
        names["init_none_hash"](names["sha256"])
        hasher = names["get_request_block_hasher"](BLOCK_TOKENS, names["sha256"])
        # No hasher given: the request holds no hashes, so each call hashes every block.
        bare = names["Request"]("hash", as_list, names["SamplingParams"](max_tokens=1), None)
        calls["vllm"] = lambda: hasher(bare)
    progress(f"hashing {tokens} tokens: {rounds} rounds x {HASH_SAMPLES} calls")
    timed = paired_medians(calls, rounds=rounds, samples=HASH_SAMPLES, warmup=1)
    ours = timed["kvfsm"][0]
    sha = timed["kvfsm_sha256"][0] if "kvfsm_sha256" in timed else None
    vllm = timed["vllm"][0] if "vllm" in timed else None
    return {"tokens": tokens, "kvfsm_ms": _ms(ours), "kvfsm_sha256_ms": _ms(sha),
            "vllm_ms": _ms(vllm), "vllm_ratio": _ratio(vllm, ours),
            "vllm_ratio_sha256": None if sha is None else _ratio(vllm, sha)}


def run(lengths: Sequence[int], *, rounds: int, samples: int, hash_tokens: int,
        skip: Sequence[str] = (), progress: Callable[[str], None] | None = None,
        cached_fraction: float = 1.0) -> dict[str, Any]:
    """The whole report: per length and configuration, every side's median and the ratios
    (each side caching the prompt's first ``cached_fraction``); the hashing comparison; the
    versions; the peers skipped and why."""
    say = progress or (lambda line: None)
    peers = import_peers(skip)
    for name, why in peers.skipped.items():
        say(f"{name} skipped: {why}")
    report: dict[str, Any] = {"lengths": {}, "block_tokens": BLOCK_TOKENS,
                              "window_tokens": WINDOW_TOKENS, "rounds": rounds,
                              "samples": samples, "cached_fraction": cached_fraction}
    for length in lengths:
        report["lengths"][str(length)] = {
            config: measure_length(peers, config, length, rounds=rounds, samples=samples,
                                   progress=say, cached_fraction=cached_fraction)
            for config in CONFIGS
        }
    report["hash"] = measure_hashing(peers, tokens=hash_tokens, rounds=rounds, progress=say)
    report["versions"] = peers.versions
    report["skipped"] = peers.skipped
    return report


def table(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    lines = [f"{'tokens':>8} {'config':<9} {'kvfsm ms':>9} {'vllm ms':>9} {'x vllm':>7} "
             f"{'sglang ms':>9} {'x sglang':>8}"]

    def cell(value: float | None, width: int) -> str:
        return f"{'-' if value is None else value:>{width}}"

    for length, configs in report["lengths"].items():
        for config, row in configs.items():
            lines.append(f"{length:>8} {config:<9} {cell(row['kvfsm_ms'], 9)} "
                         f"{cell(row['vllm_ms'], 9)} {cell(row['vllm_ratio'], 7)} "
                         f"{cell(row['sglang_ms'], 9)} {cell(row['sglang_ratio'], 8)}")
    hashing = report["hash"]
    lines.append(f"hashing {hashing['tokens']} tokens: kvfsm {hashing['kvfsm_ms']} ms "
                 f"(sha256 {cell(hashing['kvfsm_sha256_ms'], 1)} ms), vllm "
                 f"{cell(hashing['vllm_ms'], 1)} ms, x vllm {cell(hashing['vllm_ratio'], 1)} "
                 f"(vs sha256 {cell(hashing['vllm_ratio_sha256'], 1)})")
    lines.extend(f"skipped {name}: {why}" for name, why in report["skipped"].items())
    return "\n".join(lines)


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths: comma-separated token counts, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"--lengths: each length must be >= 2, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"--cached-fraction: a number from 0 to 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                        help="comma-separated prompt lengths in tokens")
    parser.add_argument("--rounds", type=_positive, default=DEFAULT_ROUNDS)
    parser.add_argument("--samples", type=_positive, default=DEFAULT_SAMPLES,
                        help="timed calls per side per round")
    parser.add_argument("--hash-tokens", type=_positive, default=HASH_TOKENS,
                        help="prompt length of the hashing comparison")
    parser.add_argument("--skip", choices=("vllm", "sglang"), action="append", default=[],
                        help="leave a peer out even if it imports")
    parser.add_argument("--cached-fraction", type=_fraction, default=1.0,
                        help="every side caches this fraction of the prompt (whole blocks) "
                             "and looks up all of it: 1, a full hit; below 1, a partial hit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run(args.lengths, rounds=args.rounds, samples=args.samples,
                 hash_tokens=args.hash_tokens, skip=args.skip,
                 cached_fraction=args.cached_fraction,
                 progress=lambda line: print(f"peer bench: {line}", file=sys.stderr,
                                             flush=True))
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
