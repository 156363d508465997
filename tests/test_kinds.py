"""The per-kind rules: which blocks, in which form, a prefix of length L needs.

Each rule is checked against a tiny executable spec written per token (which tokens a layer of
that kind reads at L, and in which form), so the block-span fast path cannot drift from the
architecture it stands for.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.kinds import RULES, rule_of
from kvfsm.lookup._spans import Spans
from kvfsm.spec import Event, GroupDecl, GroupKind, Layout
from tests.kernel_twins import usable_at

LAYOUT = Layout(("block", "token", "dim"), 256, 0)


def _decl(kind: GroupKind, block: int, **extra: int | str) -> GroupDecl:
    return GroupDecl(name="g", kind=kind, lifecycle=kind.value, block_size=block,
                     shape=(block, 4), dtype="float16", layout=LAYOUT, **extra)  # type: ignore[arg-type]


def _oracle(decl: GroupDecl, length: int, n: int, ok_raw: np.ndarray, ok_cmp: np.ndarray
            ) -> bool:
    """Usable at ``length``, token by token: every token the layer reads at ``length`` lies in
    a complete block of the prompt that is ok in the form the layer reads it in."""
    size = decl.block_size
    if decl.kind is GroupKind.RECURRENT:
        interval = decl.checkpoint_interval or size
        if length % interval:
            return False
        # One snapshot: the state after exactly `length` tokens, kept by the block ending there.
        return length == 0 or (length // size <= n and bool(ok_raw[length // size - 1]))
    if decl.kind is GroupKind.SLIDING_WINDOW:
        window = decl.window or 1
        raw_tokens = range(max(length - (window - 1), 0), length)
        compressed_tokens: range = range(0)
    elif decl.kind is GroupKind.COMPRESSED:
        boundary = length // size * size
        compressed_tokens, raw_tokens = range(0, boundary), range(boundary, length)
    else:  # full attention, sparse index
        compressed_tokens, raw_tokens = range(0), range(0, length)
    for tokens, ok in ((raw_tokens, ok_raw), (compressed_tokens, ok_cmp)):
        for token in tokens:
            block = token // size
            if block >= n or not ok[block]:
                return False
    return True


KINDS = st.sampled_from([
    (GroupKind.FULL, {}),
    (GroupKind.SPARSE_INDEX, {"target_group": "h", "top_k": 2}),
    (GroupKind.SLIDING_WINDOW, {"window": 1}),
    (GroupKind.SLIDING_WINDOW, {"window": 5}),
    (GroupKind.SLIDING_WINDOW, {"window": 16}),
    (GroupKind.SLIDING_WINDOW, {"window": 17}),
    (GroupKind.SLIDING_WINDOW, {"window": 40}),
    (GroupKind.COMPRESSED, {"sub_blocks": 2}),
    (GroupKind.RECURRENT, {"checkpoint_interval": 8}),
    (GroupKind.RECURRENT, {"checkpoint_interval": 24}),
])


@given(kind=KINDS, block=st.sampled_from([4, 8]), step_blocks=st.integers(1, 3),
       data=st.data())
def test_block_spans_match_the_token_level_rule(kind: tuple[GroupKind, dict[str, int]],
                                                block: int, step_blocks: int,
                                                data: st.DataObject) -> None:
    """For every kind, block size, candidate step and per-block ok masks, "usable at L" from
    the rule's block spans equals the token-by-token spec of what the layer reads at L."""
    decl = _decl(kind[0], block, **kind[1])
    n = data.draw(st.integers(0, 12), label="blocks in the prompt")
    ok_raw = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    ok_cmp = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    step = block * step_blocks
    lengths = np.arange(0, (n + 2) * block + 1, step, dtype=np.int64)
    fast = usable_at(Spans(rule_of(decl).needed(decl, lengths), n), ok_raw, ok_cmp)
    spec = [_oracle(decl, int(length), n, ok_raw, ok_cmp) for length in lengths]
    assert fast.tolist() == spec


@pytest.mark.parametrize(("window", "start_token", "start_block"),
                         [(16, 33, 2), (17, 32, 2), (40, 9, 0), (33, 16, 1)])
def test_sliding_window_keeps_the_last_window_minus_one_tokens(window: int, start_token: int,
                                                               start_block: int) -> None:
    """At L=48 with blocks of 16, the window reads tokens [L-(W-1), L): W=16 (W = 0 mod B)
    starts at token 33 (block 2), W=17 (W = 1 mod B) at 32 (block 2), W=40 at 9 (block 0),
    W=33 at 16 (block 1)."""
    decl = _decl(GroupKind.SLIDING_WINDOW, 16, window=window)
    need = rule_of(decl).needed(decl, np.array([48]))
    assert 48 - (window - 1) == start_token
    assert int(need.lo[0]) == start_block
    assert int(need.hi[0]) == 3


def test_compressed_needs_nothing_raw_at_a_boundary() -> None:
    decl = _decl(GroupKind.COMPRESSED, 64, sub_blocks=4)
    need = rule_of(decl).needed(decl, np.array([0, 64, 256, 320]))
    assert need.lo.tolist() == [0, 0, 0, 0]
    assert need.cut.tolist() == need.hi.tolist() == [0, 1, 4, 5]  # all compressed, no raw


def test_compressed_raw_tail_is_the_block_after_the_boundary() -> None:
    decl = _decl(GroupKind.COMPRESSED, 64, sub_blocks=4)
    need = rule_of(decl).needed(decl, np.array([100]))
    assert (int(need.cut[0]), int(need.hi[0])) == (1, 2)


def test_recurrent_commits_only_checkpoints() -> None:
    decl = _decl(GroupKind.RECURRENT, 16, checkpoint_interval=64)
    assert rule_of(decl).commit_blocks(decl, 10).tolist() == [3, 7]


def test_every_kind_has_exactly_one_rule() -> None:
    assert set(RULES) == set(GroupKind)
    for kind, rule in RULES.items():
        assert rule.kind is kind


def test_only_compressed_settles_by_compressing() -> None:
    settling = {kind for kind, rule in RULES.items() if rule.settle_events}
    assert settling == {GroupKind.COMPRESSED}
    assert RULES[GroupKind.COMPRESSED].settle_events == (Event.COMPRESS_BEGIN,
                                                         Event.COMPRESS_DONE)


def test_a_sparse_index_row_holds_only_where_every_reference_does() -> None:
    """The sparse-index rule: a row holds where each reference names an alive target at the
    epoch it was indexed against, that target is the prompt's history block at its position
    and is complete before the row; an unused slot holds only with epoch 0; a reference outside
    the target group never holds. A row that fails is *stale* where some reference's target
    is dead, at another epoch or outside the group (or an unused slot carries an epoch), else
    a gap (its targets are not this prompt's, or not complete yet)."""
    from kvfsm.kinds._sparse_index import NO_TARGET, references_hold

    # History blocks of 64 tokens, index rows of 16: history block 0 is complete from row 3.
    history = np.array([5, 6], dtype=np.int64)  # the prompt's history blocks by position
    target_epoch = np.array([0, 0, 0, 0, 0, 2, 3], dtype=np.uint32)
    target_position = np.array([-1, -1, -1, -1, -1, 0, 1], dtype=np.int32)
    target_states = np.array([0, 0, 0, 0, 1, 1, 1], dtype=np.uint8)
    hashed = np.array([False, True])
    cases = {  # name: (targets, epochs, row, holds, stale)
        "current, complete": ([5, NO_TARGET], [2, 0], 3, True, False),
        "target not complete yet": ([5, NO_TARGET], [2, 0], 2, False, False),
        "stale epoch": ([5, NO_TARGET], [1, 0], 3, False, True),
        "unused slot with an epoch": ([5, NO_TARGET], [2, 7], 3, False, True),
        "another prompt's block": ([4, NO_TARGET], [0, 0], 3, False, False),
        "dead target": ([0, NO_TARGET], [0, 0], 3, False, True),
        "outside the group": ([99, NO_TARGET], [0, 0], 3, False, True),
        "second block, later row": ([5, 6], [2, 3], 7, True, False),
    }
    for name, (targets, epochs, row, holds, stale) in cases.items():
        got = references_hold(np.array([targets], dtype=np.int32),
                              np.array([epochs], dtype=np.uint32), np.array([row]),
                              target_epoch=target_epoch, target_states=target_states,
                              hashed=hashed, target_position=target_position,
                              history_ids=history, target_size=64, own_size=16)
        assert bool(got.fit[0]) is holds, name
        assert bool(got.stale[0]) is stale, name
