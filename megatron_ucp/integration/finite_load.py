"""After a load, every fp32 master and optimizer state the engine holds is finite, or the tag is refused.

A NaN or Inf that reached a save (a step that diverged, a corrupt replica: NVIDIA/Megatron-LM#5281 restarted 44
times into NaN losses) matches the checksums its save recorded, so the binding and the partition checks let it
through, and training resumes into NaN. This check looks at what the load placed, on every route and stage,
where the engine keeps it (host or device), in chunks; a refusal is a
:class:`~megatron_ucp.errors.CheckpointFormatError`, every rank's through the load's agreement
(:func:`~megatron_ucp.integration.collectives.agreed`): the restart falls back to the
newest older tag (:mod:`megatron_ucp.integration.fallback`), or stops naming the folder. ``strict=False``: one
warning per rank instead. Only real elements are looked at (:func:`~megatron_ucp.integration.live_partitions.
live_groups`: each parameter's fragment in this rank's partition), named by parameter and state: ZeRO-3 leaves a
partition's padding uninitialized, and what sits there is no one's value. After a native reshard (:class:`Origins`)
each finding names the old rank file(s) its elements were copied from: the file to look at, or to restore.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import comm
from megatron_ucp.integration.live_partitions import live_groups
from megatron_ucp.plan.reshard import Read, pieces_in

log = logging.getLogger(__name__)

CHUNK = 1 << 24
"""Elements looked at at once: the mask is 16 MiB, whatever a rank's partition holds."""


def non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor, a chunk at a time where it lives."""
    flat = tensor.detach().reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def _all_finite(tensor: torch.Tensor) -> bool:
    """One pass over the whole partition (padding included): the common case costs one sync per chunk of a state."""
    flat = tensor.detach().reshape(-1)
    return all(
        not bool((~torch.isfinite(flat[start : start + CHUNK])).any()) for start in range(0, flat.numel(), CHUNK)
    )


@dataclass(frozen=True)
class Origins:
    """Where a native reshard's copy took this rank's partitions from: its reads per live partition (the order
    :func:`live_groups` gives) and old position -> rank file."""

    reads: Sequence[Sequence[Read]]
    rank_file: Callable[[int], Path]

    def files(self, group: int, offset: int, tensor: torch.Tensor) -> list[str]:
        """The names of the old rank files whose elements in ``tensor`` (at ``offset`` of partition ``group``) are
        not finite."""
        ranks = {
            rank
            for rank, first, end in pieces_in(self.reads[group], offset, offset + tensor.numel())
            if not _all_finite(tensor[first - offset : end - offset])
        }
        return [self.rank_file(rank).name for rank in sorted(ranks)]


def _loaded(engine: Any) -> Iterator[tuple[int, int, str, str, torch.Tensor]]:
    """(partition, offset in it, parameter, state, its real elements) of every master and floating optimizer state
    of this rank that holds a NaN or Inf anywhere (a partition found finite whole is not cut into its parameters)."""
    optimizer = engine.optimizer
    names = surface.param_names(engine)
    base = surface.base_optimizer(optimizer)
    for index, group in enumerate(live_groups(optimizer, names)):
        kept = base.state.get(group.flat, {})
        tensors = [(F.FP32_STATE, group.flat)] + [
            (name, value)
            for name, value in sorted(kept.items())
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == group.flat.shape
        ]
        suspects = [(name, tensor) for name, tensor in tensors if not _all_finite(tensor)]
        for fragment in group.fragments:
            for name, tensor in suspects:
                yield (
                    index,
                    fragment.offset,
                    names.get(fragment.lp, "?"),
                    name,
                    tensor.reshape(-1)[fragment.offset : fragment.offset + fragment.numel],
                )


def refuse_non_finite(engine: Any, folder: Path, strict: bool, origins: Optional[Origins] = None) -> None:
    """Raises on the ranks whose masters or optimizer states hold NaN or Inf (``strict``; else warns there); the
    load's agreement (:func:`~megatron_ucp.integration.collectives.agreed`) makes it every rank's error. No
    collective here: another group's load may have failed before this point. ``origins``: a native reshard's,
    so that each finding names the old rank file(s) it came from."""
    rank = comm().get_rank()
    found = []
    with torch.no_grad():
        for index, offset, param, name, tensor in _loaded(engine):
            nan, inf = non_finite(tensor)
            if nan or inf:
                files = origins.files(index, offset, tensor) if origins is not None else []
                source = f", copied from {' and '.join(files)}" if files else ""
                found.append(f"'{name}' of {param}: {nan} NaN and {inf} Inf of {tensor.numel()}{source}")
    what = (
        f"{folder}: rank {rank} loaded masters or optimizer states that are not finite "
        f"({'; '.join(found[:4])}{' ...' if len(found) > 4 else ''}): resuming would train on NaN"
        if found
        else None
    )
    if not strict:
        if what:
            log.warning("megatron-ucp (strict=False, continuing): %s", what)
        return
    if what:
        raise CheckpointFormatError(what, subject=folder)
