"""A vLLM KV connector (``SupportsHMA``) whose external store is kvfsm's tiers.

Switch on with ``--kv-transfer-config '{"kv_connector": "KvfsmConnector",
"kv_connector_module_path": "kvfsm.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"kvfsm": {...}}}'`` (settings: :class:`MirrorSettings`).

**Scheduler side.** vLLM asks ``get_num_new_matched_tokens`` once per new request, after its
local lookup, and can only extend the hit by what is returned. The connector looks the prompt
up; where the verdict can restore more than vLLM's local hit, it runs the verdict's plan
(host copies land at once, disk and remote loads are verified on kvfsm's workers, for at most
``restore_wait_s``), looks up again and claims only what is *usable* then: a block whose copy
was corrupt, torn, foreign or still in flight is not, and a length is claimed only where every
group has state. The blocks the claim needs are leased (pinned, epochs recorded) until the
worker has copied them. Loads are synchronous (``load_kv_async`` is False): vLLM schedules the
claimed tokens as computed and the worker copies them in ``start_load_kv`` before the forward.

**Saves.** vLLM caches a block when it schedules the tokens filling it, before the forward
writes them; with the connector bound, the mirror holds such blocks back as pending saves
(:class:`~kvfsm.integrations.vllm.PendingSave`), :meth:`KvfsmConnector.build_connector_meta`
ships them with the step's loads, and the worker's ``wait_for_save`` (after the step's
forward) reads each block's pages out of the KV tensors of every layer of its group and has the
mirror commit them with those bytes (``Engine.commit``: written, then readable). Saves are
synchronous: nothing is pending when ``wait_for_save`` returns, so ``request_finished`` never
delays a free.

**Worker side.** ``start_load_kv`` reads the verified bytes of each claimed block from kvfsm's
device pool (``StateCore.read`` refuses a block that is not readable) and copies them into the
KV tensors of every layer of its group (a kvfsm page is the block's page of each layer, in the
group's layer order), at the vLLM block id allocated for it; a block it cannot read or copy is
reported by ``get_block_ids_with_load_errors`` (vLLM then recomputes from it). KV tensors are
taken as block-major (the CPU backend's attention tensor ``(blocks, kv heads, block size,
2 * head size)``, and each Mamba state tensor ``(blocks, ...)``); a kvfsm page is, per layer of
the group, that block's row of each of the layer's tensors, one after another.

The scheduler and worker sides share the mirror through the in-process registry, so both must
run in one process (vLLM's in-process executor, as in the tests).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from kvfsm._errors import KvfsmError
from kvfsm.integrations.vllm._mirror import Mirror, PendingSave, mirror_for
from kvfsm.integrations.vllm._pages import GroupPages, state_tensors
from kvfsm.integrations.vllm._settings import (
    MirrorSettingsError,
    model_identity,
    settings_of,
)
from kvfsm.lookup import Lease, Verdict
from kvfsm.spec import GroupKind
from kvfsm.state import Prompt

LOG = logging.getLogger(__name__)
#: vLLM's null block id (a block index of a group where nothing is kept).
NULL_BLOCK = 0

@attrs.frozen
class BlockLoad:
    """Copy kvfsm block ``kvfsm_id`` of ``group`` into vLLM block ``vllm_block`` of KV cache
    group ``group_index``."""

    request_id: str
    group_index: int
    group: str
    kvfsm_id: int
    vllm_block: int


class KvfsmConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """The loads of one scheduler step, and the saves its forward completes."""

    def __init__(self, loads: tuple[BlockLoad, ...] = (),
                 saves: tuple[PendingSave, ...] = ()) -> None:
        self.loads = loads
        self.saves = saves


@attrs.define
class _Claim:
    """What the connector promised a request: tokens ``[start, end)`` from ``verdict``."""

    prompt: Prompt
    verdict: Verdict
    lease: Lease
    start: int
    end: int


@attrs.define
class ClaimCounts:
    """What the connector answered: requests asked, claims made, tokens claimed, restores
    run, and claims refused because nothing usable remained after the restore."""

    asked: int = 0
    claimed: int = 0
    tokens: int = 0
    restores: int = 0
    refused_after_restore: int = 0


class KvfsmConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """kvfsm's tiers as vLLM's external KV store, claiming only verified-usable tokens."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _same_process(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self.kvfsm: Mirror = mirror_for(kv_cache_config, settings_of(vllm_config),
                                       model_identity(vllm_config))
        self.counts = ClaimCounts()
        self._claims: dict[str, _Claim] = {}
        self._loads: list[BlockLoad] = []
        #: Leases of loads handed to the worker, released at the next step (after the load).
        self._shipped: list[Lease] = []
        self._kv_caches: dict[str, Any] = {}
        #: Where each group's pages live in the KV tensors, by its layers (_pages_of).
        self._pages: dict[tuple[str, ...], GroupPages] = {}
        self._load_errors: set[int] = set()

    # -- scheduler side ----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.kvfsm.save_through_worker()
        self.kvfsm.attach(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` kvfsm verified usable after restoring them."""
        self.counts.asked += 1
        self._drop_claim(request.request_id)
        mirror = self.kvfsm
        engine = mirror.engine
        prompt = mirror.prompt_of(request)
        with engine.lock:
            # The scheduler's cap just looked this prompt up: its verdict serves where nothing
            # changed since (checked under this lock, which the lease below is taken under).
            verdict = mirror.verdict_now(request, prompt)
            if max(verdict.usable_tokens, verdict.restorable_tokens) <= num_computed_tokens:
                return 0, False
            # One restore lands the longest intact prefix: after a failed load the engine
            # plans again itself (e.g. an earlier recurrent checkpoint the first plan did not
            # need).
            if verdict.plan and verdict.restorable_tokens > max(verdict.usable_tokens,
                                                                num_computed_tokens):
                self.counts.restores += 1
                ticket = engine.restore(verdict, prompt)
                ticket.wait(timeout=mirror.settings.restore_wait_s)
                verdict = engine.lookup(prompt, level=mirror.level)
            end = verdict.usable_tokens
            if end <= num_computed_tokens:
                self.counts.refused_after_restore += 1
                return 0, False
            try:
                lease = engine.lease(verdict, prompt)
            except KvfsmError:
                return 0, False
        self._claims[request.request_id] = _Claim(prompt, verdict, lease, num_computed_tokens,
                                                  end)
        self.counts.claimed += 1
        self.counts.tokens += end - num_computed_tokens
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Plan the copies of the claimed blocks into the vLLM blocks just allocated."""
        claim = self._claims.get(request.request_id)
        if claim is None or num_external_tokens == 0:
            return
        if claim.start + num_external_tokens != claim.end:
            # vLLM took another count than claimed: load nothing, recompute instead.
            self._drop_claim(request.request_id)
            return
        vllm_ids = blocks.get_block_ids()
        for probed in claim.verdict.probe.groups if claim.verdict.probe else ():
            group = next(g for g in self.kvfsm.groups if g.name == probed.group)
            first = claim.start // group.block_size
            ids = vllm_ids[group.index]
            loaded: list[tuple[int, int]] = []
            for index, kid in zip(range(probed.lo, probed.hi), probed.ids, strict=True):
                if index < first:
                    continue  # vLLM's local hit already holds it
                loaded.append((index, int(kid)))
                self._loads.append(BlockLoad(request.request_id, group.index, group.name,
                                             int(kid), int(ids[index])))
            if group.kind is GroupKind.RECURRENT and loaded:
                # vLLM's align mode copies the state at the hit into the request's running
                # block (its last allocated one) before the forward, so before start_load_kv:
                # the state goes there too.
                index, kid = loaded[-1]
                running = _running_block(ids, index)
                if running is not None:
                    self._loads.append(BlockLoad(request.request_id, group.index, group.name,
                                                 kid, running))

    def build_connector_meta(self, scheduler_output: Any) -> KvfsmConnectorMetadata:
        """This step's loads and saves; leases of the previous step's loads are released
        (done)."""
        for lease in self._shipped:
            lease.release()
        self._shipped = []
        loads = tuple(self._loads)
        self._loads = []
        for request_id in {load.request_id for load in loads}:
            claim = self._claims.pop(request_id, None)
            if claim is not None:
                self._shipped.append(claim.lease)
        return KvfsmConnectorMetadata(loads, self.kvfsm.take_saves())

    def _drop_claim(self, request_id: str) -> None:
        claim = self._claims.pop(request_id, None)
        if claim is not None:
            claim.lease.release()
            self._loads = [load for load in self._loads if load.request_id != request_id]

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._drop_claim(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._drop_claim(request.request_id)
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)
        self._pages = {}

    def _pages_of(self, layers: Sequence[str]) -> GroupPages:
        """Where the pages of a group of ``layers`` live in the KV tensors (made once; a
        layer without a KV tensor is a KeyError)."""
        key = tuple(layers)
        pages = self._pages.get(key)
        if pages is None:
            tensors = [t for layer in key for t in state_tensors(self._kv_caches[layer])]
            pages = self._pages[key] = GroupPages(tensors, f"layers {list(key)}")
        return pages

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy every planned block's verified bytes into the KV tensors of its group: per
        group, one read of kvfsm's device pool and one copy per tensor for all its blocks
        (block by block where that fails, so only the blocks that cannot be read or copied
        are load errors)."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KvfsmConnectorMetadata) or not metadata.loads:
            return
        by_group: dict[int, list[BlockLoad]] = {}
        for load in metadata.loads:
            by_group.setdefault(load.group_index, []).append(load)
        for group_index, loads in by_group.items():
            try:
                self._load_group(group_index, loads)
            except (KvfsmError, KeyError, RuntimeError):
                for load in loads:
                    self._load_one(load)

    def _load_group(self, group_index: int, loads: Sequence[BlockLoad]) -> None:
        """All of ``loads`` (of one group) at once: every block read (a block read twice, as a
        Mamba state loaded into its running block too, once), then written."""
        group = self.kvfsm.groups[group_index]
        kids, rows = np.unique(np.fromiter((load.kvfsm_id for load in loads), dtype=np.int64,
                                           count=len(loads)), return_inverse=True)
        with self.kvfsm.engine.lock:
            data = self.kvfsm.engine.core.read(group.name, kids)
        targets = np.fromiter((load.vllm_block for load in loads), dtype=np.int64,
                              count=len(loads))
        self._pages_of(group.layer_names).write(targets, data[rows.reshape(-1)])

    def _load_one(self, load: BlockLoad) -> None:
        layers = self.kvfsm.groups[load.group_index].layer_names
        try:
            with self.kvfsm.engine.lock:
                data = self.kvfsm.engine.core.read(load.group, [load.kvfsm_id])[0]
            self.write_page(layers, load.vllm_block, data)
        except (KvfsmError, KeyError, RuntimeError) as exc:
            LOG.warning("kvfsm connector: block %d of %s not loaded: %s", load.vllm_block,
                        load.group, exc)
            self._load_errors.add(load.vllm_block)

    def write_page(self, layers: Sequence[str], vllm_block: int, data: NDArray[np.uint8]
                   ) -> None:
        """Copy a kvfsm page into vLLM block ``vllm_block`` of ``layers``: per layer, the
        block's row of each of its tensors, one after another (:func:`state_tensors`); a page
        of another size is a :class:`KvfsmError`, nothing written."""
        page = np.asarray(data, dtype=np.uint8).reshape(1, -1)
        self._pages_of(layers).write(np.array([vllm_block], dtype=np.int64), page)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are done in :meth:`start_load_kv`, before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: a block is committed whole, with every layer's page, in
        :meth:`wait_for_save` (kvfsm never holds a block with some layers missing)."""

    def wait_for_save(self) -> None:
        """After the step's forward: commit each shipped save with the pages the forward
        wrote, read out of the KV tensors; a save that cannot be read commits nothing (kvfsm
        then has less than vLLM: hits are capped shorter, never longer)."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KvfsmConnectorMetadata):
            return
        for save in metadata.saves:
            try:
                self.kvfsm.save(save, functools.partial(self._read_pages, save.group_index))
            except (KvfsmError, KeyError, RuntimeError) as exc:
                self.kvfsm.commit_failures += 1
                LOG.warning("kvfsm connector: blocks %d..%d of group %d not saved: %s",
                            save.first, save.end, save.group_index, exc)

    def _read_pages(self, group_index: int, vllm_blocks: NDArray[np.int64]
                    ) -> NDArray[np.uint8]:
        """The pages of ``vllm_blocks`` in every layer of vLLM group ``group_index``, one row
        per block: its page of each layer, in the group's layer order."""
        return self._pages_of(self.kvfsm.groups[group_index].layer_names).read(vllm_blocks)


#: vLLM executors that run the worker in other processes than the scheduler.
OTHER_PROCESS_EXECUTORS = frozenset({"mp", "ray"})


def _same_process(vllm_config: Any) -> None:
    """Refuse a configuration whose worker runs in another process than the scheduler: the
    connector's two sides share the mirror in-process (a worker elsewhere would save into and
    load from a mirror of its own, which the scheduler never sees)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    workers = int(getattr(parallel, "world_size", 1) or 1)
    if (isinstance(backend, str) and backend in OTHER_PROCESS_EXECUTORS) or workers > 1:
        raise MirrorSettingsError(
            f"KvfsmConnector needs vLLM's worker in the scheduler's process (one worker, "
            f"executor 'uni'); this engine has {workers} worker(s) on executor {backend!r}. "
            "vLLM's CPU build picks 'mp' unless VLLM_ENABLE_V1_MULTIPROCESSING=0 is set "
            "(the engine core still runs apart from the API server)")


def _running_block(ids: Any, hit_index: int) -> int | None:
    """The vLLM block a Mamba group's running state is kept in for a request whose state at
    block ``hit_index`` was loaded: its last allocated block past the hit (vLLM's null block,
    id 0, stands where nothing is kept); None where there is none."""
    for index in range(len(ids) - 1, hit_index, -1):
        if int(ids[index]) != NULL_BLOCK:
            return int(ids[index])
    return None


__all__ = ["BlockLoad", "ClaimCounts", "KvfsmConnector", "KvfsmConnectorMetadata"]
