"""A verdict explained when first read (``kvfsm.lookup._explained``): its groups, reasons and
plan say what was so at the lookup, whatever changed since, and it is a value like any
Verdict."""

from __future__ import annotations

import gc
import pickle
import threading
import weakref

import attrs
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.lookup import Level, Reason, Verdict
from kvfsm.lookup._explained import ExplainedLater, explained_later
from kvfsm.spec import ModelDecl
from tests.lookup_models import DENSE, drive, engine, fire_legal, reached, spilled_miss, tokens
from tests.test_lookup_why import MODELS


@settings(deadline=None)
@given(data=st.data(), decl=st.sampled_from(MODELS),
       level=st.sampled_from([Level.FULL, Level.STANDARD]))
def test_an_explanation_read_later_says_what_was_so_at_the_lookup(
        data: st.DataObject, decl: ModelDecl, level: Level) -> None:
    """On any reachable state: two lookups of one prompt, the first explained at once and the
    second only after the core changed again (random commits, lifecycle events, corruption,
    scrambled references): both verdicts are equal in every field, groups, reasons and plan
    included, as they were at the lookups."""
    eng, text = reached(data, decl, steps=6, legal=8)
    prompt = eng.prompt(text)
    now = eng.lookup(prompt, level=level)
    later = eng.lookup(prompt, level=level)
    explained_now = (now.groups, now.reasons, now.plan)
    drive(eng, data, data.draw(st.integers(1, 6), label="steps after"))
    fire_legal(eng, data, data.draw(st.integers(1, 12), label="legal events after"))
    assert (later.groups, later.reasons, later.plan) == explained_now
    assert later == now


def test_a_shortfall_is_explained_later_and_a_full_hit_is_a_plain_verdict() -> None:
    """A lookup with something to explain answers an ExplainedLater; a full hit, nothing to
    explain, a plain Verdict."""
    _engine, verdict, _ = spilled_miss()
    assert isinstance(verdict, ExplainedLater) and isinstance(verdict, Verdict)
    assert verdict.reasons_of(Reason.NOT_RESIDENT)[0].block_index == 5
    full = engine(DENSE)
    text = tokens(100)
    full.commit(full.prompt(text))
    assert type(full.lookup(text)) is Verdict


def test_an_explained_later_verdict_is_a_value_like_any_verdict() -> None:
    """Equal to, hashed and shown as a plain Verdict of the same fields; ``attrs.evolve``,
    ``attrs.asdict`` and pickling see its explanation."""
    _engine, verdict, _ = spilled_miss()
    fields = {field.name: getattr(verdict, field.name) for field in attrs.fields(Verdict)}
    plain = Verdict(**fields)
    assert verdict == plain and plain == verdict and (verdict != plain) is False
    assert hash(verdict) == hash(plain)
    assert repr(verdict) == repr(plain) and repr(verdict).startswith("Verdict(")
    assert attrs.asdict(verdict, recurse=False)["plan"] == plain.plan
    assert attrs.evolve(verdict, recompute_from=0).plan == plain.plan
    # Pickled before its explanation was read (a lookup's probe holds a weak reference to
    # its core and is never pickled: here a verdict without one).
    eager = {name: value for name, value in fields.items()
             if name not in ("groups", "reasons", "plan")}
    unread = explained_later(eager | {"probe": None},
                             lambda: (plain.groups, plain.reasons, plain.plan))
    copied = pickle.loads(pickle.dumps(unread))
    assert copied == attrs.evolve(plain, probe=None) and copied.reasons == plain.reasons
    assert verdict != attrs.evolve(plain, usable_tokens=plain.usable_tokens + 16)
    assert verdict.__eq__(object()) is NotImplemented


def test_explaining_once_is_enough() -> None:
    """Reading the explanation twice gives the same objects: it is made once."""
    _engine, verdict, _ = spilled_miss()
    assert verdict.plan is verdict.plan and verdict.reasons is verdict.reasons
    assert np.array_equal([step.block_index for step in verdict.plan], np.arange(5, 25))


def test_threads_reading_an_explanation_while_the_core_changes_agree() -> None:
    """Several threads read one verdict's explanation for the first time at once while
    another restores the blocks it names: every reader sees the explanation of the lookup's
    moment, equal to one read at once."""
    eng, first, spilled = spilled_miss()
    assert first.probe is not None
    prompt = first.probe.prompt  # the prompt the lookup read
    expected = (first.groups, first.reasons, first.plan)
    unread = eng.lookup(prompt)
    start = threading.Barrier(5)
    seen: list[tuple[object, ...]] = []

    def reader() -> None:
        start.wait()
        seen.append((unread.groups, unread.reasons, unread.plan))

    def restorer() -> None:
        start.wait()
        for event in ("restore_begin", "restore_done"):
            with eng.lock:
                eng.core.fire("attn", spilled, event)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    threads.append(threading.Thread(target=restorer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [expected] * 4
    assert eng.lookup(prompt).usable_tokens > unread.usable_tokens  # restored since


def test_a_verdict_explained_later_does_not_keep_its_engine_alive() -> None:
    """An engine closed and dropped while a verdict of it is still unexplained is freed; the
    verdict explains itself from its snapshot afterwards."""
    eng, verdict, spilled = spilled_miss()
    core = weakref.ref(eng.core)
    eng.close()
    del eng
    gc.collect()
    assert core() is None
    assert [s.block_id for s in verdict.reasons_of(Reason.NOT_RESIDENT)] == spilled[:16]
    assert [step.block_id for step in verdict.plan] == spilled
