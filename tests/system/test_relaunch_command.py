"""``megatron-ucp relaunch``: the launch repeated on the nodes left, as a job script runs it.

A stand-in launch (a shell script) fails while its host file lists a node the probe finds down; the loop drops that
node, relaunches on the rest with their host file (in the original's form) in ``PBS_NODEFILE`` and ``HOSTFILE`` and
``{nodes}`` replaced, and records each launch in the checkpoint root's store, which ``status`` shows. A failure with
every node up ends the loop with the launch's exit code; a SIGTERM to the loop reaches the launch and ends the loop; a
probe that fails before the first launch turns the loop off; the dry run launches nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LAUNCH = r"""#!/bin/bash
[ -n "${KILLS:-}" ] && echo "$KILLS" >> down.txt
nodes="$(grep -v '^#' "$PBS_NODEFILE" | cut -d' ' -f1 | paste -sd, -)"
echo "$nodes $* HOSTFILE=$([ "$HOSTFILE" = "$PBS_NODEFILE" ] && echo same)" >> launches.txt
grep -q "${FAILS_WITH:-none}" "$PBS_NODEFILE" && exit 7
[ -n "${KILLS_LAST:-}" ] && tail -1 "$PBS_NODEFILE" | cut -d' ' -f1 >> down.txt
[ -n "${SELF_KILL:-}" ] && kill -9 $$
if [ -n "${SLEEPS:-}" ]; then
  bash -c "trap 'echo grandchild \$1 >> launches.txt; exit 1' TERM INT; sleep 60 & wait" _ got &  # a launcher's rank
  trap 'echo terminated >> launches.txt' TERM INT; wait; wait; exit 143
fi
exit "${ALWAYS:-0}"
"""
HOSTS = "# allocation\nn0 slots=2\nn1 slots=2\nn2 slots=2\nn3 slots=2\n"


def _argv(*options: str) -> list[str]:
    argv = [sys.executable, "-m", "megatron_ucp.cli", "relaunch", "--hostfile", "hosts", "--root", "ckpt"]
    return [*argv, "--state-dir", "state", *options, "--", "./launch.sh", "--nnodes", "{nodes}"]


def _setup(folder: Path) -> None:
    (folder / "hosts").write_text(HOSTS)
    script = folder / "launch.sh"
    script.write_text(LAUNCH)
    script.chmod(0o755)


def _relaunch(folder: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    _setup(folder)
    return subprocess.run(
        _argv(*options), cwd=folder, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "ckpt" / ".ucp" / "relaunches.jsonl").read_text().splitlines()]


def test_a_node_down_is_dropped_and_the_launch_goes_on_on_the_rest(tmp_path: Path) -> None:
    probe = "sh -c '! grep -qx {host} down.txt'"  # n2 answers until the first launch takes it down
    done = _relaunch(tmp_path, "--probe", probe, FAILS_WITH="n2", KILLS="n2")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "launches.txt").read_text().splitlines() == [
        "n0,n1,n2,n3 --nnodes 4 HOSTFILE=same",
        "n0,n1,n3 --nnodes 3 HOSTFILE=same",
    ]
    assert "1 of 4 node(s) down (n2): relaunching on the 3 left (relaunch 1 of 3) [probe: n2 (exit 1)]" in done.stderr
    ended = [(r["launch"], r["exit"], r.get("down")) for r in _records(tmp_path) if "exit" in r]
    assert ended == [(1, 7, ["n2"]), (2, 0, None)]
    assert (tmp_path / "state" / "hosts.1").read_text() == "n0 slots=2\nn1 slots=2\nn3 slots=2\n"  # its own form
    shown = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "status", "ckpt"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "launch 1 on 4 node(s) exit 7, down: n2; launch 2 on 3 node(s) ended well" in shown.stdout, shown.stdout


def test_a_failure_with_every_node_up_ends_the_loop_with_its_exit_code(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "true", ALWAYS="5")
    assert done.returncode == 5, done.stderr
    assert len((tmp_path / "launches.txt").read_text().splitlines()) == 1
    assert "with all 4 node(s) up: not a node failure" in done.stderr


def test_a_launch_killed_by_a_signal_exits_as_a_shell_says_it(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "true", SELF_KILL="1")
    assert done.returncode == 137, done.stderr
    assert "failed (exit 137)" in done.stderr


def test_the_loop_stops_after_its_relaunches(tmp_path: Path) -> None:
    probe = "sh -c '! grep -qx {host} down.txt'"  # each launch takes its last node down with it
    done = _relaunch(tmp_path, "--probe", probe, "--max-restarts", "1", ALWAYS="3", KILLS_LAST="1")
    assert done.returncode == 3, done.stderr
    assert [line.split()[0] for line in (tmp_path / "launches.txt").read_text().splitlines()] == [
        "n0,n1,n2,n3",
        "n0,n1,n2",
    ]
    assert "1 of 3 node(s) down (n2); 1 relaunch(es) already made: stopping" in done.stderr


def test_a_probe_that_fails_before_the_first_launch_turns_the_loop_off(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "no-such-probe-command {host}", FAILS_WITH="n2")
    assert done.returncode == 7, done.stderr
    assert "it cannot tell a lost node here; launching once on every node, no relaunch" in done.stderr
    assert "the probe cannot run" in done.stderr
    assert len((tmp_path / "launches.txt").read_text().splitlines()) == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_loop_reaches_the_whole_launch_and_ends_the_loop(tmp_path: Path, signum: int) -> None:
    _setup(tmp_path)
    loop = subprocess.Popen(
        _argv("--probe", "true"), cwd=tmp_path, env={**os.environ, "SLEEPS": "1"}, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 60
    while not (tmp_path / "launches.txt").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the launch's traps are set
    loop.send_signal(signum)
    _, err = loop.communicate(timeout=60)
    assert loop.returncode == 128 + signum, err
    seen = (tmp_path / "launches.txt").read_text().splitlines()
    assert "terminated" in seen, seen
    if signum == signal.SIGTERM:  # and what the launch started (a shell's background job ignores SIGINT)
        assert "grandchild got" in seen, seen
    name = signal.Signals(signum).name
    assert f"stopped by {name}" in err and "no relaunch" in err
    assert _records(tmp_path)[-1]["decision"] == f"stopped by {name}"


def test_a_launch_that_cannot_start_is_said_and_ends_the_loop(tmp_path: Path) -> None:
    _setup(tmp_path)
    argv = [*_argv("--probe", "true")[:-3], "./no-such-launch.sh"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 127, done.stderr
    assert "cannot start the launch ./no-such-launch.sh" in done.stderr
    assert [r.get("exit") for r in _records(tmp_path) if "exit" in r] == [127]


def test_a_node_down_before_the_first_launch_is_left_out_of_it(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "test {host} != n1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "launches.txt").read_text().split()[0] == "n0,n2,n3"
    assert "1 of 4 node(s) down before the first launch (n1): launching on the 3 left" in done.stderr


def test_the_dry_run_launches_nothing_and_says_what_it_would_do(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, UCP_DRY_RUN="1")
    assert done.returncode == 0 and not (tmp_path / "launches.txt").exists()
    assert "(dry run) launch 1 on 4 node(s) (n0, n1, n2, n3)" in done.stderr and "--nnodes 4" in done.stderr
    assert "at most 3 time(s)" in done.stderr


def test_no_host_file_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PBS_NODEFILE"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "relaunch", "--", "true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "megatron-ucp relaunch: error: relaunch: no host file" in done.stderr
