"""The lookup's usable length against a brute-force reader, on any state the API can reach.

The oracle knows nothing of spans, packed facts or passes. For every candidate length ``L`` it
lists, token by token, what each layer reads at ``L`` and in which form (the kind's rule, as
the architecture states it), finds each block the way a reader would (by the prompt's hash
key), and checks it as a reader must before trusting it: recorded at this position, every
sub-block written, written under the layout the kernel reads, readable now in that form, its
bytes matching their checksum and never seen failing one, its device address meeting the
device profile, and (an index block) every reference pointing at a live history block of this
prompt, at the epoch it was indexed against, complete before the index block ends. The verdict
must call usable exactly the longest length where every group's blocks pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvfsm import Engine, KvfsmError
from kvfsm.fsm import FORM_CODE, INVALID
from kvfsm.lookup import Level, Verdict
from kvfsm.lookup._paths import restore_paths
from kvfsm.memory._backend import data_ptr
from kvfsm.spec import Event, Form, GroupKind, ModelDecl, Tier
from kvfsm.state import FAILED, NO_TARGET, VERIFIED, GroupState, Prompt
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    FOUR,
    GPT_OSS,
    HISTORY_SWA,
    PLAN_OPS,
    PROMPTS,
    QWEN,
    SWA_ONLY,
    TWO_SIZES,
    drive,
    engine,
)

#: Every test runs on the compiled lookup and on the NumPy reference pass.
pytestmark = pytest.mark.usefixtures("jit_backend")

MODELS = [DENSE, SWA_ONLY, GPT_OSS, TWO_SIZES, QWEN, DEEPSEEK, HISTORY_SWA, FOUR]
#: One token's read: (block index of the prompt, the form the layer reads it in).
Read = tuple[int, Form]


def reads_at(group: GroupState, length: int) -> set[Read] | None:
    """The blocks (and forms) a layer of ``group``'s kind reads to continue after ``length``
    tokens, token by token; None where the kind cannot serve ``length`` at all."""
    decl = group.decl
    size = decl.block_size
    kind = decl.kind
    if kind is GroupKind.RECURRENT:
        interval = decl.checkpoint_interval or size
        if length % interval:
            return None  # state exists only after a checkpoint's tokens
        # The one snapshot: the state after exactly ``length`` tokens, in the block ending there.
        return set() if length == 0 else {(length // size - 1, Form.RAW)}
    if kind is GroupKind.SLIDING_WINDOW:
        window = decl.window or 1
        return {(token // size, Form.RAW) for token in range(max(length - (window - 1), 0),
                                                              length)}
    if kind is GroupKind.COMPRESSED:
        boundary = length // size * size
        return {(token // size, Form.COMPRESSED) for token in range(boundary)} | \
            {(token // size, Form.RAW) for token in range(boundary, length)}
    return {(token // size, Form.RAW) for token in range(length)}  # full, sparse index


def block_of(group: GroupState, prompt: Prompt, index: int) -> int:
    """The id the prompt's key of block ``index`` finds in ``group``; -1 when none (or the
    prompt has no such complete block)."""
    high, low = prompt.words(group.decl.block_size)
    if index >= high.size:
        return -1
    return int(group.hash_map.lookup(high[index : index + 1], low[index : index + 1])[0])


def references_hold(eng: Engine, group: GroupState, prompt: Prompt, row: int, block: int
                    ) -> bool:
    """Every reference of index block ``block`` (prompt row ``row``) points at a live block of
    the target group that is this prompt's block at its recorded position, at the epoch
    recorded with the reference, and ends no later than the row; an unused reference must
    carry epoch 0."""
    target_group = group.target
    assert target_group is not None
    for target, epoch in zip(group.refs_target[block].tolist(),
                             group.refs_epoch[block].tolist(), strict=True):
        if target == NO_TARGET:
            if epoch != 0:
                return False
            continue
        if not 0 <= target < target_group.n_blocks:
            return False
        if not target_group.table.hashed[int(target_group.states[target])]:
            return False
        if int(target_group.epoch[target]) != epoch:
            return False
        at = int(target_group.position[target])
        if at < 0 or block_of(target_group, prompt, at) != target:
            return False
        if (at + 1) * target_group.decl.block_size > (row + 1) * group.decl.block_size:
            return False
    return True


def recorded_as_read(group: GroupState, index: int, block: int) -> bool:
    """Block ``block`` was recorded at prompt position ``index``, with every sub-block
    written, under the layout the kernel reads."""
    return (int(group.position[block]) == index
            and int(group.sub_blocks[block]) == (1 << (group.decl.sub_blocks or 1)) - 1
            and group.layouts[int(group.layout_id[block])] == group.decl.layout)


def device_copy_passes(eng: Engine, group: GroupState, block: int,
                       level: Level = Level.FULL) -> bool:
    """The device bytes of readable block ``block`` pass their checks: never seen failing; at
    FULL their checksum recomputed (a reduced level trusts one verified at its epoch); the
    slot's address and size meeting the device profile."""
    if int(group.check[block]) == FAILED:
        return False
    pool = group.pools[Tier.DEVICE]
    slot = int(group.slot[Tier.DEVICE][block])
    trusted = level is not Level.FULL and int(group.check[block]) == VERIFIED
    if not trusted and not bool(pool.verify_checksum(np.array([slot]))[0]):
        return False
    profile = eng.profile
    address = data_ptr(pool.data) + int(pool.offsets(np.array([slot]))[0])
    return not (address % profile.base_alignment or pool.stride % profile.size_alignment)


def block_passes(eng: Engine, group: GroupState, prompt: Prompt, index: int, form: Form,
                 level: Level = Level.FULL) -> bool:
    """A reader may trust prompt block ``index`` of ``group`` in ``form`` now: at FULL its
    bytes are checksummed; a reduced level trusts a block verified at its epoch before."""
    block = block_of(group, prompt, index)
    if block < 0:
        return False
    state = int(group.states[block])
    table = group.table
    if not table.readable[state] or int(table.form[state]) != FORM_CODE[form]:
        return False
    if not recorded_as_read(group, index, block):
        return False
    if not device_copy_passes(eng, group, block, level):
        return False
    return group.target is None or references_hold(eng, group, prompt, index, block)


def usable_by_hand(eng: Engine, text: NDArray[np.int64], below: int | None = None,
                   level: Level = Level.FULL) -> int:
    """The longest candidate length (a multiple of the block sizes' LCM, short of the last
    token, which is always computed; and of ``below`` where given) at which every group's
    reads pass at ``level``."""
    prompt = eng.prompt(text)
    return longest(eng, text, lambda group, index, form: block_passes(
        eng, group, prompt, index, form, level), below)


def reaches(group: GroupState, state: int, form: Form) -> bool:
    """Some sequence of the lifecycle table's events takes ``state`` to a state readable in
    ``form`` through states whose content is complete (a path through ``free`` recomputes, it
    does not restore): a breadth-first walk of the table."""
    table = group.table
    wanted = {int(s) for s in np.flatnonzero(table.readable & (table.form == FORM_CODE[form]))}
    if state in wanted:
        return True
    if not table.complete[state]:
        return False
    seen, frontier = {state}, [state]
    while frontier:
        following = []
        for at in frontier:
            for nxt in table.next_state[at].tolist():
                if nxt == INVALID or nxt in seen or not table.complete[nxt]:
                    continue
                if nxt in wanted:
                    return True
                seen.add(nxt)
                following.append(nxt)
        frontier = following
    return False


def targets_settled(eng: Engine, group: GroupState, prompt: Prompt, block: int) -> bool:
    """Every reference of index block ``block`` points at a block of this prompt's history
    that a reader trusts now in the form its kind settles in (a plan that moved one would
    bump its epoch, and the reference would no longer hold); True for other kinds."""
    target_group = group.target
    if target_group is None:
        return True
    settled = Form.COMPRESSED if target_group.decl.kind is GroupKind.COMPRESSED else Form.RAW
    for target in group.refs_target[block].tolist():
        if target == NO_TARGET:
            continue
        if not 0 <= target < target_group.n_blocks:
            return False
        at = int(target_group.position[target])
        if at < 0 or block_of(target_group, prompt, at) != target:
            return False
        if not block_passes(eng, target_group, prompt, at, settled):
            return False
    return True


def after_plan(eng: Engine, group: GroupState, prompt: Prompt, index: int, form: Form
               ) -> tuple[bool, bool]:
    """Whether a reader could trust prompt block ``index`` of ``group`` in ``form`` once the
    restores and compressions the table allows have run, and whether getting there begins a
    restore (what the admission budget counts). A block passing now stays trusted; any other
    needs: found by key, recorded as read, its references holding and their targets settled,
    no bytes of its own it holds readable that fail a check (moving them moves the fault), the
    device slots it would land in meeting the profile by construction, and a path of the
    table to a readable state of ``form``."""
    block = block_of(group, prompt, index)
    if block < 0:
        return False, False
    settled = targets_settled(eng, group, prompt, block)
    if block_passes(eng, group, prompt, index, form):
        return settled, False
    state = int(group.states[block])
    table = group.table
    if not recorded_as_read(group, index, block) or not settled:
        return False, False
    if group.target is not None and not references_hold(eng, group, prompt, index, block):
        return False, False
    if table.readable[state] and not device_copy_passes(eng, group, block):
        return False, False
    pool, profile = group.pools[Tier.DEVICE], eng.profile
    if pool.alignment % profile.base_alignment or pool.stride % profile.size_alignment:
        return False, False  # a restored block's slot is not known to meet the profile
    if not reaches(group, state, form):
        return False, False
    return True, bool(restore_paths(table).restores[form][state])


def restorable_after_plan(eng: Engine, text: NDArray[np.int64], length: int) -> bool:
    """At ``length`` every group's reads are trusted once the plan has run, and the restores
    each group's plan begins there fit its admission budget."""
    prompt = eng.prompt(text)
    for group in eng.core.groups.values():
        reads = reads_at(group, length)
        if reads is None:
            return False
        restores = 0
        for index, form in sorted(reads):
            trusted, restores_it = after_plan(eng, group, prompt, index, form)
            if not trusted:
                return False
            restores += restores_it
        if restores > group.restore_budget():
            return False
    return True


def hit_by_hand(eng: Engine, text: NDArray[np.int64]) -> int:
    """The classic prefix-hash hit: the longest candidate length at which every block each
    group reads is found by the prompt's key, whatever its state."""
    prompt = eng.prompt(text)
    return longest(eng, text, lambda group, index, _: block_of(group, prompt, index) >= 0)


def longest(eng: Engine, text: NDArray[np.int64],
            passes: Callable[[GroupState, int, Form], bool], below: int | None = None) -> int:
    """The longest candidate length (below ``below`` where given) at which ``passes`` holds
    for every read of every group (0 when none)."""
    last = text.size - 1 if text.size > 1 else 0
    if below is not None:
        last = min(last, below - 1)
    step = eng.core.model.lcm_block_size
    best = 0
    for length in range(0, last + 1, step):
        holds = True
        for group in eng.core.groups.values():
            reads = reads_at(group, length)
            if reads is None or not all(passes(group, index, form)
                                        for index, form in sorted(reads)):
                holds = False
                break
        if holds:
            best = length
    return best


def restorable_by_hand(eng: Engine, text: NDArray[np.int64], below: int | None = None) -> int:
    """The longest candidate length (short of the last token, and of ``below`` where given)
    that the plan can make trusted (:func:`restorable_after_plan`); 0 when none."""
    last = text.size - 1 if text.size > 1 else 0
    if below is not None:
        last = min(last, below - 1)
    step = eng.core.model.lcm_block_size
    return max((length for length in range(0, last + 1, step)
                if restorable_after_plan(eng, text, length)), default=0)


def assert_reasons_fit(eng: Engine, text: NDArray[np.int64], verdict: Verdict) -> None:
    """At the hit and at the whole prompt (where longer than the usable length), every
    block a shortfall names is one the reader rejects there, with its id, and every group
    the reader finds failing there is named by some shortfall."""
    prompt = eng.prompt(text)
    step = eng.core.model.lcm_block_size
    final = (text.size - 1 if text.size > 1 else 0) // step * step
    named_blocks = {(s.group, s.block_index, s.block_id) for s in verdict.reasons
                    if s.block_index >= 0}
    named_groups = {s.group for s in verdict.reasons}
    rejected: set[tuple[str, int, int]] = set()
    for length in {verdict.hit_tokens, final}:
        if length <= verdict.usable_tokens:
            continue
        for name, group in eng.core.groups.items():
            reads = reads_at(group, length)
            failing = set() if reads is None else {
                index for index, form in reads
                if not block_passes(eng, group, prompt, index, form)}
            if reads is None or failing:
                assert name in named_groups, (name, length, verdict.reasons)
            rejected |= {(name, index, block_of(group, prompt, index)) for index in failing}
    assert named_blocks <= rejected, (named_blocks - rejected, verdict.reasons)


def reachable_state(data: st.DataObject, decl: ModelDecl) -> tuple[Engine, NDArray[np.int64]]:
    """An engine of ``decl`` in a state its API can reach, and a prompt to look up: mostly
    the prompt cached whole or in part first, then random steps that take it apart (commits,
    lifecycle events, blocks moved to host, host copies and device bytes corrupted, stricter
    device profiles, index references scrambled)."""
    eng = engine(decl, device=data.draw(st.sampled_from([16, 64, 64]), label="device blocks"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    text = text[: data.draw(st.integers(1, text.size), label="cut")]
    if data.draw(st.booleans(), label="committed first"):
        with contextlib.suppress(KvfsmError):
            eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
    default_profile = eng.profile
    drive(eng, data, data.draw(st.integers(0, 10), label="steps"), ops=PLAN_OPS)
    if data.draw(st.booleans(), label="default profile"):
        eng.profile = default_profile  # a stricter one drawn makes most blocks misaligned
    return eng, text


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS))
def test_full_lookup_calls_usable_exactly_what_a_brute_force_reader_trusts(
        data: st.DataObject, decl: ModelDecl) -> None:
    """For any state the core's API can reach (random commits and lifecycle events, host
    copies and device bytes corrupted, stricter device profiles, index references
    scrambled), a FULL lookup's ``usable_tokens`` is the longest length at which a reader
    checking every block it reads, token by token, would trust all of them: never more (a
    wrong answer), never less (a needless recompute). Its ``hit_tokens`` is the longest
    length whose every read is found by key; with the last block dropped (speculative
    decoding) the usable length is the longest one before; and a lease on the verdict pins
    exactly the blocks that reader reads at the usable length."""
    eng, text = reachable_state(data, decl)
    expected = usable_by_hand(eng, text)  # before the lookup records its checksums
    # Speculative decoding recomputes the last reusable block: the longest length before.
    dropped = usable_by_hand(eng, text, below=expected) if expected else 0
    verdict = eng.lookup(eng.prompt(text), level=Level.FULL)
    assert verdict.usable_tokens == expected, (verdict.reasons, expected)
    assert verdict.hit_tokens == hit_by_hand(eng, text)
    # Its reasons accuse only blocks the reader rejects, and name every group that fails.
    assert_reasons_fit(eng, text, verdict)
    # Recorded checks change nothing: the next FULL lookup agrees again.
    prompt = eng.prompt(text)
    again = eng.lookup(prompt, level=Level.FULL)
    assert again.usable_tokens == expected
    assert eng.lookup(prompt, level=Level.FULL, drop_last_block=True).usable_tokens == dropped
    # A lease on it holds exactly the blocks the reader reads there, in prompt order.
    with eng.lease(again, prompt) as lease:
        for name, group in eng.core.groups.items():
            reads = reads_at(group, expected)
            assert reads is not None
            indices = sorted({index for index, _ in reads})
            assert lease.indices(name).tolist() == indices, name
            assert lease.blocks(name).tolist() == [block_of(group, prompt, index)
                                                   for index in indices], name
        lease.validate()


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS))
def test_restorable_tokens_is_the_longest_length_a_plan_can_make_trusted(
        data: st.DataObject, decl: ModelDecl) -> None:
    """For any state the core's API can reach, a FULL lookup's ``restorable_tokens`` is the
    longest length at which every block each group reads is trusted by the brute-force reader
    now or once the lifecycle table's restore and compression paths have run (found by key,
    recorded as read, its references current and their targets settled, no failing bytes of
    its own, landing in slots that meet the device profile), each group's restores there
    within its admission budget; never below ``usable_tokens``. Never more (a plan promising
    what restores cannot give), never less (a recompute a restore would have saved). With the
    last block dropped, the longest such length before it."""
    eng, text = reachable_state(data, decl)
    # Before the lookup records its checksums.
    usable = usable_by_hand(eng, text)
    after = restorable_by_hand(eng, text)
    dropped_usable = usable_by_hand(eng, text, below=usable) if usable else 0
    dropped_after = restorable_by_hand(eng, text, below=after) if after else 0
    event("a plan reaches further" if after > usable else "nothing to restore")
    prompt = eng.prompt(text)
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert verdict.usable_tokens == usable
    assert verdict.restorable_tokens == max(after, usable), (verdict.plan, verdict.reasons)
    dropped = eng.lookup(prompt, level=Level.FULL, drop_last_block=True)
    assert dropped.restorable_tokens == max(dropped_after, dropped_usable)


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS),
       level=st.sampled_from([Level.STANDARD, Level.FAST]))
def test_reduced_levels_call_usable_what_the_reader_trusts_with_earlier_checks(
        data: st.DataObject, decl: ModelDecl, level: Level) -> None:
    """STANDARD and FAST checksum only blocks not verified at their epoch and trust the rest
    (FAST also skips alignment only where the pools guarantee it, so it loses nothing there):
    on any reachable state, their usable length is the reader's with that one difference.
    It is never less than FULL's, which checksums every block (more only where device bytes
    changed in place after their verification: what only FULL catches)."""
    eng, text = reachable_state(data, decl)
    expected = usable_by_hand(eng, text, level=level)
    assert eng.lookup(eng.prompt(text), level=level).usable_tokens == expected
    assert expected >= usable_by_hand(eng, text)


def test_the_oracle_sees_what_a_fault_takes_away() -> None:
    """The oracle is not vacuous: a committed prompt is trusted to its end, and one evicted
    history block or one flipped device byte takes its reach back to before that block."""
    eng = engine(DEEPSEEK)
    text = PROMPTS[0]
    eng.commit(eng.prompt(text))
    whole = usable_by_hand(eng, text)
    assert whole == (text.size - 1) // 64 * 64
    history = eng.core.group("history")
    block = block_of(history, eng.prompt(text), 2)
    slot = int(history.slot[Tier.DEVICE][block])
    history.pools[Tier.DEVICE].data[slot, 0] ^= 0x01
    assert usable_by_hand(eng, text) == 2 * 64
    assert eng.lookup(eng.prompt(text), level=Level.FULL).usable_tokens == 2 * 64


def test_the_plan_oracle_sees_what_a_restore_can_and_cannot_give_back() -> None:
    """The plan's oracle is not vacuous: a block spilled to host is restorable though not
    usable, so the reach after the plan is the whole prompt; a block evicted outright is
    neither, and takes both reaches back to before it."""
    eng = engine(DENSE)
    text = PROMPTS[0]
    prompt = eng.prompt(text)
    eng.commit(prompt)
    whole = (text.size - 1) // 16 * 16
    spilled = block_of(eng.core.group("attn"), prompt, 3)
    eng.core.fire("attn", [spilled], Event.SPILL_BEGIN)
    eng.core.fire("attn", [spilled], Event.SPILL_DONE)
    assert (usable_by_hand(eng, text), restorable_by_hand(eng, text)) == (3 * 16, whole)
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (3 * 16, whole)
    evicted = block_of(eng.core.group("attn"), prompt, 5)
    eng.core.fire("attn", [evicted], Event.EVICT)
    assert (usable_by_hand(eng, text), restorable_by_hand(eng, text)) == (3 * 16, 5 * 16)
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (3 * 16, 5 * 16)
