"""The conversion plan of a ZeRO-3 checkpoint: each parameter from its slice on every rank. Pure.

A stage-3 rank file records no fragment map (stages 1 and 2 record ``param_slice_mappings``): where
each parameter sits in a rank's partition follows from the sub-group's parameter shapes alone
(:class:`~megatron_ucp.plan.param_geometry.SubGroupGeometry`). So the checks are on what the files
do record: the number of sub-groups, the same states on every rank, every state exactly one
partition long (shorter: truncated; longer: another DP size or model), and the true lengths the
save hook records when megatron-ucp was installed. The plan is the same
:class:`~megatron_ucp.plan.conversion.ConversionPlan` stages 1 and 2 produce (``group`` = sub-group),
checked by the same :func:`~megatron_ucp.plan.conversion.check_plan`, so the writer, the manifest and
the tensor-parallel merge (:func:`~megatron_ucp.plan.model_parallel.build_model_parallel_plan`) take it
unchanged.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.plan.conversion import (
    ConversionPlan,
    CopyItem,
    GroupPlan,
    ParamPlan,
    ParamSpec,
    RankGroupLayout,
    RankLayout,
    check_plan,
    checked_ranks,
    shape_output,
)
from megatron_ucp.plan.param_geometry import SubGroupGeometry
from megatron_ucp.plan.tensor_parallel import MegatronPatterns, TpLayout


def _fail(source: str, message: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{source}: {message}", subject=source)


def build_stage3_plan(
    sub_groups: Sequence[Sequence[ParamSpec]],
    ranks: Sequence[RankLayout],
    rules: MegatronPatterns = MegatronPatterns(),
    tp_layouts: Optional[Mapping[str, TpLayout]] = None,
) -> ConversionPlan:
    """Plan a stage-3 checkpoint from its sub-groups' parameter shapes (``param_shapes``, one dict per
    sub-group) and every DP rank's file layout. Raises :class:`CheckpointFormatError` naming the file
    when a rank file contradicts the geometry."""
    ranks = checked_ranks(
        sub_groups, ranks, "optimizer sub-groups", ": files of another run, or another sub_group_size?"
    )
    dp = len(ranks)
    group_plans, param_plans = [], []
    for g, specs in enumerate(sub_groups):
        geo = SubGroupGeometry(tuple(s.numel for s in specs), dp)
        layouts = [(r.source, r.rank, r.groups[g]) for r in ranks]
        states = _check_sub_group(g, geo, layouts)
        steps = {lay.has_step for _, _, lay in layouts}
        if len(steps) != 1:
            raise PlanError(f"sub-group {g}: some rank files store an optimizer step and some do not")
        group_plans.append(
            GroupPlan(
                index=g, geometry=geo, states=states, has_step=steps.pop(), param_names=tuple(s.name for s in specs)
            )
        )
        param_plans.extend(_plan_sub_group(g, specs, geo, rules, tp_layouts))
    plan = ConversionPlan(dp=dp, groups=tuple(group_plans), params=tuple(param_plans))
    check_plan(plan)
    return plan


def _check_sub_group(
    g: int, geo: SubGroupGeometry, layouts: Sequence[tuple[str, int, RankGroupLayout]]
) -> tuple[str, ...]:
    """Every rank stores the same states, each exactly one partition long; recorded true lengths agree."""
    first = layouts[0][2].state_names
    size = geo.partition_size
    for source, rank, lay in layouts:
        if set(lay.state_names) != set(first):
            raise _fail(
                source,
                f"sub-group {g} stores states {sorted(lay.state_names)}, rank 0 stores {sorted(first)}: "
                "files from different runs?",
            )
        for name, length in lay.state_lengths:
            if length != size:
                cause = "truncated file?" if length < size else "files of a different DP size or model?"
                raise _fail(
                    source,
                    f"state {name!r} of sub-group {g} has {length} elements; the model's parameter shapes give "
                    f"{size} per rank at DP={geo.dp} (each parameter's ceil(n/{geo.dp})): {cause}",
                )
        if lay.recorded_true_length is not None and lay.recorded_true_length != geo.true_length(rank):
            raise _fail(
                source,
                f"records true length {lay.recorded_true_length} for sub-group {g}, geometry gives "
                f"{geo.true_length(rank)} (DP={geo.dp})",
            )
    ordered = ["fp32"] if "fp32" in first else []
    return tuple(ordered + sorted(s for s in first if s != "fp32"))


def _plan_sub_group(
    g: int,
    specs: Sequence[ParamSpec],
    geo: SubGroupGeometry,
    rules: MegatronPatterns,
    tp_layouts: Optional[Mapping[str, TpLayout]],
) -> list[ParamPlan]:
    if len({s.name for s in specs}) != len(specs):
        raise PlanError(f"sub-group {g} lists a parameter name twice")
    plans = []
    for spec, part, offset in zip(specs, geo.params, geo.offsets):
        items = tuple(
            CopyItem(rank=r, src_offset=offset, dst_offset=part.start(r), length=part.true_length(r))
            for r in range(geo.dp)
            if part.true_length(r)
        )
        layout = tp_layouts.get(spec.name) if tp_layouts else None
        plans.append(shape_output(spec, offset, items, rules, layout, trim_vocabulary=False))
    return plans


def stage3_layouts(
    sub_groups: Sequence[Sequence[ParamSpec]],
    dp: int,
    states: Sequence[str] = ("fp32", "exp_avg", "exp_avg_sq"),
    record_true_lengths: bool = False,
) -> list[RankLayout]:
    """The rank layouts DeepSpeed writes for these sub-groups at ``dp`` (for planning from shapes alone:
    the synthetic writer, inspect's what-if, property tests)."""
    out = []
    for r in range(dp):
        groups = []
        for specs in sub_groups:
            geo = SubGroupGeometry(tuple(s.numel for s in specs), dp)
            groups.append(
                RankGroupLayout(
                    fragments=(),
                    state_lengths=tuple((st, geo.partition_size) for st in states),
                    recorded_true_length=geo.true_length(r) if record_true_lengths else None,
                    has_step=True,
                )
            )
        out.append(RankLayout(rank=r, groups=tuple(groups), source=f"<synthetic stage-3 rank {r}>"))
    return out
