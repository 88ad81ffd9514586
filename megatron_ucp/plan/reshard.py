"""Which ranges of which old rank files a rank of a resized job needs: a DP change without conversion (pure).

One rule serves every layout: a *unit* (a ZeRO-1/2 param group's flat buffer, or one parameter at ZeRO-3) holds
its real elements at the same flat positions whatever the DP size; at DP size ``D`` it is cut into ``D`` equal
partitions of ``S`` elements, partition ``r`` in rank file ``r``. A new rank needs one contiguous run of a unit,
``[s * S', s * S' + t')``; :func:`cut_run` splits it at the old partition boundaries into pieces, each inside one
old partition, and every read below is such a piece. A rank plans only its own runs (a few per unit, whatever DP
is), so planning does not grow with the world. Padding is never read: a new rank's padding tail (and an
all-padding rank's whole partition) is zero-filled, as DeepSpeed's own buffers are.

* ZeRO-1/2 (:func:`reshard_reads`): the unit is the group; ``N'`` (the numel with per-parameter padding,
  :class:`~megatron_ucp.plan.geometry.GroupGeometry`) does not depend on DP, only the alignment tail does.
  A mixture-of-experts save partitions its expert groups over the expert-data-parallel group instead
  (:class:`Placement`): the DP ranks ``d`` with ``d % EP == r`` hold expert-parallel rank ``r``'s buffer,
  partition ``d // EP`` each; with EP fixed, a DP change is the same cut inside each buffer.
* ZeRO-3 (:func:`~megatron_ucp.plan.param_geometry.per_parameter_reads`, beside the layout it plans for): the
  unit is each parameter (``S = ceil(n / D)``), at its offset inside its sub-group's partition; each piece
  carries the element's position in its param group, which depends neither on DP nor on the sub-group cut
  (:attr:`~megatron_ucp.plan.param_geometry.ParamPlace.position`): the save's recorded checksums and the
  load's hashes of what landed meet there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Iterator, Optional, Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.geometry import GroupGeometry, at_dp


@dataclass(frozen=True)
class Read:
    """Copy ``length`` elements of old rank ``source_rank``'s partition of its group ``source_group``, from
    ``source_offset``, to ``target_offset`` of the new partition (of the group whose list holds this read);
    ``position`` is where they sit in their param group's flat order; ``param``: the parameter they belong to
    where a read never spans two (ZeRO-3), else None."""

    source_rank: int
    source_offset: int
    target_offset: int
    length: int
    position: int
    source_group: int = 0
    param: Optional[str] = None


def cut_run(start: int, stop: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """Elements ``[start, stop)`` of a unit cut into partitions of ``size``, split at the partition boundaries:
    ``(partition, offset in it, first element, length)`` per piece, in order."""
    element = start
    while element < stop:
        partition = element // size
        end = min(stop, (partition + 1) * size)
        yield partition, element - partition * size, element, end - element
        element = end


def partition_reads(old: GroupGeometry, new: GroupGeometry, rank: int, group: int = 0) -> list[Read]:
    """The pieces of new rank ``rank``'s real elements of a flat group, in order, each inside one old partition."""
    if (old.numel, old.padded_numel) != (new.numel, new.padded_numel):
        raise PlanError(
            f"the group holds {old.numel} elements ({old.padded_numel} with per-parameter padding) in "
            f"the checkpoint and {new.numel} ({new.padded_numel}) in this job: not the same model"
        )
    start = new.partition_start(rank)
    return [
        Read(source, offset, element - start, length, element, group)
        for source, offset, element, length in cut_run(start, start + new.true_length(rank), old.partition_size)
    ]


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
    for g, (old, new) in enumerate(zip(old_groups, placement.geometries(old_groups, dp_to), strict=True)):
        reads = partition_reads(old, new, placement.index(g, rank), g)
        out.append([replace(r, source_rank=placement.position(g, r.source_rank, rank)) for r in reads])
    return out


def pieces_in(reads: Sequence[Read], start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(old rank file position, first, end)`` of each read of one live partition (``reads``: that partition's)
    that landed in ``[start, stop)`` of it, clipped to it, in order: where the values found there came from (a
    NaN found after the copy is named with its file). Offsets no read covers are padding (zero-filled)."""
    out = []
    for read in sorted(reads, key=lambda r: r.target_offset):
        first, end = max(start, read.target_offset), min(stop, read.target_offset + read.length)
        if first < end:
            out.append((read.source_rank, first, end))
    return out
