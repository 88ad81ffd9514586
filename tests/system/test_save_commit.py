"""A failed save never becomes ``latest``: every rank learns of one rank's failed write within seconds.

Real DeepSpeed (CPU, gloo, DP=2, BF16_Optimizer), saves at steps 2 and 4. The write of rank 1's optimizer file
of step 4 fails for real: its path is taken by a folder before the run, so ``torch.save`` on that rank raises
``IsADirectoryError`` (what a full or failing file system does to one rank: an ``OSError`` from the write). Stock
DeepSpeed would write ``latest = global_step4`` on rank 0 and leave rank 0 in the barrier until the collective
timeout (30 minutes); with the hooks every rank raises one error naming rank 1, its file and the OS error, and
``latest`` still names global_step2.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.dsharness import TrainSpec, run_training

FAILED_AT = 4


def test_a_write_that_fails_on_one_rank_stops_every_rank_and_latest_stays(tmp_path: Path):
    save = tmp_path / "ckpt"
    taken = save / f"global_step{FAILED_AT}" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    taken.mkdir(parents=True)
    res = run_training(
        TrainSpec(
            dp=2, steps=FAILED_AT, save_dir=save, save_at=(2, FAILED_AT), plugin=True, expect_failure=True, timeout=300
        )
    )
    assert res.returncode not in (0, 124), res.log[-3000:]  # failed, and not killed at the harness's timeout
    assert res.steps[-1] == FAILED_AT and res.losses, res.log[-3000:]  # it trained up to the failed save
    said = res.log
    assert f"saving global_step{FAILED_AT} in {save}" in said and "failed on 1 rank(s) (global rank 1)" in said
    assert f"{taken}: write failed: Is a directory" in said, said[-3000:]
    assert (save / "latest").read_text().strip() == "global_step2"
    # both ranks raised the one error (rank 0 did not wait in the barrier for the collective timeout)
    sections = res.rank_logs()
    assert sorted(sections) == [0, 1], res.log[-3000:]
    for rank, section in sections.items():
        raised = [line for line in section.splitlines() if f"SaveFailedError: saving global_step{FAILED_AT}" in line]
        assert len(raised) == 1, (rank, section[-3000:])
