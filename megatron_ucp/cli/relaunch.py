"""``megatron-ucp relaunch [options] -- COMMAND...``: a launch repeated on the nodes left after a node failure.

Each launch gets its own host file, in the original's form (``PBS_NODEFILE`` and ``HOSTFILE`` in its environment;
``{hostfile}`` and ``{nodes}`` in COMMAND replaced), for a launcher that reads one of them (ALCF helpers.sh's DeepSpeed
launcher reads ``HOSTFILE``; mpiexec takes ``--hostfile {hostfile}``, torchrun ``--nnodes {nodes}``). The decision
after each failure is :func:`megatron_ucp.plan.relaunch.after_failure`'s.
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
from megatron_ucp.format.osio import write_durably
from megatron_ucp.plan.relaunch import after_failure, before_first, hosts_of, lines_for

DEFAULT_PROBE = "ssh -o BatchMode=yes -o ConnectTimeout=10 {host} true"
CANNOT_RUN = "the probe cannot run"
GRACE_S = 30.0
"""How long a launch has to end after the signal passed on to it, before it is killed."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "relaunch",
        help="run a training launch; when it fails, drop the nodes that are down and relaunch on the rest",
        description="Runs COMMAND on the allocation's nodes. When it fails, each node of that launch is probed; the "
        "ones that do not answer are dropped and COMMAND runs again on the rest, at the new node count (the elastic "
        "resume reshards the checkpoint to it). A launch that fails with every node up is not repeated. Each launch's "
        "host file is in PBS_NODEFILE and HOSTFILE; {hostfile} and {nodes} in COMMAND are replaced by it and by its "
        "node count. UCP_DRY_RUN=1 (or --dry-run) prints what it would do and launches nothing.",
    )
    p.add_argument("--hostfile", type=Path, help="the allocation's nodes (default: $PBS_NODEFILE)")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches at most (default 3)")
    p.add_argument("--min-nodes", type=int, default=1, help="stop when fewer nodes are left (default 1)")
    p.add_argument("--probe", default=DEFAULT_PROBE, help="a command that succeeds on a live node; {host} replaced")
    p.add_argument("--probe-timeout", type=float, default=30.0, help="seconds a node has to answer (default 30)")
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where each launch's host file is written; must be visible on every node (default: "
        ".cache/megatron_ucp/relaunch/<PBS_JOBID, else this process> under the current folder)",
    )
    p.add_argument(
        "--root",
        type=Path,
        help="the checkpoint root: each launch (its nodes, how it ended, the nodes found down) is recorded in its "
        ".ucp/ store, where `megatron-ucp status` shows the newest loop when it relaunched",
    )
    add_shared(p, "--no-progress", "accepted as every command accepts it (the loop draws no progress bar)")
    p.add_argument("--dry-run", action="store_true", help="print what would run; launch nothing (also UCP_DRY_RUN=1)")
    p.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the launch command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    if not command:
        raise UcpError("relaunch: no command given (megatron-ucp relaunch [options] -- COMMAND...)")
    source = args.hostfile or (Path(os.environ["PBS_NODEFILE"]) if os.environ.get("PBS_NODEFILE") else None)
    if source is None:
        raise UcpError("relaunch: no host file (--hostfile, or PBS_NODEFILE set by the scheduler)")
    lines = source.read_text().splitlines()
    hosts = hosts_of(lines)
    if not hosts:
        raise UcpError(f"{source}: lists no host", subject=source)
    state = args.state_dir or Path(".cache/megatron_ucp/relaunch") / os.environ.get("PBS_JOBID", f"pid{os.getpid()}")
    if args.dry_run or os.environ.get("UCP_DRY_RUN") == "1":
        return _dry_run(args, hosts, command, state)
    stop = _Stop()
    before = {sig: signal.signal(sig, stop.handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _loop(args, lines, hosts, command, state, stop)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _loop(
    args: argparse.Namespace, lines: list[str], hosts: list[str], command: Sequence[str], state: Path, stop: "_Stop"
) -> int:
    max_restarts = args.max_restarts
    down = _probe(hosts, args.probe, args.probe_timeout)
    first = before_first(hosts, list(down), any(why.startswith(CANNOT_RUN) for why in down.values()), args.min_nodes)
    if first.hosts is None:
        _say(
            f"the probe `{args.probe}` fails before the first launch ({_reasons(down)}): {first.why} (set --probe "
            "to a command that works on every node)"
        )
        max_restarts = 0
    else:
        if first.why:
            _say(f"{first.why} [probe: {_reasons(down)}]")
        hosts = list(first.hosts)
    loop, restarts = time.time(), 0
    while stop.signal is None:
        hostfile = _write_hostfile(state, restarts, lines_for(lines, hosts))
        argv = _filled(command, hostfile, hosts)
        _say(f"launch {restarts + 1} on {len(hosts)} node(s) ({_shown(hosts)}): {shlex.join(argv)}")
        record: dict[str, Any] = {"loop": loop, "launch": restarts + 1, "hosts": hosts}
        _record(args.root, {**record, "started": time.time()})
        t0 = time.time()
        code = _launch(argv, {"PBS_NODEFILE": str(hostfile), "HOSTFILE": str(hostfile)}, stop)
        record.update(exit=code, seconds=round(time.time() - t0))
        if code == 0 and stop.signal is None:
            _say(f"launch {restarts + 1} ended well after {record['seconds']}s")
            _record(args.root, record)
            return 0
        down = _probe(hosts, args.probe, args.probe_timeout) if stop.signal is None else {}
        if stop.signal is not None:  # walltime, qdel, Ctrl-C: the job ends here
            name = signal.Signals(stop.signal).name
            _say(
                f"stopped by {name}: launch {restarts + 1} ended with exit {code} after {record['seconds']}s; "
                "no relaunch"
            )
            _record(args.root, {**record, "decision": f"stopped by {name}"})
            return 128 + stop.signal
        decision = after_failure(hosts, list(down), code, restarts, max_restarts, args.min_nodes)
        _say(
            f"launch {restarts + 1} failed (exit {code}) after {record['seconds']}s: {decision.why}"
            + (f" [probe: {_reasons(down)}]" if down else "")
        )
        _record(args.root, {**record, "down": list(down), "why_down": down, "decision": decision.why})
        if decision.hosts is None:
            return decision.code or 1
        hosts, restarts = list(decision.hosts), restarts + 1
    return 128 + stop.signal


def _dry_run(args: argparse.Namespace, hosts: list[str], command: Sequence[str], state: Path) -> int:
    hostfile = state / "hosts.0"
    argv = _filled(command, hostfile, hosts)
    _say(
        f"(dry run) launch 1 on {len(hosts)} node(s) ({_shown(hosts)}): PBS_NODEFILE=HOSTFILE={hostfile} "
        f"{shlex.join(argv)}"
    )
    _say(
        f"(dry run) on a failure: each node of the launch probed with `{args.probe}` ({args.probe_timeout:g}s), "
        f"those that do not answer dropped, the launch repeated on the rest, at most {args.max_restarts} time(s), "
        f"while at least {max(1, args.min_nodes)} node(s) are left; a failure with every node up ends the loop"
    )
    return 0


def _filled(command: Sequence[str], hostfile: Path, hosts: Sequence[str]) -> list[str]:
    """The launch command with ``{hostfile}`` and ``{nodes}`` replaced."""
    return [word.replace("{hostfile}", str(hostfile)).replace("{nodes}", str(len(hosts))) for word in command]


def _write_hostfile(folder: Path, restarts: int, lines: Sequence[str]) -> Path:
    """This launch's host file, whole on disk before any node reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / f"hosts.{restarts}").resolve()
    write_durably(path, "".join(f"{line}\n" for line in lines))
    return path


class _Stop:
    """The signals the loop got (SIGTERM: walltime, qdel; SIGINT: Ctrl-C), each passed on to the launch's process
    group while one runs; a second signal kills it."""

    def __init__(self) -> None:
        self.got: list[tuple[int, float]] = []
        self.child: Optional[subprocess.Popen] = None

    @property
    def signal(self) -> Optional[int]:
        return self.got[0][0] if self.got else None

    def handler(self, signum: int, _frame: Any) -> None:
        if self.child is not None:
            _kill_group(self.child.pid, signal.SIGKILL if self.got else signum)
        self.got.append((signum, time.monotonic()))


def _launch(argv: Sequence[str], env: dict[str, str], stop: _Stop) -> int:
    """The launch, its output the job's, in a process group of its own within the job's session (whatever ends the
    job's processes ends it too; a signal to the loop reaches all of it). Killed when it has not ended ``GRACE_S``
    after a signal. Returns its exit code, 128 + the signal that ended it, 127 when it cannot start."""
    try:
        own_group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        child = subprocess.Popen(list(argv), env={**os.environ, **env}, **own_group)
    except OSError as exc:
        _say(f"cannot start the launch {argv[0]}: {exc.strerror or exc}")
        return 127
    stop.child = child
    if stop.got:  # a signal before the launch started
        _kill_group(child.pid, stop.got[0][0])
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if stop.got and time.monotonic() - stop.got[0][1] > GRACE_S:
                    _kill_group(child.pid, signal.SIGKILL)
    finally:
        stop.child = None
    return 128 - code if code < 0 else code


def _kill_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _probe(hosts: Sequence[str], probe: str, timeout: float) -> dict[str, str]:
    """The hosts whose probe fails or does not answer in time, each with why (probed at once), in order."""

    def why(host: str) -> Optional[str]:
        argv = [word.replace("{host}", host) for word in shlex.split(probe)]
        try:
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            return f"no answer in {timeout:g}s"
        except OSError as exc:
            return f"{CANNOT_RUN}: {exc.strerror or exc}"
        tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
        return None if done.returncode == 0 else f"exit {done.returncode}" + (f": {tail[0][:120]}" if tail[0] else "")

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return {host: bad for host, bad in zip(hosts, pool.map(why, hosts)) if bad is not None}


def _reasons(down: dict[str, str], at_most: int = 4) -> str:
    shown = "; ".join(f"{host} ({why})" for host, why in list(down.items())[:at_most])
    return shown + (f"; and {len(down) - at_most} more" if len(down) > at_most else "")


def _record(root: Optional[Path], record: dict[str, Any]) -> None:
    if root is not None:
        with contextlib.suppress(OSError):  # the folder the job saves into; append_line says what it cannot write
            root.mkdir(parents=True, exist_ok=True)
        append_line(root, RELAUNCHES_LOG, {"at": time.time(), **record}, "the launch")


def _shown(hosts: Sequence[str], at_most: int = 4) -> str:
    return ", ".join(hosts[:at_most]) + (f" and {len(hosts) - at_most} more" if len(hosts) > at_most else "")


def _say(message: str) -> None:
    print(f"megatron-ucp relaunch: {message}", file=sys.stderr, flush=True)
