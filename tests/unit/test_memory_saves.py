"""Memory saves across nodes, planned (plan/memory_saves.py): pure, no files.

Each node's files and their replica on the next node of the ring: a restart on the survivors resumes from the newest
committed generation exactly when no node lost both its copy and its replica, says which nodes' copies are gone
otherwise, and plans each missing file once per new node, from a holder.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.plan import memory_saves
from megatron_ucp.plan.memory_saves import (
    Holding,
    generations_to_drop,
    partner,
    replica_of,
    transfers,
)

ROOT = "the-root's-identity"


def choose(holdings: list[Holding], durable_step: int | None = None, origin: str | None = ROOT):
    """The plan's choice for the root these holdings were saved for."""
    return memory_saves.choose(holdings, durable_step, origin)


def _files(node: int, ranks_per_node: int = 2) -> frozenset[str]:
    return frozenset(f"bf16_zero_pp_rank_{node * ranks_per_node + r}_mp_rank_00_optim_states.pt" for r in range(2))


def _holdings(nodes: int, survivors: set[int], step: int, committed: bool = True) -> list[Holding]:
    """What the survivors hold of one generation: each its own files and its ring predecessor's replica."""
    out = []
    for n in sorted(survivors):
        out.append(Holding(f"host{n}", step, n, nodes, _files(n), committed=committed, origin=ROOT))
        if nodes > 1:
            before = replica_of(n, nodes)
            out.append(
                Holding(f"host{n}", step, before, nodes, _files(before), replica=True, committed=committed, origin=ROOT)
            )
    return out


def test_the_ring_pairs_every_node_with_one_partner_and_one_replica() -> None:
    for nodes in range(2, 9):
        assert sorted(partner(n, nodes) for n in range(nodes)) == list(range(nodes))
        assert all(replica_of(partner(n, nodes), nodes) == n for n in range(nodes))
    assert partner(0, 1) is None and replica_of(0, 1) is None
    with pytest.raises(ValueError):
        partner(3, 3)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.data())
def test_a_generation_is_whole_exactly_when_no_node_lost_its_copy_and_its_replica(nodes: int, data) -> None:
    lost = data.draw(st.sets(st.integers(0, nodes - 1), max_size=nodes - 1))
    survivors = set(range(nodes)) - lost
    choice = choose(_holdings(nodes, survivors, step=13), durable_step=10)
    whole = all(n in survivors or partner(n, nodes) in survivors for n in range(nodes))
    assert (choice.step == 13) == whole, (lost, choice)
    if whole:
        assert set(choice.sources) == {f for n in range(nodes) for f in _files(n)}
        for name, holders in choice.sources.items():
            assert holders and set(holders) <= {f"host{s}" for s in survivors}
    else:
        gone = [n for n in range(nodes) if n in lost and partner(n, nodes) in lost]
        assert any(f"node {gone[0]} " in why for why in choice.passed_over), choice.passed_over


def test_the_own_copy_is_listed_before_the_replica() -> None:
    choice = choose(_holdings(4, {0, 1, 2, 3}, step=13))
    assert choice.sources[next(iter(_files(1)))] == ("host1", "host2")


def test_the_newest_committed_generation_newer_than_the_durable_save_is_taken() -> None:
    held = _holdings(4, {0, 1, 3}, step=12) + _holdings(4, {0, 1, 3}, step=13, committed=False)
    choice = choose(held, durable_step=10)
    assert choice.step == 12
    assert choice.passed_over == ("iteration 13: not committed (the job stopped while saving it)",)
    assert choose(held, durable_step=12).step is None  # nothing newer than the durable save


def test_a_generation_held_as_two_jobs_saved_it_is_passed_over() -> None:
    held = _holdings(4, {0, 1, 2, 3}, step=13) + [Holding("host9", 13, 0, 2, _files(0), committed=True, origin=ROOT)]
    choice = choose(held)
    assert choice.step is None and "2, 4" in choice.passed_over[0]


def test_two_adjacent_nodes_lost_leave_the_durable_save_and_say_which_node() -> None:
    choice = choose(_holdings(4, {0, 3}, step=13), durable_step=10)
    assert choice.step is None
    assert choice.passed_over == (
        "iteration 13: no survivor holds the files of node 1 (its copy and its replica on node 2)",
    )


def test_each_missing_file_is_sent_once_per_node_from_a_holder_spreading_the_sends() -> None:
    choice = choose(_holdings(4, {0, 1, 2}, step=13))  # node 3's files: only host0's replica
    every = sorted(choice.sources)
    needs = {"host0": every, "host1": every, "host2": every}
    plan = transfers(needs, choice.sources)
    for dest, wanted in needs.items():
        got = {t.name for t in plan if t.destination == dest}
        assert got == {n for n in wanted if dest not in choice.sources[n]}
        assert all(t.source in choice.sources[t.name] and t.source != t.destination for t in plan)
    assert len({(t.name, t.destination) for t in plan}) == len(plan)
    sends = {h: sum(t.source == h for t in plan) for h in ("host0", "host1", "host2")}
    assert max(sends.values()) - min(sends.values()) <= 4, sends
    with pytest.raises(KeyError, match="no survivor holds it"):
        transfers({"host0": ["nowhere.pt"]}, choice.sources)


def test_a_node_keeps_the_newest_committed_generation_and_the_one_being_written() -> None:
    assert generations_to_drop([10, 11, 12], 12) == [10, 11]
    assert generations_to_drop([12], 12) == []


def test_a_damaged_copy_gives_way_to_its_replica_and_both_damaged_pass_the_generation_over() -> None:
    held = _holdings(4, {0, 1, 2, 3}, step=13)
    name = sorted(_files(0))[0]
    own = [h for h in held if h.node == 0 and not h.replica][0]
    damaged = [replace(h, damaged=frozenset({name}) if h is own else frozenset()) for h in held]
    choice = choose(damaged, durable_step=10)
    assert choice.step == 13 and choice.sources[name] == ("host1",)  # the replica alone
    both = [replace(h, damaged=frozenset({name}) if h.node == 0 else frozenset()) for h in held]
    choice = choose(both + _holdings(4, {0, 1, 2, 3}, step=12), durable_step=10)
    assert choice.step == 12
    assert choice.passed_over == (f"iteration 13: every copy of {name} is damaged (on host0, host1)",)


def test_only_the_roots_own_generations_are_taken_and_one_save_per_generation() -> None:
    held = _holdings(4, {0, 1, 2, 3}, step=12) + _holdings(4, {0, 1, 2, 3}, step=13)
    other = [
        Holding(h.holder, h.step + 1, h.node, h.nodes, h.files, h.replica, h.committed, origin="another") for h in held
    ]
    choice = choose(held + other, durable_step=10)  # a newer generation of another root (a shared local dir)
    assert choice.step == 13
    assert choice.passed_over == ("iteration 14: saved for another checkpoint root (or an earlier run of this one)",)
    assert choose(held, durable_step=10, origin=None).step is None  # a root with no identity has no memory saves
    two = [
        Holding(
            h.holder,
            h.step,
            h.node,
            h.nodes,
            h.files,
            h.replica,
            h.committed,
            origin=ROOT,
            save_id="a" if h.holder == "host0" else "b",
        )
        for h in _holdings(4, {0, 1, 2, 3}, step=13)
    ]
    choice = choose(two + _holdings(4, {0, 1, 2, 3}, step=12), durable_step=10)  # each save judged on its own
    assert choice.step == 13 and choice.save_id == "b", choice  # host1-3 hold every node's files of save b
    assert choice.passed_over == (
        "iteration 13: no survivor holds the files of node 1 (its copy and its replica on node 2), node 2 (its copy "
        "and its replica on node 3) (one of the saves held at that iteration)",
    )
    assert {h for hs in choice.sources.values() for h in hs} == {"host1", "host2", "host3"}
    stale = [
        Holding("host9", 13, 0, 4, _files(0), committed=False, origin=ROOT, save_id="old")
    ]  # a node back from an earlier run of the root, holding another save of the same iteration
    choice = choose(_holdings(4, {0, 1, 2, 3}, step=13) + stale, durable_step=10)
    assert (
        choice.step == 13 and choice.save_id == "" and "host9" not in {h for hs in choice.sources.values() for h in hs}
    )


def test_a_file_every_node_needs_is_spread_in_doubling_rounds_and_the_rest_in_the_first() -> None:
    nodes = [f"new{i}" for i in range(10)]
    sources = {"model_states": ("new0", "new1"), "rank_3": ("new5",), "rank_4": ("new9",)}
    needs = {n: ["model_states"] + (["rank_3", "rank_4"] if n == "new2" else []) for n in nodes}
    rounds = memory_saves.transfer_rounds(needs, sources)
    got = {}
    for i, sends in enumerate(rounds):
        senders = [t.source for t in sends if t.name == "model_states"]
        assert len(senders) == len(set(senders)), senders  # one copy per holder per round
        for t in sends:
            assert (t.name, t.destination) not in got, t  # each file reaches each node once
            if t.relay:  # a relay sends what it received in an earlier round
                assert got.get((t.name, t.source), i) < i, t
            got[(t.name, t.destination)] = i
    assert {d for (name, d) in got if name == "model_states"} == set(nodes) - {"new0", "new1"}
    assert got[("rank_3", "new2")] == 0 and got[("rank_4", "new2")] == 0  # few lack it: the first round
    assert len(rounds) == 3  # 2 holders -> 4 -> 8 -> 10: 8 nodes lacking it served in rounds of 2, 4, 2
    with pytest.raises(KeyError, match="rank_7: no survivor holds it"):
        memory_saves.transfer_rounds({"new2": ["rank_7"]}, sources)
