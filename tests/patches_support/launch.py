"""Launch helpers for tests/test_patches.py: a patched copy of DeepSpeed and DP runs against it.

Nothing here imports DeepSpeed; every DeepSpeed run happens in child processes whose PYTHONPATH
chooses the package (the patched copy first, or nothing extra for the installed one).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / "patches" / "deepspeed-0.19.8"
MEGATRON_PATCH = REPO / "patches" / "megatron-deepspeed" / "0001-install-megatron-ucp.patch"
WORKER = Path(__file__).resolve().parent / "worker.py"


def deepspeed_patches() -> list[Path]:
    """The DeepSpeed patches in the order they must be applied."""
    return sorted(PATCH_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def installed_deepspeed_dir() -> Path:
    """site-packages/deepspeed of the interpreter running the tests, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("deepspeed is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def git_apply(patch: Path, cwd: Path, check_only: bool = False) -> subprocess.CompletedProcess:
    # --unsafe-paths is not needed: paths are relative; cwd is outside any git work tree in tests.
    cmd = ["git", "apply", "-p1", "--verbose"] + (["--check"] if check_only else []) + [str(patch)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def pristine_copy(dest_root: Path) -> Path:
    """Copy the installed deepspeed package to dest_root/deepspeed (without bytecode caches)."""
    src = installed_deepspeed_dir()
    shutil.copytree(src, dest_root / "deepspeed", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest_root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(pythonpath_first: Optional[Path], extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["DS_BUILD_OPS"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    parts = [str(pythonpath_first)] if pythonpath_first else []
    parts.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    # A stale hook setting in the caller's environment must not leak into "no hooks" runs.
    for key in list(env):
        if key.startswith("MEGATRON_UCP_"):
            del env[key]
    if extra:
        env.update(extra)
    return env


@dataclass
class RunResult:
    returncodes: list[int]
    logs: list[str]
    reports: dict[int, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def text(self) -> str:
        return "\n".join(f"----- rank {r} (rc={rc}) -----\n{log[-6000:]}"
                         for r, (rc, log) in enumerate(zip(self.returncodes, self.logs)))


def run_dp(workdir: Path, name: str, world_size: int, spec: dict, deepspeed_root: Optional[Path],
           timeout: float = 600, grace: float = 20) -> RunResult:
    """Run worker.py on ``world_size`` ranks; when one rank fails, the others get ``grace`` seconds
    and are then killed (they would otherwise wait forever in a collective)."""
    rundir = workdir / name
    rundir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, report_dir=str(rundir))
    spec_path = rundir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = child_env(deepspeed_root, {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                                         "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port)})
        log = open(rundir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "--spec", str(spec_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=rundir))
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    for log in logs:
        log.close()
    result = RunResult([p.returncode for p in procs],
                       [(rundir / f"rank{r}.log").read_text(errors="replace") for r in range(world_size)])
    for r in range(world_size):
        report = rundir / f"rank{r}.json"
        if report.exists():
            result.reports[r] = json.loads(report.read_text())
    return result


def run_module(args: list[str], deepspeed_root: Optional[Path], cwd: Path, timeout: float = 600
               ) -> subprocess.CompletedProcess:
    """``python -m <args>`` with the chosen deepspeed first on PYTHONPATH."""
    return subprocess.run([sys.executable, "-m"] + args, env=child_env(deepspeed_root), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
