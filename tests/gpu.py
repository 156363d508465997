"""Shared GPU markers: GPU tests carry ``gpu`` and skip cleanly where CuPy has no device."""

from __future__ import annotations

import pytest

from kvfsm.memory import BackendUnavailable, CupyBackend


def _gpu_available() -> bool:
    try:
        CupyBackend()
    except BackendUnavailable:
        return False
    return True


HAVE_GPU = _gpu_available()
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA device"),
]
