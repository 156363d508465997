"""Prompt: token ids are validated integers, kept in order, and bound to the engine's seed."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm import Engine, ForeignPromptError, KvfsmError, TokenError
from kvfsm._tokens import as_token_ids
from kvfsm.state import CoreConfig, Prompt, hash_seed
from tests.lookup_models import GPT_OSS

SEED = hash_seed("m", 1)
OTHER_SEED = hash_seed("m", 1, "tenant-a")
SIZES = (1, 4, 16)


def _prompt(tokens: Any, sizes: tuple[int, ...] = SIZES) -> Prompt:
    return Prompt(SEED, sizes, tokens)


def _same_words(a: Prompt, b: Prompt, size: int) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.words(size), b.words(size), strict=True))


# --- which token ids are accepted -------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i8", "object"])
def test_every_integer_dtype_hashes_like_the_list(dtype: str) -> None:
    tokens = list(range(100))
    want = _prompt(tokens)
    got = _prompt(np.array(tokens, dtype=dtype))
    assert all(_same_words(got, want, size) for size in SIZES)
    assert got.token_ids.tolist() == tokens


@pytest.mark.parametrize(
    "container",
    [tuple, range, iter, lambda t: [np.int32(v) for v in t]],
    ids=["tuple", "range", "iterator", "numpy-scalars"])
def test_other_integer_sequences_hash_like_the_list(container: Callable[[Any], Any]) -> None:
    tokens = list(range(5, 70))
    source = range(5, 70) if container is range else container(tokens)
    assert _same_words(_prompt(source), _prompt(tokens), 16)


def test_the_largest_int64_is_a_valid_id_and_empty_input_is_nothing() -> None:
    top = 2**63 - 1
    for tokens in ([top], np.array([top], dtype=np.uint64), np.array([top], dtype=np.int64)):
        assert _prompt(tokens).token_ids.tolist() == [top]
    for empty in ([], (), np.array([]), np.zeros(0, dtype=np.int32)):
        assert _prompt(empty).n_tokens == 0


# --- which token ids are refused, and what the error says -------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([0.5] * 321, "token_ids[0] = 0.5 is not an integer token id"),
        (np.arange(321) + 0.9, "token_ids[0] = 0.9 is not an integer token id"),
        ([3.0], "token_ids[0] = 3.0 is not an integer token id"),
        (np.array([3.0, 4.0]), "token_ids[0] = 3.0 is not an integer token id"),
        ([1, 2, 7, 2.0], "token_ids[3] = 2.0 is not an integer token id"),
        ([1, np.float64(2.0)], "token_ids[1] = 2.0 is not an integer token id"),
        (np.array([1 + 2j]), "token_ids[0] = (1+2j) is not an integer token id"),
    ],
    ids=["float-list", "float-array", "integral-float", "integral-float-array", "mixed-list",
         "numpy-float-scalar", "complex"],
)
def test_floats_are_refused_even_when_integral(tokens: Any, message: str) -> None:
    with pytest.raises(TokenError, match=re.escape(message)) as raised:
        _prompt(tokens)
    if "j)" not in message:
        assert "bug upstream" in str(raised.value)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([4, 5, 6, -1], r"token_ids\[3\] = -1 is negative"),
        (np.array([4, -7, -1], dtype=np.int64), r"token_ids\[1\] = -7 is negative"),
        (np.array([4, -3], dtype=np.int8), r"token_ids\[1\] = -3 is negative"),
        ([-1, 2**63], r"token_ids\[0\] = -1 is negative"),
        # Past the few ids a short list is checked without NumPy: the same answer.
        ([*range(40), -2], r"token_ids\[40\] = -2 is negative"),
    ],
)
def test_negative_ids_are_refused(tokens: Any, message: str) -> None:
    with pytest.raises(TokenError, match=message):
        _prompt(tokens)


@pytest.mark.parametrize(
    "tokens",
    [np.array([0, 1, 2, 3, 4, 5, 6, 2**64 - 1], dtype=np.uint64),
     [0, 1, 2, 3, 4, 5, 6, 2**64 - 1]],
    ids=["uint64-array", "list"],
)
def test_ids_from_two_to_the_63_are_refused_not_wrapped(tokens: Any) -> None:
    with pytest.raises(TokenError, match=r"token_ids\[7\] = 18446744073709551615 is >= 2\*\*63"):
        _prompt(tokens)
    with pytest.raises(TokenError, match=r"token_ids\[0\] = 9223372036854775808 is >= 2\*\*63"):
        _prompt([2**63])
    with pytest.raises(TokenError, match=r"token_ids\[0\] = 36893488147419103232 is >= 2\*\*63"):
        _prompt([2**65])


@pytest.mark.parametrize(
    ("tokens", "position"),
    [(np.ones(8, dtype=bool), 0), ([True, False], 0), ([5, 9, True], 2), ([5, np.False_], 1),
     ([*range(2, 40), True], 38), ([*range(2, 200), False, 7], 198)],
    ids=["bool-array", "bool-list", "bool-among-ints", "numpy-bool-among-ints",
         "bool-in-a-longer-list", "bool-in-a-long-list"],
)
def test_bools_are_refused_as_a_mask_is_not_a_prompt(tokens: Any, position: int) -> None:
    with pytest.raises(TokenError, match=rf"token_ids\[{position}\] = (True|False) .*mask"):
        _prompt(tokens)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ("hello", "token_ids is str"),
        (b"\x01\x02", "token_ids is bytes"),
        (["1", "2"], r"token_ids\[0\] = '1' is not an integer token id"),
        (np.array(["1", "2"]), r"token_ids\[0\] = '1' is not an integer token id"),
        ([[1, 2], [3, 4]], r"token_ids\[0\] = \[1, 2\] is a sequence: token_ids must be 1-D"),
        ([1, [2, 3]], r"token_ids\[1\] = \[2, 3\] is a sequence"),
        (np.zeros((5, 8), dtype=np.int64), r"must be 1-D .*shape \(5, 8\)"),
        (np.int64(5), r"must be 1-D .*shape \(\)"),
        (5, "must be a 1-D sequence of token ids, got int 5"),
        ({1, 2}, "must be a 1-D sequence of token ids, got set"),
        (np.array([1, None], dtype=object), r"token_ids\[1\] = None is not an integer token id"),
    ],
    ids=["str", "bytes", "str-list", "str-array", "nested", "ragged", "2-D", "0-D", "scalar",
         "set", "object-array"],
)
def test_strings_nesting_and_scalars_are_refused(tokens: Any, message: str) -> None:
    with pytest.raises(TokenError, match=message):
        _prompt(tokens)


def test_a_token_error_is_a_kvfsm_error_and_a_value_error() -> None:
    with pytest.raises(KvfsmError):
        _prompt([0.5])
    with pytest.raises(ValueError):
        _prompt([-1])


def test_a_refused_extend_changes_nothing() -> None:
    prompt = _prompt(list(range(30)))
    before = (prompt.n_tokens, prompt.token_ids.copy(),
              [[w.copy() for w in prompt.words(size)] for size in SIZES])
    for bad in ([*range(40), -1], [*range(40), 0.5], np.arange(40.0), [[1, 2]]):
        with pytest.raises(TokenError):
            prompt.extend(bad)
    assert prompt.n_tokens == before[0]
    assert np.array_equal(prompt.token_ids, before[1])
    for size, words in zip(SIZES, before[2], strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(prompt.words(size), words, strict=True))
    prompt.extend(range(30, 34))  # and it still works, as if nothing had been refused
    assert _same_words(prompt, _prompt(list(range(34))), 4)


# --- torch tensors (duck typed; torch is optional) --------------------------------------------


def test_torch_integer_tensors_are_accepted_and_others_refused() -> None:
    torch = pytest.importorskip("torch")
    tokens = list(range(50))
    want = _prompt(tokens)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        assert _same_words(_prompt(torch.tensor(tokens, dtype=dtype)), want, 16)
    with pytest.raises(TokenError, match=r"token_ids\[0\] = 0.5 is not an integer token id"):
        _prompt(torch.full((4,), 0.5))
    with pytest.raises(TokenError, match=r"token_ids\[0\] = 3.0 is not an integer token id"):
        _prompt(torch.tensor([3.0], requires_grad=True))
    with pytest.raises(TokenError, match="bfloat16"):
        _prompt(torch.tensor([3.0], dtype=torch.bfloat16))
    with pytest.raises(TokenError, match="mask"):
        _prompt(torch.ones(4, dtype=torch.bool))
    with pytest.raises(TokenError, match=r"token_ids\[2\] = -1 is negative"):
        _prompt(torch.tensor([1, 2, -1]))
    with pytest.raises(TokenError, match="must be 1-D"):
        _prompt(torch.zeros(2, 3, dtype=torch.int64))


# --- the tokens are kept -----------------------------------------------------------------------


def test_token_ids_are_every_token_so_far_read_only_and_stable() -> None:
    prompt = _prompt([])
    expected: list[int] = []
    views = []
    for step in range(300):  # one token at a time, as decoding appends them, plus a few chunks
        chunk = [step] if step % 50 else list(range(step, step + 7))
        prompt.extend(chunk)
        expected.extend(chunk)
        views.append((prompt.token_ids, list(expected)))
    assert prompt.n_tokens == len(expected)
    for view, then in views:  # every earlier answer still shows the tokens of its time
        assert view.dtype == np.int64
        assert view.tolist() == then
    assert not prompt.token_ids.flags.writeable
    with pytest.raises(ValueError):
        prompt.token_ids[0] = 1
    assert _same_words(prompt, _prompt(expected), 16)


# --- the prompt is bound to its engine ---------------------------------------------------------


def test_seed_and_block_sizes_are_kept_sorted_unique_and_read_only() -> None:
    prompt = Prompt(SEED, [16, 4, 16, 1], [1, 2, 3])
    assert prompt.seed == SEED
    assert prompt.block_sizes == (1, 4, 16)
    with pytest.raises(AttributeError):
        prompt.seed = OTHER_SEED  # type: ignore[misc]
    with pytest.raises(AttributeError):
        prompt.block_sizes = (8,)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        prompt.n_tokens = 0  # type: ignore[misc]


def test_check_made_for_accepts_its_own_engine_even_when_it_keeps_more_sizes() -> None:
    prompt = Prompt(SEED, [4, 16], [1, 2, 3])
    prompt.check_made_for(SEED, [16, 4], "engine")
    prompt.check_made_for(SEED, iter([16]), "engine")


def test_check_made_for_refuses_another_seed() -> None:
    prompt = Prompt(SEED, [16], [1, 2, 3])
    with pytest.raises(ForeignPromptError,
                       match=r"prompt was made for another model, layout version, cache_salt or "
                             r"hash function; make it with engine\.prompt\(\.\.\.\)"):
        prompt.check_made_for(OTHER_SEED, [16], "engine")


def test_check_made_for_refuses_a_missing_block_size_naming_it() -> None:
    prompt = Prompt(SEED, [16], [1, 2, 3])
    with pytest.raises(ForeignPromptError, match=r"keeps block sizes \[16\].*needs \[4, 64\]"):
        prompt.check_made_for(SEED, [4, 16, 64], "engine")
    assert issubclass(ForeignPromptError, KvfsmError)


def test_check_made_for_a_tuple_found_kept_before_still_refuses_another() -> None:
    """An engine's per-group sizes (unsorted, repeated) are accepted on every call, and a
    tuple the prompt lacks a size of is refused after them as before."""
    prompt = Prompt(SEED, [4, 16], [1, 2, 3])
    per_group = (16, 4, 16)
    for _ in range(2):
        prompt.check_made_for(SEED, per_group, "engine")
    with pytest.raises(ForeignPromptError, match=r"needs \[64\]"):
        prompt.check_made_for(SEED, (16, 64), "engine")
    with pytest.raises(ForeignPromptError, match="another model"):
        prompt.check_made_for(OTHER_SEED, per_group, "engine")


def test_words_at_a_size_not_kept_is_a_foreign_prompt_error_naming_the_size() -> None:
    prompt = Prompt(SEED, [16], list(range(32)))
    with pytest.raises(ForeignPromptError, match=r"block size 8 \(it keeps \[16\]\)"):
        prompt.words(8)


# --- the invariant -----------------------------------------------------------------------------

#: Containers a caller may hand over, with the largest id each can hold.
CONTAINERS: dict[str, tuple[Callable[[list[int]], Any], int]] = {
    "list": (list, 2**63 - 1),
    "int32": (lambda t: np.array(t, dtype=np.int32), 2**31 - 1),
    "int64": (lambda t: np.array(t, dtype=np.int64), 2**63 - 1),
    "uint64": (lambda t: np.array(t, dtype=np.uint64), 2**63 - 1),
}
#: Small ids make equal and near-equal prompts likely; large ones reach the int64 edge.
TOKEN = st.one_of(st.integers(0, 3), st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1))


@st.composite
def _token_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    first = draw(st.lists(TOKEN, max_size=24))
    how = draw(st.sampled_from(["same", "one-changed", "cut", "independent"]))
    if how == "same":
        return first, list(first)
    if how == "one-changed" and first:
        changed = list(first)
        position = draw(st.integers(0, len(first) - 1))
        changed[position] = draw(TOKEN)
        return first, changed
    if how == "cut":
        return first, first[: draw(st.integers(0, len(first)))]
    return first, draw(st.lists(TOKEN, max_size=24))


@settings(max_examples=300, deadline=None)
@given(pair=_token_pairs(), kinds=st.tuples(*[st.sampled_from(sorted(CONTAINERS))] * 2),
       block_size=st.integers(2, 5))
def test_block_words_are_equal_iff_token_ids_are_equal_as_integers(
    pair: tuple[list[int], list[int]], kinds: tuple[str, str], block_size: int
) -> None:
    """Two prompts hash equal block words iff their token ids are equal as integers, whatever
    containers (list, int32/int64/uint64 arrays) carried them: at block size 1 for all tokens,
    at a larger size for the tokens of its complete blocks."""
    prompts = []
    for tokens, kind in zip(pair, kinds, strict=True):
        make, largest = CONTAINERS[kind]
        if max(tokens, default=0) > largest:  # the ids do not fit that dtype: use a list
            make = list
        prompts.append(Prompt(SEED, (1, block_size), make(tokens)))
    first, second = prompts
    assert first.token_ids.tolist() == pair[0] and second.token_ids.tolist() == pair[1]
    assert _same_words(first, second, 1) == (pair[0] == pair[1])
    whole = [len(t) - len(t) % block_size for t in pair]
    assert _same_words(first, second, block_size) == (
        pair[0][: whole[0]] == pair[1][: whole[1]])


# --- inputs are viewed, not copied, where they can be ------------------------------------------


def test_int64_arrays_and_cpu_tensors_are_viewed_others_converted_once() -> None:
    """A C-contiguous int64 array or CPU int64 tensor is hashed in place (no copy); a strided
    or other-dtype one is converted into one C-contiguous int64 array."""
    tokens = np.arange(1000, dtype=np.int64)
    assert as_token_ids(tokens) is tokens
    strided = as_token_ids(tokens[::2])
    assert strided.flags.c_contiguous and strided.tolist() == list(range(0, 1000, 2))
    narrow = as_token_ids(tokens.astype(np.int32))
    assert narrow.dtype == np.int64 and narrow.flags.c_contiguous
    torch = pytest.importorskip("torch")
    tensor = torch.arange(1000, dtype=torch.int64)
    assert np.shares_memory(as_token_ids(tensor), tensor.numpy())
    assert as_token_ids(torch.arange(10, dtype=torch.int32)).tolist() == list(range(10))


def test_a_prompt_made_from_a_list_keeps_growing_as_one_from_an_array() -> None:
    """The prompt keeps the array it converted a list into; extending it afterwards (one token
    at a time, then in chunks) gives the tokens and words of one array, and every earlier
    token_ids answer stays as it was."""
    tokens = list(range(100, 133))
    prompt = _prompt(tokens)
    first = prompt.token_ids
    for extra in ([7], [8], list(range(40))):
        prompt.extend(extra)
        tokens += extra
    assert first.tolist() == list(range(100, 133))
    assert prompt.token_ids.tolist() == tokens
    assert all(_same_words(prompt, _prompt(np.array(tokens)), size) for size in SIZES)


def test_words_are_kept_not_rebuilt() -> None:
    """words() hands out views of the kept words (O(1)), still valid after later extends."""
    prompt = _prompt(list(range(64)))
    high, low = prompt.words(16)
    again = prompt.words(16)
    assert np.shares_memory(high, again[0]) and np.shares_memory(low, again[1])
    before = high.copy()
    prompt.extend(range(64, 2000))
    assert np.array_equal(high, before)
    assert np.array_equal(prompt.words(16)[0][:4], before)


@pytest.mark.parametrize("steps", [[15, 1, 16, 3, 13], [1] * 40, [70]])
def test_words_after_each_extend_cover_every_complete_block(steps: list[int]) -> None:
    """The words handed out are made once per extend: after each (completing a block or not)
    they are those of a prompt made at once from the same tokens."""
    prompt, so_far = _prompt([]), []
    for step in steps:
        prompt.words(16)  # asked before the extend: must not be handed out again after it
        tokens = list(range(len(so_far), len(so_far) + step))
        prompt.extend(tokens)
        so_far += tokens
        assert _same_words(prompt, _prompt(so_far), 16)
        assert prompt.words(16)[0].size == len(so_far) // 16


# --- the hash function ---------------------------------------------------------------------------


def test_the_hash_function_is_kept_and_changes_every_word() -> None:
    tokens = list(range(64))
    fast, strong = _prompt(tokens), Prompt(SEED, SIZES, tokens, hash_function="sha256")
    assert (fast.hash_function, strong.hash_function) == ("xxh3_128", "sha256")
    for size in SIZES:
        assert not set(fast.words(size)[0].tolist()) & set(strong.words(size)[0].tolist())
    assert "sha256" in repr(strong)
    with pytest.raises(KvfsmError, match=r"hash_function must be one of \['xxh3_128', 'sha256'\]"):
        Prompt(SEED, SIZES, tokens, hash_function="md5")


def test_check_made_for_refuses_another_hash_function() -> None:
    prompt = Prompt(SEED, [16], [1, 2, 3], hash_function="sha256")
    prompt.check_made_for(SEED, [16], "engine")  # the seed alone cannot tell
    with pytest.raises(ForeignPromptError, match="hashed with sha256 but engine uses xxh3_128"):
        prompt.check_made_for(SEED, [16], "engine", "xxh3_128")


def test_engines_hashing_differently_refuse_each_others_prompts() -> None:
    """An engine configured for sha256 makes sha256 prompts under its own seed; the default
    engine refuses them (and the other way round), so no block is ever shared."""
    config = {"device_blocks": 32, "host_blocks": 0, "backend": "numpy"}
    fast = Engine(GPT_OSS, CoreConfig(**config))
    strong = Engine(GPT_OSS, CoreConfig(**config, hash_function="sha256"))
    assert strong.core.seed != fast.core.seed
    tokens = np.arange(200)
    made = strong.prompt(tokens)
    assert made.hash_function == "sha256"
    with pytest.raises(ForeignPromptError):
        fast.lookup(made)
    with pytest.raises(ForeignPromptError):
        strong.lookup(fast.prompt(tokens))
    assert strong.lookup(made).usable_tokens == 0  # and its own lookups work
    with pytest.raises(KvfsmError, match=r"CoreConfig.hash_function must be one of"):
        CoreConfig(hash_function="xxh3")


# --- namespace and content keys ----------------------------------------------------------------


def test_head_is_the_first_tokens_with_the_same_keys() -> None:
    """``head(n)`` keeps the seed, function, sizes, namespace and content keys: its words are
    the prompt's first; out-of-range or non-int lengths are named."""
    prompt = Prompt(SEED, SIZES, list(range(100)), namespace="lora:a",
                    content_keys=[(30, 50, "image")], hash_function="sha256")
    head = prompt.head(70)
    assert (head.n_tokens, head.namespace, head.content_keys, head.hash_function) == \
        (70, b"lora:a", ((30, 50, b"image"),), "sha256")
    for size in SIZES:
        for got, whole in zip(head.words(size), prompt.words(size), strict=True):
            assert np.array_equal(got, whole[: got.size])
    assert prompt.head(0).n_tokens == 0
    for bad in (-1, 101, 3.0, True):
        with pytest.raises(KvfsmError, match=re.escape(f"head: n_tokens must be an int in "
                                                       f"[0, 100], got {bad!r}")):
            prompt.head(bad)  # type: ignore[arg-type]


def test_a_keyed_prompt_is_its_engines_and_no_other() -> None:
    """A prompt with a namespace or content keys is still its engine's (the engine takes it
    and its repr says so); another engine's refuses it as before; bad keys are refused by
    ``Engine.prompt`` naming them, with nothing made."""
    engine = Engine("dense", CoreConfig(device_blocks=8, backend="numpy"))
    other = Engine("dense", CoreConfig(device_blocks=8, backend="numpy", cache_salt="x"))
    prompt = engine.prompt(list(range(40)), namespace=b"t", content_keys=[(1, 2, "k")])
    assert engine.lookup(prompt).prompt_tokens == 40
    assert "namespace=b't', content_keys=1" in repr(prompt)
    with pytest.raises(ForeignPromptError):
        other.lookup(prompt)
    with pytest.raises(KvfsmError, match=r"content_keys\[0\]: start and end"):
        engine.prompt([1, 2], content_keys=[(2, 1, "k")])
    with pytest.raises(KvfsmError, match="namespace must be str or bytes"):
        engine.prompt([1, 2], namespace=7)  # type: ignore[arg-type]
