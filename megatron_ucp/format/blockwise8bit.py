"""A flat tensor stored as 8-bit codes in blocks (bitsandbytes' blockwise quantization), read as its fp32 values.

A code's value is ``qmap[code] * absmax[i // blocksize]``: one fp32 product, so any range decodes on its own, exactly
as bitsandbytes' ``dequantize_blockwise`` gives it. numpy only (the file formats do not import torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_ucp.format.rawtensor import RawTensor

QMAP_SIZE = 256

Read = Callable[[RawTensor, int, np.ndarray], None]
"""Elements ``[start, start + out.size)`` of a flat tensor of a rank file into ``out`` (exactly those bytes)."""


@dataclass(frozen=True)
class Blockwise8bit:
    """One quantized flat tensor in a file (its codes, block scales and code book located, not read), decoded on read:
    to the planner, a flat fp32 tensor of :meth:`numel` elements."""

    codes: RawTensor
    absmax: RawTensor
    qmap: RawTensor
    blocksize: int

    def numel(self) -> int:
        return self.codes.numel()

    def dim(self) -> int:
        return 1

    def decode(self, read: Read, start: int, out: np.ndarray) -> np.ndarray:
        """Elements ``[start, start + out.size)`` as fp32 values into ``out``: their codes, the scales of the blocks
        they lie in and the code book read, nothing else. Returns the codes (what a save's checksum is of)."""
        n = out.size
        codes = np.empty(n, dtype=np.uint8)
        if n == 0:
            return codes
        read(self.codes, start, codes)
        first, last = start // self.blocksize, (start + n - 1) // self.blocksize
        scales = np.empty(last - first + 1, dtype=np.float32)
        read(self.absmax, first, scales)
        book = np.empty(QMAP_SIZE, dtype=np.float32)
        read(self.qmap, 0, book)
        blocks = np.arange(start, start + n, dtype=np.int64) // self.blocksize - first
        np.multiply(book[codes], scales[blocks], out=out)
        return codes
