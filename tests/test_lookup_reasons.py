"""One test per Reason: build the state that causes it, check the verdict names it (group and
block) and reports no usable token past that block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvfsm import Engine
from kvfsm.lookup import DeviceProfile, Level, Reason, Verdict
from kvfsm.spec import Event, Layout, Tier
from kvfsm.state import NO_TARGET
from tests.block_reason import block_reason
from tests.lookup_models import (
    DEEPSEEK,
    DENSE,
    GPT_OSS,
    HISTORY_SWA,
    QWEN,
    TWO_SIZES,
    block_id,
    engine,
    group_eval,
    history_by_hand,
    tokens,
)

#: Every test runs with compiled kernels and with their NumPy twins.
pytestmark = pytest.mark.usefixtures("jit_backend")


#: Prompt-level context a verdict may add to any block-level reason.
CONTEXT = frozenset({Reason.BLOCK_BOUNDARY, Reason.PROMPT_END})


def _only(verdict: Verdict, *reasons: Reason) -> None:
    """The reasons of ``verdict`` are exactly ``reasons``, besides prompt-level context."""
    assert verdict.reason_set - (CONTEXT - set(reasons)) == set(reasons), verdict.reasons


def _blocks_before(verdict: Verdict, reason: Reason, block_size: int) -> None:
    """Zero usable tokens past the first block the reason names."""
    first = min(s.block_index for s in verdict.reasons_of(reason))
    assert verdict.usable_tokens <= first * block_size


def _dense(length: int = 161) -> tuple[Engine, np.ndarray]:
    eng = engine(DENSE)
    text = tokens(length)
    eng.commit(eng.prompt(text))
    return eng, text


def test_not_cached() -> None:
    eng, text = _dense()
    eng.core.fire("attn", [block_id(eng, "attn", text, 4)], "evict")
    verdict = eng.lookup(text)
    _only(verdict, Reason.NOT_CACHED)
    assert verdict.reasons_of(Reason.NOT_CACHED)[0].block_index == 4
    _blocks_before(verdict, Reason.NOT_CACHED, 16)


def test_compressed_incomplete_and_its_plan_compresses() -> None:
    eng = engine(HISTORY_SWA)
    text = tokens(321)  # history blocks 0..4, every one needed compressed at 320
    history_by_hand(eng, text, {1: "raw", 4: "raw"})
    verdict = eng.lookup(text)
    _only(verdict, Reason.COMPRESSED_INCOMPLETE)
    shorts = verdict.reasons_of(Reason.COMPRESSED_INCOMPLETE)
    assert [(s.group, s.block_index) for s in shorts] == [("history", 1), ("history", 4)]
    # Nothing raw at a compression boundary: a raw block 1 serves no length past 64.
    assert verdict.usable_tokens == 64
    assert verdict.restorable_tokens == 320
    assert [(s.block_index, [e.spec_name for e in s.path]) for s in verdict.plan] == [
        (1, ["compress_begin", "compress_done"]), (4, ["compress_begin", "compress_done"])]


def test_compressing_a_block_under_an_index_is_not_offered_as_a_restore() -> None:
    """Compressing a history block moves its epoch and invalidates the index rows pointing at
    it, so a plan that compresses it cannot keep those rows: they are recomputed."""
    eng = engine(DEEPSEEK)
    text = tokens(321)
    history_by_hand(eng, text, {1: "raw"})
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == verdict.restorable_tokens == 64
    assert verdict.plan == ()


def test_mid_compression() -> None:
    eng = engine(HISTORY_SWA)
    text = tokens(321)
    history_by_hand(eng, text, {2: "compressing", 4: "raw"})
    verdict = eng.lookup(text)
    _only(verdict, Reason.MID_COMPRESSION, Reason.COMPRESSED_INCOMPLETE)
    (mid,) = verdict.reasons_of(Reason.MID_COMPRESSION)
    assert (mid.group, mid.block_index) == ("history", 2)
    assert verdict.usable_tokens == 128  # blocks 0 and 1 compressed; 2 is not yet
    assert [(s.block_index, [e.spec_name for e in s.path]) for s in verdict.plan] == [
        (2, ["compress_done"]), (4, ["compress_begin", "compress_done"])]


def test_tail_missing() -> None:
    """A length inside a compressed block needs that block's first tokens raw; compressed, it
    cannot serve them. Candidate lengths are whole multiples of every block size, so only a
    group's own evaluation at such a length asks for a raw tail today."""
    eng = engine(HISTORY_SWA)
    text = tokens(321)
    eng.commit(eng.prompt(text))
    group = eng.core.group("history")
    high, low = eng.prompt(text).words(64)
    evaluation = group_eval(group, high, low, np.array([0, 64, 100]),
                            level=Level.FULL, kernel_layout=None, profile=DeviceProfile())
    assert evaluation.now.tolist() == [True, True, False]
    index, compressed = evaluation.failing(100)
    assert (index.tolist(), compressed.tolist()) == ([1], [False])
    assert block_reason(evaluation, 1, False) is Reason.TAIL_MISSING


def test_window_mismatch() -> None:
    eng = engine(GPT_OSS)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    eng.core.fire("swa", [block_id(eng, "swa", text, 8)], "evict")
    verdict = eng.lookup(text)
    _only(verdict, Reason.WINDOW_MISMATCH)
    _blocks_before(verdict, Reason.WINDOW_MISMATCH, 16)


def test_a_prompt_never_cached_is_not_cached_in_every_group_not_a_window_mismatch() -> None:
    """A window block is a mismatch where the group holds the prompt's other blocks; a prompt
    the group never cached is simply not cached, window or not, in its summary too."""
    eng = engine(GPT_OSS)
    verdict = eng.lookup(tokens(161))
    _only(verdict, Reason.NOT_CACHED)
    assert {s.group for s in verdict.reasons_of(Reason.NOT_CACHED)} == {"attn", "swa"}
    assert "window_mismatch" not in str(verdict)
    assert {g.name: g.stop for g in verdict.groups} == {"attn": Reason.NOT_CACHED,
                                                        "swa": Reason.NOT_CACHED}


def test_index_stale() -> None:
    """An index whose recorded target epoch no longer matches its target (metadata that
    disagrees with the history it points at) is never usable, and restoring it is not in the
    plan."""
    eng = engine(DEEPSEEK)
    text = tokens(321)
    eng.commit(eng.prompt(text))
    index = block_id(eng, "index", text, 10)
    eng.core.group("index")._blocks.refs_epoch[index, 0] += 1
    verdict = eng.lookup(text)
    _only(verdict, Reason.INDEX_STALE)
    _blocks_before(verdict, Reason.INDEX_STALE, 16)
    assert all(s.block_id != index for s in verdict.plan)


def test_an_index_spilled_while_its_target_is_evicted_is_invalidated() -> None:
    """The index leaves the hash map with its target (no stale index survives to be read)."""
    eng = engine(DEEPSEEK)
    text = tokens(321)
    eng.commit(eng.prompt(text))
    core = eng.core
    index = block_id(eng, "index", text, 10)
    target = int(core.group("index").refs_target[index][0])
    core.fire("index", [index], "spill_begin")
    core.fire("history", [target], "evict")
    assert core.describe("index", index).state == "invalid"
    verdict = eng.lookup(text)
    assert verdict.usable_tokens <= 10 * 16
    assert core.check_invariants() == []


def test_not_resident_is_restorable() -> None:
    eng, text = _dense()
    block = block_id(eng, "attn", text, 6)
    eng.core.fire("attn", [block], "spill_begin")
    eng.core.fire("attn", [block], "spill_done")
    verdict = eng.lookup(text)
    _only(verdict, Reason.NOT_RESIDENT)
    _blocks_before(verdict, Reason.NOT_RESIDENT, 16)
    assert verdict.restorable_tokens == 160
    assert verdict.plan[0].tier is Tier.HOST


def test_restore_in_flight() -> None:
    eng, text = _dense()
    block = block_id(eng, "attn", text, 2)
    for event in ("spill_begin", "spill_done", "restore_begin"):
        eng.core.fire("attn", [block], event)
    verdict = eng.lookup(text)
    _only(verdict, Reason.RESTORE_IN_FLIGHT)
    assert verdict.usable_tokens == 32
    assert [e.spec_name for e in verdict.plan[0].path] == ["restore_done"]


def test_layout_mismatch() -> None:
    eng, text = _dense()
    decl = eng.core.group("attn").decl
    other = Layout(("block", "dim", "token"), decl.layout.alignment, decl.layout.padding)
    verdict = eng.lookup(text, kernel_layouts={"attn": other})
    _only(verdict, Reason.LAYOUT_MISMATCH)
    assert verdict.usable_tokens == 0
    assert eng.lookup(text, kernel_layouts={"attn": decl.layout}).usable_tokens == 160


def test_layout_recorded_per_block() -> None:
    """Blocks written after the engine switched kernels carry the new layout."""
    eng = engine(DENSE)
    text = tokens(161)
    eng.commit(eng.prompt(text[:81]))
    decl = eng.core.group("attn").decl
    other = Layout(("block", "dim", "token"), decl.layout.alignment, decl.layout.padding)
    eng.core.set_write_layout("attn", other)
    eng.commit(eng.prompt(text))
    verdict = eng.lookup(text, kernel_layouts={"attn": other})
    assert verdict.usable_tokens == 0
    assert verdict.reasons_of(Reason.LAYOUT_MISMATCH)[0].block_index == 0
    old = eng.lookup(text, kernel_layouts={"attn": decl.layout})
    assert old.usable_tokens == 80


def test_misaligned() -> None:
    eng, text = _dense()
    eng.profile = DeviceProfile("picky", base_alignment=1 << 20, size_alignment=16)
    verdict = eng.lookup(text, level=Level.FULL)
    _only(verdict, Reason.MISALIGNED)
    _blocks_before(verdict, Reason.MISALIGNED, 16)


def test_group_gap() -> None:
    """An index pointing at history blocks of another prompt does not fit this one."""
    eng = engine(DEEPSEEK)
    text, other = tokens(321, seed=1), tokens(321, seed=2)
    eng.commit(eng.prompt(other))
    stranger = block_id(eng, "history", other, 0)
    eng.commit(eng.prompt(text), groups=["history", "swa"])
    core = eng.core
    prompt = eng.prompt(text)
    high, low = prompt.words(16)
    ids = core.allocate("index", np.arange(high.size), high, low)
    core.fire("index", ids, Event.WRITE_BEGIN)
    refs = np.full((ids.size, 4), NO_TARGET, dtype=np.int32)
    refs[:, 0] = stranger
    core.set_index_refs("index", ids, refs)
    core.write("index", ids, np.zeros((ids.size, core.group("index").decl.payload_bytes),
                                      np.uint8))
    core.fire("index", ids, Event.WRITE_DONE)
    verdict = eng.lookup(prompt)
    _only(verdict, Reason.GROUP_GAP)
    assert verdict.usable_tokens == 0


def test_position_conflict() -> None:
    """A block registered under the hash of position 2 but recorded at position 7."""
    eng = engine(DENSE)
    text = tokens(161)
    prompt = eng.prompt(text)
    high, low = prompt.words(16)
    positions = np.arange(high.size)
    positions[2] = 7
    core = eng.core
    ids = core.allocate("attn", positions, high, low)
    core.fire("attn", ids, "write_begin")
    core.write("attn", ids, np.zeros((ids.size, core.group("attn").decl.payload_bytes), np.uint8))
    core.fire("attn", ids, "write_done")
    verdict = eng.lookup(prompt)
    _only(verdict, Reason.POSITION_CONFLICT)
    assert verdict.usable_tokens == 32


def test_checksum_mismatch_is_found_at_full_level() -> None:
    """Silent corruption of device memory: only a FULL lookup recomputes the checksum."""
    eng, text = _dense()
    group = eng.core.group("attn")
    block = block_id(eng, "attn", text, 5)
    group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), 3] ^= 0xFF
    verdict = eng.lookup(text, level=Level.FULL)
    _only(verdict, Reason.CHECKSUM_MISMATCH)
    assert verdict.usable_tokens == 80
    assert verdict.restorable_tokens == 80  # corrupt bytes are not repaired by any restore


def test_sub_blocks_missing() -> None:
    """Defence in depth: the lifecycle never completes a block with missing sub-blocks, so
    this needs a corrupted bitmap to show up."""
    eng, text = _dense()
    eng.core.group("attn")._blocks.sub_blocks[block_id(eng, "attn", text, 1)] = 0
    verdict = eng.lookup(text)
    _only(verdict, Reason.SUB_BLOCKS_MISSING)
    assert verdict.usable_tokens == 16


def test_no_checkpoint() -> None:
    eng = engine(QWEN)
    text = tokens(161)
    eng.commit(eng.prompt(text))
    verdict = eng.lookup(text)
    _only(verdict, Reason.NO_CHECKPOINT)
    assert verdict.usable_tokens == 128


def test_block_boundary() -> None:
    eng = engine(TWO_SIZES)
    text = tokens(90)
    eng.commit(eng.prompt(text))
    verdict = eng.lookup(text)
    _only(verdict, Reason.BLOCK_BOUNDARY)
    assert verdict.usable_tokens == 48


def test_prompt_end() -> None:
    eng, text = _dense(160)
    verdict = eng.lookup(text)
    _only(verdict, Reason.PROMPT_END)
    assert verdict.usable_tokens == 144  # the block holding token 159 is recomputed


def test_spec_decode_drop_is_applied_once() -> None:
    eng, text = _dense()
    verdict = eng.lookup(text, drop_last_block=True)
    _only(verdict, Reason.SPEC_DECODE_DROP)
    assert verdict.usable_tokens == 144


def test_graph_mismatch() -> None:
    """A captured graph reading at most 4 blocks: the 10-block prefix is usable eagerly, not
    replayable (every dimension is tested in tests/test_gates_graph.py)."""
    from kvfsm.gates import GraphSignature

    eng, text = _dense()
    eng.register_graph(GraphSignature.of(eng.core, "decode", {"attn": 4}))
    eng.activate_graph("decode")
    verdict = eng.lookup(text)
    _only(verdict, Reason.GRAPH_MISMATCH)
    assert verdict.usable_tokens == 160 and not eng.replayable(verdict)


def test_tier_unavailable(tmp_path: Path) -> None:
    """The prefix's only copy is on a disk tier that is backing off: the verdict still says
    what a restore could bring back, names the tier per group, and a restore asks it
    nothing."""
    from kvfsm import CoreConfig
    from kvfsm.tiers import DiskTier

    eng = Engine(DENSE, CoreConfig(device_blocks=16, host_blocks=16, disk_blocks=16,
                                   backend="numpy"),
                 tiers={"disk": DiskTier(tmp_path, capacity_bytes=1 << 30, fsync=False)})
    text = tokens(161)
    eng.commit(eng.prompt(text))
    ids = [block_id(eng, "attn", text, i) for i in range(10)]
    eng.offload("attn", ids)
    eng.spill_down("attn", Tier.HOST, 10)
    eng.restorer.health[Tier.DISK].failed("test: the disk stopped answering")
    verdict = eng.lookup(text)
    _only(verdict, Reason.NOT_RESIDENT, Reason.TIER_UNAVAILABLE)
    (named,) = verdict.reasons_of(Reason.TIER_UNAVAILABLE)
    assert named.group == "attn" and "disk" in named.detail
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (0, 160)
    ticket = eng.restore(verdict, eng.prompt(text))
    assert not ticket.wait(timeout=30)["attn"].restored
    assert any("not answering" in note for note in ticket.notes)


def test_every_reason_has_a_test() -> None:
    names = {name for name in globals() if name.startswith("test_")}
    for reason in Reason:
        assert any(reason.value in name for name in names), reason


@pytest.mark.parametrize("level", list(Level))
def test_a_clean_cache_is_usable_at_every_level(level: Level) -> None:
    eng, text = _dense()
    assert eng.lookup(text, level=level).usable_tokens == 160
