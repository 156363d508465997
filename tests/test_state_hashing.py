"""PrefixHashes and the seed: chained block identities of a token sequence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvfsm import TokenError
from kvfsm.state import PrefixHashes, hash_seed, join_words, split_digest

SEED = hash_seed("m", 1)
TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=120)
BLOCK = st.integers(1, 17)
#: Model names come from spec files: no NUL (the seed's separator) and no lone surrogates.
NAME_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")


def _hashes(tokens: list[int] | np.ndarray, block_size: int, seed: bytes = SEED) -> PrefixHashes:
    prefix = PrefixHashes(seed, block_size)
    prefix.extend(tokens)
    return prefix


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, block_size=BLOCK, cuts=st.lists(st.integers(0, 120), max_size=6))
def test_extending_in_pieces_equals_extending_at_once(
    tokens: list[int], block_size: int, cuts: list[int]
) -> None:
    """However the tokens are split into extend calls (empty pieces included), the block hashes,
    keys and counts are the same as one extend of them all."""
    whole = _hashes(tokens, block_size)
    pieces = PrefixHashes(SEED, block_size)
    bounds = [0, *sorted(min(c, len(tokens)) for c in cuts), len(tokens)]
    for start, stop in itertools.pairwise(bounds):
        pieces.extend(tokens[start:stop])
    assert pieces.keys() == whole.keys()
    assert (pieces.n_tokens, pieces.n_blocks) == (whole.n_tokens, whole.n_blocks)
    for got, want in zip(pieces.words(), whole.words(), strict=True):
        assert np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, block_size=BLOCK)
def test_only_complete_blocks_are_hashed(tokens: list[int], block_size: int) -> None:
    """A partial last block has no hash; completing it adds exactly one and changes none of the
    earlier ones."""
    prefix = _hashes(tokens, block_size)
    complete = len(tokens) // block_size
    assert prefix.n_blocks == complete == len(prefix.keys())
    assert prefix.n_tokens == len(tokens)
    assert all(w.shape == (complete,) and w.dtype == np.uint64 for w in prefix.words())
    before = prefix.keys()
    missing = block_size - len(tokens) % block_size
    prefix.extend([7] * (missing - 1))
    assert prefix.keys() == before  # still one token short
    prefix.extend([7])
    assert prefix.n_blocks == complete + 1
    assert prefix.keys()[:complete] == before


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=120), block_size=BLOCK,
       data=st.data())
def test_hashes_are_chained(tokens: list[int], block_size: int, data: st.DataObject) -> None:
    """Changing one token changes the hash of its block and of every later block, and of no
    earlier block."""
    assume(len(tokens) >= block_size)
    position = data.draw(st.integers(0, len(tokens) - 1), label="position")
    changed = list(tokens)
    changed[position] = tokens[position] + 1
    old, new = _hashes(tokens, block_size).keys(), _hashes(changed, block_size).keys()
    block = position // block_size
    assert old[:block] == new[:block]
    assert all(a != b for a, b in zip(old[block:], new[block:], strict=True))


def test_a_late_change_leaves_earlier_blocks_alone_and_an_early_one_changes_all() -> None:
    tokens = list(range(64))
    base = _hashes(tokens, 16).keys()
    late = _hashes([*tokens[:50], 999, *tokens[51:]], 16).keys()
    early = _hashes([999, *tokens[1:]], 16).keys()
    assert late[:3] == base[:3] and late[3] != base[3]
    assert all(a != b for a, b in zip(early, base, strict=True))


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(
        st.tuples(st.text(NAME_CHARS, min_size=1, max_size=8), st.integers(0, 5),
                  st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)),
        min_size=2, max_size=4, unique=True),
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=64),
)
def test_different_cache_keys_give_disjoint_hashes(
    keys: list[tuple[str, int, str]], tokens: list[int]
) -> None:
    """Seeds for different (model, layout_version, cache_salt) differ, and the same tokens hashed
    from them share no block key: one cache never serves another's blocks."""
    seeds = [hash_seed(*key) for key in keys]
    assert len(set(seeds)) == len(seeds)
    chains = [set(_hashes(tokens, 16, seed).keys()) for seed in seeds]
    for i, first in enumerate(chains):
        for second in chains[i + 1 :]:
            assert not first & second


@pytest.mark.parametrize(
    "other",
    [("m2", 1, ""), ("m", 2, ""), ("m", 1, "tenant-a")],
    ids=["model", "layout_version", "cache_salt"],
)
def test_each_part_of_the_cache_key_changes_every_block(other: tuple[str, int, str]) -> None:
    tokens = np.arange(48)
    base = _hashes(tokens, 16, hash_seed("m", 1, "")).keys()
    moved = _hashes(tokens, 16, hash_seed(*other)).keys()
    assert not set(base) & set(moved)
    assert hash_seed("m", 1) == hash_seed("m", 1, "")  # the salt defaults to empty


@settings(max_examples=100, deadline=None)
@given(tokens=TOKENS, block_size=BLOCK)
def test_keys_are_the_joined_words(tokens: list[int], block_size: int) -> None:
    """keys()[i] is the 128-bit key made of block i's two stored words, the same split of the
    digest the core stores."""
    prefix = _hashes(tokens, block_size)
    high, low = prefix.words()
    digests = [h.to_bytes(8, "little") + lo.to_bytes(8, "little")
               for h, lo in zip(high.tolist(), low.tolist(), strict=True)]
    keys = prefix.keys()
    assert keys == [join_words(*split_digest(d)) for d in digests]
    assert all(0 <= key < 2**128 for key in keys)


def test_split_and_join_round_trip_a_digest() -> None:
    digest = bytes(range(16))
    high, low = split_digest(digest)
    assert high == int.from_bytes(digest[:8], "little")
    assert low == int.from_bytes(digest[8:], "little")
    assert join_words(high, low) == (high << 64) | low


def test_the_same_tokens_as_a_list_or_an_array_hash_alike() -> None:
    tokens = list(range(40))
    as_list = _hashes(tokens, 8).keys()
    assert _hashes(np.array(tokens, dtype=np.int32), 8).keys() == as_list
    with pytest.raises(TokenError, match="1-D"):  # a batch of requests is not one prompt
        _hashes(np.array(tokens, dtype=np.int64).reshape(5, 8), 8)
    assert _hashes(np.arange(80)[::2], 8).keys() == _hashes(list(range(0, 80, 2)), 8).keys()
    assert _hashes(np.array(tokens, dtype=">i8"), 8).keys() == as_list


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_size_below_one_is_refused(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixHashes(SEED, block_size)


def test_prefix_hashes_refuse_what_is_not_a_token_id() -> None:
    """Regression: ``PrefixHashes([0.5] * 16)`` hashed like ``[0] * 16``."""
    hashes = PrefixHashes(hash_seed("m", 1, ""), 16)
    hashes.extend(np.arange(8))
    for bad in ([0.5] * 16, np.arange(16) - 1, np.full(16, 2**63, dtype=np.uint64)):
        with pytest.raises(TokenError):
            hashes.extend(bad)
    assert (hashes.n_tokens, hashes.n_blocks) == (8, 0)
