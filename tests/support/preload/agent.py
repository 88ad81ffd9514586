"""One job of the preload server: fork its ranks, watch them as torchrun's agent does, report the job's status.

torchrun's behaviour, kept: the ranks get ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and its ``TORCHELASTIC_*``/``GROUP_*``/``ROLE_*`` variables (rank 0 hosts the
rendezvous store, as with ``env://``); each rank leads its own session; when one fails the others get SIGTERM and,
30 s later, SIGKILL; the job's status is 0 when every rank exited 0, else 1. The client can ask for the job to stop
(``term``: SIGTERM, then SIGKILL) or vanish (SIGKILL at once).

A request with ``rank_logs`` (a folder; the DeepSpeed harness's) gets each rank's output in ``rank<r>.log`` there,
``rank<r>.pid`` before the rank runs and ``rank<r>.exit`` (its status, negative for a signal) as it ends, whole or
absent; with ``stop_on_failure`` false a failing rank leaves the others running (the harness stops them itself).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Iterator, NoReturn, Optional

from . import rank as rank_process

STOP_GRACE_S = 30.0
"""torchrun's wait between SIGTERM and SIGKILL when it stops the workers."""
POLL_S = 0.05


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    out = dict(env)
    out.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": out.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
        }
    )
    return out


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _write(path: Path, value: int) -> None:
    """Whole or not at all: the harness polls for these files."""
    part = path.with_name(path.name + ".part")
    part.write_text(str(value))
    os.replace(part, path)


def _own_output(folder: Path, rank: int) -> None:
    log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def finished_children() -> Iterator[tuple[int, int]]:
    """Each child process that has ended, as ``(pid, raw status)``, reaped without waiting for the others."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, raw


class _Job:
    def __init__(self, pids: dict[int, int], rank_logs: Optional[Path], stop_on_failure: bool) -> None:
        self.pids = pids  # pid -> rank
        self.codes: dict[int, int] = {}  # rank -> status
        self.kill_at: Optional[float] = None
        self.rank_logs, self.stop_on_failure = rank_logs, stop_on_failure

    def running(self) -> list[int]:
        return [pid for pid, rank in self.pids.items() if rank not in self.codes]

    def signal_all(self, sig: int) -> None:
        for pid in self.running():
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, why: str) -> None:
        if self.kill_at is None:
            print(f"preload launcher: {why}; sending SIGTERM to the other ranks", file=sys.stderr, flush=True)
            self.signal_all(signal.SIGTERM)
            self.kill_at = time.monotonic() + STOP_GRACE_S

    def reap(self) -> None:
        for pid, raw in finished_children():
            if pid in self.pids:
                rank = self.pids[pid]
                self.codes[rank] = _status(raw)
                if self.rank_logs is not None:
                    _write(self.rank_logs / f"rank{rank}.exit", self.codes[rank])
                if self.codes[rank] != 0 and self.stop_on_failure:
                    self.stop(f"rank {rank} exited with status {self.codes[rank]}")


def run(conn: socket.socket, request: dict, fds: list[int]) -> NoReturn:
    """The agent process, forked by the server: never returns."""
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        nproc, port = int(request["nproc"]), int(request["port"])
        rank_logs = Path(request["rank_logs"]) if request.get("rank_logs") else None
        sys.stdout.flush()
        sys.stderr.flush()
        pids: dict[int, int] = {}
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                conn.close()
                if rank_logs is not None:
                    _own_output(rank_logs, rank)
                rank_process.main(rank_env(request["env"], rank, nproc, port), request["cwd"], request["argv"])
            pids[pid] = rank
            if rank_logs is not None:
                _write(rank_logs / f"rank{rank}.pid", pid)
        job = _Job(pids, rank_logs, bool(request.get("stop_on_failure", True)))
        client_gone = False
        while job.running():
            if not client_gone and select.select([conn], [], [], POLL_S)[0]:
                said = conn.recv(16)
                if said.startswith(b"term"):
                    job.stop("the launch was asked to stop")
                else:  # the client was killed: nobody reads the output any more
                    client_gone = True
                    job.signal_all(signal.SIGKILL)
            elif client_gone:
                time.sleep(POLL_S)
            job.reap()
            if job.kill_at is not None and time.monotonic() > job.kill_at:
                job.signal_all(signal.SIGKILL)
        code = 0 if all(status == 0 for status in job.codes.values()) else 1
        if not client_gone:
            conn.sendall(f"exit {code}\n".encode())
    except BaseException as exc:  # never back into the server's loop
        print(f"preload launcher: the agent failed: {exc!r}", file=sys.stderr, flush=True)
        code = rank_process.STARTUP_FAILED
    os._exit(code)
