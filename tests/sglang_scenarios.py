"""SGLang HiCache scenarios for kvfsm's storage backend, run where SGLang 0.5.23 imports.

``tests/test_integrations_sglang.py`` calls :func:`run_all` in-process when SGLang imports there,
else runs this file with the interpreter ``KVFSM_PEERS_PYTHON`` names and reads the JSON it
prints. Every backend is built by SGLang's own ``StorageBackendFactory`` (the dynamic loader
for kvfsm, ``file`` for SGLang's stock backend) over SGLang's own CPU host pools, and driven
with the calls and arguments SGLang's cache controllers make. Each fault is applied to both
backends' stored copy of one page, and both answers are reported.

The shared-store scenarios start a Mooncake Store master (and a Redis server) on 127.0.0.1
themselves and build several instances on it, each with its own client, as separate SGLang
servers sharing one store would be; SGLang's stock ``mooncake`` backend runs the same steps.
Where the Mooncake client or ``mooncake_master`` is missing they report why instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Pages per request, the page hit by a fault, tokens per page.
PAGES = 8
FAULT_PAGE = 4
PAGE_TOKENS = 4
#: Mamba-like state checkpoints: after these pages (1-based lengths).
CHECKPOINTS = (4, 8)
MODEL = "test/model-a"
OTHER_MODEL = "test/model-b"
#: Another model whose served name differs from MODEL only by "-" for "/": SGLang's Mooncake
#: backend turns "/" into "-" when it prefixes its keys with the model name.
DASHED_MODEL = "test-model-a"
FAULTS = ("none", "flipped", "torn", "missing", "foreign")
#: Device-pool tokens behind each host pool (the host pool holds twice as many).
DEVICE_TOKENS = 64
SHARED_DEVICE_TOKENS = 128
#: What each Mooncake client lends the store and buffers (small: a few dozen pages in all).
MOONCAKE_SEGMENT_BYTES = 32 << 20
MOONCAKE_BUFFER_BYTES = 16 << 20
#: Rows of the other-model scenario: the name the writing instance serves.
OTHER_MODELS = {"other_name": OTHER_MODEL, "dashed_name": DASHED_MODEL}


def _import_sglang() -> dict[str, Any]:
    """SGLang's names the scenarios use; its memory pools import torchvision transforms at
    module level, answered by tools/peer_bench.py's placeholder where torchvision is absent."""
    sys.path.insert(0, str(ROOT / "tools"))
    peer_bench = importlib.import_module("peer_bench")
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.append(peer_bench._TorchvisionPlaceholder())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        factory = importlib.import_module("sglang.srt.mem_cache.storage")
        pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
        host = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    return {"storage": storage, "factory": factory.StorageBackendFactory,
            "MHATokenToKVPool": pool.MHATokenToKVPool,
            "MHATokenToKVPoolHost": host.MHATokenToKVPoolHost}


def _host_pool(sg: dict[str, Any], heads: int, layers: int, layout: str = "layer_first",
               tokens: int = DEVICE_TOKENS) -> Any:
    """A real SGLang MHA host pool on CPU (fp16, ``layout``, not pinned)."""
    import torch

    device = sg["MHATokenToKVPool"](tokens, PAGE_TOKENS, torch.float16, heads, 8, layers, "cpu",
                                    False, start_layer=0, end_layer=layers)
    return sg["MHATokenToKVPoolHost"](
        device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE_TOKENS, layout,
        pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
        end_layer=layers, write_back_staging=device.hicache_write_back_staging)


def _config(sg: dict[str, Any], model: str, extra: dict[str, Any]) -> Any:
    return sg["storage"].HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config=extra)


def _kvfsm(sg: dict[str, Any], directory: str, host: Any, model: str = MODEL,
           sidecars: dict[str, Any] | None = None) -> Any:
    """kvfsm's backend on a disk directory (see :func:`_kvfsm_on`)."""
    return _kvfsm_on(sg, {"kvfsm_disk_dir": directory, "kvfsm_disk_fsync": False}, host,
                     model, sidecars)


def _kvfsm_on(sg: dict[str, Any], tier: dict[str, Any], host: Any, model: str = MODEL,
              sidecars: dict[str, Any] | None = None) -> Any:
    """kvfsm's backend as SGLang attaches a dynamic one: the factory (``tier``: the extra
    config's tier fields), then the host pools."""
    extra = {"backend_name": "kvfsm", "module_path": "kvfsm.integrations.sglang",
             "class_name": "KvfsmStorage", **tier}
    backend = sg["factory"].create_backend("dynamic", _config(sg, model, extra), host)
    backend.register_mem_pool_host(host)
    for name, pool in (sidecars or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    return backend


def _stock(sg: dict[str, Any], directory: str, host: Any, model: str = MODEL,
           sidecars: dict[str, Any] | None = None) -> Any:
    """SGLang's own file backend over the same pools."""
    backend = sg["factory"].create_backend(
        "file", _config(sg, model, {"file_storage_path": directory}), host)
    backend.register_mem_pool_host(host)
    for name, pool in (sidecars or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    return backend


def _fill(host: Any, pages: int, seed: int) -> Any:
    """Host indices of ``pages`` fresh pages holding distinct random values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    indices = host.alloc(pages * PAGE_TOKENS)
    for page in range(pages):
        first = int(indices[page * PAGE_TOKENS])
        data = torch.randn(host.get_dummy_flat_data_page().shape, generator=generator)
        host.set_from_flat_data_page(first, data.to(host.dtype))
    return indices


def _keys(prefix: str, pages: int) -> list[str]:
    return [f"{prefix}{i:060x}" for i in range(pages)]


def _page_file(directory: str, marker: str) -> Path:
    """The one file in ``directory`` whose name holds ``marker``."""
    found = [p for p in Path(directory).iterdir() if marker in p.name and p.is_file()
             and not p.name.startswith(".")]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} files match {marker!r} in {directory}")
    return found[0]


def _apply(fault: str, path: Path, foreign: Path | None) -> None:
    """Damage ``path`` as ``fault`` says (``foreign``: a whole value of another model, renamed
    onto it)."""
    if fault == "flipped":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    elif fault == "torn":
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif fault == "missing":
        path.unlink()
    elif fault == "foreign" and foreign is not None:
        os.replace(foreign, path)


def _get_outcome(backend: Any, host: Any, keys: list[str], originals: list[Any]) -> str:
    """What reading every page back gives: "ok", "refused at N" (None from page N on),
    "wrong bytes at N" (returned bytes that are not the page's) or "raised <error>"."""
    import torch

    targets = [host.get_dummy_flat_data_page() for _ in keys]
    try:
        pages = backend.batch_get(keys, targets)
    except Exception as exc:  # the stock backend raises on a short file
        return f"raised {type(exc).__name__}"
    for i, (page, original) in enumerate(zip(pages, originals, strict=True)):
        if page is None:
            return f"refused at {i}"
        if not torch.equal(page, original):
            return f"wrong bytes at {i}"
    return "ok"


def fault_table(sg: dict[str, Any], work: str) -> dict[str, Any]:
    """Per fault on page ``FAULT_PAGE``: what ``batch_exists`` counts and what reading the
    pages back gives, stock file backend and kvfsm, after both stored the same 8 pages."""
    host = _host_pool(sg, heads=2, layers=2)
    indices = _fill(host, PAGES, seed=1)
    originals = [host.get_data_page(int(indices[i * PAGE_TOKENS])).clone() for i in range(PAGES)]
    keys = _keys("a", PAGES)
    table: dict[str, Any] = {}
    for fault in FAULTS:
        row: dict[str, Any] = {}
        for side, make in (("stock", _stock), ("kvfsm", _kvfsm)):
            directory = tempfile.mkdtemp(dir=work, prefix=f"{side}-{fault}-")
            backend = make(sg, directory, host)
            assert backend.batch_set(keys, originals)
            foreign = None
            if fault == "foreign":
                other_dir = tempfile.mkdtemp(dir=work, prefix=f"{side}-other-")
                other = make(sg, other_dir, host, model=OTHER_MODEL)
                assert other.batch_set(keys, [torch_like(o) for o in originals])
                foreign = _page_file(other_dir, _marker(side, other, keys[FAULT_PAGE]))
            target = _page_file(directory, _marker(side, backend, keys[FAULT_PAGE]))
            _apply(fault, target, foreign)
            row[side] = {"exists": backend.batch_exists(keys),
                         "get": _get_outcome(backend, host, keys, originals)}
            if side == "kvfsm":
                row[side]["counts"] = dict(backend.counts)
        table[fault] = row
    return table


def torch_like(page: Any) -> Any:
    """Another model's page of the same geometry: different bytes, same length."""
    return page.flip(0).contiguous()


def _marker(side: str, backend: Any, key: str) -> str:
    """The part of a page's file name that finds it: SGLang's key for the stock backend,
    kvfsm's stored name for kvfsm."""
    if side == "stock":
        return key
    return str(backend._pools["kv"].key(backend.model, key).name)


def hybrid(sg: dict[str, Any], work: str) -> dict[str, Any]:
    """A KV pool plus a Mamba-like state pool holding states only at ``CHECKPOINTS``:
    ``batch_exists_v2`` with the trailing-page policy, before and after the state at the
    last checkpoint is flipped, stock and kvfsm; and kvfsm's v2 read of a state."""
    import torch

    storage = sg["storage"]
    kv_host = _host_pool(sg, heads=2, layers=2)
    state_host = _host_pool(sg, heads=1, layers=1)  # a second pool: another page geometry
    mamba = storage.PoolName.MAMBA
    kv_indices = _fill(kv_host, PAGES, seed=2)
    state_indices = _fill(state_host, len(CHECKPOINTS), seed=3)
    keys = _keys("h", PAGES)
    checkpoint_keys = [keys[n - 1] for n in CHECKPOINTS]
    out: dict[str, Any] = {}
    for side, make in (("stock", _stock), ("kvfsm", _kvfsm)):
        directory = tempfile.mkdtemp(dir=work, prefix=f"hybrid-{side}-")
        backend = make(sg, directory, kv_host, sidecars={mamba: state_host})
        kv_pages = [kv_host.get_data_page(int(kv_indices[i * PAGE_TOKENS])).clone()
                    for i in range(PAGES)]
        assert backend.batch_set(keys, kv_pages)
        written = backend.batch_set_v2([storage.PoolTransfer(
            name=mamba, host_indices=state_indices, keys=checkpoint_keys,
            hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)])
        query = [storage.PoolTransfer(name=mamba, keys=[keys[-1]],
                                      hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)]

        def ask(backend: Any = backend, query: list[Any] = query) -> dict[str, Any]:
            result = backend.batch_exists_v2(keys, query)
            return {"kv_hit_pages": result.kv_hit_pages,
                    "restorable": list(result.restorable_prefix_pages or [])}

        row: dict[str, Any] = {"written": {str(k): v for k, v in written.items()},
                               "clean": ask()}
        marker = (f"{checkpoint_keys[-1]}.{mamba.value}" if side == "stock"
                  else backend._pools[mamba.value].key(backend.model, checkpoint_keys[-1]).name)
        _apply("flipped", _page_file(directory, marker), None)
        # Asked by a backend that has not read the state before (another rank, a restart):
        # kvfsm keeps the bytes it verified, and those would still be the state's own.
        row["state_flipped"] = ask(make(sg, directory, kv_host, sidecars={mamba: state_host}))
        if side == "kvfsm":
            fresh = state_host.alloc(len(CHECKPOINTS) * PAGE_TOKENS)
            reader = make(sg, directory, kv_host, sidecars={mamba: state_host})
            read = reader.batch_get_v2([storage.PoolTransfer(
                name=mamba, host_indices=fresh, keys=checkpoint_keys,
                hit_policy=storage.PoolHitPolicy.TRAILING_PAGES)])
            first = int(fresh[0])
            row["v2_read"] = [bool(x) for x in read[mamba.value]]
            row["v2_first_equal"] = bool(torch.equal(
                state_host.get_data_page(first),
                state_host.get_data_page(int(state_indices[0]))))
        out[side] = row
    return out


def lifecycle(sg: dict[str, Any], work: str) -> dict[str, Any]:
    """The other ways SGLang moves pages: the v1 interface into host indices, a backend
    reopened on the same directory (a restarted server), and a config naming no tier."""
    import torch

    host = _host_pool(sg, heads=2, layers=2)
    indices = _fill(host, PAGES, seed=4)
    keys = _keys("v", PAGES)
    directory = tempfile.mkdtemp(dir=work, prefix="lifecycle-")
    backend = _kvfsm(sg, directory, host)
    stored = backend.batch_set_v1(keys, indices)
    fresh = host.alloc(PAGES * PAGE_TOKENS)
    reopened = _kvfsm(sg, directory, host)
    exists_after_restart = reopened.batch_exists(keys)
    loaded = reopened.batch_get_v1(keys, fresh)
    equal = all(torch.equal(host.get_data_page(int(fresh[i * PAGE_TOKENS])),
                            host.get_data_page(int(indices[i * PAGE_TOKENS])))
                for i in range(PAGES))
    other = _kvfsm(sg, directory, host, model=OTHER_MODEL)
    error = ""
    try:
        sg["factory"].create_backend("dynamic", _config(sg, MODEL, {
            "backend_name": "kvfsm", "module_path": "kvfsm.integrations.sglang",
            "class_name": "KvfsmStorage"}), host)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    bad_field = ""
    try:  # refused before any client is built: no master needs to run
        _kvfsm_on(sg, {"kvfsm_mooncake_master": "127.0.0.1:1",
                       "kvfsm_mooncake_segment_bytes": "lots"}, host)
    except Exception as exc:
        bad_field = f"{type(exc).__name__}: {exc}"
    return {"stored": [bool(x) for x in stored], "exists_after_restart": exists_after_restart,
            "loaded": [bool(x) for x in loaded], "equal": equal,
            "other_model_exists": other.batch_exists(keys),
            "staged_reads": reopened.counts["STAGED"], "no_tier_error": error,
            "bad_field_error": bad_field,
            "backend_class": type(backend).__name__}


# -- one store shared by several SGLang instances ----------------------------------------------


def _kvfsm_mooncake(sg: dict[str, Any], master: str, host: Any, model: str) -> Any:
    """kvfsm's backend on the Mooncake master at ``master``, with its own client."""
    return _kvfsm_on(sg, {"kvfsm_mooncake_master": master,
                          "kvfsm_mooncake_segment_bytes": MOONCAKE_SEGMENT_BYTES,
                          "kvfsm_mooncake_buffer_bytes": MOONCAKE_BUFFER_BYTES}, host, model)


def _stock_mooncake(sg: dict[str, Any], master: str, host: Any, model: str) -> Any:
    """SGLang's own ``mooncake`` backend on the same master (TCP, no metadata server), with
    its own client."""
    extra = {"master_server_address": master, "protocol": "tcp",
             "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
             "global_segment_size": MOONCAKE_SEGMENT_BYTES}
    backend = sg["factory"].create_backend("mooncake", _config(sg, model, extra), host)
    backend.register_mem_pool_host(host)
    return backend


def _stored_names(side: str, backend: Any, key: str) -> tuple[Any, list[Any]]:
    """How to reach page ``key``'s stored value(s) raw: kvfsm's (tier, [BlockKey]), or the
    stock backend's (raw client, [its object names]): every object it reads for the page."""
    if side == "kvfsm":
        return backend.tier, [backend._pools["kv"].key(backend.model, key)]
    tagged = backend._tag_keys([key])[0]
    return backend.store, [f"{tagged}_{backend.mha_suffix}_{part}" for part in ("k", "v")]


def _damage(side: str, backend: Any, key: str, fault: str) -> None:
    """Flip one byte in the middle of page ``key``'s stored value, or remove it, through the
    store's raw client: no check on the way."""
    from kvfsm.serve._stores import delete_value, read_value, write_value

    where, names = _stored_names(side, backend, key)
    for name in names[:1]:  # the stock backend's K object: either half is a page's loss
        raw = read_value(where, name) if side == "kvfsm" else where.get(name)
        assert raw, f"no stored value for {name}"
        if fault == "flipped":
            flipped = bytearray(raw)
            flipped[len(flipped) // 2] ^= 0x10
            if side == "kvfsm":
                write_value(where, name, bytes(flipped))
            else:
                assert where.upsert(name, bytes(flipped)) == 0
        elif side == "kvfsm":
            assert delete_value(where, name)
        else:
            assert where.remove(name, True) == 0  # forced: past the read lease


def _pages(host: Any, indices: Any) -> list[Any]:
    """Copies of the flat pages starting at every page of ``indices``."""
    return [host.get_data_page(int(indices[i * PAGE_TOKENS])).clone()
            for i in range(len(indices) // PAGE_TOKENS)]


def _v1_outcome(backend: Any, host: Any, keys: list[str], originals: list[Any]) -> str:
    """What ``batch_get_v1`` into fresh host pages gives, as :func:`_get_outcome` says it."""
    import torch

    fresh = host.alloc(len(keys) * PAGE_TOKENS)
    try:
        loaded = backend.batch_get_v1(keys, fresh)
    except Exception as exc:
        return f"raised {type(exc).__name__}"
    pages = _pages(host, fresh)
    host.free(fresh)
    for i, (good, page, original) in enumerate(zip(loaded, pages, originals, strict=True)):
        if not good:
            return f"refused at {i}"
        if not torch.equal(page, original):
            return f"wrong bytes at {i}"
    return "ok"


def _served(backend: Any, host: Any, keys: list[str]) -> int:
    """How many pages ``batch_get_v1`` fills into fresh host pages."""
    fresh = host.alloc(len(keys) * PAGE_TOKENS)
    try:
        return sum(bool(x) for x in backend.batch_get_v1(keys, fresh))
    finally:
        host.free(fresh)


def _exists_v2(backend: Any, keys: list[str]) -> dict[str, Any]:
    result = backend.batch_exists_v2(keys, [])
    return {"kv_hit_pages": result.kv_hit_pages,
            "restorable": list(result.restorable_prefix_pages or [])}


def _shared_side(sg: dict[str, Any], side: str, make: Any, built: list[Any]) -> dict[str, Any]:
    """One backend kind over one shared store: instance A writes, instance B (same model and
    shard, its own client) checks and reads; instances of other models write pages under
    names A then asks for; page ``FAULT_PAGE`` of two more of A's requests is flipped or
    removed behind the backends' backs, and B asks again. ``built`` collects every backend."""
    def instance(model: str) -> tuple[Any, Any]:
        host = _host_pool(sg, heads=2, layers=2, layout="page_first",
                          tokens=SHARED_DEVICE_TOKENS)
        built.append(make(host, model))
        return built[-1], host

    a, a_host = instance(MODEL)
    b, b_host = instance(MODEL)
    indices = _fill(a_host, PAGES, seed=11)
    originals = _pages(a_host, indices)
    keys = _keys("s", PAGES)
    shared: dict[str, Any] = {
        "written": sum(bool(x) for x in a.batch_set_v1(keys, indices)),
        "exists": b.batch_exists(keys), "exists_v2": _exists_v2(b, keys),
        "get_v1": _v1_outcome(b, b_host, keys, originals)}
    if side == "kvfsm":  # SGLang's generic path: pages as tensors (stock takes pointers)
        shared["get"] = _get_outcome(b, b_host, keys, originals)
        shared["reader_counts"] = dict(b.counts)
    models: dict[str, Any] = {}
    for n, (row, model) in enumerate(OTHER_MODELS.items()):
        c, c_host = instance(model)
        names = _keys(f"m{n}", PAGES)
        written = c.batch_set_v1(names, _fill(c_host, PAGES, seed=20 + n))
        models[row] = {"model": model, "written": sum(bool(x) for x in written),
                       "exists": a.batch_exists(names), "served": _served(a, a_host, names)}
    if side == "kvfsm":
        models["asker_counts"] = dict(a.counts)
    faults: dict[str, Any] = {}
    for fault in ("flipped", "evicted"):
        names = _keys(fault[0], PAGES)
        assert all(a.batch_set_v1(names, indices))
        _damage(side, a, names[FAULT_PAGE], fault)
        faults[fault] = {"exists": b.batch_exists(names),
                         "get_v1": _v1_outcome(b, b_host, names, originals)}
    if side == "kvfsm":
        faults["reader_counts"] = dict(b.counts)
    return {"shared": shared, "other_models": models, "faults": faults}


def _close(side: str, backends: list[Any]) -> None:
    """Close every client (kvfsm's close its tier; the stock backend's ``close`` does nothing
    and its client unmounts only when closed)."""
    for backend in backends:
        if side == "kvfsm":
            backend.close()
        else:
            backend.store.close()


def mooncake_shared(sg: dict[str, Any]) -> dict[str, Any]:
    """Every shared-store step on a Mooncake master started here, stock ``mooncake`` and
    kvfsm, or ``{"unavailable": why}`` where the client or master is missing."""
    from kvfsm.serve._stores import quiet_stderr, remote_unusable
    from kvfsm.tiers import MooncakeMaster

    why = remote_unusable("mooncake")
    if why is not None:
        return {"unavailable": why}
    out: dict[str, Any] = {}
    with MooncakeMaster() as master:
        makers = {"stock": lambda host, model: _stock_mooncake(sg, master.address, host, model),
                  "kvfsm": lambda host, model: _kvfsm_mooncake(sg, master.address, host, model)}
        for side, make in makers.items():
            built: list[Any] = []
            try:
                out[side] = _shared_side(sg, side, make, built)
            finally:
                with quiet_stderr():
                    _close(side, built)
    return out


def redis_shared(sg: dict[str, Any]) -> dict[str, Any]:
    """kvfsm only (SGLang ships no Redis backend): instance A writes through one Redis server,
    instance B finds and reads the pages, then finds the prefix end at a flipped value."""
    from kvfsm.serve._stores import remote_unusable
    from kvfsm.tiers import RedisServer

    why = remote_unusable("redis")
    if why is not None:
        return {"unavailable": why}
    with RedisServer() as server:
        hosts = [_host_pool(sg, heads=2, layers=2, layout="page_first",
                            tokens=SHARED_DEVICE_TOKENS) for _ in range(2)]
        a, b = (_kvfsm_on(sg, {"kvfsm_redis": server.address}, host) for host in hosts)
        try:
            indices = _fill(hosts[0], PAGES, seed=12)
            originals = _pages(hosts[0], indices)
            keys, flipped = _keys("r", PAGES), _keys("q", PAGES)
            assert all(a.batch_set_v1(keys, indices)) and all(a.batch_set_v1(flipped, indices))
            _damage("kvfsm", a, flipped[FAULT_PAGE], "flipped")
            return {"exists": b.batch_exists(keys),
                    "get": _get_outcome(b, hosts[1], keys, originals),
                    "flipped_exists": b.batch_exists(flipped),
                    "flipped_get_v1": _v1_outcome(b, hosts[1], flipped, originals)}
        finally:
            a.close()
            b.close()


def run_all() -> dict[str, Any]:
    """Every scenario's results (JSON-ready), and the seconds they took: in all, importing
    SGLang, and the shared Mooncake Store's scenarios."""
    started = time.perf_counter()
    sg = _import_sglang()
    results: dict[str, Any] = {"import_s": time.perf_counter() - started}
    with tempfile.TemporaryDirectory(prefix="kvfsm-sglang-") as work:
        results.update(faults=fault_table(sg, work), hybrid=hybrid(sg, work),
                       lifecycle=lifecycle(sg, work))
        shared_started = time.perf_counter()
        results["mooncake"] = mooncake_shared(sg)
        results["mooncake_s"] = time.perf_counter() - shared_started
        results["redis"] = redis_shared(sg)
    results["defaults"] = extra_config_defaults()
    results["total_s"] = time.perf_counter() - started
    return results


def extra_config_defaults() -> dict[str, Any]:
    """The backend's default for each extra-config field that has one (``DEFAULT_<NAME>`` for
    the field constant ``NAME``)."""
    from kvfsm.integrations.sglang import _backend

    fields = {name: value for name, value in vars(_backend).items()
              if name.isupper() and isinstance(value, str) and value.startswith("kvfsm_")}
    return {field: getattr(_backend, f"DEFAULT_{name}") for name, field in fields.items()
            if hasattr(_backend, f"DEFAULT_{name}")}


if __name__ == "__main__":
    print(json.dumps(run_all()))
