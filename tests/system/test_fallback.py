"""A restart never dies on a bad newest tag: it falls back to the newest sound one, loudly, on its own.

Real DeepSpeed (CPU, gloo): the session's hooked DP=4 checkpoint of BF16_Optimizer (tags global_step2 and
global_step4, ``latest`` = global_step4), its global_step4 damaged as a file system would damage it, resumed at
DP=3 with no tag (the tag ``latest`` names, as Megatron loads):

* a rank file cut short: the judge finds it from the save's file list (names and sizes) before any load, and the
  restart loads global_step2 instead;
* one bit flipped in a hooked rank file (the file whole): the native reshard's own check against the save's
  checksums refuses global_step4 on every rank, and the restart loads global_step2 instead;
* ``--ucp-no-fallback``: the cut-short file's error, nothing trained.

Each fallback loads global_step2 bit for bit, continues the uninterrupted curve, says which tag failed and why,
which loaded and how many iterations that lost, records it in the store, and leaves global_step4 as it was. The
judge itself (a recorded verdict, the save's file list, tags ordered by step) is checked on synthetic saves, without
DeepSpeed.
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple
from pathlib import Path

import pytest

from megatron_ucp.background import restart_judge
from megatron_ucp.background.restart_judge import Judgement
from megatron_ucp.background.status import root_status
from megatron_ucp.background.status_text import format_status
from megatron_ucp.background.store import read_fallbacks
from megatron_ucp.background.verdicts import read_verdict, record_verdict
from megatron_ucp.cli import main
from megatron_ucp.convert.universal import source_identity
from megatron_ucp.deepspeed.model_states import recorded_save_id
from megatron_ucp.deepspeed.reader import find_checkpoint_files
from megatron_ucp.format import osio
from megatron_ucp.format.save_files import describe, file_list_path, file_list_text
from megatron_ucp.integration.resume import fallback
from megatron_ucp.plan.tags import iterations_lost
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    assert_same_state,
    fallback_announcements,
    flip_a_bit_in_the_largest_record,
    private_copy,
    resume,
)

OPT = "bf16"
NEW, OLD = "global_step4", "global_step2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("fallback"))


def _rank_file(tag: Path, rank: int) -> Path:
    (found,) = tag.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return found


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _resumed(ds_checkpoint, runs: ElasticRuns, damage: str, **plugin: object):
    ck = ds_checkpoint(OPT, 4, plugin=True)

    def make(folder: Path):
        root = private_copy(ck.root, folder / "ckpt")
        victim = _rank_file(root / NEW, 1 if damage == "cut-short" else 2)
        if damage == "cut-short":
            _cut_short(victim)
        else:
            flip_a_bit_in_the_largest_record(victim)
        before = _digest(root / NEW)
        res = resume(3, OPT, root, folder, plugin_kwargs=plugin, expect_failure=bool(plugin))
        return res, root, victim, before

    return ck, runs.get(f"{damage}-{sorted(plugin.items())}", make)


WHY = {
    "cut-short": "(cut short? the file is not the one saved) (its save's file list)",
    "flipped-bit": "checksum mismatch",
}
"""What the announcement says of each damage (the older tag's own load, logged after it, mentions checksums too): a
file cut short is found from the save's file list before any load, a flipped bit (the size unchanged) by the load."""


@pytest.mark.parametrize("damage", ["cut-short", "flipped-bit"])
def test_a_restart_falls_back_to_the_newest_sound_tag(ds_checkpoint, runs, damage: str):
    ck, (res, root, victim, before) = _resumed(ds_checkpoint, runs, damage)
    assert res.ok, res.log[-3000:]
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"])
    assert_losses_continue(res, ck.loss_at)

    (said,) = fallback_announcements(res.log)
    assert f"names {NEW}, which cannot be resumed" in said and str(victim) in said, said
    assert f"loading {OLD} instead (loses 2 iterations)" in said
    # refused by the judge from the save's file list (cut short), or tried and refused on every rank by the load's
    # own check of the partitions against the save's checksums (a flipped bit), then the older tag: it says why
    assert WHY[damage] in said, said
    # a load tried only where the sizes could not tell
    assert (f"the restart cannot load {NEW}" in res.log) == (damage == "flipped-bit")
    assert _digest(root / NEW) == before  # nothing of the bad tag is changed

    (event,) = read_fallbacks(root)
    assert (event["latest"], event["loaded"], event["lost"]) == (NEW, OLD, "2 iterations")
    assert [f["tag"] for f in event["failed"]] == [NEW]
    verdict = read_verdict(root, NEW)
    assert verdict is not None and not verdict.sound and verdict.checked_by == "restart"
    assert str(victim) in verdict.problems[0]
    rs = root_status(root, sizes=False)
    (row,) = [t for t in rs.tags if t.tag == NEW]
    assert row.verified == "unsound" and rs.last_fallback == event
    assert f"loaded {OLD} (2 iterations lost): {NEW}: " in format_status(rs)


def test_no_fallback_stops_on_the_bad_tag(ds_checkpoint, runs):
    _, (res, root, victim, before) = _resumed(ds_checkpoint, runs, "cut-short", fallback=False)
    assert res.returncode != 0 and res.losses == [], res.log[-3000:]
    assert str(victim) in res.log and "FALLING BACK" not in res.log
    assert read_fallbacks(root) == [] and _digest(root / NEW) == before


def _nan_in_exp_avg_sq(path: Path) -> None:
    """A NaN that reached the save: one element of the rank file's ``exp_avg_sq``, written as DeepSpeed writes."""
    import torch

    states = torch.load(path, weights_only=False)
    state = states["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg_sq"][7] = float("nan")
    torch.save(states, path)


def test_a_nan_that_reached_a_save_is_refused_at_load_and_the_restart_falls_back(ds_checkpoint, tmp_path: Path):
    """A save without the hooks (no checksums to differ) whose newest tag holds a NaN in one rank's ``exp_avg_sq``:
    the reshard to DP 3 places it, the load's finite check refuses the tag on every rank, and the restart loads
    global_step2 bit for bit instead."""
    ck = ds_checkpoint(OPT, 4)
    root = private_copy(ck.root, tmp_path / "ckpt")
    victim = _rank_file(root / NEW, 2)
    _nan_in_exp_avg_sq(victim)
    res = resume(3, OPT, root, tmp_path)
    assert res.ok and res.loaded_step == 2 and res.steps == [3, 4], res.log[-3000:]
    assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"])
    assert_losses_continue(res, ck.loss_at)
    (said,) = fallback_announcements(res.log)
    assert "not finite" in said and "'exp_avg_sq' of " in said and ": 1 NaN and 0 Inf of " in said, said
    assert f", copied from {victim.name}" in said, said  # the old rank file it came from, named
    assert f"loading {OLD} instead (loses 2 iterations)" in said


SMALL = ["--layers", "1", "--hidden", "32", "--ffn", "64", "--heads", "2", "--kv-heads", "1", "--vocab", "64"]


def test_the_judge_uses_a_recorded_verdict_and_orders_tags_by_step(tmp_path: Path):
    """A verdict that applies is used as it is (a NaN the background conversion found: the tag is skipped without
    reading it); one on files rewritten since is not; candidates are older native tags of any stage, newest
    first."""
    root = tmp_path / "ck"
    for step in (5, 10, 100):  # the oldest a ZeRO-3 save (its model states are per rank)
        stage = ["--optimizer", "zero", "--zero-stage", "3"] if step == 5 else []
        args = ["synthesize", str(root), *SMALL, "--dp", "2", *stage, "--iteration", str(step), "--no-progress"]
        assert main(args) == 0
    tags = [f"global_step{s}" for s in (5, 10, 100)]
    (root / "latest").write_text(tags[2])
    assert restart_judge.older_tags(root, tags[2]) == [tags[1], tags[0]]
    assert restart_judge.judge(root, tags[2], through_twin=False) == Judgement()

    identity = source_identity(find_checkpoint_files(root / tags[2]).identity_files())
    record_verdict(
        root, tags[2], ["r1.pt: 1 NaN and 0 Inf in 'exp_avg' of parameter 'w'"], "background conversion", identity
    )
    assert restart_judge.judge(root, tags[2], through_twin=False) == Judgement(
        ("r1.pt: 1 NaN and 0 Inf in 'exp_avg' of parameter 'w' (found by background conversion)",),
        "files",
    )
    record_verdict(root, tags[1], ["stale"], "megatron-ucp verify", {"other": [1, 2]})
    assert restart_judge.judge(root, tags[1], through_twin=False) == Judgement()  # judged on other files: checked again
    problems, kind = astuple(restart_judge.judge(root, tags[1], through_twin=True))[:2]
    assert "no complete universal twin" in problems[0] and kind == "twin"  # not the tag's own verdict
    assert not fallback._verdict_to_record(root, fallback.Failed(tags[1], problems, kind))

    assert iterations_lost(tags[2], tags[1]) == "90 iterations"


def test_the_judge_finds_cut_and_missing_files_from_the_saves_file_list_and_status_predicts_it(tmp_path: Path):
    """Tags 2, 4, 6, 8 of a hooked save (each with the file list its commit writes); a rank file of 4, 6 and 8 cut
    short or deleted: the judge refuses each from names and sizes before any load (no load counts against the
    cap), ``status`` shows each unsound and predicts the fall back to global_step2, and a refused restart records
    those verdicts (the tag's own damage, whatever the job)."""
    root = tmp_path / "ck"
    tags = [f"global_step{s}" for s in (2, 4, 6, 8)]
    for tag in tags:
        step = tag[len("global_step") :]
        args = ["synthesize", str(root), *SMALL, "--dp", "2", "--iteration", step, "--record", "--no-progress"]
        assert main(args) == 0
        folder = root / tag
        listing = file_list_path(root, tag)
        listing.parent.mkdir(parents=True, exist_ok=True)
        files = [describe(path) for path in sorted(folder.iterdir())]
        osio.write_durably(listing, file_list_text(folder, recorded_save_id(folder), files))
    (root / "latest").write_text(tags[-1])
    assert restart_judge.judge(root, tags[-1], through_twin=False) == Judgement()
    victims = {}
    for tag in tags[1:]:
        (victim,) = (root / tag).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
        if tag == tags[1]:
            victim.unlink()
        else:
            victim.write_bytes(victim.read_bytes()[:100])
        victims[tag] = victim
    for tag in tags[1:]:
        problems, kind = astuple(restart_judge.judge(root, tag, through_twin=False))[:2]
        assert kind == "files" and str(victims[tag]) in problems[0] and "(its save's file list)" in problems[0]
        assert ("is missing" if tag == tags[1] else "cut short?") in problems[0]
    assert restart_judge.judge(root, tags[0], through_twin=False) == Judgement()

    rs = root_status(root, sizes=False)
    assert {t.tag: t.verified for t in rs.tags} == {tags[0]: None, **{t: "unsound" for t in tags[1:]}}
    answer = rs.resume_answer()
    assert answer.tag == tags[0] and answer.fallback, answer

    assert not [p for p in rs.problems if "never committed" in p]
    # a newer save killed before its commit (its files there, no file list): status says what it is
    args = ["synthesize", str(root), *SMALL, "--dp", "2", "--iteration", "10", "--record", "--no-progress"]
    assert main(args) == 0
    (root / "latest").write_text(tags[-1])  # never named by latest: the commit never came
    (said,) = [p for p in root_status(root, sizes=False).problems if "never committed" in p]
    assert said.startswith("global_step10: newer than latest and never committed"), said

    failed = [
        fallback.Failed(tag, restart_judge.judge(root, tag, False).problems, "files") for tag in reversed(tags[1:])
    ]
    fallback._record_refused(root, failed, tags[-1])
    for tag in tags[1:]:
        verdict = read_verdict(root, tag)
        assert verdict is not None and not verdict.sound and str(victims[tag]) in verdict.problems[0]


def test_loads_refused_for_the_jobs_fault_are_refused_again_until_their_files_change(tmp_path: Path):
    """A restart whose loads of global_step8, 6 and 4 were refused for what may be the job's fault (a changed
    optimizer) and that stopped at the cap: ``--check`` says a restart fails again (exit 1), though a verdict later
    finds their files sound (the same job refuses the same files). One tag's files changed, its load decides again."""
    root = tmp_path / "ck"
    tags = [f"global_step{s}" for s in (2, 4, 6, 8)]
    for tag in tags:
        args = ["synthesize", str(root), *SMALL, "--dp", "2", "--iteration", tag[len("global_step") :], "--no-progress"]
        assert main(args) == 0
    (root / "latest").write_text(tags[-1])
    assert _check(root) == (
        0,
        f"a restart resumes from {tags[-1]} (not read yet: its load checks it); "
        f"if its files are damaged: {tags[2]} (not read yet), then {tags[1]} (not read yet), "
        f"then {tags[0]} (not read yet), then no tag (`megatron-ucp status {root} --deep` "
        "reads them)",
    )
    refusal = "the saved optimizer is Adam, the job's SGD"
    failed = [fallback.Failed(tag, (refusal,), "load") for tag in reversed(tags[1:])]
    failed.append(fallback.Failed(tags[0], ("not tried: 3 loads were refused before it",), "capped"))
    fallback._record_refused(root, failed, tags[-1])
    assert all(read_verdict(root, tag) is None for tag in tags)  # the job may be at fault: no verdict
    code, said = _check(root)
    assert code == 1 and said.startswith("a restart fails again: no tag passes"), said
    assert f"{tags[0]}: not tried: 3 loads were refused before it" in said, said
    assert main(["verify", str(root), "--tag", tags[2], "--no-progress"]) == 0  # found sound: refused all the same
    assert _check(root)[0] == 1

    victim = _rank_file(root / tags[2], 0)
    victim.write_bytes(victim.read_bytes())  # rewritten (a repair, a copy back): its load decides again
    code, said = _check(root)
    assert code == 0 and said.startswith(f"a restart falls back to {tags[2]} (not read yet"), said
    assert f"{tags[-1]}: the last restart's load refused it: {refusal}" in said, said


def _refused_on_one_rank(rank: int, root: str, store: str, out: str) -> None:
    """One rank of a two-rank job whose load of the newest tag is refused on rank 1 only (as one DP group's damaged
    file refuses it at TP 2): through the load's agreement, as the hooks load, both ranks go on to the older tag
    together."""
    import json

    import torch.distributed as dist

    from megatron_ucp.errors import CheckpointFormatError
    from megatron_ucp.integration.collectives import JOB

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tried: list = []

    def load(name):
        def step():
            tried.append(name)
            if name is None and rank == 1:
                raise CheckpointFormatError(f"{root}/{NEW}/rank1.pt: cut short (rank {rank})", subject=root)
            return name or NEW

        return JOB.agreed(step, f"loading {name or 'latest'}")

    try:
        loaded = fallback.load_with_fallback(Path(root), load, universal=False)
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"loaded": loaded, "tried": tried}))


def test_a_tag_refused_on_some_ranks_only_is_refused_on_every_rank(tmp_path: Path):
    """Real torch.distributed (gloo, two processes): the fallback's loads agree across the job."""
    import json

    import torch.multiprocessing as mp

    root = tmp_path / "ck"
    for tag in (OLD, NEW):
        (root / tag).mkdir(parents=True)
        (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "latest").write_text(NEW)
    mp.spawn(_refused_on_one_rank, args=(str(root), str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert said == {"loaded": OLD, "tried": [None, OLD]}, (rank, said)
    (event,) = read_fallbacks(root)
    assert event["failed"][0]["tag"] == NEW and "global rank 1" in event["failed"][0]["problems"][0]
    assert "rank1.pt: cut short" in event["failed"][0]["problems"][0]


def test_the_scheduler_is_put_back_before_each_load_after_a_refused_one():
    """Megatron's OptimizerParamScheduler adds the saved step count to its own at each load: a load refused after
    DeepSpeed's own load (the scheduler loaded) would otherwise count the refused tag's steps in the next one."""

    class Additive:  # what Megatron's load_state_dict does: step(increment=num_steps)
        def __init__(self) -> None:
            self.optimizer = object()
            self.num_steps, self.max_lr, self.styles = 0, 1e-3, ["cosine"]

        def load_state_dict(self, sd: dict) -> None:
            self.num_steps += sd["num_steps"]

    scheduler = Additive()
    before = fallback.SchedulerAsBefore(scheduler)
    scheduler.load_state_dict({"num_steps": 72})  # the refused tag's load got that far
    scheduler.styles.append("x")
    before.restore()
    scheduler.load_state_dict({"num_steps": 36})
    assert (scheduler.num_steps, scheduler.styles) == (36, ["cosine"])
    assert "optimizer" not in before.values  # not copied: only the scheduler's own values


def _check(root: Path) -> tuple[int, str]:
    """``megatron-ucp status ROOT --check``: its exit status and what it says a restart would load."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["status", str(root), "--check", "--no-sizes"])
    (said,) = [line for line in err.getvalue().splitlines() if line.startswith("megatron-ucp status --check: ")]
    return code, said.removeprefix("megatron-ucp status --check: ")


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_fallback_then_a_save_of_the_same_tag_leaves_one_save_and_the_next_restart_resumes_from_it(
    ds_checkpoint, tmp_path: Path, saving: str
):
    """The sequence a requeued job meets: global_step4 (DP 4) cut short; the restart at DP 3 falls back to
    global_step2, trains 3 and 4 and saves global_step4 again, at DP 3, into the same folder (synchronously, or
    asynchronously: committed at the end of the run). The folder then holds that save alone (three rank files, the
    earlier save's four moved aside and removed once the new one committed); the next restart at DP 3 resumes from
    it, with no fallback, instead of losing the same iterations again."""
    ck = ds_checkpoint(OPT, 4, plugin=True)
    root = private_copy(ck.root, tmp_path / "ckpt")
    _cut_short(_rank_file(root / NEW, 1))
    # what status answers before and after the files are read, and what verify says, agree with the restart: the
    # cut is seen from the save's file list before anything is read
    code, said = _check(root)
    assert code == 0 and said.startswith(f"a restart falls back to {OLD} (not read yet: its load checks it; loses 2"), (
        said
    )
    assert "(cut short? the file is not the one saved) (its save's file list)" in said, said
    assert main(["verify", str(root), "--tag", NEW, "--no-progress"]) == 1
    code, said = _check(root)
    assert code == 0 and said.startswith(f"a restart falls back to {OLD} (not read yet: its load checks it; loses 2"), (
        said
    )
    first = resume(
        3, OPT, root, tmp_path / "first", save_dir=root, save_at=(4,), plugin_kwargs={"async_save": saving == "async"}
    )
    assert first.ok and first.loaded_step == 2 and first.steps == [3, 4], first.log[-3000:]
    assert len(fallback_announcements(first.log)) == 1
    assert_losses_continue(first, ck.loss_at)
    replaced = [line for line in first.log.splitlines() if f"already holds a save of {NEW}; this save replaces" in line]
    assert len(replaced) == 1, first.log[-3000:]
    rank_files = sorted(p.name for p in (root / NEW).glob("*optim_states.pt"))
    assert rank_files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)], rank_files
    assert (root / "latest").read_text().strip() == NEW
    assert not any((root / ".ucp" / "replaced").iterdir())  # removed once the new save committed
    # the earlier save's verdict went with it: the new save is judged afresh
    code, said = _check(root)
    assert code == 0 and said.startswith(f"a restart resumes from {NEW} (not read yet: its load checks it); "), said
    assert f"if its files are damaged: {OLD} (not read yet), then no tag" in said, said
    assert main(["verify", str(root), "--tag", NEW, "--no-progress"]) == 0
    assert _check(root) == (0, f"a restart resumes from {NEW} (found sound)")

    again = resume(3, OPT, root, tmp_path / "again", steps=5)
    assert again.ok and again.loaded_step == 4 and again.steps == [5], again.log[-3000:]
    assert fallback_announcements(again.log) == []
    assert len(read_fallbacks(root)) == 1  # the first restart's, and no other


def test_a_restart_that_falls_back_again_for_the_same_reason_says_so_loudly(ds_checkpoint, runs):
    """The cut-short save restarted a second time (nothing saved in between, as a job that dies before its next save
    is requeued): the second fallback from global_step4 to global_step2 says it is the second, how many iterations
    that loses in all and where the record is; the record counts it, for a requeue script to stop on."""
    _, (first, root, _, _) = _resumed(ds_checkpoint, runs, "cut-short")
    assert first.ok and "REPEATED FALLBACK" not in first.log, first.log[-3000:]
    again = runs.get("cut-short-again", lambda folder: resume(3, OPT, root, folder))
    assert again.ok and again.loaded_step == 2, again.log[-3000:]
    (said,) = [line for line in again.log.splitlines() if "!!! REPEATED FALLBACK" in line]
    assert f"restart 2 to fall back from {NEW} to {OLD} (4 iterations lost in all" in said, said
    assert [(e["latest"], e["loaded"], e["repeat"]) for e in read_fallbacks(root)] == [(NEW, OLD, 1), (NEW, OLD, 2)]


def test_a_restart_that_resumes_from_no_tag_is_what_status_answers_until_a_file_changes(ds_checkpoint, tmp_path):
    """Both tags damaged (global_step4 cut short, global_step2 with a bit flipped): the restart refuses each and
    trains nothing. Until then status sees the cut from the save's file list and says the load will check the other;
    after it, each tag's own damage is its verdict (the cut from the list, the flipped bit from the sums its save
    recorded), so status says that no tag can be resumed, naming each (exit 1 for a requeue script), and the next
    restart refuses both without a load. The damaged file put back, status answers as before the restart, and the
    restart that falls back to it leaves no refusal behind."""
    ck = ds_checkpoint(OPT, 4, plugin=True)
    root = private_copy(ck.root, tmp_path / "ckpt")
    _cut_short(_rank_file(root / NEW, 1))
    victim = _rank_file(root / OLD, 2)
    flip_a_bit_in_the_largest_record(victim)
    # the cut is seen from the save's file list; the flipped bit only by reading
    expected = f"a restart falls back to {OLD} (not read yet: its load checks it; loses 2 iterations)"
    code, said = _check(root)
    assert code == 0 and said.startswith(expected), said

    refused = resume(3, OPT, root, tmp_path / "refused", expect_failure=True)
    assert refused.returncode != 0 and refused.losses == [], refused.log[-3000:]
    code, said = _check(root)
    assert code == 1 and said.startswith("no tag here can be resumed: "), said
    assert f"{NEW}: " in said and f"{OLD}: " in said and str(victim) in said, said
    verdict = read_verdict(root, NEW)
    assert verdict is not None and not verdict.sound and "(its save's file list)" in verdict.problems[0], verdict
    verdict = read_verdict(root, OLD)
    assert verdict is not None and not verdict.sound and "checksum mismatch" in verdict.problems[0], verdict
    assert read_fallbacks(root) == []
    again = resume(3, OPT, root, tmp_path / "judged", expect_failure=True)
    assert again.returncode != 0 and "cannot load" not in again.log, again.log[-3000:]  # no load tried

    victim.write_bytes((ck.root / OLD / victim.name).read_bytes())  # the file repaired: the refusal is history
    code, said = _check(root)
    assert code == 0 and said.startswith(expected), said
    again = resume(3, OPT, root, tmp_path / "again")
    assert again.ok and again.loaded_step == 2, again.log[-3000:]
    assert not (root / ".ucp" / "refused-restart.json").exists()


def test_a_job_whose_optimizer_differs_from_the_saves_records_no_verdict_against_a_tag(ds_checkpoint, tmp_path):
    """A save of AdamW restarted by a job whose torch optimizer is NAdam (a state AdamW never saved): every tag's load
    is refused for the job, not for the tags' files, so no tag is recorded unsound (the job, fixed, must find them as
    they were), and ``--check`` says a restart fails again until the job changes; the job as the save's resumes."""
    ck = ds_checkpoint(OPT, 4, plugin=True)
    root = private_copy(ck.root, tmp_path / "ckpt")
    refused = resume(3, OPT, root, tmp_path / "refused", base_optimizer="nadam", expect_failure=True)
    assert refused.returncode != 0 and refused.losses == [], refused.log[-3000:]
    assert "may be this job's fault" in refused.log, refused.log[-3000:]
    assert read_verdict(root, NEW) is None and read_verdict(root, OLD) is None
    code, said = _check(root)
    assert code == 1 and said.startswith("a restart fails again: no tag passes"), said
    again = resume(3, OPT, root, tmp_path / "fixed")
    assert again.ok and again.loaded_step == 4, again.log[-3000:]
