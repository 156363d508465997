"""What every lookup of one group passes to its group pass unchanged, made once per group, reading
layout and device profile (:class:`Statics`, :func:`statics_for`), and the device-alignment facts
of its pool.

The group's metadata arrays are fixed buffers the core writes in place, and the per-layout and
per-state facts, the index's references and the parameters that never change are packed once,
so a lookup hands the pass one address table instead of sixteen arrays.
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

# Stand-ins for a group without an index (the pass reads none of them; read-only like the
# core's arrays, so the call compiles to the same version): its references and its target
# group's epochs, states and positions.
_NO_TARGETS = (np.full((1, 1), -1, dtype=np.int32), np.zeros((1, 1), dtype=np.uint32),
               np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=np.uint8),
               np.full(1, -1, dtype=np.int32))
for _stand_in in _NO_TARGETS:
    _stand_in.flags.writeable = False
#: The target states' "hashed" table of a group without an index (never read).
_NO_HASHED = np.ones(1, dtype=np.bool_)


class _Kept(NamedTuple):
    """What explaining an evaluation reads of its group and of the group's statics once the
    lookup is over (:meth:`~kvfsm.lookup._pass_output.PassOutput.detach`), under the names
    both have."""

    rule: KindRule
    name: str
    paths: RestorePaths


#: Statics kept per group: one per reading layout and device profile a caller uses.
_MAX_STATICS = 64


class Statics:
    """What every lookup of one group under one reading layout and device profile passes to
    the group pass unchanged: the group's metadata arrays (fixed buffers the core writes in
    place), the per-layout and per-state facts, the index's references and its target group's
    arrays, and the parameters that never change. Made once; :func:`statics_for` makes a new
    one when something it was made from is replaced (the table, a new recorded layout)."""

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
        #: Per layout id of the group: the reading kernel's layout accepts it.
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
        #: The group's kind settles in the compressed form (else raw).
        self.settled_compressed = group.rule.settled_form is Form.COMPRESSED
        consts = pack_consts(group.full_sub_mask, self.restore_aligned, *sizes,
                             self.settled_compressed, layout_ok, paths.code,
                             paths.restores_by_form, hashed, target_settled_compressed)
        #: What an evaluation keeps of the group and of these statics once its lookup is over
        #: (:meth:`~kvfsm.lookup._pass_output.PassOutput.detach`): the same for every
        #: evaluation made with them.
        self.kept = _Kept(group.rule, group.name, paths)
        table = self.table
        #: The pass's arguments after the prompt's words, up to the prompt's history: the hash
        #: table, the group's metadata, its index references and their targets, the consts.
        self.arrays = (table.slots, table.block_high, table.block_low, table.mapped,
                       group.states,
                       group.epoch, group.position, group.sub_blocks, group.layout_id,
                       group.check, *targets, consts)
        #: The same arrays as one address table (None where one is laid out otherwise),
        #: holding the arrays it addresses.
        self.fixed_table = pack_fixed(self.arrays)
        #: The table as a plain ndarray, as a compiled pass takes it (one argument instead of
        #: sixteen): numba matches an ndarray subclass's type in Python, some 0.7 us a call,
        #: a plain array's in C.
        self.fixed = None if self.fixed_table is None else self.fixed_table.view(np.ndarray)


#: A group's statics: by the ids of the reading layout and device profile (each entry holds
#: both, and is compared with them by identity), and under None the one used last.
StaticsCache = dict[tuple[int, int] | None, "Statics"]

#: Per group (weakly): its statics by the ids of the reading layout and device profile.
_STATICS: weakref.WeakKeyDictionary[GroupState, StaticsCache] = \
    weakref.WeakKeyDictionary()


def statics_for(group: GroupState, reads: Layout, profile: DeviceProfile,
                known_here: StaticsCache | None = None) -> Statics:
    """The group's :class:`Statics` for the layout ``reads`` and ``profile`` (cached in
    ``known_here``, the group's own cache when None). Identity checks only: made again when
    the group's table or its target's table is replaced (the restore paths follow from the
    table), or the group records a new layout."""
    if known_here is None:
        known_here = _STATICS.get(group)
        if known_here is None:
            known_here = _STATICS[group] = {}
    table, target = group.table, group.target
    target_table = None if target is None else target.table
    # The statics made or found last first (under None: a caller mostly reads with one layout
    # and profile, and this spares making and hashing the key); each is compared below by
    # identity with what it was made from, which it holds.
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
    """Every slot of ``pool`` meets ``profile``: its base and stride are multiples of the
    base alignment and its stride of the size alignment (layer 4 then has nothing to check)."""
    return data_ptr(pool.data) % profile.base_alignment == 0 and \
        pool.stride % profile.base_alignment == 0 and pool.stride % profile.size_alignment == 0


def alignment_guaranteed(pool: SlotPool, profile: DeviceProfile) -> bool:
    """The pool's construction already satisfies the profile for every slot."""
    return pool.alignment % profile.base_alignment == 0 and \
        pool.stride % profile.size_alignment == 0


def slots_aligned(pool: SlotPool, profile: DeviceProfile, slots: NDArray[np.int32],
             readable: Bools) -> Bools | None:
    """Layer 4 per prompt block: the device address and size of each readable block meet the
    profile (None: all do). address = base + slot * stride: when base and stride are both
    multiples of the required alignment every slot is aligned, exactly; else check each."""
    base = data_ptr(pool.data)
    sized = pool.stride % profile.size_alignment == 0
    if base % profile.base_alignment == 0 and pool.stride % profile.base_alignment == 0:
        return None if sized else ~readable
    address = np.int64(base) + pool.offsets(slots)
    ok = np.ones(readable.size, dtype=np.bool_)
    ok[readable] = (address % profile.base_alignment == 0) & sized
    return ok
