"""The position-weighted checksum of a tensor's raw bits, computable from disjoint fragments.

One function serves three places: the converter records it per state file in ``ucp_manifest.json``
as the bytes pass on their way to disk; each loading rank computes it over the fragments it
placed, at their offsets, and one all-reduce proves that the fragments reassemble every file;
``megatron-ucp verify`` recomputes it over whole files to find bit rot and modified files.

Definition. Element ``i`` of a flattened tensor (flat position ``i`` in its parameter), read as an
unsigned integer ``b_i`` of its own width (``bits`` = 32 for float32, 16 for bf16, ...), sits in
lane ``l = i mod e`` of the 64-bit word ``w = i div e`` (``e = 64 / bits`` elements per word) and
weighs ``c_i = (2w + 1) * 2**(bits * l)``. The checksum is::

    sum_i (b_i + 1) * c_i   mod 2**64

Why this form: it is additive over fragments at any offsets (ranks hash only what they read) and
exact integer arithmetic (independent of reduction order and device); and for whole words it is
``sum_w (v_w + K) * (2w + 1)`` where ``v_w`` is the word's little-endian value, so the bulk of a
tensor is one wrapping uint64 dot product of the bytes viewed as words (no copy) against a fixed
table of odd weights: several GB/s, faster than the CRC-32 the zip writer computes anyway. Every
single-bit change shows (``c_i`` is an odd number times a power of two below 2**64); ``+ 1`` makes
position matter even for zeros. Pure: numpy only (the converter does not import torch).
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

ALGORITHM = "ucp-wsum64-v2"
"""Name recorded in the manifest next to the sums; a reader that does not know it ignores them."""
MASK = (1 << 64) - 1
_WORDS_PER_CHUNK = 1 << 14
_WEIGHTS = 2 * np.arange(_WORDS_PER_CHUNK, dtype=np.uint64) + 1
_UINT_OF_SIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def as_uints(data: Any, itemsize: int) -> np.ndarray:
    """A bytes-like object (memoryview, mmap slice, numpy array) as little-endian unsigned ints of
    ``itemsize`` bytes, without a copy."""
    kind = _UINT_OF_SIZE.get(itemsize)
    if kind is None:
        raise ValueError(f"no checksum for {itemsize}-byte elements")
    if isinstance(data, np.ndarray):
        flat = data.reshape(-1)
        return flat if flat.dtype == np.dtype(kind) else flat.view(np.uint8).view(kind)
    return np.frombuffer(data, dtype=kind)


def _element_weight(i: int, per_word: int, bits: int) -> int:
    return ((2 * (i // per_word) + 1) << (bits * (i % per_word))) & MASK


def fragment_sum(values: np.ndarray, offset: int = 0) -> int:
    """Checksum of the unsigned ints ``values`` placed at flat element ``offset`` (a Python int < 2**64)."""
    if offset < 0:
        raise ValueError(f"negative fragment offset {offset}")
    itemsize = values.dtype.itemsize
    per_word, bits = 8 // itemsize, 8 * itemsize
    n = values.size
    total = 0
    # leading elements up to the first word boundary, and trailing ones after the last: one by one
    head = min(n, (-offset) % per_word)
    body_words = (n - head) // per_word
    tail_start = head + body_words * per_word
    for k in (*range(head), *range(tail_start, n)):
        total += (int(values[k]) + 1) * _element_weight(offset + k, per_word, bits)
    if body_words:
        words = values[head:tail_start].view("<u8")
        first = (offset + head) // per_word
        lanes = sum(1 << (bits * lane) for lane in range(per_word)) & MASK  # the "+ 1" of a whole word
        with np.errstate(over="ignore"):
            for start in range(0, body_words, _WORDS_PER_CHUNK):
                chunk = words[start:start + _WORDS_PER_CHUNK]
                m = chunk.size
                base = first + start
                # sum_k (v_k + lanes) * (W_k + 2*base), W_k = 2k + 1, sum_k W_k = m*m
                plain = int(chunk.sum(dtype=np.uint64))
                total += int(np.dot(chunk, _WEIGHTS[:m])) + 2 * base * plain + lanes * (m * m + 2 * base * m)
    return total & MASK


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


class StreamingSum:
    """The checksum of a tensor whose bytes arrive in order, in pieces of any length (the converter
    feeds it the chunks it writes, while they are in the CPU cache); pieces may split elements."""

    def __init__(self, itemsize: int, offset: int = 0):
        self.itemsize = itemsize
        self.start = offset
        self.offset = offset
        """Flat position of the next whole element."""
        self.value = 0
        self._carry = b""

    def update(self, piece: Any) -> None:
        data = memoryview(piece).cast("B")
        if self._carry:
            need = self.itemsize - len(self._carry)
            self._carry += bytes(data[:need])
            data = data[need:]
            if len(self._carry) < self.itemsize:
                return
            self._add(self._carry)
            self._carry = b""
        whole = len(data) - len(data) % self.itemsize
        if whole:
            self._add(data[:whole])
        self._carry = bytes(data[whole:])

    def _add(self, data: Any) -> None:
        values = as_uints(data, self.itemsize)
        self.value = (self.value + fragment_sum(values, self.offset)) & MASK
        self.offset += values.size

    @property
    def numel(self) -> int:
        """Whole elements seen so far."""
        return self.offset - self.start

    def result(self) -> int:
        if self._carry:
            raise ValueError(f"{len(self._carry)} bytes left over: not a whole number of {self.itemsize}-byte elements")
        return self.value
