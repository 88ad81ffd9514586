"""ZeRO-3 per-parameter geometry and the stage-3 conversion plan, from numbers alone (no files, no DeepSpeed)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.plan.conversion import ParamSpec, RankGroupLayout, RankLayout, build_plan
from megatron_ucp.plan.param_geometry import (
    ParamPartition,
    SubGroupGeometry,
    stock_stage3_problems,
    sub_groups,
)
from megatron_ucp.synthetic.layouts import synthesize_layouts
from tests.support.aurora_shapes import aurora_7b_param_groups


def test_small_parameter_has_padding_only_ranks():
    p = ParamPartition(numel=3, dp=4)
    assert (p.partition_size, p.padding_total) == (1, 1)
    assert [p.true_length(r) for r in range(4)] == [1, 1, 1, 0]
    assert p.padding_only_ranks() == [3]
    assert p.stock_extracted_length(3) == 0  # |3 - 3|: the first padding-only rank comes out right
    wide = ParamPartition(numel=3, dp=8)
    assert wide.padding_only_ranks() == [3, 4, 5, 6, 7]
    # stock before 0.19.3 takes min(S, |n - r S|): one padding element of ranks 4..7 each, as data
    assert [wide.stock_extracted_length(r) for r in range(3, 8)] == [0, 1, 1, 1, 1]


def test_aurora_7b_norm_weight_at_dp768():
    norm = ParamPartition(numel=4096, dp=768)
    assert norm.partition_size == 6
    assert norm.true_length(682) == 4 and norm.true_length(683) == 0
    assert norm.padding_only_ranks() == list(range(683, 768))
    # stock's abs(): rank 700 holds only padding, yet 6 elements of it become "data"
    assert norm.stock_extracted_length(700) == 6


def test_empty_parameter_has_nothing_to_pad():
    p = ParamPartition(numel=0, dp=8)
    assert p.partition_size == 0 and p.padding_only_ranks() == []
    with pytest.raises(UcpError):
        ParamPartition(numel=4, dp=0)


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(0, 10**6), dp=st.integers(1, 1024))
def test_param_partition_invariants(numel, dp):
    p = ParamPartition(numel, dp)
    lengths = [p.true_length(r) for r in range(dp)]
    assert sum(lengths) == numel
    assert p.dp * p.partition_size - numel == p.padding_total < dp or numel == 0
    assert lengths == sorted(lengths, reverse=True)  # real data first, padding on the last ranks
    assert p.padding_only_ranks() == [r for r, t in enumerate(lengths) if t == 0 and p.partition_size]
    assert all(p.true_length(r) == p.stock_extracted_length(r) for r in range(dp) if p.true_length(r))


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 5000), min_size=1, max_size=12), dp=st.integers(1, 64))
def test_sub_group_fragments_tile_each_rank_partition(numels, dp):
    geo = SubGroupGeometry(tuple(numels), dp)
    for r in range(dp):
        frags = geo.fragments(r)
        assert sum(n for _, _, n in frags) == geo.true_length(r)
        for (i, start, n), (j, next_start, _) in pairwise(frags):
            assert i < j and start + n <= next_start
        assert all(start + n <= geo.partition_size for _, start, n in frags)
    assert sum(geo.true_length(r) for r in range(dp)) == geo.numel


def test_sub_groups_follow_deepspeed_cutting_rule():
    # partition elements at DP 4: 48, 7, 3, 9, 9, 48 (the tiny model's weight-decay group)
    numels = [192, 27, 9, 36, 36, 192]
    assert sub_groups(numels, 4, 10**12) == [[0, 1, 2, 3, 4, 5]]
    assert sub_groups(numels, 4, 50) == [[0, 1], [2, 3, 4, 5]]
    assert sub_groups(numels, 4, 1) == [[i] for i in range(6)]


def test_stock_problems_by_release():
    geos = [SubGroupGeometry((192, 27), 8), SubGroupGeometry((3, 3, 3), 8)]
    assert stock_stage3_problems(geos, reads_every_sub_group=True, strips_padding_only_slices=True) == []
    before_0_19_3 = stock_stage3_problems(geos, True, False)
    assert [(p.sub_group, p.param) for p in before_0_19_3] == [(0, 1), (1, 0), (1, 1), (1, 2)]
    assert "taken as data" in before_0_19_3[0].what
    before_0_18 = stock_stage3_problems(geos, False, False)
    assert (before_0_18[-1].sub_group, before_0_18[-1].param) == (1, -1)


def _specs(groups: list[list[int]]) -> list[list[ParamSpec]]:
    return [[ParamSpec(f"g{g}.p{i}", g, (n,)) for i, n in enumerate(ns)] for g, ns in enumerate(groups)]


@pytest.mark.parametrize("dp", [1, 3, 4, 7])
def test_stage3_plan_places_every_element_once(dp):
    specs = _specs([[192, 27, 9], [3, 3, 0, 5]])
    plan = build_plan(specs, synthesize_layouts(specs, dp, per_parameter=True), per_parameter=True)
    for p, spec in zip(plan.params, [s for g in specs for s in g], strict=True):
        part = ParamPartition(spec.numel, dp)
        assert sum(i.length for i in p.items) == spec.numel
        assert [(i.rank, i.dst_offset, i.length) for i in p.items] == [
            (r, part.start(r), part.true_length(r)) for r in range(dp) if part.true_length(r)
        ]
        assert {i.src_offset for i in p.items} <= {p.flat_offset}  # the same place in every rank's partition


def test_aurora_7b_shapes_plan_at_dp768():
    specs = [[ParamSpec(s.name, g, s.shape) for s in group] for g, group in enumerate(aurora_7b_param_groups())]
    plan = build_plan(specs, synthesize_layouts(specs, 768, per_parameter=True), per_parameter=True)
    norms = plan.groups[1].geometry
    assert norms.partition_size == 65 * 6
    assert sum(p.numel for p in plan.params) == sum(s.numel for g in specs for s in g)


def _with(layouts: list[RankLayout], rank: int, **changes) -> list[RankLayout]:
    out = list(layouts)
    lay = out[rank]
    groups = list(lay.groups)
    groups[0] = RankGroupLayout(**{**groups[0].__dict__, **changes})
    out[rank] = RankLayout(rank=rank, groups=tuple(groups), source=f"rank{rank}.pt")
    return out


def test_stage3_plan_refuses_files_that_contradict_the_shapes():
    specs = _specs([[192, 27], [3]])
    layouts = synthesize_layouts(specs, 4, per_parameter=True)
    short = _with(layouts, 2, state_lengths=(("fp32", 55), ("exp_avg", 54), ("exp_avg_sq", 55)))
    with pytest.raises(CheckpointFormatError, match=r"rank2\.pt: state 'exp_avg' of sub-group 0 has 54 .*truncated"):
        build_plan(specs, short, per_parameter=True)
    long = _with(layouts, 1, state_lengths=(("fp32", 60), ("exp_avg", 60), ("exp_avg_sq", 60)))
    with pytest.raises(CheckpointFormatError, match="different DP size"):
        build_plan(specs, long, per_parameter=True)
    lied = _with(synthesize_layouts(specs, 4, per_parameter=True), 3, recorded_true_length=55)
    with pytest.raises(CheckpointFormatError, match="records true length 55 for sub-group 0"):
        build_plan(specs, lied, per_parameter=True)
    other_states = _with(layouts, 1, state_lengths=(("fp32", 55), ("momentum", 55)))
    with pytest.raises(CheckpointFormatError, match="rank1.pt: sub-group 0 stores states"):
        build_plan(specs, other_states, per_parameter=True)
    fewer = list(layouts)
    fewer[3] = RankLayout(rank=3, groups=layouts[3].groups[:1], source="rank3.pt")
    with pytest.raises(CheckpointFormatError, match="rank3.pt: has 1 optimizer sub-groups, the model states list 2"):
        build_plan(specs, fewer, per_parameter=True)
