"""Chained prefix hashes of token blocks: block i's hash covers every token of blocks 0..i.

Block ``i``'s digest hashes the digest of block ``i - 1`` (the *seed* for block 0) followed by
its token ids as little-endian int64. The seed hashes the keys that make two caches
incompatible (model, layout version, cache salt, and the hash function when it is not the
default), so two such caches never share a block. A request computes the hashes once,
incrementally, as its tokens arrive (:class:`PrefixHashes`); lookups never rehash.

Two hash functions (:data:`HASH_FUNCTIONS`):

* ``"xxh3_128"`` (the default): XXH3-128, every block of a call in one compiled pass
  (:mod:`kvfsm.state._hash_kernel`; the ``xxhash`` package block by block without numba).
  Different prefixes collide with probability about 2**-128 per pair for inputs nobody chose
  to collide, but XXH3 is not cryptographic: whoever can choose tokens can construct colliding
  prefixes.
* ``"sha256"``: SHA-256 (hashlib) chained over the full 32-byte digests, the stored key being a
  digest's first 16 bytes. Finding two prefixes with one key takes about 2**64 SHA-256
  evaluations (the birthday bound of a 128-bit key). About 20 times slower.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import KvfsmError
from kvfsm._tokens import as_token_ids
from kvfsm.state import _hash_kernel
from kvfsm.state._hash_kernel import DIGEST_BYTES, DIGEST_WORDS, SECRET_WORDS
from kvfsm.state._request_keys import ContentKey, keyed_blocks, mix_content

#: The default block hash: XXH3-128, compiled (see the module docstring for its guarantee).
XXH3_128: Final = "xxh3_128"
#: The collision-resistant block hash: SHA-256, its digests truncated to 128-bit keys.
SHA256: Final = "sha256"
#: Every block hash function, the default first.
HASH_FUNCTIONS: Final = (XXH3_128, SHA256)

_TOKEN_DTYPE = np.dtype("<i8")
_WORD_DTYPE = np.dtype("<u8")
#: Blocks of hash words a fresh chain has room for before its arrays first grow.
_INITIAL_BLOCKS: Final = 16


def check_hash_function(name: object, where: str = "hash_function") -> str:
    """``name`` if it is one of :data:`HASH_FUNCTIONS`, else a :class:`KvfsmError` naming
    ``where`` and the choices."""
    if not isinstance(name, str) or name not in HASH_FUNCTIONS:
        raise KvfsmError(f"{where} must be one of {list(HASH_FUNCTIONS)}, got {name!r}")
    return name


def hash_seed(model: str, layout_version: int, cache_salt: str = "",
              hash_function: str = XXH3_128) -> bytes:
    """The 16-byte root digest every chain starts from; different keys never share a block.

    The default function's seed leaves the function out, so its seeds (and every key stored
    on disk or remotely under them) are those of earlier versions; any other function is one
    more part of the key, hashed with that function.
    """
    check_hash_function(hash_function)
    # Length-prefixed parts: no two different (model, version, salt) spell the same bytes.
    parts = [b"kvfsm", model.encode(), str(layout_version).encode(), cache_salt.encode()]
    if hash_function != XXH3_128:
        parts.append(hash_function.encode())
    key = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    if hash_function == SHA256:
        return hashlib.sha256(key).digest()[:DIGEST_BYTES]
    return xxhash.xxh3_128_digest(key)


def split_digest(digest: bytes) -> tuple[int, int]:
    """A 16-byte digest as the two uint64 words stored in the logical line."""
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little")


def join_words(high: int, low: int) -> int:
    """The 128-bit key used in the hash map, from the two stored words."""
    return (int(high) << 64) | int(low)


class PrefixHashes:
    """The chained hashes of one token sequence at one block size, extended as tokens arrive.

    Only complete blocks are hashed: a partial last block has no identity yet. The words live
    in arrays that double when full and are never rewritten, so appending costs O(new tokens)
    amortized and :meth:`words` O(1).
    """

    def __init__(self, seed: bytes, block_size: int, hash_function: str = XXH3_128,
                 content_keys: tuple[ContentKey, ...] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(seed) != DIGEST_BYTES:
            raise ValueError(f"seed must be {DIGEST_BYTES} bytes (see hash_seed), got "
                             f"{len(seed)}")
        self.block_size = block_size
        self.hash_function = check_hash_function(hash_function)
        self._n_tokens = 0
        self._n_blocks = 0
        self._high = np.zeros(_INITIAL_BLOCKS, dtype=np.uint64)
        self._low = np.zeros(_INITIAL_BLOCKS, dtype=np.uint64)
        # words() of the blocks so far, made once per extend (a lookup asks on every call).
        self._words: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
        # The incomplete last block's tokens: _pending[:_n_pending].
        self._pending = np.zeros(block_size, dtype=np.int64)
        self._n_pending = 0
        # The last block's digest as the next block reads it (XXH3: its two words; SHA-256: all
        # 32 bytes, kept whole so a collision of two 128-bit keys does not carry down a chain).
        self._parent_words = np.frombuffer(bytes(seed), dtype=_WORD_DTYPE).astype(np.uint64)
        self._parent_digest = bytes(seed)
        #: Token ranges standing for content the ids do not carry (checked, sorted: see
        #: :func:`~kvfsm.state._request_keys.content_keys_of`), mixed into their blocks.
        self.content_keys = content_keys
        # Keys whose range has begun before the tokens hashed so far and not ended there, and
        # the first key not yet begun: a block's keys are found among these few, so a prompt
        # of many keys extended a token at a time costs what each block holds.
        self._open_keys: list[ContentKey] = []
        self._next_key = 0

    def extend(self, token_ids: Sequence[int] | ArrayLike) -> None:
        """Append tokens and hash every block they complete (O(new tokens)). Token ids must be
        integers in ``[0, 2**63)`` (:class:`~kvfsm.TokenError` otherwise, nothing appended)."""
        self.extend_checked(as_token_ids(token_ids))

    def extend_checked(self, tokens: NDArray[np.int64]) -> None:
        """:meth:`extend` with ``tokens`` already checked by :func:`kvfsm.as_token_ids` (a 1-D
        C-contiguous int64 array), so a caller hashing several block sizes checks once."""
        size = self.block_size
        self._n_tokens += tokens.size
        if self._n_pending:
            take = min(size - self._n_pending, tokens.size)
            self._pending[self._n_pending : self._n_pending + take] = tokens[:take]
            self._n_pending += take
            tokens = tokens[take:]
            if self._n_pending < size:
                return
            self._hash_blocks(self._pending)
            self._n_pending = 0
        complete = tokens.size - tokens.size % size
        if complete:
            self._hash_blocks(tokens[:complete])
        tail = tokens.size - complete
        self._pending[:tail] = tokens[complete:]
        self._n_pending = tail

    def _hash_blocks(self, tokens: NDArray[np.int64]) -> None:
        """Hash the complete blocks ``tokens`` (a multiple of the block size) onto the chain,
        each block holding a content key's token with the key mixed into its digest."""
        count = tokens.size // self.block_size
        start, end = self._n_blocks, self._n_blocks + count
        if end > self._high.size:
            capacity = max(end, 2 * self._high.size)
            for name in ("_high", "_low"):
                grown = np.zeros(capacity, dtype=np.uint64)
                grown[:start] = getattr(self, name)[:start]
                setattr(self, name, grown)
        keyed = self._keyed(start, end) if self.content_keys else None
        if not keyed:
            self._hash_run(tokens, start, end)
        else:
            # Runs of plain blocks hashed as usual; each keyed block after its run, then mixed.
            size, done = self.block_size, start
            for block in sorted(keyed):
                self._hash_run(tokens[(done - start) * size : (block + 1 - start) * size],
                               done, block + 1)
                self._mix(block, keyed[block])
                done = block + 1
            if done < end:
                self._hash_run(tokens[(done - start) * size :], done, end)
        self._n_blocks = end
        self._words = None

    def _keyed(self, start: int, end: int) -> dict[int, list[ContentKey]]:
        """The keys of each keyed block of ``[start, end)``, the blocks about to be hashed;
        keys ending within them are let go (no later block holds their tokens)."""
        keys, size = self.content_keys, self.block_size
        stop = end * size
        while self._next_key < len(keys) and keys[self._next_key][0] < stop:
            self._open_keys.append(keys[self._next_key])
            self._next_key += 1
        keyed = keyed_blocks(self._open_keys, size, start, end)
        self._open_keys = [key for key in self._open_keys if key[1] > stop]
        return keyed

    def _hash_run(self, tokens: NDArray[np.int64], start: int, end: int) -> None:
        """Hash blocks ``[start, end)`` (``tokens``: theirs) onto the chain's last digest."""
        high, low = self._high[start:end], self._low[start:end]
        if self.hash_function == SHA256:
            self._sha256_blocks(tokens, high, low)
        else:
            view = tokens.view()
            view.flags.writeable = False  # the kernel is compiled for read-only tokens
            _hash_kernel.chain_kernel(view, self.block_size, self._parent_words, SECRET_WORDS,
                                      high, low)
            self._parent_words[0], self._parent_words[1] = high[-1], low[-1]

    def _mix(self, block: int, keys: list[ContentKey]) -> None:
        """Mix ``keys`` into block ``block``'s digest, the last one hashed: the chain goes on
        from the mixed digest."""
        if self.hash_function == SHA256:
            self._parent_digest = digest = mix_content(self._parent_digest, keys, SHA256)
        else:
            digest = mix_content(self._parent_words.astype(_WORD_DTYPE).tobytes(), keys,
                                 XXH3_128)
            self._parent_words[:] = np.frombuffer(digest, dtype=_WORD_DTYPE)
        self._high[block], self._low[block] = split_digest(digest)

    def _sha256_blocks(self, tokens: NDArray[np.int64], high: NDArray[np.uint64],
                       low: NDArray[np.uint64]) -> None:
        raw = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE).data.cast("B")
        step = self.block_size * _TOKEN_DTYPE.itemsize
        parent = self._parent_digest
        keys = []
        for start in range(0, len(raw), step):
            chained = hashlib.sha256(parent)
            chained.update(raw[start : start + step])
            parent = chained.digest()
            keys.append(parent[:DIGEST_BYTES])
        self._parent_digest = parent
        pairs = np.frombuffer(b"".join(keys), dtype=_WORD_DTYPE).reshape(-1, DIGEST_WORDS)
        high[:] = pairs[:, 0]
        low[:] = pairs[:, 1]

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def n_blocks(self) -> int:
        return self._n_blocks

    def words(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """``(high, low)`` uint64 arrays, one entry per complete block, in O(1): views of the
        chain's storage that later extends leave as they are (not to be written: they stay
        writable only because the lookup kernels are compiled for writable arrays)."""
        words = self._words
        if words is None:
            words = self._words = (self._high[: self._n_blocks], self._low[: self._n_blocks])
        return words

    def keys(self) -> list[int]:
        """128-bit keys, one per complete block, as the hash map stores them."""
        high, low = self.words()
        return [join_words(h, lo) for h, lo in zip(high.tolist(), low.tolist(), strict=True)]
