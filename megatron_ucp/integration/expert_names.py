"""The global names of the experts this rank holds, as a universal folder keeps them.

A mixture-of-experts job's optimizer names each rank's experts by their local index (``...deepspeed_experts.<k>...``,
``k < E/EP``) and partitions each expert param group over the expert-data-parallel group. A universal folder keeps
every expert under its global index (``r * E/EP + k``, as the expert files do), so that a job at any EP finds its
own: this rank's expert-parallel rank ``r`` follows from its place in the DP group and the groups' sizes (DeepSpeed-
MoE's E + D layout, :class:`~megatron_ucp.plan.parallel_layout.ParallelLayout`), checked against its place in the
expert group's own process group, so that a topology megatron-ucp does not know stops the load by name.
"""

from __future__ import annotations

from typing import Any

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import PlanError, UnsupportedError
from megatron_ucp.integration.collectives import comm
from megatron_ucp.plan.experts import global_expert_names
from megatron_ucp.plan.parallel_layout import ParallelLayout


def live_expert_names(optimizer: Any, names: dict[Any, str]) -> dict[Any, str]:
    """Live parameter -> global name, for the expert parameters this rank holds (empty without expert groups).
    ``names``: live parameter -> the optimizer's (local) name."""
    sizes = surface.group_dp_sizes(optimizer)
    if len(set(sizes)) == 1:
        return {}
    dist = comm()
    dp_group = surface.dp_group(optimizer)
    dp, d = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    out: dict[Any, str] = {}
    layout_groups = surface.layout_of(optimizer).groups(optimizer)
    for g, (size, group, lps) in enumerate(zip(sizes, surface.group_dp_groups(optimizer), layout_groups)):
        if size == dp:
            continue
        try:
            layout = ParallelLayout(dp=dp, ep=dp // size)
            place = dist.get_rank(group=group)
            if dp % size or place != layout.expert_data_parallel_rank(d):
                raise PlanError(
                    f"DP rank {d} of {dp} is rank {place} of param group {g}'s {size} ranks; DeepSpeed-MoE's layout "
                    f"puts it at {layout.expert_data_parallel_rank(d)}"
                )
            local = [names[lp] for lp in lps]
            mapping = global_expert_names(local, layout.expert_parallel_rank(d))
        except PlanError as exc:
            raise UnsupportedError(f"mixture-of-experts param group {g}: {exc}") from exc
        strays = [name for name in local if name not in mapping]
        if strays:
            raise UnsupportedError(
                f"param group {g} is partitioned over {size} of {dp} ranks (an expert group) but holds "
                f"{strays[0]!r}, which is not an expert parameter"
            )
        out.update({lp: mapping[name] for lp, name in zip(lps, local)})
    return out
