"""Launch an N-process CPU (gloo) job with plain subprocesses, the way torchrun would set it up.

Used by the demo and by tests: each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT, DS_ACCELERATOR=cpu and OMP_NUM_THREADS=1. Output of
every rank goes to its own log file; when one rank fails, the others are stopped (they would
otherwise wait in a collective forever).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class LaunchResult:
    returncodes: tuple[int, ...]
    logs: tuple[Path, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def first_failure(self) -> Optional[int]:
        """The rank whose log explains the failure: the first non-zero exit that was not our kill."""
        failed = [r for r, rc in enumerate(self.returncodes) if rc not in (0, -15)]
        return failed[0] if failed else None


def rank_env(
    rank: int,
    world: int,
    port: int,
    base: Optional[Mapping[str, str]] = None,
    extra: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra or {})
    return env


def launch(
    argv: Sequence[str],
    nprocs: int,
    log_dir: Path,
    *,
    name: str = "run",
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    timeout: float = 900.0,
) -> LaunchResult:
    """Run ``python argv...`` as ``nprocs`` ranks; wait for all; stop the rest when one fails."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    handles = []
    start = time.monotonic()
    for rank in range(nprocs):
        path = log_dir / f"{name}.rank{rank}.log"
        fh = open(path, "w")
        handles.append(fh)
        logs.append(path)
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=rank_env(rank, nprocs, port, extra=env),
                cwd=cwd,
            )
        )
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() - start > timeout:
                time.sleep(2.0)  # let the failing rank's peers print their own error first
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fh in handles:
            fh.close()
    return LaunchResult(
        returncodes=tuple(int(p.returncode) for p in procs), logs=tuple(logs), seconds=time.monotonic() - start
    )
