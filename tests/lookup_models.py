"""Small model declarations and helpers shared by the verdict tests."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

from kvfsm import Engine, KvfsmError, Lease
from kvfsm.lookup import DeviceProfile, Level, Verdict
from kvfsm.lookup._group_eval import GroupEval, _new_eval
from kvfsm.lookup._spans import Spans
from kvfsm.lookup._statics import statics_for
from kvfsm.spec import Event, Layout, ModelDecl, Tier, parse_model
from kvfsm.state import NO_TARGET, CoreConfig, GroupState
from tests.strategies import legal_events

LAYOUT = """
[groups.layout]
dim_order = ["block", "token", "dim"]
alignment = 256
padding = 0
"""


def group(name: str, kind: str, lifecycle: str, block: int, extra: str = "") -> str:
    return f"""
[[groups]]
name = "{name}"
kind = "{kind}"
lifecycle = "{lifecycle}"
block_size = {block}
shape = [{block}, 8]
dtype = "float16"
{extra}
{LAYOUT}"""


def model(name: str, *groups: str) -> ModelDecl:
    text = f'[model]\nname = "{name}"\ndescription = "test"\nlayout_version = 1\n' + \
        "".join(groups)
    return parse_model(text, source=f"<{name}>")


FULL = group("attn", "full", "full_kv", 16)
SWA = group("swa", "sliding_window", "sliding_window", 16, "window = 64")
HISTORY = group("history", "compressed", "compressed", 64, "sub_blocks = 4")
INDEX = group("index", "sparse_index", "sparse_index", 16,
              'target_group = "history"\ntop_k = 4')
DELTA = group("delta", "recurrent", "recurrent", 16, "checkpoint_interval = 64")
WIDE = group("wide", "full", "full_kv", 24)

DENSE = model("t_dense", FULL)
SWA_ONLY = model("t_swa", SWA)
GPT_OSS = model("t_gpt_oss", FULL, SWA)
TWO_SIZES = model("t_two_sizes", FULL, WIDE)
QWEN = model("t_qwen", FULL, DELTA)
DEEPSEEK = model("t_deepseek", HISTORY, SWA, INDEX)
#: Compressed history and a window, no index pointing into the history.
HISTORY_SWA = model("t_history_swa", HISTORY, SWA)
FOUR = model("t_four", HISTORY, SWA, INDEX, DELTA)


def engine(decl: ModelDecl, device: int = 64, host: int = 16) -> Engine:
    return Engine(decl, CoreConfig(device_blocks=device, host_blocks=host, backend="numpy"))


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def block_id(eng: Engine, group: str, prompt_tokens: np.ndarray, index: int) -> int:
    """The id of block ``index`` of ``group`` for a prompt (must be cached)."""
    prompt = eng.prompt(prompt_tokens)
    size = eng.core.group(group).decl.block_size
    high, low = prompt.words(size)
    found = int(eng.core.lookup_words(group, high[index : index + 1], low[index : index + 1])[0])
    assert found >= 0, f"{group} block {index} not cached"
    return found


EVENTS = [Event.EVICT, Event.SPILL_BEGIN, Event.SPILL_DONE, Event.RESTORE_BEGIN,
          Event.RESTORE_DONE, Event.RESTORE_FAIL, Event.COMPRESS_BEGIN, Event.INVALIDATE]
#: Prompts the random drives commit and look up: equal first tokens, so their chains share.
PROMPTS = [np.concatenate([tokens(64, seed=9), tokens(257, seed=s)]) for s in range(3)]


#: Every operation :func:`drive` can draw (by default).
DRIVE_OPS = ("commit", "event", "offload", "corrupt", "flip", "profile", "scramble")
#: With blocks moved to host through the engine (what a plan restores) drawn more often.
PLAN_OPS = (*DRIVE_OPS, "offload")


def drive(eng: Engine, data: st.DataObject, steps: int,
          ops: Sequence[str] = DRIVE_OPS) -> set[str]:
    """Take ``eng`` through ``steps`` random operations of ``ops``: commits of prompt
    prefixes, lifecycle events on live blocks, blocks moved to host (``Engine.offload``, a
    copy and its spill, or an eviction to a stored copy), host copies corrupted on purpose, device
    profiles stricter than the pools, bits flipped in device memory under readable blocks
    (silent corruption no fire sees), and index references scrambled behind the core's back
    (a stale, dead, foreign or unused target; the core's invariants then rightly fail).
    Returns the operations drawn."""
    drawn: set[str] = set()
    for _ in range(steps):
        op = data.draw(st.sampled_from(list(ops)), label="op")
        drawn.add(op)
        name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
        group = eng.core.group(name)
        if op == "commit":
            text = data.draw(st.sampled_from(PROMPTS), label="prompt")
            cut = data.draw(st.integers(1, text.size), label="cut")
            # Pools may fill up: the groups committed before the refusal stay, consistently.
            with contextlib.suppress(KvfsmError):
                eng.commit(eng.prompt(text[:cut]))
        elif op == "offload":
            held = np.flatnonzero(group.slot[Tier.DEVICE] != -1)
            if held.size:
                chosen = data.draw(st.lists(st.sampled_from(held.tolist()), min_size=1,
                                            max_size=6, unique=True), label="offloaded")
                eng.offload(name, chosen)
        elif op == "event":
            live = np.flatnonzero(group.states != group.table.initial)
            if live.size:
                block = int(data.draw(st.sampled_from(live.tolist()), label="block"))
                with contextlib.suppress(KvfsmError):
                    eng.core.fire(name, [block], data.draw(st.sampled_from(EVENTS)))
        elif op == "corrupt":
            held = np.flatnonzero(group.slot[Tier.HOST] != -1) if Tier.HOST in group.slot \
                else np.zeros(0, dtype=np.intp)
            if held.size:
                block = int(data.draw(st.sampled_from(held.tolist()), label="block"))
                group.pools[Tier.HOST].data[int(group.slot[Tier.HOST][block]), 0] ^= 0xFF
        elif op == "flip":
            held = np.flatnonzero(group.slot[Tier.DEVICE] != -1)
            if held.size:
                block = int(data.draw(st.sampled_from(held.tolist()), label="block"))
                byte = data.draw(st.integers(0, group.decl.payload_bytes - 1), label="byte")
                group.pools[Tier.DEVICE].data[int(group.slot[Tier.DEVICE][block]), byte] ^= 0x04
        elif op == "profile":
            eng.profile = DeviceProfile(
                "drawn", base_alignment=data.draw(st.sampled_from([64, 256, 4096, 1 << 16])),
                size_alignment=data.draw(st.sampled_from([1, 16, 512])))
        elif group.target is not None:
            live = np.flatnonzero(group.states != group.table.initial)
            if live.size:
                block = int(data.draw(st.sampled_from(live.tolist()), label="block"))
                slot = data.draw(st.integers(0, group.refs_target.shape[1] - 1), label="ref")
                # Mostly real targets, sometimes outside the target group (corrupt metadata).
                group._blocks.refs_target[block, slot] = data.draw(
                    st.integers(NO_TARGET, group.target.n_blocks - 1)
                    | st.sampled_from([-5, group.target.n_blocks, 1 << 30]), label="target")
                group._blocks.refs_epoch[block, slot] = data.draw(st.integers(0, 3), label="epoch")
    return drawn


def history_by_hand(eng: Engine, text: np.ndarray, compress: dict[int, str]) -> None:
    """Commit the other groups, and the history with chosen blocks left raw or
    mid-compression (the engine's commit would compress them)."""
    prompt = eng.prompt(text)
    core = eng.core
    high, low = prompt.words(64)
    ids = core.allocate("history", np.arange(high.size), high, low)
    core.fire("history", ids, Event.WRITE_BEGIN)
    core.write("history", ids, np.zeros((ids.size, core.group("history").decl.payload_bytes),
                                        np.uint8))
    core.fire("history", ids, Event.WRITE_DONE)
    for index, block in enumerate(ids.tolist()):
        how = compress.get(index, "compressed")
        if how in ("compressing", "compressed"):
            core.fire("history", [block], Event.COMPRESS_BEGIN)
        if how == "compressed":
            core.fire("history", [block], Event.COMPRESS_DONE)
    others = [g for g in core.groups if g != "history"]
    if others:
        eng.commit(prompt, groups=others)


def same_holdings_then_released(first: Lease, second: Lease) -> None:
    """``first`` and ``second`` hold the same blocks, prompt indices and epochs in every
    group; both validate, and both are released."""
    assert first.groups == second.groups
    for name in first.groups:
        assert first.blocks(name).tolist() == second.blocks(name).tolist()
        assert first.indices(name).tolist() == second.indices(name).tolist()
        assert first.epochs(name).tolist() == second.epochs(name).tolist()
    first.validate()
    second.validate()
    first.release()
    second.release()


def fire_legal(eng: Engine, data: st.DataObject, steps: int) -> None:
    """Fire ``steps`` events, each one the spec has a row for in its block's state (spills,
    restores, compressions begun and finished or failed, evictions), on live blocks."""
    for _ in range(steps):
        name = data.draw(st.sampled_from(sorted(eng.core.groups)), label="group")
        group = eng.core.group(name)
        live = np.flatnonzero(group.states != group.table.initial)
        if not live.size:
            continue
        block = int(data.draw(st.sampled_from(live.tolist()), label="block"))
        events = legal_events(group.table.lifecycle,
                              group.table.state_name(int(group.states[block])))
        if events:
            with contextlib.suppress(KvfsmError):  # a guard refused it: nothing changed
                eng.core.fire(name, [block], data.draw(st.sampled_from(events), label="event"))


def reached(data: st.DataObject, decl: ModelDecl, steps: int = 10, legal: int = 12
            ) -> tuple[Engine, np.ndarray]:
    """An engine of ``decl`` in a state drawn from what its API can reach (a prompt cached
    whole, in part or not at all, then up to ``steps`` random operations of :func:`drive` and
    up to ``legal`` events of :func:`fire_legal`), and the prompt text drawn."""
    eng = engine(decl, device=data.draw(st.sampled_from([16, 64]), label="device blocks"))
    text = data.draw(st.sampled_from(PROMPTS), label="prompt")
    text = text[: data.draw(st.integers(1, text.size), label="cut")]
    if data.draw(st.booleans(), label="committed first"):
        with contextlib.suppress(KvfsmError):
            eng.commit(eng.prompt(text[: data.draw(st.integers(1, text.size), label="kept")]))
    drive(eng, data, data.draw(st.integers(0, steps), label="steps"))
    fire_legal(eng, data, data.draw(st.integers(0, legal), label="legal events"))
    return eng, text


def spilled_miss() -> tuple[Engine, Verdict, list[int]]:
    """A DENSE engine whose 60-block prompt was cached up to block 30, blocks 5..24 of it
    since spilled to host; the lookup of that prompt and the spilled blocks' ids."""
    eng = engine(DENSE, device=64, host=32)
    text = tokens(60 * 16 + 1)
    eng.commit(eng.prompt(text[: 30 * 16]))
    spilled = [block_id(eng, "attn", text, index) for index in range(5, 25)]
    for event in ("spill_begin", "spill_done"):
        eng.core.fire("attn", spilled, event)
    return eng, eng.lookup(text), spilled


def group_eval(group: GroupState, high: np.ndarray, low: np.ndarray, lengths: np.ndarray, *,
               level: Level, kernel_layout: Layout | None = None,
               profile: DeviceProfile | None = None, history: GroupEval | None = None,
               checksums: bool = True) -> GroupEval:
    """One group's evaluation of the prompt words ``high``/``low`` over candidate ``lengths``
    (``history``: an index's target group's evaluation), as a lookup makes it."""
    profile = DeviceProfile() if profile is None else profile
    words = (np.require(high, np.uint64, ["C", "W"]), np.require(low, np.uint64, ["C", "W"]))
    evaluation: GroupEval = _new_eval(GroupEval)
    evaluation._evaluate(
        group, words, lengths, level, profile, history, checksums,
        Spans(group.rule.needed(group.decl, lengths), words[0].size),
        statics_for(group, kernel_layout or group.decl.layout, profile), group.budget.capped)
    return evaluation
