"""The compiled XXH3-128 chain: the same digests as the xxhash package on every path of XXH3
that a block's input can take, compiled and as plain Python."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import xxhash

from kvfsm._jit import read_only
from kvfsm._jit import settings as jit
from kvfsm.state._hash_kernel import DIGEST_WORDS, SECRET_WORDS, chain_kernel

# XXH3 wraps uint64 arithmetic by definition; uncompiled, NumPy scalars warn at each wrap.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning")

#: Block sizes at the edges of XXH3's paths for an input of 16 + 8 * size bytes: 17-128 bytes
#: (1-14), 129-240 (15-28), striped (29+), one 1024-byte stripe block and more (126-128, 300).
EDGE_SIZES = [1, 2, 4, 6, 10, 12, 14, 15, 16, 20, 27, 28, 29, 30, 64, 125, 126, 127, 128, 129,
              300]


def _runs() -> list[tuple[str, Callable[..., None]]]:
    runs: list[tuple[str, Callable[..., None]]] = [("python", chain_kernel.python)]
    if jit.available:
        runs.append(("compiled", chain_kernel.compiled))
    return runs


@pytest.mark.parametrize("block_size", EDGE_SIZES)
def test_every_xxh3_path_matches_the_xxhash_package(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    n_blocks = 3
    tokens = read_only(rng.integers(0, 2**63 - 1, size=n_blocks * block_size, dtype=np.int64))
    parent = rng.integers(0, 2**64 - 1, size=DIGEST_WORDS, dtype=np.uint64, endpoint=True)
    digest = parent.astype("<u8").tobytes()
    want = []
    for block in range(n_blocks):
        chunk = tokens[block * block_size : (block + 1) * block_size].astype("<i8").tobytes()
        digest = xxhash.xxh3_128_digest(digest + chunk)
        want.append(tuple(np.frombuffer(digest, dtype="<u8").tolist()))
    for name, run in _runs():
        high = np.zeros(n_blocks, dtype=np.uint64)
        low = np.zeros(n_blocks, dtype=np.uint64)
        run(tokens, block_size, parent, SECRET_WORDS, high, low)
        assert list(zip(high.tolist(), low.tolist(), strict=True)) == want, name


def test_no_blocks_writes_nothing_and_the_secret_is_xxh3s() -> None:
    high = np.zeros(0, dtype=np.uint64)
    chain_kernel(read_only(np.zeros(0, dtype=np.int64)), 16, np.zeros(2, dtype=np.uint64),
                 SECRET_WORDS, high, high.copy())
    assert SECRET_WORDS.size == 185 and not SECRET_WORDS.flags.writeable
    # The secret's first and last words (xxHash's kSecret starts b8 fe 6c 39, ends 4b 40 7e).
    assert int(SECRET_WORDS[0]) & 0xFFFFFFFF == 0x396CFEB8
    assert int(SECRET_WORDS[-1]) >> 40 == 0x7E404B
