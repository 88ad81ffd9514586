"""The preload launcher (tests/support/preload), which the tests use in place of torchrun and of fresh interpreters:
a rank forked from it sees what a rank started by torchrun sees, and a job fails, stops and exits as under torchrun.

The script is plain Python: these checks cost the launches, not training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dsharness.launch import HARNESS_IMPORTS, free_port
from tests.support.preload import pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux only")

SCRIPT = """
import atexit, json, os, signal, sys, time
rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode == "report":
    atexit.register(lambda: print("exit handler of rank", rank, flush=True))
    import concurrent.futures
    POOL = concurrent.futures.ThreadPoolExecutor(1)  # left open, as torch's compiler leaves its pool: an idle worker
    POOL.submit(int).result()
    report = json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "env": {k: v for k, v in os.environ.items() if k not in SKIP}, "session_leader": os.getsid(0) == os.getpid(),
    })
    # a file per rank: two ranks' long lines on one shared stdout can interleave
    with open(os.path.join(os.environ["REPORT_DIR"], f"report-{rank}.json"), "w") as f:
        f.write(report)
elif mode == "fail":
    signal.signal(signal.SIGTERM, lambda *a: (print("rank", rank, "got SIGTERM", flush=True), sys.exit(9)))
    if rank == 1:
        sys.exit(3)
    time.sleep(120)
elif mode == "sleep":
    print("rank", rank, "sleeping as", os.getpid(), flush=True)
    time.sleep(120)
"""
SKIP = {"_", "OLDPWD", "PWD", "SHLVL", "REPORT_DIR"}  # REPORT_DIR: each launch its own


def _port() -> int:
    return free_port()


def _env(report_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if report_dir is not None:
        env["REPORT_DIR"] = str(report_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(pool.REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job" / "script.py"
    path.parent.mkdir()
    path.write_text(f"SKIP = {SKIP!r}\n" + SCRIPT)
    return path


def _launch(command: list[str], script: Path, mode: str, cwd: Path, report_dir: Path | None = None):
    return subprocess.Popen(
        [*command, str(script), mode],
        cwd=cwd,
        env=_env(report_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _forked(nproc: int, port: int) -> list[str]:
    command = pool.launch_command(_env(), nproc, port, imports=HARNESS_IMPORTS)
    if command is None:
        pytest.skip("the preload server does not fork here (its imports left a thread)")
    return command


def _torchrun(nproc: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(port)]  # fmt: skip


def _reports(report_dir: Path) -> dict[int, dict]:
    reports = [json.loads(path.read_text()) for path in sorted(report_dir.glob("report-*.json"))]
    return {int(r["env"]["RANK"]): r for r in reports}


def test_a_forked_rank_sees_what_a_rank_started_by_torchrun_sees(script: Path, tmp_path: Path):
    port = _port()
    seen = {}
    for name, command in (("torchrun", _torchrun(2, port)), ("forked", _forked(2, port))):
        report_dir = tmp_path / f"reports-{name}"
        report_dir.mkdir()
        out, _ = _launch(command, script, "report", tmp_path, report_dir).communicate(timeout=120)
        seen[name] = _reports(report_dir)
        assert sorted(seen[name]) == [0, 1], out
        # every rank exited (an idle pool worker told to leave, as at an interpreter's exit), its exit handlers run
        assert out.count("exit handler of rank") == 2, out
    for rank in (0, 1):
        torchrun, forked = seen["torchrun"][rank], seen["forked"][rank]
        for key in ("argv", "path0", "cwd", "name"):
            assert forked[key] == torchrun[key], key
        # what torchrun's agent adds and ours does not: its own store (rank 0 hosts it here, as with env://), its
        # error file, NCCL's setting, the signals the agent itself handles
        agent_only = {
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
        }
        assert set(torchrun["env"]) - agent_only - set(forked["env"]) == set()
        assert set(forked["env"]) - set(torchrun["env"]) == set()
        differing = {k for k in forked["env"] if forked["env"][k] != torchrun["env"].get(k)}
        assert differing <= {"TORCHELASTIC_RUN_ID"}, differing
        assert forked["session_leader"]


def test_a_failing_rank_stops_the_others_and_the_job_exits_1(script: Path, tmp_path: Path):
    proc = _launch(_forked(2, _port()), script, "fail", tmp_path)
    out, _ = proc.communicate(timeout=60)  # rank 0 sleeps 120 s unless stopped
    assert proc.returncode == 1, out
    assert "rank 1 exited with status 3; sending SIGTERM to the other ranks" in out, out
    assert "rank 0 got SIGTERM" in out, out


def test_a_launch_asked_to_stop_stops_its_ranks(script: Path, tmp_path: Path):
    proc = _launch(_forked(2, _port()), script, "sleep", tmp_path)
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        if "sleeping as" in line:
            pids.append(int(line.split()[-1]))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "the launch was asked to stop" in out, out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
