"""kvfsm pages in vLLM's KV tensors (``kvfsm.integrations.vllm._pages``): a page written into
a group's blocks reads back as the same bytes, whatever the tensors' layout, and a page of
the wrong size writes nothing. Plain torch tensors stand in for vLLM's own, laid out as vLLM
lays them out on CPU; no vLLM import."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfsm import KvfsmError

torch = pytest.importorskip("torch")

from kvfsm.integrations.vllm._pages import GroupPages, byte_rows  # noqa: E402

BLOCKS = 12


def _attention(dtype: Any = None) -> Any:
    """A CPU attention layer's tensor: (blocks, kv heads, block size, 2 * head size)."""
    return torch.zeros((BLOCKS, 2, 32, 2 * 64), dtype=dtype or torch.bfloat16)


def _mamba_states() -> list[Any]:
    """A linear-attention layer's conv and SSM states carved out of one buffer per block, as
    vLLM does: each state's block stride is the whole buffer row, more than its own row."""
    conv_shape, ssm_shape = (3, 96), (2, 64, 64)
    conv_size = int(np.prod(conv_shape)) * 2  # bfloat16
    ssm_size = int(np.prod(ssm_shape)) * 4  # float32
    buffer = torch.zeros((BLOCKS, conv_size + ssm_size), dtype=torch.uint8)
    conv = buffer[:, :conv_size].view(torch.bfloat16).view(BLOCKS, *conv_shape)
    ssm = buffer[:, conv_size:].view(torch.float32).view(BLOCKS, *ssm_shape)
    return [conv, ssm]


def _pages(tensors: list[Any], rng: np.random.Generator, count: int) -> np.ndarray:
    page = sum(int(t[0].numel()) * t.element_size() for t in tensors)
    return rng.integers(0, 256, (count, page), dtype=np.uint8)


@pytest.mark.parametrize("layout", ["attention", "two layers", "mamba", "transposed"])
def test_pages_written_read_back_byte_for_byte_and_touch_no_other_block(layout: str) -> None:
    """Whatever the group's tensors (one attention tensor, two layers, Mamba states sharing a
    buffer, a tensor NumPy cannot view as rows), the pages written into some blocks read
    back as written, and every other block keeps its bytes."""
    if layout == "attention":
        tensors = [_attention()]
    elif layout == "two layers":
        tensors = [_attention(), _attention(torch.float16)]
    elif layout == "mamba":
        tensors = [*_mamba_states(), _attention()]
    else:
        tensors = [torch.zeros((64, BLOCKS), dtype=torch.float32).t()]
    rng = np.random.default_rng(3)
    pages = GroupPages(tensors, layout)
    before = pages.read(np.arange(BLOCKS))
    blocks = np.array([7, 2, 9], dtype=np.int64)
    written = _pages(tensors, rng, blocks.size)
    pages.write(blocks, written)
    assert np.array_equal(pages.read(blocks), written)
    others = np.setdiff1d(np.arange(BLOCKS), blocks)
    assert np.array_equal(pages.read(others), before[others])
    # Through the tensors themselves: torch sees the bytes the page put there.
    one = GroupPages(tensors, layout)
    assert np.array_equal(one.read(blocks[:1]), written[:1])


def test_a_page_of_another_size_is_refused_and_nothing_is_written() -> None:
    """A page that is not exactly the group's bytes per block is a KvfsmError naming the
    group, and every tensor keeps its bytes."""
    tensors = [_attention(), _attention()]
    pages = GroupPages(tensors, "layers ['a', 'b']")
    before = pages.read(np.arange(BLOCKS))
    for width in (pages.page_bytes - 1, pages.page_bytes + 1):
        with pytest.raises(KvfsmError, match="layers"):
            pages.write(np.array([1]), np.ones((1, width), dtype=np.uint8))
    with pytest.raises(KvfsmError, match="2 blocks"):
        pages.write(np.array([1, 2]), np.ones((1, pages.page_bytes), dtype=np.uint8))
    assert np.array_equal(pages.read(np.arange(BLOCKS)), before)


def test_byte_rows_views_only_what_numpy_can_view_as_rows() -> None:
    """A CPU tensor whose block rows are contiguous is viewed (writing the view writes the
    tensor); a transposed one is not (None: it goes through torch)."""
    tensor = _attention(torch.float32)
    rows = byte_rows(tensor)
    assert rows is not None and rows.shape == (BLOCKS, 2 * 32 * 128 * 4)
    rows[4, :4] = np.frombuffer(np.float32(1.5).tobytes(), dtype=np.uint8)
    assert float(tensor[4, 0, 0, 0]) == 1.5
    assert byte_rows(torch.zeros((8, BLOCKS)).t()) is None
