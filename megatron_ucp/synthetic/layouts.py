"""The rank layouts DeepSpeed writes for given parameters at a DP size, from metadata alone: what the synthetic
checkpoints are laid out by (and the conversion plan's tests reason about)."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_ucp.plan.conversion import Fragment, ParamSpec, RankGroupLayout, RankLayout
from megatron_ucp.plan.geometry import NCCL_START_ALIGNMENT_FACTOR, GroupGeometry, PaddingStyle
from megatron_ucp.plan.param_geometry import SubGroupGeometry


def synthesize_layouts(
    param_groups: Sequence[Sequence[ParamSpec]],
    dp: int,
    states: Sequence[str] = ("fp32", "exp_avg", "exp_avg_sq"),
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
    param_alignment: int = 1,
    flat_orders: Optional[Sequence[Sequence[str]]] = None,
    recorded_style: Optional[PaddingStyle] = None,
    fp32_cut_style: Optional[PaddingStyle] = None,
    per_parameter: bool = False,
) -> list[RankLayout]:
    """The rank layouts DeepSpeed writes for these parameters at ``dp`` (``per_parameter``: ZeRO-3's, for
    these optimizer sub-groups: every state one partition long, no fragment map).

    ``param_alignment`` pads every parameter but the last to a multiple (DeepSpeedZeroOptimizer's
    ``parameter_alignment``); ``flat_orders`` gives each group's flat order (``round_robin_gradients``
    reorders). ``recorded_style``: ``group_paddings`` as stock DeepSpeed records them (no true
    lengths); default: as saved with megatron-ucp's record (per-rank paddings and true lengths).
    ``fp32_cut_style``: DeepSpeedZeroOptimizer stores the fp32 partition cut by the padding it records
    in that style (Python slice semantics, as its ``state_dict`` does); default: whole partitions.
    What the synthetic-checkpoint writer lays its files out by, and what the plan's property tests reason about
    from metadata alone (the AuroraGPT-7B shapes at DP=768) without producing a single tensor.
    """
    per_rank: list[list[RankGroupLayout]] = [[] for _ in range(dp)]
    for g, specs in enumerate(param_groups):
        if per_parameter:
            sub = SubGroupGeometry(tuple(spec.numel for spec in specs), dp)
            for r in range(dp):
                per_rank[r].append(
                    RankGroupLayout(
                        fragments=(),
                        state_lengths=tuple((st, sub.partition_size) for st in states),
                        recorded_true_length=sub.true_length(r) if recorded_style is None else None,
                        has_step=True,
                    )
                )
            continue
        by_name = {spec.name: spec for spec in specs}
        order = [by_name[n] for n in flat_orders[g]] if flat_orders is not None else list(specs)
        offsets, offset = [], 0
        for i, spec in enumerate(order):
            offsets.append(offset)
            offset += spec.numel
            if i != len(order) - 1:
                offset += (-offset) % param_alignment
        numel = sum(s.numel for s in specs)
        geo = GroupGeometry(numel=numel, dp=dp, padded_numel=offset, alignment_factor=alignment_factor)
        s = geo.partition_size
        frags: list[list[Fragment]] = [[] for _ in range(dp)]
        for spec, lo in zip(order, offsets):
            hi = lo + spec.numel
            for r in range(lo // s if s else 0, min(dp, -(-hi // s)) if s else 0):
                a, b = max(lo, r * s), min(hi, (r + 1) * s)
                if a < b:
                    frags[r].append(Fragment(spec.name, a - r * s, b - a))
        for r in range(dp):
            fp32 = s if fp32_cut_style is None else len(range(s)[: s - geo.recorded_padding(r, fp32_cut_style)])
            per_rank[r].append(
                RankGroupLayout(
                    fragments=tuple(frags[r]),
                    state_lengths=tuple((st, fp32 if st == "fp32" else s) for st in states),
                    recorded_padding=geo.padding(r)
                    if recorded_style is None
                    else geo.recorded_padding(r, recorded_style),
                    recorded_true_length=geo.true_length(r) if recorded_style is None else None,
                    param_alignment_padding=offset - numel,
                    has_step=True,
                )
            )
    return [RankLayout(rank=r, groups=tuple(per_rank[r]), source=f"<synthetic rank {r}>") for r in range(dp)]
