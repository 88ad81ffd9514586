"""The relaunch after a node failure, decided (plan/relaunch.py): pure.

A launch that fails with nodes down goes on on the others, at most as many times as allowed and while enough nodes
are left; one that fails with every node up is not repeated.
"""

from __future__ import annotations

from megatron_ucp.plan.relaunch import after_failure, before_first, hosts_of, last_loop, lines_for, loop_summary

HOSTS = ["x1000c0s0b0n0", "x1000c0s0b1n0", "x1000c0s1b0n0", "x1000c0s1b1n0"]


def test_a_host_file_lists_each_node_once_in_order() -> None:
    lines = ["# nodes", "b slots=12", "a", "", "b", "a  # again", "c"]
    assert hosts_of(lines) == ["b", "a", "c"]
    assert lines_for(lines, ["b", "c"]) == ["b slots=12", "b", "c"]  # the survivors' lines, in their own form


def test_the_nodes_down_are_dropped_and_the_launch_repeated_on_the_rest() -> None:
    nxt = after_failure(HOSTS, [HOSTS[2]], 1, restarts_done=0, max_restarts=3)
    assert nxt.hosts == (HOSTS[0], HOSTS[1], HOSTS[3])
    assert nxt.why == f"1 of 4 node(s) down ({HOSTS[2]}): relaunching on the 3 left (relaunch 1 of 3)"


def test_a_failure_with_every_node_up_is_not_repeated_and_keeps_its_exit_code() -> None:
    nxt = after_failure(HOSTS, [], 7, restarts_done=0, max_restarts=3)
    assert nxt.hosts is None and nxt.code == 7 and "not a node failure" in nxt.why
    assert after_failure(HOSTS, ["elsewhere"], 7, 0, 3).hosts is None  # a host not in this launch is not its loss


def test_the_loop_stops_after_its_relaunches_or_below_its_node_floor() -> None:
    assert after_failure(HOSTS, [HOSTS[0]], 1, restarts_done=3, max_restarts=3).hosts is None
    assert "already made" in after_failure(HOSTS, [HOSTS[0]], 1, 3, 3).why
    stop = after_failure(HOSTS, HOSTS[:3], 1, 0, 3, min_nodes=2)
    assert stop.hosts is None and "1 left, fewer than the 2 needed" in stop.why
    everyone = after_failure(HOSTS, HOSTS, 1, 0, 3)  # every node at once: the probe, not the nodes
    assert everyone.hosts is None and "more likely the probe than the nodes" in everyone.why


def test_status_shows_the_newest_loop_that_relaunched() -> None:
    once = [{"loop": 1.0, "launch": 1, "hosts": HOSTS, "at": 1}, {"loop": 1.0, "launch": 1, "hosts": HOSTS, "exit": 0}]
    loop = [
        {"loop": 2.0, "launch": 1, "hosts": HOSTS, "at": 2},
        {"loop": 2.0, "launch": 1, "hosts": HOSTS, "exit": 1, "down": [HOSTS[2]]},
        {"loop": 2.0, "launch": 2, "hosts": HOSTS[:2] + HOSTS[3:], "at": 3},
    ]
    merged = last_loop(once + loop)
    assert [r["launch"] for r in merged] == [1, 2] and merged[0]["down"] == [HOSTS[2]]
    assert last_loop(loop + [{**r, "loop": 3.0} for r in once]) == ()  # the newest loop launched once
    assert loop_summary(merged) == (
        f"launch 1 on 4 node(s) exit 1, down: {HOSTS[2]}; launch 2 on 3 node(s) running, or its loop was killed"
    )
    assert loop_summary([{"launch": 2, "hosts": HOSTS, "exit": 0}]) == "launch 2 on 4 node(s) ended well"


def test_nodes_down_before_the_first_launch_are_left_out_when_enough_are_left() -> None:
    assert before_first(HOSTS, [HOSTS[1]], False).hosts == (HOSTS[0], HOSTS[2], HOSTS[3])
    assert before_first(HOSTS, [], False) == before_first(HOSTS, [], False, 4)
    assert before_first(HOSTS, [], False).hosts == tuple(HOSTS) and before_first(HOSTS, [], False).why == ""
    kept = before_first(HOSTS, HOSTS[:2], False, min_nodes=3)
    assert kept.hosts == tuple(HOSTS) and "too few left" in kept.why
    assert before_first(HOSTS, HOSTS, False).hosts is None  # every node: the probe
    assert before_first(HOSTS, [HOSTS[0]], True).hosts is None  # a probe that cannot run
