"""A request's tokens and their chained block hashes, kept per block size as tokens arrive."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import ForeignPromptError
from kvfsm._tokens import as_token_ids
from kvfsm.state import PrefixHashes
from kvfsm.state._hashing import XXH3_128, check_hash_function


class Prompt:
    """Tokens of one request and their block hashes for every block size the model uses.

    Hashes are computed once, incrementally (as vLLM's requests keep them), so a lookup never
    hashes: it only reads the words. A prompt is bound to the ``seed`` (model, layout version,
    cache salt, hash function), the ``hash_function`` (one of
    :data:`kvfsm.state.HASH_FUNCTIONS`) and the ``block_sizes`` it was made with;
    :meth:`check_made_for` tells an engine whether it may use it.
    """

    def __init__(self, seed: bytes, block_sizes: Iterable[int],
                 token_ids: Sequence[int] | ArrayLike = (), *,
                 hash_function: str = XXH3_128) -> None:
        self._seed = bytes(seed)
        self._hash_function = check_hash_function(hash_function)
        self._block_sizes = tuple(sorted(set(block_sizes)))
        #: The last tuple of block sizes found kept (check_made_for), by identity.
        self._sizes_kept: tuple[int, ...] | None = None
        self._hashes = {size: PrefixHashes(self._seed, size, hash_function)
                        for size in self._block_sizes}
        # Tokens so far live in _buffer[:_n_tokens]; the buffer doubles when full, so appending
        # one token at a time stays amortized O(1).
        self._buffer = np.zeros(0, dtype=np.int64)
        self._n_tokens = 0
        self.extend(token_ids)

    @property
    def seed(self) -> bytes:
        """The root digest the block hashes chain from (see :func:`kvfsm.state.hash_seed`)."""
        return self._seed

    @property
    def hash_function(self) -> str:
        """The block hash its words were made with (one of :data:`kvfsm.state.HASH_FUNCTIONS`)."""
        return self._hash_function

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The block sizes whose hashes this prompt keeps, ascending, each once."""
        return self._block_sizes

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def token_ids(self) -> NDArray[np.int64]:
        """Every token so far, as a read-only int64 array (later extends do not change it)."""
        view = self._buffer[: self._n_tokens]
        view.flags.writeable = False
        return view

    def extend(self, token_ids: Sequence[int] | ArrayLike) -> None:
        """Append tokens (hashing only the blocks they complete).

        Raises :class:`TokenError` (and changes nothing) unless every id is an integer in
        ``[0, 2**63)``; see :func:`as_token_ids` for what is accepted.
        """
        tokens = as_token_ids(token_ids)  # validate all before changing anything
        if not tokens.size:
            return
        end = self._n_tokens + tokens.size
        if not self._n_tokens and isinstance(token_ids, list | tuple):
            # A list was just converted into an array nobody else holds: keep it, not a copy
            # (it is exactly full, so the next extend moves the tokens to a growable buffer).
            self._buffer = tokens
        elif end > self._buffer.size:
            grown = np.empty(max(end, 2 * self._buffer.size), dtype=np.int64)
            grown[: self._n_tokens] = self._buffer[: self._n_tokens]
            self._buffer = grown
        if self._buffer is not tokens:
            self._buffer[self._n_tokens : end] = tokens
        for hashes in self._hashes.values():
            hashes.extend_checked(tokens)
        self._n_tokens = end

    def check_made_for(self, seed: bytes, block_sizes: Iterable[int], owner: str,
                       hash_function: str | None = None) -> None:
        """Raise :class:`ForeignPromptError` unless this prompt was made with ``seed`` (and
        ``hash_function``, where given) and keeps every one of ``block_sizes`` (``owner`` names
        the maker to use instead)."""
        if seed is not self._seed and bytes(seed) != self._seed:
            raise ForeignPromptError(
                "prompt was made for another model, layout version, cache_salt or hash "
                f"function; make it with {owner}.prompt(...)")
        if hash_function is not None and hash_function != self._hash_function:
            raise ForeignPromptError(
                f"prompt was hashed with {self._hash_function} but {owner} uses "
                f"{hash_function}; make it with {owner}.prompt(...)")
        if block_sizes == self._block_sizes or block_sizes is self._sizes_kept:
            return  # the engine's own sizes, or a tuple found kept before: nothing to compare
        missing = sorted(set(block_sizes) - set(self._block_sizes))
        if missing:
            raise ForeignPromptError(
                f"prompt keeps block sizes {list(self._block_sizes)} but {owner} also needs "
                f"{missing}; make it with {owner}.prompt(...)")
        if isinstance(block_sizes, tuple):
            # Immutable: the same tuple asked again (an engine's per-group sizes, on every
            # lookup) needs no second comparison.
            self._sizes_kept = block_sizes

    def words(self, block_size: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """``(high, low)`` hash words of every complete block at ``block_size``."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            raise ForeignPromptError(
                f"prompt keeps no hashes at block size {block_size} (it keeps "
                f"{list(self._block_sizes)}); make it with the engine's prompt(...)")
        return hashes.words()

    def __repr__(self) -> str:
        return (f"Prompt(n_tokens={self._n_tokens}, block_sizes={self._block_sizes}, "
                f"hash_function={self._hash_function!r})")
