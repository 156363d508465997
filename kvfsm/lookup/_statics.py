"""What a group's lookups pass to its group pass unchanged (:class:`Statics`, one per reading layout
and device profile: the core writes its metadata arrays in place), and its pool's alignment."""
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

# A non-index group's refs and targets: never read; read-only like the core's, so no new compile.
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
    """One group's statics for a reading layout and device profile, made by :func:`statics_for`."""
    __slots__ = ("aligned", "fixed", "fixed_table", "kept", "made_from", "paths", "pool",
                 "restore_aligned")

    def __init__(self, group: GroupState, reads: Layout, profile: DeviceProfile,
                 made_from: tuple[Layout, DeviceProfile, CompiledTable, RestorePaths, int,
                                  CompiledTable | None]) -> None:
        self.made_from = made_from
        self.paths = paths = made_from[3]
        self.pool = pool = group.pools[Tier.DEVICE]
        #: Restored blocks land aligned for the profile / every device slot already meets it.
        self.restore_aligned = alignment_guaranteed(pool, profile)
        self.aligned = _aligned_by_construction(pool, profile)
        target = group.target
        targets: tuple[NDArray[Any], ...] = _NO_TARGETS
        hashed, sizes = _NO_HASHED, (1, 1)  # sizes of a non-index group
        if target is not None:
            sizes = (target.decl.block_size, group.decl.block_size)
            targets = (group.refs_target, group.refs_epoch, target.epoch, target.states,
                       target.position)
            hashed = target.table.hashed
        consts = pack_consts(
            group.full_sub_mask, self.restore_aligned, *sizes,
            group.rule.settled_form is Form.COMPRESSED,
            np.array([layout == reads for layout in group.layouts], dtype=np.bool_), paths.code,
            paths.restores_by_form, hashed,
            target is not None and target.rule.settled_form is Form.COMPRESSED)
        self.kept = _Kept(group.rule, group.name, paths)
        table = group.hash_map
        #: The pass's fixed arguments as one address table, and as the plain ndarray the pass takes.
        self.fixed_table = pack_fixed((
            table.slots, table.block_high, table.block_low, table.mapped, group.states,
            group.epoch, group.position, group.sub_blocks, group.layout_id, group.check,
            *targets, consts))
        self.fixed = self.fixed_table.view(np.ndarray)


#: A group's statics by the ids of the reading layout and profile (each entry holds both).
StaticsCache = dict[tuple[int, int], "Statics"]
_STATICS: weakref.WeakKeyDictionary[GroupState, StaticsCache] = weakref.WeakKeyDictionary()


def statics_for(group: GroupState, reads: Layout, profile: DeviceProfile,
                known_here: StaticsCache | None = None) -> Statics:
    """The group's :class:`Statics` for ``reads`` and ``profile``, cached in ``known_here`` (None:
    the group's own); made anew when its or its target's table is replaced or it adds a layout."""
    if known_here is None:
        known_here = _STATICS.setdefault(group, {})
    table, target = group.table, group.target
    target_table = None if target is None else target.table
    key = (id(reads), id(profile))
    known = known_here.get(key)
    if known is not None:
        was = known.made_from  # restore paths not compared: they follow from the table alone
        if was[0] is reads and was[1] is profile and was[2] is table \
                and was[4] == len(group.layouts) and was[5] is target_table:
            return known
    if len(known_here) >= _MAX_STATICS:
        known_here.clear()
    known = known_here[key] = Statics(group, reads, profile, (
        reads, profile, table, restore_paths(table), len(group.layouts), target_table))
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
                  readable: Bools) -> Bools:
    """Layer 4 per prompt block: each readable block's device address and size meet the
    profile (checked where the pool's construction does not promise it)."""
    address = np.int64(data_ptr(pool.data)) + pool.offsets(slots)
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[readable] = (address % profile.base_alignment == 0) & \
        (pool.stride % profile.size_alignment == 0)
    return ok
