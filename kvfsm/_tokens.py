"""Token ids as a request gives them, checked and made one 1-D int64 array before hashing.

Hashing reads tokens as int64 bytes, so anything that is not an integer in ``[0, 2**63)`` would
silently alias another prompt (``0.5`` hashes like ``0``, ``2**64 - 1`` like ``-1``); every
path that hashes tokens goes through :func:`as_token_ids` first.
"""

from __future__ import annotations

import reprlib
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvfsm._errors import TokenError

#: Token ids are hashed as int64, so the valid ids are exactly the non-negative int64 values.
TOKEN_ID_LIMIT = 2**63

_FLOAT_NOTE = ("floats are refused even when integral, since a float token array is almost "
               "always a bug upstream")
#: Lists up to this many ids are checked without NumPy reductions (see _from_sequence).
_FEW = 32
#: Keeps a message readable when the bad value is a long nested list or a long string.
_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = 4
_SHORT.maxstring = _SHORT.maxother = 30


def as_token_ids(token_ids: Sequence[int] | ArrayLike) -> NDArray[np.int64]:
    """``token_ids`` as a 1-D C-contiguous int64 array, or :class:`TokenError` if any id is
    not an integer in ``[0, 2**63)``. A C-contiguous int64 array, or a CPU int64 tensor, comes
    back as a view of the caller's memory (not a copy); other inputs are converted once.

    Accepted: a sequence (or an iterator) of Python or NumPy integers, a 1-D NumPy array of
    any integer dtype (int8..int64, uint8..uint64, or object holding integers), and a 1-D torch
    integer tensor (a GPU one is copied to the host). Refused: floats, even integral ones like
    ``3.0`` (a float token array is almost always a bug upstream, and ``0.5`` and ``0`` would
    otherwise hash alike); bools (a mask is not a prompt); complex numbers; strings and bytes;
    nested or 2-D input; scalars; negative ids; ids ``>= 2**63`` (they would wrap in int64).
    """
    if isinstance(token_ids, list):  # what requests carry: no other check applies
        return _from_sequence(token_ids)
    if isinstance(token_ids, str | bytes | bytearray | memoryview):
        raise TokenError(f"token_ids is {type(token_ids).__name__}, not a sequence of integer "
                         "token ids (tokenize first)")
    if isinstance(token_ids, np.ndarray):
        return _from_array(token_ids)
    if _is_torch_tensor(token_ids):
        return _from_array(_tensor_to_numpy(token_ids))
    if isinstance(token_ids, range):
        return _from_array(np.arange(token_ids.start, token_ids.stop, token_ids.step))
    if hasattr(token_ids, "__array__") or hasattr(token_ids, "__array_interface__"):
        return _from_array(np.asarray(token_ids))
    if isinstance(token_ids, Sequence):
        return _from_sequence(token_ids)
    if isinstance(token_ids, Iterator):  # a generator; sets and dicts have no token order
        return _from_sequence(list(token_ids))
    raise TokenError(f"token_ids must be a 1-D sequence of token ids, got "
                     f"{type(token_ids).__name__} {_SHORT.repr(token_ids)}")


def _from_sequence(values: Sequence[object]) -> NDArray[np.int64]:
    # struct's native "q" takes only int-likes (floats, strings and sequences raise) and
    # overflows at 2**63, in one C loop: the fastest correct list -> int64 conversion measured
    # (array('q') parses a format per item, np.fromiter casts floats and parses strings).
    # A Struct's own pack: ``struct.pack(format, *values)`` first copies the ids into a list
    # behind the format (one more pass over every id object: about a fifth of the time).
    try:
        packed = struct.Struct(f"{len(values)}q").pack(*values)
    except (struct.error, TypeError, OverflowError, ValueError):
        raise _first_bad(values) from None
    tokens: NDArray[np.int64] = np.frombuffer(packed, dtype=np.int64)
    if not tokens.size:
        return tokens
    if tokens.size <= _FEW:
        # A short list (a short prompt, a turn's new tokens): the same two checks over the
        # ids as Python objects, each one C-level pass; NumPy's reductions cost more to call
        # at this size than they save (16 ids: 0.5 us against 2.3).
        if min(tokens.tolist()) < 0 or bool in set(map(type, values)):
            raise _first_bad(values)
        return tokens
    if tokens.min() < 0:
        raise _first_bad(values)
    # bool is an int subclass, so array('q') took True as 1. Only ids 0 and 1 can be bools and
    # real prompts have few (a BOS id), so look at just those; when there are many, one C-speed
    # pass over the item types is cheaper than a Python loop over them.
    maybe_bools = np.flatnonzero(tokens <= 1)
    if maybe_bools.size > 64:
        has_bool = bool in set(map(type, values))
    else:
        has_bool = any(isinstance(values[i], bool) for i in maybe_bools.tolist())
    if has_bool:
        raise _first_bad(values)
    return tokens


def _from_array(values: NDArray[Any]) -> NDArray[np.int64]:
    if values.ndim != 1:
        raise TokenError(f"token_ids must be 1-D (one request's tokens), got shape "
                         f"{values.shape}")
    if not values.size:  # nothing to hash, whatever the dtype (np.array([]) is float64)
        return np.zeros(0, dtype=np.int64)
    kind, itemsize = values.dtype.kind, values.dtype.itemsize
    if kind == "O":
        return _from_sequence(values.tolist())
    if kind not in "iu":  # bool, float, complex, str, bytes, datetime, void: never token ids
        raise _bad(0, values[0])
    # One reduction on the hot path: int64 can only be negative, uint64 only too large, and
    # narrower dtypes need at most the sign check.
    if kind == "i" and values.min() < 0:
        position = int(np.argmax(values < 0))
        raise _bad(position, values[position])
    if kind == "u" and itemsize == 8 and values.max() >= TOKEN_ID_LIMIT:
        position = int(np.argmax(values >= TOKEN_ID_LIMIT))
        raise _bad(position, values[position])
    # C-contiguous int64 (an array or a CPU tensor's view) comes back as it is, not copied.
    return np.ascontiguousarray(values, dtype=np.int64)


def _first_bad(values: Sequence[object]) -> TokenError:
    """The error for the first invalid item (only called once the fast check has failed)."""
    for position, value in enumerate(values):
        if (isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer)
                or not 0 <= value < TOKEN_ID_LIMIT):
            return _bad(position, value)
    return TokenError("token_ids could not be read as integer token ids")


def _bad(position: int, value: object) -> TokenError:
    """The error naming ``token_ids[position]`` and why its value is no token id."""
    if isinstance(value, np.generic):
        value = value.item()  # show 0.5, not np.float64(0.5)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, list | tuple | np.ndarray):
            why = "is a sequence: token_ids must be 1-D (one request's tokens)"
        elif isinstance(value, float):
            why = f"is not an integer token id ({_FLOAT_NOTE})"
        elif isinstance(value, bool):
            why = "is not an integer token id (bools are a mask, not a prompt)"
        else:
            why = "is not an integer token id"
    elif value < 0:
        why = "is negative"
    else:
        why = "is >= 2**63 (token ids are hashed as int64)"
    return TokenError(f"token_ids[{position}] = {_SHORT.repr(value)} {why}")


def _is_torch_tensor(value: object) -> bool:
    # Duck typing keeps torch an optional dependency, never imported here.
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy")


def _tensor_to_numpy(tensor: Any) -> NDArray[Any]:
    try:
        values: NDArray[Any] = tensor.detach().cpu().numpy()
    except (TypeError, RuntimeError):  # dtypes NumPy lacks, such as bfloat16
        raise TokenError(f"token_ids is a tensor of {tensor.dtype}, not of integer token ids; "
                         f"{_FLOAT_NOTE}") from None
    return values
