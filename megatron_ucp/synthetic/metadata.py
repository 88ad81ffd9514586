"""A synthetic checkpoint's metadata without its bytes: what the reader would make of its rank files.

:func:`rank_layouts` gives, for every DP rank of a :class:`~megatron_ucp.synthetic.content.SyntheticSpec`,
the :class:`~megatron_ucp.plan.conversion.RankLayout` the reader builds from that rank's file
(fragments from ``param_slice_mappings``, stored state lengths, recorded paddings) by the same
rules :mod:`~megatron_ucp.synthetic.content` writes them with. So the conversion plan of
AuroraGPT-7B at DP 768 (81 GB of optimizer state) is built and checked with nothing on disk.
"""
from __future__ import annotations

from megatron_ucp.plan.conversion import Fragment, RankGroupLayout, RankLayout
from megatron_ucp.synthetic.content import SyntheticSpec


def rank_layouts(spec: SyntheticSpec, tp_rank: int = 0) -> list[RankLayout]:
    groups, geos, style = spec.groups(), spec.geometries(), spec.padding_style()
    out = []
    for r in range(spec.dp):
        per_group = []
        for params, geo in zip(groups, geos):
            size, start = geo.partition_size, r * geo.partition_size
            fragments, offset = [], 0
            for p in params:
                lo, hi = max(offset, start), min(offset + p.numel, start + size)
                if hi > lo:
                    fragments.append(Fragment(p.name, lo - start, hi - lo))
                offset += p.numel
            padding = geo.padding(r) if spec.record else geo.recorded_padding(r, style)
            fp32 = size if spec.optimizer == "bf16" else len(range(size)[:size - geo.recorded_padding(r, style)])
            per_group.append(RankGroupLayout(
                fragments=tuple(fragments), state_lengths=(("fp32", fp32), ("exp_avg", size), ("exp_avg_sq", size)),
                recorded_padding=padding, recorded_true_length=geo.true_length(r) if spec.record else None,
                has_step=True))
        out.append(RankLayout(rank=r, groups=tuple(per_group),
                              source=f"<synthetic rank {r} of {spec.dp}, TP rank {tp_rank}>"))
    return out
