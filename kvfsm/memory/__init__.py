"""The physical line: real byte arrays behind the state machines.

``SlotPool`` is one tier's slot allocator over one aligned array; ``Backend`` hides whether that
array is NumPy host memory or CuPy device memory.
"""

from kvfsm.memory._backend import (
    Backend,
    BackendUnavailable,
    CupyBackend,
    NumpyBackend,
    select_backend,
    torch_view,
)
from kvfsm.memory._pool import PoolExhausted, SlotError, SlotPool

__all__ = [
    "Backend",
    "BackendUnavailable",
    "CupyBackend",
    "NumpyBackend",
    "PoolExhausted",
    "SlotError",
    "SlotPool",
    "select_backend",
    "torch_view",
]
