"""Exact ranges of tensors located in a file, read into torch tensors: the bytes of a plain tensor, or the values of
one stored in 8-bit blocks (its codes, the scales of their blocks and its code book; ``--ucp-requantize-8bit``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_ucp.format.blockwise8bit import Blockwise8bit
from megatron_ucp.format.exact_read import RangeReader, file_offset
from megatron_ucp.format.rawtensor import RawTensor


def read_tensor_range(reader: RangeReader, tensor: RawTensor, start: int, dest: torch.Tensor) -> torch.Tensor:
    """Elements ``[start, start + dest.numel())`` of a (flat, contiguous) mapped tensor into ``dest``,
    exactly those bytes (:class:`~megatron_ucp.format.exact_read.RangeReader`); a tensor already in
    memory is copied; one in 8-bit blocks lands as its fp32 values. Returns what the file holds of the range, as
    its save hashed it: ``dest``, or the 8-bit codes."""
    if isinstance(tensor, Blockwise8bit):  # its codes, block scales and code book read; their values land
        in_place = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == torch.float32
        decoded = dest if in_place else torch.empty(dest.numel(), dtype=torch.float32)
        codes = tensor.decode(
            lambda raw, at, out: read_tensor_range(reader, raw, at, torch.from_numpy(out)), start, decoded.numpy()
        )
        if decoded is not dest:
            dest.copy_(decoded)
        return torch.from_numpy(codes)
    length = dest.numel()
    offset = file_offset(tensor, start)
    if offset is None:  # a small record already in memory, or a tensor torch mapped
        dest.copy_(tensor.narrow(0, start, length).to_torch())
        return dest
    buffer = dest if dest.device.type == "cpu" and dest.is_contiguous() else torch.empty(length, dtype=dest.dtype)
    reader.read(offset, memoryview(buffer.detach().view(torch.uint8).numpy()).cast("B"))
    if buffer is not dest:
        dest.copy_(buffer)
    return dest


@dataclass
class Source:
    """One old rank file of a native load: where its fp32 partitions and optimizer states per group lie in the
    file, and the file, opened on first use, to read the planned ranges from (exactly those bytes)."""

    path: Path
    fp32: list[RawTensor]
    states: list[dict[str, Any]]
    sums: Optional[Sequence[dict[str, Any]]] = None
    """Per group, state -> (real elements, checksum) recorded at save (None: saved without them)."""
    reader: Optional[RangeReader] = None

    def read_into(self, tensor: RawTensor, start: int, dest: torch.Tensor) -> torch.Tensor:
        """As :func:`read_tensor_range`, from this file."""
        if self.reader is None:
            self.reader = RangeReader(self.path)
        return read_tensor_range(self.reader, tensor, start, dest)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
