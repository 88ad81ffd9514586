"""Reproducible values for a synthetic checkpoint, any element range of any flat buffer on demand.

A flat buffer (named by the caller: one param group of one model-parallel rank, or of every rank
that holds the same values) is cut into blocks of :data:`BLOCK` elements; each block's values come
from a generator seeded with a hash of (seed, buffer name, state, block).
So a value depends on where it sits in the model, not on the DP size or on which rank file holds
it: the same model written at DP 8 and at DP 768 holds the same numbers (their universal
conversions are byte-identical), a rank's partition is made without the rest, and a test can
rebuild any parameter independently. Padding (from the group's real length on) is zero, as in
DeepSpeed's buffers, where Adam leaves the zero-initialised padding at zero.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS, SECOND_MOMENTS

BLOCK = 1 << 16
"""Elements per seeded block (256 KiB of fp32): a partition boundary wastes at most one block."""
STATES = ("fp32", *sorted({s for states, _ in BASE_OPTIMIZERS.values() for s in states}))


@functools.lru_cache(maxsize=256)
def _block(seed: int, buffer: str, state: str, index: int) -> torch.Tensor:
    """One block's values (cached: at stage 3 every rank's slice of a small parameter falls in the same
    block, drawn once instead of once per rank; callers copy out of it, never write into it)."""
    return _draw(seed, buffer, state, index)


def _draw(seed: int, buffer: str, state: str, index: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}/{buffer}/{state}/{index}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    if state in SECOND_MOMENTS:  # non-negative
        return torch.rand(BLOCK, generator=gen).mul_(1e-6)
    values = torch.randn(BLOCK, generator=gen)
    return values.mul_(0.02 if state == "fp32" else 1e-3)


def flat_range(seed: int, buffer: str, state: str, start: int, stop: int, real: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flat buffer of ``state``; those at ``real`` and beyond are 0."""
    if state not in STATES:
        raise ValueError(f"unknown state {state!r}; one of {STATES}")
    out = torch.zeros(max(stop - start, 0), dtype=torch.float32)
    end = min(stop, real)
    pos = start
    while pos < end:
        index = pos // BLOCK
        lo = pos - index * BLOCK
        hi = min(BLOCK, end - index * BLOCK)
        out[pos - start : pos - start + hi - lo] = _block(seed, buffer, state, index)[lo:hi]
        pos += hi - lo
    return out
