"""How a page SGLang hands its storage backend is named in kvfsm's stored tiers.

SGLang names a page by a string (the chained hash of every token up to the page's end, so the
name already covers the whole prefix). kvfsm names a stored value by a :class:`BlockKey`:
whose model and cache namespace, which group, which layout, which prefix. Here:

* **model**: the model name, the cache salt and the parallel shard every pool shares
  (pipeline stage, context-parallel rank, decode-context-parallel shard), hashed to 16 bytes;
* **group**: the pool's name and its tensor-parallel shard (MLA's KV is the same on every
  tensor-parallel rank and is shared; everything else, Mamba state included, is per rank);
* **layout**: the host pool's page layout (``layer_first``, ``page_first`` ...), element type,
  elements per page, tokens per page and format tag: a page written by a pool of another
  layout has another name, and a value planted under this one fails the header check;
* **chain**: the 128-bit xxh3 of SGLang's page name; **token range**: ``[0, page tokens)``
  (the position is inside the chain: SGLang's names are chained).

The header every value carries (:func:`kvfsm.tiers.encode_header`) repeats the key, so a load
accepts only a whole value of exactly this key (:func:`kvfsm.tiers.verify`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs
import xxhash

from kvfsm.tiers import BlockKey, group_hash

#: Prefix of every namespace digest: bumped if what a name covers changes.
_NAMESPACE: Final = b"kvfsm-sglang-hicache/1"
_WORD: Final = (1 << 64) - 1
#: Pools whose state is split over tensor-parallel ranks even where the KV is MLA (shared).
TP_SHARDED_POOLS: Final = frozenset({"mamba"})


def _digest(*parts: str) -> int:
    # Length-prefixed: no two different part lists spell the same bytes.
    return xxhash.xxh3_128_intdigest(
        b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts))


def namespace_digest(fields: Mapping[str, object]) -> bytes:
    """16 bytes naming a cache namespace from ``fields`` (name -> value, order irrelevant)."""
    parts = [f"{name}={fields[name]}" for name in sorted(fields)]
    return _digest(_NAMESPACE.decode(), *parts).to_bytes(16, "little")


@attrs.frozen
class PagePool:
    """One SGLang host pool as stored: its name, the key fields its pages share, and the
    exact byte length of one page."""

    name: str
    #: ``BlockKey.group`` of its pages: the pool's name and tensor-parallel shard.
    group: int
    #: ``BlockKey.layout`` of its pages: the page's layout and geometry.
    layout: int
    page_bytes: int
    page_tokens: int

    def key(self, model: bytes, page_name: str) -> BlockKey:
        """The stored key of the page SGLang calls ``page_name``."""
        chain = _digest(page_name)
        return BlockKey(model, self.group, self.layout, chain >> 64, chain & _WORD, 0,
                        self.page_tokens)


def page_pool(name: str, *, tp_shard: str, layout: str, dtype: str, page_elements: int,
              itemsize: int, page_tokens: int, format_tag: str = "") -> PagePool:
    """The stored form of pool ``name`` whose flat page is ``page_elements`` of ``dtype``
    (``itemsize`` bytes each) covering ``page_tokens`` tokens in host ``layout``;
    ``tp_shard`` names the tensor-parallel shard it holds ("" where every rank holds the
    same)."""
    if page_elements < 1 or itemsize < 1 or page_tokens < 1:
        raise ValueError(f"pool {name!r}: a page needs elements, bytes and tokens "
                         f"(got {page_elements}, {itemsize}, {page_tokens})")
    group = group_hash(f"sglang:{name}:{tp_shard}")
    geometry = _digest("layout", layout, dtype, str(page_elements), str(itemsize),
                       str(page_tokens), format_tag)
    return PagePool(name, group, geometry & _WORD, page_elements * itemsize, page_tokens)
