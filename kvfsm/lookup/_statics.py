"""What every lookup of one group passes to its group pass unchanged (:class:`Statics`, made
once per reading layout and device profile: the metadata arrays are fixed buffers the core
writes in place), and the device-alignment facts of its pool.
"""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from kvfsm.fsm import CompiledTable
from kvfsm.kinds import KindRule
from kvfsm.lookup._buffers import pack_consts
from kvfsm.lookup._group_pass import pack_fixed
from kvfsm.lookup._paths import RestorePaths, restore_paths
from kvfsm.lookup._types import DeviceProfile
from kvfsm.memory import SlotPool
from kvfsm.memory._backend import data_ptr
from kvfsm.spec import Form, Layout, Tier
from kvfsm.state import GroupState

Bools = NDArray[np.bool_]

# A non-index group's references and target arrays (never read; read-only like the core's
# arrays, so the call compiles to the same version).
_NO_TARGETS = (np.full((1, 1), -1, dtype=np.int32), np.zeros((1, 1), dtype=np.uint32),
               np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint8),
               np.full(1, -1, dtype=np.int32))
for _stand_in in _NO_TARGETS:
    _stand_in.flags.writeable = False
_NO_HASHED = np.ones(1, dtype=np.bool_)


class _Kept(NamedTuple):
    """What explaining reads of a group and its statics after
    :meth:`~kvfsm.lookup._pass_output.PassOutput.detach`, under the names both have."""

    rule: KindRule
    name: str
    paths: RestorePaths


#: Statics kept per group: one per reading layout and device profile a caller uses.
_MAX_STATICS = 64


class Statics:
    """What every lookup of one group under one reading layout and device profile passes to
    the group pass unchanged. :func:`statics_for` makes a new one when something it was made
    from is replaced (the table, a new recorded layout)."""

    __slots__ = ("aligned", "arrays", "entry", "fixed", "fixed_table", "kept", "layout_ok",
                 "made_from", "paths", "pool", "restore_aligned", "settled_compressed", "table")

    paths: RestorePaths

    def __init__(self, group: GroupState, reads: Layout, profile: DeviceProfile,
                 made_from: tuple[Layout, DeviceProfile, CompiledTable, RestorePaths, int,
                                  CompiledTable | None]) -> None:
        self.made_from = made_from
        self.table = group.hash_map
        self.paths = paths = made_from[3]
        self.pool = pool = group.pools[Tier.DEVICE]
        self.layout_ok = layout_ok = np.array([layout == reads for layout in group.layouts],
                                              dtype=np.bool_)
        layout_ok.setflags(write=False)
        #: Restored blocks land aligned for the profile / every device slot already meets it.
        self.restore_aligned = alignment_guaranteed(pool, profile)
        self.aligned = _aligned_by_construction(pool, profile)
        target = group.target
        targets: tuple[NDArray[Any], ...] = _NO_TARGETS
        hashed, sizes = _NO_HASHED, (1, 1)  # sizes of a non-index group
        target_settled_compressed = False
        if target is not None:
            sizes = (target.decl.block_size, group.decl.block_size)
            targets = (group.refs_target, group.refs_epoch, target.epoch, target.states,
                       target.position)
            hashed = target.table.hashed
            target_settled_compressed = target.rule.settled_form is Form.COMPRESSED
        self.settled_compressed = group.rule.settled_form is Form.COMPRESSED
        consts = pack_consts(group.full_sub_mask, self.restore_aligned, *sizes,
                             self.settled_compressed, layout_ok, paths.code,
                             paths.restores_by_form, hashed, target_settled_compressed)
        self.kept = _Kept(group.rule, group.name, paths)
        table = self.table
        #: The pass's arguments from ``slots`` to ``consts``.
        self.arrays = (table.slots, table.block_high, table.block_low, table.mapped,
                       group.states,
                       group.epoch, group.position, group.sub_blocks, group.layout_id,
                       group.check, *targets, consts)
        #: The same arrays as one address table holding them (None: some laid out otherwise).
        self.fixed_table = pack_fixed(self.arrays)
        #: The table as a plain ndarray, as the compiled pass takes it.
        self.fixed = None if self.fixed_table is None else self.fixed_table.view(np.ndarray)


#: A group's statics by the ids of the reading layout and profile (each entry holds both and
#: is compared with them by identity), and under None the one used last.
StaticsCache = dict[tuple[int, int] | None, "Statics"]

_STATICS: weakref.WeakKeyDictionary[GroupState, StaticsCache] = \
    weakref.WeakKeyDictionary()


def statics_for(group: GroupState, reads: Layout, profile: DeviceProfile,
                known_here: StaticsCache | None = None) -> Statics:
    """The group's :class:`Statics` for ``reads`` and ``profile`` (cached in ``known_here``,
    the group's own cache when None). Made again when the group's or its target's table is
    replaced, or the group records a new layout."""
    if known_here is None:
        known_here = _STATICS.get(group)
        if known_here is None:
            known_here = _STATICS[group] = {}
    table, target = group.table, group.target
    target_table = None if target is None else target.table
    # The statics used last first; each is compared by identity with what it was made from.
    known = known_here.get(None)
    if known is None or known.made_from[0] is not reads or known.made_from[1] is not profile:
        key = (id(reads), id(profile))
        known = known_here.get(key)
    else:
        key = None
    if known is not None:
        # The restore paths are not compared: they follow from the table alone.
        was = known.made_from
        if was[0] is reads and was[1] is profile and was[2] is table \
                and was[4] == len(group.layouts) and was[5] is target_table:
            if key is not None:
                known_here[None] = known
            return known
    if key is None:
        key = (id(reads), id(profile))
    paths = restore_paths(table)
    if len(known_here) >= _MAX_STATICS:
        known_here.clear()
    known = known_here[key] = known_here[None] = Statics(
        group, reads, profile, (reads, profile, table, paths, len(group.layouts), target_table))
    return known


def _aligned_by_construction(pool: SlotPool, profile: DeviceProfile) -> bool:
    """Every slot of ``pool`` meets ``profile`` (layer 4 then has nothing to check)."""
    return data_ptr(pool.data) % profile.base_alignment == 0 and \
        pool.stride % profile.base_alignment == 0 and pool.stride % profile.size_alignment == 0


def alignment_guaranteed(pool: SlotPool, profile: DeviceProfile) -> bool:
    """The pool's construction already satisfies the profile for every slot."""
    return pool.alignment % profile.base_alignment == 0 and \
        pool.stride % profile.size_alignment == 0


def slots_aligned(pool: SlotPool, profile: DeviceProfile, slots: NDArray[np.int32],
             readable: Bools) -> Bools | None:
    """Layer 4 per prompt block: each readable block's device address and size meet the
    profile (None: all do)."""
    base = data_ptr(pool.data)
    sized = pool.stride % profile.size_alignment == 0
    if base % profile.base_alignment == 0 and pool.stride % profile.base_alignment == 0:
        return None if sized else ~readable
    address = np.int64(base) + pool.offsets(slots)
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[readable] = (address % profile.base_alignment == 0) & sized
    return ok
