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
    with pytest.raises(PlanError, match="expert-parallel"):
        ParallelLayout(ep=2)


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
