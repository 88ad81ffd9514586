"""What a mixture-of-experts save says about its experts (plan/experts.py): pure, from names and counts, and
each way its experts can fail to add up named before anything is copied."""

from __future__ import annotations

import pytest

from megatron_ucp.plan.experts import expert_facts


def names(layers=(0, 1), experts=4, mp=1, drop=()) -> list[str]:
    """A stage-1/2 MoE tag folder at DP 8 as DeepSpeed 0.16 lists it."""
    return [
        *(f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)),
        *(f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(8) for m in range(mp)),
        *(
            f"layer_{layer}_expert_{e}_mp_rank_{m:02d}_model_states.pt"
            for layer in layers
            for e in range(experts)
            for m in range(mp)
            if (layer, e, m) not in drop
        ),
        *(f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)),  # {'optimizer': None} under ZeRO
    ]


def test_the_expert_groups_and_files_give_the_expert_parallel_size() -> None:
    facts = expert_facts(names(), [8, 8, 2], dp=8, model_experts=[4, 4])
    assert facts is not None and facts.layers == (0, 1) and facts.experts == 4
    assert facts.expert_groups == (2,) and facts.expert_dp == 2 and facts.ep == 4
    assert facts.problems() == []
    assert facts.describe() == (
        "mixture of experts (4 experts in each of 2 MoE layer(s); param group(s) 2 partitioned over "
        "expert-data-parallel size 2 at DP=8: EP=4)"
    )
    assert expert_facts(names()[:9], [8, 8], dp=8) is None  # a dense save
    ep1 = expert_facts(names(), [8, 8], dp=8, model_experts=[4, 4])  # experts partitioned over DP: EP 1
    assert ep1 is not None and ep1.ep == 1 and ep1.problems() == []
    assert ep1.describe().endswith("partitioned over DP=8 with the dense groups: EP=1)")


@pytest.mark.parametrize(
    "case, counts, model, files, expected",
    [
        ("an expert file missing", [8, 2], 4, names(drop={(1, 3, 0)}), "layer_1_expert_3_mp_rank_00_model_states.pt"),
        ("one TP rank's expert file", [8, 2], 4, names(mp=2, drop={(0, 2, 1)}), "layer_0_expert_2_mp_rank_01"),
        ("the model records more experts", [8, 2], 6, names(), "layer_0_expert_4_mp_rank_00_model_states.pt"),
        ("the files hold more experts", [8, 2], 2, names(), "the files hold expert 3 but the model records 2"),
        ("EP does not divide the experts", [8, 1], 6, names(experts=6), "EP=8 does not divide the 6 experts"),
        ("expert-DP does not divide DP", [8, 3], 4, names(), "partitioned over 3 ranks, which does not divide DP=8"),
        ("two expert-DP sizes", [8, 2, 4], 4, names(), "partitioned over different sizes [2, 4]"),
    ],
)
def test_experts_that_do_not_add_up_are_named(case, counts, model, files, expected) -> None:
    mp = 2 if "TP rank" in case else 1
    facts = expert_facts(files, counts, dp=8, model_parallel=mp, model_experts=model)
    assert facts is not None
    found = facts.problems()
    assert found and any(expected in name or expected in problem for name, problem in found), found


def test_local_expert_names_become_global_and_each_expert_group_has_its_files() -> None:
    from megatron_ucp.errors import PlanError
    from megatron_ucp.plan.experts import expert_group_files, global_expert_name
    from megatron_ucp.plan.parallel_layout import ParallelLayout

    local = "language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.1.dense_4h_to_h.weight"
    assert global_expert_name(local, 1, 2) == local.replace("deepspeed_experts.1.", "deepspeed_experts.3.")
    with pytest.raises(PlanError, match="local expert 1 but a rank holds 1"):
        global_expert_name(local, 0, 1)
    with pytest.raises(PlanError, match="not an expert parameter"):
        global_expert_name("language_model.encoder.layers.1.mlp.deepspeed_moe.gate.wg.weight", 0, 2)
    assert expert_group_files(ParallelLayout(dp=4, ep=2)) == {0: [0, 2], 1: [1, 3]}
    assert expert_group_files(ParallelLayout(dp=8, ep=4)) == {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}
    assert expert_group_files(ParallelLayout(dp=4, ep=1)) == {0: [0, 1, 2, 3]}
