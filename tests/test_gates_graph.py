"""Gate 4, static graph topology: a verdict is replayable on a captured graph only when its
usable prefix and restore plan fit the graph's signature, dimension by dimension."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from kvfsm import Engine, KvfsmError
from kvfsm.gates import GraphSignature, GraphVerdict, SignatureError
from kvfsm.lookup import Reason, Verdict
from kvfsm.spec import Layout, Tier
from tests.lookup_models import DEEPSEEK, DENSE, block_id, engine, tokens

TEXT = tokens(161)  # 10 complete blocks of 16 on the dense model; 160 tokens usable
OTHER_LAYOUT = Layout(("token", "block", "dim"), alignment=256, padding=0)


def _dense() -> Engine:
    eng = engine(DENSE)
    eng.commit(eng.prompt(TEXT))
    return eng


def _signature(eng: Engine, name: str = "decode", **changes: Any) -> GraphSignature:
    """The dense engine's own signature (10 blocks of ``attn``), with ``changes`` applied."""
    base = GraphSignature.of(eng.core, name, {"attn": 10})
    return GraphSignature(name, [attrs.evolve(base.group("attn"), **changes)])


def _under(eng: Engine, signature: GraphSignature) -> Verdict:
    eng.register_graph(signature)
    eng.activate_graph(signature.name)
    return eng.lookup(TEXT)


def _mismatches(verdict: Verdict) -> tuple[str, ...]:
    return tuple(s.detail for s in verdict.reasons_of(Reason.GRAPH_MISMATCH))


def _spill(eng: Engine, *indices: int) -> None:
    ids = [block_id(eng, "attn", TEXT, i) for i in indices]
    eng.core.fire("attn", ids, "spill_begin")
    eng.core.fire("attn", ids, "spill_done")


# -- fits ----------------------------------------------------------------------------------


def test_a_verdict_that_fits_is_unchanged_and_replayable() -> None:
    eng = _dense()
    eager = eng.lookup(TEXT)
    assert not eng.replayable(eager)  # no graph active: nothing to replay
    signature = _signature(eng)
    verdict = _under(eng, signature)
    assert isinstance(verdict, GraphVerdict) and verdict.graph == signature
    for field in ("hit_tokens", "usable_tokens", "restorable_tokens", "reasons", "plan"):
        assert getattr(verdict, field) == getattr(eager, field), field
    assert verdict.replayable and eng.replayable(verdict)
    assert eng.graphs == {"decode": signature} and eng.active_graph == signature


def test_exactly_max_blocks_fits() -> None:
    eng = _dense()
    assert eng.replayable(_under(eng, _signature(eng, max_blocks=10)))


def test_a_restore_plan_that_lands_on_the_device_fits_a_device_graph() -> None:
    """Blocks spilled to the host are read from the device once the plan restored them."""
    eng = _dense()
    _spill(eng, 2, 5)
    verdict = _under(eng, _signature(eng))
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (32, 160)
    assert verdict.plan and eng.replayable(verdict)


def test_a_model_with_three_groups_fits_its_own_signature() -> None:
    eng = engine(DEEPSEEK)
    text = tokens(321)
    eng.commit(eng.prompt(text))
    signature = GraphSignature.of(eng.core, "decode", {"history": 5, "swa": 20, "index": 20})
    eng.register_graph(signature)
    eng.activate_graph("decode")
    verdict = eng.lookup(text)
    assert verdict.usable_tokens == 320 and eng.replayable(verdict)


# -- does not fit, one dimension at a time -------------------------------------------------


def _assert_mismatch(verdict: Verdict, eng: Engine, *words: str) -> None:
    details = _mismatches(verdict)
    assert details, verdict.reasons
    assert all("eager only, or re-plan" in d for d in details)
    assert any(all(w in d for w in words) for d in details), details
    assert not eng.replayable(verdict)
    assert verdict.usable_tokens == 160  # eagerly still usable: the numbers do not change


def test_too_many_blocks_for_the_graph() -> None:
    eng = _dense()
    _assert_mismatch(_under(eng, _signature(eng, max_blocks=9)), eng, "at most 9", "need 10")


def test_a_restore_plan_needing_more_blocks_than_the_graph_reads() -> None:
    """The usable prefix (2 blocks) fits, the prefix after the plan (10) does not."""
    eng = _dense()
    _spill(eng, 2)
    verdict = _under(eng, _signature(eng, max_blocks=5))
    assert (verdict.usable_tokens, verdict.restorable_tokens) == (32, 160)
    assert any("need 10" in d for d in _mismatches(verdict))
    assert not eng.replayable(verdict)


def test_a_tier_the_graph_does_not_read() -> None:
    eng = _dense()
    verdict = _under(eng, _signature(eng, tiers=[Tier.HOST]))
    _assert_mismatch(verdict, eng, "from ['host']", "read from device")
    blocks = [s.block_index for s in verdict.reasons_of(Reason.GRAPH_MISMATCH)]
    assert blocks == list(range(10))


def test_a_layout_the_graph_does_not_read() -> None:
    """Blocks written under another layout (the engine switched kernels) are usable by a
    kernel reading that layout, but not by a graph captured for the declared one."""
    eng = engine(DENSE)
    eng.core.set_write_layout("attn", OTHER_LAYOUT)
    eng.commit(eng.prompt(TEXT))
    signature = _signature(eng, layouts=[DENSE.group("attn").layout])  # the declared one
    eng.register_graph(signature)
    eng.activate_graph("decode")
    verdict = eng.lookup(TEXT, kernel_layouts={"attn": OTHER_LAYOUT})
    _assert_mismatch(verdict, eng, "reads layouts", "token', 'block'")
    both = _signature(eng, "both", layouts=[DENSE.group("attn").layout, OTHER_LAYOUT])
    eng.register_graph(both)
    eng.activate_graph("both")
    assert eng.replayable(eng.lookup(TEXT, kernel_layouts={"attn": OTHER_LAYOUT}))


@pytest.mark.parametrize(("change", "words"), [
    ({"dtype": "float32"}, ("dtype 'float32'", "has 'float16'")),
    ({"page_size": 32}, ("page size", "32", "has 16")),
    ({"alignment": 512}, ("alignment (bytes) 512", "has 256")),
])
def test_a_pool_the_graph_was_not_captured_against(change: dict[str, Any],
                                                   words: tuple[str, ...]) -> None:
    eng = _dense()
    _assert_mismatch(_under(eng, _signature(eng, **change)), eng, *words)


def test_a_verdict_checked_against_another_graph_is_not_replayable() -> None:
    eng = _dense()
    fits = _under(eng, _signature(eng))
    eng.register_graph(_signature(eng, "other"))
    eng.activate_graph("other")
    assert not eng.replayable(fits)
    eng.activate_graph(None)
    assert not eng.replayable(fits)
    assert type(eng.lookup(TEXT)) is Verdict  # eager: plain verdicts again


# -- registration errors -------------------------------------------------------------------


@pytest.mark.parametrize(("build", "words"), [
    (lambda sig: attrs.evolve(sig.group("attn"), max_blocks=-1), ("'attn'", "max_blocks")),
    (lambda sig: attrs.evolve(sig.group("attn"), page_size=0), ("'attn'", "page_size")),
    (lambda sig: attrs.evolve(sig.group("attn"), alignment=3), ("'attn'", "power of two")),
    (lambda sig: attrs.evolve(sig.group("attn"), dtype="bfloat8"), ("unknown dtype",)),
    (lambda sig: attrs.evolve(sig.group("attn"), tiers=["disk"]), ("stored tier 'disk'",)),
    (lambda sig: attrs.evolve(sig.group("attn"), tiers=["nvme"]), ("unknown tier 'nvme'",)),
    (lambda sig: attrs.evolve(sig.group("attn"), tiers=[]), ("tiers is empty",)),
    (lambda sig: attrs.evolve(sig.group("attn"), layouts=[]), ("layouts is empty",)),
    (lambda sig: attrs.evolve(sig.group("attn"), layouts=["block"]), ("Layout values",)),
    (lambda sig: GraphSignature("", sig.groups), ("name",)),
    (lambda sig: GraphSignature("twice", [*sig.groups, *sig.groups]), ("named twice",)),
    (lambda sig: GraphSignature("none", []), ("names no group",)),
])
def test_malformed_signatures_are_refused_when_built(build: Any, words: tuple[str, ...]) -> None:
    eng = _dense()
    with pytest.raises(SignatureError) as caught:
        build(_signature(eng))
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert issubclass(SignatureError, KvfsmError)


@pytest.mark.parametrize(("build", "words"), [
    (lambda sig: GraphSignature("g", [attrs.evolve(sig.group("attn"), group="mla")]),
     ("graph signature 'g'", "unknown group 'mla'", "['attn']")),
    (lambda sig: GraphSignature("g", [*sig.groups,
                                      attrs.evolve(sig.group("attn"), group="swa")]),
     ("unknown group 'swa'",)),
    (lambda sig: GraphSignature("g", [attrs.evolve(sig.group("attn"),
                                                   layouts=[OTHER_LAYOUT])]),
     ("group 'attn'", "unknown layout")),
    (lambda sig: GraphSignature("g", [attrs.evolve(sig.group("attn"),
                                                   tiers=[Tier.DEVICE, Tier.HOST])]),
     ("group 'attn' has no host pool",)),
])
def test_signatures_that_do_not_match_the_model_register_nothing(
        build: Any, words: tuple[str, ...]) -> None:
    eng = engine(DENSE, host=0)
    eng.commit(eng.prompt(TEXT))
    with pytest.raises(SignatureError) as caught:
        eng.register_graph(build(_signature(eng)))
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert dict(eng.graphs) == {} and eng.active_graph is None


def test_a_signature_must_name_every_group() -> None:
    eng = engine(DEEPSEEK)
    full = GraphSignature.of(eng.core, "g", {"history": 4})
    with pytest.raises(SignatureError, match=r"no signature for groups \['index'\]"):
        eng.register_graph(GraphSignature("g", full.groups[:2]))
    assert dict(eng.graphs) == {}


def test_names_are_unique_and_activation_names_a_registered_graph() -> None:
    eng = _dense()
    first = _signature(eng)
    eng.register_graph(first)
    with pytest.raises(SignatureError, match="'decode' is already registered"):
        eng.register_graph(_signature(eng, max_blocks=3))
    assert eng.graphs["decode"] is first
    with pytest.raises(SignatureError, match=r"no graph signature 'prefill'; .*\['decode'\]"):
        eng.activate_graph("prefill")
    assert eng.active_graph is None
    with pytest.raises(SignatureError, match="GraphSignature"):
        eng.register_graph("decode")  # type: ignore[arg-type]


def test_tiers_may_be_named() -> None:
    eng = _dense()
    assert _signature(eng, tiers=["device"]).group("attn").tiers == frozenset({Tier.DEVICE})
    assert np.array_equal(sorted(_signature(eng, tiers=["DEVICE", Tier.HOST])
                                 .group("attn").tiers), [Tier.DEVICE, Tier.HOST])
