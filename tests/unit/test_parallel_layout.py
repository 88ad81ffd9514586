"""The parallel layout value and DeepSpeed's rank <-> file numbering it owns; the runtime surface's
pure parts (which entries may be replaced, the optimizer layouts' stages)."""

from __future__ import annotations

import pytest

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import PlanError
from megatron_ucp.plan.parallel_layout import ParallelLayout


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 4), (2, 1, 3), (1, 2, 2), (2, 2, 1), (4, 3, 5)])
def test_every_rank_has_one_file_and_the_numbering_is_deepspeeds(tp: int, pp: int, dp: int) -> None:
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    assert layout.model_parallel == tp * pp and layout.world == tp * pp * dp
    seen = set()
    for stage in range(pp):
        for t in range(tp):
            mp = layout.mp_rank(stage, t)
            assert mp == stage * tp + t  # DeepSpeed's mp_rank_XX: pipeline stage major
            assert layout.coordinates_of(mp) == (stage, t)
            for d in range(dp):
                seen.add(layout.rank_file_index(mp, d))
    assert seen == set(range(layout.world))  # model-parallel rank major, no gap, no overlap


def test_out_of_range_ranks_and_unsupported_axes_are_refused() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=3)
    for call in (lambda: layout.mp_rank(2, 0), lambda: layout.coordinates_of(4), lambda: layout.rank_file_index(0, 3)):
        with pytest.raises(PlanError, match="does not exist"):
            call()
    with pytest.raises(PlanError, match="DP size must be >= 1"):
        ParallelLayout(dp=0)
    with pytest.raises(PlanError, match="EP=3 does not divide DP=4"):
        ParallelLayout(dp=4, ep=3)
    with pytest.raises(PlanError, match="does not divide the 6 experts"):
        ParallelLayout(dp=4, ep=4).local_experts(6)
    with pytest.raises(PlanError, match="expert-parallel rank 2 does not exist"):
        ParallelLayout(dp=4, ep=2).expert_optimizer_file(2, 0)


@pytest.mark.parametrize("tp, pp, dp, ep", [(1, 1, 4, 2), (2, 1, 8, 4), (1, 2, 6, 3), (2, 2, 4, 1), (1, 1, 8, 8)])
def test_expert_parallelism_lives_inside_dp_as_deepspeed_moe_builds_it(tp: int, pp: int, dp: int, ep: int) -> None:
    """The E + D topology of DeepSpeed-MoE (``_get_expert_parallel_ranks``), written out independently for the
    ranks of one model-parallel rank: expert-parallel groups of EP consecutive DP ranks, expert-data-parallel
    groups of every EP-th DP rank; each expert held by exactly the DP / EP ranks of one expert-DP group."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    assert layout.world == tp * pp * dp and layout.expert_dp == dp // ep
    ep_groups = [list(range(g * ep, (g + 1) * ep)) for g in range(dp // ep)]
    edp_groups = [list(range(i, dp, ep)) for i in range(ep)]
    experts = 2 * ep
    holders: dict[int, list[int]] = {e: [] for e in range(experts)}
    for d in range(dp):
        (ep_group,) = [g for g in ep_groups if d in g]
        (edp_group,) = [g for g in edp_groups if d in g]
        assert layout.expert_parallel_rank(d) == ep_group.index(d)
        assert layout.expert_data_parallel_rank(d) == edp_group.index(d)
        for e in layout.experts_of(d, experts):
            holders[e].append(d)
    for e, ranks in holders.items():
        assert ranks in edp_groups and len(ranks) == layout.expert_dp  # one expert-DP group per expert
    assert layout.expert_file(1, experts - 1, layout.model_parallel - 1) == (
        f"layer_1_expert_{experts - 1}_mp_rank_{layout.model_parallel - 1:02d}_model_states.pt"
    )
    assert layout.expert_optimizer_file(ep - 1, 0) == f"expp_rank_{ep - 1}_mp_rank_00_optim_states.pt"


def test_logs_name_what_changed() -> None:
    assert ParallelLayout(dp=768).describe_change(ParallelLayout(dp=512)) == "DP changed 768 -> 512"
    assert (
        ParallelLayout(tp=1, dp=4).describe_change(ParallelLayout(tp=2, dp=2)) == "TP changed 1 -> 2, DP changed 4 -> 2"
    )
    assert (
        ParallelLayout(tp=2, dp=2).describe_change(ParallelLayout(tp=2, dp=2)) == "layout unchanged (TP=2, PP=1, DP=2)"
    )
    assert ParallelLayout(dp=4).describe() == "DP=4" and ParallelLayout(2, 2, 1).describe() == "TP=2 x PP=2 x DP=1"
    assert ParallelLayout(2, 1, 4).with_dp(3) == ParallelLayout(2, 1, 3)
    assert ParallelLayout(dp=4, ep=2).describe() == "DP=4 (EP=2)"
    assert ParallelLayout(dp=4, ep=2).describe_change(ParallelLayout(dp=4, ep=4)) == "EP changed 2 -> 4"


def test_only_entries_the_surface_marks_replaced_can_be_replaced() -> None:
    patches = surface.PatchSet()
    with pytest.raises(KeyError, match="called, not replaced"):
        surface.replace(patches, surface.ENGINE, "train_batch_size", lambda original: original)
    with pytest.raises(KeyError, match="add it there first"):
        surface.replace(patches, surface.ENGINE, "step", lambda original: original)
    assert len(patches) == 0


def test_each_optimizer_class_has_one_layout_with_its_stages() -> None:
    assert surface.layout_named("BF16_Optimizer").stages == (1,)
    assert surface.layout_named("DeepSpeedZeroOptimizer").stages == (1, 2)
    stage3 = surface.layout_named("DeepSpeedZeroOptimizer_Stage3")
    assert stage3.stages == (3,) and stage3.per_parameter
    assert not any(layout.per_parameter for layout in surface.OPTIMIZER_LAYOUTS if layout is not stage3)
    assert surface.ELASTIC_STAGES == (1, 2, 3)
    names = [(e.owner, e.name) for e in surface.SURFACE]
    assert len(names) == len(set(names)), "one entry per internal"


def test_an_optimizer_missing_an_attribute_its_layout_names_is_refused_naming_all() -> None:
    from megatron_ucp.errors import UnsupportedError

    class BF16_Optimizer:  # the class name is what selects the layout
        bf16_groups = bf16_groups_flat = fp32_groups_flat_partition = []
        dp_process_group = real_dp_process_group = param_names = optimizer = None

    with pytest.raises(UnsupportedError, match=r"'bf16_partitioned_groups', 'nccl_start_alignment_factor'"):
        surface.layout_of(BF16_Optimizer())
    BF16_Optimizer.bf16_partitioned_groups = []
    BF16_Optimizer.nccl_start_alignment_factor = 2
    assert surface.layout_of(BF16_Optimizer()) is surface.layout_named("BF16_Optimizer")
    assert surface.alignment_factor(BF16_Optimizer()) == 2


def test_the_stage3_layout_names_its_own_attributes_not_the_flat_classes() -> None:
    """ZeRO-3 keeps no flat-buffer alignment nor per-group DP groups: its check asks for what its hooks read."""
    from megatron_ucp.errors import UnsupportedError

    class DeepSpeedZeroOptimizer_Stage3:
        fp16_groups = fp16_partitioned_groups_flat = fp16_partitioned_groups = fp32_partitioned_groups_flat = []
        dp_process_group = optimizer = unflatten = loss_scaler = dynamic_loss_scale = overflow = None

    with pytest.raises(UnsupportedError, match=r"'sub_group_to_group_id', 'swap_optimizer'"):
        surface.layout_of(DeepSpeedZeroOptimizer_Stage3())
    DeepSpeedZeroOptimizer_Stage3.sub_group_to_group_id = {}
    DeepSpeedZeroOptimizer_Stage3.swap_optimizer = False
    layout = surface.layout_of(DeepSpeedZeroOptimizer_Stage3())
    assert layout is surface.layout_named("DeepSpeedZeroOptimizer_Stage3")
    assert "nccl_start_alignment_factor" not in layout.required()
