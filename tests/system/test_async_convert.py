"""Asynchronous conversion with real DeepSpeed (CPU, gloo, 4 processes as two pretend nodes of 2).

One training run (module fixture) exercises every scenario, because a DeepSpeed start costs about
a minute on the test machines:

* saves at steps 1, 2, 3 in quick succession: ``global_step1`` converts at once (two converters,
  one per pretend node, one commit; node 1's pauses a few seconds, so a save that waited for the
  conversion would return after the commit); ``global_step2`` is replaced by ``global_step3`` before its
  conversion starts (skipped, reported in the training log); ``global_step3`` converts next;
* node 0's converter of ``global_step3`` pauses after its first parameter (fault injection) and the
  test SIGKILLs it: nothing looks finished, ``latest_universal`` does not move, the training's
  exit handler reports the unfinished conversion;
* afterwards the next trigger (what both nodes' launchers do after a save) converts it, and
  ``megatron-ucp convert`` completes it from the dead staging folder as well.

A copy of the root right after the run (``snapshot``) keeps the killed state for the assertions
while the recovery tests write into the live root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ucp.background import queue as B
from megatron_ucp.background.status import UniversalStatus, root_status
from megatron_ucp.background.store import ConverterSettings, read_queue, read_registrations, ucp_dir
from megatron_ucp.background.trigger import trigger, wait_for_converter
from megatron_ucp.cli import main as cli_main
from megatron_ucp.convert.universal import COMPLETE, inspect_staging, staging_path, universal_state
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.faults import PAUSE_ENV as FAULT_PAUSE_ENV
from megatron_ucp.format import dsformat as F
from tests.support.dsharness import TrainResult, TrainSpec, run_training

pytestmark = pytest.mark.slow

KILL_TAG = "global_step3"
STEP1_PAUSE_S = 3
"""Node 1's converter of global_step1 pauses this long: the commit cannot come before save returned,
however fast the converter (it starts in ~0.2 s), unless save waited for it."""


@dataclass
class AsyncRun:
    root: Path
    snapshot: Path
    dumps: Path
    result: TrainResult
    killed_pid: int
    tmp: Path


def _kill_converters(root: Path) -> None:
    for reg in read_registrations(root).values():
        try:
            os.killpg(os.getpgid(reg.pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncRun:
    tmp = tmp_path_factory.mktemp("async")
    root, dumps = tmp / "ckpt", tmp / "dumps"
    spec = TrainSpec(
        dp=4,
        optimizer="bf16",
        steps=3,
        save_dir=root,
        save_at=(1, 2, 3),
        dump_dir=dumps,
        plugin=True,
        plugin_kwargs={"async_convert": True, "ranks_per_node": 2, "keep_last": 1, "converter_exit_wait": 150},
        env={FAULT_PAUSE_ENV: f"global_step1:{STEP1_PAUSE_S}:1,{KILL_TAG}:300:0"},
        timeout=400,
    )
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", run_training(spec)), daemon=True)
    thread.start()
    paused = ucp_dir(root) / B.log_name(KILL_TAG, 0, 2)
    deadline = time.monotonic() + 300
    try:
        while not (paused.is_file() and "fault injection" in paused.read_text()):
            assert thread.is_alive() or "result" in box, "training ended before the converter paused"
            assert time.monotonic() < deadline, "node 0's converter never reached the pause"
            time.sleep(0.2)
        reg = read_registrations(root)[0]
        os.killpg(os.getpgid(reg.pid), signal.SIGKILL)  # the converter leads its own session
        thread.join(timeout=300)
        assert "result" in box, "training did not finish after the converter was killed"
        for node in (0, 1):  # node 1's converter notices the dead share and exits
            assert wait_for_converter(root, node, timeout=60)
        snapshot = tmp / "snapshot"
        shutil.copytree(root, snapshot, symlinks=True)
        yield AsyncRun(root=root, snapshot=snapshot, dumps=dumps, result=box["result"], killed_pid=reg.pid, tmp=tmp)
    finally:
        _kill_converters(root)


def _events(root: Path, tag: str, kind: B.EventKind) -> list[B.Event]:
    return [e for e in read_queue(root).events if e.tag == tag and e.kind is kind]


def test_save_returns_before_the_universal_folder_exists(run: AsyncRun):
    # the dump is written right after save_checkpoint(global_step1) returned; the commit came later
    (complete,) = _events(run.snapshot, "global_step1", B.EventKind.COMPLETE)
    committed_at = (run.snapshot / "global_step1_universal" / F.MANIFEST_FILE).stat().st_mtime
    returned_at = (run.dumps / "rank0_step1.pt").stat().st_mtime
    assert returned_at < committed_at <= complete.time
    assert "global_step1 queued for background conversion on 2 node(s)" in run.result.log


def test_two_nodes_one_commit_bit_exact(run: AsyncRun):
    folder = run.snapshot / "global_step1_universal"
    assert universal_state(folder) == COMPLETE
    assert (run.snapshot / F.LATEST_UNIVERSAL).read_text().strip() == "global_step1_universal"
    manifest = json.loads((folder / F.MANIFEST_FILE).read_text())
    assert manifest["shares"] == 2 and manifest["source"]["dp"] == 4
    report = verify_universal(folder, source=run.snapshot / "global_step1")
    assert report.ok, report.problems
    assert report.checksummed == len(manifest["checksums"]["files"]) == 27  # both nodes' shares recorded theirs
    logs = [ucp_dir(run.snapshot) / B.log_name("global_step1", i, 2) for i in (0, 1)]
    texts = [p.read_text() for p in logs]
    assert "share 1 of 2" in texts[0] and "share 2 of 2" in texts[1]
    assert sum(t.count("global_step1: complete") for t in texts) == 1  # exactly one converter committed
    assert len(_events(run.snapshot, "global_step1", B.EventKind.COMPLETE)) == 1


def test_newest_pending_wins_and_the_skip_is_reported(run: AsyncRun):
    assert universal_state(run.snapshot / "global_step2_universal") == "absent"
    assert staging_path(run.snapshot / "global_step2_universal").exists() is False
    (skip,) = _events(run.snapshot, "global_step2", B.EventKind.SKIPPED)
    assert "global_step3" in skip.message
    assert "global_step2: skipped" in (ucp_dir(run.snapshot) / "events.log").read_text()
    assert "background conversion: global_step2: skipped" in run.result.log  # the training log, at the next save
    assert (run.snapshot / "global_step2").is_dir()  # the native checkpoint is untouched


def test_killed_converter_leaves_nothing_that_looks_finished(run: AsyncRun):
    snap = run.snapshot
    twin = snap / f"{KILL_TAG}_universal"
    assert universal_state(twin) == "absent"
    assert (snap / F.LATEST_UNIVERSAL).read_text().strip() == "global_step1_universal"  # did not move
    info = inspect_staging(twin)
    assert info is not None and not info.is_live(60.0)  # a dead staging folder, recognisably unfinished
    assert info.shares_done == (1,)  # node 1 finished its share; node 0 was killed mid-way
    assert any((info.path / F.UNIVERSAL_ZERO_DIR).rglob("*.pt"))
    assert not (info.path / F.MANIFEST_FILE).exists()
    finished = [p for p in snap.iterdir() if p.name.endswith(F.UNIVERSAL_SUFFIX) and universal_state(p) != "absent"]
    assert [p.name for p in finished] == ["global_step1_universal"]
    assert _events(snap, KILL_TAG, B.EventKind.INTERRUPTED)
    assert "did not finish before exit" in run.result.log and f"--tag {KILL_TAG}" in run.result.log

    status = {t.tag: t for t in root_status(snap).tags}
    assert status[KILL_TAG].universal is UniversalStatus.INTERRUPTED
    assert status["global_step2"].universal is UniversalStatus.SKIPPED
    assert status["global_step1"].universal is UniversalStatus.COMPLETE and status["global_step1"].dp == 4
    assert status["global_step1"].seconds is not None and status["global_step1"].universal_bytes > 0
    # a restart resumes from the latest tag all the same (its native files; the twin is for other changes)
    assert cli_main(["status", str(snap), "--check"]) == 0


def test_convert_completes_an_interrupted_conversion(run: AsyncRun, tmp_path: Path):
    copy = tmp_path / "ckpt"
    shutil.copytree(run.snapshot, copy, symlinks=True)
    assert cli_main(["convert", str(copy), "--tag", KILL_TAG, "--no-progress"]) == 0  # takes over the dead staging
    twin = copy / f"{KILL_TAG}_universal"
    assert verify_universal(twin, source=copy / KILL_TAG).ok
    assert not staging_path(twin).exists()
    assert cli_main(["status", str(copy), "--check"]) == 0


def test_next_trigger_recovers(run: AsyncRun):
    settings = ConverterSettings(keep_last=1)
    results = [trigger(run.root, KILL_TAG, node, 2, settings, report=node == 0) for node in (0, 1)]
    assert results[0].spawned and results[1].spawned
    assert any(e.kind is B.EventKind.CLEANED and e.tag == KILL_TAG for e in results[0].events)
    for node in (0, 1):
        assert wait_for_converter(run.root, node, timeout=120)
    twin = run.root / f"{KILL_TAG}_universal"
    assert universal_state(twin) == COMPLETE
    assert verify_universal(twin, source=run.root / KILL_TAG).ok
    assert (run.root / F.LATEST_UNIVERSAL).read_text().strip() == twin.name
    # keep_last=1: the older universal folder goes, every native checkpoint stays
    assert not (run.root / "global_step1_universal").exists()
    assert all((run.root / f"global_step{s}").is_dir() for s in (1, 2, 3))
    assert not list(run.root.glob(f".*{F.STAGING_SUFFIX}"))
    state = read_queue(run.root)
    assert state.active is None and state.pending is None
    assert read_registrations(run.root) == {}


def test_the_converters_path_never_shadows_deepspeed(tmp_path):
    """The converter's PYTHONPATH holds the folder above the package, not the package folder: there its
    ``deepspeed`` subpackage became the top-level ``deepspeed`` for anything the converter imports
    (IPEX imports DeepSpeed at start, so on the torch 2.8 + IPEX stack every conversion that needed a
    DeepSpeed class failed with ``No module named 'deepspeed.utils'``)."""
    import subprocess
    import sys

    import deepspeed

    from megatron_ucp.background.trigger import converter_env

    env = converter_env(ConverterSettings())
    code = "import deepspeed, megatron_ucp; print(deepspeed.__file__); print(megatron_ucp.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ds_file, ucp_file = proc.stdout.split()[-2:]
    assert Path(ds_file) == Path(deepspeed.__file__), ds_file
    assert Path(ucp_file).parent.parent == Path(env["PYTHONPATH"].split(os.pathsep)[0]), env["PYTHONPATH"]
