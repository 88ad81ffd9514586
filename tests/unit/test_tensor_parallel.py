"""TP layouts and the model-parallel plan (pure): slices cover the whole exactly once, and a merged
plan reads every slice element of every coordinate's rank files exactly once."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.conversion import ParamSpec
from megatron_ucp.plan.model_parallel import CoordinateInput, build_model_parallel_plan
from megatron_ucp.plan.tensor_parallel import (
    MegatronPatterns,
    SavedRecord,
    TpLayout,
    full_shape,
    layout_from_patterns,
    merge_layout_records,
    resolve_layouts,
    runs_between,
    slice_runs,
    slice_shape,
)
from megatron_ucp.synthetic.layouts import synthesize_layouts

LAYOUTS = [TpLayout(), TpLayout(dim=1), TpLayout(sub_params=2), TpLayout(replicated=True), TpLayout(dim=2)]


def _slice_by_numpy(whole: np.ndarray, layout: TpLayout, tp: int, rank: int) -> np.ndarray:
    """Megatron's slicing, written the obvious way (the oracle)."""
    if layout.replicated or tp == 1:
        return whole
    if layout.sub_params > 1:
        subs = np.split(whole, layout.sub_params, axis=0)
        return np.concatenate([np.split(s, tp, axis=0)[rank] for s in subs], axis=0)
    return np.split(whole, tp, axis=layout.dim)[rank]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.describe())
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slice_runs_match_megatron_slicing(layout: TpLayout, tp: int) -> None:
    shape = (8, 12, 4)
    whole = np.arange(math.prod(shape)).reshape(shape)
    for rank in range(tp):
        want = _slice_by_numpy(whole, layout, tp, rank).reshape(-1)
        got = np.concatenate(
            [whole.reshape(-1)[r.full_offset : r.full_offset + r.length] for r in slice_runs(shape, layout, tp, rank)]
        )
        assert np.array_equal(got, want)
        assert slice_shape(shape, layout, tp) == _slice_by_numpy(whole, layout, tp, rank).shape
        assert full_shape(slice_shape(shape, layout, tp), layout, tp) == shape


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if not x.replicated], ids=lambda x: x.describe())
def test_split_slices_cover_the_whole_exactly_once(layout: TpLayout) -> None:
    shape, tp = (8, 12, 4), 4
    hits = np.zeros(math.prod(shape), dtype=int)
    for rank in range(tp):
        for run in slice_runs(shape, layout, tp, rank):
            hits[run.full_offset : run.full_offset + run.length] += 1
    assert (hits == 1).all()


def test_runs_between_cuts_a_slice_range() -> None:
    runs = slice_runs((4, 6), TpLayout(dim=1), 2, 1)  # 4 runs of 3
    part = runs_between(runs, 2, 5)
    assert sum(r.length for r in part) == 5
    assert part[0].slice_offset == 2 and part[0].full_offset == 3 + 2
    assert part[-1].slice_offset + part[-1].length == 7


def test_indivisible_shapes_are_refused() -> None:
    with pytest.raises(PlanError, match="does not divide"):
        slice_shape((6, 5), TpLayout(dim=1), 2, "w")
    with pytest.raises(PlanError, match="sub-parameters"):
        TpLayout(dim=1, sub_params=2)


def test_patterns_without_tp_say_nothing_of_row_parallelism_but_a_record_does() -> None:
    rules = MegatronPatterns(two_sub_param_patterns=(r"\d+.mlp.dense_h_to_4h.weight",), saved_tp=1)
    assert layout_from_patterns("3.self_attention.dense.weight", rules) == TpLayout(dim=0)  # stock's assumption
    recorded = {
        "3.self_attention.dense.weight": {"partition_dim": 1},
        "3.mlp.dense_h_to_4h.weight": {"partition_dim": 0},
        "3.input_layernorm.weight": {"replicated": True},
    }
    got = resolve_layouts(recorded, recorded, rules, "f")
    assert got["3.self_attention.dense.weight"] == TpLayout(dim=1)
    assert got["3.mlp.dense_h_to_4h.weight"] == TpLayout(sub_params=2)
    assert got["3.input_layernorm.weight"].replicated
    with pytest.raises(PlanError, match="not of"):
        resolve_layouts([*recorded, "4.weight"], recorded, rules, "f")


def _stage_record(*names: str, dim: int = 0) -> dict:
    return {n: TpLayout(replicated=n.endswith("norm.weight"), dim=dim).to_record() for n in names}


def test_each_pipeline_stage_records_its_own_parameters_and_the_records_merge() -> None:
    """A PP=2 save through the hooks: stage 0's file records stage 0's layers, stage 1's its own."""
    stage0 = SavedRecord(
        "mp_rank_00 (stage 0)",
        _stage_record("1.word_embeddings.weight", "2.input_layernorm.weight"),
        ("1.word_embeddings.weight", "2.input_layernorm.weight"),
    )
    stage1 = SavedRecord(
        "mp_rank_01 (stage 1)",
        _stage_record("3.input_layernorm.weight", "5.lm_head.weight"),
        ("3.input_layernorm.weight", "5.lm_head.weight"),
    )
    merged = merge_layout_records([stage0, stage1])
    assert sorted(merged) == [
        "1.word_embeddings.weight",
        "2.input_layernorm.weight",
        "3.input_layernorm.weight",
        "5.lm_head.weight",
    ]
    layouts = resolve_layouts(sorted(merged), merged, MegatronPatterns(), "tag")
    assert layouts["3.input_layernorm.weight"].replicated and not layouts["5.lm_head.weight"].replicated
    assert merge_layout_records([SavedRecord("a", None, ("x",)), SavedRecord("b", None, ("y",))]) is None


def test_a_stage_without_the_record_of_its_own_parameter_is_named() -> None:
    stage0 = SavedRecord("mp_rank_00 (pipeline stage 0, TP rank 0)", _stage_record("1.w"), ("1.w",))
    stage1 = SavedRecord("mp_rank_01 (pipeline stage 1, TP rank 0)", _stage_record("3.w"), ("3.w", "4.weight"))
    with pytest.raises(PlanError, match=r"mp_rank_01 \(pipeline stage 1, TP rank 0\).*\['4.weight'\]"):
        merge_layout_records([stage0, stage1])
    with pytest.raises(PlanError, match="mp_rank_01.*no TP-layout record.*different saves"):
        merge_layout_records([stage0, SavedRecord("mp_rank_01", None, ("3.w",))])


def test_copies_of_one_parameter_must_agree_on_its_layout() -> None:
    """The TP ranks of a stage, and the stages holding a tied embedding, record one parameter each."""
    tied = "tied_modules.embed.word_embeddings.weight"
    first = SavedRecord("stage 0", _stage_record(tied), (tied,))
    assert merge_layout_records([first, SavedRecord("stage 1", _stage_record(tied), (tied,))]) == _stage_record(tied)
    with pytest.raises(PlanError, match="stage 1: records .* as split dim 1, but stage 0 records it as split dim 0"):
        merge_layout_records([first, SavedRecord("stage 1", _stage_record(tied, dim=1), (tied,))])


def _coordinates(tp: int, pp: int, dp: int, stage_params: list[list[tuple[str, tuple[int, ...], TpLayout]]]):
    coords, first = [], 0
    for p, t in itertools.product(range(pp), range(tp)):
        groups = [[ParamSpec(name, 0, slice_shape(shape, layout, tp, name)) for name, shape, layout in stage_params[p]]]
        ranks = synthesize_layouts(groups, dp)
        coords.append(
            CoordinateInput(
                pp=p, tp=t, param_groups=tuple(tuple(g) for g in groups), ranks=tuple(ranks), first_file=first
            )
        )
        first += dp
    return coords


def test_merged_plan_reads_every_slice_element_once_and_places_it_like_megatron() -> None:
    tp, pp, dp = 2, 2, 3
    stages = [
        [
            ("1.word_embeddings.weight", (16, 4), TpLayout(dim=0, vocab=True)),
            ("2.self_attention.dense.weight", (4, 8), TpLayout(dim=1)),
            ("2.mlp.dense_h_to_4h.weight", (8, 4), TpLayout(sub_params=2)),
            ("2.input_layernorm.weight", (4,), TpLayout(replicated=True)),
        ],
        [("3.self_attention.dense.weight", (4, 8), TpLayout(dim=1)), ("4.weight", (4,), TpLayout(replicated=True))],
    ]
    layouts = {name: layout for stage in stages for name, _, layout in stage}
    coords = _coordinates(tp, pp, dp, stages)
    plan = build_model_parallel_plan(coords, tp, pp, layouts, MegatronPatterns())
    assert plan.tp == 2 and plan.pp == 2 and plan.files == tp * pp * dp
    # Simulate the files: each coordinate's flat partitions hold its slices (values = whole offsets).
    wholes = {
        name: np.arange(math.prod(shape)) + 1000 * i
        for i, (name, shape, _) in enumerate(s for stage in stages for s in stage)
    }
    shapes = {name: shape for stage in stages for name, shape, _ in stage}
    files = {}
    for c in coords:
        part = plan.partition_size(0, c.first_file)
        flat = np.full(part * dp, -1)
        offset = 0
        for spec in c.param_groups[0]:
            piece = _slice_by_numpy(wholes[spec.name].reshape(shapes[spec.name]), layouts[spec.name], tp, c.tp)
            flat[offset : offset + piece.size] = piece.reshape(-1)
            offset += piece.size
        for r in range(dp):
            files[c.first_file + r] = flat[r * part : (r + 1) * part]
    for p in plan.params:
        out = np.full(p.numel, -7)
        for item in p.items:
            out[item.dst_offset : item.dst_offset + item.length] = files[item.rank][
                item.src_offset : item.src_offset + item.length
            ]
        assert np.array_equal(out, wholes[p.name]), p.name
        assert p.shape == shapes[p.name]
        assert len(p.replicas) == (tp - 1 if layouts[p.name].replicated else 0)
    assert plan.param("2.self_attention.dense.weight").cat_dim == 1
    assert plan.param("2.mlp.dense_h_to_4h.weight").n_sub_params == 2


def test_merged_plan_refuses_stages_that_disagree() -> None:
    stages = [[("a", (4, 4), TpLayout(dim=0))], [("b", (4, 4), TpLayout(dim=0))]]
    coords = _coordinates(2, 2, 1, stages)
    with pytest.raises(PlanError, match="no TP layout"):
        build_model_parallel_plan(coords, 2, 2, {"a": TpLayout()}, MegatronPatterns())
    with pytest.raises(PlanError, match="do not cover"):
        build_model_parallel_plan(coords[:3], 2, 2, {"a": TpLayout(), "b": TpLayout()}, MegatronPatterns())


def test_parallel_dimensions_from_deepspeed_or_megatron_records() -> None:
    from argparse import Namespace
    from pathlib import Path

    from megatron_ucp.deepspeed.reader import parallel_dimensions
    from megatron_ucp.errors import CheckpointFormatError

    f = Path("mp_rank_00_model_states.pt")
    assert parallel_dimensions({"checkpoint_parallel_dimensions": {"tp_degree": 2, "pp_degree": 2}}, f, 4) == (2, 2)
    older = {"args": Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)}  # DeepSpeed < 0.19
    assert parallel_dimensions(older, f, 2) == (1, 2)
    assert parallel_dimensions({}, f, 1) == (1, 1)
    with pytest.raises(CheckpointFormatError, match="neither"):
        parallel_dimensions({}, f, 2)
    with pytest.raises(CheckpointFormatError, match="holds 2 model-parallel"):
        parallel_dimensions({"checkpoint_parallel_dimensions": {"tp_degree": 2, "pp_degree": 2}}, f, 2)
