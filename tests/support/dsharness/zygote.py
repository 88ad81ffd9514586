"""All ranks of one harness run from one interpreter: ``python -m tests.support.dsharness.zygote <spec-json> <dir>``.

Importing torch and DeepSpeed costs each rank ~3 s of CPU before it does anything (with the real Megatron-DeepSpeed's
runtime installed, DeepSpeed pulls in transformers and torch's compiler stack); a DP 4 run on 2 cores spent half its
wall time there. This process imports them once, then forks the ranks: each child leads its own session, takes its
``RANK``/``LOCAL_RANK``, writes to its own log and runs :func:`tests.support.dsharness.worker.run_rank` exactly as a
freshly started worker would (the plugin installed, the process group made and everything else done after the fork;
nothing that starts a thread runs before it).

Files in ``<dir>`` for the launcher: ``rank<r>.log`` (the rank's output), ``rank<r>.pid`` (written before the rank
runs: the launcher kills its session on a failure or a timeout) and ``rank<r>.exit`` (its exit status, as
``subprocess`` reports it: negative for a signal). Used for the CPU only (``launch.forks``); a CUDA run starts fresh
interpreters, as CUDA requires.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from pathlib import Path

LAZY_IMPORTS = ("deepspeed.runtime.zero.muon.muon_optimizer",)
"""What ``deepspeed.initialize`` imports on every rank (0.19.8's ZeRO optimizer check imports Muon, whose module
calls ``torch.compile`` and so imports torch's compiler: ~2 s of CPU per rank), imported here once where the release
has it."""


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _write(path: Path, value: int) -> None:
    """Whole or not at all: the launcher polls for these files."""
    part = path.with_name(path.name + ".part")
    part.write_text(str(value))
    os.replace(part, path)


def main(spec_json: str, folder: Path) -> None:
    import deepspeed  # noqa: F401
    import torch._dynamo  # noqa: F401  (the worker imports it before training; pay for it once)

    from . import worker

    for lazy in LAZY_IMPORTS:
        try:
            importlib.import_module(lazy)
        except ImportError:
            pass

    gc.collect()
    gc.freeze()  # the imported modules stay shared with the ranks, copy-on-write
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = int(os.environ["WORLD_SIZE"])
    children: dict[int, int] = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
                log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
            except BaseException:
                os._exit(70)
            worker.run_rank(["worker", spec_json])  # never returns
        _write(folder / f"rank{rank}.pid", pid)
        children[pid] = rank
    while children:
        pid, raw = os.wait()
        rank = children.pop(pid, None)
        if rank is not None:
            _write(folder / f"rank{rank}.exit", _status(raw))
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
