"""Where the real elements of each rank file's partitions sit: one question every layout answers.

A saved (or live) optimizer is a set of groups, each cut into one partition per rank; a partition holds
runs of real elements and, between or after them, padding. :class:`Partitioned` is that answer as a value:
``runs(position, group)`` lists the real runs of one rank's partition of one group, each with its offset in
the partition and its *position* in its param group's flat order (the same at every DP size, which is
where a save's checksums and a load's hashes meet). The copy's ledger, the recorded checksums and the
restart's checks ask only this, whatever the layout:

* :class:`FlatGroups` (ZeRO-1/2, expert groups over expert-DP): one run per partition, from its start;
* :class:`~megatron_ucp.plan.param_geometry.Stage3Groups` (ZeRO-3): a run per parameter slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from megatron_ucp.plan.geometry import GroupGeometry
from megatron_ucp.plan.param_geometry import Run
from megatron_ucp.plan.reshard import DENSE, Placement, Read


class Partitioned(Protocol):
    """Any layout: the real runs of a rank's partition of a group, the ranks holding only padding, and
    what a group is called."""

    unit: str
    dp: int

    def runs(self, position: int, group: int) -> list[Run]: ...

    def padding_only_ranks(self) -> list[int]: ...


@dataclass(frozen=True)
class FlatGroups:
    """ZeRO-1/2: each param group one flat buffer cut into equal partitions (an expert group's over its
    expert-DP ranks, ``placement``); a partition's real elements start it, the padding ends the group.
    ``position`` is the DP rank file's position (for an expert group: of this rank's expert-parallel rank)."""

    geometries: Sequence[GroupGeometry]
    dp: int
    """The DP rank files (positions) of the save."""
    placement: Placement = DENSE
    unit: str = "param group"

    def runs(self, position: int, group: int) -> list[Run]:
        geo = self.geometries[group]
        index = self.placement.index(group, position)
        real = geo.true_length(index)
        return [Run("", 0, 0, real, index * geo.partition_size)] if real else []

    def padding_only_ranks(self) -> list[int]:
        return [r for r in range(self.dp) if not any(self.runs(r, g) for g in range(len(self.geometries)))]


def real_length(layout: Partitioned, position: int, group: int) -> int:
    return sum(run.length for run in layout.runs(position, group))


def first_real(layout: Partitioned, position: int, group: int) -> int:
    """Where the first real element of the partition sits (-1: none)."""
    runs = layout.runs(position, group)
    return runs[0].offset if runs else -1


def checked_positions(layout: Partitioned, dp_to: int, rank: int, reads: Sequence[Sequence[Read]]) -> list[int]:
    """The old files new rank ``rank`` of ``dp_to`` opens: those it reads, and those holding only padding whose
    position falls to it (``position % dp_to``), so that every file of the save is checked by some rank."""
    read = {r.source_rank for g in reads for r in g}
    return sorted(read | {r for r in layout.padding_only_ranks() if r % dp_to == rank})
