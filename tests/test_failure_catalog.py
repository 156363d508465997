"""A catalog of KV-cache failure classes reported against serving engines, each set up through
kvfsm's public API.

In every class a prefix-hash hit would have served the cache as it stands. Each test checks
that kvfsm does not: the verdict's usable prefix stops short with the reason that explains it,
a restore refuses the bad copy and forgets it, or a lease raises ``LeaseLost``. Where bytes are
involved, every block kvfsm lets a kernel read is checked to hold exactly the bytes committed
for it. ``docs/failures.md`` lists the classes with the mechanism that covers each.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import pytest
import xxhash
from numpy.typing import NDArray

from kvfsm import (
    CoreConfig,
    Engine,
    GuardRejected,
    LeaseLost,
    StateError,
    shipped_models,
)
from kvfsm.gates import GraphSignature
from kvfsm.lookup import Reason, Verdict
from kvfsm.spec import Event, Layout, Tier
from kvfsm.state import GroupState, Prompt
from kvfsm.tiers import (
    BlockKey,
    DiskTier,
    LoadStatus,
    StoredTier,
    block_keys,
    encode_header,
    layout_hash,
    model_digest,
)
from tests.lookup_models import DEEPSEEK, DENSE, GPT_OSS, QWEN, block_id, engine, tokens
from tests.wrapped_tier import Wrapped

#: Tokens per block of the test models' full-attention, window and index groups.
BLOCK: Final = 16
#: Complete blocks of TEXT: all of them are usable when cached (the last token is computed).
BLOCKS: Final = 10
TEXT: Final = tokens(BLOCKS * BLOCK + 1)
#: The whole prefix of TEXT a lookup can serve.
WHOLE: Final = BLOCKS * BLOCK
#: A DeepSeek-like prompt: 5 compressed history blocks of 64, 20 window and index blocks of 16.
LONG: Final = tokens(321, seed=4)
LONG_WHOLE: Final = 320
HISTORY_BLOCK: Final = 64
#: The Qwen-like test model's delta group snapshots its recurrent state every 64 tokens.
CHECKPOINT: Final = 64
#: Where drafted tokens start in the speculative-decoding test (inside block 7).
DRAFT_FROM: Final = 120
#: The block a fault is put into; the usable prefix must end right before it.
BAD: Final = 3
#: Bytes of per-block scales a quantized row carries inline (what a host row sized without
#: them loses).
SCALE_BYTES: Final = 32
#: Generous wait for stored-tier loads: a test never depends on them being quick.
WAIT_S: Final = 30.0
#: Block-first with K and V side by side per token (the shipped dense model's declared order),
#: and the K/V-first order some kernels keep instead.
BLOCK_FIRST: Final = shipped_models()["dense"].group("attn").layout
KV_FIRST: Final = Layout(("kv", "block", "token", "head", "dim"), BLOCK_FIRST.alignment,
                         BLOCK_FIRST.padding)

#: Every test runs with compiled kernels and with their NumPy twins.
pytestmark = pytest.mark.usefixtures("jit_backend")

PayloadFn = Callable[[GroupState, NDArray[np.int64]], NDArray[np.uint8]]


# -- helpers --------------------------------------------------------------------------------------


def _row(seed: int, group: GroupState, index: int) -> NDArray[np.uint8]:
    """The committed bytes of block ``index`` of ``group`` under ``seed``: non-zero, so a row
    whose tail was lost differs from it."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(1, 256, group.decl.payload_bytes, dtype=np.uint8)


def _content(seed: int) -> PayloadFn:
    """A commit payload giving each block its :func:`_row`."""

    def payload(group: GroupState, index: NDArray[np.int64]) -> NDArray[np.uint8]:
        rows = [_row(seed, group, int(i)) for i in index.tolist()]
        return np.stack(rows) if rows else np.zeros((0, group.decl.payload_bytes), np.uint8)

    return payload


def _ids(eng: Engine, group: str, text: NDArray[Any]) -> NDArray[np.intp]:
    """The block id of each of ``text``'s blocks of ``group`` (-1 where not cached)."""
    return eng.core.lookup_words(group, *eng.prompt(text).words(
        eng.core.group(group).decl.block_size))


def _states(eng: Engine, group: str, text: NDArray[Any]) -> list[str | None]:
    return [None if i < 0 else eng.core.describe(group, int(i)).state
            for i in _ids(eng, group, text).tolist()]


def _reasons(verdict: Verdict, group: str) -> set[Reason]:
    """The reasons ``verdict`` gives for ``group``."""
    return {s.reason for s in verdict.reasons if s.group == group}


def _readable_rows_hold(eng: Engine, text: NDArray[Any], seed: int, group: str = "attn") -> int:
    """Every block of ``text`` the core lets a kernel read holds the bytes committed for it
    under ``seed``, and the core's invariants hold. Returns how many are readable."""
    state = eng.core.group(group)
    readable = 0
    for index, block in enumerate(_ids(eng, group, text).tolist()):
        if block >= 0 and state.table.readable[state.states[block]]:
            got = eng.core.read(group, [block])[0]
            assert np.array_equal(got, _row(seed, state, index)), f"block {index}: wrong bytes"
            readable += 1
    assert eng.core.check_invariants() == []
    return readable


def _disk_engine(where: Path, *, salt: str = "",
                 wrap: Callable[[DiskTier], StoredTier] | None = None
                 ) -> tuple[Engine, DiskTier]:
    """The dense test model over a disk tier in ``where`` (seen through ``wrap``)."""
    store = DiskTier(where, capacity_bytes=1 << 22, fsync=False)
    config = CoreConfig(device_blocks=2 * BLOCKS, host_blocks=2 * BLOCKS,
                        disk_blocks=4 * BLOCKS, cache_salt=salt, backend="numpy")
    tier: StoredTier = store if wrap is None else wrap(store)
    return Engine(DENSE, config, tiers={"disk": tier}), store


def _park(eng: Engine, text: NDArray[Any], seed: int) -> None:
    """Commit ``text`` with content ``seed`` and move every block device -> host -> disk."""
    eng.commit(text, payload=_content(seed))
    eng.offload("attn", _ids(eng, "attn", text))
    assert eng.spill_down("attn", Tier.HOST, BLOCKS) == BLOCKS
    assert _states(eng, "attn", text) == ["disk"] * BLOCKS


def _key(eng: Engine, text: NDArray[Any], index: int) -> BlockKey:
    """The stored key of block ``index`` of ``text``, built from the tier contract alone."""
    high, low = eng.prompt(text).words(BLOCK)
    (found,) = block_keys(model_digest(DENSE, eng.core.seed), DENSE.group("attn"),
                          layout_hash(DENSE.group("attn")), high[index:index + 1],
                          low[index:index + 1], np.array([index]))
    return found


def _file(store: DiskTier, key: BlockKey) -> Path:
    return store.directory / f"{key.name}.kvb"


def _write_value(path: Path, key: BlockKey, payload: NDArray[np.uint8]) -> None:
    """A whole, self-consistent value of ``key`` (its header announcing ``payload``'s length
    and checksum) put at ``path``."""
    header = encode_header(key, payload.size, xxhash.xxh3_64_intdigest(payload.tobytes()))
    path.write_bytes(header + payload.tobytes())


def _restore(eng: Engine, text: NDArray[Any]) -> tuple[Verdict, Any]:
    """Look ``text`` up, run the verdict's plan and wait for it: the verdict and the ticket."""
    prompt = eng.prompt(text)
    verdict = eng.lookup(prompt)
    ticket = eng.restore(verdict, prompt)
    ticket.wait(timeout=WAIT_S)
    return verdict, ticket


def _begin_writing(eng: Engine, group: str, text: NDArray[Any],
                   indices: Sequence[int]) -> NDArray[np.intp]:
    """Allocate ``text``'s blocks ``indices`` of ``group`` and start writing them (no done)."""
    high, low = eng.prompt(text).words(eng.core.group(group).decl.block_size)
    at = np.asarray(indices, dtype=np.int64)
    ids = eng.core.allocate(group, at, high[at], low[at])
    eng.core.fire(group, ids, Event.WRITE_BEGIN)
    return ids


class _FailingPuts(Wrapped):
    """A disk tier whose puts fail with an I/O error (a full or dying disk); loads, lookups
    and removals go to the real tier."""

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[Any],
            checksums: NDArray[np.uint64]) -> NDArray[np.bool_]:
        raise OSError("no space left on device")


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


# -- 1. sparse-indexer sidecar shorter than, or stale against, the KV ------------------------------


def _short_index(eng: Engine) -> None:
    """The KV (history and window) cached for all of LONG, its index only for 160 tokens."""
    eng.commit(LONG, groups=["history", "swa"])
    eng.commit(LONG[:BLOCKS * BLOCK + 1], groups=["index"])


def _stale_index(eng: Engine) -> None:
    """The index offloaded to host, then its target history block 2 dropped and computed
    afresh: the host index rows were written against the old block."""
    eng.commit(LONG)
    index = _ids(eng, "index", LONG)
    eng.core.fire("index", index, Event.SPILL_BEGIN)
    eng.core.fire("index", index, Event.SPILL_DONE)
    eng.core.fire("history", [block_id(eng, "history", LONG, 2)], Event.EVICT)
    eng.commit(LONG, groups=["history"])


@pytest.mark.parametrize(("setup", "first_gone", "usable"),
                         [(_short_index, 10, 128), (_stale_index, 11, 0)],
                         ids=["short", "stale"])
def test_an_index_shorter_or_staler_than_the_kv_is_never_paired_with_it(
        setup: Callable[[Engine], None], first_gone: int, usable: int) -> None:
    """The KV groups alone are usable for all 320 tokens (what an engine loading KV and index
    separately would serve), but the prefix is usable only as far as the index is cached
    against this very KV: index rows past the short sidecar, or written against a history
    block computed again since, are not cached, and no restore plan brings them back."""
    eng = engine(DEEPSEEK, host=32)
    setup(eng)
    verdict = eng.lookup(LONG)
    for kv in ("history", "swa"):
        assert verdict.group(kv).usable_tokens == LONG_WHOLE
    assert verdict.usable_tokens == usable
    # Usable lengths are multiples of the history block: the last one before the first row gone.
    assert verdict.restorable_tokens == first_gone * BLOCK // HISTORY_BLOCK * HISTORY_BLOCK
    gone = [s.block_index for s in verdict.reasons_of(Reason.NOT_CACHED) if s.group == "index"]
    assert gone and min(gone) == first_gone
    assert all(s.block_index < first_gone for s in verdict.plan)
    assert _reasons(verdict, "history") == _reasons(verdict, "swa") == set()
    assert eng.core.check_invariants() == []


# -- 2. layer-wise load racing the indexer read ----------------------------------------------------


def test_an_index_is_never_read_while_its_target_is_mid_restore() -> None:
    """A history block an index points at is moved off the device and loaded back. A lease
    (the indexer's read) keeps the move from completing under it; once moved, the index rows
    pointing at it leave the cache with it, and while it loads the prefix stops before it.
    The restored block does not bring the index rows back: they are computed again."""
    eng = engine(DEEPSEEK)
    eng.commit(LONG)
    position = 2  # history block 2: tokens [128, 192)
    target = block_id(eng, "history", LONG, position)
    rows = _ids(eng, "index", LONG)
    assert (eng.core.group("index").refs_target[rows] == target).any()
    with eng.lease(eng.lookup(LONG), LONG):
        eng.core.fire("history", [target], Event.SPILL_BEGIN)
        with pytest.raises(GuardRejected, match="no_pins"):
            eng.core.fire("history", [target], Event.SPILL_DONE)
        eng.core.fire("history", [target], Event.SPILL_FAIL)
    for event in (Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN):
        eng.core.fire("history", [target], event)
    during = eng.lookup(LONG)
    assert during.group("history").hit_tokens == LONG_WHOLE  # still a hash hit
    assert during.usable_tokens == position * HISTORY_BLOCK
    assert Reason.RESTORE_IN_FLIGHT in _reasons(during, "history")
    assert Reason.NOT_CACHED in _reasons(during, "index")
    with pytest.raises(StateError):
        eng.core.read("history", [target])
    eng.core.fire("history", [target], Event.RESTORE_DONE)
    after = eng.lookup(LONG)
    assert after.group("history").usable_tokens == LONG_WHOLE
    assert after.usable_tokens == position * HISTORY_BLOCK
    eng.commit(LONG)  # the index computed again against the restored history
    assert eng.lookup(LONG).usable_tokens == LONG_WHOLE
    assert eng.core.check_invariants() == []


# -- 3. host rows sized without inline scales (silent truncation) ---------------------------------


def _host_row_tail_lost(eng: Engine, store: DiskTier) -> None:
    """Block BAD offloaded to host with its last SCALE_BYTES (the scales) never copied."""
    eng.commit(TEXT, payload=_content(0))
    eng.offload("attn", _ids(eng, "attn", TEXT))
    group = eng.core.group("attn")
    slot = eng.core.describe("attn", block_id(eng, "attn", TEXT, BAD)).slots[Tier.HOST]
    group.pools[Tier.HOST].data[slot, -SCALE_BYTES:] = 0


def _disk_copy_sized(delta: int) -> Callable[[Engine, DiskTier], None]:
    """Block BAD's file rewritten as a whole value ``delta`` bytes longer than the row (its
    header agreeing with its length and checksum)."""

    def fault(eng: Engine, store: DiskTier) -> None:
        _park(eng, TEXT, 0)
        key = _key(eng, TEXT, BAD)
        row = _row(0, eng.core.group("attn"), BAD)
        payload = row[:delta] if delta < 0 else np.concatenate([row, np.ones(delta, np.uint8)])
        _write_value(_file(store, key), key, payload)

    return fault


def _disk_copy_other_layout(eng: Engine, store: DiskTier) -> None:
    """Block BAD's file rewritten with the right bytes and length under another layout."""
    _park(eng, TEXT, 0)
    key = _key(eng, TEXT, BAD)
    decl = DENSE.group("attn")
    flipped = Layout(tuple(reversed(decl.layout.dim_order)), decl.layout.alignment,
                     decl.layout.padding)
    _write_value(_file(store, key), attrs.evolve(key, layout=layout_hash(decl, flipped)),
                 _row(0, eng.core.group("attn"), BAD))


@pytest.mark.parametrize(("fault", "status"), [
    (_host_row_tail_lost, None),
    (_disk_copy_sized(-SCALE_BYTES), LoadStatus.CORRUPT),
    (_disk_copy_sized(SCALE_BYTES), LoadStatus.CORRUPT),
    (_disk_copy_other_layout, LoadStatus.FOREIGN),
], ids=["host_row_tail_lost", "disk_copy_shorter", "disk_copy_longer", "disk_copy_other_layout"])
def test_a_copy_shorter_or_laid_out_unlike_the_device_row_is_never_served(
        tmp_path: Path, fault: Callable[[Engine, DiskTier], None],
        status: LoadStatus | None) -> None:
    """Host and device rows are sized by one declaration. A host copy whose tail was lost
    fails the checksum its restore re-computes; a stored copy whose header announces another
    length, or another layout, is refused by its load (corrupt, foreign). Either way the copy
    is forgotten: the usable prefix after the restore ends at that block, and every block
    readable holds the committed bytes."""
    eng, store = _disk_engine(tmp_path / "disk")
    group = eng.core.group("attn")
    assert group.pools[Tier.HOST].payload_bytes == group.pools[Tier.DEVICE].payload_bytes
    fault(eng, store)
    verdict, ticket = _restore(eng, TEXT)
    assert verdict.hit_tokens == verdict.restorable_tokens == WHOLE  # the hit would serve it
    outcome = ticket.wait(timeout=WAIT_S)["attn"]
    if status is None:  # restored from host: restore_done's checksum_ok refused it
        assert len(ticket.notes) == 1 and "restore_done refused" in ticket.notes[0]
        assert outcome.lost == ()
    else:  # loaded from disk: the load refused it
        assert ticket.notes == ()
        assert outcome.statuses == {LoadStatus.OK.name: BLOCKS - 1, status.name: 1}
        assert len(outcome.lost) == 1
    after = eng.lookup(TEXT)
    assert after.usable_tokens == after.hit_tokens == BAD * BLOCK
    assert _readable_rows_hold(eng, TEXT, 0) == BLOCKS - 1
    eng.close()


# -- 4. recurrent state restored from the wrong checkpoint ----------------------------------------


def test_a_recurrent_snapshot_is_used_only_at_its_own_checkpoint() -> None:
    """The delta group snapshots every 64 tokens. A snapshot at 80 tokens (a writer with
    another chunk size) is found by hash, but no length reuses it: alone it serves nothing,
    beside the 64-token snapshot only 64 tokens are usable. A snapshot written under another
    layout serves nothing either."""
    text = tokens(6 * BLOCK + 1)
    eng = engine(QWEN)
    eng.commit(text, groups=["attn"])
    off_interval = (CHECKPOINT + BLOCK) // BLOCK - 1  # the block ending at 80 tokens
    ids = _begin_writing(eng, "delta", text, [off_interval])
    eng.core.write("delta", ids, _content(0)(eng.core.group("delta"), np.array([off_interval])))
    eng.core.fire("delta", ids, Event.WRITE_DONE)
    assert _ids(eng, "delta", text)[off_interval] == ids[0]  # a hash hit for 80 tokens
    alone = eng.lookup(text)
    assert alone.group("attn").usable_tokens == 6 * BLOCK
    assert alone.usable_tokens == 0
    assert _reasons(alone, "delta") == {Reason.NO_CHECKPOINT}
    eng.commit(text)  # the snapshot at 64
    assert eng.lookup(text).usable_tokens == CHECKPOINT

    other = engine(QWEN)
    declared = QWEN.group("delta").layout
    other.core.set_write_layout("delta", Layout(("token", "block", "dim"), declared.alignment,
                                                declared.padding))
    other.commit(text)
    laid_out = other.lookup(text)
    assert laid_out.hit_tokens == CHECKPOINT
    assert laid_out.usable_tokens == 0
    assert Reason.LAYOUT_MISMATCH in _reasons(laid_out, "delta")


# -- 5. speculative decoding: rejected tokens' state reachable by hash -----------------------------


def test_state_covering_rejected_draft_tokens_is_never_a_hit() -> None:
    """Drafted tokens 120..160 were cached (KV blocks and the snapshot at 128), then the
    verifier accepted other tokens there. The accepted prompt's chain differs from the
    drafted one at block 7, so neither the drafted KV nor the snapshot covering drafted
    tokens is a hit for it; invalidating the rejected blocks takes them out of the hash map
    at once. A lookup with ``drop_last_block`` recomputes the last reusable block (for a
    recurrent group: back to the previous checkpoint)."""
    accepted = TEXT
    drafted = accepted.copy()
    drafted[DRAFT_FROM:] = tokens(accepted.size - DRAFT_FROM, seed=5)
    first_drafted = DRAFT_FROM // BLOCK
    eng = engine(QWEN)
    eng.commit(drafted)
    assert eng.lookup(drafted).usable_tokens == 2 * CHECKPOINT
    verdict = eng.lookup(accepted)
    assert verdict.group("delta").hit_tokens == CHECKPOINT
    assert verdict.usable_tokens == CHECKPOINT
    assert min(s.block_index for s in verdict.reasons_of(Reason.NOT_CACHED)) == first_drafted

    rejected = {"attn": _ids(eng, "attn", drafted)[first_drafted:],
                "delta": _ids(eng, "delta", drafted)[first_drafted:]}
    for group, ids in rejected.items():
        ids = ids[ids >= 0]
        eng.core.fire(group, ids, Event.INVALIDATE)
        eng.core.fire(group, ids, Event.FREE)
    for group in rejected:
        assert (_ids(eng, group, drafted)[first_drafted:] == -1).all()
    assert eng.lookup(drafted).usable_tokens == CHECKPOINT

    eng.commit(accepted)
    assert eng.lookup(accepted).usable_tokens == 2 * CHECKPOINT
    dropped = eng.lookup(accepted, drop_last_block=True)
    assert dropped.hit_tokens == 2 * CHECKPOINT
    assert dropped.usable_tokens == CHECKPOINT
    assert Reason.SPEC_DECODE_DROP in dropped.reason_set
    assert eng.core.check_invariants() == []


# -- 6. one group's allocation evicting another group's not-yet-pinned hit ----------------------


def test_an_allocation_never_evicts_a_leased_hit_and_a_lease_on_an_evicted_one_fails() -> None:
    """Device room for 12 blocks per group; one prompt holds 10 of them. Leased, its blocks
    are pinned: committing another prompt fails whole (nothing of it cached, nothing of the
    first evicted) and the lease still validates. Not yet leased, another prompt's window
    group takes the room (the first prompt's window blocks spill), and the lease then asked
    for on the earlier verdict raises LeaseLost naming that group."""
    eng = engine(GPT_OSS, device=12, host=16)
    first, second = TEXT, tokens(BLOCKS * BLOCK + 1, seed=2)
    eng.commit(first)
    with eng.lease(eng.lookup(first), first) as lease:
        with pytest.raises(StateError, match="nothing changed"):
            eng.commit(second)
        lease.validate()
        assert eng.lookup(first).usable_tokens == WHOLE
        assert eng.lookup(second).hit_tokens == 0
    verdict = eng.lookup(first)
    eng.commit(second, groups=["swa"])
    with pytest.raises(LeaseLost) as lost:
        eng.lease(verdict, first)
    assert lost.value.group == "swa"
    assert eng.leases_open == 0
    after = eng.lookup(first)
    assert after.hit_tokens == WHOLE
    assert after.usable_tokens < WHOLE
    assert Reason.NOT_RESIDENT in _reasons(after, "swa")
    assert eng.core.check_invariants() == []


# -- 7. a failed store leaving the key visible -----------------------------------------------------


def _crash_before_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src: Any, dst: Any, **kwargs: Any) -> None:
        raise OSError("crashed before the rename")

    # The disk tier publishes a value by renaming its temporary file onto the value's name.
    monkeypatch.setattr(os, "replace", crash)


@pytest.mark.parametrize("how", ["put_raises", "crash_before_rename"])
def test_a_failed_store_leaves_no_copy_to_find(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              how: str) -> None:
    """Spilling host -> disk fails (the tier raises; or the value is written but the process
    dies before publishing it under its name). The spill rolls back: each block stays on
    host, restorable from there, recording no disk copy; the disk holds no file (not even a
    temporary one) and indexes no key; an engine opened on the directory afterwards finds
    nothing to adopt."""
    where = tmp_path / "disk"
    eng, store = _disk_engine(where, wrap=_FailingPuts if how == "put_raises" else None)
    eng.commit(TEXT, payload=_content(0))
    eng.offload("attn", _ids(eng, "attn", TEXT))
    if how == "crash_before_rename":
        _crash_before_rename(monkeypatch)
    assert eng.spill_down("attn", Tier.HOST, BLOCKS) == 0
    monkeypatch.undo()
    ids = _ids(eng, "attn", TEXT)
    assert _states(eng, "attn", TEXT) == ["host"] * BLOCKS
    assert all(eng.core.describe("attn", int(i)).stored == () for i in ids.tolist())
    keys = [_key(eng, TEXT, i) for i in range(BLOCKS)]
    assert not store.contains(keys).any()
    assert list(where.iterdir()) == []
    verdict = eng.lookup(TEXT)
    assert verdict.restorable_tokens == WHOLE
    assert {step.tier for step in verdict.plan} == {Tier.HOST}
    eng.close()

    again, _ = _disk_engine(where)
    assert again.discover(TEXT) == 0
    assert again.lookup(TEXT).hit_tokens == 0
    again.close()


# -- 8. reading a chunk while it is still being written --------------------------------------------


def test_a_block_being_written_is_never_usable_readable_or_leased() -> None:
    """Blocks between write_begin and write_done are not in the hash map: not a hit, not
    readable, not pinnable. A block written again under the same hash (its earlier content
    dropped) refuses the lease of a verdict taken before the rewrite. A compressed block
    with sub-blocks missing cannot complete its write."""
    eng = engine(DENSE)
    ids = _begin_writing(eng, "attn", TEXT, range(BLOCKS))
    eng.core.write("attn", ids, _content(0)(eng.core.group("attn"), np.arange(BLOCKS)))
    writing = eng.lookup(TEXT)
    assert writing.hit_tokens == writing.usable_tokens == 0
    assert _reasons(writing, "attn") == {Reason.NOT_CACHED}
    with pytest.raises(StateError, match="writing"):
        eng.core.read("attn", ids[:1])
    with pytest.raises(StateError, match="writing"):
        eng.core.pin("attn", ids[:1])
    eng.core.fire("attn", ids, Event.WRITE_DONE)
    before = eng.lookup(TEXT)
    assert before.usable_tokens == WHOLE

    rewritten = ids[BAD:]
    eng.core.fire("attn", rewritten, Event.INVALIDATE)
    eng.core.fire("attn", rewritten, Event.FREE)
    _begin_writing(eng, "attn", TEXT, range(BAD, BLOCKS))
    assert eng.lookup(TEXT).usable_tokens == BAD * BLOCK
    with pytest.raises(LeaseLost, match=f"only {BAD * BLOCK}: not_cached at prompt block {BAD}"):
        eng.lease(before, TEXT)
    with eng.lease(eng.lookup(TEXT), TEXT) as lease:
        assert lease.tokens == BAD * BLOCK
        assert lease.blocks("attn").tolist() == ids[:BAD].tolist()

    history = engine(DEEPSEEK)
    block = _begin_writing(history, "history", LONG, [0])
    decl = history.core.group("history").decl
    assert decl.sub_blocks is not None
    width = -(-decl.payload_bytes // decl.sub_blocks)
    for sub_block in range(decl.sub_blocks - 1):  # the last sub-block never written
        history.core.write("history", block, np.ones(width, np.uint8), sub_block=sub_block)
    with pytest.raises(GuardRejected, match="all_sub_blocks_present"):
        history.core.fire("history", block, Event.WRITE_DONE)
    assert history.lookup(LONG).group("history").hit_tokens == 0
    assert eng.core.check_invariants() == history.core.check_invariants() == []


# -- 9. a stored hit serving another request's or model's KV -------------------------------------


def _other_model(eng: Engine, store: DiskTier, where: Path) -> None:
    """A whole value of another model's key, with its own bytes, under this block's name."""
    key = _key(eng, TEXT, BAD)
    foreign = attrs.evolve(key, model=model_digest(GPT_OSS, eng.core.seed))
    _write_value(_file(store, key), foreign, _row(1, eng.core.group("attn"), BAD))


def _other_request(eng: Engine, store: DiskTier, where: Path) -> None:
    """Another prompt's block file, spilled by this very engine, under this block's name."""
    other = tokens(BLOCKS * BLOCK + 1, seed=2)
    _park(eng, other, 1)
    os.replace(_file(store, _key(eng, other, BAD)), _file(store, _key(eng, TEXT, BAD)))


def _other_namespace(eng: Engine, store: DiskTier, where: Path) -> None:
    """Another tenant (another cache salt) on the same directory, same tokens: it adopts none
    of this engine's copies, and its own copy of block BAD is put under this block's name."""
    tenant, tenant_store = _disk_engine(where, salt="tenant-b")
    assert tenant.lookup(TEXT).hit_tokens == 0
    _park(tenant, TEXT, 1)
    theirs = tenant.restorer.keys.keys("attn", _ids(tenant, "attn", TEXT)[BAD:BAD + 1])[0]
    os.replace(_file(tenant_store, theirs), _file(store, _key(eng, TEXT, BAD)))
    tenant.close()


@pytest.mark.parametrize("plant", [_other_model, _other_request, _other_namespace],
                         ids=["other_model", "other_request", "other_namespace"])
def test_a_stored_copy_naming_another_key_is_refused_on_restore(
        tmp_path: Path, plant: Callable[[Engine, DiskTier, Path], None]) -> None:
    """The file under a block's name holds a whole, self-consistent value whose header names
    another model, another prefix or another cache namespace. The hash hit covers all 10
    blocks, but its load reports FOREIGN: the copy is forgotten and deleted, the usable
    prefix ends at that block, and no byte of the stranger's value is readable."""
    where = tmp_path / "disk"
    eng, store = _disk_engine(where)
    _park(eng, TEXT, 0)
    bad = int(_ids(eng, "attn", TEXT)[BAD])
    plant(eng, store, where)
    verdict, ticket = _restore(eng, TEXT)
    assert verdict.hit_tokens == WHOLE
    outcome = ticket.wait(timeout=WAIT_S)["attn"]
    assert outcome.statuses == {LoadStatus.OK.name: BLOCKS - 1, LoadStatus.FOREIGN.name: 1}
    assert outcome.lost == (bad,)
    assert _ids(eng, "attn", TEXT)[BAD] == -1
    assert not _file(store, _key(eng, TEXT, BAD)).exists()
    after = eng.lookup(TEXT)
    assert after.usable_tokens == after.hit_tokens == BAD * BLOCK
    assert _readable_rows_hold(eng, TEXT, 0) == BLOCKS - 1
    eng.close()


# -- 10. graph replay over page tables an async load is still filling ------------------------------


def test_blocks_still_loading_are_outside_what_a_graph_may_read() -> None:
    """Two blocks are being loaded back to the device. The usable prefix stops before them
    (RESTORE_IN_FLIGHT), a lease (the block table a replay reads) holds only the blocks
    before them, their bytes cannot be read, and a verdict taken before the load began is
    refused its lease. A graph too narrow for the prefix the plan will make usable gets a
    GRAPH_MISMATCH and is not replayable."""
    eng = engine(DENSE)
    eng.commit(TEXT)
    eng.register_graph(GraphSignature.of(eng.core, "wide", {"attn": BLOCKS}))
    eng.register_graph(GraphSignature.of(eng.core, "narrow", {"attn": BLOCKS // 2}))
    eng.activate_graph("wide")
    before = eng.lookup(TEXT)
    assert eng.replayable(before)
    first_loading = 4
    indices = [first_loading, first_loading + 1]
    loading = [block_id(eng, "attn", TEXT, i) for i in indices]
    for event in (Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN):
        eng.core.fire("attn", loading, event)
    during = eng.lookup(TEXT)
    assert during.hit_tokens == during.restorable_tokens == WHOLE
    assert during.usable_tokens == first_loading * BLOCK
    assert [s.block_index for s in during.reasons_of(Reason.RESTORE_IN_FLIGHT)] == indices
    assert [[e.spec_name for e in s.path] for s in during.plan] == [["restore_done"]] * 2
    with eng.lease(during, TEXT) as lease:
        assert lease.indices("attn").tolist() == list(range(first_loading))
    with pytest.raises(StateError):
        eng.core.read("attn", loading)
    with pytest.raises(LeaseLost):
        eng.lease(before, TEXT)
    eng.activate_graph("narrow")
    narrow = eng.lookup(TEXT)
    assert narrow.reasons_of(Reason.GRAPH_MISMATCH)
    assert not eng.replayable(narrow)
    assert eng.core.check_invariants() == []


# -- 11. block id versus pool slot after an offload swap ------------------------------------------


def test_a_restore_into_another_slot_keeps_the_block_id_and_refuses_old_leases() -> None:
    """A prompt's blocks are offloaded to host (a leased block is left where it is), another
    prompt takes their device slots, and restoring the first puts its blocks in other slots.
    Block ids stay the same, the core reads each from its new slot (the committed bytes),
    and a lease on the verdict taken before the swap holds the blocks as they are now (the
    prompt looked up again: still usable), at their new epochs, never the old ones."""
    eng = engine(DENSE, device=12, host=16)
    first, second = TEXT, tokens(BLOCKS * BLOCK + 1, seed=2)
    eng.commit(first, payload=_content(0))
    ids = _ids(eng, "attn", first)
    slots = [eng.core.describe("attn", int(i)).slots[Tier.DEVICE] for i in ids.tolist()]
    epochs = [eng.core.describe("attn", int(i)).epoch for i in ids.tolist()]
    before = eng.lookup(first)
    with eng.lease(before, first):
        assert eng.offload("attn", ids[:1]).tolist() == [False]
    assert eng.offload("attn", ids).all()
    eng.commit(second, payload=_content(1))
    _restore(eng, first)
    assert _ids(eng, "attn", first).tolist() == ids.tolist()
    moved = [eng.core.describe("attn", int(i)).slots[Tier.DEVICE] for i in ids.tolist()]
    assert moved != slots
    assert eng.lookup(first).usable_tokens == WHOLE
    assert _readable_rows_hold(eng, first, 0) == BLOCKS
    with eng.lease(before, first) as lease:
        assert lease.tokens == before.usable_tokens
        assert lease.blocks("attn").tolist() == ids.tolist()
        now = lease.epochs("attn").tolist()
        assert now == [eng.core.describe("attn", int(i)).epoch for i in ids.tolist()]
        assert all(new != old for new, old in zip(now, epochs, strict=True))
        lease.validate()


# -- 12. block-first versus K/V-first layout ------------------------------------------------------


@pytest.mark.parametrize(("written", "read"), [(BLOCK_FIRST, KV_FIRST), (KV_FIRST, BLOCK_FIRST)],
                         ids=["kernel_reads_kv_first", "blocks_written_kv_first"])
def test_blocks_of_another_dim_order_are_unusable_in_their_group(written: Layout,
                                                                 read: Layout) -> None:
    """The shipped dense model's blocks, written in one dim order and read by a kernel that
    declares the other: every block is a hash hit, none is usable (LAYOUT_MISMATCH from the
    first block), and a kernel reading the order they were written in uses them all."""
    eng = Engine("dense", CoreConfig(device_blocks=2 * BLOCKS, host_blocks=0,
                                     backend="numpy"))
    eng.core.set_write_layout("attn", written)
    eng.commit(TEXT)
    verdict = eng.lookup(TEXT, kernel_layouts={"attn": read})
    assert verdict.hit_tokens == WHOLE
    assert verdict.group("attn").usable_tokens == verdict.usable_tokens == 0
    assert _reasons(verdict, "attn") == {Reason.LAYOUT_MISMATCH}
    assert verdict.reasons_of(Reason.LAYOUT_MISMATCH)[0].block_index == 0
    assert eng.lookup(TEXT, kernel_layouts={"attn": written}).usable_tokens == WHOLE


# -- 13. a read finishing after its lease expired ----------------------------------------------


def test_a_read_after_the_lease_expired_is_refused() -> None:
    """An engine whose leases run on a clock the test moves: validate passes until the ttl
    runs out, then raises LeaseLost and releases the pins, so the blocks may go; a lease no
    one validates is released by the engine's next call; a lease from a fresh lookup is
    granted again."""
    ttl_s = 2.0
    clock = _Clock()
    eng = Engine(DENSE, CoreConfig(device_blocks=64, host_blocks=16, backend="numpy"),
                 lease_clock=clock)
    eng.commit(TEXT)
    prompt: Prompt = eng.prompt(TEXT)
    lease = eng.lease(eng.lookup(prompt), prompt, ttl_s=ttl_s)
    lease.validate()  # the read starts in time
    clock.now += ttl_s / 2
    lease.validate()
    assert int(eng.core.group("attn").pins.sum()) == BLOCKS
    clock.now += ttl_s / 2  # ... and finishes after the ttl
    assert lease.expired
    with pytest.raises(LeaseLost, match="expired"):
        lease.validate()
    assert eng.leases_open == 0
    assert int(eng.core.group("attn").pins.sum()) == 0
    first = block_id(eng, "attn", TEXT, 0)
    assert eng.core.fire("attn", [first], Event.EVICT).all()
    eng.commit(TEXT)
    abandoned = eng.lease(eng.lookup(prompt), prompt, ttl_s=ttl_s)
    clock.now += ttl_s  # its reader died: the next call gives its pins back
    assert eng.lookup(prompt).usable_tokens == WHOLE
    assert eng.leases_open == 0 and abandoned.expired
    assert int(eng.core.group("attn").pins.sum()) == 0
    with eng.lease(eng.lookup(prompt), prompt, ttl_s=ttl_s) as again:
        again.validate()
    assert eng.core.check_invariants() == []


# -- 14. the same token ids standing for other KV (adapter, tenant, image) ------------------------


def test_the_same_tokens_under_another_adapter_tenant_or_image_are_never_a_hit(
        tmp_path: Path) -> None:
    """Two requests with the same token ids need different KV when one runs another LoRA
    adapter, belongs to another tenant, or has another image behind its placeholder tokens.
    TEXT cached under adapter ``lora-a`` and parked on disk is no hit for the base model or
    for ``lora-b``, before and after a restart over the same disk; it is restored whole for
    ``lora-a``. TEXT with image 1 behind tokens ``[20, 40)`` is a hit with image 2 there only
    for block 0, the block before the image."""
    where = tmp_path / "disk"
    eng, _ = _disk_engine(where)
    lora_a = eng.prompt(TEXT, namespace="lora-a")
    eng.commit(lora_a, payload=_content(0))
    eng.offload("attn", eng.core.lookup_words("attn", *lora_a.words(BLOCK)))
    assert eng.spill_down("attn", Tier.HOST, BLOCKS) == BLOCKS
    for other in (eng.prompt(TEXT), eng.prompt(TEXT, namespace="lora-b")):
        verdict = eng.lookup(other)
        assert (verdict.hit_tokens, verdict.usable_tokens, verdict.restorable_tokens) == \
            (0, 0, 0)
    image_1 = eng.prompt(TEXT, content_keys=[(20, 40, "image-1")])
    eng.commit(image_1, payload=_content(1))
    image_2 = eng.lookup(eng.prompt(TEXT, content_keys=[(20, 40, "image-2")]))
    assert image_2.hit_tokens == image_2.usable_tokens == BLOCK
    assert eng.lookup(image_1).usable_tokens == WHOLE
    eng.close()
    again, _ = _disk_engine(where)  # a restart: the disk tier indexes its files again
    assert again.lookup(again.prompt(TEXT, namespace="lora-b")).hit_tokens == 0
    assert again.lookup(again.prompt(TEXT)).hit_tokens == 0
    prompt = again.prompt(TEXT, namespace="lora-a")
    verdict = again.lookup(prompt)
    assert verdict.restorable_tokens == WHOLE
    again.restore(verdict, prompt).wait(timeout=WAIT_S)
    assert again.lookup(prompt).usable_tokens == WHOLE
    rows = again.core.read("attn", again.core.lookup_words("attn", *prompt.words(BLOCK)))
    state = again.core.group("attn")
    for index, row in enumerate(rows):
        assert np.array_equal(row, _row(0, state, index)), f"block {index}: wrong bytes"
    again.close()
