"""Stored tiers: where block copies live beyond host memory, by key, verified on every load.

``DiskTier`` keeps one crash-safe file per block under a directory; ``MooncakeTier`` and
``RedisTier`` keep values in a shared store that several engines read. All keep the
``StoredTier`` contract and write the same header (``encode_header``) before each payload.
Building a remote tier checks that its store answers (:class:`TierConnectError` if not); every
tier reports whether its store works (``available``, ``last_error``; changes logged on the
``kvfsm.tiers`` logger).
"""

from kvfsm.tiers._contract import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    BlockKey,
    Header,
    LoadResult,
    LoadStatus,
    StoredTier,
    TierConnectError,
    TierError,
    block_keys,
    decode_header,
    encode_header,
    group_hash,
    layout_hash,
    model_digest,
    verify,
)
from kvfsm.tiers._disk import DiskTier

# The remote backends import their client libraries (mooncake, redis) only when a tier is built,
# so these imports work without them; a missing one is a TierError naming how to install it.
from kvfsm.tiers._mooncake import MooncakeTier
from kvfsm.tiers._redis import RedisTier
from kvfsm.tiers._servers import MooncakeMaster, RedisServer

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "BlockKey",
    "DiskTier",
    "Header",
    "LoadResult",
    "LoadStatus",
    "MooncakeMaster",
    "MooncakeTier",
    "RedisServer",
    "RedisTier",
    "StoredTier",
    "TierConnectError",
    "TierError",
    "block_keys",
    "decode_header",
    "encode_header",
    "group_hash",
    "layout_hash",
    "model_digest",
    "verify",
]
