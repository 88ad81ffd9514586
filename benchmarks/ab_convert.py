"""Interleaved A/B of ``megatron-ucp convert`` between two source trees, beside the durable copy floor.

Each repetition runs, in an order that alternates between repetitions, the conversion of one cached
benchmark checkpoint by tree A and by tree B (each ``python -m megatron_ucp.cli convert`` with
``PYTHONPATH=<tree>`` and the tree as working directory, which ``python -m`` imports from first; the
same interpreter and venv) and ``cp -r`` + ``sync`` of the same tag (the
durable I/O floor). Per run: wall seconds, CPU seconds of the process tree (``getrusage`` of the
children), peak resident memory of the tree (psutil, every 10 ms). Medians and the per-repetition
ratios' medians go to ``benchmarks/results/<name>.{json,md}``.

    git worktree add /tmp/old <commit>
    python benchmarks/ab_convert.py --a /tmp/old --b . --name convert-ab-2026-11-25 --reps 7
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_convert as bc  # noqa: E402
import make_checkpoint as mk  # noqa: E402


def _measured(argv: list[str], env: dict, cwd: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = bc.run_measured(argv, env=env, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def one(kind: str, tree: Path, tag: Path, scratch: Path, workers: int, cache: str) -> dict:
    out = scratch / f"out-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    if cache == "cold":
        bc.evict(tag)
    else:
        bc.warm(tag)
    env = {**os.environ, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu"}
    if kind == "cp+sync":
        run = _measured(["bash", "-c", f"cp -r '{tag}' '{out}' && sync -f '{out}'"], env, tree)
    else:
        argv = [sys.executable, "-m", "megatron_ucp.cli", "convert", str(tag), "--output", str(out)]
        run = _measured([*argv, "--workers", str(workers), "--no-progress"], env, tree)  # -m imports from cwd
    shutil.rmtree(out, ignore_errors=True)
    return {"kind": kind, "wall_s": run["seconds"], "cpu_s": run["cpu_s"], "peak_rss_mb": run["peak_rss"] / 2**20}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="tree A (the baseline)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    ap.add_argument("--checkpoint", default="m100-dp8", choices=sorted(mk.SPECS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm")
    ap.add_argument("--name", default="convert-ab")
    args = ap.parse_args(argv)
    tag = mk.build(mk.SPECS[args.checkpoint]) / mk.TAG
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    runs = []
    with tempfile.TemporaryDirectory(dir=mk.CACHE_DIR, prefix="ab-") as tmp:
        for rep in range(args.reps):
            order = ["A", "B", "cp+sync"] if rep % 2 == 0 else ["B", "A", "cp+sync"]
            for kind in order:
                run = one(kind, trees.get(kind, trees["B"]), tag, Path(tmp), args.workers, args.cache)
                run["rep"] = rep
                runs.append(run)
                print(f"[ab] rep {rep + 1}/{args.reps} {kind}: {run['wall_s']:.2f} s", flush=True)
    table = {}
    for kind in ("A", "B", "cp+sync"):
        mine = [r for r in runs if r["kind"] == kind]
        table[kind] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "peak_rss_mb")}

    def ratio(a: str, b: str, key: str = "wall_s") -> float:
        reps = {}
        for r in runs:
            reps.setdefault(r["rep"], {})[r["kind"]] = r[key]
        return statistics.median(x[a] / x[b] for x in reps.values())

    ratios = {
        "B/A wall": ratio("B", "A"),
        "B/A cpu": ratio("B", "A", "cpu_s"),
        "A/cp+sync wall": ratio("A", "cp+sync"),
        "B/cp+sync wall": ratio("B", "cp+sync"),
    }
    m = bc.machine()
    lines = [
        f"# Conversion A/B ({time.strftime('%Y-%m-%d')}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"DeepSpeed {m['deepspeed']})",
        "",
        f"A = `{trees['A']}`, B = `{trees['B']}`; checkpoint {args.checkpoint} ({mk.folder_bytes(tag) / 1e9:.2f} GB), "
        f"{args.reps} interleaved repetitions, cache {args.cache}, {args.workers} workers. Medians; ratios are "
        "medians of per-repetition ratios.",
        "",
        "| run | wall s | CPU s | peak RSS MiB |",
        "|---|---|---|---|",
        *(f"| {k} | {v['wall_s']:.2f} | {v['cpu_s']:.2f} | {v['peak_rss_mb']:.0f} |" for k, v in table.items()),
        "",
        *(f"* {k}: {v:.2f}x" for k, v in ratios.items()),
    ]
    bc.RESULTS_DIR.mkdir(exist_ok=True)
    (bc.RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (bc.RESULTS_DIR / f"{args.name}.json").write_text(
        json.dumps({"machine": m, "args": vars(args) | {"a": str(args.a), "b": str(args.b)}, "runs": runs}, indent=1)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
