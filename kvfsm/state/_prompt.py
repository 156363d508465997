"""A request's tokens and their chained block hashes, kept per block size as tokens arrive."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import ForeignPromptError, KvfsmError
from kvfsm._tokens import as_token_ids
from kvfsm.state._hashing import XXH3_128, PrefixHashes, check_hash_function
from kvfsm.state._request_keys import content_keys_of, namespace_of, namespace_root


class Prompt:
    """Tokens of one request and their block hashes for every block size the model uses.

    Hashes are computed once, incrementally; a lookup only reads the words. A prompt is bound to the
    ``seed`` (model, layout version, cache salt, hash function), ``hash_function`` (one of
    :data:`kvfsm.state.HASH_FUNCTIONS`) and ``block_sizes`` it was made with; :meth:`check_made_for`
    tells an engine whether it may use it. The hashes also cover what besides token ids decides the
    KV (:mod:`kvfsm.state._request_keys`): a ``namespace`` (a LoRA adapter's name, a tenant's cache
    salt; namespaces share no block) and ``content_keys`` ``(start, end, key)``: tokens
    ``[start, end)`` stand for content named by ``key`` (e.g. an image's hash), and blocks from the
    one holding ``start`` on are shared only with prompts holding the same content there."""

    def __init__(self, seed: bytes, block_sizes: Iterable[int],
                 token_ids: Sequence[int] | ArrayLike = (), *,
                 hash_function: str = XXH3_128, namespace: str | bytes | None = None,
                 content_keys: Sequence[tuple[int, int, str | bytes]] | None = None) -> None:
        self._seed = bytes(seed)
        self._hash_function = check_hash_function(hash_function)
        self._namespace = b"" if namespace is None else namespace_of(namespace)
        self._content_keys = () if content_keys is None else content_keys_of(content_keys)
        self._block_sizes = tuple(sorted(set(block_sizes)))
        self._sizes_kept: tuple[int, ...] | None = None  #: last tuple found kept, by identity
        self.checked_for: object = None  #: last ``token`` :meth:`check_made_for` recorded
        root = namespace_root(self._seed, self._namespace, hash_function) \
            if self._namespace else self._seed
        self._hashes = {size: PrefixHashes(root, size, hash_function, self._content_keys)
                        for size in self._block_sizes}
        #: :meth:`words` by block size (emptied when tokens are added).
        self._words_at: dict[int, tuple[NDArray[np.uint64], NDArray[np.uint64]]] = {}
        self._buffer = np.zeros(0, dtype=np.int64)  # tokens in [:_n_tokens], doubling when full
        self._n_tokens = 0
        self.extend(token_ids)

    @property
    def seed(self) -> bytes:
        """The engine's root digest (see :func:`kvfsm.state.hash_seed`): the block hashes
        chain from it, or from its mix with the namespace where the prompt has one."""
        return self._seed

    @property
    def namespace(self) -> bytes:
        """The namespace its hashes are made in (empty: none)."""
        return self._namespace

    @property
    def content_keys(self) -> tuple[tuple[int, int, bytes], ...]:
        """Its content keys ``(start, end, key)``, sorted, keys as bytes."""
        return self._content_keys

    def head(self, n_tokens: int) -> Prompt:
        """A prompt of this one's first ``n_tokens`` tokens, with its seed, hash function,
        block sizes, namespace and content keys (its block hashes are this one's first)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer) or \
                not 0 <= n_tokens <= self._n_tokens:
            raise KvfsmError(f"head: n_tokens must be an int in [0, {self._n_tokens}], got "
                             f"{n_tokens!r}")
        return Prompt(self._seed, self._block_sizes, self.token_ids[:n_tokens],
                      hash_function=self._hash_function, namespace=self._namespace,
                      content_keys=self._content_keys)

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
        """Append tokens, hashing only the blocks they complete. Unless every id is an integer in
        ``[0, 2**63)`` (:func:`as_token_ids`), raises :class:`TokenError` and changes nothing."""
        tokens = as_token_ids(token_ids)  # validate all before changing anything
        if not tokens.size:
            return
        end = self._n_tokens + tokens.size
        if not self._n_tokens and isinstance(token_ids, list | tuple):
            self._buffer = tokens  # made here from a list: nobody else holds it, so no copy
        elif end > self._buffer.size:
            grown = np.empty(max(end, 2 * self._buffer.size), dtype=np.int64)
            grown[: self._n_tokens] = self._buffer[: self._n_tokens]
            self._buffer = grown
        if self._buffer is not tokens:
            self._buffer[self._n_tokens : end] = tokens
        self._words_at = {}  # first: the words change below
        for hashes in self._hashes.values():
            hashes.extend_checked(tokens)
        self._n_tokens = end

    def check_made_for(self, seed: bytes, block_sizes: Iterable[int], owner: str,
                       hash_function: str | None = None, token: object = None) -> None:
        """Raise :class:`ForeignPromptError` unless made with ``seed`` (and ``hash_function``, where
        given) and keeping all ``block_sizes`` (errors name ``owner``'s maker). Passed, it records
        ``token`` (if given) in :attr:`checked_for`: that owner may skip the (unchanging) check."""
        if seed is not self._seed and bytes(seed) != self._seed:
            raise ForeignPromptError(
                "prompt was made for another model, layout version, cache_salt or hash "
                f"function; make it with {owner}.prompt(...)")
        if hash_function is not None and hash_function != self._hash_function:
            raise ForeignPromptError(
                f"prompt was hashed with {self._hash_function} but {owner} uses "
                f"{hash_function}; make it with {owner}.prompt(...)")
        if not (block_sizes == self._block_sizes or block_sizes is self._sizes_kept):
            missing = sorted(set(block_sizes) - set(self._block_sizes))
            if missing:
                raise ForeignPromptError(
                    f"prompt keeps block sizes {list(self._block_sizes)} but {owner} also "
                    f"needs {missing}; make it with {owner}.prompt(...)")
            if isinstance(block_sizes, tuple):  # immutable: no need to compare it again
                self._sizes_kept = block_sizes
        if token is not None:
            self.checked_for = token

    def words(self, block_size: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """``(high, low)`` hash words of every complete block at ``block_size``."""
        words = self._words_at.get(block_size)
        if words is not None:
            return words
        hashes = self._hashes.get(block_size)
        if hashes is None:
            raise ForeignPromptError(
                f"prompt keeps no hashes at block size {block_size} (it keeps "
                f"{list(self._block_sizes)}); make it with the engine's prompt(...)")
        words = hashes.words()
        self._words_at[block_size] = words
        return words

    def __repr__(self) -> str:
        keys = (f", namespace={self._namespace!r}" if self._namespace else "") + \
            (f", content_keys={len(self._content_keys)}" if self._content_keys else "")
        return (f"Prompt(n_tokens={self._n_tokens}, block_sizes={self._block_sizes}, "
                f"hash_function={self._hash_function!r}{keys})")
