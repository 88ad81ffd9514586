"""What load_checkpoint does when the DP size may have changed: pure decisions, no DeepSpeed."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import UcpError
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.resume import (
    ResumeDecision,
    Route,
    TwinState,
    check_global_batch,
    checkpoint_global_batch,
    decide_resume,
    restored_global_samples,
    schedule_difference,
)


def decide(checkpoint_dp=768, current_dp=512, checkpoint_mp=(1, 1), current_mp=(1, 1), **overrides) -> ResumeDecision:
    """The decision for a save at (TP, PP) ``checkpoint_mp`` x ``checkpoint_dp`` (None: no recorded DP)
    resumed at ``current_mp`` x ``current_dp``."""
    args = dict(
        requested_tag="global_step95600",
        load_universal=False,
        twin_state=TwinState.ABSENT,
        resume_route="universal",
        saved=None if checkpoint_dp is None else ParallelLayout(*checkpoint_mp, dp=checkpoint_dp),
        live=ParallelLayout(*current_mp, dp=current_dp),
    )
    args.update(overrides)
    return decide_resume(**args)


def test_same_dp_is_the_untouched_native_load():
    d = decide(current_dp=768)
    assert d.route is Route.NATIVE and d.tag == "global_step95600" and not d.universal and not d.dp_changed


def test_dp_change_with_complete_twin_loads_it():
    d = decide(twin_state="complete")
    assert d.route is Route.UNIVERSAL_EXISTING and d.tag == "global_step95600_universal"
    assert d.message == "DP changed 768 -> 512: loading global_step95600_universal"
    assert d.universal and not d.convert and d.dp_changed and d.warning is None


def test_dp_change_without_twin_converts_first():
    d = decide()
    assert d.route is Route.CONVERT_THEN_UNIVERSAL and d.convert and d.tag == "global_step95600_universal"
    assert "DP changed 768 -> 512" in d.message and "converting global_step95600" in d.message
    assert "staging" in decide(staging_present=True).message


def test_foreign_twin_is_loaded_with_a_warning():
    d = decide(twin_state=TwinState.FOREIGN)
    assert d.route is Route.UNIVERSAL_EXISTING and d.warning and "manifest" in d.warning


def test_explicit_flag_wins_at_any_dp():
    for dp in (512, 768):
        d = decide(load_universal=True, requested_tag=None, checkpoint_dp=None, current_dp=dp)
        assert d.route is Route.EXPLICIT_UNIVERSAL and d.tag is None and "latest_universal" in d.message


def test_universal_tag_given_directly_loads_in_universal_mode_even_at_same_dp():
    d = decide(requested_tag="global_step5_universal", current_dp=768, tag_is_universal=True)
    assert d.route is Route.EXPLICIT_UNIVERSAL and d.tag == "global_step5_universal"


def test_nothing_to_read_leaves_deepspeed_to_complain():
    assert decide(requested_tag=None, checkpoint_dp=None).route is Route.NATIVE
    assert decide(checkpoint_dp=None).route is Route.NATIVE


def test_no_optimizer_states_needs_no_resharding():
    d = decide(loads_optimizer_states=False)
    assert d.route is Route.NATIVE and "no optimizer states" in d.message


def test_scale_up_is_symmetric():
    d = decide(checkpoint_dp=2, current_dp=4, twin_state="complete", requested_tag="global_step4")
    assert d.message == "DP changed 2 -> 4: loading global_step4_universal"


def test_dp_only_change_reshards_the_native_files_by_default():
    for twin in TwinState:  # a twin on disk changes nothing: the native files are read once, nothing converted
        d = decide(resume_route="auto", twin_state=twin)
        assert d.route is Route.RESHARD and d.tag == "global_step95600" and not d.universal and not d.convert
        assert d.message == (
            "DP changed 768 -> 512: resharding global_step95600 from its native rank files "
            "(resume route auto), no conversion"
        )
    assert (
        decide_resume(
            requested_tag="t", saved=ParallelLayout(dp=4), live=ParallelLayout(dp=3), load_universal=False
        ).route
        is Route.RESHARD
    )
    explicit = decide(resume_route="reshard", checkpoint_mp=(2, 1), current_mp=(2, 1))
    assert explicit.route is Route.RESHARD and "(resume route" not in explicit.message


def test_tp_or_pp_change_still_goes_through_the_universal_folder():
    for route in ("auto", "reshard"):
        d = decide(resume_route=route, checkpoint_mp=(1, 1), current_mp=(2, 1), current_dp=768)
        assert d.route is Route.CONVERT_THEN_UNIVERSAL and d.tag == "global_step95600_universal"
        assert ("universal folder" in d.message) == (route == "reshard"), d.message
    # the explicit flag, a universal tag, or no optimizer states: as before, whatever the route
    assert decide(resume_route="reshard", load_universal=True).route is Route.EXPLICIT_UNIVERSAL
    assert decide(resume_route="reshard", loads_optimizer_states=False).route is Route.NATIVE
    assert decide(resume_route="reshard", universal_of_latest=True).route is Route.CONVERT_THEN_UNIVERSAL


def test_a_model_class_change_goes_through_the_universal_folder():
    """GPTModelPipe saved, GPTModel resumed: the native partitions cannot be matched by name."""
    for route in ("auto", "reshard"):
        d = decide(resume_route=route, names_match=False, twin_state="complete")
        assert d.route is Route.UNIVERSAL_EXISTING and d.tag == "global_step95600_universal"
        assert "saved parameter names are not the model's" in d.message, d.message
    assert "names" not in decide(resume_route="universal", names_match=False).message
    same_dp = decide(checkpoint_dp=512, names_match=False)  # same layout: DeepSpeed's own load, as before
    assert same_dp.route is Route.NATIVE


def test_a_zero_stage_change_goes_through_the_universal_folder():
    """ZeRO-1/2 saved, ZeRO-3 resumed (or the other way): flat partitions and per-parameter ones only meet
    in the universal folder, at the same DP size too, whatever the route."""
    for route in ("auto", "reshard"):
        same = decide(resume_route=route, current_dp=768, stage_change="1/2 -> 3")
        assert same.route is Route.CONVERT_THEN_UNIVERSAL and same.tag == "global_step95600_universal"
        assert same.message.startswith("ZeRO stage changed 1/2 -> 3"), same.message
        assert "no global_step95600_universal yet, converting global_step95600 now" in same.message
        assert ("stage change goes through the universal folder" in same.message) == (route == "reshard")
    moved = decide(resume_route="auto", stage_change="3 -> 1/2", twin_state="complete")
    assert moved.route is Route.UNIVERSAL_EXISTING
    assert moved.message == "ZeRO stage changed 3 -> 1/2, DP changed 768 -> 512: loading global_step95600_universal"


def test_zero3_sub_groups_cut_otherwise_at_the_same_dp_are_resharded():
    d = decide(resume_route="auto", current_dp=768, regrouped=True)
    assert d.route is Route.RESHARD and "other sub-groups" in d.message, d.message
    assert decide(resume_route="auto", current_dp=768).route is Route.NATIVE


def test_bad_inputs():
    with pytest.raises(UcpError, match="resume route"):
        decide(resume_route="fast")
    with pytest.raises(UcpError):
        decide(current_dp=0)
    with pytest.raises(ValueError):
        decide(twin_state="half-done")


def test_decision_is_frozen():
    d = decide()
    with pytest.raises(Exception):
        d.route = Route.NATIVE  # type: ignore[misc]


def test_checkpoint_global_batch():
    assert checkpoint_global_batch({"train_batch_size": 3072}, 768) == 3072
    assert checkpoint_global_batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8) == 64
    assert checkpoint_global_batch({"train_micro_batch_size_per_gpu": 4}, 8) == 32
    assert checkpoint_global_batch({}, 8) is None
    assert checkpoint_global_batch(None, 8) is None


def test_global_batch_warning_names_both_numbers():
    assert check_global_batch(3072, 3072, 768, 512) is None
    assert check_global_batch(None, 2048, 768, 512) is None
    text = check_global_batch(3072, 2048, 768, 512)
    assert "3072" in text and "2048" in text and "DP=768" in text and "DP=512" in text


def test_global_samples_fallback_uses_the_checkpoint_batch():
    assert restored_global_samples({"global_steps": 10, "global_samples": 123}, 12, 8) == 123
    assert restored_global_samples({"global_steps": 10}, 12, 8) == 120
    assert restored_global_samples({"global_steps": 10}, None, 8) == 80
    assert restored_global_samples({}, 12, 8) is None


def test_flag_with_latest_followed_loads_the_twin_of_latest_even_at_the_same_layout():
    """--universal-checkpoint whose latest_universal lags `latest`: the twin of latest's tag, converted when needed."""
    d = decide(current_dp=768, universal_of_latest=True)
    assert d.route is Route.CONVERT_THEN_UNIVERSAL and d.tag == "global_step95600_universal"
    assert d.message.startswith("load_universal is set (layout unchanged")
    d = decide(current_dp=768, universal_of_latest=True, twin_state=TwinState.COMPLETE, loads_optimizer_states=False)
    assert d.route is Route.UNIVERSAL_EXISTING and d.tag == "global_step95600_universal"
    assert decide(universal_of_latest=True).message.startswith("DP changed 768 -> 512")


def test_latest_universal_that_does_not_name_the_twin_of_latest_is_reported(tmp_path):
    from megatron_ucp.format.paths import lagging_universal_pointer

    assert lagging_universal_pointer(tmp_path) is None  # no latest
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "latest").write_text("global_step4")
    assert lagging_universal_pointer(tmp_path) == ("global_step4", None)
    (tmp_path / "latest_universal").write_text("global_step6_universal")  # newer than the tag the user chose
    assert lagging_universal_pointer(tmp_path) == ("global_step4", "global_step6_universal")
    (tmp_path / "latest_universal").write_text("global_step4_universal")
    assert lagging_universal_pointer(tmp_path) == ("global_step4", "global_step4_universal")  # twin deleted
    (tmp_path / "global_step4_universal").mkdir()
    assert lagging_universal_pointer(tmp_path) is None
    (tmp_path / "latest").write_text("global_step6_universal")  # latest names a universal folder itself
    (tmp_path / "global_step6_universal" / "zero").mkdir(parents=True)
    (tmp_path / "global_step6_universal" / "zero" / "optimizer_state.pt").write_bytes(b"x")
    assert lagging_universal_pointer(tmp_path) is None


@pytest.mark.parametrize(
    "saved, live, route, said",
    [
        (
            (768, 8),
            (512, 8),
            Route.RESHARD,
            "DP changed 768 -> 512: resharding global_step95600 from its native rank files, EP=8 kept: each "
            "expert-parallel rank's experts over expert-DP 96 -> 64 (resume route auto), no conversion",
        ),
        ((768, 8), (768, 16), Route.CONVERT_THEN_UNIVERSAL, "EP changed 8 -> 16 (mixture of experts: experts move"),
        ((768, 8), (512, 4), Route.CONVERT_THEN_UNIVERSAL, "DP changed 768 -> 512, EP changed 8 -> 4 (mixture"),
        ((768, 8), (768, 8), Route.NATIVE, "DP unchanged (768): native load"),
    ],
)
def test_a_mixture_of_experts_save_reshards_a_dp_change_and_converts_an_ep_change(saved, live, route, said):
    """A DP change at the same EP reshards from the native files (each expert-parallel rank's buffer over its
    expert-DP ranks); an EP change moves experts between ranks: the universal folder, whatever the resume route
    asks; same DP and EP: the native load."""
    d = decide(
        saved=ParallelLayout(dp=saved[0], ep=saved[1]), live=ParallelLayout(dp=live[0], ep=live[1]), resume_route="auto"
    )
    assert d.route is route and said in d.message, d.message
    no_states = decide(
        saved=ParallelLayout(dp=768, ep=8), live=ParallelLayout(dp=768, ep=16), loads_optimizer_states=False
    )
    assert (
        no_states.route is Route.NATIVE and "EP changed 8 -> 16 but no optimizer states are loaded" in no_states.message
    )


def test_a_schedule_that_differs_is_told_apart_from_a_schedule_not_restored():
    """A learning-rate schedule whose settings differ (another --train-iters) is the command line's doing; one whose
    progress differs is the load's."""
    saved = {"max_lr": 1e-3, "num_steps": 72, "decay_steps": 144, "decay_style": "cosine"}
    progress, settings = schedule_difference({**saved, "decay_steps": 240}, saved)
    assert progress == [] and settings == ["decay_steps 240 (this run) vs 144 (the checkpoint)"]
    progress, settings = schedule_difference({**saved, "num_steps": 0}, saved)
    assert progress == ["num_steps 0 (this run) vs 72 (the checkpoint)"] and settings == []
    assert schedule_difference(saved, dict(saved)) == ([], [])
