"""kvfsm inside vLLM's real v1 scheduler (``kvfsm.integrations.vllm``).

The scenarios (``tests/vllm_scenarios.py``) drive vLLM's own scheduler, KV cache manager and
connector factory on CPU, once per session: in this interpreter where vLLM imports, else in
``$KVFSM_PEERS_PYTHON`` (one subprocess for all of them: importing vLLM takes seconds). Without
either they are skipped, saying why. The declaration and settings tests need no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvfsm.integrations.vllm import (
    Mirror,
    MirrorSettings,
    MirrorSettingsError,
    UnsupportedSpecError,
    declare,
    mirror_for,
    model_identity,
    settings_of,
    unregister,
)
from kvfsm.spec import GroupKind
from tests.doc_figures import integers, page, section, table

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"
#: Seconds the scenario subprocess may take (about 25 s measured on 2 busy cores).
SCENARIO_TIMEOUT_S = 300
PEERS = "KVFSM_PEERS_PYTHON"
NO_FAULT_RUNS = ("full", "swa", "mamba", "mamba_async")
FAULTS = ("corrupt", "torn", "restore_fails", "in_flight", "foreign", "mamba_state_missing")
#: Full-attention blocks of the faulted prompt and the block each fault hits
#: (``vllm_scenarios.PROMPT_BLOCKS``, ``FAULT_INDEX``).
PROMPT_BLOCKS, FAULT_INDEX = 12, 6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario's results, run once."""
    out = tmp_path_factory.mktemp("vllm") / "results.json"
    if importlib.util.find_spec("vllm") is not None:
        sys.path.insert(0, str(ROOT))
        from tests import vllm_scenarios

        vllm_scenarios.main(str(out))
    else:
        python = os.environ.get(PEERS)
        if not python:
            pytest.skip(f"vLLM does not import here and {PEERS} names no interpreter where "
                        "it does (see docs/integrations.md for the pinned install)")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([python, str(SCENARIOS), str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S,
                              check=False)
        assert done.returncode == 0, done.stderr[-4000:]
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@pytest.mark.parametrize("run", NO_FAULT_RUNS)
def test_no_fault_kvfsm_admits_exactly_what_stock_vllm_admits(results: dict[str, Any],
                                                               run: str) -> None:
    """With no fault, every request is admitted with the same computed tokens with and without
    the cap (no lost reuse), every admission is usable, and the workload does hit."""
    sides = results["nofault"][run]
    stock, kvfsm = sides["stock"], sides["kvfsm"]
    assert kvfsm["class"] == ("KvfsmAsyncScheduler" if run.endswith("async")
                              else "KvfsmScheduler")
    assert kvfsm["admitted"] == stock["admitted"]
    assert stock["unusable"] == [] and kvfsm["unusable"] == []
    assert kvfsm["lookups"] > 0 and kvfsm["capped"] == 0
    assert sum(1 for n in stock["admitted"].values() if n > 0) >= 3


@pytest.mark.parametrize("fault", FAULTS)
def test_faulted_store_trusting_connector_admits_unusable_kvfsm_never(
        results: dict[str, Any], fault: str) -> None:
    """A fault in the offloaded copy makes a connector that trusts existence admit a prefix
    whose pages are wrong; kvfsm's connector admits only what it verified (so fewer tokens,
    never an unusable one), and stock vLLM (no store) admits nothing from it. A restore caught
    half-landed is the exception on the kvfsm side: its host copy is intact, so the restore
    rolls back to it and copies it again, and the whole prefix is admitted, usable."""
    row = results["faults"][fault]
    print(f"{fault}: admitted stock {row['stock']['admitted']}, trusting "
          f"{row['trusting']['admitted']} ({len(row['trusting']['unusable'])} unusable), "
          f"kvfsm {row['kvfsm']['admitted']} ({len(row['kvfsm']['unusable'])} unusable)")
    assert row["kvfsm"]["unusable"] == []
    assert row["stock"]["unusable"] == []
    assert len(row["trusting"]["unusable"]) == 1
    if fault == "in_flight":
        assert row["kvfsm"]["admitted"] == row["trusting"]["admitted"] == PROMPT_BLOCKS * 16
    else:
        assert 0 < row["kvfsm"]["admitted"] < row["trusting"]["admitted"]


def test_clean_store_kvfsm_connector_reuses_everything(results: dict[str, Any]) -> None:
    """With an undamaged store, kvfsm's connector restores and claims the whole offloaded
    prefix (what the trusting connector claims), and it is usable."""
    row = results["faults"]["none"]
    assert row["kvfsm"]["admitted"] == row["trusting"]["admitted"] > 0
    assert row["kvfsm"]["unusable"] == [] and row["trusting"]["unusable"] == []
    assert row["kvfsm"]["claims"]["restores"] >= 1


@pytest.mark.parametrize("scenario", ["salted", "adapters"])
def test_the_connector_serves_a_keyed_prefix_only_to_requests_with_its_key(
        results: dict[str, Any], scenario: str) -> None:
    """The same prompt under cache salts ``tenant-a`` and ``tenant-b`` and none (``salted``),
    or under LoRA adapters ``lora-a`` and ``lora-b`` and the base model (``adapters``), each
    after vLLM gave back every block: the second key's and the unkeyed request are claimed
    nothing of the first key's prefix held in kvfsm's tiers and compute it; the first key's
    second request is claimed the whole prefix, restored; every page read at every admitted
    length is the one written under that request's own key."""
    row = results[scenario]
    assert row["unusable"] == []
    admitted = row["admitted"]
    assert (admitted["a"], admitted["b"], admitted["base"]) == (0, 0, 0)
    assert admitted["a-again"] == row["whole"]
    assert row["claims"]["claimed"] == 1 and row["claims"]["restores"] >= 1


@pytest.mark.parametrize("fault", (*FAULTS, "none"))
def test_connector_saves_the_pages_the_forward_wrote(results: dict[str, Any],
                                                     fault: str) -> None:
    """With no payload source, kvfsm's device copy of every block of the computed prompt is
    the page the stand-in model wrote into the KV tensors (the connector read it out after
    the forward); stock vLLM, with no connector, stores nothing. The clean-store row then
    shows those bytes surviving host and disk: the KV tensors were zeroed, every block came
    back through a restore, and every page read at the admitted length was right."""
    row = results["faults"][fault]
    for side in ("kvfsm", "trusting"):
        stored = row[side]["stored"]
        assert stored["readable"] >= PROMPT_BLOCKS and stored["differ"] == 0, (side, stored)
    assert row["stock"]["stored"]["readable"] == 0


def _shared(results: dict[str, Any]) -> dict[str, Any]:
    shared: dict[str, Any] = results["shared"]
    if "skipped" in shared:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the shared-store scenarios did not run under CI: {shared['skipped']}")
        pytest.skip(shared["skipped"])
    return shared


def test_a_second_engine_reuses_a_prefix_through_mooncake(results: dict[str, Any]) -> None:
    """A prefix one vLLM engine computed and kvfsm moved down to a Mooncake Store is claimed,
    restored and usable in a second vLLM engine of the same model (own scheduler, mirror,
    disk and store client); stock vLLM, with no shared store, recomputes it."""
    row = _shared(results)["same_model"]
    assert row["kvfsm"]["pushed"] == PROMPT_BLOCKS
    assert row["kvfsm"]["admitted"] == PROMPT_BLOCKS * 16 and row["kvfsm"]["unusable"] == []
    assert row["kvfsm"]["claims"]["restores"] >= 1
    assert row["stock"]["admitted"] == 0


@pytest.mark.parametrize("case", ["other_model", "remote_corrupt", "remote_evicted"])
def test_shared_store_faults_never_reach_a_kvfsm_engine(results: dict[str, Any],
                                                        case: str) -> None:
    """Another model's values for the same tokens, a flipped bit in a stored value, a value
    the store evicted: a connector naming values by tokens alone admits the other model's
    pages and the flipped one (unusable), kvfsm's admits only verified pages of its own
    model, up to the damaged block."""
    row = _shared(results)[case]
    print(f"{case}: admitted stock {row['stock']['admitted']}, trusting "
          f"{row['trusting']['admitted']} ({len(row['trusting']['unusable'])} unusable), "
          f"kvfsm {row['kvfsm']['admitted']} ({len(row['kvfsm']['unusable'])} unusable)")
    assert row["kvfsm"]["unusable"] == [] and row["stock"]["unusable"] == []
    expected = 0 if case == "other_model" else FAULT_INDEX * 16
    assert row["kvfsm"]["admitted"] == expected
    if case != "remote_evicted":  # a value that is gone is not found by anyone
        assert len(row["trusting"]["unusable"]) == 1


# -- without vLLM --------------------------------------------------------------------------

def _spec(kind: str, **fields: Any) -> Any:
    """A stand-in for a vLLM spec: a class of that name with those fields."""
    return type(kind, (), {})() if not fields else _with(type(kind, (), {})(), fields)


def _with(obj: Any, fields: dict[str, Any]) -> Any:
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


def _config(*specs: Any) -> Any:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"layer{i}"])
              for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=32)


def test_declare_maps_each_vllm_group_to_its_kind() -> None:
    """Full attention, sliding window and Mamba groups become full, sliding_window and
    recurrent kvfsm groups with vLLM's block sizes (a Mamba state per block)."""
    attn = dict(block_size=16, num_kv_heads=2, head_size=16, dtype="torch.float16")
    model, maps = declare(_config(_spec("FullAttentionSpec", sliding_window=None, **attn),
                                  _spec("SlidingWindowSpec", sliding_window=32, **attn),
                                  _spec("MambaSpec", block_size=32, shapes=((4, 4),),
                                        dtypes=("torch.float32",))))
    assert [g.kind for g in maps] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW,
                                      GroupKind.RECURRENT]
    assert [g.name for g in model.groups] == ["g0", "g1", "g2"]
    assert model.groups[1].window == 32
    assert model.groups[2].checkpoint_interval == 32
    assert model.groups[0].payload_bytes == 16 * 2 * 2 * 16 * 2


def test_declare_payload_is_every_layers_page() -> None:
    """A group of several layers stores each layer's page of a block, so a save and a load
    carry all of them (one page per layer, in the group's layer order)."""
    spec = _spec("FullAttentionSpec", sliding_window=None, block_size=16, num_kv_heads=2,
                 head_size=16, dtype="torch.float16")
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["a", "b", "c"])
    model, maps = declare(SimpleNamespace(kv_cache_groups=[group], num_blocks=8))
    assert maps[0].layer_names == ("a", "b", "c")
    assert model.groups[0].payload_bytes == 3 * 16 * 2 * 2 * 16 * 2


def test_declare_refuses_what_kvfsm_has_no_kind_for() -> None:
    """An unmapped spec, a dtype without a kvfsm name and an empty config are typed errors
    naming the group."""
    with pytest.raises(UnsupportedSpecError, match=r"group 0 .*MLAAttentionSpec"):
        declare(_config(_spec("MLAAttentionSpec", block_size=16)))
    with pytest.raises(UnsupportedSpecError, match="dtype"):
        declare(_config(_spec("FullAttentionSpec", block_size=16, num_kv_heads=1,
                              head_size=8, dtype="torch.int8", sliding_window=None)))
    with pytest.raises(UnsupportedSpecError, match="no KV cache groups"):
        declare(_config())


def test_settings_come_from_the_connector_or_additional_config() -> None:
    """The connector's extra config wins, then ``additional_config``; unknown keys, wrong
    types and unknown levels are refused, naming where they came from."""
    transfer = SimpleNamespace(kv_connector_extra_config={"kvfsm": {"name": "a"}})
    both = SimpleNamespace(kv_transfer_config=transfer,
                           additional_config={"kvfsm": {"name": "b"}})
    assert settings_of(both).name == "a"
    assert settings_of(SimpleNamespace(kv_transfer_config=None,
                                       additional_config={"kvfsm": {"name": "b"}})).name == "b"
    assert settings_of(SimpleNamespace()) == MirrorSettings()
    with pytest.raises(MirrorSettingsError, match="unknown kvfsm settings"):
        MirrorSettings.from_mapping({"colour": 1}, "here")
    with pytest.raises(MirrorSettingsError, match="host_blocks"):
        MirrorSettings.from_mapping({"host_blocks": "8"}, "here")
    with pytest.raises(MirrorSettingsError, match="here"):
        MirrorSettings.from_mapping({"level": "paranoid"}, "here")


def test_settings_refuse_a_remote_store_they_cannot_reach_through() -> None:
    """A remote store is named by a known URL scheme and needs a disk tier above it (copies
    move down through disk); counts are not negative and a namespace is not empty."""
    ok = MirrorSettings.from_mapping({"disk_dir": "/tmp/x", "remote": "mooncake://h:1",
                                      "remote_blocks": 8}, "here")
    assert ok.remote == "mooncake://h:1"
    with pytest.raises(MirrorSettingsError, match="must start with"):
        MirrorSettings.from_mapping({"disk_dir": "/tmp/x", "remote": "s3://bucket"}, "here")
    with pytest.raises(MirrorSettingsError, match="needs disk_dir"):
        MirrorSettings.from_mapping({"remote": "redis://h:1"}, "here")
    with pytest.raises(MirrorSettingsError, match="remote_blocks must be >= 0"):
        MirrorSettings.from_mapping({"remote_blocks": -1}, "here")
    with pytest.raises(MirrorSettingsError, match="namespace"):
        MirrorSettings.from_mapping({"namespace": ""}, "here")


def _vllm_config(model: str = "org/model", **changes: Any) -> Any:
    fields = dict(model=model, revision=None, dtype="torch.float16", quantization=None)
    cache = {"cache_dtype": changes.pop("cache_dtype", "auto")}
    parallel = {"tensor_parallel_size": changes.pop("tp", 1), "pipeline_parallel_size": 1}
    fields.update(changes)
    return SimpleNamespace(model_config=SimpleNamespace(**fields),
                           cache_config=SimpleNamespace(**cache),
                           parallel_config=SimpleNamespace(**parallel))


def test_model_identity_names_what_changes_the_kv() -> None:
    """The same model and settings give one identity; another model, revision, dtype, KV
    cache dtype, quantization or tensor-parallel split gives another."""
    base = model_identity(_vllm_config())
    assert base == model_identity(_vllm_config())
    others = [_vllm_config("org/other"), _vllm_config(revision="v2"),
              _vllm_config(dtype="torch.bfloat16"), _vllm_config(cache_dtype="fp8"),
              _vllm_config(quantization="awq"), _vllm_config(tp=2)]
    identities = {model_identity(c) for c in others}
    assert base not in identities and len(identities) == len(others)


def _dense_config() -> Any:
    return _config(_spec("FullAttentionSpec", sliding_window=None, block_size=16,
                         num_kv_heads=2, head_size=16, dtype="torch.float16"))


def test_mirrors_share_stored_prefixes_only_within_one_model(tmp_path: Path) -> None:
    """Two mirrors of one model (any registry names) find each other's disk copies; a mirror
    of another model with the same KV geometry finds none of them, unless both are given one
    namespace on purpose."""
    from kvfsm.spec import Tier

    tokens = list(range(1000, 1000 + 4 * 16 + 1))

    def mirror(name: str, model: str, namespace: str | None = None) -> Mirror:
        settings = MirrorSettings(name=name, host_blocks=8, disk_dir=str(tmp_path / "shared"),
                                  disk_blocks=64, namespace=namespace)
        return Mirror(_dense_config(), settings, identity=model_identity(_vllm_config(model)))

    writer = mirror("w", "org/a")
    prompt = writer.engine.prompt(tokens)
    writer.engine.commit(prompt)
    ids = writer.engine.core.lookup_words("g0", *prompt.words(16))
    writer.engine.offload("g0", ids)
    writer.engine.spill_down("g0", Tier.HOST, 4)
    try:
        same = mirror("r1", "org/a")
        other = mirror("r2", "org/b")
        assert same.engine.lookup(same.engine.prompt(tokens)).restorable_tokens == 64
        assert other.engine.lookup(other.engine.prompt(tokens)).hit_tokens == 0
        # One namespace on purpose: the other model's engine now finds them (so set it only
        # for deployments known to serve the same weights).
        writer_ns = mirror("w2", "org/a", "team")
        p = writer_ns.engine.prompt(tokens)
        writer_ns.engine.commit(p)
        writer_ns.engine.offload("g0", writer_ns.engine.core.lookup_words("g0", *p.words(16)))
        writer_ns.engine.spill_down("g0", Tier.HOST, 4)
        reader_ns = mirror("r3", "org/b", "team")  # a disk tier indexes its files when opened
        assert reader_ns.engine.lookup(reader_ns.engine.prompt(tokens)).hit_tokens == 64
        for m in (same, other, writer_ns, reader_ns):
            m.close()
    finally:
        writer.close()


def test_a_registered_mirror_refuses_an_engine_of_another_model() -> None:
    """``mirror_for`` hands the registered mirror only to an engine of the model it was built
    for; another model is an error naming both."""
    name = "identity-check"
    unregister(name)
    settings = MirrorSettings(name=name)
    built = mirror_for(_dense_config(), settings, model_identity(_vllm_config("org/a")))
    try:
        assert mirror_for(_dense_config(), settings,
                          model_identity(_vllm_config("org/a"))) is built
        with pytest.raises(MirrorSettingsError, match="org/b"):
            mirror_for(_dense_config(), settings, model_identity(_vllm_config("org/b")))
    finally:
        unregister(name)
        built.close()


class _Pool:
    """The two methods of vLLM's ``BlockPool`` a mirror wraps (vLLM's own bookkeeping left
    out: the mirror acts on what they are called with)."""

    def cache_full_blocks(self, *args: Any) -> None:
        pass

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        return True


def _request(tokens: list[int], **keys: Any) -> Any:
    """A vLLM request as the mirror reads it: its tokens, and whatever keys it has."""
    fields = dict(lora_request=None, cache_salt=None, mm_features=None, prompt_embeds=None)
    fields.update(keys)
    return SimpleNamespace(all_token_ids=tokens, num_tokens=len(tokens), **fields)


def _lora(name: str, path: str = "/adapters/a") -> Any:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def _image(offset: int, length: int, identifier: str | None) -> Any:
    return SimpleNamespace(identifier=identifier,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_the_mirror_keeps_requests_with_other_adapters_salts_or_images_apart() -> None:
    """vLLM keys a request's blocks by its LoRA adapter, cache salt and multimodal inputs as
    well as its token ids; so does the mirror. Blocks vLLM cached for the base model are no
    hit for a LoRA request with the same tokens (and the reverse), nor for a salted one or one
    with an image behind its tokens (that one keeps the block before the image); each kind
    of request reuses its own, and vLLM's blocks of two adapters are two kvfsm blocks."""
    tokens = list(range(2000, 2000 + 4 * 16 + 1))
    mirror = Mirror(_dense_config(), MirrorSettings(name="keys"),
                    identity=model_identity(_vllm_config()))
    pool = _Pool()
    mirror.attach(SimpleNamespace(block_pool=pool, coordinator=SimpleNamespace()))

    def cache(request: Any, first_id: int) -> None:
        blocks = [SimpleNamespace(block_id=first_id + i, is_null=False, block_hash=i)
                  for i in range(4)]
        pool.cache_full_blocks(request, blocks, 0, 4, 16, 0)

    base, lora_a = _request(tokens), _request(tokens, lora_request=_lora("a"))
    cache(base, 0)
    assert mirror.verdict(base).usable_tokens == 64
    others = [lora_a, _request(tokens, lora_request=_lora("a", "/adapters/a-v2")),
              _request(tokens, cache_salt="tenant-2")]
    assert [mirror.verdict(r).hit_tokens for r in others] == [0, 0, 0]
    image = _request(tokens, mm_features=[_image(20, 20, "image-1")])
    assert mirror.verdict(image).usable_tokens == 16
    cache(lora_a, 10)
    assert mirror.verdict(lora_a).usable_tokens == 64
    assert mirror.kvfsm_block(10) != mirror.kvfsm_block(0)
    assert mirror.verdict(_request(tokens, lora_request=_lora("b"))).hit_tokens == 0
    assert mirror.verdict(base).usable_tokens == 64
    mirror.close()


def test_request_keys_are_what_vllm_hashes_beside_the_tokens() -> None:
    """No keys: the plain prompt. The adapter's name and path and the cache salt make the
    namespace (each part told apart); each image is a content key over its placeholders;
    prompt embeddings one over the prompt, named by their bytes."""
    from kvfsm.integrations.vllm._mirror import request_keys

    assert request_keys(_request([1, 2])) == (b"", ())
    namespaces = {request_keys(_request([1], **keys))[0] for keys in (
        {"lora_request": _lora("a")}, {"lora_request": _lora("a", "/other")},
        {"cache_salt": "a"}, {"lora_request": _lora("a"), "cache_salt": "x"})}
    assert len(namespaces) == 4 and b"" not in namespaces
    _, content = request_keys(_request([1] * 40, mm_features=[
        _image(30, 5, "late"), _image(2, 10, "early"), _image(12, 0, "empty")]))
    assert [(start, end) for start, end, _ in content] == [(2, 12), (30, 35)]
    unnamed = _request([1] * 40, mm_features=[_image(2, 10, None)])
    assert request_keys(unnamed) != request_keys(unnamed)  # never shared, even with itself
    torch = pytest.importorskip("torch")
    embeds = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    _, first = request_keys(_request([0, 0, 0], prompt_embeds=embeds))
    _, second = request_keys(_request([0, 0, 0], prompt_embeds=embeds + 1))
    assert [(s, e) for s, e, _ in first] == [(0, 3)] and first != second
    # Per chunk of rows (the mirror's finest block): a shared first chunk keeps its key.
    longer = torch.arange(40 * 4, dtype=torch.float16).reshape(40, 4)
    changed = longer.clone()
    changed[20] += 1
    _, keyed = request_keys(_request([0] * 40, prompt_embeds=longer), 16)
    _, other = request_keys(_request([0] * 40, prompt_embeds=changed), 16)
    assert [(s, e) for s, e, _ in keyed] == [(0, 16), (16, 32), (32, 40)]
    assert keyed[0] == other[0] and keyed[1] != other[1] and keyed[2] == other[2]


def test_bad_tier_settings_are_errors_naming_the_setting(tmp_path: Path) -> None:
    """A disk directory that cannot be made or written, and a store address where nothing
    answers, fail the mirror's construction (so vLLM's start-up) with a typed error naming
    the setting or address; no tier is left open."""
    from kvfsm.tiers import TierError
    from kvfsm.tiers._servers import free_port

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(MirrorSettingsError, match=r"disk_dir='.*a-file/kv' is not a writable"):
        Mirror(_dense_config(), MirrorSettings(disk_dir=str(blocker / "kv")), identity="m")
    port = free_port()
    for url in (f"mooncake://127.0.0.1:{port}", f"redis://127.0.0.1:{port}"):
        settings = MirrorSettings(disk_dir=str(tmp_path / "disk"), remote=url,
                                  remote_blocks=8)
        with pytest.raises(TierError, match=f"127.0.0.1:{port}"):
            Mirror(_dense_config(), settings, identity="m")


def test_the_mirror_serves_its_engines_metrics_on_the_port_it_is_given() -> None:
    """``metrics_port`` serves the mirror engine's Prometheus metrics over HTTP (lookups and
    their tokens counted), stops serving when the mirror closes; a port out of range or
    already taken is a settings error."""
    import urllib.request

    from kvfsm.tiers._servers import free_port

    port = free_port()
    mirror = Mirror(_dense_config(), MirrorSettings.from_mapping(
        {"metrics_port": port}, "here"), identity=model_identity(_vllm_config()))
    try:
        mirror.engine.lookup(mirror.engine.prompt(list(range(40))))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert 'kvfsm_lookups_total{level="standard"} 1.0' in text
        assert "kvfsm_prompt_tokens_total 40.0" in text
        with pytest.raises(MirrorSettingsError, match=f"metrics_port={port}"):
            Mirror(_dense_config(), MirrorSettings(metrics_port=port), identity="m")
    finally:
        mirror.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with pytest.raises(MirrorSettingsError, match="metrics_port"):
        MirrorSettings.from_mapping({"metrics_port": 70000}, "here")


class _Live:
    """A request as vLLM's are: weakly referenceable (the mirror keeps its prompt while it
    lives)."""

    def __init__(self, request: Any) -> None:
        self.__dict__.update(vars(request))


def test_a_requests_prompt_follows_its_tokens_and_a_verdict_is_reused_only_while_nothing_changed(
        ) -> None:
    """The mirror keeps each live request's prompt: asked again with the same tokens it is the
    same prompt, with tokens appended it hashes like a prompt made afresh of all of them, with
    a token changed it is a new one. The connector's lookup right after the scheduler's takes
    the scheduler's verdict only while no block changed since; after a commit it looks up
    again and sees the commit."""
    tokens = list(range(3000, 3000 + 4 * 16 + 1))
    mirror = Mirror(_dense_config(), MirrorSettings(name="prompts"),
                    identity=model_identity(_vllm_config()))
    engine = mirror.engine
    request: Any = _Live(_request(list(tokens)))
    first = mirror.prompt_of(request)
    assert mirror.prompt_of(request) is first
    request.all_token_ids += list(range(9000, 9020))
    request.num_tokens = len(request.all_token_ids)
    grown = mirror.prompt_of(request)
    fresh = engine.prompt(request.all_token_ids)
    assert grown.n_tokens == fresh.n_tokens
    assert all(np.array_equal(a, b) for a, b in zip(grown.words(16), fresh.words(16),
                                                   strict=True))
    request.all_token_ids[3] += 1
    changed = mirror.prompt_of(request)
    assert changed is not grown
    assert not np.array_equal(changed.words(16)[0], fresh.words(16)[0])

    other: Any = _Live(_request(list(tokens)))
    verdict = mirror.verdict(other)
    prompt = mirror.prompt_of(other)
    with engine.lock:
        assert mirror.verdict_now(other, prompt) is verdict
    assert mirror.verdicts_reused == 1
    mirror.verdict(other)
    engine.commit(prompt)
    with engine.lock:
        after = mirror.verdict_now(other, prompt)
    assert after is not verdict and after.usable_tokens == 64
    assert mirror.verdicts_reused == 1
    mirror.close()


# -- docs/integrations.md's figures are these scenarios' -----------------------------------

DOC = " ".join(section(page("integrations.md"), "What the tests show").split())


def _admitted(cell: str) -> tuple[int, int]:
    """``192 (**1**)``: tokens admitted, unusable admissions."""
    admitted, unusable = integers(cell)
    return admitted, unusable


def _side(row: dict[str, Any]) -> tuple[int, int]:
    return row["admitted"], len(row["unusable"])


def test_docs_no_fault_figures_are_the_runs(results: dict[str, Any]) -> None:
    found = re.search(r"\*\*No fault\*\* \((\d+) requests in (\d+) waves .*?, (\d+)-block pool"
                      r".*?\(window (\d+)\).*?\((\d+), (\d+), (\d+) and (\d+) capping lookups, "
                      r"(\d+) caps\)", DOC)
    assert found, "the page's no-fault figures moved"
    requests, waves, pool, window, *lookups, caps = map(int, found.groups())
    settings = results["settings"]
    assert (waves, pool, window) == (settings["no_fault_waves"], settings["no_fault_blocks"],
                                     settings["window"])
    for run, expected in zip(NO_FAULT_RUNS, lookups, strict=True):
        sides = results["nofault"][run]
        assert len(sides["stock"]["admitted"]) == len(sides["kvfsm"]["admitted"]) == requests
        assert (sides["kvfsm"]["lookups"], sides["kvfsm"]["capped"]) == (expected, caps), run


def test_docs_fault_table_is_the_runs(results: dict[str, Any]) -> None:
    """The offloaded-store table, a row per fault (in the scenarios' order, then the clean
    store): each side's admitted tokens and unusable admissions; and the bytes each side
    stored, as the page gives them."""
    rows = table(section(page("integrations.md"), "What the tests show"),
                 "fault (block 6 of 12")
    assert len(rows) == len(FAULTS) + 1 and rows[-1][0].startswith("none")
    for row, fault in zip(rows, (*FAULTS, "none"), strict=True):
        sides = results["faults"][fault]
        assert [_admitted(cell) for cell in row[1:]] == [
            _side(sides[side]) for side in ("stock", "trusting", "kvfsm")], (fault, row)
    found = re.search(r"each of its blocks \((\d+), or (\d+) with the Mamba group\) is exactly "
                      r"the page the stand-in model wrote \((\d+) differ", DOC)
    assert found
    full, mamba, differ = map(int, found.groups())
    for fault, sides in results["faults"].items():
        for side in ("trusting", "kvfsm"):
            stored = sides[side]["stored"]
            expected = mamba if fault == "mamba_state_missing" else full
            assert (stored["readable"], stored["differ"]) == (expected, differ), (fault, side)


@pytest.mark.parametrize(("scenario", "title"), [("salted", "Same tokens, another tenant"),
                                                 ("adapters", "Same tokens, another adapter")])
def test_docs_keyed_figures_are_the_runs(results: dict[str, Any], scenario: str,
                                         title: str) -> None:
    found = re.search(rf"\*\*{title}\.\*\* .*? (\d+) requests .*?claimed all (\d+) tokens", DOC)
    assert found, title
    count, claimed = map(int, found.groups())
    assert len(results[scenario]["admitted"]) == count
    assert results[scenario]["admitted"]["a-again"] == claimed
    assert f"same {results['settings']['prompt_blocks']}-block prompt" in DOC


def test_docs_shared_store_table_is_the_runs(results: dict[str, Any]) -> None:
    shared = _shared(results)
    rows = table(section(page("integrations.md"), "What the tests show"),
                 "what the store holds for the consumer")
    assert len(rows) == len(shared)
    for row, case in zip(rows, shared, strict=True):  # the scenarios' order
        assert [_admitted(cell) for cell in row[1:]] == [
            _side(shared[case][side]) for side in ("stock", "trusting", "kvfsm")], (case, row)


def test_docs_times_name_keys_of_the_results(results: dict[str, Any]) -> None:
    for key in ("total_s", "import_s", "shared_s"):
        assert f"`{key}`" in DOC, key
        assert isinstance(results[key], float) and results[key] > 0, key
