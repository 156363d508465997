"""Reuse every intact token: what the engine keeps, stores, finds and restores so that a prefix
whose blocks are intact somewhere is reused, across every kind of cache object.

Each test is a reproduction of cache thrown away although it was intact: a window block, a
compressed block or a snapshot that could not be stored (so no hybrid prefix survived a
restart), a restore that stopped at its first failed step, eviction that kept a prompt's tail,
discovery that stopped at a gap, a failing device copy never reloaded from its stored copy,
a stored copy that could not be loaded kept instead of a fresh one. Content is a function of
each block's prefix hash, so every read can be checked against the bytes committed for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from kvfsm import CoreConfig, Engine, KvfsmError
from kvfsm.lookup import Level
from kvfsm.serve import corrupt_host_copy, flip_device_bytes, restore_in_flight
from kvfsm.spec import Tier
from kvfsm.state import GroupState, Prompt
from kvfsm.tiers import DiskTier

#: Generous waits: a test never depends on them passing quickly.
WAIT = 30.0
#: The shipped models whose every group a restored prefix needs (no sparse index, whose
#: references name this engine's blocks and stay on device and host).
STORABLE = ["dense", "gpt_oss_like", "qwen3_next_like", "tiny_gpt_oss", "tiny_qwen3_next",
            "tiny_deepseek_v4"]


def content(group: GroupState, prompt: Prompt, index: int) -> NDArray[np.uint8]:
    high, low = prompt.words(group.decl.block_size)
    rng = np.random.default_rng([int(high[index]), int(low[index]), len(group.name)])
    return rng.integers(0, 256, group.decl.payload_bytes, dtype=np.uint8)


def payload_of(prompt: Prompt) -> Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]:
    def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
        rows = [content(group, prompt, int(i)) for i in index.tolist()]
        return np.stack(rows) if rows else np.zeros((0, group.decl.payload_bytes), np.uint8)

    return payload


def tokens(n: int, seed: int = 0) -> NDArray[np.int64]:
    return np.arange(n, dtype=np.int64) + 1_000 * (seed + 1)


def ids_of(eng: Engine, prompt: Prompt, group: str) -> NDArray[np.intp]:
    high, low = prompt.words(eng.core.group(group).decl.block_size)
    return eng.core.lookup_words(group, high, low)


def states(eng: Engine, prompt: Prompt, group: str) -> list[str | None]:
    state = eng.core.group(group)
    return [None if i < 0 else state.machine.state_of(int(i)) for i in ids_of(eng, prompt, group)]


def right_bytes(eng: Engine, prompt: Prompt) -> None:
    """Every readable block of ``prompt`` holds exactly the bytes committed for it."""
    for name, group in eng.core.groups.items():
        for index, block in enumerate(ids_of(eng, prompt, name).tolist()):
            if block >= 0 and group.table.readable[group.states[block]]:
                got = eng.core.read(name, [block], form=None)[0]
                assert np.array_equal(got, content(group, prompt, index)), (name, index)


def park(eng: Engine, prompt: Prompt, tier: Tier = Tier.DISK) -> None:
    """Every cached block of ``prompt`` moved down to ``tier`` (device -> host -> ...)."""
    for name in eng.core.groups:
        ids = ids_of(eng, prompt, name)
        eng.offload(name, ids[ids >= 0])
        for upper in (Tier.HOST, Tier.DISK):
            if upper < tier:
                eng.spill_down(name, upper, len(ids))
    for name in eng.core.groups:
        assert set(states(eng, prompt, name)) <= {tier.spec_name, None}, name


def disk_engine(model: str, path: Path, **config: int) -> Engine:
    sizes = {"device_blocks": 64, "host_blocks": 64, "disk_blocks": 256} | config
    return Engine(model, CoreConfig(**sizes, backend="numpy"),
                  tiers={"disk": DiskTier(path, capacity_bytes=1 << 30, fsync=False)})


def restored(eng: Engine, prompt: Prompt, level: Level = Level.STANDARD) -> int:
    """The documented round: lookup, restore with the prompt, wait, lookup; usable tokens."""
    verdict = eng.lookup(prompt, level=level)
    if verdict.restorable_tokens > verdict.usable_tokens:
        eng.restore(verdict, prompt).wait(timeout=WAIT)
    return eng.lookup(prompt, level=level).usable_tokens


# -- every kind is stored, so every architecture's prefix survives a restart -------------------


@pytest.mark.parametrize("model", STORABLE)
def test_every_kind_reaches_disk_and_a_restarted_engine_reuses_the_whole_prefix(
        tmp_path: Path, model: str) -> None:
    """Window blocks, compressed history and recurrent snapshots go to disk like full
    attention's blocks: a restarted engine on the same directory finds the prefix by key,
    restores it verified, and reuses every token a fresh engine would (before, a model with
    a sliding window or a compressed group reused nothing after a restart)."""
    eng = disk_engine(model, tmp_path)
    step = eng.model.lcm_block_size
    prompt = eng.prompt(tokens(8 * 64 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    whole = eng.lookup(prompt).usable_tokens
    assert whole > 0 and whole % step == 0
    park(eng, prompt)
    eng.close()

    again = disk_engine(model, tmp_path)
    prompt = again.prompt(tokens(8 * 64 + 1))
    assert restored(again, prompt) == whole
    right_bytes(again, prompt)
    assert again.core.check_invariants() == []


def test_a_remote_tier_without_a_disk_tier_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Blocks reach the remote store from disk (host -> disk -> remote): an engine that spills
    to host and has a remote tier but no disk tier would never write the remote store, so it
    is refused, saying why and what to do; one with no host pool only reads what others
    stored, and is accepted."""
    remote = DiskTier(tmp_path / "r", capacity_bytes=1 << 20)
    remote.tier = Tier.REMOTE  # any stored tier may stand for the remote one here
    with pytest.raises(KvfsmError, match=r"DiskTier.*host_blocks=0"):
        Engine("dense", CoreConfig(host_blocks=8, remote_blocks=8), tiers={"remote": remote})
    Engine("dense", CoreConfig(host_blocks=0, remote_blocks=8), tiers={"remote": remote}).close()


def test_stored_blocks_without_their_tier_are_refused(tmp_path: Path) -> None:
    """``disk_blocks`` (or ``remote_blocks``) with no such tier attached would count copies
    nobody writes: refused, naming the setting."""
    with pytest.raises(KvfsmError, match="disk_blocks"):
        Engine("dense", CoreConfig(host_blocks=8, disk_blocks=8))


# -- one restore lands the longest intact prefix ------------------------------------------------


def test_one_restore_call_lands_the_fallback_length_after_a_failed_step() -> None:
    """A plan restores what the longest restorable length needs; when a host copy fails its
    checksum the fallback length needs window blocks the plan did not name. The documented
    lookup -> restore -> wait -> lookup still ends at the intact length (before: 0, and a
    second round was needed to get it)."""
    eng = Engine("tiny_gpt_oss", CoreConfig(device_blocks=64, host_blocks=64, backend="numpy"))
    prompt = eng.prompt(tokens(200))
    eng.commit(prompt, payload=payload_of(prompt))
    for name in eng.core.groups:
        ids = ids_of(eng, prompt, name)
        eng.offload(name, ids[ids >= 0])
    corrupt_host_copy(eng, prompt, index=8, group="full")  # tokens [128, 144)
    verdict = eng.lookup(prompt, level=Level.FULL)
    assert verdict.restorable_tokens == 192
    ticket = eng.restore(verdict, prompt)
    outcomes = ticket.wait(timeout=WAIT)
    assert ticket.rounds == 2  # the plan for 192, then the fallback's for 128
    assert eng.lookup(prompt, level=Level.FULL).usable_tokens == 128
    full = ids_of(eng, prompt, "full")
    assert set(full[:8].tolist()) <= set(outcomes["full"].restored)
    right_bytes(eng, prompt)
    assert eng.core.check_invariants() == []


def test_a_half_landed_restore_is_copied_again_from_its_intact_host_copy() -> None:
    """A restore begun earlier whose device copy only half landed fails its check; the block
    rolls back to its host copy, which is intact, and the same restore call copies it again
    (before, the host copy was dropped with the bad device bytes and the prefix recomputed)."""
    eng = Engine("dense", CoreConfig(device_blocks=16, host_blocks=16, backend="numpy"))
    prompt = eng.prompt(tokens(8 * 16 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    restore_in_flight(eng, prompt, index=2, group="attn")
    assert restored(eng, prompt, Level.FULL) == 128
    right_bytes(eng, prompt)
    assert eng.core.check_invariants() == []


# -- eviction keeps prefixes whole --------------------------------------------------------------


def test_eviction_gives_a_prompts_tail_back_first() -> None:
    """Room for another prompt is taken from the least recently used prompt's tail, as vLLM
    frees a request's blocks in reverse: what stays is a prefix a lookup can use (before, its
    head went first and the tail left behind was of no use)."""
    eng = Engine("dense", CoreConfig(device_blocks=8, backend="numpy"))
    first = eng.prompt(tokens(97))
    eng.commit(first)
    eng.commit(eng.prompt(tokens(65, seed=1)))
    assert states(eng, first, "attn") == ["device"] * 4 + [None] * 2
    assert eng.lookup(first).usable_tokens == 64


def test_eviction_keeps_the_same_prefix_in_every_group() -> None:
    """With a full and a sliding-window group, each gives back the prompt's tail: the prefix
    left is usable in both (the window blocks its end needs are the ones kept)."""
    eng = Engine("tiny_gpt_oss", CoreConfig(device_blocks=8, backend="numpy"))
    first = eng.prompt(tokens(97))
    eng.commit(first)
    eng.commit(eng.prompt(tokens(65, seed=1)))
    assert eng.lookup(first).usable_tokens == 64


# -- discovery by key at the length asked -------------------------------------------------------


def test_discovery_adopts_snapshots_past_a_missing_one(tmp_path: Path) -> None:
    """A prefix needs only the snapshot at its own length: with the snapshot after 32 tokens
    gone from disk, a restarted engine still adopts the rest and reuses 96 tokens (before,
    discovery stopped at the gap: 16)."""
    eng = disk_engine("tiny_qwen3_next", tmp_path)
    prompt = eng.prompt(tokens(97))
    eng.commit(prompt, payload=payload_of(prompt))
    park(eng, prompt)
    snapshot = eng.restorer.keys.keys("linear", ids_of(eng, prompt, "linear")[1:2])
    eng.close()
    store = DiskTier(tmp_path, capacity_bytes=1 << 30)
    assert store.remove(snapshot).all()

    again = disk_engine("tiny_qwen3_next", tmp_path)
    prompt = again.prompt(tokens(97))
    verdict = again.lookup(prompt)
    assert (verdict.hit_tokens, verdict.restorable_tokens) == (96, 96)
    assert restored(again, prompt) == 96
    right_bytes(again, prompt)


# -- a failing copy is replaced by an intact one ------------------------------------------------


def test_a_device_copy_failing_its_checksum_is_reloaded_from_its_disk_copy(
        tmp_path: Path) -> None:
    """A restored block keeps its disk copy (``device_disk``); when its device bytes fail
    the checksum, the lookup gives the device slot back and plans the reload from disk, so
    the documented round reuses the whole prefix again (before, it stayed unusable until a
    commit rewrote it)."""
    eng = disk_engine("dense", tmp_path)
    prompt = eng.prompt(tokens(8 * 16 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    park(eng, prompt)
    assert restored(eng, prompt, Level.FULL) == 128
    assert set(states(eng, prompt, "attn")) == {"device_disk"}
    flip_device_bytes(eng, prompt, index=3, group="attn")
    assert restored(eng, prompt, Level.FULL) == 128
    right_bytes(eng, prompt)


def test_a_commit_replaces_a_stored_copy_the_prefill_computed_again(tmp_path: Path) -> None:
    """The prefill recomputed blocks whose stored copy could not be used (here: their files
    were unreadable at restore time): the commit writes the fresh copies to the device, so
    the next lookup reuses them (before, the stored copies were kept and the prompt stayed
    unusable however often it was recomputed)."""
    eng = disk_engine("dense", tmp_path)
    prompt = eng.prompt(tokens(8 * 16 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    park(eng, prompt)
    assert eng.lookup(prompt).usable_tokens == 0
    eng.commit(prompt, payload=payload_of(prompt))
    assert eng.lookup(prompt).usable_tokens == 128
    right_bytes(eng, prompt)


@pytest.mark.parametrize("index_failed_too", [False, True])
def test_a_commit_replacing_a_failed_target_writes_its_index_blocks_again(
        index_failed_too: bool) -> None:
    """A history block seen failing its checksum is invalidated and written again by the next
    commit, which invalidates every index block pointing at it: the commit writes those
    again too, so the whole prefix is reused, with the committed bytes (before, the index
    blocks were lost until another commit, and an index block that had failed as well made
    the commit raise half done)."""
    eng = Engine("deepseek_v4_like", CoreConfig(device_blocks=64, host_blocks=64,
                                                backend="numpy"))
    prompt = eng.prompt(tokens(4 * 64 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    flip_device_bytes(eng, prompt, index=0, group="history")
    if index_failed_too:
        flip_device_bytes(eng, prompt, index=5, group="index")
    assert eng.lookup(prompt, level=Level.FULL).usable_tokens == 0
    eng.commit(prompt, payload=payload_of(prompt))
    assert eng.lookup(prompt, level=Level.FULL).usable_tokens == 256
    right_bytes(eng, prompt)
    assert eng.core.check_invariants() == []


def test_a_commit_leaves_the_blocks_a_prefill_reused_as_they_are() -> None:
    """``computed_from``: blocks before it were reused, not computed: a lower-tier copy of
    one stays where it is (the prefill has no fresh content for it)."""
    eng = Engine("dense", CoreConfig(device_blocks=16, host_blocks=16, backend="numpy"))
    prompt = eng.prompt(tokens(4 * 16 + 1))
    eng.commit(prompt, payload=payload_of(prompt))
    eng.offload("attn", ids_of(eng, prompt, "attn")[:2])
    eng.commit(prompt, payload=payload_of(prompt), computed_from=32)
    assert states(eng, prompt, "attn") == ["host", "host", "device", "device"]


def test_a_commit_skips_the_blocks_the_caller_has_no_content_for() -> None:
    """``unavailable`` names blocks a caller cannot give (a window block that slid out before
    it was captured): the group's other blocks are still committed (before, the whole group
    was skipped and the blocks computed past a resume point were lost)."""
    eng = Engine("tiny_gpt_oss", CoreConfig(device_blocks=32, backend="numpy"))
    prompt = eng.prompt(tokens(6 * 16 + 1))
    eng.commit(prompt, payload=payload_of(prompt), unavailable={"sliding": [0, 1]})
    assert states(eng, prompt, "sliding") == [None, None] + ["device"] * 4
    assert states(eng, prompt, "full") == ["device"] * 6
    assert eng.lookup(prompt).usable_tokens == 96
    with pytest.raises(KvfsmError, match="unavailable"):
        eng.commit(prompt, unavailable={"sliding": [-1]})
    with pytest.raises(KvfsmError, match="nope"):
        eng.commit(prompt, unavailable={"nope": [1]})
