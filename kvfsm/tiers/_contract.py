"""The contract every stored tier (disk, remote) keeps, and the header its values carry.

Disk and remote tiers are content-addressed: a block's copy is named by what it holds (the model,
the group, the layout and the chained hash of every token up to its end), never by a slot, so a
copy outlives the block that wrote it, another engine finds it by hash and a restarted engine
finds its files again. What a block records of its copies is one bit per stored tier (see
``docs/tiers.md``); the tier itself is the truth about what it holds.

Every value, on disk or in a store, is a fixed 128-byte header followed by the payload. The header
names the value's identity and the xxh3-64 of its payload and ends with the xxh3-64 of the header
itself, so a torn, truncated, flipped or foreign value is told apart from a good one before a byte
of it reaches a pool (:func:`verify`). No pickle: a header is ``struct`` fields, a payload
raw bytes.
"""

from __future__ import annotations

import abc
import enum
import functools
import struct
from collections.abc import Sequence
from typing import Any, Final

import attrs
import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError
from kvfsm.spec._models import GroupDecl, Layout, ModelDecl
from kvfsm.spec._vocabulary import Tier

#: First bytes of every stored value.
MAGIC: Final = b"KVFSMBLK"
#: Bumped whenever the header's fields change; a value of another version is never loaded.
FORMAT_VERSION: Final = 1
#: magic, version, header length, flags, model digest, group hash, layout hash, chain hash (two
#: words), token range (start, end), payload length, payload xxh3-64.
_FIELDS: Final = struct.Struct("<8sHHI16sQQQQQQQQ")
#: Bytes of the header: the fields, zero padding, and the header's own xxh3-64 in the last 8.
HEADER_BYTES: Final = 128
_CHECK_AT: Final = HEADER_BYTES - 8
#: Largest payload a header may announce (a block is at most 1 GiB; see ``MAX_BLOCK_BYTES``).
MAX_PAYLOAD_BYTES: Final = 1 << 30


class TierError(KvfsmError):
    """A stored tier could not be opened or used as configured (a bad directory, no server)."""


class TierConnectError(TierError):
    """Building a remote tier found no working store at ``address``: nothing listens there, it
    did not answer within the tier's ``connect_timeout_s``, or what answered is not the store
    (another server's port). ``reason`` says which, with what was seen."""

    def __init__(self, store: str, address: str, reason: str) -> None:
        self.store = store
        self.address = address
        self.reason = reason
        super().__init__(f"no {store} answers at {address}: {reason}")


class LoadStatus(enum.IntEnum):
    """What a load found for one key. Only ``OK`` lets bytes reach a pool."""

    #: Header and payload verified: the bytes are this key's content.
    OK = 0
    #: No value under the key (never stored, removed, evicted by the store, lost in a restart).
    MISSING = 1
    #: A value is there but torn, truncated, of another format or failing its checksum.
    CORRUPT = 2
    #: A whole, self-consistent value of another model, group, layout, chain or token range.
    FOREIGN = 3
    #: The tier did not answer (I/O error, server down); the value may still be good.
    FAILED = 4
    #: The read finished after its deadline or lease: the store may have replaced the value
    #: under it, so its bytes are not trusted even if they verify.
    LATE = 5

    @property
    def lost(self) -> bool:
        """The tier's copy is gone or bad for good: forget it rather than retry."""
        return self in (LoadStatus.MISSING, LoadStatus.CORRUPT, LoadStatus.FOREIGN)


def _hash64(*parts: bytes) -> int:
    # Length-prefixed: no two different part lists spell the same bytes.
    return xxhash.xxh3_64_intdigest(b"".join(len(p).to_bytes(4, "little") + p for p in parts))


def group_hash(name: str) -> int:
    """The 64-bit name of a group inside keys and headers."""
    return _hash64(b"group", name.encode())


def layout_hash(decl: GroupDecl, layout: Layout | None = None) -> int:
    """The 64-bit name of how a block's bytes are laid out: ``layout`` (default the declared one)
    and the geometry it applies to. Two engines reading each other's copies must agree on all."""
    layout = decl.layout if layout is None else layout
    parts = [b"layout", ",".join(layout.dim_order).encode(), str(layout.alignment).encode(),
             str(layout.padding).encode(), ",".join(map(str, decl.shape)).encode(),
             decl.dtype.encode(), str(decl.block_size).encode(), str(decl.payload_bytes).encode()]
    return _hash64(*parts)


def model_digest(model: ModelDecl, seed: bytes) -> bytes:
    """16 bytes naming the model and its cache namespace (``seed``: model name, layout version,
    cache salt): a copy written for another model or salt never matches."""
    groups = ";".join(f"{g.name}:{g.kind.value}:{g.block_size}:{g.payload_bytes}"
                      for g in model.groups)
    return xxhash.xxh3_128_digest(seed + model.name.encode() + b"\0" + groups.encode())


@attrs.frozen
class BlockKey:
    """The identity of one stored copy: whose model, which group and layout, which prefix."""

    model: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))
    group: int
    layout: int
    chain_high: int
    chain_low: int
    #: Tokens ``[token_start, token_end)`` the block covers.
    token_start: int
    token_end: int

    def __attrs_post_init__(self) -> None:
        if len(self.model) != 16:
            raise ValueError(f"BlockKey.model must be 16 bytes, got {len(self.model)}")
        for name in ("group", "layout", "chain_high", "chain_low", "token_start", "token_end"):
            value = getattr(self, name)
            if not 0 <= value < 1 << 64:
                raise ValueError(f"BlockKey.{name} must fit in 64 unsigned bits, got {value}")
        if self.token_end < self.token_start:
            raise ValueError(f"BlockKey token range [{self.token_start}, {self.token_end}) "
                             "is empty backwards")

    @functools.cached_property
    def name(self) -> str:
        """Lower-case hex and dashes only, by construction (every field is a validated integer
        or 16 bytes), so it is a safe file name and store key: model, group, layout, chain hash
        and token range. Computed once per key (a load or store asks for it several times)."""
        return (f"{self.model.hex()}-{self.group:016x}-{self.layout:016x}-"
                f"{self.chain_high:016x}{self.chain_low:016x}-{self.token_start:x}-"
                f"{self.token_end:x}")


def block_keys(model: bytes, decl: GroupDecl, layout: int, hash_high: NDArray[np.uint64],
               hash_low: NDArray[np.uint64], positions: NDArray[Any]) -> list[BlockKey]:
    """Keys of the blocks at ``positions`` of a group with chained hashes ``hash_high/low``."""
    group = group_hash(decl.name)
    size = decl.block_size
    return [BlockKey(model, group, layout, int(h), int(lo), int(p) * size, (int(p) + 1) * size)
            for h, lo, p in zip(hash_high.tolist(), hash_low.tolist(), positions.tolist(),
                                strict=True)]


def encode_header(key: BlockKey, payload_bytes: int, checksum: int) -> bytes:
    """The 128-byte header of ``key``'s value with a payload of that length and xxh3-64."""
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, key.model, key.group,
                          key.layout, key.chain_high, key.chain_low, key.token_start,
                          key.token_end, payload_bytes, checksum)
    body = fields + bytes(_CHECK_AT - len(fields))
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


@attrs.frozen
class Header:
    """A header read back and found whole (its own checksum matched)."""

    key: BlockKey
    payload_bytes: int
    checksum: int


def decode_header(raw: bytes | memoryview) -> Header | None:
    """The header in ``raw`` (at least ``HEADER_BYTES``), or None if it is torn, of another
    format or version, or announces an impossible payload."""
    if len(raw) < HEADER_BYTES:
        return None
    head = bytes(raw[:HEADER_BYTES])
    if int.from_bytes(head[_CHECK_AT:], "little") != xxhash.xxh3_64_intdigest(head[:_CHECK_AT]):
        return None
    (magic, version, length, _flags, model, group, layout, high, low, start, end, payload,
     checksum) = _FIELDS.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION or length != HEADER_BYTES:
        return None
    if payload > MAX_PAYLOAD_BYTES or end < start:
        return None
    return Header(BlockKey(model, group, layout, high, low, start, end), payload, checksum)


def verify(key: BlockKey, header: bytes | memoryview, payload: Any,
           payload_bytes: int) -> tuple[LoadStatus, int]:
    """Whether ``header`` + ``payload`` (a buffer of exactly the bytes read) are ``key``'s
    content of ``payload_bytes`` bytes: ``(status, checksum)``, the checksum the header recorded
    (0 unless the status is OK). Nothing is trusted before this says OK."""
    found = decode_header(header)
    if found is None:
        return LoadStatus.CORRUPT, 0
    if found.key != key:
        return LoadStatus.FOREIGN, 0
    if found.payload_bytes != payload_bytes or memoryview(payload).nbytes != payload_bytes:
        return LoadStatus.CORRUPT, 0
    if xxhash.xxh3_64_intdigest(payload) != found.checksum:
        return LoadStatus.CORRUPT, 0
    return LoadStatus.OK, found.checksum


@attrs.frozen
class LoadResult:
    """Per key of a ``load_into`` batch: its status, and the checksum its header recorded."""

    status: NDArray[np.uint8]
    checksum: NDArray[np.uint64]

    @property
    def ok(self) -> NDArray[np.bool_]:
        result: NDArray[np.bool_] = self.status == LoadStatus.OK
        return result


class StoredTier(abc.ABC):
    """A tier that holds copies of blocks by key: a directory of files, a Mooncake Store, a
    Redis/Valkey server. Every method takes a batch and answers per key; none raises for one
    key's trouble (that is its status), only for misuse (buffers of the wrong size). Methods may
    be called from worker threads, one batch at a time per tier object unless it says more."""

    #: ``Tier.DISK`` or ``Tier.REMOTE``: which lifecycle states restore from it.
    tier: Tier

    @abc.abstractmethod
    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        """Store each payload (a buffer) under its key with a header carrying ``checksums``.
        True where the tier now holds exactly that content: newly written, or already there
        and verified whole. A key holding something else is never overwritten silently: the
        answer is False unless the bad value could be replaced."""

    @abc.abstractmethod
    def load_into(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> LoadResult:
        """Read each key's payload into ``outs[i]`` (a writable buffer of the payload's length)
        and verify it. Where the status is not OK the buffer's bytes are unspecified and must
        not be used."""

    @abc.abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        """Whether a value is stored under each key (a hint: only a load verifies it)."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[BlockKey]) -> NDArray[np.bool_]:
        """Drop each key's value; True where it is gone afterwards (or was never there)."""

    @property
    def available(self) -> bool:
        """False while the store is failing: the last call found it not answering (or, for a
        disk, a write failed for the file system), so calls answer FAILED / False; True again
        after a call that worked. Tiers that do not track their store always say True."""
        return True

    @property
    def last_error(self) -> str | None:
        """What the call that made the tier unavailable saw (None while available)."""
        return None

    def close(self) -> None:  # noqa: B027 - tiers without resources need no close
        """Release connections and files; the stored values stay."""

    def __enter__(self) -> StoredTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
