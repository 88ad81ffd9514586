"""Pure tests of the background-conversion decisions (megatron_ucp.background.queue,
megatron_ucp.background.status.classify).

No processes, no DeepSpeed: queue transitions, liveness verdicts, node assignment, tag order,
retention and the status precedence, walked through the interleavings that matter.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.background import queue as B
from megatron_ucp.background.status import TagFacts, UniversalStatus, classify
from megatron_ucp.errors import UcpError
from megatron_ucp.plan import tags as T

ALIVE = B.JobFacts(universal_complete=False, staging_live=True, runners_live=False)
NOTHING = B.JobFacts(universal_complete=False, staging_live=False, runners_live=False)
DONE = B.JobFacts(universal_complete=True, staging_live=False, runners_live=False)


def _attempt(job: B.Job) -> str:
    return f"{job.tag}#{job.tries}"


def _save(state: B.QueueState, tag: str, now: float, facts: B.JobFacts = NOTHING, shares: int = 1):
    """What one node's trigger does after a save: request, then settle/activate."""
    state, events = B.request(state, tag, shares, now)
    outcome = B.judge(state, state.active, facts, now) if state.active else None
    state, job, more = B.advance(state, outcome, now, _attempt)
    return state, job, events + more


# ---------------------------------------------------------------------------------------------
# queue
# ---------------------------------------------------------------------------------------------


def test_first_save_activates_at_once():
    state, job, events = _save(B.QueueState(), "global_step1", 100.0)
    assert job is not None and job.tag == "global_step1" and job.attempt == "global_step1#1"
    assert state.active == job and state.pending is None and events == []


def test_saves_faster_than_conversions_newest_pending_wins():
    state, _, _ = _save(B.QueueState(), "global_step1", 100.0)
    state, job, events = _save(state, "global_step2", 101.0, facts=ALIVE)
    assert job.tag == "global_step1" and state.pending.tag == "global_step2" and events == []
    state, job, events = _save(state, "global_step3", 102.0, facts=ALIVE)
    assert state.pending.tag == "global_step3"
    assert [(e.tag, e.kind) for e in events] == [("global_step2", B.EventKind.SKIPPED)]
    # global_step1 commits: the next one to run is the newest, global_step3
    state, done = state.add("global_step1", B.EventKind.COMPLETE, "ok", 110.0, attempt=state.active.attempt)
    state, job, events = B.advance(state, B.judge(state, state.active, NOTHING, 111.0), 111.0, _attempt)
    assert job.tag == "global_step3" and state.pending is None and events == []


def test_request_is_idempotent_across_nodes():
    state, _, _ = _save(B.QueueState(), "global_step1", 100.0, shares=2)
    again, events = B.request(state, "global_step1", 2, 100.1)
    assert again == state and events == []
    state, _, _ = _save(state, "global_step2", 101.0, facts=ALIVE, shares=2)
    again, events = B.request(state, "global_step2", 2, 101.1)
    assert again == state and events == []


def test_already_complete_is_not_queued():
    state, events = B.request(B.QueueState(), "global_step1", 1, 1.0, already_complete=True)
    assert state == B.QueueState() and events == []


def test_dead_job_is_superseded_by_pending():
    state, _, _ = _save(B.QueueState(), "global_step2", 100.0)
    state, _, _ = _save(state, "global_step4", 101.0, facts=ALIVE)
    # the converter of global_step2 is SIGKILLed: no heartbeat, no runner, grace over
    assert B.judge(state, state.active, NOTHING, 200.0) is B.Outcome.DEAD
    state, job, events = B.advance(state, B.Outcome.DEAD, 200.0, _attempt)
    assert job.tag == "global_step4"
    assert [(e.tag, e.kind) for e in events] == [("global_step2", B.EventKind.INTERRUPTED)]
    assert "superseded by global_step4" in events[0].message


def test_dead_job_alone_is_redone_with_a_new_attempt_then_given_up():
    state, job, _ = _save(B.QueueState(), "global_step2", 100.0)
    attempts = [job.attempt]
    now = 100.0
    for _ in range(B.MAX_TRIES - 1):
        now += 100
        state, job, events = B.advance(state, B.Outcome.DEAD, now, _attempt)
        assert job.tag == "global_step2" and job.attempt not in attempts
        assert events[0].kind is B.EventKind.INTERRUPTED and "again" in events[0].message
        attempts.append(job.attempt)
    state, job, events = B.advance(state, B.Outcome.DEAD, now + 100, _attempt)
    assert job is None and state.active is None and "given up" in events[0].message


def test_surviving_converter_does_not_redo_alone():
    """A converter whose peer node died reports the job interrupted and stops; the next trigger
    (which starts every node's converter) or `megatron-ucp convert` redoes it."""
    state, job, _ = _save(B.QueueState(), "global_step2", 100.0, shares=2)
    state, nxt, events = B.advance(state, B.Outcome.DEAD, 300.0, _attempt, redo_dead=False)
    assert nxt is None and state.active is None and state.pending is None
    assert events[0].kind is B.EventKind.INTERRUPTED and "next save" in events[0].message
    state, job, _ = _save(state, "global_step2", 400.0, shares=2)  # the trigger of a re-save redoes it
    assert job.tag == "global_step2" and job.tries == 1


def test_judge_precedence():
    state, job, _ = _save(B.QueueState(), "t1", 100.0)
    assert B.judge(state, job, NOTHING, 101.0) is B.Outcome.RUNNING  # startup grace
    assert B.judge(state, job, NOTHING, 100.0 + B.STARTUP_GRACE_S + 1) is B.Outcome.DEAD
    runners = B.JobFacts(universal_complete=False, staging_live=False, runners_live=True)
    assert B.judge(state, job, runners, 500.0) is B.Outcome.RUNNING
    # committed but the committer still verifies: not settled yet (no overlap with the next job)
    busy_done = B.JobFacts(universal_complete=True, staging_live=False, runners_live=True)
    assert B.judge(state, job, busy_done, 500.0) is B.Outcome.RUNNING
    assert B.judge(state, job, DONE, 500.0) is B.Outcome.COMPLETE
    failed = B.JobFacts(universal_complete=False, staging_live=False, runners_live=False, shares_failed=("x",))
    assert B.judge(state, job, failed, 500.0) is B.Outcome.FAILED
    state, _ = state.add("t1", B.EventKind.FAILED, "boom", 120.0, attempt=job.attempt)
    assert B.judge(state, job, ALIVE, 500.0) is B.Outcome.FAILED  # a recorded event settles it


def test_startup_grace_is_not_given_to_a_converter_seen_dead():
    state, job, _ = _save(B.QueueState(), "t1", 100.0)
    gone = B.JobFacts(universal_complete=False, staging_live=False, runners_live=False, runners_gone=True)
    assert B.judge(state, job, gone, 101.0) is B.Outcome.DEAD  # killed right after activation: no "in progress"
    assert B.judge(state, job, gone, 500.0) is B.Outcome.DEAD
    # a dead joiner does not outvote a live heartbeat (another node still converting its share)
    assert B.judge(state, job, B.JobFacts(False, True, False, runners_gone=True), 101.0) is B.Outcome.RUNNING


def test_complete_without_event_is_recorded_once():
    state, job, _ = _save(B.QueueState(), "t1", 100.0)
    state, nxt, events = B.advance(state, B.Outcome.COMPLETE, 200.0, _attempt)
    assert nxt is None and [e.kind for e in events] == [B.EventKind.COMPLETE]
    assert state.settled_by(job.attempt) is not None


def test_events_are_reported_once_and_bounded():
    state = B.QueueState()
    for i in range(B.MAX_EVENTS + 10):
        state, _ = state.add(f"t{i}", B.EventKind.SKIPPED, "x", float(i))
    assert len(state.events) == B.MAX_EVENTS and len(state.unreported()) == B.MAX_EVENTS
    state = state.mark_reported()
    assert state.unreported() == ()
    state, e = state.add("late", B.EventKind.FAILED, "y", 1e6)
    assert state.unreported() == (e,)


def test_queue_json_roundtrip_and_tolerance():
    state, _, _ = _save(B.QueueState(), "t1", 100.0, shares=3)
    state, _, _ = _save(state, "t2", 101.0, facts=ALIVE, shares=3)
    state, _ = state.add("t0", B.EventKind.REMOVED, "gone", 99.0, log="/x")
    data = state.to_json()
    assert B.QueueState.from_json(data) == state
    data["future_field"] = 1
    data["events"].append({"seq": 99, "kind": "from-the-future", "tag": "z"})
    assert B.QueueState.from_json(data) == state
    assert B.QueueState.from_json(None) == B.QueueState()
    assert B.QueueState.from_json({"format": "something else"}) == B.QueueState()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["save", "finish", "die"]), st.integers(1, 50)), max_size=40))
def test_random_interleavings_keep_invariants(ops):
    """Whatever the order of saves, completions and deaths: one active at most, the pending one is
    the newest request not yet activated, and every request is converted, skipped or still owed."""
    state = B.QueueState()
    now = 0.0
    requested: list[str] = []
    activated: list[str] = []
    for i, (op, step) in enumerate(ops):
        now += 100.0
        if op == "save":
            tag = f"global_step{i}"
            requested.append(tag)
            state, job, _ = _save(state, tag, now, facts=ALIVE)
        elif op == "finish" and state.active is not None:
            state, _ = state.add(state.active.tag, B.EventKind.COMPLETE, "ok", now, attempt=state.active.attempt)
            state, job, _ = B.advance(state, B.Outcome.COMPLETE, now, _attempt)
        elif op == "die" and state.active is not None:
            state, job, _ = B.advance(state, B.Outcome.DEAD, now, _attempt)
        else:
            continue
        if job is not None and (not activated or activated[-1] != job.attempt):
            activated.append(job.attempt)
        if state.pending is not None:
            assert state.pending.tag == requested[-1]
            assert state.active is not None
        if state.active is not None and state.pending is not None:
            assert state.active.tag != state.pending.tag
    skipped = {e.tag for e in state.events if e.kind is B.EventKind.SKIPPED}
    converted = {a.split("#")[0] for a in activated}
    owed = {j.tag for j in (state.active, state.pending) if j is not None}
    if len(state.events) < B.MAX_EVENTS:
        assert set(requested) <= skipped | converted | owed
        assert not (skipped & converted)


# ---------------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rank,expected", [(0, (0, 2, True)), (1, (0, 2, False)), (2, (1, 2, True)), (3, (1, 2, False))]
)
def test_two_pretend_nodes_from_config(rank, expected):
    a = B.node_assignment(rank, 4, local_rank=rank, local_world=4, ranks_per_node=2)
    assert (a.node, a.nodes, a.launcher) == expected


def test_nodes_from_launcher_env():
    # 3 nodes of 12 ranks (Aurora: 12 tiles per node)
    launchers = [r for r in range(36) if B.node_assignment(r, 36, r % 12, 12).launcher]
    assert launchers == [0, 12, 24]
    assert {B.node_assignment(r, 36, r % 12, 12).node for r in range(36)} == {0, 1, 2}
    assert all(B.node_assignment(r, 36, r % 12, 12).nodes == 3 for r in range(36))


def test_nodes_fall_back_to_one_converter():
    for args in [
        dict(local_rank=None, local_world=None),
        dict(local_rank=0, local_world=5),
        dict(local_rank=3, local_world=4),
    ]:  # 4 ranks per node, but rank 2 says local 3
        a = B.node_assignment(2, 8, **args)
        assert (a.node, a.nodes, a.launcher) == (0, 1, False) and a.note
        assert B.node_assignment(0, 8, **args).launcher
    with pytest.raises(UcpError):
        B.node_assignment(8, 8)


@settings(deadline=None)
@given(st.integers(1, 16), st.integers(1, 64))
def test_one_launcher_per_node(per, nodes):
    world = per * nodes
    assigned = [B.node_assignment(r, world, r % per, per) for r in range(world)]
    assert [a.node for a in assigned if a.launcher] == list(range(nodes))
    assert all(a.nodes == nodes for a in assigned)


# ---------------------------------------------------------------------------------------------
# tag order, latest_universal, retention
# ---------------------------------------------------------------------------------------------


def test_tag_order_by_step_then_mtime():
    assert T.tag_step("global_step1200") == 1200 and T.tag_step("global_step1200_universal") == 1200
    assert T.tag_step("final") is None
    assert T.newer(("global_step10", 1.0), ("global_step9", 5.0))
    assert T.newer(("final", 5.0), ("global_step9", 1.0))
    assert [t for t, _ in T.chronological([("global_step10", 1), ("global_step9", 2), ("global_step100", 0)])] == [
        "global_step9",
        "global_step10",
        "global_step100",
    ]
    assert [t for t, _ in T.chronological([("b", 2), ("a", 1), ("global_step1", 3)])] == ["a", "b", "global_step1"]


def test_latest_universal_never_moves_back():
    assert T.should_update_latest(("global_step5_universal", 1.0), None)
    assert T.should_update_latest(("global_step5_universal", 1.0), ("global_step4_universal", 9.0))
    assert not T.should_update_latest(("global_step5_universal", 9.0), ("global_step6_universal", 1.0))


def test_retention_keeps_newest_and_protected():
    folders = [(f"global_step{s}_universal", float(s)) for s in (1, 2, 3, 4, 5)]
    assert B.select_for_removal(folders, None, []) == []
    assert B.select_for_removal(folders, 2, []) == [
        "global_step1_universal",
        "global_step2_universal",
        "global_step3_universal",
    ]
    assert B.select_for_removal(folders, 2, ["global_step1_universal"]) == [
        "global_step2_universal",
        "global_step3_universal",
    ]
    assert B.select_for_removal(folders, 10, []) == []
    with pytest.raises(UcpError):
        B.select_for_removal(folders, 0, [])


@settings(deadline=None)
@given(st.lists(st.integers(0, 10_000), unique=True, max_size=30), st.integers(1, 8), st.data())
def test_retention_properties(steps, keep, data):
    folders = [(f"global_step{s}_universal", float(s)) for s in steps]
    protected = data.draw(st.sets(st.sampled_from([n for n, _ in folders]))) if folders else set()
    removed = B.select_for_removal(folders, keep, protected)
    kept = [n for n, _ in folders if n not in removed]
    assert not set(removed) & protected
    newest = [n for n, _ in sorted(folders, key=lambda f: f[1])[-keep:]]
    assert set(newest) <= set(kept)
    assert len(kept) <= keep + len(protected)


def test_log_names():
    assert B.log_name("global_step2", 0, 1) == "convert-global_step2.log"
    assert B.log_name("global_step2", 1, 2) == "convert-global_step2.node1.log"
    assert B.log_name("global_step2", 0, 1, B.VERIFY) == "verify-global_step2.log"


def test_verify_jobs_queue_like_conversions_and_say_so_in_their_events():
    """A job saving without background conversion: one node's, settled by its own event; a skipped or interrupted
    verification says ``job: verify`` (the universal column of status ignores it), and the queue file keeps the
    kind."""
    state, events = B.request(B.QueueState(), "global_step1", 1, 100.0, kind=B.VERIFY)
    state, job, _ = B.advance(state, None, 100.0, _attempt)
    assert job.kind == B.VERIFY and job.event_job == B.VERIFY and job.share_count == 1
    state, events = B.request(state, "global_step2", 1, 101.0, kind=B.VERIFY)
    state, events = B.request(state, "global_step3", 1, 102.0, kind=B.VERIFY)
    (skipped,) = events
    assert (skipped.tag, skipped.kind, skipped.job) == ("global_step2", B.EventKind.SKIPPED, B.VERIFY)
    assert skipped.message.startswith("not verified: global_step3 was saved before its verify job could start")
    assert skipped.line().startswith("global_step2: skipped (verify): ")
    assert state.last_event("global_step2") is None and state.last_event("global_step2", B.VERIFY) == skipped
    assert B.QueueState.from_json(state.to_json()) == state
    # settled by its event, like a conversion's committer; no folder says "complete" for it
    state, _ = state.add("global_step1", B.EventKind.REJECTED, "unsound", 103.0, attempt=job.attempt, job=B.VERIFY)
    assert B.judge(state, state.active, ALIVE, 103.0) is B.Outcome.FAILED
    state, job, events = B.advance(state, B.Outcome.FAILED, 103.0, _attempt)
    assert job.tag == "global_step3" and job.kind == B.VERIFY and events == []
    # its converter died: interrupted, as a verification
    state, _, events = B.advance(state, B.Outcome.DEAD, 200.0, _attempt, redo_dead=False)
    assert [(e.kind, e.job) for e in events] == [(B.EventKind.INTERRUPTED, B.VERIFY)]


# ---------------------------------------------------------------------------------------------
# status precedence
# ---------------------------------------------------------------------------------------------


def _ev(kind: B.EventKind, log: str = None) -> B.Event:
    return B.Event(seq=1, time=0.0, tag="t", kind=kind, message=f"{kind.value} msg", log=log)


@pytest.mark.parametrize(
    "facts,expected",
    [
        (TagFacts("t", "complete", staging=True, pending=True), UniversalStatus.COMPLETE),
        (TagFacts("t", "foreign"), UniversalStatus.FOREIGN),
        (
            TagFacts("t", "absent", staging=True, staging_live=True, progress=0.5, shares=(1, 2)),
            UniversalStatus.IN_PROGRESS,
        ),
        (TagFacts("t", "absent", active="running"), UniversalStatus.IN_PROGRESS),
        (TagFacts("t", "absent", pending=True, last_event=_ev(B.EventKind.FAILED)), UniversalStatus.PENDING),
        (
            TagFacts("t", "absent", staging=True, last_event=_ev(B.EventKind.FAILED, "/r/.ucp/x.log")),
            UniversalStatus.FAILED,
        ),
        (TagFacts("t", "absent", staging=True), UniversalStatus.INTERRUPTED),
        (TagFacts("t", "absent", active="dead"), UniversalStatus.INTERRUPTED),
        (TagFacts("t", "absent", last_event=_ev(B.EventKind.INTERRUPTED)), UniversalStatus.INTERRUPTED),
        # its dead staging folder was cleaned up since: still a conversion that never finished, not "absent"
        (TagFacts("t", "absent", last_event=_ev(B.EventKind.CLEANED)), UniversalStatus.INTERRUPTED),
        (TagFacts("t", "absent", last_event=_ev(B.EventKind.SKIPPED)), UniversalStatus.SKIPPED),
        (TagFacts("t", "absent", last_event=_ev(B.EventKind.REMOVED)), UniversalStatus.REMOVED),
        (TagFacts("t", "absent"), UniversalStatus.ABSENT),
    ],
)
def test_status_precedence(facts, expected):
    state, detail = classify(facts)
    assert state is expected
    if expected is UniversalStatus.IN_PROGRESS and facts.progress is not None:
        assert detail == "50%, 1/2 shares done"
    if expected is UniversalStatus.FAILED:
        assert "/r/.ucp/x.log" in detail
    if expected in (UniversalStatus.INTERRUPTED, UniversalStatus.SKIPPED):
        assert "megatron-ucp convert" in detail
