"""A restart never dies on a bad newest tag: it falls back to the newest sound one, loudly, on its own.

Real DeepSpeed (CPU, gloo): the session's hooked DP=4 checkpoint of BF16_Optimizer (tags global_step2 and
global_step4, ``latest`` = global_step4), its global_step4 damaged as a file system would damage it, resumed at
DP=3 with no tag (the tag ``latest`` names, as Megatron loads):

* a rank file cut short: the binding of every rank file before DeepSpeed's load refuses global_step4 on every
  rank, and the restart loads global_step2 instead;
* one bit flipped in a hooked rank file (the file whole): the native reshard's own check against the save's
  checksums refuses global_step4 on every rank, and the restart loads global_step2 instead;
* ``--ucp-no-fallback``: the cut-short file's error, nothing trained.

Each fallback loads global_step2 bit for bit, continues the uninterrupted curve, says which tag failed and why,
which loaded and how many iterations that lost, records it in the store, and leaves global_step4 as it was. The
judge itself (a recorded verdict, tags ordered by step) is checked on synthetic saves, without DeepSpeed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from megatron_ucp.background.status import format_status, root_status
from megatron_ucp.background.store import read_fallbacks, read_verdict, record_verdict
from megatron_ucp.cli import main
from megatron_ucp.convert.universal import source_identity
from megatron_ucp.deepspeed.reader import find_checkpoint_files
from megatron_ucp.integration import fallback
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    assert_same_state,
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


@pytest.mark.parametrize("damage", ["cut-short", "flipped-bit"])
def test_a_restart_falls_back_to_the_newest_sound_tag(ds_checkpoint, runs, damage: str):
    ck, (res, root, victim, before) = _resumed(ds_checkpoint, runs, damage)
    assert res.ok, res.log[-3000:]
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"])
    assert_losses_continue(res, ck.loss_at)

    said = res.log[res.log.index("FALLING BACK") :]
    assert f"names {NEW}, which cannot be resumed" in said and str(victim) in said, said[:3000]
    assert f"loading {OLD} instead (loses 2 iterations)" in said
    # tried, refused on every rank by the load's own checks (the binding of every rank file before DeepSpeed's load;
    # the partitions against the save's checksums), then the older tag
    assert f"the restart cannot load {NEW}" in res.log
    assert ("checksum" if damage == "flipped-bit" else "unreadable") in res.log, res.log[-3000:]
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
    said = res.log[res.log.index("FALLING BACK") :]
    assert "not finite" in said and "'exp_avg_sq' of " in said and ": 1 NaN and 0 Inf of " in said, said[:3000]
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
    assert fallback._older_than(root, tags[2]) == [tags[1], tags[0]]
    assert fallback._judge(root, tags[2], through_twin=False) == ()

    identity = source_identity(find_checkpoint_files(root / tags[2]).identity_files())
    record_verdict(
        root, tags[2], ["r1.pt: 1 NaN and 0 Inf in 'exp_avg' of parameter 'w'"], "background conversion", identity
    )
    assert fallback._judge(root, tags[2], through_twin=False) == (
        "r1.pt: 1 NaN and 0 Inf in 'exp_avg' of parameter 'w' (found by background conversion)",
    )
    record_verdict(root, tags[1], ["stale"], "megatron-ucp verify", {"other": [1, 2]})
    assert fallback._judge(root, tags[1], through_twin=False) == ()  # judged on other files: checked again
    assert "no complete universal twin" in fallback._judge(root, tags[1], through_twin=True)[0]

    assert fallback._lost(tags[2], tags[1]) == "90 iterations"


def _refused_on_one_rank(rank: int, root: str, store: str, out: str) -> None:
    """One rank of a two-rank job whose load of the newest tag is refused on rank 1 only (as one DP group's damaged
    file refuses it at TP 2): through the load's agreement, as the hooks load, both ranks go on to the older tag
    together."""
    import json

    import torch.distributed as dist

    from megatron_ucp.errors import CheckpointFormatError
    from megatron_ucp.integration.collectives import agreed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tried: list = []

    def load(name):
        def step():
            tried.append(name)
            if name is None and rank == 1:
                raise CheckpointFormatError(f"{root}/{NEW}/rank1.pt: cut short (rank {rank})", subject=root)
            return name or NEW

        return agreed(step, f"loading {name or 'latest'}")

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
