"""What a mixture-of-experts save says about its experts (plan/experts.py): pure, from names and counts."""

from __future__ import annotations

from megatron_ucp.plan.experts import expert_facts

NAMES = [
    "mp_rank_00_model_states.pt",
    *(f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(8)),
    *(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)),
    *(f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)),  # 0.16 writes them ({'optimizer': None})
]


def test_the_expert_groups_and_files_give_the_expert_parallel_size() -> None:
    facts = expert_facts(NAMES, [8, 8, 2], dp=8)
    assert facts is not None and facts.layers == (0, 1) and facts.experts == 4
    assert facts.expert_groups == (2,) and facts.expert_dp == 2 and facts.ep == 4
    assert facts.describe() == (
        "mixture of experts (4 experts in each of 2 MoE layer(s); param group(s) 2 partitioned over "
        "expert-data-parallel size 2 at DP=8: EP=4)"
    )


def test_a_dense_save_has_no_experts_and_odd_counts_have_no_ep() -> None:
    assert expert_facts(NAMES[:9], [8, 8], dp=8) is None
    mixed = expert_facts(NAMES, [8, 3, 2], dp=8)  # two different partition counts: no one expert-DP size
    assert mixed is not None and mixed.expert_dp is None and mixed.ep is None and "EP unknown" in mixed.describe()
    uneven = expert_facts(NAMES, [8, 3], dp=8)
    assert uneven is not None and uneven.ep is None
