"""Where the real elements of each rank file's partitions sit: one question every layout answers.

A saved (or live) optimizer is a set of groups, each cut into one partition per rank; a partition holds
runs of real elements and, between or after them, padding. :class:`Partitioned` is that answer as a value:
``runs(position, group)`` lists the real runs of one rank's partition of one group, each with its offset in
the partition and its *position* in its param group's flat order (the same at every DP size, which is
where a save's checksums and a load's hashes meet). The copy's ledger, the recorded checksums and the
restart's checks ask only this, whatever the layout:

* :class:`FlatGroups` (ZeRO-1/2, expert groups over expert-DP): one run per partition, from its start;
* :class:`~megatron_ucp.plan.param_geometry.Stage3Groups` (ZeRO-3): a run per parameter slice.

The same value plans a resume (``old.reads_to(new, rank)``: the ranges of the old rank files that land in
a new rank's partitions) and says what each old rank file must hold before it is read (partition sizes,
real lengths, what the planned reads need, the fragment map where the layout derives one): the binding,
the copy, the ledger and the checks after a load are written once against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from megatron_ucp.errors import UcpError
from megatron_ucp.plan.geometry import GroupGeometry
from megatron_ucp.plan.param_geometry import Run, first_difference, group_count_difference
from megatron_ucp.plan.rank_binding import Fragments, expected_fragments
from megatron_ucp.plan.reshard import DENSE, Placement, Read, reshard_reads

Shapes = Sequence[Sequence[tuple[str, tuple[int, ...]]]]
"""Each flat group's parameters in flat order, with their shapes (``param_shapes``)."""


class Partitioned(Protocol):
    """Any layout: the real runs of a rank's partition of a group, the ranks holding only padding, what a
    group is called, the reads of a resume into another layout of the same parameters, and what each
    rank file must hold."""

    unit: str
    dp: int

    def runs(self, position: int, group: int) -> list[Run]: ...

    def padding_only_ranks(self) -> list[int]: ...

    def partition_sizes(self) -> list[int]: ...

    def true_lengths(self, position: int) -> list[int]: ...

    def reads_to(self, new: "Partitioned", rank: int) -> list[list[Read]]:
        """Per group of ``new``, the ranges new rank ``rank`` copies out of this layout's rank files."""
        ...

    def needs(self, position: int, reads: Sequence[Sequence[Read]]) -> list[int]:
        """Per group, how many leading fp32 elements of the file at ``position`` must be there for ``reads``."""
        ...

    def fragments(self, position: int) -> Optional[tuple[Fragments, ...]]:
        """Per group, the parameter fragments the file at ``position`` must record; None: none to check."""
        ...

    def partition_counts(self) -> Optional[tuple[int, ...]]:
        """Per group, its number of partitions when not every group has ``dp``; None: all have ``dp``."""
        ...

    def names(self, group: int) -> list[str]:
        """The parameters of ``group``, in order."""
        ...

    def param_group(self, group: int) -> int:
        """The optimizer param group ``group`` belongs to (its hyperparameters)."""
        ...

    def drawn_from(self, old: "Partitioned", group: int) -> tuple[int, ...]:
        """The groups of the save ``old`` whose elements this layout's ``group`` holds after a resume."""
        ...


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
    shapes: Shapes = ()
    """Each group's parameters with their shapes, where known (then the files' fragment maps are checked)."""

    @classmethod
    def of(cls, shapes: Shapes, dp: int, placement: Placement = DENSE) -> "FlatGroups":
        """The groups of ``shapes`` saved at DP size ``dp`` (each over its own number of partitions)."""
        numels = [sum(math.prod(shape) for _, shape in group) for group in shapes]
        geometries = [GroupGeometry(numel=n, dp=placement.size(g, dp)) for g, n in enumerate(numels)]
        return cls(geometries, dp, placement, shapes=[list(group) for group in shapes])

    def at_dp(self, dp: int) -> "FlatGroups":
        """The same groups partitioned at DP size ``dp``."""
        return FlatGroups(self.placement.geometries(self.geometries, dp), dp, self.placement, self.unit, self.shapes)

    def index(self, group: int, position: int) -> int:
        """Which partition of ``group`` the file at ``position`` holds (of its expert-parallel rank's buffer)."""
        return self.placement.index(group, position)

    def runs(self, position: int, group: int) -> list[Run]:
        real = self.true_lengths(position)[group]
        return [Run("", 0, 0, real, self.starts(position)[group])] if real else []

    def starts(self, position: int) -> list[int]:
        """Per group, where the partition at ``position`` starts in the group's flat order."""
        return [self.index(g, position) * geo.partition_size for g, geo in enumerate(self.geometries)]

    def true_lengths(self, position: int) -> list[int]:
        return [geo.true_length(self.index(g, position)) for g, geo in enumerate(self.geometries)]

    def partition_sizes(self) -> list[int]:
        return [geo.partition_size for geo in self.geometries]

    def padding_only_ranks(self) -> list[int]:
        return [r for r in range(self.dp) if not any(self.true_lengths(r))]

    def reads_to(self, new: "Partitioned", rank: int) -> list[list[Read]]:
        return reshard_reads(self.geometries, new.dp, rank, self.placement)

    def needs(self, position: int, reads: Sequence[Sequence[Read]]) -> list[int]:
        """Only what is read: a partition's fp32 is read from its start."""
        return [max((r.source_offset + r.length for r in g if r.source_rank == position), default=0) for g in reads]

    def fragments(self, position: int) -> Optional[tuple[Fragments, ...]]:
        """The groups' parameters lie in ``shapes`` order without padding between them."""
        if not self.shapes:
            return None
        return tuple(
            expected_fragments(self.shapes[g], geo, self.index(g, position)) for g, geo in enumerate(self.geometries)
        )

    def partition_counts(self) -> Optional[tuple[int, ...]]:
        return tuple(geo.dp for geo in self.geometries) if self.placement.ep > 1 else None

    def names(self, group: int) -> list[str]:
        return [name for name, _ in self.shapes[group]] if self.shapes else []

    def param_group(self, group: int) -> int:
        return group

    def drawn_from(self, old: "Partitioned", group: int) -> tuple[int, ...]:
        """A flat group is the same group at every DP size."""
        return (group,)


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


def check_live_model(
    saved: FlatGroups, live: list[list[tuple[str, tuple[int, ...]]]], flat_sizes: list[int], dp_to: int, where: Any
) -> FlatGroups:
    """The live flat groups are the saved ones (order, names, shapes), partitioned as the plan expects at
    ``dp_to``. Returns the live layout. Raises naming the first difference."""
    if len(live) != len(saved.shapes):
        raise UcpError(f"{where}: {group_count_difference(len(saved.shapes), len(live))}", subject=where)
    for g, (saved_params, live_params) in enumerate(zip(saved.shapes, live, strict=True)):
        if list(live_params) != list(saved_params):
            at = first_difference(saved_params, live_params)
            theirs = saved_params[at] if at < len(saved_params) else "nothing"
            ours = live_params[at] if at < len(live_params) else "nothing"
            raise UcpError(
                f"{where}: param group {g} differs from the model at position {at}: the checkpoint has "
                f"{theirs}, the model {ours} ({len(saved_params)} vs {len(live_params)} parameters)",
                subject=where,
            )
    new = saved.at_dp(dp_to)
    for g, (geo, new_geo, flat) in enumerate(zip(saved.geometries, new.geometries, flat_sizes, strict=True)):
        if new_geo.partition_size != flat:
            raise UcpError(
                f"{where}: param group {g} ({geo.numel} elements) has a {flat}-element partition at DP={dp_to}; "
                f"the plan expects ZeRO's alignment padding only over {new_geo.dp} partitions (per-parameter padding?)",
                subject=where,
            )
    return new
