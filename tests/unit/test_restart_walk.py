"""The restart's walk over its candidates, as ``status --check`` predicts it (pure)."""

from __future__ import annotations

import random

from megatron_ucp.plan.restart_walk import MAX_LOADS, Candidate, Walk, one_line, walk


def test_a_tag_known_damaged_is_passed_over_and_a_sound_one_is_certain():
    w = walk([Candidate("t8", ("t8/r1.pt: cut short",)), Candidate("t6", sound=True), Candidate("t4")])
    assert w == Walk(("t6",), True, ("t8: t8/r1.pt: cut short",))
    assert w.tag == "t6"


def test_a_tag_not_read_yet_is_tried_first_and_the_walk_goes_on_to_the_first_sound_one():
    w = walk([Candidate("t8"), Candidate("t6", ("damaged",)), Candidate("t4"), Candidate("t2", sound=True)])
    assert w.tries == ("t8", "t4", "t2") and w.certain and w.skipped == ()


def test_nothing_sound_known_leaves_the_outcome_open():
    w = walk([Candidate("t8"), Candidate("t6")])
    assert w.tries == ("t8", "t6") and not w.certain and w.tag == "t8"


def test_refusals_the_job_may_be_at_fault_for_stop_the_walk_at_the_cap_and_a_sound_tag_after_them_is_not_reached():
    refused = [Candidate(f"t{9 - i}", refused="optimizer differs") for i in range(MAX_LOADS)]
    w = walk([*refused, Candidate("t1", sound=True)])
    assert w.tries == () and w.capped and w.tag is None
    assert w.skipped[-1] == f"t1: not tried: {MAX_LOADS} loads were refused before it"


def test_a_sound_tag_refused_by_the_last_restart_is_refused_again():
    """A verdict says the files are sound; the same job refused them: it refuses them again (the job's fault)."""
    w = walk([Candidate("t8", sound=True, refused="model differs"), Candidate("t6")])
    assert w.tries == ("t6",) and not w.certain


def test_damage_does_not_count_against_the_cap():
    damaged = [Candidate(f"t{20 - i}", (f"cut {i}",)) for i in range(10)]
    w = walk([*damaged, Candidate("t2", sound=True)])
    assert w.tries == ("t2",) and w.certain and len(w.skipped) == 10 and not w.capped


def test_the_walk_matches_a_simulated_restart_on_random_candidates():
    """Random candidates, and a simulated restart that loads them in turn with the true state of each tag: what
    the restart loads is always one of the walk's tries; when the walk is certain it loads one (unless the job itself
    is at fault on a tag not read yet); when the walk has no tries it loads none."""
    rng = random.Random(7)
    for _ in range(2000):
        truth, candidates = [], []
        for i in range(rng.randint(0, 7)):
            state = rng.choice(["damaged-known", "sound-known", "sound", "damaged", "job", "job-known"])
            truth.append(state)
            candidates.append(
                Candidate(
                    f"t{i}",
                    ("known damage",) if state == "damaged-known" else (),
                    sound=state == "sound-known",
                    refused="refused before" if state == "job-known" else None,
                )
            )
        loaded, loads = None, 0
        for c, state in zip(candidates, truth, strict=True):
            if state == "damaged-known":
                continue
            if loads == MAX_LOADS:
                break
            if state in ("job", "job-known"):
                loads += 1
                continue
            if state == "damaged":
                continue
            loaded = c.tag
            break
        w = walk(candidates)
        if w.tries:
            assert loaded is None or loaded in w.tries, (truth, w, loaded)
        else:
            assert loaded is None, (truth, w, loaded)
        job_unknown = any(state == "job" for c, state in zip(candidates, truth, strict=True) if c.tag in w.tries)
        if w.certain and not job_unknown:  # only a job at fault, on tags not read yet, keeps it from the sound one
            assert loaded in w.tries, (truth, w, loaded)


def test_one_line():
    assert one_line("a\n  b\tc") == "a b c"
    assert len(one_line("x" * 1000)) == 400


def test_an_error_raised_in_several_classes_is_a_refusal_only_when_every_rank_refused():
    """Several ranks failed a load, each in its own class: the one error every rank raises does not depend on the
    ranks' order, and is a refusal of the checkpoint only when each rank's was."""
    from megatron_ucp.errors import AccountingError, CheckpointFormatError, PlanError, UcpError
    from megatron_ucp.integration.collectives import _one_class

    assert _one_class([AccountingError, AccountingError]) is AccountingError
    assert _one_class([AccountingError, CheckpointFormatError]) is CheckpointFormatError
    assert _one_class([PlanError, CheckpointFormatError]) is UcpError
    assert _one_class([CheckpointFormatError, PlanError]) is UcpError
