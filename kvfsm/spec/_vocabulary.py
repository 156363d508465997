"""The closed vocabulary a lifecycle spec may use: events, tiers, guards and effects.

Specs are data; this module is the dictionary they are checked against. Later layers bind each
guard and effect name to real code (slot pools, copies, checksums); a name not listed here is a
spec error, never a silent no-op.
"""

from __future__ import annotations

import enum
import re
from types import MappingProxyType
from typing import Final

#: What a lifecycle or state name must look like: it becomes a Mermaid/DOT node id, a docs
#: anchor and part of every problem line, so no punctuation, spaces or line breaks.
#: (``fullmatch``: with ``$`` a trailing newline would still match.)
NAME_PATTERN: Final = re.compile(r"[a-z_][a-z0-9_]*")


class GroupKind(enum.Enum):
    """What a cache group stores; a model group and the lifecycle it follows share one kind,
    and the kind decides which group keys and which lifecycle structure are required."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    COMPRESSED = "compressed"
    SPARSE_INDEX = "sparse_index"
    RECURRENT = "recurrent"


KIND_NAMES: Final = tuple(kind.value for kind in GroupKind)


class Event(enum.IntEnum):
    """Every event any cache-object kind can receive. Ids are stable: they index compiled tables."""

    ALLOCATE = 0
    WRITE_BEGIN = 1
    WRITE_DONE = 2
    WRITE_FAIL = 3
    COMPRESS_BEGIN = 4
    COMPRESS_DONE = 5
    COMPRESS_FAIL = 6
    EVICT = 7
    SPILL_BEGIN = 8
    SPILL_DONE = 9
    SPILL_FAIL = 10
    RESTORE_BEGIN = 11
    RESTORE_DONE = 12
    RESTORE_FAIL = 13
    FREE = 14
    INVALIDATE = 15
    #: A copy of the block's content was found in a stored tier by its key (another engine
    #: wrote it, or this one before a restart): the block is known there, not yet loaded.
    DISCOVER_DISK = 16
    DISCOVER_REMOTE = 17

    @property
    def spec_name(self) -> str:
        """The lower-case name used in spec files (``write_begin``)."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> Event:
        """Parse a spec-file event name; raises ``KeyError`` for an unknown one."""
        return cls[name.upper()]


EVENT_NAMES: Final = tuple(event.spec_name for event in Event)


class Tier(enum.IntEnum):
    """Where a copy of a block's content can live, fastest first.

    Device and host are *pooled*: a copy is a slot of a byte array. Disk and remote are
    *stored*: a copy is a value named by the block's identity (model, group, layout, chain
    hash), written and loaded by the data path between an event's begin and done, verified on
    every load; a block records only that it holds one.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3

    @property
    def spec_name(self) -> str:
        return self.name.lower()


TIER_NAMES: Final = tuple(tier.spec_name for tier in Tier)

#: Tiers whose copies live in slot pools the core owns.
POOLED_TIERS: Final = frozenset({Tier.DEVICE, Tier.HOST})
#: Tiers whose copies are values stored by key outside the core (``kvfsm.tiers``).
STORED_TIERS: Final = frozenset({Tier.DISK, Tier.REMOTE})
#: The event that adopts a copy found in each stored tier.
DISCOVER_EVENT: Final = MappingProxyType({Tier.DISK: Event.DISCOVER_DISK,
                                          Tier.REMOTE: Event.DISCOVER_REMOTE})

#: ``residency`` value of a state whose content lives nowhere.
NO_TIER: Final = "none"


class Content(enum.Enum):
    """How much of a block's content exists in its residency tier."""

    NONE = "none"
    PARTIAL = "partial"
    COMPLETE = "complete"


class Form(enum.Enum):
    """The representation of a block's content; a compressed block is never read as raw."""

    NONE = "none"
    RAW = "raw"
    COMPRESSED = "compressed"


#: Guards: named predicates a row needs before it may fire. ``:tier`` marks a tier argument.
GUARDS: Final = MappingProxyType(
    {
        "has_room": "the named tier has a free slot for every object in the batch; a stored "
                    "tier (disk, remote) has room when it is attached (arg: tier)",
        "no_pins": "no reader holds a pin on the object",
        "admission_open": "the restore admission gate has budget for this object",
        "all_sub_blocks_present": "every sub-block has been written (an unsplit block is one)",
        "checksum_ok": "the content read back matches the checksum recorded when it was written",
        "targets_current": "every block a sparse index points at is still at the indexed epoch",
    }
)

#: Guards that take a tier argument (``has_room:host``).
GUARDS_WITH_TIER: Final = frozenset({"has_room"})

#: Effects: the memory operations a row drives, run once per batch after all guards pass.
EFFECTS: Final = MappingProxyType(
    {
        "take_slot": "take a slot in the named tier; in a stored tier, record that the object "
                     "holds a copy there (arg: tier)",
        "return_slot": "return the object's slot in the named tier; in a stored tier, forget "
                       "its copy (the stored value may stay for others) (arg: tier)",
        "copy_to": "start copying the content from its residency tier to the named one: between "
                   "pools at once, to or from a stored tier by the data path before the row's "
                   "done (arg: tier)",
        "bump_epoch": "advance the object's epoch: its content or location changed",
        "record_checksum": "compute and record the checksum of the content just written",
        "publish_hash": "make the object reachable through the prefix hash map",
        "drop_hash": "remove the object from the prefix hash map",
        "invalidate_dependents": "invalidate every index block that points at this object",
        "clear_sub_blocks": "forget what was written: sub-block bitmap, index references",
    }
)

#: Effects that take a tier argument (``take_slot:device``).
EFFECTS_WITH_TIER: Final = frozenset({"take_slot", "return_slot", "copy_to"})
