"""XXH3-128 block chains of an int64 token array in one compiled pass (no Python loop per block).

Block ``i``'s input is the 16-byte digest of block ``i - 1`` (the seed for block 0) followed by
its tokens as little-endian int64; its digest is XXH3-128 (xxHash 0.8, seed 0, default secret)
of those bytes in canonical (big-endian) order. The two stored words are that digest read as
two little-endian uint64, so they are also exactly the first two input words of the next block.

:data:`chain_kernel` is a port of the XXH3-128 specification for inputs whose length is a
multiple of 8 and at least 24 bytes (every block size gives ``16 + 8 * block_size`` bytes):
the 17-128 and 129-240 byte paths and the long (striped) path. Its twin calls the ``xxhash``
package block by block, so the differential test in ``tests/test_jit.py`` checks the port
against the reference implementation on random tokens, block sizes and parents. The hash is
defined by wrapping uint64 arithmetic: run uncompiled (tests only; the twin serves without
numba), NumPy scalars report each wrap as an overflow ``RuntimeWarning``.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvfsm._jit import kernel, read_only

#: XXH3's default 192-byte secret, from the xxHash specification.
_SECRET: Final = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_WORD_BYTES: Final = 8
#: ``SECRET_WORDS[k]``: the little-endian uint64 at byte ``k`` of the secret (XXH3 reads the
#: secret at unaligned offsets; a table makes each read one load).
SECRET_WORDS: Final = read_only(np.array(
    [int.from_bytes(_SECRET[k : k + _WORD_BYTES], "little")
     for k in range(len(_SECRET) - _WORD_BYTES + 1)], dtype=np.uint64))
#: Bytes of a digest, and uint64 words of one.
DIGEST_BYTES: Final = 16
DIGEST_WORDS: Final = DIGEST_BYTES // _WORD_BYTES

# XXH3's constants, as uint64 scalars so that numba keeps every operation in uint64.
_PRIME32_1: Final = np.uint64(0x9E3779B1)
_PRIME32_2: Final = np.uint64(0x85EBCA77)
_PRIME32_3: Final = np.uint64(0xC2B2AE3D)
_PRIME64_1: Final = np.uint64(0x9E3779B185EBCA87)
_PRIME64_2: Final = np.uint64(0xC2B2AE3D27D4EB4F)
_PRIME64_3: Final = np.uint64(0x165667B19E3779F9)
_PRIME64_4: Final = np.uint64(0x85EBCA77C2B2AE63)
_PRIME64_5: Final = np.uint64(0x27D4EB2F165667C5)
_PRIME_MX1: Final = np.uint64(0x165667919E3779F9)
_LOW32: Final = np.uint64(0xFFFFFFFF)
#: Every other byte, and every other 16-bit pair, of a word (for swapping its byte order).
_EVEN_BYTES: Final = np.uint64(0x00FF00FF00FF00FF)
_EVEN_PAIRS: Final = np.uint64(0x0000FFFF0000FFFF)
_ZERO: Final = np.uint64(0)
_SHIFT8: Final = np.uint64(8)
_SHIFT16: Final = np.uint64(16)
_SHIFT32: Final = np.uint64(32)
_SHIFT37: Final = np.uint64(37)
_SHIFT47: Final = np.uint64(47)
#: Input lengths (bytes) up to which XXH3 takes its short and its mid-size path.
_SHORT_MAX: Final = 128
_MID_MAX: Final = 240
#: Bytes per mix32B round, and the secret offsets of the mid-size path's later rounds and last
#: round (XXH3_MIDSIZE_STARTOFFSET; XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET - 16).
_ROUND_BYTES: Final = 32
_MID_START_OFFSET: Final = 3
_MID_LAST_OFFSET: Final = 103
_MID_FIRST_ROUNDS: Final = 4
#: Long path: stripe bytes, secret bytes consumed per stripe, stripes per block, and the offsets
#: of the last stripe's secret, the scramble's secret and the two merges' secrets.
_STRIPE_BYTES: Final = 64
_STRIPE_WORDS: Final = _STRIPE_BYTES // _WORD_BYTES
_SECRET_STEP: Final = 8
_STRIPES_PER_BLOCK: Final = (len(_SECRET) - _STRIPE_BYTES) // _SECRET_STEP
_LONG_BLOCK_BYTES: Final = _STRIPE_BYTES * _STRIPES_PER_BLOCK
_LAST_STRIPE_SECRET: Final = len(_SECRET) - _STRIPE_BYTES - 7
_SCRAMBLE_SECRET: Final = len(_SECRET) - _STRIPE_BYTES
_MERGE_LOW_SECRET: Final = 11
_MERGE_HIGH_SECRET: Final = len(_SECRET) - _STRIPE_BYTES - 11
_INIT_ACC: Final = read_only(np.array(
    [_PRIME32_3, _PRIME64_1, _PRIME64_2, _PRIME64_3, _PRIME64_4, _PRIME32_2, _PRIME64_5,
     _PRIME32_1], dtype=np.uint64))


def _example() -> tuple[Any, ...]:
    # Read-only tokens: the call site always passes a read-only view (numba compiles one
    # version per mutability), since token arrays it is given may be read-only.
    tokens = read_only(np.arange(64, dtype=np.int64))
    return (tokens, 16, np.zeros(DIGEST_WORDS, dtype=np.uint64), SECRET_WORDS,
            np.zeros(4, dtype=np.uint64), np.zeros(4, dtype=np.uint64))


def _inputs(rng: np.random.Generator) -> tuple[Any, ...]:
    # Block sizes reach all three XXH3 paths (<= 14 tokens: short, 15-28: mid, more: long,
    # beyond 126: several long blocks); ids span small and full-width int64 values.
    block_size = int(rng.choice([1, 2, 7, 14, 15, 16, 28, 29, 64, 127, 128, 200]))
    n_blocks = int(rng.integers(0, 5))
    top = int(rng.choice([4, 2**31, 2**63 - 1]))
    tokens = read_only(rng.integers(0, top, size=n_blocks * block_size, dtype=np.int64,
                                    endpoint=True))
    parent = rng.integers(0, 2**64 - 1, size=DIGEST_WORDS, dtype=np.uint64, endpoint=True)
    return (tokens, block_size, parent, SECRET_WORDS, np.zeros(n_blocks, dtype=np.uint64),
            np.zeros(n_blocks, dtype=np.uint64))


def _chain_twin(tokens: NDArray[np.int64], block_size: int, parent: NDArray[np.uint64],
                secret: NDArray[np.uint64], high: NDArray[np.uint64],
                low: NDArray[np.uint64]) -> None:
    """:func:`chain_kernel` with the ``xxhash`` package's XXH3-128, one call per block (its own
    secret is the default one, so ``secret`` is unused)."""
    digest = np.asarray(parent, dtype="<u8").tobytes()
    raw = np.ascontiguousarray(tokens, dtype="<i8").data.cast("B")
    step = block_size * _WORD_BYTES
    digests = []
    for block in range(high.size):
        digest = xxhash.xxh3_128_digest(digest + raw[block * step : (block + 1) * step])
        digests.append(digest)
    pairs = np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, DIGEST_WORDS)
    high[:] = pairs[:, 0]
    low[:] = pairs[:, 1]


@kernel(example=_example, twin=_chain_twin, inputs=_inputs)
def chain_kernel(tokens: NDArray[np.int64], block_size: int, parent: NDArray[np.uint64],
                 secret: NDArray[np.uint64], high: NDArray[np.uint64],
                 low: NDArray[np.uint64]) -> None:
    """``(high[i], low[i])``: the chained XXH3-128 words of block ``i`` of ``tokens`` (block
    ``i`` is ``tokens[i * block_size : (i + 1) * block_size]``; ``high.size`` blocks), block
    0 chained from the words ``parent``. ``secret`` is :data:`SECRET_WORDS`."""
    n_words = DIGEST_WORDS + block_size
    length = n_words * _WORD_BYTES
    length64 = np.uint64(length)
    words = np.empty(n_words, dtype=np.uint64)  # one block's input
    words[0] = parent[0]
    words[1] = parent[1]
    acc = np.empty(_STRIPE_WORDS, dtype=np.uint64)
    merged = np.zeros(2, dtype=np.uint64)  # the long path's two merges: low, high
    # The mid-size paths are a fixed schedule of mix32B rounds for a given length: the two
    # inputs' word offsets and the secret's byte offset of each round; the accumulators are
    # avalanched before round ``avalanche_at`` (129-240 bytes only).
    n_rounds = 0
    avalanche_at = -1
    first = np.zeros(_MID_MAX // _ROUND_BYTES + 1, dtype=np.int64)
    second = np.zeros(_MID_MAX // _ROUND_BYTES + 1, dtype=np.int64)
    key_at = np.zeros(_MID_MAX // _ROUND_BYTES + 1, dtype=np.int64)
    if length <= _SHORT_MAX:
        n_rounds = (length - 1) // _ROUND_BYTES + 1
        for step in range(n_rounds):
            j = n_rounds - 1 - step
            first[step] = 2 * j
            second[step] = (length - 16 - 16 * j) // _WORD_BYTES
            key_at[step] = _ROUND_BYTES * j
    elif length <= _MID_MAX:
        n_rounds = length // _ROUND_BYTES + 1
        avalanche_at = _MID_FIRST_ROUNDS
        for step in range(n_rounds - 1):
            first[step] = 4 * step
            second[step] = 4 * step + 2
            if step < _MID_FIRST_ROUNDS:
                key_at[step] = _ROUND_BYTES * step
            else:
                key_at[step] = _MID_START_OFFSET + _ROUND_BYTES * (step - _MID_FIRST_ROUNDS)
        first[n_rounds - 1] = (length - 16) // _WORD_BYTES
        second[n_rounds - 1] = (length - 32) // _WORD_BYTES
        key_at[n_rounds - 1] = _MID_LAST_OFFSET
    for block in range(high.size):
        start = block * block_size
        for k in range(block_size):
            words[DIGEST_WORDS + k] = np.uint64(tokens[start + k])
        if length <= _MID_MAX:
            acc_low = length64 * _PRIME64_1
            acc_high = _ZERO
            for step in range(n_rounds):
                if step == avalanche_at:
                    acc_low ^= acc_low >> _SHIFT37
                    acc_low *= _PRIME_MX1
                    acc_low ^= acc_low >> _SHIFT32
                    acc_high ^= acc_high >> _SHIFT37
                    acc_high *= _PRIME_MX1
                    acc_high ^= acc_high >> _SHIFT32
                one, two, key = first[step], second[step], key_at[step]
                for half in range(2):  # mix16B of the first input, then of the second
                    at = one if half == 0 else two
                    a = words[at] ^ secret[key + 16 * half]
                    b = words[at + 1] ^ secret[key + 16 * half + _WORD_BYTES]
                    # 64x64 -> 128-bit product folded to 64 bits (xor of its halves).
                    a_lo, a_hi, b_lo, b_hi = a & _LOW32, a >> _SHIFT32, b & _LOW32, b >> _SHIFT32
                    lo_lo, hi_lo = a_lo * b_lo, a_hi * b_lo
                    cross = (lo_lo >> _SHIFT32) + (hi_lo & _LOW32) + a_lo * b_hi
                    upper = (hi_lo >> _SHIFT32) + (cross >> _SHIFT32) + a_hi * b_hi
                    folded = ((cross << _SHIFT32) | (lo_lo & _LOW32)) ^ upper
                    # mix32B: each accumulator takes one input's mix and the other's sum.
                    if half == 0:
                        acc_low = (acc_low + folded) ^ (words[two] + words[two + 1])
                    else:
                        acc_high = (acc_high + folded) ^ (words[one] + words[one + 1])
            out_low = acc_low + acc_high
            out_high = acc_low * _PRIME64_1 + acc_high * _PRIME64_4 + length64 * _PRIME64_2
            out_low ^= out_low >> _SHIFT37
            out_low *= _PRIME_MX1
            out_low ^= out_low >> _SHIFT32
            out_high ^= out_high >> _SHIFT37
            out_high *= _PRIME_MX1
            out_high ^= out_high >> _SHIFT32
            out_high = _ZERO - out_high
        else:
            for lane in range(_STRIPE_WORDS):
                acc[lane] = _INIT_ACC[lane]
            n_long_blocks = (length - 1) // _LONG_BLOCK_BYTES
            last_stripes = ((length - 1) - _LONG_BLOCK_BYTES * n_long_blocks) // _STRIPE_BYTES
            total = n_long_blocks * _STRIPES_PER_BLOCK + last_stripes + 1
            for stripe in range(total):
                if stripe == total - 1:  # the last stripe: the input's final 64 bytes
                    at = (length - _STRIPE_BYTES) // _WORD_BYTES
                    key = _LAST_STRIPE_SECRET
                else:
                    at = stripe * _STRIPE_WORDS
                    key = (stripe % _STRIPES_PER_BLOCK) * _SECRET_STEP
                for pair in range(_STRIPE_WORDS // 2):  # lanes 2p and 2p + 1 swap their inputs
                    even, odd = words[at + 2 * pair], words[at + 2 * pair + 1]
                    keyed_even = even ^ secret[key + 16 * pair]
                    keyed_odd = odd ^ secret[key + 16 * pair + _WORD_BYTES]
                    acc[2 * pair] += odd + (keyed_even & _LOW32) * (keyed_even >> _SHIFT32)
                    acc[2 * pair + 1] += even + (keyed_odd & _LOW32) * (keyed_odd >> _SHIFT32)
                if stripe < n_long_blocks * _STRIPES_PER_BLOCK and (
                        stripe % _STRIPES_PER_BLOCK == _STRIPES_PER_BLOCK - 1):
                    for lane in range(_STRIPE_WORDS):  # scramble after each full block
                        value = acc[lane]
                        value ^= value >> _SHIFT47
                        value ^= secret[_SCRAMBLE_SECRET + lane * _WORD_BYTES]
                        acc[lane] = value * _PRIME32_1
            for half in range(2):  # the low word's merge, then the high word's
                if half == 0:
                    total_hash = length64 * _PRIME64_1
                    key = _MERGE_LOW_SECRET
                else:
                    total_hash = ~(length64 * _PRIME64_2)
                    key = _MERGE_HIGH_SECRET
                for pair in range(_STRIPE_WORDS // 2):
                    a = acc[2 * pair] ^ secret[key + 16 * pair]
                    b = acc[2 * pair + 1] ^ secret[key + 16 * pair + _WORD_BYTES]
                    a_lo, a_hi, b_lo, b_hi = a & _LOW32, a >> _SHIFT32, b & _LOW32, b >> _SHIFT32
                    lo_lo, hi_lo = a_lo * b_lo, a_hi * b_lo
                    cross = (lo_lo >> _SHIFT32) + (hi_lo & _LOW32) + a_lo * b_hi
                    upper = (hi_lo >> _SHIFT32) + (cross >> _SHIFT32) + a_hi * b_hi
                    total_hash += ((cross << _SHIFT32) | (lo_lo & _LOW32)) ^ upper
                total_hash ^= total_hash >> _SHIFT37
                total_hash *= _PRIME_MX1
                total_hash ^= total_hash >> _SHIFT32
                merged[half] = total_hash
            out_low, out_high = merged[0], merged[1]
        # Stored words: the canonical (big-endian) digest read as little-endian words, i.e.
        # each half byte-swapped; they are the next block's first input words.
        for half in range(2):
            value = out_high if half == 0 else out_low
            value = ((value & _EVEN_BYTES) << _SHIFT8) | ((value >> _SHIFT8) & _EVEN_BYTES)
            value = ((value & _EVEN_PAIRS) << _SHIFT16) | ((value >> _SHIFT16) & _EVEN_PAIRS)
            value = (value << _SHIFT32) | (value >> _SHIFT32)
            if half == 0:
                high[block] = value
            else:
                low[block] = value
            words[half] = value
