"""SGLang HiCache scenarios for kvfsm's storage backend, run where SGLang 0.5.23 imports.

``tests/test_integrations_sglang.py`` calls :func:`run_all` in-process when SGLang imports there,
else runs this file with the interpreter ``KVFSM_PEERS_PYTHON`` names and reads the JSON it
prints. Every backend is built by SGLang's own ``StorageBackendFactory`` (the dynamic loader
for kvfsm, ``file`` for SGLang's stock backend) over SGLang's own CPU host pools, and driven
with the calls and arguments SGLang's cache controllers make. Each fault is applied to both
backends' stored copy of one page, and both answers are reported.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
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
FAULTS = ("none", "flipped", "torn", "missing", "foreign")


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


def _host_pool(sg: dict[str, Any], heads: int, layers: int) -> Any:
    """A real SGLang MHA host pool on CPU (fp16, ``layer_first``, not pinned)."""
    import torch

    device = sg["MHATokenToKVPool"](64, PAGE_TOKENS, torch.float16, heads, 8, layers, "cpu",
                                    False, start_layer=0, end_layer=layers)
    return sg["MHATokenToKVPoolHost"](
        device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE_TOKENS, "layer_first",
        pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
        end_layer=layers, write_back_staging=device.hicache_write_back_staging)


def _config(sg: dict[str, Any], model: str, extra: dict[str, Any]) -> Any:
    return sg["storage"].HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config=extra)


def _kvfsm(sg: dict[str, Any], directory: str, host: Any, model: str = MODEL,
           sidecars: dict[str, Any] | None = None) -> Any:
    """kvfsm's backend as SGLang attaches a dynamic one: the factory, then the host pools."""
    extra = {"backend_name": "kvfsm", "module_path": "kvfsm.integrations.sglang",
             "class_name": "KvfsmStorage", "kvfsm_disk_dir": directory,
             "kvfsm_disk_fsync": False}
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
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
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
    return backend._pools["kv"].key(backend.model, key).name


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
    return {"stored": [bool(x) for x in stored], "exists_after_restart": exists_after_restart,
            "loaded": [bool(x) for x in loaded], "equal": equal,
            "other_model_exists": other.batch_exists(keys),
            "staged_reads": reopened.counts["STAGED"], "no_tier_error": error,
            "backend_class": type(backend).__name__}


def run_all() -> dict[str, Any]:
    """Every scenario's results (JSON-ready)."""
    sg = _import_sglang()
    with tempfile.TemporaryDirectory(prefix="kvfsm-sglang-") as work:
        return {"faults": fault_table(sg, work), "hybrid": hybrid(sg, work),
                "lifecycle": lifecycle(sg, work)}


if __name__ == "__main__":
    print(json.dumps(run_all()))
