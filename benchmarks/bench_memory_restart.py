"""A restart after a lost node: from the nodes' memory saves against from the checkpoint root on disk (cold).

One real DeepSpeed job (CPU, gloo, ``--nodes`` ranks, each rank its own node and node folder, the harness's GPT-like
model, DeepSpeedZeroOptimizer) saves to memory every step and durably at step 2, and dies after step 3. Then, per
round, in alternating order, the survivors (every node but node 1) restart at DP ``nodes - 1``:

* ``memory``: from the memory save of step 3 (node 1's files from their replica, every node assembling the whole
  generation over gloo), then the native reshard;
* ``disk``: from the durable tag of step 2 in the checkpoint root (files of the same sizes), evicted from the page
  cache first (the cold-read floor of a restart that reads the parallel file system), the same reshard.

The time of ``load_checkpoint`` on rank 0 (the harness's marks), medians over the rounds, and their ratio per round.
With ``benchmarks/results/async_save-<model>-dp<nodes>.json`` (``bench_async_save.py --modes sync,memory``) at hand,
also the iterations a failure loses on average at the same training stall: a durable save every ``D`` iterations
loses ``D / 2``; a memory save with the same stall per iteration can run every ``D * memory_stall / sync_stall``. ::

    python benchmarks/bench_async_save.py --model m25 --dp 4 --modes sync,async,memory
    python benchmarks/bench_memory_restart.py --model m25 --rounds 3

Results: ``benchmarks/results/memory_restart-<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(BENCH_DIR))
from bench_async_save import MODELS, machine, shm_folder  # noqa: E402

DURABLE_EVERY = 1000
"""The durable save interval the iterations-lost model is stated for (AuroraGPT-7B's order of magnitude)."""


def _memory(work: Path) -> dict:
    """Each node's folder in node memory (``/dev/shm``), as on a cluster; the checkpoint root stays in ``--work``."""
    return {"memory_save_interval": 1, "local_dir": str(shm_folder(str(work)) / "{node}")}


def _node_folder(work: Path, node: str) -> Path:
    from megatron_ucp.config import UcpConfig
    from megatron_ucp.integration.node_memory import local_folder

    return local_folder(UcpConfig(**_memory(work)), work / "ckpt", node)


def _load_s(result) -> float:
    times = result.info["times"]
    return round(times["load"] - times["initialize"], 4)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="demo")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from tests.support.dsharness import TrainSpec, run_training
    from tests.support.page_cache import evict

    shape = MODELS[args.model]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-memory-restart-"))
    names = [f"n{i}" for i in range(args.nodes)]
    survivors = [n for n in names if n != "n1"]
    batch = args.nodes * (args.nodes - 1)
    job = work / "job"
    crashed = run_training(
        TrainSpec(
            dp=args.nodes,
            optimizer="zero",
            steps=5,
            global_batch=batch,
            save_dir=job / "ckpt",
            save_at=(2,),
            memory_every=1,
            crash=(4, 1),
            expect_failure=True,
            plugin=True,
            plugin_kwargs=_memory(job),
            env={"MEGATRON_UCP_NODE_NAMES": ",".join(names)},
            timeout=3600,
            **shape,
        )
    )
    assert crashed.returncode != 0, crashed.log[-3000:]
    times: dict[str, list[float]] = {"memory": [], "disk": []}
    for r in range(args.rounds):
        for route in ("memory", "disk") if r % 2 == 0 else ("disk", "memory"):
            here = work / f"round{r}-{route}"
            shutil.copytree(job / "ckpt", here / "ckpt")
            if route == "memory":  # the survivors' folders as they were, for this copy's root
                for node in survivors:
                    shutil.copytree(_node_folder(job, node), _node_folder(here, node))
            else:
                evict(here / "ckpt")
            res = run_training(
                TrainSpec(
                    dp=len(survivors),
                    optimizer="zero",
                    steps=3,
                    global_batch=batch,
                    load_dir=here / "ckpt",
                    plugin=True,
                    plugin_kwargs=_memory(here) if route == "memory" else {},
                    env={"MEGATRON_UCP_NODE_NAMES": ",".join(survivors)},
                    timeout=3600,
                    **shape,
                )
            )
            assert res.loaded_step == (3 if route == "memory" else 2), res.log[-3000:]
            said = res.rank_logs()[0]
            assert ("restarting from the memory save of iteration 3" in said) == (route == "memory"), said[-3000:]
            times[route].append(_load_s(res))
            shutil.rmtree(here, ignore_errors=True)
            shutil.rmtree(shm_folder(str(here)), ignore_errors=True)
    ratios = [m / d for m, d in zip(times["memory"], times["disk"], strict=True)]
    size = sum(f.stat().st_size for f in (job / "ckpt" / "global_step2").iterdir())
    out: dict = {
        "model": args.model,
        "nodes": args.nodes,
        "restart_nodes": len(survivors),
        "checkpoint_mb": round(size / 1e6, 1),
        "memory_load_s": round(statistics.median(times["memory"]), 4),
        "disk_cold_load_s": round(statistics.median(times["disk"]), 4),
        "memory_over_disk": round(statistics.median(ratios), 3),
        "raw": times,
        "machine": machine(),
    }
    saves = RESULTS / f"async_save-{args.model}-dp{args.nodes}.json"
    if saves.is_file():
        stall = {r["mode"]: r["stall_s"] for r in json.loads(saves.read_text())["results"]}
        if stall.get("sync") and stall.get("memory"):
            every = max(1, round(DURABLE_EVERY * stall["memory"] / stall["sync"]))
            out["same_stall"] = {
                "durable_every": DURABLE_EVERY,
                "sync_stall_s": stall["sync"],
                "memory_stall_s": stall["memory"],
                "memory_every_at_the_same_stall": every,
                "iterations_lost_durable_alone": DURABLE_EVERY / 2,
                "iterations_lost_with_memory_saves": every / 2,
            }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"memory_restart-{args.model}.json").write_text(json.dumps(out, indent=1))
    lines = [
        f"# Restart after a lost node: memory saves vs the checkpoint root (cold), {args.model}",
        "",
        f"{args.nodes} nodes (one rank each) saved, node 1 lost, {len(survivors)} restart at DP {len(survivors)}; "
        f"the tag is {out['checkpoint_mb']} MB; {args.rounds} rounds, alternating; {out['machine']}. One machine: the "
        "nodes' memory is its /dev/shm, the checkpoint root its local disk (not a parallel file system), the "
        "replicas and the assembly go over gloo on the loopback.",
        "",
        "| restart from | load_checkpoint (s, median) |",
        "|---|---|",
        f"| the nodes' memory (assembled over gloo, then resharded) | {out['memory_load_s']} |",
        f"| the checkpoint root, evicted from the page cache | {out['disk_cold_load_s']} |",
        "",
        f"memory / disk, median of per-round ratios: **{out['memory_over_disk']}x**",
    ]
    if "same_stall" in out:
        s = out["same_stall"]
        lines += [
            "",
            f"At the same training stall as a durable save every {s['durable_every']} iterations (sync stall "
            f"{s['sync_stall_s']} s, memory stall {s['memory_stall_s']} s), a memory save can run every "
            f"{s['memory_every_at_the_same_stall']} iterations: a failure loses {s['iterations_lost_durable_alone']} "
            f"iterations on average with durable saves alone, {s['iterations_lost_with_memory_saves']} with memory "
            "saves (plus, in both, the step in progress and the requeue's wait). The stall alone: what a memory "
            "save's writer thread takes from the steps beside it is not counted (docs/benchmarks.md).",
        ]
    (RESULTS / f"memory_restart-{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(shm_folder(str(job)), ignore_errors=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
