"""What besides its token ids makes a request's KV what it is, as part of its block hashes.

Two requests with the same token ids can need different KV: one runs a LoRA adapter the
other does not, they belong to tenants whose caches must stay apart (a per-request cache
salt), or the same placeholder tokens stand for different images. A cache keyed by token ids
alone hands one the other's KV: a hit that is not usable, and wrong output. So a prompt's
chained block hashes take two more inputs:

* a **namespace** (bytes; empty: none): the adapter, the tenant's salt. It changes the chain's
  root, so no block of one namespace is ever a hit for another, whatever the tokens.
* **content keys** ``(start, end, key)``: the tokens ``[start, end)`` stand for content the ids
  do not carry, identified by ``key`` (an image's hash). Every block holding any of those
  tokens has the key, with its range, mixed into its digest; the chain carries the change to
  every later block. Blocks before ``start`` stay shared with prompts that hold other
  content there.

Both are mixed with the prompt's own hash function, so a SHA-256 chain stays collision
resistant with them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import xxhash

from kvfsm._errors import KvfsmError
from kvfsm.state._hash_kernel import DIGEST_BYTES

#: One content key: the tokens ``[start, end)`` stand for content named by ``key``.
ContentKey = tuple[int, int, bytes]

#: Length-prefixed tags: a mixed digest never spells the bytes of an unmixed one.
_NAMESPACE_TAG: Final = b"kvfsm-namespace"
_CONTENT_TAG: Final = b"kvfsm-content"
_SHA256: Final = "sha256"


def _key_bytes(where: str, value: object) -> bytes:
    """``value`` (str: UTF-8, or bytes-like) as bytes, or a KvfsmError naming ``where``."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise KvfsmError(f"{where} must be str or bytes, got {type(value).__name__} {value!r}")


def namespace_of(value: object) -> bytes:
    """A prompt's namespace as bytes (str as UTF-8; None or empty: none), or a KvfsmError."""
    if value is None:
        return b""
    return _key_bytes("namespace", value)


def content_keys_of(value: object) -> tuple[ContentKey, ...]:
    """Content keys as ``(start, end, key bytes)`` sorted by range, each checked: ``start``
    and ``end`` ints with ``0 <= start < end``, ``key`` str or bytes and not empty; a
    KvfsmError naming the first bad entry otherwise."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        raise KvfsmError(f"content_keys must be a sequence of (start, end, key), got "
                         f"{type(value).__name__}")
    made: list[ContentKey] = []
    for at, entry in enumerate(value):
        where = f"content_keys[{at}]"
        if not isinstance(entry, Sequence) or isinstance(entry, str | bytes) or \
                len(entry) != 3:
            raise KvfsmError(f"{where} must be (start, end, key), got {entry!r}")
        start, end, key = entry
        if not all(isinstance(bound, int | np.integer) and not isinstance(bound, bool | np.bool_)
                   for bound in (start, end)) or not 0 <= start < end:
            raise KvfsmError(f"{where}: start and end must be ints with 0 <= start < end, "
                             f"got ({start!r}, {end!r})")
        data = _key_bytes(f"{where} key", key)
        if not data:
            raise KvfsmError(f"{where}: the key is empty; name the content (its hash)")
        made.append((int(start), int(end), data))
    return tuple(sorted(made))


def _digest(parts: Sequence[bytes], hash_function: str) -> bytes:
    """The digest of length-prefixed ``parts``: SHA-256's 32 bytes, or XXH3-128's 16."""
    data = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    if hash_function == _SHA256:
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def namespace_root(seed: bytes, namespace: bytes, hash_function: str) -> bytes:
    """The root digest a chain in ``namespace`` starts from (``seed`` itself for none), of
    the seed's length."""
    if not namespace:
        return seed
    return _digest((_NAMESPACE_TAG, seed, namespace), hash_function)[:DIGEST_BYTES]


def keyed_blocks(keys: Sequence[ContentKey], block_size: int, start: int, end: int
                 ) -> dict[int, list[ContentKey]]:
    """Per block of ``[start, end)`` holding a token of some key's range: those keys, in
    order (blocks of ``block_size`` tokens)."""
    found: dict[int, list[ContentKey]] = {}
    for key in keys:
        first = max(key[0] // block_size, start)
        stop = min(-(-key[1] // block_size), end)
        for block in range(first, stop):
            found.setdefault(block, []).append(key)
    return found


def mix_content(digest: bytes, keys: Sequence[ContentKey], hash_function: str) -> bytes:
    """A block's digest with its content keys mixed in (same length: 16 bytes for XXH3,
    SHA-256's whole 32 for its chain)."""
    parts = [_CONTENT_TAG, digest]
    for start, end, key in keys:
        parts += [start.to_bytes(8, "little"), end.to_bytes(8, "little"), key]
    return _digest(parts, hash_function)[:len(digest)]


__all__ = ["ContentKey", "content_keys_of", "keyed_blocks", "mix_content", "namespace_of",
           "namespace_root"]
