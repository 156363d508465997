"""kvfsm's stored tiers as an SGLang HiCache storage backend (L3), loaded dynamically.

SGLang builds it through its backend factory (``--hicache-storage-backend dynamic`` with
``module_path`` ``kvfsm.integrations.sglang`` and ``class_name`` ``KvfsmStorage``) as
``KvfsmStorage(storage_config, kwargs)``, then registers its host pools. Every value goes
through a kvfsm :class:`~kvfsm.tiers.StoredTier` (a crash-safe disk directory, Mooncake Store,
Redis/Valkey) with its 128-byte header, so:

* a page is reported to exist (``exists``, ``batch_exists``, ``batch_exists_v2``) only after
  its stored copy was read and verified: whole, this key's (model, shard, pool, layout,
  prefix) and matching its checksum. A torn, flipped, missing or foreign value is never
  counted, and the tier deletes a bad one;
* reads (``get``, ``batch_get``, ``batch_get_v1``, ``batch_get_v2``) write a host page only
  with verified bytes; a page that fails answers None / False and the host page is untouched;
* ``batch_exists_v2`` answers hybrid models per pool from kvfsm's kind rules
  (:mod:`kvfsm.integrations.sglang._verdict`): the prefix lengths where the KV pages and every
  sidecar pool's needed pages (all of them, or the trailing state) verified.

The bytes a check read are kept (bounded, ``kvfsm_staging_bytes``) for the read that follows.
Tier calls are serialized by one lock (SGLang's prefetch and backup threads share the backend).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch
import xxhash
from numpy.typing import NDArray
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvfsm.integrations.sglang._identity import (
    TP_SHARDED_POOLS,
    PagePool,
    namespace_digest,
    page_pool,
)
from kvfsm.integrations.sglang._staging import VerifiedPages
from kvfsm.integrations.sglang._verdict import (
    ALL_PAGES,
    KV_POOL,
    TRAILING_PAGES,
    pool_for_policy,
    restorable_prefix,
)
from kvfsm.tiers import (
    BlockKey,
    DiskTier,
    LoadStatus,
    MooncakeMaster,
    MooncakeTier,
    RedisTier,
    StoredTier,
    TierError,
)

logger = logging.getLogger(__name__)

#: extra_config fields this backend reads (SGLang passes the whole ``--hicache-storage-backend-
#: extra-config`` JSON). Exactly one of the three tier fields names the tier.
DISK_DIR: Final = "kvfsm_disk_dir"
DISK_BYTES: Final = "kvfsm_disk_bytes"
DISK_FSYNC: Final = "kvfsm_disk_fsync"
MOONCAKE_MASTER: Final = "kvfsm_mooncake_master"
MOONCAKE_SEGMENT_BYTES: Final = "kvfsm_mooncake_segment_bytes"
MOONCAKE_BUFFER_BYTES: Final = "kvfsm_mooncake_buffer_bytes"
MOONCAKE_LOCAL_HOSTNAME: Final = "kvfsm_mooncake_local_hostname"
MOONCAKE_LEASE_S: Final = "kvfsm_mooncake_lease_s"
REDIS_ADDRESS: Final = "kvfsm_redis"
SALT: Final = "kvfsm_salt"
STAGING_BYTES: Final = "kvfsm_staging_bytes"
#: Defaults: the disk tier's size cap and the verified pages kept for the read after a check.
DEFAULT_DISK_BYTES: Final = 64 << 30
DEFAULT_STAGING_BYTES: Final = 256 << 20
#: Mooncake client defaults: the memory this instance lends the store for values, its transfer
#: buffer, the address other clients reach its segment at, and the master's read lease
#: (``mooncake_master --default_kv_lease_ttl``, 10 s unless set).
DEFAULT_MOONCAKE_SEGMENT_BYTES: Final = 256 << 20
DEFAULT_MOONCAKE_BUFFER_BYTES: Final = 64 << 20
DEFAULT_MOONCAKE_LOCAL_HOSTNAME: Final = "127.0.0.1"
DEFAULT_MOONCAKE_LEASE_S: Final = MooncakeMaster.DEFAULT_LEASE_TTL_MS / 1000
_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})
#: Pages a leading-run check reads per tier call: it stops after the first batch with a miss.
VERIFY_BATCH_PAGES: Final = 16
_TIER_FIELDS: Final = (DISK_DIR, MOONCAKE_MASTER, REDIS_ADDRESS)


def tier_from_config(extra: Mapping[str, Any]) -> StoredTier:
    """The stored tier ``extra`` names (exactly one of ``kvfsm_disk_dir``,
    ``kvfsm_mooncake_master``, ``kvfsm_redis``), or a TierError saying what is wrong."""
    named = [field for field in _TIER_FIELDS if extra.get(field)]
    if len(named) != 1:
        raise TierError(f"the kvfsm HiCache backend needs exactly one of {list(_TIER_FIELDS)} "
                        f"in --hicache-storage-backend-extra-config, got {named or 'none'}")
    field = named[0]
    if field == DISK_DIR:
        return DiskTier(str(extra[DISK_DIR]),
                        capacity_bytes=int(_positive(extra, DISK_BYTES, DEFAULT_DISK_BYTES)),
                        fsync=bool(extra.get(DISK_FSYNC, True)))
    if field == MOONCAKE_MASTER:
        master = str(extra[MOONCAKE_MASTER])
        hostname = str(extra.get(MOONCAKE_LOCAL_HOSTNAME) or DEFAULT_MOONCAKE_LOCAL_HOSTNAME)
        if hostname in _LOOPBACK and master.rpartition(":")[0] not in _LOOPBACK:
            # Values land in whichever client's segment the master picks: one advertised on
            # loopback cannot be read by an instance on another host.
            logger.warning("kvfsm HiCache backend: Mooncake master %s is not on loopback but "
                           "this instance's segment is advertised at %s; set %s to an address "
                           "other hosts reach", master, hostname, MOONCAKE_LOCAL_HOSTNAME)
        return MooncakeTier(
            master,
            global_segment_bytes=int(_positive(extra, MOONCAKE_SEGMENT_BYTES,
                                               DEFAULT_MOONCAKE_SEGMENT_BYTES)),
            local_buffer_bytes=int(_positive(extra, MOONCAKE_BUFFER_BYTES,
                                             DEFAULT_MOONCAKE_BUFFER_BYTES)),
            local_hostname=hostname,
            lease_s=_positive(extra, MOONCAKE_LEASE_S, DEFAULT_MOONCAKE_LEASE_S))
    return RedisTier(str(extra[REDIS_ADDRESS]))


def _positive(extra: Mapping[str, Any], field: str, default: float) -> float:
    """``extra[field]`` as a positive number (``default`` when absent), or a TierError naming
    the field."""
    raw = extra.get(field, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = 0.0
    if isinstance(raw, bool) or not value > 0:  # NaN fails the comparison too
        raise TierError(f"--hicache-storage-backend-extra-config field {field!r} must be a "
                        f"positive number, got {raw!r}")
    return value


def _name(pool_name: object) -> str:
    """A pool name as text (SGLang passes ``PoolName`` members or strings)."""
    return str(getattr(pool_name, "value", pool_name))


def _bytes_view(tensor: torch.Tensor) -> NDArray[np.uint8] | None:
    """The bytes of a contiguous CPU tensor, sharing its memory (None for any other)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    view: NDArray[np.uint8] = tensor.reshape(-1).view(torch.uint8).numpy()
    return view


class KvfsmStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]  # SGLang is untyped
    """An SGLang ``HiCacheStorage`` on a kvfsm stored tier that reports and reads only pages
    it verified. ``kwargs["tier"]`` (a :class:`~kvfsm.tiers.StoredTier`) overrides the tier
    the extra config names; the backend closes the tier it built, not one it was given."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        given = (kwargs or {}).get("tier")
        if given is not None and not isinstance(given, StoredTier):
            raise TierError(f"kwargs['tier'] must be a kvfsm StoredTier, got "
                            f"{type(given).__name__}")
        self.tier: StoredTier = given if given is not None else tier_from_config(extra)
        self._owns_tier = given is None
        self.config = storage_config
        self._mla = bool(storage_config.is_mla_model)
        self._tp_shard = f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        self.model = namespace_digest({
            "model": storage_config.model_name or "",
            "salt": extra.get(SALT, ""),
            "pp": f"{storage_config.pp_rank}of{storage_config.pp_size}",
            "cp": f"{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}",
            "dcp": f"{storage_config.dcp_rank}of{storage_config.dcp_size}"
                   f"@{storage_config.logical_page_size}",
        })
        self._pools: dict[str, PagePool] = {}
        self._hosts: dict[str, Any] = {}
        self._staged = VerifiedPages(int(extra.get(STAGING_BYTES, DEFAULT_STAGING_BYTES)))
        self._io = threading.Lock()
        #: Loads by outcome (``LoadStatus`` names; ``STAGED`` for reads served from checked
        #: bytes) and refused writes, for tests and ``get_stats``.
        self.counts: Counter[str] = Counter()

    # -- pools -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool: its pages are what ``get``/``set`` and the v1 calls move."""
        super().register_mem_pool_host(mem_pool_host)
        self._register(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool the v2 calls name (Mamba state, sliding window, indexer ...)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(_name(host_pool_name), host_pool)

    def _register(self, name: str, host: Any) -> None:
        page = host.get_dummy_flat_data_page()
        shared = self._mla and name not in TP_SHARDED_POOLS
        self._pools[name] = page_pool(
            name, tp_shard="" if shared else self._tp_shard,
            layout=str(getattr(host, "layout", "")), dtype=str(page.dtype),
            page_elements=int(page.numel()), itemsize=int(page.element_size()),
            page_tokens=int(host.page_size),
            format_tag=str(getattr(host, "storage_format_tag", None) or ""))
        self._hosts[name] = host

    def _pool(self, name: str) -> PagePool | None:
        pool = self._pools.get(name)
        if pool is None:
            logger.warning("kvfsm HiCache backend: pool %r has no registered host pool; "
                           "its pages are neither stored nor reported", name)
        return pool

    # -- verified reads and writes -----------------------------------------------------------

    def _load(self, pool: PagePool, names: Sequence[str], outs: Sequence[NDArray[np.uint8]],
              *, stage: bool) -> NDArray[np.bool_]:
        """Fill ``outs[i]`` with page ``names[i]``'s verified bytes; True where it verified
        (elsewhere ``outs[i]`` is unspecified). Checked bytes are taken from the staging
        area; with ``stage`` the bytes of fresh loads are kept there (``outs`` are then
        owned by it)."""
        keys = [pool.key(self.model, name) for name in names]
        ok = np.zeros(len(keys), dtype=np.bool_)
        todo: list[int] = []
        for i, key in enumerate(keys):
            staged = self._staged.get(key.name)
            if staged is not None and staged.nbytes == outs[i].nbytes:
                if not stage:
                    outs[i][:] = staged
                ok[i] = True
                self.counts["STAGED"] += 1
            else:
                todo.append(i)
        if not todo:
            return ok
        with self._io:
            result = self.tier.load_into([keys[i] for i in todo], [outs[i] for i in todo])
        for i, status in zip(todo, result.status.tolist(), strict=True):
            self.counts[LoadStatus(status).name] += 1
            if status == LoadStatus.OK:
                ok[i] = True
                if stage:
                    self._staged.add(keys[i].name, outs[i])
        return ok

    def _verified(self, pool: PagePool, names: Sequence[str], *,
                  leading: bool) -> NDArray[np.bool_]:
        """Which of ``names`` have a verified stored copy; with ``leading``, only the run from
        the start is established (the rest reads False once one fails)."""
        verified = np.zeros(len(names), dtype=np.bool_)
        step = VERIFY_BATCH_PAGES if leading else max(1, len(names))
        for start in range(0, len(names), step):
            chunk = names[start:start + step]
            outs = [np.empty(pool.page_bytes, dtype=np.uint8) for _ in chunk]
            verified[start:start + len(chunk)] = self._load(pool, chunk, outs, stage=True)
            if leading and not verified[start:start + len(chunk)].all():
                break
        return verified

    def _store(self, pool: PagePool, names: Sequence[str],
               pages: Sequence[NDArray[np.uint8]]) -> NDArray[np.bool_]:
        """Write each page under its name; True where the tier now holds exactly it. A page
        of the wrong length for the pool is refused (its header would misname it)."""
        done = np.zeros(len(names), dtype=np.bool_)
        fits = [i for i, page in enumerate(pages) if page.nbytes == pool.page_bytes]
        if len(fits) < len(pages):
            self.counts["WRONG_SIZE"] += len(pages) - len(fits)
            logger.warning("kvfsm HiCache backend: %d page(s) of pool %r are not %d bytes; "
                           "not stored", len(pages) - len(fits), pool.name, pool.page_bytes)
        if not fits:
            return done
        keys: list[BlockKey] = [pool.key(self.model, names[i]) for i in fits]
        sums = np.array([xxhash.xxh3_64_intdigest(pages[i].data) for i in fits],
                        dtype=np.uint64)
        with self._io:
            done[fits] = self.tier.put(keys, [pages[i] for i in fits], sums)
        refused = int((~done[fits]).sum())
        if refused:
            self.counts["PUT_REFUSED"] += refused
        return done

    # -- the v0 interface: pages as tensors ---------------------------------------------------

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """Page ``key`` into ``target_location`` (a flat page tensor; default a new one),
        or None where no verified copy exists (the target is then unspecified)."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its target (see :meth:`get`)."""
        pool = self._pool(KV_POOL)
        if pool is None:
            return [None] * len(keys)
        host = self._hosts[KV_POOL]
        targets = list(target_locations or [None] * len(keys))
        targets = [host.get_dummy_flat_data_page() if t is None else t for t in targets]
        views = [_bytes_view(t) for t in targets]
        outs = [np.empty(t.numel() * t.element_size(), dtype=np.uint8) if v is None else v
                for t, v in zip(targets, views, strict=True)]
        ok = self._load(pool, keys, outs, stage=False)
        answer: list[torch.Tensor | None] = []
        for target, view, out, good in zip(targets, views, outs, ok.tolist(), strict=True):
            if good and view is None:
                target.copy_(torch.from_numpy(out).view(target.dtype).reshape(target.shape))
            answer.append(target if good else None)
        return answer

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store page ``value`` (a tensor) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each page; True only where every one is now stored."""
        pool = self._pool(KV_POOL)
        if pool is None or values is None:
            return False
        pages = [value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                 for value in values]
        return bool(self._store(pool, keys, pages).all())

    def exists(self, key: str) -> bool:
        """Whether page ``key`` has a verified stored copy."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages from the start of ``keys`` have a verified stored copy."""
        pool = self._pool(KV_POOL)
        if pool is None:
            return 0
        verified = self._verified(pool, keys, leading=True)
        return int(verified.size if verified.all() else np.argmin(verified))

    # -- hybrid models: per-pool verdicts -----------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        """The prefix lengths (pages) restorable for KV and every pool of ``pool_transfers``:
        each pool by its hit policy, as a kvfsm verdict ANDs groups. A pool with a policy
        this backend does not know (``block_groups``) is not reported and does not gate."""
        kv = self._pool(KV_POOL)
        if kv is None:
            return PoolTransferResult(0, {}, [])
        kv_verified = self._verified(kv, keys, leading=True)
        kv_pages = int(kv_verified.size if kv_verified.all() else np.argmin(kv_verified))
        checked = []
        for transfer in pool_transfers or []:
            policy = _name(transfer.hit_policy)
            if policy not in (ALL_PAGES, TRAILING_PAGES):
                continue
            name = _name(transfer.name)
            rule = pool_for_policy(name, policy, len(transfer.keys or []))
            verified = np.zeros(len(keys), dtype=np.bool_)
            pool = self._pool(name)
            if pool is not None and kv_pages:
                verified[:kv_pages] = self._verified(pool, keys[:kv_pages], leading=False)
            checked.append((rule, verified))
        answer = restorable_prefix(kv_verified, checked)
        return PoolTransferResult(answer.pages, dict(answer.boundaries), list(answer.lengths))

    # -- the v1 and v2 interfaces: pages named by host indices --------------------------------

    def _host_pages(self, name: str, keys: Sequence[str], host_indices: torch.Tensor | None,
                    write: bool) -> list[bool]:
        """Move pages between the storage and host pool ``name`` at ``host_indices`` (the
        first index of each page); per page whether it moved (reads: verified)."""
        pool = self._pool(name)
        host = self._hosts.get(name)
        if pool is None or host is None or host_indices is None:
            return [False] * len(keys)
        tokens = int(host.page_size or 1)
        if host_indices.numel() != len(keys) * tokens:
            logger.warning("kvfsm HiCache backend: %d host indices for %d pages of %d tokens "
                           "(pool %r); nothing moved", host_indices.numel(), len(keys), tokens,
                           name)
            return [False] * len(keys)
        firsts = host_indices[::tokens].tolist()
        if write:
            pages = [host.get_data_page(i, flat=True).contiguous().view(torch.uint8).numpy()
                     for i in firsts]
            return [bool(x) for x in self._store(pool, keys, pages).tolist()]
        outs = [np.empty(pool.page_bytes, dtype=np.uint8) for _ in keys]
        ok = self._load(pool, keys, outs, stage=False)
        dtype = host.get_dummy_flat_data_page().dtype
        for index, out, good in zip(firsts, outs, ok.tolist(), strict=True):
            if good:
                host.set_from_flat_data_page(index, torch.from_numpy(out).view(dtype))
        return [bool(x) for x in ok.tolist()]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Verified pages straight into the KV host pool (``interface_v1``)."""
        return self._host_pages(KV_POOL, keys, host_indices, write=False)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """KV host pages into the tier (``interface_v1``)."""
        return self._host_pages(KV_POOL, keys, host_indices, write=True)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Each transfer's verified pages into its host pool."""
        return {_name(t.name): self._host_pages(_name(t.name), t.keys or [], t.host_indices,
                                                write=False) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Each transfer's host pages into the tier."""
        return {_name(t.name): self._host_pages(_name(t.name), t.keys or [], t.host_indices,
                                                write=True) for t in transfers}

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop the checked pages kept, and on a disk tier every file of this namespace. A
        remote store cannot list its keys: its values stay (each read verifies them) and the
        answer is False."""
        self._staged.clear()
        if not isinstance(self.tier, DiskTier):
            return False
        with self._io:
            stored = self.tier.keys()
            ours = [key for key in stored if key.model == self.model]
            return bool(self.tier.remove(ours).all())

    def get_stats(self) -> None:
        """SGLang's storage metrics are not reported (``counts`` holds this backend's)."""
        return None

    def close(self) -> None:
        """Close the tier this backend built (a tier it was given stays open)."""
        self._staged.clear()
        if self._owns_tier:
            self.tier.close()
