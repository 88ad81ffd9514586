"""What asynchronous conversion costs training: blocking time of ``save_checkpoint``, step time meanwhile.

For each model, one real DeepSpeed run (CPU, gloo, ``--dp`` processes, DeepSpeedZeroOptimizer =
bf16 + ZeRO-1, the harness's GPT-like model) with megatron-ucp installed. It alternates saves
with ``async_convert`` off and on (the hooks are reinstalled in-process between them; the order
flips every round), so both kinds of save see the same machine load:

* **off** save, then ``--idle-steps`` training steps;
* **on** save, then training steps while the background converter runs (the *during conversion*
  step times), then ``--idle-steps`` steps after it finished. Every save starts with no converter
  running, so the save times compare the blocking cost only.

Reported per model: median ``save_checkpoint`` time off and on (max over ranks, barrier before each
save), the median of the paired differences (the added blocking time), the median time of the
post-save trigger measured inside the hook, median step times idle vs during a conversion, and
the save record's partition checksums (``plan.save_record.partition_checksums``: every rank hashes
its fp32 partition and optimizer states in memory at each save, what the native reshard checks
against), timed inside the save on the slowest rank, as a share of the save.
Medians, because these machines are noisy; never asserted.

Models: ``demo`` is the demo's geometry (hidden 3, 1 layer, vocab 64: 9-element norm group whose
padding exceeds a partition); ``m100`` is 100.6M parameters (hidden 768, 12 layers, vocab 10240;
the same shape as benchmarks/make_checkpoint.py's m100). ::

    python benchmarks/bench_save_overhead.py --model demo
    python benchmarks/bench_save_overhead.py --model m100 --saves 3 --idle-steps 3

Results: a table on stdout and ``benchmarks/results/save_overhead-<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

MARKER = "SAVE_OVERHEAD "

MODELS = {
    "demo": dict(hidden=3, num_layers=1, vocab=64, seq=4),
    "m100": dict(hidden=768, num_layers=12, vocab=10240, seq=16),
}


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    dp: int
    saves: int
    """Rounds; each round saves once with async conversion off and once with it on."""
    idle_steps: int
    max_during_steps: int
    root: str


# ================================================================================================
# one rank
# ================================================================================================


def _worker(cfg: WorkerConfig) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import megatron_ucp
    from megatron_ucp.background.store import read_registrations
    from megatron_ucp.integration.save.async_trigger import trigger_timings
    from tests.support.dsharness import TrainSpec
    from tests.support.dsharness.worker import Rank

    shape = MODELS[cfg.model]
    plugin = {"keep_last": 1, "converter_exit_wait": 1800}
    spec = TrainSpec(
        dp=cfg.dp,
        optimizer="zero",
        steps=0,
        global_batch=cfg.dp,
        hidden=shape["hidden"],
        num_layers=shape["num_layers"],
        vocab=shape["vocab"],
        seq=shape["seq"],
        plugin=True,
        plugin_kwargs={"async_convert": False, **plugin},
    )
    rank = Rank(spec)
    rank.setup()
    engine, torch, dist = rank.engine, rank.torch, rank.dist
    root = Path(cfg.root)
    from megatron_ucp.integration.save import recording as save_recording

    record_seconds: list[float] = []
    hashing = save_recording.partition_checksums

    def timed_checksums(*args, **kwargs):  # the save hook's own call, timed where it runs
        t0 = time.perf_counter()
        try:
            return hashing(*args, **kwargs)
        finally:
            record_seconds.append(time.perf_counter() - t0)

    save_recording.partition_checksums = timed_checksums

    def step() -> float:
        return timed_step(rank)

    def slowest(value: float) -> float:
        return _slowest(rank, value)

    def converting() -> bool:
        flag = int(rank.rank == 0 and any(r.alive() for r in read_registrations(root).values()))
        t = torch.tensor([flag], dtype=torch.int32)
        dist.all_reduce(t)
        return bool(t.item())

    def prune() -> None:
        """Keep the disk bounded: only the newest native tag survives (no conversion is running)."""
        if rank.rank == 0 and root.is_dir():
            tags = sorted(
                (
                    p
                    for p in root.iterdir()
                    if p.is_dir() and p.name.startswith("global_step") and not p.name.endswith("_universal")
                ),
                key=lambda p: int(p.name[len("global_step") :]),
            )
            for p in tags[:-1]:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    for _ in range(2):  # warm-up
        step()
    out: dict[str, list] = {
        "save_off": [],
        "save_on": [],
        "idle": [],
        "during": [],
        "trigger": [],
        "checksums": [],
        "checksums_share": [],
    }
    for i in range(cfg.saves):
        for on in (False, True) if i % 2 == 0 else (True, False):
            megatron_ucp.install(async_convert=on, **plugin)
            prune()
            before = len(trigger_timings())
            dist.barrier()
            t0 = time.perf_counter()
            hashed = len(record_seconds)
            engine.save_checkpoint(str(root))
            took = slowest(time.perf_counter() - t0)
            out["save_on" if on else "save_off"].append(took)
            out["checksums"].append(slowest(sum(record_seconds[hashed:])))
            out["checksums_share"].append(out["checksums"][-1] / took)
            if on:
                out["trigger"] += trigger_timings()[before:]
            n = 0
            while on and converting() and n < cfg.max_during_steps:
                out["during"].append(slowest(step()))
                n += 1
            while on and converting():  # the step cap was hit: wait, so the next save starts idle
                time.sleep(0.5)
            for _ in range(cfg.idle_steps):
                out["idle"].append(slowest(step()))
    dist.barrier()
    if rank.rank == 0:
        out["params"] = sum(p.numel() for p in engine.module.parameters())
        print(MARKER + json.dumps(out), flush=True)


# ================================================================================================
# the driver
# ================================================================================================


def _launch(cfg: WorkerConfig, log_dir: Path) -> dict:
    return run_worker(Path(__file__), asdict(cfg), cfg.dp, log_dir, cfg.model, MARKER)


def _median_ms(values: list) -> Optional[float]:
    return round(statistics.median(values) * 1000, 2) if values else None


def run_model(model: str, dp: int, saves: int, idle_steps: int, max_during: int, work: Path) -> dict:
    root = work / model
    shutil.rmtree(root, ignore_errors=True)
    cfg = WorkerConfig(
        model=model, dp=dp, saves=saves, idle_steps=idle_steps, max_during_steps=max_during, root=str(root)
    )
    t0 = time.perf_counter()
    raw = _launch(cfg, work / "logs")
    shutil.rmtree(root, ignore_errors=True)
    paired = [on - off for off, on in zip(raw["save_off"], raw["save_on"])]
    kept = {k: raw[k] for k in ("save_off", "save_on", "trigger", "checksums")}
    for k in ("idle", "during"):  # step times: quartiles only (thousands of values)
        kept[f"{k}_quartiles"] = statistics.quantiles(raw[k], n=4) if len(raw[k]) >= 2 else raw[k]
    return {
        "model": model,
        "dp": dp,
        "rounds": saves,
        "params": raw["params"],
        "raw": kept,
        "wall_s": round(time.perf_counter() - t0, 1),
        "save_off_ms": _median_ms(raw["save_off"]),
        "save_on_ms": _median_ms(raw["save_on"]),
        "added_ms": _median_ms(paired),
        "trigger_ms": _median_ms(raw["trigger"]),
        "trigger_max_ms": round(max(raw["trigger"]) * 1000, 2),
        "idle_step_ms": _median_ms(raw["idle"]),
        "during_step_ms": _median_ms(raw["during"]),
        "checksums_ms": _median_ms(raw["checksums"]),
        "checksums_share": round(statistics.median(raw["checksums_share"]), 4),
        "during_steps": len(raw["during"]),
    }


def table(results: list[dict]) -> str:
    rows = [
        (
            "model",
            "params",
            "DP",
            "saves",
            "save off (ms)",
            "save on (ms)",
            "added, paired (ms)",
            "trigger median / max (ms)",
            "step idle (ms)",
            "step during conversion (ms)",
            "steps during",
            "record checksums (ms, share of the save)",
        )
    ]
    for r in results:
        params = f"{r['params'] / 1e6:.1f}M" if r["params"] >= 100_000 else str(r["params"])
        rows.append(
            (
                r["model"],
                params,
                str(r["dp"]),
                f"{r['rounds']}+{r['rounds']}",
                str(r["save_off_ms"]),
                str(r["save_on_ms"]),
                str(r["added_ms"]),
                f"{r['trigger_ms']} / {r['trigger_max_ms']}",
                str(r["idle_step_ms"]),
                str(r["during_step_ms"]),
                str(r["during_steps"]),
                f"{r['checksums_ms']} ({100 * r['checksums_share']:.1f}%)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=[*MODELS, "all"], default="demo")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--idle-steps", type=int, default=20)
    ap.add_argument("--max-during-steps", type=int, default=500)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(WorkerConfig(**json.loads(args.worker)))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-save-overhead-"))
    models = list(MODELS) if args.model == "all" else [args.model]
    results = []
    for model in models:
        r = run_model(model, args.dp, args.saves, args.idle_steps, args.max_during_steps, work)
        r["machine"] = machine()
        results.append(r)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"save_overhead-{model}.json").write_text(json.dumps(r, indent=1))
    print(f"machine: {machine()}")
    print(table(results))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
