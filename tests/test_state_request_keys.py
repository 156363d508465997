"""Request keys: a prompt's namespace and content keys are part of its block hashes."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import KvfsmError
from kvfsm.state import HASH_FUNCTIONS, PrefixHashes, Prompt, hash_seed
from kvfsm.state._request_keys import (
    content_keys_of,
    keyed_blocks,
    mix_content,
    namespace_of,
    namespace_root,
)

SEED = hash_seed("m", 1)
TOKENS = list(range(500, 500 + 8 * 16 + 3))
#: Content keys over some ranges of up to 140 tokens.
RANGES = st.tuples(st.integers(0, 139), st.integers(1, 40)).map(lambda r: (r[0], r[0] + r[1]))
CONTENT = st.lists(st.tuples(RANGES, st.binary(min_size=1, max_size=6)).map(
    lambda each: (each[0][0], each[0][1], each[1])), max_size=4)


def _words(tokens: list[int], size: int = 16, function: str = HASH_FUNCTIONS[0], *,
           namespace: str | bytes | None = None,
           content_keys: Any = None) -> list[tuple[int, int]]:
    prompt = Prompt(SEED, (size,), tokens, hash_function=function, namespace=namespace,
                    content_keys=content_keys)
    high, low = prompt.words(size)
    return list(zip(high.tolist(), low.tolist(), strict=True))


@pytest.mark.parametrize("function", HASH_FUNCTIONS)
def test_no_keys_leave_the_words_of_earlier_versions(function: str) -> None:
    """A prompt with no namespace (None or empty) and no content keys hashes exactly as a
    plain chain does: values stored under earlier versions' keys stay found."""
    plain = PrefixHashes(SEED, 16, function)
    plain.extend(TOKENS)
    want = list(zip(*(w.tolist() for w in plain.words()), strict=True))
    assert _words(TOKENS, function=function) == want
    assert _words(TOKENS, function=function, namespace="", content_keys=()) == want
    assert _words(TOKENS, function=function, namespace=b"") == want


@pytest.mark.parametrize("function", HASH_FUNCTIONS)
def test_no_block_is_shared_across_namespaces(function: str) -> None:
    """The same tokens in two namespaces (two LoRA adapters, two tenants) share no block, not
    even the first; in one namespace (str or its UTF-8 bytes) they share every block."""
    a = _words(TOKENS, function=function, namespace="lora:a")
    b = _words(TOKENS, function=function, namespace="lora:b")
    plain = _words(TOKENS, function=function)
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert a == _words(TOKENS, function=function, namespace=b"lora:a")


@pytest.mark.parametrize("function", HASH_FUNCTIONS)
def test_content_keys_change_their_blocks_and_every_later_one(function: str) -> None:
    """Tokens ``[20, 40)`` standing for an image: block 0 (tokens 0-15) is shared with the
    plain prompt and with other images there; block 1 (holding token 20) and every block after
    it differ by image, and by where the image lies; the same image at the same place gives
    the same words."""
    plain = _words(TOKENS, function=function)
    one = _words(TOKENS, function=function, content_keys=[(20, 40, "image-1")])
    two = _words(TOKENS, function=function, content_keys=[(20, 40, "image-2")])
    moved = _words(TOKENS, function=function, content_keys=[(21, 41, "image-1")])
    assert one[0] == two[0] == moved[0] == plain[0]
    for later in range(1, len(plain)):
        assert len({one[later], two[later], moved[later], plain[later]}) == 4
    assert one == _words(TOKENS, function=function, content_keys=[(20, 40, b"image-1")])


def test_a_range_inside_one_block_keys_that_block_only_from_there_on() -> None:
    """A key over tokens ``[35, 37)`` (block 2 at 16 tokens, block 0 at 64) changes the blocks
    from the one holding them, at each block size."""
    for size, first in ((16, 2), (64, 0), (4, 8)):
        plain = _words(TOKENS, size)
        keyed = _words(TOKENS, size, content_keys=[(35, 37, "x")])
        assert keyed[:first] == plain[:first]
        assert all(k != p for k, p in zip(keyed[first:], plain[first:], strict=True))


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**40), max_size=140), size=st.sampled_from((1, 3, 16)),
       function=st.sampled_from(HASH_FUNCTIONS), content=CONTENT,
       namespace=st.binary(max_size=4), data=st.data())
def test_keyed_words_are_the_reference_chain_however_tokens_arrive(
        tokens: list[int], size: int, function: str, content: list[tuple[int, int, bytes]],
        namespace: bytes, data: st.DataObject) -> None:
    """For any tokens, block size, hash function, namespace and content keys, extended in any
    pieces: block ``i``'s digest is the plain chain step from block ``i - 1``'s, with every key
    whose range holds a token of block ``i`` mixed in (keys sorted), starting from the
    namespace's root."""
    cuts = data.draw(st.lists(st.integers(0, len(tokens)), max_size=5), label="cuts")
    prompt = Prompt(SEED, (size,), hash_function=function, namespace=namespace,
                    content_keys=content)
    for start, stop in itertools.pairwise([0, *sorted(cuts), len(tokens)]):
        prompt.extend(tokens[start:stop])
    keys = content_keys_of(content)
    parent = namespace_root(SEED, namespace, function)
    want = []
    for block in range(len(tokens) // size):
        step = PrefixHashes(parent[:16], size, function)
        if function == "sha256":
            step._parent_digest = parent  # the chain carries SHA-256's whole digest
        step.extend(tokens[block * size : (block + 1) * size])
        high, low = (int(w[0]) for w in step.words())
        digest = step._parent_digest if function == "sha256" else \
            np.array([high, low], dtype="<u8").tobytes()
        mine = [key for key in keys if key[0] < (block + 1) * size and key[1] > block * size]
        if mine:
            digest = mix_content(digest, mine, function)
            high, low = (int.from_bytes(digest[at : at + 8], "little") for at in (0, 8))
        parent = digest
        want.append((high, low))
    got = prompt.words(size)
    assert list(zip(got[0].tolist(), got[1].tolist(), strict=True)) == want


def test_keyed_blocks_lists_each_block_holding_a_keys_token() -> None:
    keys = content_keys_of([(20, 40, "a"), (33, 34, "b")])
    assert keyed_blocks(keys, 16, 0, 8) == {1: [keys[0]], 2: [keys[0], keys[1]]}
    assert keyed_blocks(keys, 16, 2, 8) == {2: [keys[0], keys[1]]}
    assert keyed_blocks(keys, 16, 3, 8) == {}


@pytest.mark.parametrize(("value", "message"), [
    ("abc", "content_keys must be a sequence"),
    ([(1, 2)], r"content_keys\[0\] must be \(start, end, key\)"),
    ([(0, 4, "a"), (5, 5, "b")], r"content_keys\[1\]: start and end must be ints with "
                                 r"0 <= start < end"),
    ([(-1, 4, "a")], r"content_keys\[0\]: start and end"),
    ([(0.0, 4, "a")], r"content_keys\[0\]: start and end"),
    ([(True, 4, "a")], r"content_keys\[0\]: start and end"),
    ([(0, 4, 7)], r"content_keys\[0\] key must be str or bytes, got int 7"),
    ([(0, 4, "")], r"content_keys\[0\]: the key is empty"),
])
def test_bad_content_keys_are_named(value: Any, message: str) -> None:
    with pytest.raises(KvfsmError, match=message):
        content_keys_of(value)


def test_namespaces_are_str_or_bytes() -> None:
    assert namespace_of(None) == namespace_of("") == b""
    assert namespace_of("é") == "é".encode()
    with pytest.raises(KvfsmError, match="namespace must be str or bytes, got int 3"):
        namespace_of(3)
