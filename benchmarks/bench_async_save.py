"""What a save costs training: stock DeepSpeed, its decoupled engine, the hooked save, the asynchronous save.

For each mode, one real DeepSpeed run (CPU, gloo, ``--dp`` processes, DeepSpeedZeroOptimizer = bf16 + ZeRO-1, the
harness's GPT-like model) trains and saves ``--saves`` times, ``--gap`` steps apart:

* ``stock``: DeepSpeed's own save, no hooks;
* ``decoupled``: DeepSpeed's decoupled checkpoint engine (``checkpoint.writer``: python writer, decoupled; 0.17+),
  no hooks;
* ``sync``: the hooks' save (record, commit across the job);
* ``async``: the hooks with ``async_save`` (the state copied into host memory, written in the background);
* ``memory``: the hooks' memory save (``megatron_ucp.save_to_memory``: each rank's state copied into host memory,
  its files written into its node's folder in ``/dev/shm`` by the memory saves' writer thread, here one node per rank,
  each node's files replicated on the next node over their own gloo group and committed, in that thread), in place of
  the save; its folder's size per node at rest is reported (one generation and a replica; two while the next one is
  written).

Per save, on the slowest rank: the time inside ``save_checkpoint``, and the extra time of the next step over an idle
step (a write that still holds the CPU, the commit's all-reduce, a decoupled engine's commit); their sum is the
**stall**. *Idle* steps are the ``--gap`` steps trained before the first save, while nothing is written (a step after a
save may still share the cores with its write). Also: the steps after the next one until the next save against idle
(*beside*: the training time the write still takes from the steps it runs beside, summed per save), the bytes each rank
copied (async), the **copy floor** (those bytes copied once in memory by the same ranks, one ``copy_`` into a buffer
allocated before), and the peak RSS of the ranks (a decoupled engine's writer processes not included). Medians over the
saves, because these machines are noisy; never asserted. ``--optimizer bf16`` runs BF16_Optimizer (DeepSpeed's
decoupled engine cannot save DeepSpeedZeroOptimizer's state: its writer process is handed a tensor that requires
grad). ::

    python benchmarks/bench_async_save.py --model m100 --dp 2
    python benchmarks/bench_async_save.py --model m100 --dp 4 --saves 3

Results: a table on stdout and ``benchmarks/results/async_save-<model>-dp<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
REPO_ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
from worker_launch import run_worker, timed_step  # noqa: E402
from worker_launch import slowest as _slowest  # noqa: E402

MARKER = "ASYNC_SAVE "
MODES = ("stock", "decoupled", "sync", "async", "memory")
MODELS = {
    "demo": dict(hidden=3, num_layers=1, vocab=64, seq=4),
    "m25": dict(hidden=512, num_layers=6, vocab=8192, seq=16),
    "m100": dict(hidden=768, num_layers=12, vocab=10240, seq=16),
    "llama1b": dict(hidden=2048, num_layers=16, vocab=32000, seq=16),
}
DECOUPLED = {"checkpoint": {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}}
"""``data_parallel: replica`` (every rank writes its own files): with the default (none), 0.19.8's writer config asks a
job without an ``mpu`` for a field it does not have (``'UniversalParallelInfo' object has no attribute 'dp_rank'``)."""
OPTIMIZERS = {"zero": "DeepSpeedZeroOptimizer", "bf16": "BF16_Optimizer"}
DECOUPLED_ZERO = (
    "its first save fails in the writer process's queue (RuntimeError: Cowardly refusing to serialize non-leaf tensor "
    "which requires_grad; 0.19.8, seen at DP 2) or hangs (DP 4): measured with --optimizer bf16"
)


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    mode: str
    optimizer: str
    dp: int
    saves: int
    gap: int
    root: str


def _worker(cfg: WorkerConfig) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.dsharness import TrainSpec
    from tests.support.dsharness.worker import Rank

    shape = MODELS[cfg.model]
    hooked = cfg.mode in ("sync", "async", "memory")
    local = shm_folder(cfg.root)
    if cfg.mode == "memory":  # one node per rank, each its own folder
        os.environ["MEGATRON_UCP_NODE_NAMES"] = ",".join(f"n{r}" for r in range(cfg.dp))
    kwargs = {"async_save": cfg.mode == "async"}
    if cfg.mode == "memory":
        kwargs = {"memory_save_interval": 1, "local_dir": str(local / "{node}")}
    spec = TrainSpec(
        dp=cfg.dp,
        optimizer=cfg.optimizer,
        steps=0,
        global_batch=cfg.dp,
        plugin=hooked,
        plugin_kwargs=kwargs if hooked else {},
        extra_config=DECOUPLED if cfg.mode == "decoupled" else {},
        **shape,
    )
    if cfg.mode == "decoupled":  # what DeepSpeed's own launcher exports, which its decoupled writer reads
        for name, value in (("CROSS_SIZE", "1"), ("CROSS_RANK", "0"), ("LOCAL_SIZE", str(cfg.dp))):
            os.environ.setdefault(name, value)
    rank = Rank(spec)
    rank.setup()
    engine, torch, dist = rank.engine, rank.torch, rank.dist

    def step() -> float:
        return timed_step(rank)

    def slowest(value: float) -> float:
        return _slowest(rank, value)

    for _ in range(2):  # warm-up
        step()
    out: dict[str, list] = {"save": [], "next": [], "idle": [], "after": [], "copied": []}
    out["idle"] = [slowest(step()) for _ in range(cfg.gap)]  # nothing saved yet: nothing written beside them
    for _ in range(cfg.saves):
        dist.barrier()
        t0 = time.perf_counter()
        if cfg.mode == "memory":
            import megatron_ucp

            megatron_ucp.save_to_memory(cfg.root, engine.global_steps, lambda into: engine.save_checkpoint(into))
        else:
            engine.save_checkpoint(cfg.root)
        out["save"].append(slowest(time.perf_counter() - t0))
        out["next"].append(slowest(step()))
        out["after"].append([slowest(step()) for _ in range(cfg.gap - 1)])
        if cfg.mode == "async":
            from megatron_ucp.integration.save import async_save

            out["copied"].append(async_save.last_copied_bytes())
    if cfg.mode == "async":
        import megatron_ucp

        megatron_ucp.uninstall()  # the last save committed while the ranks still meet
    if cfg.mode == "memory":  # the last memory save committed (in the writer threads): the folders at rest
        from megatron_ucp.integration.save import memory_save

        memory_save.wait()
        dist.barrier()
    if cfg.mode == "decoupled":  # its last save committed and its writer process ended (it outlives the rank else)
        engine._commit_decoupled_checkpoint()
        engine.checkpoint_engine.cleanup()
    nbytes = max(out["copied"] or [0])
    floor = []
    if nbytes:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src)
            floor.append(slowest(time.perf_counter() - t0))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    dist.barrier()
    if rank.rank == 0:
        out.update(floor=floor, rss_kb=int(rss.item()), params=sum(p.numel() for p in engine.module.parameters()))
        if cfg.mode == "memory":
            sizes = [sum(f.stat().st_size for f in n.rglob("*") if f.is_file()) for n in local.iterdir()]
            out["node_bytes"] = max(sizes)
        print(MARKER + json.dumps(out), flush=True)


def shm_folder(root: str) -> Path:
    """Where a memory save's node folders go: node memory (``/dev/shm``), as on a cluster's nodes, named after the
    run's root (removed after it)."""
    import hashlib

    return Path("/dev/shm") / f"megatron-ucp-bench-{hashlib.sha256(str(root).encode()).hexdigest()[:10]}"


def _launch(cfg: WorkerConfig, log_dir: Path) -> dict:
    return run_worker(Path(__file__), asdict(cfg), cfg.dp, log_dir, f"{cfg.model}-{cfg.mode}", MARKER)


def _median(values: list) -> Optional[float]:
    return round(statistics.median(values), 4) if values else None


def run_mode(model: str, mode: str, optimizer: str, dp: int, saves: int, gap: int, work: Path) -> dict:
    root = work / f"{model}-{mode}"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        raw = _launch(WorkerConfig(model, mode, optimizer, dp, saves, gap, str(root)), work / "logs")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm_folder(str(root)), ignore_errors=True)
    idle = _median(raw["idle"])
    stalls = [s + max(0.0, n - idle) for s, n in zip(raw["save"], raw["next"], strict=True)]
    beside = [sum(max(0.0, step - idle) for step in after) for after in raw["after"]]
    return {
        "model": model,
        "mode": mode,
        "optimizer": OPTIMIZERS[optimizer],
        "dp": dp,
        "params": raw["params"],
        "saves": saves,
        "save_s": _median(raw["save"]),
        "next_step_s": _median(raw["next"]),
        "idle_step_s": idle,
        "stall_s": _median(stalls),
        "after_step_s": _median([step for after in raw["after"] for step in after]),
        "beside_s": _median(beside),
        "copied_mb": round(max(raw["copied"]) / 1e6, 1) if raw["copied"] else None,
        "floor_s": _median(raw["floor"]),
        "peak_rss_mb": round(raw["rss_kb"] / 1024, 1),
        "memory_per_node_mb": round(raw["node_bytes"] / 1e6, 1) if "node_bytes" in raw else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "raw": {k: raw[k] for k in ("save", "next", "idle", "after", "floor")},
    }


def table(results: list[dict]) -> str:
    stock = next((r["stall_s"] for r in results if r["mode"] == "stock"), None)
    rows = [("mode", "DP", "in save (s)", "next step (s)", "idle step (s)", "stall (s)", "x stock", "copy floor (s)")]
    rows[0] += ("x floor", "steps after (s)", "beside (s)", "copied MB", "peak RSS MB", "memory per node MB")
    for r in results:
        x_stock = f"{r['stall_s'] / stock:.2f}" if stock else "-"
        x_floor = f"{r['stall_s'] / r['floor_s']:.2f}" if r["floor_s"] else "-"
        rows.append(
            tuple(
                str(v)
                for v in (
                    r["mode"],
                    r["dp"],
                    r["save_s"],
                    r["next_step_s"],
                    r["idle_step_s"],
                    r["stall_s"],
                    x_stock,
                    r["floor_s"] or "-",
                    x_floor,
                    r["after_step_s"],
                    r["beside_s"],
                    r["copied_mb"] or "-",
                    r["peak_rss_mb"],
                    r.get("memory_per_node_mb") or "-",
                )
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> str:
    import deepspeed

    where = f"{platform.machine()}, {os.cpu_count()} cores"
    return f"{where}, Python {platform.python_version()}, DeepSpeed {deepspeed.__version__}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=list(MODELS), default="demo")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--gap", type=int, default=4, help="steps from one save to the next")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="zero",
        help="zero: DeepSpeedZeroOptimizer (bf16 + ZeRO-1); bf16: BF16_Optimizer (fp32 gradient accumulation)",
    )
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(WorkerConfig(**json.loads(args.worker)))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ucp.deepspeed.versions import internals

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-async-save-"))
    results, skipped = [], []
    for mode in args.modes.split(","):
        if mode == "decoupled" and not internals().decoupled_commit:
            print("decoupled: this DeepSpeed has no decoupled checkpoint engine; skipped", file=sys.stderr)
            continue
        if mode == "decoupled" and args.optimizer == "zero":
            skipped.append({"mode": mode, "error": DECOUPLED_ZERO})
            print(f"decoupled: not with DeepSpeedZeroOptimizer: {DECOUPLED_ZERO}", file=sys.stderr)
            continue
        try:
            r = run_mode(args.model, mode, args.optimizer, args.dp, args.saves, args.gap, work)
        except RuntimeError as exc:  # DeepSpeed's decoupled engine does not start everywhere: said, not measured
            if mode != "decoupled":
                raise
            error = next((line for line in reversed(str(exc).splitlines()) if "Error" in line), str(exc)[-300:])
            print(f"decoupled: did not start: {error.strip()}", file=sys.stderr)
            skipped.append({"mode": mode, "error": error.strip()})
            continue
        r["machine"] = machine()
        results.append(r)
        print(table(results), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"results": results, "not_measured": skipped}
    suffix = "" if args.optimizer == "zero" else f"-{args.optimizer}"
    (RESULTS / f"async_save-{args.model}-dp{args.dp}{suffix}.json").write_text(json.dumps(out, indent=1))
    print(f"machine: {machine()}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
