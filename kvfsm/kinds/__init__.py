"""The rule of each kind of cache object, one module per kind, chosen once through a registry.

A new kind is one module with a :class:`KindRule` subclass and one line in :data:`RULES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvfsm.kinds._compressed import CompressedRule
from kvfsm.kinds._full import FullRule
from kvfsm.kinds._recurrent import RecurrentRule
from kvfsm.kinds._rule import KindRule, Needed
from kvfsm.kinds._sliding_window import SlidingWindowRule
from kvfsm.kinds._sparse_index import SparseIndexRule
from kvfsm.spec import GroupDecl, GroupKind

#: The rule of every kind.
RULES: Mapping[GroupKind, KindRule] = MappingProxyType({
    rule.kind: rule for rule in (FullRule(), SlidingWindowRule(), CompressedRule(),
                                 SparseIndexRule(), RecurrentRule())
})


def rule_of(decl: GroupDecl) -> KindRule:
    """The rule of ``decl``'s kind."""
    return RULES[decl.kind]


__all__ = ["RULES", "KindRule", "Needed", "rule_of"]
