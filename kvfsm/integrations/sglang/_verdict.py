"""Which prefix lengths SGLang may restore from storage, by kvfsm's kind rules, page by page.

SGLang's hybrid models ask their storage backend (``batch_exists_v2``) how many pages of a
prefix it can restore: the KV pages every length needs, plus sidecar pools with their own hit
policy, every page of the prefix (``all_pages``) or only the last few, where a Mamba or
sliding-window state sits (``trailing_pages``). Here each pool is a kvfsm group whose block is
one page, so a pool serves a length ``L`` exactly where a kvfsm verdict would say so
(:mod:`kvfsm.kinds`): every block its kind needs at ``L`` was verified. A length is restorable
where every pool serves it; the lengths are not downward-closed (a trailing state may exist at
8 pages and not at 7), so the answer is the set, as SGLang's ``restorable_prefix_pages`` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

import attrs
import numpy as np
from numpy.typing import NDArray

from kvfsm.kinds import rule_of
from kvfsm.spec import GroupDecl, GroupKind, Layout

#: SGLang's ``PoolHitPolicy`` values this module understands.
ALL_PAGES: Final = "all_pages"
TRAILING_PAGES: Final = "trailing_pages"
#: The pool whose pages every length needs (SGLang's ``PoolName.KV``).
KV_POOL: Final = "kv"
#: A page is one kvfsm block of one "token": lengths below are counted in pages.
_PAGE: Final = 1
#: Geometry the kind rules do not read (they read block size, window and checkpoints only).
_NO_LAYOUT: Final = Layout(("block", "token"), 1, 0)


@attrs.frozen
class StoragePool:
    """One pool as a kvfsm group over pages: ``kind`` FULL (every page of the prefix),
    RECURRENT (the state at exactly the prefix's last page) or SLIDING_WINDOW (the last
    ``trailing`` pages)."""

    name: str
    kind: GroupKind
    #: Pages a trailing state needs at the prefix's end (1 for FULL and RECURRENT).
    trailing: int = 1

    def __attrs_post_init__(self) -> None:
        if self.kind not in (GroupKind.FULL, GroupKind.RECURRENT, GroupKind.SLIDING_WINDOW):
            raise ValueError(f"storage pool {self.name!r}: kind {self.kind.value} is not a "
                             "page policy SGLang asks about")
        if self.trailing < 1:
            raise ValueError(f"storage pool {self.name!r}: trailing must be >= 1, "
                             f"got {self.trailing}")

    @property
    def decl(self) -> GroupDecl:
        """The group the kind rule reads: blocks of one page. A window of ``trailing + 1``
        "tokens" needs exactly the last ``trailing`` pages (the rule's window holds the
        ``W - 1`` tokens before the prefix's end)."""
        window = self.trailing + 1 if self.kind is GroupKind.SLIDING_WINDOW else None
        checkpoint = _PAGE if self.kind is GroupKind.RECURRENT else None
        return GroupDecl(self.name, self.kind, self.kind.value, _PAGE, (1,), "uint8",
                         _NO_LAYOUT, window=window, checkpoint_interval=checkpoint)


def pool_for_policy(name: str, policy: str, trailing_pages: int) -> StoragePool:
    """The pool SGLang describes with hit policy ``policy`` (``all_pages`` or
    ``trailing_pages``; ``trailing_pages`` pages of state at the end). Another policy is a
    ValueError."""
    if policy == ALL_PAGES:
        return StoragePool(name, GroupKind.FULL)
    if policy == TRAILING_PAGES:
        trailing = max(1, trailing_pages)
        kind = GroupKind.RECURRENT if trailing == 1 else GroupKind.SLIDING_WINDOW
        return StoragePool(name, kind, trailing)
    raise ValueError(f"storage pool {name!r}: hit policy {policy!r} is not supported "
                     f"(supported: {ALL_PAGES}, {TRAILING_PAGES})")


def servable(pool: StoragePool, verified: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """For each length ``L = 1..len(verified)`` pages: whether ``pool`` can serve ``L``, given
    which of its pages verified (``verified[i]``: page ``i``'s stored copy is whole and this
    pool's)."""
    verified = np.asarray(verified, dtype=np.bool_)
    lengths = np.arange(1, verified.size + 1, dtype=np.int64)
    needed = rule_of(pool.decl).needed(pool.decl, lengths)
    # Pages failing before each index: a length is served where none of [lo, hi) fails.
    failed = np.concatenate(([0], np.cumsum(~verified)))
    ok: NDArray[np.bool_] = failed[needed.hi] == failed[needed.lo]
    if needed.servable is not None:
        ok &= needed.servable
    return ok


@attrs.frozen
class RestorablePrefix:
    """What ``batch_exists_v2`` answers, in pages."""

    #: Every length every pool can serve, ascending.
    lengths: tuple[int, ...]
    #: Per pool (KV included, only pools with a nonzero boundary): the longest length it
    #: serves within the KV pages, its own verdict whatever the others say.
    boundaries: Mapping[str, int]

    @property
    def pages(self) -> int:
        """The longest restorable length (0: none)."""
        return self.lengths[-1] if self.lengths else 0


def restorable_prefix(kv_verified: NDArray[np.bool_],
                      pools: Sequence[tuple[StoragePool, NDArray[np.bool_]]]
                      ) -> RestorablePrefix:
    """The lengths restorable when the KV pages ``kv_verified`` and each pool's pages verified
    as given (every vector one entry per page of the request's keys)."""
    kv_ok = servable(StoragePool(KV_POOL, GroupKind.FULL), kv_verified)
    every = kv_ok.copy()
    lengths = np.arange(1, kv_ok.size + 1, dtype=np.int64)
    boundaries: dict[str, int] = {}
    for pool, verified in pools:
        if np.asarray(verified).size != kv_ok.size:
            raise ValueError(f"storage pool {pool.name!r}: {np.asarray(verified).size} pages "
                             f"verified for {kv_ok.size} keys")
        ok = servable(pool, verified) & kv_ok
        every &= ok
        if ok.any():
            boundaries[pool.name] = int(lengths[ok][-1])
    if kv_ok.any():
        boundaries[KV_POOL] = int(lengths[kv_ok][-1])
    return RestorablePrefix(tuple(int(n) for n in lengths[every]),
                            MappingProxyType(boundaries))
