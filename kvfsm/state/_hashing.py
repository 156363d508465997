"""Chained prefix hashes of token blocks: block i's hash covers every token of blocks 0..i.

Hashes are xxh3-128 over the parent's digest and the block's token ids, seeded by the extra keys
that make two caches incompatible (model, layout version, cache salt). A request computes them
once, incrementally, as its tokens arrive (:class:`PrefixHashes`); lookups never rehash.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from kvfsm._tokens import as_token_ids

_TOKEN_DTYPE = np.dtype("<i8")


def hash_seed(model: str, layout_version: int, cache_salt: str = "") -> bytes:
    """The root digest every chain starts from; different keys never share a block."""
    # Length-prefixed parts: no two different (model, version, salt) spell the same bytes.
    parts = [b"kvfsm", model.encode(), str(layout_version).encode(), cache_salt.encode()]
    key = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    return xxhash.xxh3_128_digest(key)


def split_digest(digest: bytes) -> tuple[int, int]:
    """A 16-byte digest as the two uint64 words stored in the logical line."""
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def join_words(high: int, low: int) -> int:
    """The 128-bit key used in the hash map, from the two stored words."""
    return (int(high) << 64) | int(low)


class PrefixHashes:
    """The chained hashes of one token sequence at one block size, extended as tokens arrive.

    Only complete blocks are hashed: a partial last block has no identity yet.
    """

    def __init__(self, seed: bytes, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._seed = seed
        self._n_tokens = 0
        self._pending = np.zeros(0, dtype=_TOKEN_DTYPE)  # tokens of the incomplete last block
        self._digests: list[bytes] = []

    def extend(self, token_ids: Sequence[int] | ArrayLike) -> None:
        """Append tokens and hash every block they complete (O(new tokens)). Token ids must be
        integers in ``[0, 2**63)`` (:class:`~kvfsm.TokenError` otherwise, nothing appended)."""
        new = as_token_ids(token_ids)
        self._n_tokens += new.size
        tokens = np.concatenate([self._pending, new]) if self._pending.size else new
        size = self.block_size
        complete = tokens.size - tokens.size % size
        parent = self._digests[-1] if self._digests else self._seed
        # A view, not tobytes(): hashing a long prompt need not copy all of its tokens first.
        raw = np.ascontiguousarray(tokens[:complete]).data.cast("B")
        step = size * _TOKEN_DTYPE.itemsize
        for start in range(0, len(raw), step):
            parent = xxhash.xxh3_128_digest(parent + raw[start : start + step])
            self._digests.append(parent)
        self._pending = tokens[complete:].copy()

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def n_blocks(self) -> int:
        return len(self._digests)

    def words(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """``(high, low)`` uint64 arrays, one entry per complete block."""
        raw = np.frombuffer(b"".join(self._digests), dtype="<u8").reshape(-1, 2)
        return raw[:, 0].astype(np.uint64), raw[:, 1].astype(np.uint64)

    def keys(self) -> list[int]:
        """128-bit keys, one per complete block, as the hash map stores them."""
        return [join_words(*split_digest(d)) for d in self._digests]
