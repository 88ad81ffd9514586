"""What DeepSpeed's own checkpoint tests do with the hooks installed, in the suite's budget (the whole peer suite is
``make peer``: tests/peer/run_peer.py): a load right after an asynchronous save, a worker that ends without exit
handlers, ZeRO's ``elastic_checkpoint`` form (tests/support/peer_cases.py, one small DeepSpeed job each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.format import dsformat as F
from tests.support.dsharness import REPO_ROOT, free_port


def _run(case: str, root: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **extra}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "tests.support.peer_cases",
            case,
            str(root),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_load_right_after_an_asynchronous_save_commits_it_first_and_loads_it(tmp_path: Path):
    # the writer slowed on the model states of each save (2 s): without the waits, the script's read and the load
    # would find the files not yet there
    slow = ",".join(f"write global_step{step}/mp_rank_00_model_states.pt:*:pause2" for step in (1, 2))
    done = _run("save-load", tmp_path / "ckpt", MEGATRON_UCP_TEST_FAULT=slow)
    assert done.returncode == 0, done.stderr[-3000:]
    # a script that reads the files itself waits for the save first
    assert "READ global_step1 4" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "LOADED global_step2 2 same=True" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "this load waits for 1 save(s) in flight to commit" in done.stderr


def test_a_worker_that_ends_without_exit_handlers_commits_its_last_save_when_it_leaves_its_group(tmp_path: Path):
    root = tmp_path / "ckpt"
    done = _run("exit-without-handlers", root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / F.LATEST).read_text() == "global_step2"
    assert not [p for p in (root / "global_step2").iterdir() if p.name.endswith(".ucp-writing")]


@pytest.mark.parametrize("case", ["elastic"])
def test_an_elastic_checkpoint_saves_and_loads_as_stock_with_one_warning(tmp_path: Path, case: str):
    done = _run(case, tmp_path / "ckpt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED elastic=True 2" in done.stdout and "LOADED elastic=False 2" in done.stdout, done.stdout
    warned = [line for line in done.stderr.splitlines() if "elastic_checkpoint" in line and "megatron-ucp" in line]
    assert warned and all("WARNING" in line for line in warned), warned
    # one warning each, from the first rank: the job that saves in that form runs as stock; the load of such a save
    # by a job that does not is DeepSpeed's own
    assert len(warned) == 2, warned
    assert "this job saves, loads and resumes as stock DeepSpeed does" in warned[0], warned
    assert "loaded by DeepSpeed's own load, as without megatron-ucp" in warned[1], warned
