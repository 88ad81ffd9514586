"""Which slices of which old ZeRO-3 rank files a rank of a resized job needs (pure).

At stage 3 every parameter is partitioned on its own: at DP size ``D`` rank ``r`` holds elements
``[r * S, r * S + t)`` of a parameter of ``n`` elements (``S = ceil(n / D)``, ``t`` its true length
there), at the parameter's offset inside its sub-group's partition. A rank ``s`` of the resized job
needs ``[s * S', s * S' + t')`` of every parameter of its sub-groups: a run held by the one or few old
ranks whose slices it crosses. :func:`stage3_reads` lists those pieces (a few per parameter,
whatever the DP sizes), each with the element's position in its param group, which does not depend
on the DP size nor on the sub-group cut (:attr:`~megatron_ucp.plan.param_geometry.ParamPlace.position`):
the save's recorded checksums and the load's hashes of what landed meet there.

Padding is never read: a parameter's tail padding on the last ranks (and a rank whose slice is all
padding) stays zero, as DeepSpeed's own buffers are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.param_geometry import Stage3Groups


@dataclass(frozen=True)
class SliceRead:
    """Copy ``length`` elements of old rank ``source_rank``'s partition of old sub-group ``source_group``,
    from ``source_offset``, to ``target_offset`` of the new partition (of the sub-group whose list holds
    this read); ``position`` is where they sit in their param group."""

    param: str
    source_rank: int
    source_group: int
    source_offset: int
    target_offset: int
    length: int
    position: int


def same_parameters(old: Stage3Groups, new: Stage3Groups) -> None:
    """The two layouts hold the same parameters in the same param groups and order; raises naming the
    first difference (another model, or the param groups built otherwise)."""
    if len(old.param_groups) != len(new.param_groups):
        raise PlanError(
            f"the checkpoint has {len(old.param_groups)} param groups, the optimizer {len(new.param_groups)}"
        )
    for g, (saved, live) in enumerate(zip(old.param_groups, new.param_groups)):
        if saved == live:
            continue
        at = next((i for i, (a, b) in enumerate(zip(saved, live)) if a != b), min(len(saved), len(live)))
        theirs = f"{saved[at][0]} ({saved[at][1]} elements)" if at < len(saved) else "nothing"
        ours = f"{live[at][0]} ({live[at][1]} elements)" if at < len(live) else "nothing"
        raise PlanError(
            f"param group {g} differs from the model at position {at}: the checkpoint has {theirs}, the model "
            f"{ours} ({len(saved)} vs {len(live)} parameters)"
        )


def stage3_reads(old: Stage3Groups, new: Stage3Groups, rank: int) -> list[list[SliceRead]]:
    """Per sub-group of ``new``, the pieces new rank ``rank`` copies out of the old rank files, in
    partition order. The parameters must be the same (:func:`same_parameters`)."""
    if not 0 <= rank < new.dp:
        raise PlanError(f"rank {rank} out of range for DP size {new.dp}")
    same_parameters(old, new)
    out: list[list[SliceRead]] = []
    for h in range(len(new.sub_groups)):
        reads: list[SliceRead] = []
        for run in new.runs(rank, h):
            source = old.places[run.param]
            size = old.partition_of(run.param).partition_size
            element, stop = run.start, run.start + run.length
            while element < stop:
                r = element // size
                end = min(stop, (r + 1) * size)
                reads.append(
                    SliceRead(
                        run.param,
                        r,
                        source.sub_group,
                        source.offset + element - r * size,
                        run.offset + element - run.start,
                        end - element,
                        source.position + element,
                    )
                )
                element = end
        out.append(reads)
    return out


def source_ranks(reads: Sequence[Sequence[SliceRead]]) -> list[int]:
    """The old rank files a new rank opens (sorted, each once)."""
    return sorted({read.source_rank for group in reads for read in group})


def first_real_offset(old: Stage3Groups, rank: int, sub_group: int) -> int:
    """Where the first real element of old ``rank``'s partition of ``sub_group`` sits (-1: none): the
    reader of that element enters the file's own record of the partition in the ledger, once."""
    runs = old.runs(rank, sub_group)
    return runs[0].offset if runs else -1
