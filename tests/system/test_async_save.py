"""An asynchronous save (``async_save``) under real DeepSpeed (CPU, gloo, DP=2; ZeRO-1 with BF16_Optimizer, ZeRO-3).

The run saves at steps 2 and 4 as the shared synchronous run does: the losses are the synchronous run's step for
step, every file of every tag holds the same tensors (torch.load'ed and compared, the save's random identity
aside), the step-2 save commits at an optimizer step and the step-4 save (the last: no step follows) at the end of
the run, from every rank's record, and (ZeRO-1) each is converted in the background once committed, the last after
the ranks left their process group. A background write that fails (its path taken by a folder: the ``OSError`` a
full or failing file system gives) is said on every rank, naming the file, never becomes ``latest``, and training
goes on.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.convert.universal import universal_state
from megatron_ucp.faults import PAUSE_ENV
from megatron_ucp.format import dsformat as F
from tests.support.dsharness import TrainSpec, run_training
from tests.support.dsharness.checkpoints import session_cache
from tests.support.state_compare import tag_differences

ASYNC = {"async_save": True}
LAYOUTS = {"zero1": {"optimizer": "bf16"}, "zero3": {"optimizer": "zero", "zero_stage": 3}}
CONVERTED = {"zero1": True, "zero3": False}
"""With the background conversion: each save converted once committed, the last one after the process group is gone
(the worker leaves it before it exits)."""


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_async_save_writes_what_a_synchronous_save_writes_and_commits_after_every_rank(tmp_path: Path, layout):
    fields = LAYOUTS[layout]
    sync = session_cache()(dp=2, plugin=True, **fields)
    save = tmp_path / "ckpt"
    res = run_training(
        TrainSpec(
            dp=2,
            steps=4,
            save_dir=save,
            save_at=(2, 4),
            plugin=True,
            plugin_kwargs={**ASYNC, "async_convert": CONVERTED[layout]},
            **fields,
        )
    )
    assert res.returncode == 0, res.log[-3000:]
    assert res.losses == sync.result.losses and len(res.losses) == 4
    assert (save / "latest").read_text().strip() == "global_step4"
    for tag in ("global_step2", "global_step4"):
        assert len(list((save / tag).glob("*.pt"))) == (3 if layout == "zero1" else 4)
        assert tag_differences(save / tag, sync.root / tag) == []
        assert not [p for p in (save / tag).iterdir() if p.name.endswith(".ucp-writing")]
    said = res.log
    assert "global_step2 copied into host memory" in said and "global_step2 committed: every rank's files" in said
    assert "global_step4 committed at the end of the run" in said
    assert said.index("global_step2 committed") < said.index("global_step4 copied into host memory")
    if CONVERTED[layout]:
        for tag in ("global_step2", "global_step4"):
            assert universal_state(save / F.universal_tag(tag)) == "complete", (tag, said[-3000:])


def test_a_background_write_that_fails_is_said_on_every_rank_never_latest_and_training_goes_on(tmp_path: Path):
    save = tmp_path / "ckpt"
    taken = [save / f"global_step{s}" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" for s in (2, 4)]
    for path in taken:
        path.mkdir(parents=True)
    res = run_training(
        TrainSpec(dp=2, steps=4, save_dir=save, save_at=(1, 2, 4), plugin=True, plugin_kwargs=ASYNC, timeout=300)
    )
    assert res.returncode == 0 and res.steps[-1] == 4, res.log[-3000:]  # training went on
    assert (save / "latest").read_text().strip() == "global_step1"
    sections = res.rank_logs()
    assert sorted(sections) == [0, 1], res.log[-3000:]
    for rank, section in sections.items():  # the step-2 failure, agreed at step 3: said on both ranks, by name
        said = f"{taken[0]}: write failed: Is a directory; training goes on (the save is lost"
        assert said in section, (rank, section[-3000:])
        # and again at the end of the run, with the step-4 failure (agreed from each rank's record)
        end = section[section.index("asynchronous save(s) of this run failed") :]
        assert str(taken[0]) in end and str(taken[1]) in end, (rank, end)
    assert f"global_step4 was not committed at the end of the run ({taken[1]}: write failed" in sections[0]
    status = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "status", str(save), "--no-sizes"], capture_output=True, text=True
    )
    assert status.returncode == 0, status.stderr
    for tag in ("global_step2", "global_step4"):
        assert f"{tag}: an asynchronous save of it failed and did not become latest" in status.stdout, status.stdout


def test_retention_removes_a_twin_only_once_a_newer_save_committed(tmp_path: Path):
    """``keep_last=1`` with a save every step: the newest committed save's universal twin is never removed while a
    newer save is still in flight (each removal comes after a later save's commit; the last twin stays)."""
    from megatron_ucp.background.queue import EventKind
    from megatron_ucp.background.store import SAVES_LOG, read_queue, ucp_dir

    save = tmp_path / "ckpt"
    kwargs = {**ASYNC, "async_convert": True, "keep_last": 1}
    res = run_training(TrainSpec(dp=2, steps=4, save_dir=save, save_at=(1, 2, 3, 4), plugin=True, plugin_kwargs=kwargs))
    assert res.returncode == 0, res.log[-3000:]
    assert sorted(p.name for p in save.glob("global_step*_universal")) == ["global_step4_universal"]
    assert universal_state(save / "global_step4_universal") == "complete"
    lines = [json.loads(line) for line in (ucp_dir(save) / SAVES_LOG).read_text().splitlines()]
    committed = {entry["tag"]: entry["at"] for entry in lines if not entry["failure"]}
    assert sorted(committed) == [f"global_step{s}" for s in (1, 2, 3, 4)], lines
    removed = [e for e in read_queue(save).events if e.kind is EventKind.REMOVED]
    assert removed, read_queue(save).events  # retention ran
    for event in removed:
        step = int(event.tag.removeprefix("global_step"))
        newer = [at for tag, at in committed.items() if int(tag.removeprefix("global_step")) > step]
        assert newer and min(newer) <= event.time, (event, committed)


def test_a_job_the_hooks_leave_to_deepspeed_saves_and_loads_as_stock_with_async_save_asked_for(tmp_path: Path):
    """No ZeRO (DeepSpeed's bf16 data parallelism: no layout of the hooks'): with ``async_save`` asked for, every save
    is stock DeepSpeed's own, written before it returns, with one warning; ``latest`` names the last; a restart from
    the first save continues the run exactly."""
    import torch

    from megatron_ucp.integration.handled import STOCK

    save = tmp_path / "ckpt"
    fields = dict(dp=2, optimizer="zero", zero_stage=0, plugin=True, plugin_kwargs=ASYNC)
    first = run_training(TrainSpec(steps=4, save_dir=save, save_at=(2, 4), **fields))
    assert first.returncode == 0, first.log[-3000:]
    warned = [line for line in first.log.splitlines() if "is not one of the layouts megatron-ucp handles" in line]
    assert len(warned) == 1 and STOCK in warned[0], warned
    assert "copied into host memory" not in first.log and "committed" not in first.log, first.log[-3000:]
    assert (save / F.LATEST).read_text().strip() == "global_step4"
    for tag in ("global_step2", "global_step4"):
        assert not [p for p in (save / tag).iterdir() if p.name.endswith(".ucp-writing")]
        states = torch.load(save / tag / F.MODEL_STATES_FILE, weights_only=False)
        assert F.UCP_SAVE_RECORD not in states and states["optimizer"] is not None  # stock's files, whole
    assert not (save / ".ucp").exists()  # nothing of ours: no record, no commit, no conversion
    resumed = run_training(TrainSpec(steps=4, load_dir=save, load_tag="global_step2", **fields))
    assert resumed.returncode == 0 and resumed.loaded_step == 2, resumed.log[-3000:]
    assert resumed.steps == [3, 4] and resumed.losses == first.losses[2:]


@pytest.mark.parametrize("plugin_kwargs", [{}, ASYNC], ids=["sync", "async"])
def test_a_step_saved_twice_with_the_background_conversion_ends_with_one_save_and_its_twin(
    tmp_path: Path, plugin_kwargs
):
    """Megatron saves its last iteration twice when it falls on a save interval (the interval's save, then the end of
    training's): the second save replaces the first while the first is being converted in the background. The folder
    ends with the second save alone, its twin made from it (not stale), no verdict against it, and a restart resumes
    from it, as status says."""
    from megatron_ucp.background.verdicts import read_verdict
    from megatron_ucp.cli import main as cli

    save = tmp_path / "ckpt"
    kwargs = {**plugin_kwargs, "async_convert": True}
    # the race, each time: the first save's conversion pauses after its first parameter, the second save comes then
    slow = {PAUSE_ENV: "global_step2:4:0"}
    spec = TrainSpec(dp=2, steps=2, save_dir=save, save_at=(2, 2), resave_pause=2.0, plugin=True, plugin_kwargs=kwargs)
    res = run_training(dataclasses.replace(spec, env=slow))
    assert res.returncode == 0, res.log[-3000:]
    assert "global_step2 saved again by this run" in res.log, res.log[-3000:]
    if not plugin_kwargs:  # the race happened (an asynchronous first save commits only as the second one starts)
        events = (save / ".ucp" / "events.log").read_text()
        assert "global_step2 was saved again while it was converted" in events, events
    tag = save / "global_step2"
    assert len(list(tag.glob("*optim_states.pt"))) == 2
    assert universal_state(save / F.universal_tag("global_step2"), tag) == "complete", res.log[-3000:]
    assert (save / F.LATEST_UNIVERSAL).read_text().strip() == F.universal_tag("global_step2")
    verdict = read_verdict(save, "global_step2")
    assert verdict is None or verdict.sound, verdict
    assert not list((save / ".ucp" / "replaced").iterdir())  # the first save removed once the second committed
    assert cli(["status", str(save), "--check", "--no-sizes"]) == 0
    restart = run_training(TrainSpec(dp=2, steps=3, load_dir=save, plugin=True, plugin_kwargs=kwargs))
    assert restart.returncode == 0 and restart.loaded_step == 2, restart.log[-3000:]
    assert "FALLING BACK" not in restart.log


def test_a_pipeline_modules_layer_files_each_hold_their_own_layer_save_after_save(tmp_path: Path):
    """DeepSpeed's ``PipelineModule.save_state_dict`` saves each layer from a clone it frees before the next one's
    (0.19.8's expert and model-state saves too): the next clone may get the freed one's address. Copied through the
    asynchronous save's capture, one host slot reused by three saves, every layer file holds its own layer's
    tensors, each in a storage of its own size (as a synchronous save writes it)."""
    from tests.support.dsharness import REPO_ROOT, free_port

    done = subprocess.run(
        [sys.executable, "-m", "tests.support.pipeline_copies", str(free_port())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)},
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("WRONG ")]
    assert done.returncode == 0 and found, done.stderr[-3000:]
    assert json.loads(found[0][len("WRONG ") :]) == []


def test_two_saves_in_flight_each_name_their_own_iteration_in_megatrons_tracker(tmp_path: Path):
    """With two saves in flight (the write of the fourth slowed, so that the fifth is made while it is written),
    each commit writes its own save's iteration into Megatron's tracker, before ``latest``: at the end both name the
    last save."""
    from megatron_ucp.faults import FAULT_ENV

    save = tmp_path / "ckpt"
    kwargs = {**ASYNC, "saves_in_flight": 2}
    spec = TrainSpec(dp=2, steps=5, save_dir=save, save_at=(1, 2, 3, 4, 5), plugin=True, plugin_kwargs=kwargs)
    slow = {FAULT_ENV: "write global_step4/mp_rank_00_model_states.pt:0:pause3"}
    res = run_training(dataclasses.replace(spec, tracker=True, env=slow))
    assert res.returncode == 0, res.log[-3000:]
    assert res.log.index("global_step5 copied into host memory") < res.log.index("global_step4 committed")
    assert (save / F.LATEST).read_text() == "global_step5"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not list((save / ".ucp").glob(".tracker-*-global_step*"))  # every save's own aside taken at its commit


def test_a_job_dying_of_an_exception_with_a_save_in_flight_ends_at_once(tmp_path: Path):
    """Rank 0 dies of an exception right after an asynchronous save; rank 1 waits for it in the next step's
    collective. Rank 0's exit does not wait for rank 1's record (it would wait ``converter_exit_wait``, 10 minutes
    here, while rank 1 waits for it): the job ends within seconds, ``latest`` names the previous save, and the next
    start resumes from it."""
    import time

    save = tmp_path / "ckpt"
    kwargs = {**ASYNC, "converter_exit_wait": 600}
    spec = TrainSpec(
        dp=2, steps=4, save_dir=save, save_at=(2, 3), plugin=True, plugin_kwargs=kwargs, crash=(3, 0), timeout=120
    )
    t0 = time.monotonic()
    res = run_training(dataclasses.replace(spec, expect_failure=True))
    assert res.returncode != 0 and time.monotonic() - t0 < 60, res.log[-3000:]
    assert "rank 0 dies of an exception after step 3" in res.log
    assert (save / F.LATEST).read_text() == "global_step2"
    restart = run_training(TrainSpec(dp=2, steps=4, save_dir=save, load_dir=save, plugin=True, plugin_kwargs=ASYNC))
    assert restart.returncode == 0 and restart.loaded_step == 2, restart.log[-3000:]
