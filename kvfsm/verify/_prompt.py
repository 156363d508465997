"""A request's tokens and their chained block hashes, kept per block size as tokens arrive."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm.state import PrefixHashes


class Prompt:
    """Tokens of one request and their block hashes for every block size the model uses.

    Hashes are computed once, incrementally (as vLLM's requests keep them), so a lookup never
    hashes: it only reads the words.
    """

    def __init__(self, seed: bytes, block_sizes: Iterable[int],
                 token_ids: Sequence[int] | ArrayLike = ()) -> None:
        self._hashes = {size: PrefixHashes(seed, size) for size in sorted(set(block_sizes))}
        self._words: dict[int, tuple[NDArray[np.uint64], NDArray[np.uint64]]] = {}
        self.n_tokens = 0
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int] | ArrayLike) -> None:
        """Append tokens (hashing only the blocks they complete)."""
        tokens = np.asarray(token_ids, dtype=np.int64).ravel()
        if not tokens.size:
            return
        for hashes in self._hashes.values():
            hashes.extend(tokens)
        self.n_tokens += tokens.size
        self._words.clear()

    def words(self, block_size: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """``(high, low)`` hash words of every complete block at ``block_size``."""
        if block_size not in self._words:
            self._words[block_size] = self._hashes[block_size].words()
        return self._words[block_size]
