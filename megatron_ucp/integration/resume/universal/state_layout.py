"""A universal state file's tensor as the flat layout of the whole live parameter, never materialized.

The loader (:mod:`megatron_ucp.integration.resume.universal.partition_load`) cuts each rank's fragment out of the
memory-mapped file through a :class:`StateLayout`: the file's tensor, then the padded vocabulary
rows megatron-ucp's converter kept beside it, then zeros; and it hashes exactly what it restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, osio
from megatron_ucp.plan.accounting import checksum
from megatron_ucp.plan.tensor_parallel import Run


@dataclass(frozen=True)
class StateLayout:
    """A state file's tensor in the parameter's flat layout, never materialized: a rank copies only
    the bytes of its fragment out of the memory-mapped file.

    ``pieces`` are flat views in order (the tensor, then the kept vocabulary rows it restores);
    positions from ``held`` to ``numel`` (vocabulary padding the folder did not keep, or rows the
    new padded size adds) read as zeros.
    """

    pieces: tuple[torch.Tensor, ...]
    held: int
    numel: int
    rows_cut: bool = False
    """Only the first of the folder's kept vocabulary rows are restored (the padded size shrank)."""
    dropped: Optional[torch.Tensor] = None
    """A whole vocabulary tensor's rows past the new padded size (:data:`~megatron_ucp.format.dsformat.
    VOCAB_ROWS_WHOLE`), not restored: the manifest's checksum of the file less theirs is what is."""

    @property
    def rows_restored(self) -> bool:
        """The kept vocabulary rows are the second piece."""
        return len(self.pieces) > 1

    def narrow(self, start: int, length: int) -> torch.Tensor:
        parts, pos = [], 0
        for piece in self.pieces:
            lo, hi = max(start, pos), min(start + length, pos + piece.numel())
            if lo < hi:
                part = piece.narrow(0, lo - pos, hi - lo)
                if part.device.type == "cpu":  # a mapped file: read this slice, not the readahead around it
                    base = piece.data_ptr()
                    osio.read_only_this(
                        part.data_ptr(),
                        part.numel() * part.element_size(),
                        (base, base + piece.numel() * piece.element_size()),
                    )
                parts.append(part)
            pos += piece.numel()
        got = sum(t.numel() for t in parts)
        if got < length:
            parts.append(self.pieces[0].new_zeros(length - got))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def source_sum(self) -> int:
        """Checksum of everything the file holds (reads all of it: the path without manifest sums)."""
        sums, pos = [], 0
        for piece in self.pieces:
            sums.append(checksum(piece, pos))
            pos += piece.numel()
        return integrity.combine(sums)


def tensor_of(entry: Any, path: Path) -> torch.Tensor:
    tensor = entry.get(F.PARAM) if isinstance(entry, dict) else entry
    if not torch.is_tensor(tensor):
        raise CheckpointFormatError(f"{path}: no tensor under {F.PARAM!r}", subject=path)
    return tensor


def state_layout(
    full: torch.Tensor, entry: Any, shape: tuple[int, ...], name: str, state: str, path: Path
) -> StateLayout:
    """The file's tensor as the flat layout of the whole live parameter of ``shape`` (all TP slices).

    Vocabulary tensors trimmed to ``original_vocab_size`` get their padded rows back from
    :data:`~megatron_ucp.format.dsformat.VOCAB_PADDED_ROWS` when the folder kept them (megatron-ucp's
    conversions do): every row that exists on both sides, i.e. up to the smaller of the saved and
    the new padded size (a TP change changes it). Rows the new size adds, and every padded row of a
    stock folder, start at zero as with stock DeepSpeed and are not counted: every real row is.
    """
    numel = math.prod(shape)
    if tuple(full.shape) == shape or (full.dim() == 1 and full.numel() == numel):
        # stock's ZeRO-3 conversions write each parameter flattened (its loader views them flat)
        return StateLayout((full.reshape(-1),), full.numel(), numel)
    whole = isinstance(entry, dict) and entry.get(F.VOCAB_ROWS_WHOLE, False)
    if whole and full.dim() == len(shape) >= 1 and tuple(full.shape[1:]) == shape[1:]:
        if full.shape[0] <= shape[0]:  # the new padded size adds rows: zeros, as the rows a trimmed folder lacks
            return StateLayout((full.reshape(-1),), full.numel(), numel)
        kept = full.narrow(0, 0, shape[0]).reshape(-1)  # the rows both padded sizes have
        return StateLayout((kept,), kept.numel(), numel, dropped=full.narrow(0, shape[0], full.shape[0] - shape[0]))
    is_vocab = isinstance(entry, dict) and entry.get(F.VOCAB_TENSOR, False)
    if (
        is_vocab
        and full.dim() == len(shape)
        and full.dim() >= 1
        and full.shape[0] <= shape[0]
        and tuple(full.shape[1:]) == shape[1:]
    ):
        rows = entry.get(F.VOCAB_PADDED_ROWS)
        room = shape[0] - full.shape[0]
        if (
            torch.is_tensor(rows)
            and rows.dim() == len(shape)
            and tuple(rows.shape[1:]) == shape[1:]
            and room > 0
            and rows.shape[0] > 0
        ):
            kept = rows.narrow(0, 0, min(room, rows.shape[0]))
            kept = kept if kept.dtype == full.dtype else kept.to(full.dtype)
            return StateLayout(
                (full.reshape(-1), kept.reshape(-1)),
                full.numel() + kept.numel(),
                numel,
                rows_cut=kept.shape[0] < rows.shape[0],
            )
        return StateLayout((full.reshape(-1),), full.numel(), numel)
    raise CheckpointFormatError(
        f"{path}: parameter {name!r} state {state!r} has shape {tuple(full.shape)}, the model's "
        f"whole parameter (all TP slices) is {shape}: a different model, or a TP layout "
        "the checkpoint does not record",
        subject=name,
    )


def gather(layout: StateLayout, runs: tuple[Run, ...]) -> torch.Tensor:
    parts = [layout.narrow(run.full_offset, run.length) for run in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
