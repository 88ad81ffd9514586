"""The conversion plan of a mixture-of-experts save: dense groups over DP, expert groups over expert-DP. Pure.

DeepSpeed-MoE partitions each dense param group over the whole DP group, as any ZeRO-1/2 save, and each
expert param group over the expert-data-parallel group of DP / EP ranks: the ranks of expert-parallel rank
``r`` (``d % EP == r``) hold the partitions of *their* experts' flat buffer, in expert-DP order (``d // EP``),
under local names (``...deepspeed_experts.<k>...``, ``k < E/EP``). Each expert-parallel rank's buffer is
planned on its own as a ZeRO group of expert-DP ranks (:func:`~megatron_ucp.plan.conversion.plan_group`: the
same geometry checks, fragment by fragment), then its parameters are renamed to the global expert index the
expert files use (``r * E/EP + k``), so the universal folder holds every expert of every layer as a parameter
of its own that any EP size can gather. Every expert-parallel rank's buffer has the same geometry (its experts
have the same shapes), so one partition size per group holds for every rank file and
:func:`~megatron_ucp.plan.conversion.check_plan` checks the merged plan as any other: every element of every
expert exactly once, every read inside its file's partition.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.conversion import (
    ConversionPlan,
    CopyItem,
    GroupPlan,
    MegatronPatterns,
    ParamPlan,
    ParamSpec,
    RankLayout,
    check_plan,
    checked_ranks,
    plan_group,
)
from megatron_ucp.plan.experts import expert_group_files, global_expert_name
from megatron_ucp.plan.geometry import NCCL_START_ALIGNMENT_FACTOR
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.tensor_parallel import TpLayout


def build_expert_plan(
    param_groups: Sequence[Sequence[ParamSpec]],
    ranks: Sequence[RankLayout],
    expert_groups: Sequence[int],
    ep: int,
    experts: int,
    rules: MegatronPatterns = MegatronPatterns(),
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
    tp_layouts: Optional[Mapping[str, TpLayout]] = None,
) -> ConversionPlan:
    """Plan a DP-only MoE save: ``param_groups`` as the model states list them (expert groups under the local
    names of expert-parallel rank 0), ``ranks`` every DP rank's layout, ``expert_groups`` the groups partitioned
    over expert-DP, ``experts`` per MoE layer. Expert parameters come out under their global names."""
    ranks = checked_ranks(param_groups, ranks)
    layout = ParallelLayout(dp=len(ranks), ep=ep)
    local = layout.local_experts(experts)
    unknown = sorted(set(expert_groups) - set(range(len(param_groups))))
    if unknown:
        raise PlanError(f"expert param groups {unknown} do not exist (the save has {len(param_groups)} groups)")
    groups: list[GroupPlan] = []
    params: list[ParamPlan] = []
    for g, specs in enumerate(param_groups):
        if g not in expert_groups:
            group, planned = plan_group(g, specs, ranks, rules, alignment_factor, tp_layouts)
        else:
            group, planned = _plan_expert_group(g, specs, ranks, layout, local, rules, alignment_factor, tp_layouts)
        groups.append(group)
        params.extend(planned)
    plan = ConversionPlan(dp=layout.dp, groups=tuple(groups), params=tuple(params))
    check_plan(plan)
    return plan


def _plan_expert_group(
    g: int,
    specs: Sequence[ParamSpec],
    ranks: Sequence[RankLayout],
    layout: ParallelLayout,
    local: int,
    rules: MegatronPatterns,
    alignment_factor: int,
    tp_layouts: Optional[Mapping[str, TpLayout]],
) -> tuple[GroupPlan, list[ParamPlan]]:
    """Each expert-parallel rank's buffer planned over its expert-DP ranks, merged under global names."""
    first: Optional[GroupPlan] = None
    params: list[ParamPlan] = []
    for r, files in expert_group_files(layout).items():
        members = [replace(ranks[d], rank=i) for i, d in enumerate(files)]
        global_names = {spec.name: global_expert_name(spec.name, r, local) for spec in specs}
        group, planned = plan_group(g, specs, members, rules, alignment_factor, tp_layouts)
        if first is not None and (group.geometry, group.states, group.has_step) != (
            first.geometry,
            first.states,
            first.has_step,
        ):
            raise PlanError(
                f"param group {g}: the expert-parallel ranks' expert buffers differ (rank {files[0]}'s holds "
                f"{group.geometry.numel} elements and states {list(group.states)}; rank 0's {first.geometry.numel} "
                f"and {list(first.states)})"
            )
        first = first or group
        for p in planned:
            params.append(replace(p, name=global_names[p.name], items=_file_items(p.items, files)))
    assert first is not None  # a layout has at least one expert-parallel rank
    names = tuple(p.name for p in params)
    if len(set(names)) != len(names):
        raise PlanError(f"param group {g}: two expert-parallel ranks' experts get the same global name")
    return replace(first, param_names=names), params


def _file_items(items: Sequence[CopyItem], files: Sequence[int]) -> tuple[CopyItem, ...]:
    """Items numbered by expert-DP rank, renumbered by the DP rank file that holds that partition."""
    return tuple(replace(item, rank=files[item.rank]) for item in items)


def derive_param_groups(
    ranks: Sequence[RankLayout],
    expert_groups: Sequence[int],
    ep: int,
    shapes: Mapping[str, Sequence[int]],
) -> list[list[ParamSpec]]:
    """The param groups a MoE save's model states would list (DeepSpeed before 0.19 writes no ``param_shapes``
    for them): each group's parameters in flat order, from the fragments of the ranks holding its buffer (every
    DP rank for a dense group, expert-parallel rank 0's expert-DP ranks for an expert group, whose local names
    are the global ones), each with the shape the saved module or its expert file gives it."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if not ranks:
        raise PlanError("no rank files to derive the param groups from")
    expert_holders = expert_group_files(ParallelLayout(dp=len(ranks), ep=ep))[0]
    groups: list[list[ParamSpec]] = []
    for g in range(len(ranks[0].groups)):
        holders = expert_holders if g in expert_groups else range(len(ranks))
        names: list[str] = []
        for d in holders:
            for frag in sorted(ranks[d].groups[g].fragments, key=lambda f: f.start):
                if not names or names[-1] != frag.name:
                    names.append(frag.name)
        if len(set(names)) != len(names):
            raise PlanError(f"param group {g}: a parameter's fragments are not contiguous across the rank files")
        specs = []
        for name in names:
            if name not in shapes:
                raise PlanError(f"param group {g}: {name!r} is in no saved module nor expert file, so has no shape")
            specs.append(ParamSpec(name=name, group=g, shape=tuple(int(d) for d in shapes[name])))
        groups.append(specs)
    return groups
