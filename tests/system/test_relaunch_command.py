"""``megatron-ucp relaunch``: the launch repeated on the nodes left, as a job script runs it.

A stand-in launch (a shell script) fails while its host file lists a node the probe finds down; the loop drops that
node, relaunches on the rest with their host file in ``PBS_NODEFILE`` and ``{nodes}`` replaced, and records each
launch. A failure with every node up ends the loop with the launch's exit code; the dry run launches nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LAUNCH = """#!/bin/bash
echo "$(paste -sd, "$PBS_NODEFILE") $*" >> launches.txt
grep -q "${FAILS_WITH:-none}" "$PBS_NODEFILE" && exit 7
[ -n "${KILLS_LAST:-}" ] && tail -1 "$PBS_NODEFILE" >> down.txt
exit "${ALWAYS:-0}"
"""


def _relaunch(folder: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    (folder / "hosts").write_text("n0\nn1\nn2\nn3\n")
    script = folder / "launch.sh"
    script.write_text(LAUNCH)
    script.chmod(0o755)
    argv = [sys.executable, "-m", "megatron_ucp.cli", "relaunch", "--hostfile", "hosts", "--root", "ckpt"]
    argv += [*options, "--", "./launch.sh", "--nnodes", "{nodes}"]
    return subprocess.run(argv, cwd=folder, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_a_node_down_is_dropped_and_the_launch_goes_on_on_the_rest(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "test {host} != n2", FAILS_WITH="n2")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "launches.txt").read_text().splitlines() == ["n0,n1,n2,n3 --nnodes 4", "n0,n1,n3 --nnodes 3"]
    assert "1 of 4 node(s) down (n2): relaunching on the 3 left (relaunch 1 of 3)" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "ckpt" / ".ucp" / "relaunches.jsonl").read_text().splitlines()]
    assert [(r["launch"], r["exit"], r.get("down")) for r in records] == [(1, 7, ["n2"]), (2, 0, None)]
    assert (tmp_path / ".cache/megatron_ucp/relaunch/hosts.1").read_text() == "n0\nn1\nn3\n"
    shown = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "status", "ckpt"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "last relaunch loop (" in shown.stdout, shown.stdout + shown.stderr
    assert "launch 1 on 4 node(s) exit 7, down: n2; launch 2 on 3 node(s) ended well" in shown.stdout


def test_a_failure_with_every_node_up_ends_the_loop_with_its_exit_code(tmp_path: Path) -> None:
    done = _relaunch(tmp_path, "--probe", "true", ALWAYS="5")
    assert done.returncode == 5, done.stderr
    assert len((tmp_path / "launches.txt").read_text().splitlines()) == 1
    assert "with all 4 node(s) up: not a node failure" in done.stderr


def test_the_loop_stops_after_its_relaunches(tmp_path: Path) -> None:
    probe = "sh -c '! grep -qx {host} down.txt'"  # each launch takes its last node down with it
    done = _relaunch(tmp_path, "--probe", probe, "--max-restarts", "1", ALWAYS="3", KILLS_LAST="1")
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "launches.txt").read_text().splitlines() == ["n0,n1,n2,n3 --nnodes 4", "n0,n1,n2 --nnodes 3"]
    assert "1 of 3 node(s) down (n2); 1 relaunch(es) already made: stopping" in done.stderr.splitlines()[-1]


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
    assert done.returncode == 2 and "no host file" in done.stderr
