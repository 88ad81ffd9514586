"""The position-weighted checksum of a tensor's raw bits, computable from disjoint fragments.

One function serves three places: the converter records it per state file in ``ucp_manifest.json``
as the bytes pass on their way to disk; each loading rank computes it over the fragments it
placed, at their offsets, and one all-reduce proves that the fragments reassemble every file;
``megatron-ucp verify`` recomputes it over whole files to find bit rot and modified files.

Definition (``ucp-wsum64-v3``). Element ``i`` of a flattened tensor (flat position ``i`` in its
parameter), read as an unsigned integer ``b_i`` of its own width (32 bits for float32, 16 for
bf16, ...), weighs ``c_i = T[i mod P] * (2 * (i div P) + 1) mod 2**64``, where ``T`` is a fixed
table of ``P`` = 16384 odd 64-bit words (splitmix64 of the index, low bit set). The checksum is::

    sum_i (b_i + 1) * c_i   mod 2**64

Why this form: it is additive over fragments at any offsets (ranks hash only what they read) and
exact integer arithmetic (independent of reduction order and device); a fragment is one wrapping
multiply-and-sum per period it touches, against a slice of ``T``, with no copy of the data. Every
weight is odd, so every change of one element shows; ``+ 1`` makes position matter even for
zeros. Weights look random across positions, so no class of changes cancels: two sign-bit flips
(``+-2**31 * (c_i +- c_j)``) cancel only where ``c_i = -+c_j`` modulo 2**33, which never happens
within one residue of ``P`` (below 2**32 periods) and for other pairs by the table's chance, about
one pair in 2**32: the room any 64-bit sum leaves a change of bit 31.

The previous definition (``ucp-wsum64-v2``, :data:`LEGACY_ALGORITHM`) packed elements into 64-bit
words and weighed element ``i`` by ``(2w + 1) * 2**(bits * (i mod e))`` (``w`` its word, ``e``
elements per word): odd-lane elements got weights of ``2**32`` times an odd number, so any two
sign-bit flips at odd-indexed float32 elements of one state added ``2**63 + 2**63 = 0``. Manifests
written with it are still checked with it (:func:`fragment_sum`'s ``algorithm``). Pure: numpy only
(the converter does not import torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

log = logging.getLogger(__name__)

ALGORITHM = "ucp-wsum64-v3"
"""Name recorded in the manifest next to the sums; a reader that does not know it ignores them."""
LEGACY_ALGORITHM = "ucp-wsum64-v2"
"""What megatron-ucp recorded before v3; its manifests are still checked with it."""
KNOWN_ALGORITHMS = (ALGORITHM, LEGACY_ALGORITHM)
MASK = (1 << 64) - 1
PERIOD = 1 << 14
_WORDS_PER_CHUNK = 1 << 14
_WEIGHTS = 2 * np.arange(_WORDS_PER_CHUNK, dtype=np.uint64) + 1
_UINT_OF_SIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _splitmix64(index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = index * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_TABLE = _splitmix64(np.arange(PERIOD, dtype=np.uint64)) | np.uint64(1)
with np.errstate(over="ignore"):
    _TABLE_PREFIX = np.concatenate([np.zeros(1, np.uint64), np.cumsum(_TABLE, dtype=np.uint64)])
"""``_TABLE_PREFIX[k]`` = sum of the first ``k`` table entries mod 2**64 (the ``+ 1`` term of a piece)."""


def weight(i: int) -> int:
    """``c_i`` of v3 (the module docstring's definition), for one position."""
    q, r = divmod(i, PERIOD)
    return (int(_TABLE[r]) * (2 * q + 1)) & MASK


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


def fragment_sum(values: np.ndarray, offset: int = 0, algorithm: str = ALGORITHM) -> int:
    """Checksum of the unsigned ints ``values`` placed at flat element ``offset`` (a Python int < 2**64),
    by ``algorithm`` (one of :data:`KNOWN_ALGORITHMS`)."""
    if offset < 0:
        raise ValueError(f"negative fragment offset {offset}")
    if algorithm == ALGORITHM:
        return _period_sum(values, offset)
    if algorithm != LEGACY_ALGORITHM:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(KNOWN_ALGORITHMS)})")
    return _word_sum(values, offset)


def _period_sum(values: np.ndarray, offset: int) -> int:
    """v3: per period piece, ``(2q + 1) * (sum_k b_k * T[r + k] + sum_k T[r + k])``."""
    n = values.size
    total, pos = 0, 0
    buf = np.empty(min(n, PERIOD), dtype=np.uint64)
    with np.errstate(over="ignore"):
        while pos < n:
            q, r = divmod(offset + pos, PERIOD)
            m = min(PERIOD - r, n - pos)
            np.multiply(values[pos : pos + m], _TABLE[r : r + m], out=buf[:m], dtype=np.uint64)
            piece = int(buf[:m].sum(dtype=np.uint64)) + int(_TABLE_PREFIX[r + m] - _TABLE_PREFIX[r])
            total += piece * (2 * q + 1)
            pos += m
    return total & MASK


def _word_sum(values: np.ndarray, offset: int) -> int:
    """v2 (:data:`LEGACY_ALGORITHM`): elements packed into 64-bit words."""
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
                chunk = words[start : start + _WORDS_PER_CHUNK]
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

    def __init__(self, itemsize: int, offset: int = 0, algorithm: str = ALGORITHM):
        self.algorithm = algorithm
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
        self.value = (self.value + fragment_sum(values, self.offset, self.algorithm)) & MASK
        self.offset += values.size

    @property
    def numel(self) -> int:
        """Whole elements seen so far."""
        return self.offset - self.start

    def result(self) -> int:
        if self._carry:
            raise ValueError(f"{len(self._carry)} bytes left over: not a whole number of {self.itemsize}-byte elements")
        return self.value


@dataclass(frozen=True)
class RecordedChecksums:
    """The manifest's checksums: the algorithm that made them and, per state file (``<param>/<state>``),
    ``{"numel", "sum"[, "rows_numel", "rows_sum"]}``."""

    algorithm: str
    files: dict[str, dict]


def recorded_checksums(manifest: Optional[dict]) -> Optional[RecordedChecksums]:
    """The manifest's checksums, or None: a folder without them (stock's, or converted before
    megatron-ucp recorded them) or with an algorithm this megatron-ucp does not know (warned: not
    checked). Older algorithms it knows (:data:`~megatron_ucp.format.KNOWN_ALGORITHMS`)
    are checked with their own definition."""
    sums = (manifest or {}).get("checksums")
    if not isinstance(sums, dict):
        return None
    algorithm = sums.get("algorithm")
    if algorithm not in KNOWN_ALGORITHMS:
        log.warning("manifest checksums use %r, which this megatron-ucp does not know: not checked", algorithm)
        return None
    files = sums.get("files")
    return RecordedChecksums(str(algorithm), files) if isinstance(files, dict) else None
