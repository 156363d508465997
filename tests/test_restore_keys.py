"""Stored-tier keys: the same prefix of the same model under the same layout is the same key in
every engine; another model, group, layout or prefix is another key."""

from __future__ import annotations

import attrs
import numpy as np

from kvfsm import CoreConfig, Engine, ModelDecl, shipped_models
from kvfsm.restore import KeyMaker
from kvfsm.spec import Layout

DENSE = shipped_models()["dense"]


def _engine(model: ModelDecl = DENSE, salt: str = "") -> Engine:
    return Engine(model, CoreConfig(device_blocks=8, backend="numpy", cache_salt=salt))


def _keys(engine: Engine, tokens: np.ndarray) -> list[str]:
    prompt = engine.prompt(tokens)
    engine.commit(prompt)
    high, low = prompt.words(engine.model.group("attn").block_size)
    ids = engine.core.lookup_words("attn", high, low)
    return [key.name for key in KeyMaker(engine.core).keys("attn", ids)]


def test_two_engines_of_one_model_name_a_prefix_alike() -> None:
    tokens = np.arange(64)
    first, second = _keys(_engine(), tokens), _keys(_engine(), tokens)
    assert first == second
    assert len(set(first)) == len(first)  # every block its own key


def test_the_keys_a_lookup_asks_for_are_the_keys_blocks_are_stored_under() -> None:
    engine = _engine()
    prompt = engine.prompt(np.arange(48))
    engine.commit(prompt)
    high, low = prompt.words(engine.model.group("attn").block_size)
    ids = engine.core.lookup_words("attn", high, low)
    maker = KeyMaker(engine.core)
    assert maker.prompt_keys("attn", high, low, range(ids.size)) == maker.keys("attn", ids)


def test_another_model_salt_prefix_or_layout_is_another_key() -> None:
    tokens = np.arange(64)
    base = _keys(_engine(), tokens)
    renamed = _keys(_engine(attrs.evolve(DENSE, name="dense_other")), tokens)
    salted = _keys(_engine(salt="tenant-b"), tokens)
    shifted = _keys(_engine(), tokens + 1)
    assert not set(base) & (set(renamed) | set(salted) | set(shifted))
    engine = _engine()
    layout = engine.model.group("attn").layout
    engine.core.set_write_layout("attn", Layout(layout.dim_order, layout.alignment,
                                                layout.padding + 64))
    assert not set(base) & set(_keys(engine, tokens))
