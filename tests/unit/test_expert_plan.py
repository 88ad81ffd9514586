"""The conversion plan of a mixture-of-experts save (plan/expert_plan.py): pure, from layouts as DeepSpeed-MoE
writes them (dense groups over DP, expert groups over expert-DP under local names), held to an independent
rebuild of every expert from the expert-parallel ranks' flat buffers."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.plan.conversion import ParamSpec, RankLayout
from megatron_ucp.plan.expert_plan import build_expert_plan, derive_param_groups
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.synthetic.layouts import synthesize_layouts

EXPERT = "language_model.encoder.layers.{layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{k}.{what}"


def model(local: int, layers=(1, 3)) -> list[list[ParamSpec]]:
    """Group 0 dense (odd sizes: partitions cut through parameters), group 1 expert-parallel rank 0's experts."""
    dense = [ParamSpec("embedding.weight", 0, (13, 4)), ParamSpec("gate.wg.weight", 0, (4, 3))]
    experts = [
        ParamSpec(EXPERT.format(layer=layer, k=k, what=what), 1, shape)
        for layer in layers
        for k in range(local)
        for what, shape in (("dense_h_to_4h.weight", (5, 3)), ("dense_4h_to_h.bias", (7,)))
    ]
    return [dense, experts]


def moe_layouts(groups: list[list[ParamSpec]], dp: int, ep: int, param_alignment: int = 1) -> list[RankLayout]:
    """Every DP rank's layout: its slice of the dense group at DP, its expert-DP slice of its experts' group."""
    layout = ParallelLayout(dp=dp, ep=ep)
    dense = synthesize_layouts([groups[0]], dp, param_alignment=param_alignment)
    expert = synthesize_layouts([groups[1]], layout.expert_dp, param_alignment=param_alignment)
    return [
        RankLayout(
            rank=d,
            groups=(dense[d].groups[0], expert[layout.expert_data_parallel_rank(d)].groups[0]),
            source=f"<rank {d}>",
        )
        for d in range(dp)
    ]


def value(name: str, i: int) -> float:
    return float(hash((name, i)) % 100_003)


def flat_buffers(groups, ranks, layout: ParallelLayout, local: int) -> dict[tuple[int, int], list[float]]:
    """What each rank file holds per group, built from each global parameter's values (the truth): the dense
    flat buffer cut at DP, expert-parallel rank r's experts' buffer cut at expert-DP."""
    from megatron_ucp.plan.experts import global_expert_name

    out = {}
    for d, rank in enumerate(ranks):
        r = layout.expert_parallel_rank(d)
        for g, group in enumerate(rank.groups):
            size = max((f.start + f.numel for f in group.fragments), default=0) + 64
            buf = [float("nan")] * size
            for frag in group.fragments:
                name = frag.name if g == 0 else global_expert_name(frag.name, r, local)
                # the fragment's place in its parameter: what came before it on lower ranks of the same buffer
                before = sum(
                    f.numel
                    for e, other in enumerate(ranks)
                    if (g == 0 or layout.expert_parallel_rank(e) == r) and e < d
                    for f in other.groups[g].fragments
                    if f.name == frag.name
                )
                for i in range(frag.numel):
                    buf[frag.start + i] = value(name, before + i)
            out[(d, g)] = buf
    return out


@pytest.mark.parametrize("dp, ep, experts", [(4, 2, 4), (8, 4, 4), (6, 3, 6), (4, 1, 2), (8, 8, 8)])
def test_every_expert_comes_out_whole_under_its_global_name(dp: int, ep: int, experts: int) -> None:
    layout = ParallelLayout(dp=dp, ep=ep)
    local = layout.local_experts(experts)
    groups = model(local)
    ranks = moe_layouts(groups, dp, ep)
    expert_groups = [1] if ep > 1 else []
    plan = build_expert_plan(groups, ranks, expert_groups, ep, experts)
    expected = {spec.name for spec in groups[0]} | {
        EXPERT.format(layer=layer, k=e, what=what)
        for layer in (1, 3)
        for e in range(experts)
        for what in ("dense_h_to_4h.weight", "dense_4h_to_h.bias")
    }
    assert {p.name for p in plan.params} == expected
    held = flat_buffers(groups, ranks, layout, local)
    for p in plan.params:
        out = [None] * p.numel
        for item in p.items:
            for i in range(item.length):
                out[item.dst_offset + i] = held[(item.rank, p.group)][item.src_offset + i]
        assert out == [value(p.name, i) for i in range(p.numel)], p.name
        if p.group == 1 and ep > 1:  # an expert is read only from the ranks holding it
            e = int(p.name.split("deepspeed_experts.")[1].split(".")[0])
            assert {layout.expert_parallel_rank(i.rank) for i in p.items} == {e // local}, p.name
    assert plan.groups[1].geometry.dp == layout.expert_dp and plan.groups[0].geometry.dp == dp


def test_the_groups_derive_from_the_rank_files_when_the_model_states_list_none() -> None:
    groups = model(2)
    ranks = moe_layouts(groups, 8, 4, param_alignment=4)
    shapes = {spec.name: spec.shape for group in groups for spec in group}
    assert derive_param_groups(ranks, [1], 4, shapes) == groups
    del shapes["gate.wg.weight"]
    with pytest.raises(PlanError, match=r"'gate\.wg\.weight' is in no saved module nor expert file"):
        derive_param_groups(ranks, [1], 4, shapes)


def test_an_expert_parallel_rank_with_another_buffer_is_named() -> None:
    groups = model(2)
    ranks = moe_layouts(groups, 4, 2)
    other = moe_layouts(model(2, layers=(1, 3, 5)), 4, 2)
    mixed = [ranks[0], RankLayout(1, (ranks[1].groups[0], other[1].groups[1]), "<rank 1>"), ranks[2], ranks[3]]
    mixed[3] = RankLayout(3, (ranks[3].groups[0], other[3].groups[1]), "<rank 3>")
    with pytest.raises(CheckpointFormatError, match=r"<rank 1>: state 'fp32' of param group 1 has 66 elements"):
        build_expert_plan(groups, mixed, [1], 2, 4)
    with pytest.raises(PlanError, match="EP=2 does not divide the 3 experts"):
        build_expert_plan(groups, ranks, [1], 2, 3)


def test_a_rank_names_its_experts_globally_whatever_ep_it_runs_at() -> None:
    from megatron_ucp.plan.experts import global_expert_names

    names = [EXPERT.format(layer=1, k=k, what="w") for k in (0, 1)] + ["gate.wg.weight"]
    assert global_expert_names(names, 3) == {
        EXPERT.format(layer=1, k=0, what="w"): EXPERT.format(layer=1, k=6, what="w"),
        EXPERT.format(layer=1, k=1, what="w"): EXPERT.format(layer=1, k=7, what="w"),
    }
    with pytest.raises(PlanError, match=r"local experts \[0, 2\], not 0\.\.1"):
        global_expert_names([EXPERT.format(layer=1, k=k, what="w") for k in (0, 2)], 0)


def test_the_save_record_follows_each_group_over_its_own_ranks() -> None:
    """A rank's expert groups are partitioned over expert-DP: their true lengths and the checksums' offsets
    follow that group's geometry and this rank's place in it (what the reader checks every rank file against)."""
    from megatron_ucp.plan.save_record import partition_record

    groups = model(2)
    dense, experts = (sum(spec.numel for spec in g) for g in groups)
    layouts = moe_layouts(groups, 4, 2)
    for d in range(4):
        sizes = [layouts[d].groups[g].state_length("fp32") for g in range(2)]
        record = partition_record(
            [dense, experts], [dense, experts], [s * n for s, n in zip(sizes, (4, 2), strict=True)], [4, 2], [d, d // 2]
        )
        assert record["group_true_lengths"] == [layouts[d].groups[g].recorded_true_length for g in range(2)]
        assert record["zero_partition_info"]["group_dp_ranks"] == [d, d // 2]
        assert record["zero_partition_info"]["dp_size"] == 4 and record["zero_partition_info"]["dp_rank"] == d
