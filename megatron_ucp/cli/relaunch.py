"""``megatron-ucp relaunch [options] -- COMMAND...``: a launch repeated on the nodes left after a node failure.

Each launch gets its own host file (``PBS_NODEFILE`` in its environment; ``{hostfile}`` and ``{nodes}`` in COMMAND
replaced), so that a launcher that reads either (ezpz and ALCF's helpers.sh read ``PBS_NODEFILE``; mpiexec takes
``--hostfile {hostfile}``, torchrun ``--nnodes {nodes}``) starts on the nodes left. The decision after each failure is
:func:`megatron_ucp.plan.relaunch.after_failure`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.background.store import RELAUNCHES_LOG, append_line
from megatron_ucp.cli import add_shared
from megatron_ucp.errors import UcpError
from megatron_ucp.plan.relaunch import after_failure, hosts_of

DEFAULT_PROBE = "ssh -o BatchMode=yes -o ConnectTimeout=10 {host} true"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "relaunch",
        help="run a training launch; when it fails, drop the nodes that are down and relaunch on the rest",
        description="Runs COMMAND on the allocation's nodes. When it fails, each node is probed; the ones that do not "
        "answer are dropped and COMMAND runs again on the rest, at the new node count (the elastic resume reshards "
        "the checkpoint to it; train_aGPT_7B_ucp.sh keeps the checkpoint's global batch where it divides). A launch "
        "that fails with every node up is not repeated. Each launch's host file is in PBS_NODEFILE; {hostfile} and "
        "{nodes} in COMMAND are replaced by it and by its node count. UCP_DRY_RUN=1 (or --dry-run) prints what it "
        "would do and launches nothing.",
    )
    p.add_argument("--hostfile", type=Path, help="the allocation's nodes (default: $PBS_NODEFILE)")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches at most (default 3)")
    p.add_argument("--min-nodes", type=int, default=1, help="stop when fewer nodes are left (default 1)")
    p.add_argument("--probe", default=DEFAULT_PROBE, help="a command that succeeds on a live node; {host} replaced")
    p.add_argument("--probe-timeout", type=float, default=30.0, help="seconds a node has to answer (default 30)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".cache/megatron_ucp/relaunch"),
        help="where each launch's host file is written; must be visible on every node (default: "
        ".cache/megatron_ucp/relaunch under the current folder)",
    )
    p.add_argument(
        "--root",
        type=Path,
        help="the checkpoint root: each launch (its nodes, how it ended, the nodes found down) is recorded in its "
        ".ucp/ store, where `megatron-ucp status` shows the last",
    )
    add_shared(p, "--no-progress", "accepted as every command accepts it (the loop draws no progress bar)")
    p.add_argument("--dry-run", action="store_true", help="print what would run; launch nothing (also UCP_DRY_RUN=1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launch command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UcpError("relaunch: no command given (megatron-ucp relaunch [options] -- COMMAND...)")
    source = args.hostfile or (Path(os.environ["PBS_NODEFILE"]) if os.environ.get("PBS_NODEFILE") else None)
    if source is None:
        raise UcpError("relaunch: no host file (--hostfile, or PBS_NODEFILE set by the scheduler)")
    hosts = hosts_of(source.read_text().splitlines())
    if not hosts:
        raise UcpError(f"{source}: lists no host", subject=source)
    if args.dry_run or os.environ.get("UCP_DRY_RUN") == "1":
        return _dry_run(args, hosts, command)
    restarts = 0
    while True:
        hostfile = _write_hostfile(args.state_dir, restarts, hosts)
        argv = _filled(command, hostfile, hosts)
        _say(f"launch {restarts + 1} on {len(hosts)} node(s) ({_shown(hosts)}): {shlex.join(argv)}")
        t0 = time.time()
        code = _launch(argv, {"PBS_NODEFILE": str(hostfile), "UCP_RELAUNCH": str(restarts)})
        record: dict[str, Any] = {
            "launch": restarts + 1,
            "hosts": hosts,
            "exit": code,
            "seconds": round(time.time() - t0),
        }
        if code == 0:
            _say(f"launch {restarts + 1} ended well after {record['seconds']}s")
            _record(args.root, record)
            return 0
        down = _probe(hosts, args.probe, args.probe_timeout)
        decision = after_failure(hosts, down, code, restarts, args.max_restarts, args.min_nodes)
        _say(f"launch {restarts + 1} failed (exit {code}) after {record['seconds']}s: {decision.why}")
        _record(args.root, {**record, "down": down, "decision": decision.why})
        if decision.hosts is None:
            return decision.code or 1
        hosts, restarts = list(decision.hosts), restarts + 1


def _dry_run(args: argparse.Namespace, hosts: list[str], command: Sequence[str]) -> int:
    hostfile = args.state_dir / "hosts.0"
    _say(
        f"(dry run) launch 1 on {len(hosts)} node(s) ({_shown(hosts)}): PBS_NODEFILE={hostfile} "
        f"{shlex.join(_filled(command, hostfile, hosts))}"
    )
    _say(
        f"(dry run) on a failure: each node probed with `{args.probe}` ({args.probe_timeout:g}s), those that do not "
        f"answer dropped, the launch repeated on the rest, at most {args.max_restarts} time(s), while at least "
        f"{max(1, args.min_nodes)} node(s) are left; a failure with every node up ends the loop"
    )
    return 0


def _filled(command: Sequence[str], hostfile: Path, hosts: Sequence[str]) -> list[str]:
    return [word.replace("{hostfile}", str(hostfile)).replace("{nodes}", str(len(hosts))) for word in command]


def _write_hostfile(folder: Path, restarts: int, hosts: Sequence[str]) -> Path:
    """This launch's host file, written whole before it is used (a temporary name, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / f"hosts.{restarts}").resolve()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{host}\n" for host in hosts))
    os.replace(tmp, path)
    return path


def _launch(argv: Sequence[str], env: dict[str, str]) -> int:
    """The launch, its output the job's; a SIGTERM (walltime, qdel) is passed on to it and ends the loop."""
    child = subprocess.Popen(list(argv), env={**os.environ, **env})

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)
        child.wait()
        sys.exit(128 + signum)

    before = signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGTERM, before)


def _probe(hosts: Sequence[str], probe: str, timeout: float) -> list[str]:
    """The hosts whose probe fails or does not answer in time, in order (probed at once)."""

    def down(host: str) -> bool:
        try:
            argv = [word.replace("{host}", host) for word in shlex.split(probe)]
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
            return done.returncode != 0
        except (subprocess.TimeoutExpired, OSError):
            return True

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [host for host, bad in zip(hosts, pool.map(down, hosts)) if bad]


def _record(root: Optional[Path], record: dict[str, Any]) -> None:
    if root is not None:
        with contextlib.suppress(OSError):  # the folder the job saves into; append_line says what it cannot write
            root.mkdir(parents=True, exist_ok=True)
        append_line(root, RELAUNCHES_LOG, {"at": time.time(), **record}, "the launch")


def _shown(hosts: Sequence[str], at_most: int = 4) -> str:
    return ", ".join(hosts[:at_most]) + (f" and {len(hosts) - at_most} more" if len(hosts) > at_most else "")


def _say(message: str) -> None:
    print(f"megatron-ucp relaunch: {message}", file=sys.stderr, flush=True)
