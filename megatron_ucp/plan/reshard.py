"""Which ranges of which old rank files a rank of a resized job needs: a DP change without conversion (pure).

Inside a ZeRO-1/2 param group the parameters' flat order does not depend on the DP size; only the
alignment padding at the end does. So the group's real elements ``[0, N')`` (``N'``: the numel
with per-parameter padding, :class:`~megatron_ucp.plan.geometry.GroupGeometry`) sit at the same
flat positions at every DP size, and rank ``s`` of the new job needs ``[s * S_new, s * S_new +
t_new(s))``: one contiguous range, held by the few old rank files whose partitions
``[r * S_old, (r + 1) * S_old)`` it crosses. :func:`partition_reads` lists those pieces; a rank
plans only its own (a few entries, whatever DP is), so planning does not grow with the world.
Padding is never read: a new rank's padding tail (and an all-padding rank's whole partition) is
zero-filled, as DeepSpeed's own buffers are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.geometry import GroupGeometry, at_dp


@dataclass(frozen=True)
class Read:
    """Copy ``length`` elements of old rank ``source_rank``'s partition, from ``source_offset``, to
    ``target_offset`` of the new partition; ``position`` is where they sit in the group's flat order."""

    source_rank: int
    source_offset: int
    target_offset: int
    length: int
    position: int


def partition_reads(old: GroupGeometry, new: GroupGeometry, rank: int) -> list[Read]:
    """The pieces of new rank ``rank``'s real elements, in order, each inside one old partition."""
    if (old.numel, old.padded_numel) != (new.numel, new.padded_numel):
        raise PlanError(
            f"the group holds {old.numel} elements ({old.padded_numel} with per-parameter padding) in "
            f"the checkpoint and {new.numel} ({new.padded_numel}) in this job: not the same model"
        )
    start = new.partition_start(rank)
    stop = start + new.true_length(rank)
    size = old.partition_size
    reads, pos = [], start
    while pos < stop:
        source = pos // size
        end = min(stop, (source + 1) * size)
        reads.append(Read(source, pos - source * size, pos - start, end - pos, pos))
        pos = end
    return reads


def reshard_reads(old_groups: Sequence[GroupGeometry], dp_to: int, rank: int) -> list[list[Read]]:
    """:func:`partition_reads` for every group of a checkpoint saved at ``old_groups[g].dp``."""
    if not 0 <= rank < dp_to:
        raise PlanError(f"rank {rank} out of range for DP size {dp_to}")
    return [partition_reads(old, new, rank) for old, new in zip(old_groups, at_dp(old_groups, dp_to))]


def source_ranks(reads: Sequence[Sequence[Read]]) -> list[int]:
    """The old rank files a new rank opens (sorted, each once)."""
    return sorted({read.source_rank for group in reads for read in group})
