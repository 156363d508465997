"""The values a lookup answers with: reasons, per-group detail, the restore plan, the verdict."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from kvfsm.spec import Event, GroupKind, Layout, Tier


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


class Level(enum.Enum):
    """How much verification a lookup does. Reduced levels skip only provably redundant work."""

    #: Every layer on every block, checksums recomputed over the device bytes.
    FULL = "full"
    #: Checksums only of blocks not already verified at their current epoch.
    STANDARD = "standard"
    #: As STANDARD, and the alignment layer is skipped where the pools guarantee it by
    #: construction (pool alignment a multiple of the profile's).
    FAST = "fast"


@attrs.frozen
class DeviceProfile:
    """What the hardware demands of a block the kernel reads."""

    name: str = "gpu"
    #: Every block's first byte must sit at a multiple of this.
    base_alignment: int = 256
    #: Every block's stride must be a multiple of this.
    size_alignment: int = 16


@attrs.frozen
class Shortfall:
    """One reason, where it applies: the group, the block index in the prompt and its id."""

    reason: Reason
    group: str
    block_index: int = -1
    block_id: int = -1
    detail: str = ""


@attrs.frozen
class RestoreStep:
    """Make one block usable: fire ``path`` (derived from the lifecycle table) on it."""

    group: str
    block_index: int
    block_id: int
    state: str
    tier: Tier | None
    path: tuple[Event, ...]


@attrs.frozen
class GroupVerdict:
    name: str
    kind: GroupKind
    block_size: int
    #: Contiguous hash hit of this group alone, in tokens.
    hit_tokens: int
    #: Largest candidate length this group alone can serve now / after restores.
    usable_tokens: int
    restorable_tokens: int
    #: Why this group stops where it does (None when it covers the whole candidate range).
    stop: Reason | None


@attrs.frozen
class Verdict:
    """The answer to "can this prefix be reused right now, after which restores, or not"."""

    prompt_tokens: int
    #: The classic prefix-hash hit (every group's hash chain present), what other engines report.
    hit_tokens: int
    #: Reusable right now: every group agrees, every layer passed.
    usable_tokens: int
    #: Reusable after executing ``plan``.
    restorable_tokens: int
    #: First token to compute when not waiting for restores (== usable_tokens).
    recompute_from: int
    level: Level
    groups: tuple[GroupVerdict, ...]
    reasons: tuple[Shortfall, ...]
    plan: tuple[RestoreStep, ...]

    def group(self, name: str) -> GroupVerdict:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)

    def reasons_of(self, reason: Reason) -> tuple[Shortfall, ...]:
        return tuple(s for s in self.reasons if s.reason is reason)

    @property
    def reason_set(self) -> frozenset[Reason]:
        return frozenset(s.reason for s in self.reasons)


KernelLayouts = Mapping[str, Layout]
