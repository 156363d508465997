"""Why tokens of a prompt are not reusable: the reasons a verdict gives, with stable values."""

from __future__ import annotations

import enum
from typing import Final

#: At most this many block-level shortfalls a verdict lists per group and reason (a miss of
#: thousands of blocks names its first few).
MAX_LISTED: Final = 16


class Reason(enum.Enum):
    """Why some tokens of a prompt are not reusable right now. Values are stable strings."""

    #: The block is not in the prefix hash map (never computed, or evicted).
    NOT_CACHED = "not_cached"
    #: A history block needed in compressed form is still raw (compression not started).
    COMPRESSED_INCOMPLETE = "compressed_incomplete"
    #: A history block needed in compressed form is being compressed right now.
    MID_COMPRESSION = "mid_compression"
    #: The uncompressed tail is missing: a block the kernel must read raw is compressed.
    TAIL_MISSING = "tail_missing"
    #: A block inside the sliding window ``[L-W+1, L)`` is missing.
    WINDOW_MISMATCH = "window_mismatch"
    #: A sparse-index block points at a target whose epoch changed (freed, reused, moved).
    INDEX_STALE = "index_stale"
    #: The content lives in host, disk or remote memory: restore it first.
    NOT_RESIDENT = "not_resident"
    #: A restore of the block is running; wait for it.
    RESTORE_IN_FLIGHT = "restore_in_flight"
    #: The block was written under another layout than the reading kernel declares.
    LAYOUT_MISMATCH = "layout_mismatch"
    #: The block's address or size breaks the device profile's alignment.
    MISALIGNED = "misaligned"
    #: Groups do not fit together: an index points outside this prompt's history.
    GROUP_GAP = "group_gap"
    #: The block found by hash sits at another position than the prompt needs.
    POSITION_CONFLICT = "position_conflict"
    #: The bytes on the device no longer match the recorded checksum.
    CHECKSUM_MISMATCH = "checksum_mismatch"
    #: Not every sub-block of the block was written.
    SUB_BLOCKS_MISSING = "sub_blocks_missing"
    #: A recurrent group has no snapshot at exactly this length.
    NO_CHECKPOINT = "no_checkpoint"
    #: Hit lengths of groups with different block sizes meet only at multiples of their LCM.
    BLOCK_BOUNDARY = "block_boundary"
    #: The last prompt token is always computed (its logits start generation).
    PROMPT_END = "prompt_end"
    #: Speculative decoding asked to recompute the last reusable block.
    SPEC_DECODE_DROP = "spec_decode_drop"
    #: The usable prefix or restore plan does not fit the active captured graph's signature
    #: (block count, tier, layout, dtype, page size, alignment): run eagerly, or re-plan.
    GRAPH_MISMATCH = "graph_mismatch"
    #: The block's only copy lives in a stored tier that is not answering (its calls failed
    #: or ran out of time; it is backing off): restores from it are skipped and the block is
    #: recomputed until the tier answers again.
    TIER_UNAVAILABLE = "tier_unavailable"
