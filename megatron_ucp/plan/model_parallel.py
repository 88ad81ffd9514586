"""The conversion plan of a tensor- and pipeline-parallel checkpoint: per-coordinate plans, merged.

Pure (no I/O, no torch). Every model-parallel coordinate ``(pp, tp)`` has its own parameters and
its own ZeRO partition geometry, so the DP-padding checks run per coordinate:
:func:`~megatron_ucp.plan.conversion.build_plan` plans each one on its own (its TP slice of every
parameter, from its DP rank files). :func:`build_model_parallel_plan` then merges them: each
parameter's TP slices are placed in the whole parameter through
:func:`~megatron_ucp.plan.tensor_parallel.slice_runs`, so a :class:`CopyItem` copies from one rank
file (numbered across coordinates) to one contiguous run of the whole parameter. A replicated
parameter is read from TP rank 0 and every other copy (the other TP ranks', the other pipeline
stage of a tied parameter) becomes a replica the converter compares with it. The merged plan is
checked like any other (:func:`~megatron_ucp.plan.conversion.check_plan`: every element exactly
once, every read inside its file's partition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.conversion import (
    ConversionPlan,
    CopyItem,
    GroupPlan,
    MegatronPatterns,
    ParamPlan,
    ParamSpec,
    RankLayout,
    build_plan,
    check_plan,
    shape_output,
)
from megatron_ucp.plan.geometry import NCCL_START_ALIGNMENT_FACTOR
from megatron_ucp.plan.tensor_parallel import TpLayout, full_shape, runs_between, slice_runs


@dataclass(frozen=True)
class CoordinateInput:
    """One model-parallel rank's files, as the reader describes them."""

    pp: int
    tp: int
    param_groups: tuple[tuple[ParamSpec, ...], ...]
    ranks: tuple[RankLayout, ...]
    first_file: int
    """Global index of its DP rank 0's file (``CopyItem.rank`` numbers files across coordinates)."""


def _global_items(slice_plan: ParamPlan, first_file: int, runs) -> list[CopyItem]:
    """A slice's items (DP ranks -> slice offsets) composed with the slice's runs in the whole parameter."""
    out = []
    for item in slice_plan.items:
        for run in runs_between(runs, item.dst_offset, item.length):
            out.append(
                CopyItem(
                    rank=first_file + item.rank,
                    src_offset=item.src_offset + run.slice_offset - item.dst_offset,
                    dst_offset=run.full_offset,
                    length=run.length,
                    group=slice_plan.group,
                )
            )
    return sorted(out, key=lambda i: i.dst_offset)


def build_model_parallel_plan(
    coordinates: Sequence[CoordinateInput],
    tp: int,
    pp: int,
    layouts: Mapping[str, TpLayout],
    rules: MegatronPatterns = MegatronPatterns(),
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
    per_parameter: bool = False,
) -> ConversionPlan:
    """Plan every coordinate (:func:`~megatron_ucp.plan.conversion.build_plan`; ``per_parameter``: ZeRO-3's
    sub-groups, whose vocabulary parameters are written whole), then merge TP slices and pipeline stages into
    whole parameters."""
    trim_vocabulary = not per_parameter

    def plan_coordinate(groups: Sequence[Sequence[ParamSpec]], ranks: Sequence[RankLayout]) -> ConversionPlan:
        return build_plan(groups, ranks, MegatronPatterns(), alignment_factor, per_parameter=per_parameter)

    by_coord = {(c.pp, c.tp): c for c in coordinates}
    if sorted(by_coord) != [(p, t) for p in range(pp) for t in range(tp)]:
        raise PlanError(f"coordinates {sorted(by_coord)} do not cover TP={tp} x PP={pp}")
    dps = {len(c.ranks) for c in coordinates}
    if len(dps) != 1:
        raise PlanError(f"coordinates have different DP sizes {sorted(dps)}")
    plans = {key: plan_coordinate(c.param_groups, c.ranks) for key, c in by_coord.items()}
    n_groups = {len(p.groups) for p in plans.values()}
    if len(n_groups) != 1:
        raise PlanError(f"pipeline stages / TP ranks have different numbers of param groups {sorted(n_groups)}")

    stages_of: dict[str, list[int]] = {}
    for p_index in range(pp):
        for sp in plans[(p_index, 0)].params:
            stages_of.setdefault(sp.name, []).append(p_index)
    for p_index in range(pp):
        names0 = {sp.name for sp in plans[(p_index, 0)].params}
        for t in range(1, tp):
            names = {sp.name for sp in plans[(p_index, t)].params}
            if names != names0:
                raise PlanError(
                    f"pipeline stage {p_index}: TP rank {t} holds parameters {sorted(names ^ names0)[:4]} "
                    "that TP rank 0 does not (or the reverse)"
                )

    merged: list[ParamPlan] = []
    for name, stages in stages_of.items():
        layout = layouts.get(name)
        if layout is None:
            raise PlanError(f"no TP layout for parameter {name!r}")
        copies: list[tuple[CopyItem, ...]] = []
        spec_shape = None
        group = None
        for stage in stages:
            slices = [plans[(stage, t)].param(name) for t in range(tp)]
            shapes = {sp.shape for sp in slices}
            if len(shapes) != 1:
                raise PlanError(f"{name!r}: TP slices have different shapes {sorted(shapes)} (stage {stage})")
            groups = {sp.group for sp in slices}
            if len(groups) != 1:
                raise PlanError(f"{name!r}: TP slices sit in different param groups {sorted(groups)}")
            whole = full_shape(slices[0].shape, layout, tp)
            if spec_shape is not None and whole != spec_shape:
                raise PlanError(f"{name!r}: pipeline stages {stages} hold it with different shapes")
            if group is not None and slices[0].group != group:
                raise PlanError(f"{name!r}: pipeline stages {stages} hold it in different param groups")
            spec_shape, group = whole, slices[0].group
            if layout.replicated:
                for t, sp in enumerate(slices):
                    copies.append(
                        tuple(_global_items(sp, by_coord[(stage, t)].first_file, slice_runs(whole, layout, 1, 0, name)))
                    )
            else:
                items: list[CopyItem] = []
                for t, sp in enumerate(slices):
                    items += _global_items(sp, by_coord[(stage, t)].first_file, slice_runs(whole, layout, tp, t, name))
                copies.append(tuple(sorted(items, key=lambda i: i.dst_offset)))
        spec = ParamSpec(name=name, group=group, shape=spec_shape)
        merged.append(
            shape_output(spec, 0, copies[0], rules, layout, replicas=tuple(copies[1:]), trim_vocabulary=trim_vocabulary)
        )

    first = plans[(0, 0)]
    groups = []
    for g in range(len(first.groups)):
        states = {plans[k].groups[g].states for k in plans}
        if len(states) != 1:
            raise PlanError(f"param group {g}: coordinates store different optimizer states {sorted(states)}")
        steps = {plans[k].groups[g].has_step for k in plans}
        if len(steps) != 1:
            raise PlanError(f"param group {g}: some coordinates store an optimizer step and some do not")
        names = tuple(p.name for p in merged if p.group == g)
        groups.append(
            GroupPlan(
                index=g,
                geometry=first.groups[g].geometry,
                states=first.groups[g].states,
                has_step=first.groups[g].has_step,
                param_names=names,
            )
        )
    files = sorted((c.first_file, c) for c in coordinates)
    partitions: list[tuple[int, ...]] = []
    for first_file, c in files:
        if first_file != len(partitions):
            raise PlanError(
                f"rank files of coordinate (pp={c.pp}, tp={c.tp}) start at {first_file}, expected {len(partitions)}"
            )
        sizes = tuple(g.geometry.partition_size for g in plans[(c.pp, c.tp)].groups)
        partitions += [sizes] * len(c.ranks)
    merged.sort(key=lambda p: (p.group, min(i.rank for i in p.items) if p.items else 0, p.name))
    plan = ConversionPlan(
        dp=dps.pop(), groups=tuple(groups), params=tuple(merged), partitions=tuple(partitions), tp=tp, pp=pp
    )
    check_plan(plan)
    return plan
