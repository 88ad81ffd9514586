"""One benchmark's ranks launched on this machine (the demo's launcher, the test harness's environment), and the one
JSON line rank 0 printed after its marker: what the in-training benchmarks share."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_worker(script: Path, config: dict, nproc: int, log_dir: Path, name: str, marker: str) -> dict:
    """``python script --worker <config>`` on ``nproc`` ranks; rank 0's ``marker`` line, parsed. Raises with the log's
    tail when a rank failed."""
    from demo.launch import launch
    from tests.support.dsharness.launch import extensions_dir

    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(extensions_dir(sys.executable))),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    res = launch(
        [str(Path(script).resolve()), "--worker", json.dumps(config)],
        nproc,
        log_dir,
        name=name,
        env=env,
        cwd=REPO_ROOT,
        timeout=3600,
    )
    text = res.output(0)
    if not res.ok:
        raise RuntimeError(f"{name} failed (exit codes {res.returncodes}); see {res.logs}:\n{text[-4000:]}")
    line = next(x for x in text.splitlines() if x.startswith(marker))
    return json.loads(line[len(marker) :])


def timed_step(rank: "object") -> float:
    """One training step of a harness rank (``tests.support.dsharness.worker.Rank``, set up), in seconds."""
    import time

    from tests.support.dsharness.model import rank_batch

    engine, spec = rank.engine, rank.spec
    t0 = time.perf_counter()
    tokens, labels = rank_batch(
        engine.global_steps, rank.rank, rank.world, spec.global_batch, spec.seq, spec.vocab, spec.seed
    )
    loss = engine(tokens, labels)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def slowest(rank: "object", value: float) -> float:
    """``value`` on the slowest rank (an all-reduce of the maximum)."""
    t = rank.torch.tensor([value], dtype=rank.torch.float64)
    rank.dist.all_reduce(t, op=rank.dist.ReduceOp.MAX)
    return float(t.item())
