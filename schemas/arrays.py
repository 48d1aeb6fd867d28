"""Per-token arrays on the wire: raw little-endian bytes, read back with ``np.frombuffer``.

msgspec has no numpy support, and Python lists of ints/floats are ~30x slower to encode
and decode than raw bytes (see NATS_NOTES.md). Every per-token array in a schema is a
``bytes`` field in one of three dtypes; these helpers are the only place that knows them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

I32 = np.dtype("<i4")  # token ids
F32 = np.dtype("<f4")  # logprobs, temperatures, advantages, weights
U8 = np.dtype("u1")  # masks (0/1)


def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def pack_mask(values: Sequence[bool] | Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=bool).astype(U8).tobytes()


def i32(buf: bytes | memoryview) -> np.ndarray:
    """Token ids as a read-only int32 array (zero copy)."""
    return np.frombuffer(buf, dtype=I32)


def f32(buf: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=F32)


def mask(buf: bytes | memoryview) -> np.ndarray:
    """A 0/1 mask as a read-only bool array (zero copy)."""
    return np.frombuffer(buf, dtype=U8).view(bool)
