"""What the save hook adds to each rank's optimizer state dict: the geometry (pure) and the partitions' checksums.

The hook (``integration/save/recording``) calls it with the live optimizer's sizes; the
synthetic-checkpoint writer (``synthetic/``) with a model shape's. One function, so that a
synthetic checkpoint "with our save record" carries exactly what a hooked save carries.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity
from megatron_ucp.plan.accounting import checksum
from megatron_ucp.plan.geometry import NCCL_START_ALIGNMENT_FACTOR, GroupGeometry
from megatron_ucp.plan.param_geometry import Run, Stage3Groups


def partition_record(
    group_numels: Sequence[int],
    padded_group_numels: Sequence[int],
    flat_numels: Sequence[int],
    dp_sizes: Sequence[int],
    dp_ranks: Sequence[int],
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
) -> dict[str, Any]:
    """The keys added to a rank's optimizer state dict. Pure; checks DeepSpeed's flat sizes.

    ``dp_sizes``/``dp_ranks``: per param group, the size of the group it is partitioned over and this rank's
    place in it (the DP group; a mixture-of-experts expert group's expert-data-parallel group, smaller, whose
    true lengths follow its own geometry: ``group_dp_sizes``/``group_dp_ranks`` record them)."""
    if len(dp_sizes) != len(group_numels) or len(dp_ranks) != len(group_numels):
        raise UnsupportedError(f"{len(group_numels)} param groups but DP sizes {list(dp_sizes)}")
    dp, rank = max(dp_sizes), dp_ranks[dp_sizes.index(max(dp_sizes))]
    geos = [
        GroupGeometry(numel=n, dp=size, padded_numel=pn, alignment_factor=alignment_factor)
        for n, pn, size in zip(group_numels, padded_group_numels, dp_sizes)
    ]
    for g, (geo, flat) in enumerate(zip(geos, flat_numels)):
        if geo.padded_total != flat:
            raise UnsupportedError(
                f"param group {g}: DeepSpeed's flat buffer has {flat} elements, the known geometry "
                f"gives {geo.padded_total} (N={geo.numel}, DP={geo.dp}); this DeepSpeed partitions "
                "differently from what megatron-ucp understands"
            )
    ranks = list(dp_ranks)
    per_group = {"group_dp_sizes": list(dp_sizes), "group_dp_ranks": ranks} if len(set(dp_sizes)) > 1 else {}
    return {
        F.GROUP_PADDINGS: [geo.padding(r) for geo, r in zip(geos, ranks)],
        F.GROUP_TRUE_LENGTHS: [geo.true_length(r) for geo, r in zip(geos, ranks)],
        F.ZERO_PARTITION_INFO: {
            "version": F.ZERO_PARTITION_INFO_VERSION,
            "dp_size": dp,
            "dp_rank": rank,
            "alignment": alignment_factor * dp,
            "group_numels": [geo.numel for geo in geos],
            "padded_group_numels": [geo.padded_numel for geo in geos],
            "partition_sizes": [geo.partition_size for geo in geos],
            **per_group,
        },
    }


def partition_checksums(fp32: list[Any], states: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
    """:data:`~megatron_ucp.format.dsformat.ZERO_PARTITION_CHECKSUMS` of one rank: each group's real
    elements (``group_true_lengths``) of the fp32 partition and of each tensor state of partition size,
    hashed at their flat position in the group (``dp_rank * partition_size``)."""
    info = record[F.ZERO_PARTITION_INFO]
    groups = []
    for g, (master, state) in enumerate(zip(fp32, states)):
        size, real = info["partition_sizes"][g], record[F.GROUP_TRUE_LENGTHS][g]
        start = info.get("group_dp_ranks", [info["dp_rank"]] * len(fp32))[g] * size
        tensors = {
            F.FP32_STATE: master,
            **{
                k: v
                for k, v in sorted(state.items())
                if hasattr(v, "numel") and k != F.STEP_STATE and v.numel() == size
            },
        }
        groups.append({k: [real, checksum(t.reshape(-1)[:real], start)] for k, t in tensors.items()})
    return {F.ZERO_PARTITION_CHECKSUMS: {"algorithm": integrity.ALGORITHM, "groups": groups}}


def save_identity(save_id: str, dp_size: Optional[int] = None, dp_rank: Optional[int] = None) -> dict[str, Any]:
    """:data:`~megatron_ucp.format.dsformat.UCP_SAVE_RECORD`: the save's identity, and in an optimizer
    file the DP size and the rank that saved it."""
    record: dict[str, Any] = {"version": F.UCP_SAVE_RECORD_VERSION, "save_id": save_id}
    if dp_size is not None:
        record.update(dp_size=int(dp_size), dp_rank=int(dp_rank if dp_rank is not None else -1))
    return {F.UCP_SAVE_RECORD: record}


def stage3_partition_record(groups: Stage3Groups, rank: int) -> dict[str, Any]:
    """The keys the save hook adds to a ZeRO-3 rank's optimizer state dict: each sub-group's and each
    parameter's true length on ``rank`` and the layout they follow from. Pure."""
    return {
        F.GROUP_TRUE_LENGTHS: groups.true_lengths(rank),
        F.PARAM_TRUE_LENGTHS: groups.param_true_lengths(rank),
        F.ZERO_PARTITION_INFO: {
            "version": F.ZERO_PARTITION_INFO_VERSION,
            "zero_stage": 3,
            "dp_size": groups.dp,
            "dp_rank": rank,
            "sub_group_numels": [[n for _, n in group] for group in groups.sub_groups],
            "sub_group_param_groups": list(groups.param_group_of),
            "partition_sizes": groups.partition_sizes(),
        },
    }


def runs_checksum(tensor: Any, runs: Sequence[Run], algorithm: str = integrity.ALGORITHM) -> int:
    """One partition's real runs (:meth:`~megatron_ucp.plan.partitioned.Partitioned.runs`, any layout), each
    hashed at its position in its param group, combined: what the save records and what a load recomputes."""
    flat = tensor.reshape(-1)
    return integrity.combine(checksum(flat[r.offset : r.offset + r.length], r.position, algorithm) for r in runs)


def stage3_partition_checksums(
    fp32: Sequence[Any], states: Sequence[dict[str, Any]], groups: Stage3Groups, rank: int
) -> dict[str, Any]:
    """:data:`~megatron_ucp.format.dsformat.ZERO_PARTITION_CHECKSUMS` of one ZeRO-3 rank: per sub-group, the
    fp32 partition and each tensor state of partition size, over the real runs (:func:`runs_checksum`)."""
    out = []
    for h, (master, state) in enumerate(zip(fp32, states)):
        size, runs = groups.geometry(h).partition_size, groups.runs(rank, h)
        real = sum(r.length for r in runs)
        tensors = {
            F.FP32_STATE: master,
            **{
                k: v
                for k, v in sorted(state.items())
                if hasattr(v, "numel") and k != F.STEP_STATE and v.numel() == size
            },
        }
        out.append({k: [real, runs_checksum(t, runs)] for k, t in tensors.items()})
    return {F.ZERO_PARTITION_CHECKSUMS: {"algorithm": integrity.ALGORITHM, "groups": out}}
