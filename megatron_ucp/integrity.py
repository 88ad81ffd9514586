"""The position-weighted checksum of a tensor's raw bits, computable from disjoint fragments.

One function serves three places: the converter records it per state file in ``ucp_manifest.json``
as the bytes pass on their way to disk; each loading rank computes it over the fragments it
placed, at their offsets, and one all-reduce proves that the fragments reassemble every file;
``megatron-ucp verify`` recomputes it over whole files to find bit rot and modified files.

Definition, for the elements ``b_i`` of a flattened tensor read as unsigned integers of their own
width (float32 -> uint32, bf16 -> uint16, ...), at flat position ``offset + i`` of their parameter::

    sum_i (b_i + 1) * (2 * (offset + i) + 1)   mod 2**64

It is additive over fragments at any offsets (so ranks hash only what they read), exact integer
arithmetic (so the result does not depend on reduction order or device), and fast: one wrapping
uint64 dot product per chunk against a fixed table of odd weights (about as fast as copying the
bytes), because a chunk at ``start`` weighs ``W_k + 2*start`` and the ``2*start`` part factors out.
Odd weights make every single-bit change visible; ``+ 1`` makes position matter even for zeros.
Pure: numpy only (the converter does not import torch).
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

ALGORITHM = "ucp-wsum64-v1"
"""Name recorded in the manifest next to the sums; a reader that does not know it ignores them."""
MASK = (1 << 64) - 1
_CHUNK = 1 << 16
_WEIGHTS = 2 * np.arange(_CHUNK, dtype=np.uint64) + 1
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def as_uints(data: Any, itemsize: int) -> np.ndarray:
    """A bytes-like object (memoryview, mmap slice, numpy array) as unsigned ints of ``itemsize`` bytes."""
    kind = _UINT_OF_SIZE.get(itemsize)
    if kind is None:
        raise ValueError(f"no checksum for {itemsize}-byte elements")
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8).view(kind) if data.dtype != kind else data.reshape(-1)
    return np.frombuffer(data, dtype=kind)


def fragment_sum(values: np.ndarray, offset: int = 0) -> int:
    """Checksum of the unsigned ints ``values`` placed at flat element ``offset`` (a Python int < 2**64)."""
    if offset < 0:
        raise ValueError(f"negative fragment offset {offset}")
    total = 0
    n = values.size
    with np.errstate(over="ignore"):
        for start in range(0, n, _CHUNK):
            piece = values[start:start + _CHUNK].astype(np.uint64)
            m = piece.size
            weighted = int(np.dot(piece, _WEIGHTS[:m]))
            plain = int(piece.sum(dtype=np.uint64))
            base = offset + start
            # sum over the chunk of (b + 1) * (W_k + 2*base): the b-terms, then the +1 terms in closed form
            total += weighted + 2 * base * plain + m * (2 * base + m)
    return total & MASK


def bytes_sum(data: Any, itemsize: int, offset: int = 0) -> int:
    """:func:`fragment_sum` of raw bytes holding elements of ``itemsize`` bytes."""
    return fragment_sum(as_uints(data, itemsize), offset)


def combine(sums: Iterable[int]) -> int:
    """The checksum of a tensor from those of the fragments that partition it."""
    return sum(int(s) for s in sums) & MASK


def split(value: int) -> tuple[int, int]:
    """(high, low) 32-bit halves: what an int64 all-reduce can sum without overflow."""
    value &= MASK
    return value >> 32, value & 0xFFFFFFFF


def join(high: int, low: int) -> int:
    """Inverse of :func:`split` after the halves of several values were summed separately."""
    return ((int(high) << 32) + int(low)) & MASK
