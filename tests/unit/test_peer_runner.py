"""The peer-suite runner's judgement (tests/peer/run_peer.py): what counts as a difference from stock, which are
intended and in which modes, how pytest's last line is read. The runs themselves are ``make peer``."""

from __future__ import annotations

from tests.peer.run_peer import Outcome, _outcome, differences, intended, table

NODE = "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::"


def test_only_outcomes_that_differ_from_stocks_are_differences():
    results = [
        Outcome(NODE + "test_a[1]", "stock", "passed", 1.0),
        Outcome(NODE + "test_a[1]", "hooks", "passed", 1.0),
        Outcome(NODE + "test_a[1]", "async", "failed", 1.0, "E   FileNotFoundError"),
        Outcome(NODE + "test_b", "hooks", "hang", 300.0),  # no stock outcome: nothing to compare with
    ]
    found = differences(results)
    assert [(node, mode, stock.outcome, r.outcome) for node, mode, stock, r in found] == [
        (NODE + "test_a[1]", "async", "passed", "failed")
    ]
    assert "| TestZeROCheckpoint::test_a[1] | passed | passed | failed |" in table(results, ["stock", "hooks", "async"])


def test_an_intended_difference_is_intended_only_in_its_modes_and_outcomes():
    change_dp = NODE.replace("TestZeROCheckpoint", "TestZeROElasticCheckpoint") + (
        "test_elastic_checkpoint_change_dp[True-False-False]"
    )
    assert intended(change_dp, "hooks", "failed") and intended(change_dp, "async", "hang")
    assert intended(change_dp, "hooks", "error") is None  # another outcome of that test is a difference
    assert intended(change_dp, "stock") is None
    assert intended(NODE + "test_elastic_checkpoint_change_dp[False-False-False]", "hooks") is None
    # the tests that read a save's files themselves are not excused: they run with a wait after each save
    shared = "unit/checkpoint/test_shared_weights.py::TestCheckpointSharedWeights::test_checkpoint_shared_weights"
    assert intended(shared, "async") is None


def test_pytests_last_line_decides_the_outcome():
    assert _outcome("...\n1 failed, 2 passed in 3.0s", 1) == "failed"
    assert _outcome("...\n1 passed in 3.0s", 0) == "passed"
    assert _outcome("...\n1 skipped in 0.1s", 0) == "skipped"
    assert _outcome("", 1) == "failed"
