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

A mixture-of-experts save partitions its expert groups over the expert-data-parallel group instead
(:class:`Placement`): the DP ranks ``d`` with ``d % EP == r`` hold expert-parallel rank ``r``'s buffer,
partition ``d // EP`` each. With EP fixed, a DP change is the same reshard inside each expert-parallel
rank's buffer, from DP / EP old partitions to DP' / EP new ones; reads name DP rank files throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Sequence

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


@dataclass(frozen=True)
class Placement:
    """Which DP rank files hold a save's param groups' partitions: a dense group's partition ``i`` is in DP rank
    file ``i``; an expert group (of ``expert_groups``, at ``ep`` > 1) is partitioned over DP / EP ranks, its
    partition ``i`` of expert-parallel rank ``r``'s buffer in DP rank file ``i * EP + r``."""

    ep: int = 1
    expert_groups: frozenset[int] = frozenset()

    @classmethod
    def of(cls, ep: int, expert_groups: Collection[int]) -> "Placement":
        return cls(ep, frozenset(expert_groups)) if ep > 1 else DENSE

    def expert(self, group: int) -> bool:
        return self.ep > 1 and group in self.expert_groups

    def size(self, group: int, dp: int) -> int:
        """How many partitions the group has at DP size ``dp``."""
        if not self.expert(group):
            return dp
        if dp % self.ep:
            raise PlanError(f"DP={dp} is not a multiple of EP={self.ep}: no expert-data-parallel group")
        return dp // self.ep

    def index(self, group: int, position: int) -> int:
        """The partition DP rank ``position`` holds of the group (its buffer's, for an expert group)."""
        return position // self.ep if self.expert(group) else position

    def position(self, group: int, index: int, like: int) -> int:
        """The DP rank file holding partition ``index`` of the buffer DP rank ``like`` holds part of."""
        return index * self.ep + like % self.ep if self.expert(group) else index

    def geometries(self, groups: Sequence[GroupGeometry], dp: int) -> list[GroupGeometry]:
        """The groups re-partitioned for DP size ``dp``, each over its own number of partitions."""
        return [at_dp([geo], self.size(g, dp))[0] for g, geo in enumerate(groups)]


DENSE = Placement()
"""Every group partitioned over the whole DP group (every save without experts)."""


def reshard_reads(
    old_groups: Sequence[GroupGeometry], dp_to: int, rank: int, placement: Placement = DENSE
) -> list[list[Read]]:
    """:func:`partition_reads` for every group of a checkpoint saved at ``old_groups[g].dp`` partitions, for DP
    rank ``rank`` of ``dp_to``; ``source_rank`` is the DP rank file read (an expert group's: of this rank's
    expert-parallel rank)."""
    if not 0 <= rank < dp_to:
        raise PlanError(f"rank {rank} out of range for DP size {dp_to}")
    out = []
    for g, (old, new) in enumerate(zip(old_groups, placement.geometries(old_groups, dp_to))):
        reads = partition_reads(old, new, placement.index(g, rank))
        out.append([replace(r, source_rank=placement.position(g, r.source_rank, rank)) for r in reads])
    return out


def source_ranks(reads: Sequence[Sequence[Read]]) -> list[int]:
    """The old rank files a new rank opens (sorted, each once)."""
    return sorted({read.source_rank for group in reads for read in group})
