"""kvfsm pages in vLLM's KV tensors: the connector's worker side reads and writes them here.

A kvfsm page of a block is, per layer of its KV cache group (in the group's layer order), the
block's row of each of the layer's tensors, one after another (:func:`state_tensors`). KV
tensors are block-major: the CPU backend's attention tensor ``(blocks, kv heads, block size,
2 * head size)``, each Mamba state tensor ``(blocks, ...)`` (vLLM carves a layer's conv and SSM
states out of one buffer, so their block stride can exceed their row).

:class:`GroupPages` moves many blocks at once: one gather (or scatter) per tensor, whatever
the number of blocks. On CPU it goes through NumPy views of the tensors' memory, on the calling
thread: torch's ``index_select`` hands even a few blocks to its OpenMP pool, and waking it costs
milliseconds per call where vLLM's own threads hold every core (measured: 2.6 ms to gather 16
blocks of two layers in ``wait_for_save``, against 20 us here). A tensor NumPy cannot view (on a
GPU, or whose block row is not one contiguous run) goes through torch. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvfsm._errors import KvfsmError


def state_tensors(cache: Any) -> list[Any]:
    """The tensors of one layer's KV cache, each indexed by vLLM block first: the layer's
    tensor (attention: ``(blocks, kv heads, block size, 2 * head size)`` on CPU), or its state
    tensors in order (Mamba and linear attention: conv state, then SSM state)."""
    import torch

    if isinstance(cache, torch.Tensor):
        return [cache]
    return list(cache)


def byte_rows(tensor: Any) -> NDArray[np.uint8] | None:
    """``tensor``'s memory as ``uint8 [blocks, row bytes]``, row ``b`` the bytes of
    ``tensor[b]`` in order (a view, never a copy: writing it writes the tensor), where
    ``tensor`` is on the CPU and each block's row is one contiguous run; None where not."""
    import torch

    if tensor.device.type != "cpu" or tensor.dim() == 0 or not tensor.shape[0] \
            or tensor.requires_grad or not tensor[0].is_contiguous():
        return None
    try:
        flat = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
        memory = flat.numpy()
    except (RuntimeError, TypeError):
        return None
    size = tensor.element_size()
    rows: NDArray[np.uint8] = np.lib.stride_tricks.as_strided(
        memory, shape=(int(tensor.shape[0]), int(tensor[0].numel()) * size),
        strides=(int(tensor.stride(0)) * size, 1))
    return rows


class GroupPages:
    """The pages of one KV cache group's blocks in ``tensors`` (every tensor of every layer of
    the group, in page order; ``where`` names them in errors)."""

    def __init__(self, tensors: Sequence[Any], where: str) -> None:
        self.where = where
        #: Per tensor: (tensor, its byte rows or None, offset in the page, bytes per block).
        self._parts: list[tuple[Any, NDArray[np.uint8] | None, int, int]] = []
        offset = 0
        for tensor in tensors:
            size = int(tensor[0].numel()) * tensor.element_size()
            self._parts.append((tensor, byte_rows(tensor), offset, size))
            offset += size
        #: Bytes of a page: what the group's tensors hold per block.
        self.page_bytes = offset

    def read(self, blocks: NDArray[np.int64]) -> NDArray[np.uint8]:
        """The pages of vLLM blocks ``blocks``, ``uint8 [len(blocks), page_bytes]``."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(self._parts) == 1 and self._parts[0][1] is not None:
            single: NDArray[np.uint8] = self._parts[0][1][blocks]
            return single
        out = np.empty((blocks.size, self.page_bytes), dtype=np.uint8)
        for tensor, rows, offset, size in self._parts:
            if rows is not None:
                out[:, offset:offset + size] = rows[blocks]
            else:
                out[:, offset:offset + size] = _torch_read(tensor, blocks)
        return out

    def write(self, blocks: NDArray[np.int64], pages: NDArray[np.uint8]) -> None:
        """Write ``pages`` (``uint8 [len(blocks), page_bytes]``) into vLLM blocks ``blocks``
        (a block named twice gets its last page). A page of another size is a
        :class:`KvfsmError` before anything is written."""
        blocks = np.asarray(blocks, dtype=np.int64)
        pages = np.asarray(pages, dtype=np.uint8)
        if pages.ndim != 2 or pages.shape[0] != blocks.size:
            raise KvfsmError(f"{self.where}: {blocks.size} blocks but pages of shape "
                             f"{list(pages.shape)}")
        if pages.shape[1] < self.page_bytes:
            raise KvfsmError(f"KV tensors of {self.where}: their block does not fit in kvfsm's "
                             f"page of {pages.shape[1]} bytes")
        if pages.shape[1] != self.page_bytes:
            raise KvfsmError(f"{self.where}: their blocks hold {self.page_bytes} bytes, "
                             f"kvfsm's page {pages.shape[1]}")
        for tensor, rows, offset, size in self._parts:
            if rows is not None:
                rows[blocks] = pages[:, offset:offset + size]
            else:
                _torch_write(tensor, blocks, pages[:, offset:offset + size])


def _torch_read(tensor: Any, blocks: NDArray[np.int64]) -> NDArray[np.uint8]:
    """``tensor``'s rows ``blocks`` as bytes, through torch (a tensor NumPy cannot view)."""
    import torch

    index = torch.from_numpy(blocks).to(tensor.device)
    rows = tensor.index_select(0, index).contiguous()
    out: NDArray[np.uint8] = rows.view(torch.uint8).reshape(blocks.size, -1).cpu().numpy()
    return out


def _torch_write(tensor: Any, blocks: NDArray[np.int64], chunk: NDArray[np.uint8]) -> None:
    """Write byte rows ``chunk`` into ``tensor``'s rows ``blocks``, through torch."""
    import torch

    data = torch.from_numpy(np.ascontiguousarray(chunk)).view(tensor.dtype)
    data = data.view((blocks.size, *tensor.shape[1:])).to(tensor.device)
    if np.unique(blocks).size == blocks.size:
        tensor.index_copy_(0, torch.from_numpy(blocks).to(tensor.device), data)
        return
    for row, block in enumerate(blocks.tolist()):  # in order: a repeated block keeps its last
        tensor[block].copy_(data[row])
