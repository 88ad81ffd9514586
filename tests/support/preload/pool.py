"""The preload servers of this test session, one per environment that changes what an import does, started when first
needed and stopped at the session's end; and the command line that starts a job on one.

``UCP_PRELOAD=0`` (or a server that cannot fork safely) gives ``None``: the caller launches fresh interpreters.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .server import CANNOT_FORK, TORCH_AND_DEEPSPEED

REPO_ROOT = Path(__file__).resolve().parents[3]
CLIENT = Path(__file__).with_name("client.py")
IMPORT_KEYS = ("PYTHONPATH", "DS_ACCELERATOR", "MEGATRON_UCP_TEST_IMPORT_IPEX", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")
"""The variables read at the imports the server does (which DeepSpeed, which accelerator, IPEX first or not): a job
whose values differ gets a server of its own."""
START_TIMEOUT_S = 300.0

_servers: dict[tuple, tuple[subprocess.Popen, Path]] = {}
_refused: set[tuple] = set()
_folder: Optional[Path] = None


def enabled(env: dict[str, str], python: str) -> bool:
    """On the CPU only (CUDA must not be initialised before a fork), for a Python interpreter (the launcher's own
    tests run other programs in its place), unless ``UCP_PRELOAD=0``."""
    return (
        env.get("DS_ACCELERATOR", "cpu") == "cpu"
        and env.get("UCP_PRELOAD", "1") != "0"
        and Path(python).name.startswith("python")
    )


def _key(python: str, env: dict[str, str], modules: tuple[str, ...]) -> tuple:
    return (python, modules, *(env.get(name, "") for name in IMPORT_KEYS))


def _stop_all() -> None:
    for proc, path in _servers.values():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        path.unlink(missing_ok=True)
    _servers.clear()
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)


def _start(python: str, env: dict[str, str], modules: tuple[str, ...], key: tuple) -> Optional[Path]:
    global _folder
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="ucp-preload-"))
        atexit.register(_stop_all)
    path = _folder / f"s{len(_servers) + len(_refused)}.sock"
    log = path.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [python, "-m", "tests.support.preload.server", str(path), *modules],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        code = proc.poll()
        if code == CANNOT_FORK:
            print(f"preload launcher: not used here, launching fresh interpreters ({log.read_text().strip()})")
            _refused.add(key)
            return None
        if code is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the preload server did not start (exit {code}): {log.read_text()[-3000:]}")
        time.sleep(0.05)
    _servers[key] = (proc, path)
    return path


def socket_for(env: dict[str, str], python: str, modules: tuple[str, ...]) -> Optional[Path]:
    """The socket of a running server for jobs with this environment, started if needed; None: launch fresh."""
    if not enabled(env, python):
        return None
    key = _key(python, env, modules)
    if key in _refused:
        return None
    running = _servers.get(key)
    if running is not None and running[0].poll() is None:
        return running[1]
    return _start(python, env, modules, key)


def launch_command(
    env: dict[str, str],
    nproc: int,
    port: int,
    python: str = sys.executable,
    imports: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
) -> Optional[list[str]]:
    """What replaces ``torchrun --nproc-per-node N --master-port P`` before the script or ``-m module``: the ranks
    forked from a server that imported torch, DeepSpeed and ``imports``; ``options`` are client.py's. None when this
    environment launches fresh interpreters."""
    path = socket_for(env, python, (*TORCH_AND_DEEPSPEED, *imports))
    if path is None:
        return None
    return [python, "-S", str(CLIENT), str(path), str(nproc), str(port), *options, "--"]
