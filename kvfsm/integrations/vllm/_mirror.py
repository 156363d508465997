"""A kvfsm engine kept in step with vLLM's block pool, and the verdict it gives a request.

:class:`Mirror` wraps two methods of the one ``BlockPool`` instance vLLM's ``KVCacheManager``
built (the instance, not the class: other pools are untouched):

* ``cache_full_blocks``: vLLM just put a request's full blocks of one KV cache group in its
  prefix-cache map. The mirror commits the same prefix to that kvfsm group and remembers which
  kvfsm block each vLLM block is (with a connector: once its worker side has read the pages'
  bytes, see below). kvfsm keeps what its kind's rule keeps; a block vLLM left out
  (a null or masked block: sliding-window blocks out of the window, Mamba states off a step end)
  and that this commit created is evicted again, so kvfsm never holds what vLLM's pool does not.
* ``_maybe_evict_cached_block``: vLLM is reusing a cached block. When no other vLLM block holds
  that kvfsm block any more, the mirror offloads it a tier down (host, then disk or remote as
  the host fills, through the engine's stored tiers), where it stays a hit the connector can
  restore; with no tier below the device it is evicted.

**Where the bytes come from.** vLLM caches a block when it *schedules* the tokens that fill
it, before the forward writes them. With the connector (:meth:`Mirror.save_through_worker`), a
cached block is therefore not committed at once: it waits as a :class:`PendingSave`, the
connector ships it to its worker side in the step's metadata, and after that step's forward
(``wait_for_save``) the worker reads the pages out of vLLM's KV tensors and :meth:`Mirror.save`
commits them with those bytes, so kvfsm's device pool (and every spill to host, disk or remote,
checksummed) holds what the model wrote, and no block is readable before its bytes are in.
Without a connector nothing can read the KV tensors: the mirror then commits at once with zero
bytes, bookkeeping only (the scheduler's cap needs no bytes, and nothing loads them).

A lookup (:meth:`Mirror.verdict`) then says how much of a request's prompt is usable now and
after a restore. kvfsm's device pool is sized above vLLM's (``MirrorSettings.device_headroom``) so
that kvfsm never gives back a block vLLM still caches.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm._engine import Engine
from kvfsm._errors import KvfsmError
from kvfsm.integrations.vllm._model import UnsupportedSpecError, declare
from kvfsm.integrations.vllm._settings import MirrorSettings, MirrorSettingsError, remote_tier
from kvfsm.lookup import Level, Verdict, as_level
from kvfsm.obs import EngineMetrics
from kvfsm.spec import Event, Tier
from kvfsm.state import CoreConfig, GroupState, Prompt
from kvfsm.tiers import DiskTier, StoredTier

LOG = logging.getLogger(__name__)

#: ``vLLM block ids -> uint8 [len(ids), payload_bytes]``: the pages of those blocks of one
#: KV cache group, read out of vLLM's KV tensors (the connector's worker side).
PageReader = Callable[[NDArray[np.int64]], NDArray[np.uint8]]
#: vLLM's block id of a block index where vLLM holds no block (its null block).
NO_VLLM_BLOCK = -1
#: A request's namespace and content keys, as :meth:`Engine.prompt` takes them.
RequestKeys = tuple[bytes, tuple[tuple[int, int, bytes], ...]]


@attrs.frozen
class PendingSave:
    """vLLM cached blocks ``[first, end)`` of KV cache group ``group_index`` for the prompt
    ``tokens``; kvfsm commits them once the worker has read their pages.

    ``vllm_blocks[i]`` is vLLM's block at index ``i`` of the request (``NO_VLLM_BLOCK`` where
    it holds none) and ``kept[i]`` whether vLLM keeps it cached, for every ``i < end``."""

    group_index: int
    tokens: tuple[int, ...]
    first: int
    end: int
    vllm_blocks: tuple[int, ...]
    kept: tuple[bool, ...]
    #: What besides the tokens decides the request's KV (:func:`request_keys`).
    keys: RequestKeys = (b"", ())


@attrs.define(eq=False)
class _KeptPrompt:
    """A request's prompt as :meth:`Mirror.prompt_of` made it: of ``tokens``, with ``keys``."""

    prompt: Prompt
    tokens: list[int]
    keys: RequestKeys


def _parts(*parts: str | bytes) -> bytes:
    """Length-prefixed ``parts``: no two different lists spell the same bytes."""
    data = [part.encode() if isinstance(part, str) else part for part in parts]
    return b"".join(len(part).to_bytes(4, "little") + part for part in data)


def request_keys(request: Any, embeds_chunk: int = 16) -> RequestKeys:
    """What besides its token ids decides a vLLM request's KV, as kvfsm prompt keys (vLLM's
    own block hashes take the same: its ``generate_block_hash_extra_keys``): the LoRA
    adapter (name and path) and the cache salt make the namespace; each multimodal input's
    placeholder tokens are a content key named by its identifier; prompt embeddings are a
    content key per ``embeds_chunk`` tokens (the mirror's finest block), named by the SHA-256
    of those rows, so requests whose embeddings share a prefix share its blocks. Without
    these, two requests with the same token ids (another adapter, tenant or image) would be
    served each other's KV."""
    parts: list[str | bytes] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        parts += ["lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")]
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts += ["cache_salt", str(salt)]
    content: list[tuple[int, int, bytes]] = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        if int(position.length) > 0:
            start = int(position.offset)
            # An input vLLM did not identify (it does wherever it hashes blocks) is named by
            # chance: shared with nothing, never taken for another.
            name = secrets.token_bytes(16) if feature.identifier is None else \
                str(feature.identifier).encode()
            content.append((start, start + int(position.length), _parts("mm", name)))
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None and len(embeds):
        rows = embeds.detach().cpu().contiguous()
        rows = rows.view(len(rows), -1).view(dtype=_torch_uint8()).numpy()
        for start in range(0, len(rows), embeds_chunk):
            end = min(start + embeds_chunk, len(rows))
            digest = hashlib.sha256(rows[start:end].tobytes()).digest()
            content.append((start, end, _parts("prompt_embeds", digest)))
    return (_parts(*parts) if parts else b""), tuple(sorted(content))


def _torch_uint8() -> Any:
    import torch  # vLLM's requests carry torch tensors: torch is there when they are
    return torch.uint8


class Mirror:
    """A kvfsm engine mirroring one vLLM ``KVCacheManager``'s block pool.

    ``identity`` is vLLM's :func:`model_identity` of the engine (the cache namespace unless
    ``settings.namespace`` is set); ``engine``, when given, replaces the one the settings
    describe (its own ``CoreConfig.cache_salt`` is then the namespace)."""

    def __init__(self, kv_cache_config: Any, settings: MirrorSettings | None = None, *,
                 identity: str, engine: Engine | None = None) -> None:
        self.settings = settings or MirrorSettings()
        self.identity = identity
        # The registry name is not part of what the KV is: engines of one model share values.
        self.model, self.groups = declare(kv_cache_config, name="vllm")
        #: The finest block of the groups: prompt embeddings are keyed per this many tokens.
        self._finest = min(group.block_size for group in self.groups)
        self.level: Level = as_level(self.settings.level)
        #: Stored tiers this mirror opened (closed with it).
        self._opened: list[StoredTier] = []
        #: The HTTP server of the metrics (``MirrorSettings.metrics_port``), None without.
        self._metrics_server: Any = None
        self.engine = engine or self._engine(int(kv_cache_config.num_blocks))
        if [g.name for g in self.engine.model.groups] != [g.name for g in self.groups]:
            raise KvfsmError("mirror engine's groups do not match the vLLM KV cache groups")
        #: Commits wait for the worker's bytes (a connector is attached), else zero bytes.
        self._through_worker = False
        self._pending: list[PendingSave] = []
        #: vLLM block id -> saves not yet committed that name it.
        self._saving: dict[int, int] = {}
        #: vLLM blocks released while a save naming them was pending (their pages may be
        #: overwritten: never read for kvfsm).
        self._lost: set[int] = set()
        #: vLLM block id -> (kvfsm group, kvfsm block id), for every block vLLM caches.
        self._held: dict[int, tuple[str, int]] = {}
        #: (kvfsm group, kvfsm block id) -> the vLLM block ids caching it.
        self._holders: dict[tuple[str, int], set[int]] = {}
        self._attached: object | None = None
        self._lock = threading.RLock()
        #: Each live request's uncut prompt (prompt_of), and the lock of that map alone (taken
        #: under no other lock of the mirror's, nor around one: never part of a deadlock).
        self._prompts: weakref.WeakKeyDictionary[Any, _KeptPrompt] = \
            weakref.WeakKeyDictionary()
        self._prompts_lock = threading.Lock()
        #: The last verdict() asked: (request, prompt, verdict), for verdict_now.
        self._last_verdict: tuple[Any, Prompt, Verdict] | None = None
        #: Verdicts verdict_now served from verdict() instead of looking up again.
        self.verdicts_reused = 0
        #: Counters: commits that found no room, blocks offloaded and dropped.
        self.commit_failures = 0
        self.offloaded = 0
        self.dropped = 0

    @property
    def namespace(self) -> str:
        """The cache namespace this mirror's engine hashes prompts and names values in."""
        if self.settings.namespace is not None:
            return f"namespace:{self.settings.namespace}"
        return f"vllm-model:{self.identity}"

    def _engine(self, vllm_blocks: int) -> Engine:
        s = self.settings
        tiers: dict[Tier | str, StoredTier] = {}
        try:
            if s.disk_dir is not None:
                _writable_dir(s.disk_dir)
                tiers[Tier.DISK] = self._open(DiskTier(s.disk_dir, capacity_bytes=s.disk_bytes,
                                                       fsync=False))
            if s.remote is not None:
                tiers[Tier.REMOTE] = self._open(remote_tier(s))
            config = CoreConfig(device_blocks=int(vllm_blocks * s.device_headroom) + 1,
                                host_blocks=s.host_blocks,
                                disk_blocks=s.disk_blocks if Tier.DISK in tiers else 0,
                                remote_blocks=s.remote_blocks if Tier.REMOTE in tiers else 0,
                                cache_salt=self.namespace, backend="numpy")
            return Engine(self.model, config, tiers=tiers, metrics=self._serve_metrics())
        except Exception:
            self._stop_metrics()
            self._close_tiers()
            raise

    def _serve_metrics(self) -> EngineMetrics | None:
        """The engine's metrics in a registry of their own, served over HTTP where the settings
        name a port (None: no metrics)."""
        s = self.settings
        if s.metrics_port is None:
            return None
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        metrics = EngineMetrics(registry)
        try:
            self._metrics_server = start_http_server(s.metrics_port, addr=s.metrics_host,
                                                     registry=registry)[0]
        except OSError as exc:
            raise MirrorSettingsError(f"kvfsm metrics_port={s.metrics_port} on "
                                      f"{s.metrics_host}: {exc}") from exc
        return metrics

    def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def _open(self, tier: StoredTier) -> StoredTier:
        self._opened.append(tier)
        return tier

    def _close_tiers(self) -> None:
        while self._opened:
            tier = self._opened.pop()
            try:
                tier.close()
            except (KvfsmError, OSError) as exc:
                LOG.warning("kvfsm mirror: closing %s failed: %s", type(tier).__name__, exc)

    # -- keeping in step ----------------------------------------------------------------------

    def attach(self, kv_cache_manager: Any) -> None:
        """Follow ``kv_cache_manager``'s block pool from now on (once; attaching to a second
        manager is an error: one mirror follows one pool)."""
        pool = kv_cache_manager.block_pool
        if getattr(kv_cache_manager.coordinator, "enable_partial_hash_hits", False):
            raise UnsupportedSpecError(
                "vLLM keeps Mamba states at sub-block positions here (a Mamba block longer "
                "than the hash block); the mirror follows whole blocks only: give the Mamba "
                "groups the hash block size")
        if self._attached is pool:
            return
        if self._attached is not None:
            raise KvfsmError("this mirror already follows another vLLM block pool")
        self._attached = pool
        cache = pool.cache_full_blocks
        evict = pool._maybe_evict_cached_block

        @functools.wraps(cache)
        def cache_full_blocks(request: Any, blocks: Sequence[Any], num_cached_blocks: int,
                              num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                              block_mask: Sequence[bool] | None = None) -> None:
            cache(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                  kv_cache_group_id, block_mask)
            self._cached(request, blocks, num_cached_blocks, num_full_blocks,
                         kv_cache_group_id, block_mask)

        @functools.wraps(evict)
        def maybe_evict(block: Any) -> bool:
            evicted = bool(evict(block))
            self._released(int(block.block_id))
            return evicted

        pool.cache_full_blocks = cache_full_blocks
        pool._maybe_evict_cached_block = maybe_evict

    def save_through_worker(self) -> None:
        """From now on, commit what vLLM caches only with the pages the connector's worker
        reads out of vLLM's KV tensors (:meth:`take_saves`, :meth:`save`)."""
        with self._lock:
            self._through_worker = True

    def take_saves(self) -> tuple[PendingSave, ...]:
        """The saves waiting since the last call (the connector ships them to its worker)."""
        with self._lock:
            saves, self._pending = tuple(self._pending), []
            return saves

    def save(self, save: PendingSave, read_pages: PageReader) -> None:
        """Commit ``save``'s blocks with the bytes ``read_pages`` gives for their vLLM blocks
        (called after the forward that wrote them); a block vLLM released meanwhile is not
        read, and not kept."""
        with self._lock:
            lost = self._lost
            kept = tuple(k and b not in lost for k, b in zip(save.kept, save.vllm_blocks,
                                                               strict=True))
            try:
                self._commit(save.group_index, save.tokens, save.end, save.vllm_blocks, kept,
                             read_pages, save.keys)
            finally:
                self._forget_saving(save)

    def _cached(self, request: Any, blocks: Sequence[Any], first: int, end: int,
                group_id: int, mask: Sequence[bool] | None) -> None:
        if first >= end:
            return
        group = self.groups[group_id]
        tokens = tuple(request.all_token_ids[:end * group.block_size])
        ids = tuple(NO_VLLM_BLOCK if blocks[i].is_null else int(blocks[i].block_id)
                    for i in range(end))
        # Below ``first`` vLLM cached the block earlier (a hash says so); from ``first`` on
        # the mask says which of the new ones it keeps.
        kept = tuple(not blocks[i].is_null and blocks[i].block_hash is not None
                     and (mask is None or i < first or bool(mask[i - first]))
                     for i in range(end))
        keys = request_keys(request, self._finest)
        with self._lock:
            if self._through_worker:
                save = PendingSave(group_id, tokens, first, end, ids, kept, keys)
                self._pending.append(save)
                for block in ids:
                    self._saving[block] = self._saving.get(block, 0) + 1
                return
            self._commit(group_id, tokens, end, ids, kept, None, keys)

    def _forget_saving(self, save: PendingSave) -> None:
        for block in save.vllm_blocks:
            left = self._saving.get(block, 0) - 1
            if left > 0:
                self._saving[block] = left
            else:
                self._saving.pop(block, None)
                self._lost.discard(block)

    def _commit(self, group_id: int, tokens: Sequence[int], end: int,
                vllm_blocks: Sequence[int], kept: Sequence[bool],
                read_pages: PageReader | None, keys: RequestKeys) -> None:
        """Commit ``tokens`` (of a request with ``keys``) to kvfsm group ``group_id`` with the
        pages ``read_pages`` gives (zeros without it), hold each kept block's kvfsm block,
        evict what this commit made that vLLM does not keep."""
        group = self.groups[group_id]
        ids = np.asarray(vllm_blocks, dtype=np.int64)
        keep = np.asarray(kept, dtype=np.bool_)

        def payload(state: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
            # Blocks vLLM does not keep are evicted right after (below): never read for them.
            wanted = keep[index]
            if read_pages is None or not wanted.any():
                return np.zeros((index.size, state.decl.payload_bytes), dtype=np.uint8)
            pages = np.asarray(read_pages(ids[index[wanted]]), dtype=np.uint8)
            if pages.shape != (int(wanted.sum()), state.decl.payload_bytes):
                raise KvfsmError(f"{group.name}: the worker read pages of shape "
                                 f"{pages.shape}; kvfsm's page is "
                                 f"{state.decl.payload_bytes} bytes")
            if wanted.all():
                return pages  # every block read: the pages are the payload, not copied again
            rows = np.zeros((index.size, state.decl.payload_bytes), dtype=np.uint8)
            rows[wanted] = pages
            return rows

        with self.engine.lock:
            namespace, content_keys = keys
            prompt = self.engine.prompt(list(tokens), namespace=namespace,
                                        content_keys=content_keys)
            high, low = prompt.words(group.block_size)
            before = self.engine.core.lookup_words(group.name, high, low)
            try:
                self.engine.commit(prompt, payload=payload, groups=[group.name])
            except KvfsmError as exc:
                # kvfsm then has less than vLLM: hits are capped shorter, never longer.
                self.commit_failures += 1
                LOG.warning("kvfsm mirror: commit of %d tokens to %s failed: %s",
                            len(tokens), group.name, exc)
                return
            after = self.engine.core.lookup_words(group.name, high, low)
            stray: list[int] = []
            for i in range(end):
                kid = int(after[i])
                if kid < 0:
                    continue
                if keep[i]:
                    self._hold(int(ids[i]), group.name, kid)
                elif before[i] < 0 and (group.name, kid) not in self._holders:
                    stray.append(kid)
            if stray:
                self.engine.core.fire(group.name, stray, Event.EVICT, masked=True)

    def _hold(self, vllm_block: int, group: str, kid: int) -> None:
        old = self._held.get(vllm_block)
        if old == (group, kid):
            return
        if old is not None:
            self._release_one(vllm_block, old)
        self._held[vllm_block] = (group, kid)
        self._holders.setdefault((group, kid), set()).add(vllm_block)

    def _released(self, vllm_block: int) -> None:
        with self._lock:
            if vllm_block in self._saving:
                self._lost.add(vllm_block)
            held = self._held.pop(vllm_block, None)
            if held is not None:
                with self.engine.lock:
                    self._release_one(vllm_block, held)

    def _release_one(self, vllm_block: int, held: tuple[str, int]) -> None:
        holders = self._holders.get(held)
        if holders is None:
            return
        holders.discard(vllm_block)
        if holders:
            return
        del self._holders[held]
        self._offload(*held)

    def _offload(self, group: str, kid: int) -> None:
        """vLLM dropped its last copy of kvfsm block ``kid``: move it a tier down (a hit to
        restore), or evict it where no tier takes it."""
        state = self.engine.core.group(group)
        if int(state.table.residency[state.states[kid]]) != int(Tier.DEVICE):
            return  # already elsewhere (restored copy given back, or never resident)
        if self.engine.offload(group, [kid])[0]:
            self.offloaded += 1
            return
        self.engine.core.fire(group, [kid], Event.EVICT, masked=True)
        self.dropped += 1

    # -- asking ----------------------------------------------------------------------------

    def prompt_of(self, request: Any, limit: int | None = None) -> Prompt:
        """kvfsm's prompt of ``request``'s tokens (in its namespace, with its content keys:
        :func:`request_keys`), cut so that no candidate length exceeds ``limit`` (vLLM's
        ``max_cache_hit_length``; the last token is never a hit).

        The uncut prompt is kept with the request (while it lives) and served again while its
        tokens and keys are the same, extended in place (only the new blocks hashed) where
        tokens were appended; any other change makes a new one."""
        tokens = request.all_token_ids[:request.num_tokens]
        if not isinstance(tokens, list):
            tokens = list(tokens)
        keys = request_keys(request, self._finest)
        if limit is not None and max(limit, 0) + 1 < len(tokens):
            return self._new_prompt(tokens[:max(limit, 0) + 1], keys)
        with self._prompts_lock:
            try:
                kept = self._prompts.get(request)
            except TypeError:  # a request that cannot be weakly referenced: nothing kept
                return self._new_prompt(tokens, keys)
            if kept is not None and kept.keys == keys:
                seen = len(kept.tokens)
                if len(tokens) == seen and tokens == kept.tokens:
                    return kept.prompt
                if len(tokens) > seen and tokens[:seen] == kept.tokens:
                    kept.prompt.extend(tokens[seen:])
                    kept.tokens = tokens
                    return kept.prompt
        prompt = self._new_prompt(tokens, keys)
        with self._prompts_lock:
            self._prompts[request] = _KeptPrompt(prompt, tokens, keys)
        return prompt

    def _new_prompt(self, tokens: list[int], keys: RequestKeys) -> Prompt:
        namespace, content_keys = keys
        return self.engine.prompt(tokens, namespace=namespace, content_keys=content_keys)

    def verdict(self, request: Any, limit: int | None = None) -> Verdict:
        """kvfsm's verdict on ``request``'s prompt (up to ``limit`` tokens reused), kept for
        :meth:`verdict_now` (the connector's lookup of the same request right after)."""
        prompt = self.prompt_of(request, limit)
        verdict = self.engine.lookup(prompt, level=self.level)
        self._last_verdict = (request, prompt, verdict)
        return verdict

    def verdict_now(self, request: Any, prompt: Prompt) -> Verdict:
        """kvfsm's verdict on ``prompt`` (``request``'s, from :meth:`prompt_of`) as a lookup
        gives it now. Where :meth:`verdict` was last asked about this very prompt and no
        block of any group changed since (the core's change count is the one its lookup
        saw: nothing written, moved, freed, pinned or failed a check), that verdict is it, and
        no second lookup is made (vLLM asks the scheduler's cap and then the connector about
        each new request, back to back). Call it holding the engine's lock, and lease or
        restore under the same hold: nothing then changes between the check and the use."""
        last, self._last_verdict = self._last_verdict, None
        if last is not None and last[0] is request and last[1] is prompt:
            verdict = last[2]
            probe = verdict.probe
            if probe is not None and probe.prompt is prompt \
                    and verdict.prompt_tokens == prompt.n_tokens \
                    and probe.changes == self.engine.core.change_count.total:
                self.verdicts_reused += 1
                return verdict
        return self.engine.lookup(prompt, level=self.level)

    def being_saved(self, vllm_blocks: Sequence[int]) -> bool:
        """Whether every one of ``vllm_blocks`` is a block vLLM cached for a scheduled forward
        whose pages kvfsm has not committed yet (a pending save): vLLM's own, being written,
        and nothing kvfsm knows against it."""
        with self._lock:
            return all(int(block) in self._saving and int(block) not in self._lost
                       for block in vllm_blocks)

    def kvfsm_block(self, vllm_block: int) -> tuple[str, int] | None:
        """The kvfsm block vLLM block ``vllm_block`` caches, None if it caches none."""
        return self._held.get(vllm_block)

    def close(self) -> None:
        """Stop the engine's restore workers and close the stored tiers this mirror opened
        (disk files stay; a Mooncake client unmounts its segment, so values it lent memory to
        go with it)."""
        self.engine.close()
        self._stop_metrics()
        self._close_tiers()


def _writable_dir(path: str) -> None:
    """Make ``path`` a directory if it is none and check that files can be written there; a
    :class:`MirrorSettingsError` naming it where not."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvfsm-probe-"):
            pass
    except OSError as exc:
        raise MirrorSettingsError(f"kvfsm disk_dir={path!r} is not a writable directory: "
                                  f"{exc}") from exc


#: Mirrors by settings name, shared by the scheduler and the connector of one process.
_MIRRORS: dict[str, Mirror] = {}
_REGISTRY_LOCK = threading.Lock()


def register(mirror: Mirror) -> None:
    """Make ``mirror`` the one the scheduler and connector named like it use (a test, or a
    deployment building its engine itself, registers before vLLM starts)."""
    with _REGISTRY_LOCK:
        _MIRRORS[mirror.settings.name] = mirror


def unregister(name: str) -> Mirror | None:
    """Forget the mirror named ``name`` (returned, not closed)."""
    with _REGISTRY_LOCK:
        return _MIRRORS.pop(name, None)


def mirror_for(kv_cache_config: Any, settings: MirrorSettings, identity: str) -> Mirror:
    """The registered mirror named by ``settings``, built from them the first time; a mirror
    registered for another model (``identity``) is a :class:`MirrorSettingsError`: its hashes
    and stored values are that model's."""
    with _REGISTRY_LOCK:
        mirror = _MIRRORS.get(settings.name)
        if mirror is None:
            mirror = _MIRRORS[settings.name] = Mirror(kv_cache_config, settings,
                                                      identity=identity)
        elif mirror.identity != identity:
            raise MirrorSettingsError(
                f"the kvfsm mirror named {settings.name!r} was built for model "
                f"[{mirror.identity}], this vLLM engine serves [{identity}]: give each "
                "engine its own kvfsm name")
        return mirror
