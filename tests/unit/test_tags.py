"""What a fallback loses, in words (plan/tags.py): a step difference only when both tags are here to say it."""

from __future__ import annotations

from megatron_ucp.plan.tags import iterations_lost


def test_iterations_lost_between_two_tags_by_their_steps():
    assert iterations_lost("global_step20", "global_step10") == "10 iterations"
    assert iterations_lost("final", "global_step10") == "the iterations between them"


def test_a_latest_that_names_no_tag_or_one_not_here_says_nothing_of_steps():
    assert iterations_lost(None, "global_step10") == "what was saved after global_step10, if anything"
    lost = iterations_lost("global_step99", "global_step2", latest_here=False)
    assert lost == "what was saved after global_step2, if anything: global_step99 is not here"
    assert "97" not in lost
