"""PrefixHashes and the seed: chained block identities of a token sequence."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError, TokenError
from kvfsm._jit import settings as jit
from kvfsm.state import (
    HASH_FUNCTIONS,
    PrefixHashes,
    _hash_kernel,
    hash_seed,
    join_words,
    split_digest,
)
from kvfsm.state._hashing import SHA256

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


# --- the hash functions and their chains -------------------------------------------------------

#: Block sizes reaching each XXH3 path of a block's input (16 + 8 * size bytes): up to 128
#: bytes (sizes 1-14), 129-240 (15-28), striped (29+; several 1024-byte stripes from 127 on).
PATH_SIZES = st.one_of(st.integers(1, 30), st.sampled_from([63, 64, 65, 126, 127, 128, 129, 300]))
#: Small ids make equal blocks likely; large ones reach the int64 edge.
ANY_TOKEN = st.one_of(st.integers(0, 3), st.integers(0, 2**63 - 1))


def _reference_words(tokens: list[int], block_size: int, seed: bytes,
                     function: str) -> tuple[list[int], list[int]]:
    """The chain as the module docstring defines it, one block at a time with the reference
    libraries: block i hashes block i - 1's digest (the seed for block 0) and its tokens as
    little-endian int64; xxh3_128 chains 16-byte digests, sha256 the full 32 bytes and keeps
    the first 16."""
    parent, high, low = seed, [], []
    raw = np.array(tokens, dtype="<i8").tobytes()
    step = 8 * block_size
    for start in range(0, len(raw) - len(raw) % step, step):
        if function == SHA256:
            parent = hashlib.sha256(parent + raw[start : start + step]).digest()
        else:
            parent = xxhash.xxh3_128_digest(parent + raw[start : start + step])
        high.append(int.from_bytes(parent[:8], "little"))
        low.append(int.from_bytes(parent[8:16], "little"))
    return high, low


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(ANY_TOKEN, max_size=700), block_size=PATH_SIZES,
       seed=st.binary(min_size=16, max_size=16), function=st.sampled_from(HASH_FUNCTIONS),
       compiled=st.booleans())
def test_words_are_the_reference_chain(tokens: list[int], block_size: int, seed: bytes,
                                       function: str, compiled: bool) -> None:
    """For any tokens, block size, seed and hash function, compiled or not, the words are
    those of the chain computed block by block with xxhash / hashlib."""
    if compiled and not jit.available:
        return
    prefix = PrefixHashes(seed, block_size, function)
    with jit.using(compiled):
        prefix.extend(tokens)
    high, low = prefix.words()
    assert (high.tolist(), low.tolist()) == _reference_words(tokens, block_size, seed, function)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(ANY_TOKEN, max_size=400), block_size=PATH_SIZES,
       function=st.sampled_from(HASH_FUNCTIONS), data=st.data())
def test_any_chunking_gives_the_words_of_one_extend(tokens: list[int], block_size: int,
                                                    function: str, data: st.DataObject) -> None:
    """Extending in arbitrary chunks (as arrays or lists, empty ones included) gives the words
    of one extend of all the tokens, at every block size and with either function."""
    whole = PrefixHashes(SEED, block_size, function)
    whole.extend(tokens)
    cuts = data.draw(st.lists(st.integers(0, len(tokens)), max_size=8), label="cuts")
    pieces = PrefixHashes(SEED, block_size, function)
    bounds = [0, *sorted(cuts), len(tokens)]
    for start, stop in itertools.pairwise(bounds):
        chunk = tokens[start:stop]
        pieces.extend(np.array(chunk, dtype=np.int64) if start % 2 else chunk)
    assert pieces.keys() == whole.keys()
    assert pieces.n_tokens == whole.n_tokens == len(tokens)


def test_the_default_chain_is_unchanged_so_stored_keys_stay_valid() -> None:
    """Disk and remote copies are named by these words: the compiled chain gives exactly the
    seeds and words of earlier versions (values computed by the per-block xxhash chain)."""
    assert hash_seed("m", 1).hex() == "a6a7f64f5037f71adf7792f370ac6ade"
    expected = {1: (0x836D815AF1ECAA74ACB6246F25EC0E3, 0x9E32593329FB2C4DEFA3CD88BF568214),
                16: (0x24DB25797E818B9D80E3197CECA8B26, 0xCE697494CE9CCFCD7BC87266439B631B),
                64: (0x79104BE840DC91D7BAE3DD92E696862C, 0x1C1593B34D82E6AAA852828A70F219B7)}
    for block_size, (first, last) in expected.items():
        keys = _hashes(np.arange(256), block_size).keys()
        assert (keys[0], keys[-1]) == (first, last), block_size


def test_sha256_is_its_own_namespace() -> None:
    """The collision-resistant function gives other seeds and other words for the same key and
    tokens, so caches hashing differently share no block."""
    tokens = list(range(64))
    assert hash_seed("m", 1, hash_function=SHA256) != hash_seed("m", 1)
    assert len(hash_seed("m", 1, hash_function=SHA256)) == 16
    fast = _hashes(tokens, 16).keys()
    strong = PrefixHashes(hash_seed("m", 1, hash_function=SHA256), 16, SHA256)
    strong.extend(tokens)
    assert strong.n_blocks == 4 and not set(strong.keys()) & set(fast)
    assert strong.hash_function == SHA256 and PrefixHashes(SEED, 16).hash_function == "xxh3_128"


@pytest.mark.parametrize("name", ["xxhash", "SHA256", "", 3])
def test_an_unknown_hash_function_is_refused_naming_the_choices(name: object) -> None:
    with pytest.raises(KvfsmError, match=r"hash_function must be one of \['xxh3_128', 'sha256'\]"):
        PrefixHashes(SEED, 16, name)  # type: ignore[arg-type]
    with pytest.raises(KvfsmError, match="one of"):
        hash_seed("m", 1, hash_function=name)  # type: ignore[arg-type]


def test_a_seed_that_is_not_16_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="seed must be 16 bytes"):
        PrefixHashes(b"short", 16)


class _CountingKernel:
    """Stands in for the chain kernel, recording how many blocks each call hashed."""

    def __init__(self, kernel: Callable[..., None]) -> None:
        self.kernel = kernel
        self.blocks: list[int] = []

    def __call__(self, tokens: np.ndarray, block_size: int, *rest: np.ndarray) -> None:
        self.blocks.append(tokens.size // block_size)
        self.kernel(tokens, block_size, *rest)


def test_one_token_appends_hash_each_block_once_and_words_cost_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding appends one token at a time: each append hashes at most the one block it
    completes (every block exactly once overall), the word arrays grow by doubling (a
    logarithmic number of moves), and words() is a view of them, not a rebuild."""
    counter = _CountingKernel(_hash_kernel.chain_kernel)
    monkeypatch.setattr(_hash_kernel, "chain_kernel", counter)
    prefix = PrefixHashes(SEED, 16)
    storages = set()
    earlier: list[tuple[np.ndarray, np.ndarray]] = []
    for token in range(5000):
        prefix.extend([token])
        high, low = prefix.words()
        storages.add(high.base.__array_interface__["data"][0] if high.base is not None else 0)
        if token % 997 == 0:
            earlier.append((high, high.copy()))
    assert counter.blocks == [1] * (5000 // 16)  # one call per completed block, one block each
    assert prefix.n_blocks == 5000 // 16
    assert len(storages) <= 2 + int(np.log2(5000 // 16))
    high, low = prefix.words()
    again = prefix.words()
    assert np.shares_memory(high, again[0]) and np.shares_memory(low, again[1])
    for view, then in earlier:  # earlier answers still hold the words of their time
        assert np.array_equal(view, then)
    assert prefix.keys() == _hashes(list(range(5000)), 16).keys()


def test_a_refused_extend_leaves_every_word_as_it_was() -> None:
    prefix = _hashes(list(range(40)), 16)
    before = [w.copy() for w in prefix.words()]
    for bad in ([*range(30), -1], [*range(30), 0.5], [True] * 20):
        with pytest.raises(TokenError):
            prefix.extend(bad)
    assert (prefix.n_tokens, prefix.n_blocks) == (40, 2)
    assert all(np.array_equal(a, b) for a, b in zip(prefix.words(), before, strict=True))
    prefix.extend(range(40, 48))  # the pending block completes as if nothing was refused
    assert prefix.keys() == _hashes(list(range(48)), 16).keys()
