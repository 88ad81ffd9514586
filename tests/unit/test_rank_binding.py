"""Binding each old rank file to its DP position and to its save (plan/rank_binding.py): pure, no files.

The fragments the geometry puts at a position equal what DeepSpeed records (the synthetic writer's
``param_slice_mappings`` are held to real saves elsewhere); the cross-file verdict names the file
that differs, never its innocent neighbour; the weights-against-masters bracket accepts every
rounding of a master and nothing else.
"""

from __future__ import annotations

import math
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.resume.native.reshard import bracket_misses
from megatron_ucp.plan.geometry import GroupGeometry
from megatron_ucp.plan.rank_binding import (
    FileExpectation,
    FileFacts,
    WeightTally,
    blame_weights,
    cross_check,
    expected_fragments,
    file_problems,
    recorded_fragments,
)

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2)), ("d", (9,))]  # 35 elements


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 24))
def test_expected_fragments_tile_the_group_exactly_once(sizes: list[int], dp: int) -> None:
    shapes = [(f"p{i}", (n,)) for i, n in enumerate(sizes)]
    geo = GroupGeometry(numel=sum(sizes), dp=dp)
    covered = {name: 0 for name, _ in shapes}
    for rank in range(dp):
        frags = expected_fragments(shapes, geo, rank)
        assert sum(n for _, _, n in frags) == geo.true_length(rank)
        ends = [(start, start + n) for _, start, n in frags]
        assert ends == sorted(ends) and all(b <= c for (_, b), (c, _) in pairwise(ends))
        for name, _, n in frags:
            covered[name] += n
    assert covered == {name: math.prod(shape) for name, shape in shapes}


def test_expected_fragments_at_dp_768_are_empty_on_padding_only_ranks() -> None:
    geo = GroupGeometry(numel=65 * 4096, dp=768)  # AuroraGPT-7B's norm group
    assert expected_fragments([("norms", (65 * 4096,))], geo, 765) == (("norms", 0, 20),)
    assert expected_fragments([("norms", (65 * 4096,))], geo, 766) == ()


def _address(start: int, numel: int) -> SimpleNamespace:
    return SimpleNamespace(start=start, numel=numel)


def test_recorded_fragments_read_deepspeeds_addresses_and_refuse_anything_else() -> None:
    assert recorded_fragments({"b": _address(4, 3), "a": _address(0, 4)}) == (("a", 0, 4), ("b", 4, 3))
    assert recorded_fragments({"a": (0, 4)}) is None
    assert recorded_fragments(["a"]) is None


class _Raw:
    """Enough of a RawTensor for file_problems (numel, dim, dtype name, contiguity)."""

    def __init__(self, numel: int, dtype: str = "float32") -> None:
        self._numel, self.dtype, self.shape = numel, SimpleNamespace(name=dtype), (numel,)

    def numel(self) -> int:
        return self._numel

    def dim(self) -> int:
        return 1

    def is_contiguous(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _raw_is_rawtensor(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_ucp.plan.rank_binding as binding

    monkeypatch.setattr(binding, "RawTensor", _Raw)


def _optim(position: int, dp: int, geo: GroupGeometry, **changes) -> dict:
    frags = expected_fragments(SHAPES, geo, position)
    optim = {
        F.PARTITION_COUNT: [dp],
        F.SINGLE_PARTITION_OF_FP32_GROUPS: [_Raw(geo.partition_size)],
        F.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": _Raw(geo.partition_size), "step": 2.0}}},
        F.PARAM_SLICE_MAPPINGS: [{name: _address(start, n) for name, start, n in frags}],
    }
    optim.update(changes)
    return optim


def _expect(position: int, geo: GroupGeometry, save_id=None) -> FileExpectation:
    return FileExpectation(
        position=position,
        dp=geo.dp,
        partition_sizes=(geo.partition_size,),
        states=(("exp_avg",),),
        needs=(geo.true_length(position),),
        fragments=(expected_fragments(SHAPES, geo, position),),
        true_lengths=(geo.true_length(position),),
        save_id=save_id,
    )


def test_a_sound_file_at_its_position_has_no_problem_and_a_swapped_one_is_named() -> None:
    geo = GroupGeometry(numel=35, dp=4)  # S = 10
    for r in range(4):
        assert file_problems(f"f{r}", _optim(r, 4, geo), _expect(r, geo)) == []
    (problem,) = file_problems("f1", _optim(2, 4, geo), _expect(1, geo))
    assert problem.startswith("f1: holds param group 0's fragments") and "DP rank 1's partition" in problem


def test_wrong_dp_truncated_master_and_wrong_dtype_say_what_they_hold() -> None:
    geo = GroupGeometry(numel=35, dp=4)
    problems = file_problems(
        "f1",
        _optim(
            1,
            4,
            geo,
            **{
                F.PARTITION_COUNT: [8],
                F.SINGLE_PARTITION_OF_FP32_GROUPS: [_Raw(3)],
                F.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": _Raw(10, "bfloat16")}}},
            },
        ),
        _expect(1, geo),
    )
    assert problems[0] == "f1: saved at DP=8, the model states say DP=4 (a rank file of another save?)"
    assert "fp32 partition holds 3 float32 elements, its first 10" in problems[1]
    assert "'exp_avg' holds 10 bfloat16 elements, not the 10 float32 elements" in problems[2]


def test_an_expert_group_is_checked_against_its_own_partition_count() -> None:
    """A mixture-of-experts save: the expert group over expert-DP (2 of DP 4), its partition of 18 elements; a
    file whose counts are another layout's is named with both."""
    geo = GroupGeometry(numel=35, dp=2)  # S = 18
    exp = FileExpectation(
        position=3,
        dp=4,
        partition_sizes=(geo.partition_size,),
        states=(("exp_avg",),),
        needs=(geo.true_length(1),),
        fragments=(expected_fragments(SHAPES, geo, 1),),
        true_lengths=(geo.true_length(1),),
        partition_counts=(2,),
    )
    assert file_problems("f3", _optim(1, 2, geo), exp) == []  # DP rank 3 holds expert-DP partition 1
    (problem,) = file_problems("f3", _optim(1, 4, geo), exp)
    assert problem == (
        "f3: its groups' partition counts are [4], a save at DP=4 with these experts has [2] (a rank file of "
        "another save?)"
    )
    wrong = _optim(1, 2, geo, **{F.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": _Raw(10)}}}})
    assert "not the 18 float32 elements of an expert-DP=2 partition" in file_problems("f3", wrong, exp)[0]


def test_a_file_of_this_save_at_the_wrong_position_is_named_by_its_record() -> None:
    geo = GroupGeometry(numel=35, dp=4)
    record = {F.UCP_SAVE_RECORD: {"save_id": "S", "dp_rank": 2, "dp_size": 4}}
    problems = file_problems("f1", _optim(1, 4, geo, **record), _expect(1, geo, save_id="S"))
    assert problems == [
        "f1: its save record says DP rank 2 of 4, the folder puts it at rank 1 of 4: a rank file of another "
        "position (swapped, or copied over this one?)"
    ]


def _facts(position: int, save_id=None, step=2.0) -> FileFacts:
    return FileFacts(position, f"f{position}", (step, step), save_id)


def test_cross_check_names_the_file_of_another_save_not_the_model_states() -> None:
    files = [_facts(r, "S") for r in range(4)]
    assert cross_check("ms", "S", files) == []
    odd = files[:2] + [_facts(2, "T")] + files[3:]
    assert cross_check("ms", "S", odd) == [
        "f2: from another save (save T); the model states and 3 rank file(s) are of save S"
    ]
    stock = files[:3] + [_facts(3, None)]
    (problem,) = cross_check("ms", "S", stock)
    assert problem.startswith("f3: carries no megatron-ucp save record, but the model states and 3 rank file(s)")


def test_cross_check_names_the_model_states_when_every_file_disagrees_with_them() -> None:
    assert cross_check("ms", "OTHER", [_facts(r, "S") for r in range(4)]) == [
        "ms: from another save (save OTHER); 4 of the 4 rank files are of save S"
    ]
    (problem,) = cross_check("ms", None, [_facts(r, "S") for r in range(4)])
    assert problem.startswith("ms: carries no megatron-ucp save record, but 4 of the 4 rank files do")
    (problem,) = cross_check("ms", "S", [_facts(0, "T")])
    assert problem == "ms and f0: of different saves (S and T)"


def test_cross_check_blames_the_odd_step_even_on_rank_0_and_both_sides_of_a_tie() -> None:
    files = [_facts(0, step=4.0)] + [_facts(r) for r in range(1, 4)]
    problems = cross_check("ms", None, files)
    assert problems and all(p.startswith("f0: param group") for p in problems), problems
    assert "the other 3 rank file(s) say 2.0" in problems[0]
    tie = cross_check("ms", None, [_facts(0, step=4.0), _facts(1)])
    assert tie and "no majority" in tie[0] and "f0: 4.0" in tie[0] and "f1: 2.0" in tie[0]


def test_a_hooked_file_among_stock_files_is_named() -> None:
    (problem,) = cross_check("ms", None, [_facts(0), _facts(1, "S"), _facts(2), _facts(3)])
    assert problem.startswith("f1: carries a megatron-ucp save record (save S)")


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = x.view(torch.int32)
    low = (bits & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # exact: only the top half is set
    high = ((bits & ~0xFFFF) + 0x10000).view(torch.float32).to(torch.bfloat16)
    return low, high


def test_bracket_accepts_every_rounding_of_the_master_and_nothing_else() -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096)
    master[:4] = torch.tensor([0.0, -0.0, 1.0, -2.5])  # bf16 represents these exactly
    low, high = _bf16_neighbours(master)
    assert bracket_misses(master, master.to(torch.bfloat16)) == 0  # round to nearest (DeepSpeed's copy)
    assert bracket_misses(master, low) == 0  # truncation
    pick = torch.rand(4096, generator=g) < 0.5
    assert bracket_misses(master, torch.where(pick, low, high).where(master.view(torch.int32) & 0xFFFF != 0, low)) == 0
    exact_up = master.clone()[:4].to(torch.bfloat16).view(torch.int16) + 1  # one bf16 step off an exact master
    assert bracket_misses(master[:4], exact_up.view(torch.bfloat16)) == 4
    two_up = (high.view(torch.int16) + 1).view(torch.bfloat16)
    assert bracket_misses(master[4:], two_up[4:]) == 4092
    other = torch.randn(4096, generator=g)
    assert bracket_misses(master, other.to(torch.bfloat16)) > 4000
    assert bracket_misses(master, master) == 0 and bracket_misses(master, master + 1) > 0  # fp32 weights: exact


def test_blame_names_the_files_whose_ranges_miss_or_the_model_states_when_all_do() -> None:
    paths = {r: f"f{r}" for r in range(4)}
    one = blame_weights("ms", paths, WeightTally({0: 10, 1: 10, 2: 10}, {0: 0, 1: 7, 2: 0}))
    assert one == [
        "f1: 7 of the 10 saved bf16 weights its elements are compared with are not its fp32 masters rounded: "
        "a rank file of another save, or of another position?"
    ]
    every = blame_weights("ms", paths, WeightTally({0: 10, 1: 10, 2: 10, 3: 0}, {0: 9, 1: 10, 2: 10}))
    assert len(every) == 1 and every[0].startswith("ms: its bf16 weights are not the rounded fp32 masters")
    alone = blame_weights("ms", paths, WeightTally({0: 10}, {0: 3}))
    assert alone[0].startswith("f0: 3 of the 10") and alone[0].endswith("(or the model states)?")
    assert blame_weights("ms", paths, WeightTally({0: 10}, {0: 0})) == []


def test_cross_check_names_the_file_whose_per_partition_state_differs() -> None:
    mu = (("mu_product", ("tensor", "float32", 0.25)),)
    files = [FileFacts(r, f"f{r}", steps=(2.0,), save_id="s", scalars=(mu,)) for r in range(4)]
    files[2] = FileFacts(2, "f2", steps=(2.0,), save_id="s", scalars=((("mu_product", ("tensor", "float32", 0.5)),),))
    problems = cross_check("model", "s", files)
    assert len(problems) == 1 and problems[0].startswith("f2: param group 0's states of one value per partition is")
