"""Launch ``spec.dp`` worker processes, watch them, collect their output into a ``TrainResult``."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from tests.support.preload import pool as preload_pool

from .spec import MARKER, TrainResult, TrainSpec

REPO_ROOT = Path(__file__).resolve().parents[3]
#: After one rank fails, give the others this long to print their own error before killing them.
FAILURE_GRACE_S = 3.0
_PORT_IN_USE = ("address already in use", "eaddrinuse")
_LOG_TAIL_CHARS = 6000
HARNESS_IMPORTS = ("tests.support.dsharness.worker",)
"""Imported once by the preload server beside torch and DeepSpeed (the worker imports nothing else heavy)."""


_PORTS = (20000, 32000)
"""Where a launch's rendezvous port is drawn: below Linux's ephemeral range (32768-60999). A port the kernel hands
out (``bind(0)``) is an ephemeral one, and between its release and the launch's listen, one of the many connections
gloo opens between ranks may take it as its source port (EADDRINUSE at the rendezvous, seen in the suite)."""


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range, drawn at random (each launch its own)."""
    import random

    for _ in range(200):
        port = random.randint(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded machine: what the kernel hands out
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """Kill one rank and everything it started (it leads its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def extensions_dir(python: str, pythonpath: str = "") -> Path:
    """A torch-extensions cache private to one interpreter (venv) and ``PYTHONPATH``.

    DeepSpeed's CPU backend JIT-builds its ``deepspeed_shm_comm`` op whenever a process group is
    created (~30 s of g++ here, minutes on a loaded machine). In the shared default cache every
    venv (main, the 0.16.2 legacy venv, other checkouts, patched copies on ``PYTHONPATH``) writes
    the same op name with different sources, so each switch rebuilds it and concurrent runs wait on
    one another's build lock. An explicit ``TORCH_EXTENSIONS_DIR`` in the environment wins.
    """
    key = hashlib.sha1(f"{Path(python).absolute()}\0{pythonpath}".encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "megatron-ucp-test-extensions" / key


def child_env(python: str, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment of a DeepSpeed child process: CPU accelerator, one thread, the repo importable,
    the interpreter's own bin/ first on PATH (so torch's JIT always finds the same ``ninja``: the
    pip ``ninja`` 1.13 and /usr/bin/ninja 1.11 hash build commands differently, and alternating
    between them rebuilds the op every time) and a private extensions cache (see above)."""
    env = dict(os.environ)
    env.update(extra or {})
    pythonpath = [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(
        {
            # the CPU unless the spec asks for another (tests/device/gpu_checks.py: ``cuda``, with NCCL)
            "DS_ACCELERATOR": (extra or {}).get("DS_ACCELERATOR", "cpu"),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "PATH": os.pathsep.join([str(Path(python).absolute().parent), env.get("PATH", "")]),
        }
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(python, env["PYTHONPATH"])))
    return env


def _rank_env(spec: TrainSpec, rank: int, port: int) -> dict[str, str]:
    env = child_env(spec.python or sys.executable, spec.env)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(spec.dp),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(spec.dp),
        }
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


class _Forked:
    """The ranks of one run forked by a preload server (tests/support/preload): their exit statuses as they end, and a
    kill of every session (each rank leads one) and of the client that stands for the job."""

    def __init__(self, client: subprocess.Popen, folder: Path, ranks: int) -> None:
        self.client, self.folder, self.ranks = client, folder, ranks

    def codes(self) -> list[Optional[int]]:
        out: list[Optional[int]] = []
        for rank in range(self.ranks):
            path = self.folder / f"rank{rank}.exit"
            out.append(int(path.read_text()) if path.is_file() else None)
        if self.client.poll() is not None:  # the job ended before some rank was forked or reaped
            out = [70 if code is None and not self._alive(rank) else code for rank, code in enumerate(out)]
        return out

    def _alive(self, rank: int) -> bool:
        pid = self._pid(rank)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _pid(self, rank: int) -> Optional[int]:
        path = self.folder / f"rank{rank}.pid"
        return int(path.read_text()) if path.is_file() else None

    def kill(self) -> None:
        for rank in range(self.ranks):
            pid = self._pid(rank)
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        _kill(self.client)


def _launch_once(spec: TrainSpec, port: int) -> TrainResult:
    python = spec.python or sys.executable
    spec_json = spec.to_json()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsharness-") as tmp:
        outputs = [Path(tmp) / f"rank{r}.log" for r in range(spec.dp)]
        procs: list[subprocess.Popen] = []
        forked: Optional[_Forked] = None
        handles = []
        try:
            env = _rank_env(spec, 0, port)  # forked: the agent sets each rank's RANK and LOCAL_RANK
            client = preload_pool.launch_command(
                env,
                spec.dp,
                port,
                python,
                imports=HARNESS_IMPORTS,
                options=("--rank-logs", tmp, "--no-stop-on-failure"),
            )
            if client is not None:
                handles.append(open(Path(tmp) / "launcher.log", "wb"))
                proc = subprocess.Popen(
                    [*client, "-m", "tests.support.dsharness.worker", spec_json],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=handles[-1],
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                forked = _Forked(proc, Path(tmp), spec.dp)
            else:
                for rank in range(spec.dp):
                    handle = open(outputs[rank], "wb")
                    handles.append(handle)
                    procs.append(
                        subprocess.Popen(
                            [python, "-m", "tests.support.dsharness.worker", spec_json],
                            cwd=REPO_ROOT,
                            env=_rank_env(spec, rank, port),
                            stdout=handle,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
            deadline = start + spec.timeout
            failed_at = None
            timed_out = False
            while True:
                codes = forked.codes() if forked is not None else [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.perf_counter()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
                    break
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            if forked is not None:
                forked.kill()
                codes = [code if code is not None else -signal.SIGKILL for code in forked.codes()]
            for proc in procs:
                _kill(proc)
            for handle in handles:
                handle.close()
        if forked is None:
            codes = [p.returncode for p in procs]
        logs = [path.read_text(errors="replace") if path.is_file() else "" for path in outputs]
        if forked is not None and (Path(tmp) / "launcher.log").stat().st_size:
            logs[0] += "\n===== harness: the launcher's own output =====\n" + (Path(tmp) / "launcher.log").read_text(
                errors="replace"
            )
    wall = time.perf_counter() - start

    parts = []
    for rank, (code, text) in enumerate(zip(codes, logs, strict=True)):
        parts.append(f"===== rank {rank} (exit {code}) =====\n{text}")
    log = "\n".join(parts)
    if timed_out:
        log += f"\n===== harness: timeout after {spec.timeout}s, all ranks killed =====\n"

    losses: list[float] = []
    steps: list[int] = []
    info: dict = {}
    for line in logs[0].splitlines():
        if not line.startswith(MARKER):
            continue
        record = json.loads(line[len(MARKER) :])
        kind = record.pop("kind")
        if kind == "step":
            steps.append(int(record["step"]))
            losses.append(float(record["loss"]))
            info.setdefault("lr", []).append(record["lr"])
        elif kind == "dump":
            info.setdefault("dumps", {})[record.pop("name")] = record
        elif kind == "refusal":
            info.setdefault("refusals", {})[record["name"]] = record["outcomes"]
        else:
            info.update(record)

    if timed_out:
        returncode = 124
    else:
        returncode = next((c for c in codes if c != 0), 0)
    dumps: dict[str, Path] = {}
    if spec.dump_dir is not None and Path(spec.dump_dir).is_dir():
        dumps = {p.stem: p for p in sorted(Path(spec.dump_dir).glob("*.pt"))}
    return TrainResult(
        losses=losses,
        steps=steps,
        returncode=returncode,
        log=log,
        dumps=dumps,
        optimizer_class=info.get("optimizer_class"),
        ds_version=info.get("ds_version"),
        loaded_step=info.get("loaded_step"),
        wall_s=round(wall, 3),
        info=info,
    )


def failure_tail(log: str, chars: int = _LOG_TAIL_CHARS) -> str:
    """The end of every failing rank's section (the first error is often not on the last rank)."""
    sections = log.split("===== rank ")
    failing = [s for s in sections[1:] if "(exit 0)" not in s.split("\n", 1)[0]]
    if not failing:
        return log[-chars:]
    per = max(chars // len(failing), 800)
    return "\n".join(
        "===== rank " + (s if len(s) <= per else s.split("\n", 1)[0] + "\n..." + s[-per:]) for s in failing
    )


def run_training(spec: TrainSpec, attempts: int = 3) -> TrainResult:
    """Run ``spec`` to completion; raise ``RuntimeError`` (with the log tail) on failure.

    With ``spec.expect_failure`` a failing run is returned instead (``res.returncode != 0``).
    A rendezvous port taken by someone else between probing and binding is retried on a new port.
    """
    for attempt in range(attempts):
        result = _launch_once(spec, free_port())
        port_clash = result.returncode != 0 and any(m in result.log.lower() for m in _PORT_IN_USE)
        if not port_clash or attempt == attempts - 1:
            break
    if result.returncode != 0 and not spec.expect_failure:
        raise RuntimeError(
            f"DeepSpeed run failed (exit {result.returncode}, dp={spec.dp}, "
            f"optimizer={spec.optimizer}):\n{failure_tail(result.log)}"
        )
    return result
