"""The conversion plan and its checks, over random geometries, from metadata alone (no files)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.plan.conversion import (
    ConversionPlan,
    CopyItem,
    Fragment,
    ParamSpec,
    build_plan,
    check_plan,
    share_of,
    split_by_bytes,
    split_items,
)
from megatron_ucp.plan.tensor_parallel import MegatronPatterns
from megatron_ucp.synthetic.layouts import synthesize_layouts
from tests.support.aurora_shapes import aurora_7b_param_groups


def groups_from_sizes(sizes: list[list[int]]) -> list[list[ParamSpec]]:
    return [[ParamSpec(f"g{g}.p{i}", g, (n,)) for i, n in enumerate(group)] for g, group in enumerate(sizes)]


@st.composite
def checkpoints(draw):
    n_groups = draw(st.integers(1, 3))
    sizes = [draw(st.lists(st.integers(1, 300), min_size=1, max_size=8)) for _ in range(n_groups)]
    dp = draw(st.integers(1, 40))
    align = draw(st.sampled_from([1, 1, 2, 8]))
    groups = groups_from_sizes(sizes)
    orders = [draw(st.permutations([p.name for p in g])) for g in groups]
    return groups, dp, align, orders


def covered_exactly_once(plan: ConversionPlan) -> None:
    """Independent oracle: every element of every parameter written exactly once (padded vocabulary
    rows included: they go to the state file beside the trimmed tensor)."""
    for p in plan.params:
        hits = [0] * p.numel
        for it in p.items:
            for k in range(it.dst_offset, it.dst_offset + it.length):
                hits[k] += 1
        assert hits == [1] * p.numel, p.name


@settings(max_examples=300, deadline=None)
@given(checkpoints())
def test_plan_covers_every_element_once(ck):
    groups, dp, align, orders = ck
    layouts = synthesize_layouts(groups, dp, param_alignment=align, flat_orders=orders)
    plan = build_plan(groups, layouts)
    covered_exactly_once(plan)
    # items read each parameter's fragments in flat order: a contiguous run of ranks
    for p in plan.params:
        ranks = [it.rank for it in p.items]
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks))) if ranks else True
        s = plan.groups[p.group].geometry.partition_size
        for it in p.items:
            assert p.flat_offset + it.dst_offset == it.rank * s + it.src_offset
    assert [p.name for p in plan.params if p.group == 0] == list(orders[0])


@settings(max_examples=100, deadline=None)
@given(checkpoints(), st.integers(1, 7))
def test_shares_partition_the_params(ck, n):
    groups, dp, align, orders = ck
    plan = build_plan(groups, synthesize_layouts(groups, dp, param_alignment=align, flat_orders=orders))
    shares = [share_of(plan, i, n) for i in range(n)]
    names = [p.name for share in shares for p in share]
    assert sorted(names) == sorted(p.name for p in plan.params)
    assert shares == [share_of(plan, i, n) for i in range(n)]  # deterministic


@pytest.mark.parametrize("per_parameter", [False, True], ids=["flat", "per-parameter"])
@pytest.mark.parametrize("src,dst", [(768, 512), (4, 3), (6, 9), (3, 8), (512, 768)])
def test_reshard_from_metadata(src, dst, per_parameter):
    """The same parameters at two DP sizes, through the one planner for either layout (ZeRO-1/2's flat groups,
    ZeRO-3's sub-groups; at 512 and 768 most ranks hold only padding of the small groups): both plans rebuild
    every parameter completely, and at ZeRO-3 each rank's slice of a parameter is read where the shapes put it."""
    sizes = [[96, 7, 300, 5], [3, 3, 3]]
    groups = groups_from_sizes(sizes)
    plans = [
        build_plan(groups, synthesize_layouts(groups, dp, per_parameter=per_parameter), per_parameter=per_parameter)
        for dp in (src, dst)
    ]
    for plan in plans:
        covered_exactly_once(plan)
        for p in plan.params:
            assert sum(it.length for it in p.items) == p.numel
            if per_parameter:  # every item a whole slice of its own parameter, one per rank holding any of it
                size = -(-p.numel // plan.dp)
                # where the slice sits in each rank's partition, from the sizes alone: after the slices
                # (ceil(n / dp) each, padded) of the parameters before it in its group
                index = [q.name for q in plan.params if q.group == p.group].index(p.name)
                offset = sum(-(-n // plan.dp) for n in sizes[p.group][:index])
                assert [(it.rank, it.src_offset, it.dst_offset) for it in p.items] == [
                    (r, offset, r * size) for r in range(plan.dp) if r * size < p.numel
                ]
    assert [(p.name, p.numel) for p in plans[0].params] == [(p.name, p.numel) for p in plans[1].params]


def test_aurora_7b_at_dp768_from_metadata():
    groups = aurora_7b_param_groups()
    layouts = synthesize_layouts(groups, 768)
    plan = build_plan(groups, layouts)
    norms = plan.groups[1]
    assert norms.geometry.partition_size == 348 and norms.geometry.padding_only_ranks() == [766, 767]
    last_norm = plan.param("language_model.encoder.final_layernorm.weight")
    assert [it.rank for it in last_norm.items] == list(range(262_144 // 348, 765 + 1))  # 753..765
    assert sum(it.length for it in last_norm.items) == 4096
    assert sum(p.numel for p in plan.params) == 6_738_149_376 + 266_240


def test_vocab_trimming_and_cat_dim():
    groups = [
        [
            ParamSpec("language_model.embedding.word_embeddings.weight", 0, (8, 3)),
            ParamSpec("language_model.encoder.layers.0.self_attention.dense.weight", 0, (3, 3)),
        ]
    ]
    rules = MegatronPatterns(
        vocabulary_patterns=(r".*word_embeddings\.weight$",),
        original_vocab_size=5,
        row_parallel_patterns=(r".*dense\.weight$",),
    )
    plan = build_plan(groups, synthesize_layouts(groups, 4), rules)
    emb = plan.param("language_model.embedding.word_embeddings.weight")
    assert emb.out_shape == (5, 3) and emb.vocab_tensor and sum(i.length for i in emb.items) == 24
    # the trimmed tensor and the padded rows split the items at element 15, nothing dropped
    assert sum(i.length for i in emb.kept_items) == 15 and emb.padded_rows_shape == (3, 3)
    rows = emb.padded_rows_items
    assert sum(i.length for i in rows) == 9 and rows[0].dst_offset == 0

    def elements(items):
        return sorted((i.rank, i.src_offset + j) for i in items for j in range(i.length))

    assert sorted(elements(emb.kept_items) + elements(rows)) == elements(emb.items)
    assert plan.param("language_model.encoder.layers.0.self_attention.dense.weight").cat_dim == 1
    with pytest.raises(PlanError):
        build_plan(groups, synthesize_layouts(groups, 4), dataclasses.replace(rules, original_vocab_size=9))


@settings(deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.data())
def test_split_items_partitions_every_element(lengths, data):
    items, offset = [], 0
    for k, n in enumerate(lengths):
        items.append(CopyItem(rank=k, src_offset=3, dst_offset=offset, length=n))
        offset += n
    at = data.draw(st.integers(0, offset))
    head, tail = split_items(items, at)
    assert sum(i.length for i in head) == at and sum(i.length for i in tail) == offset - at
    covered = sorted(
        [(i.rank, i.src_offset + j) for i in head for j in range(i.length)]
        + [(i.rank, i.src_offset + j) for i in tail for j in range(i.length)]
    )
    assert covered == sorted((i.rank, i.src_offset + j) for i in items for j in range(i.length))
    assert [i.dst_offset for i in tail][:1] in ([], [0])


def _corrupt(layouts, rank, group, fragments=None, **changes):
    lay = layouts[rank].groups[group]
    if fragments is not None:
        changes["fragments"] = tuple(fragments)
    new_group = dataclasses.replace(lay, **changes)
    groups = list(layouts[rank].groups)
    groups[group] = new_group
    layouts = list(layouts)
    layouts[rank] = dataclasses.replace(layouts[rank], groups=tuple(groups), source=f"rank{rank}.pt")
    return layouts


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda L: _corrupt(L, 1, 0, fragments=L[1].groups[0].fragments[:-1]), "elements"),
        (lambda L: _corrupt(L, 0, 0, fragments=[Fragment("g0.p0", 0, 10), Fragment("g0.p0", 5, 10)]), "overlap"),
        (lambda L: _corrupt(L, 0, 0, fragments=[*L[0].groups[0].fragments, Fragment("nope", 0, 1)]), "nope"),
        (lambda L: _corrupt(L, 0, 0, fragments=[Fragment("g0.p0", 95, 50)]), "outside the partition"),
        (lambda L: _corrupt(L, 2, 0, state_lengths=(("fp32", 3), ("exp_avg", 3), ("exp_avg_sq", 3))), "truncated"),
        (lambda L: _corrupt(L, 1, 1, state_lengths=(("fp32", 3),)), "stores states"),
        (lambda L: _corrupt(L, 3, 1, recorded_true_length=2), "true length"),
        (lambda L: _corrupt(L, 0, 1, has_step=False), "step"),
    ],
)
def test_inconsistent_metadata_is_refused(mutate, message):
    groups = groups_from_sizes([[96, 7, 300, 5], [3, 3, 3]])
    layouts = mutate(synthesize_layouts(groups, 4))
    with pytest.raises((CheckpointFormatError, PlanError), match=message):
        build_plan(groups, layouts)


def test_rank_set_must_be_complete():
    groups = groups_from_sizes([[10]])
    layouts = synthesize_layouts(groups, 4)
    with pytest.raises(PlanError, match="exactly once"):
        build_plan(groups, layouts[:2] + layouts[3:])


def test_check_plan_catches_gaps_overlaps_and_bounds():
    groups = groups_from_sizes([[10, 6]])
    plan = build_plan(groups, synthesize_layouts(groups, 2))
    p0 = plan.params[0]

    def with_items(items):
        return dataclasses.replace(plan, params=(dataclasses.replace(p0, items=tuple(items)), *plan.params[1:]))

    first = p0.items[0]
    with pytest.raises(PlanError, match="gap"):
        check_plan(with_items([dataclasses.replace(first, dst_offset=1)] + list(p0.items[1:])))
    with pytest.raises(PlanError, match="overlap"):
        check_plan(with_items([first, first] + list(p0.items[1:])))
    with pytest.raises(PlanError, match="outside"):
        check_plan(with_items([CopyItem(rank=5, src_offset=0, dst_offset=0, length=10)]))
    p1 = plan.params[1]
    stolen = dataclasses.replace(p1, items=(CopyItem(rank=0, src_offset=0, dst_offset=0, length=6),))
    with pytest.raises(PlanError, match="overlapping"):
        check_plan(dataclasses.replace(plan, params=(p0, stolen)))


def test_split_by_bytes_is_balanced_and_contiguous():
    groups = groups_from_sizes([[100] * 20])
    plan = build_plan(groups, synthesize_layouts(groups, 4))
    parts = split_by_bytes(plan.params, 4, {0: 3})
    assert [len(p) for p in parts] == [5, 5, 5, 5]
    assert [p.name for part in parts for p in part] == [p.name for p in plan.params]
