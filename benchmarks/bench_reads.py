"""What a restart reads, per rank and for the whole job: stock DeepSpeed's loads against megatron-ucp's.

Real DeepSpeed processes (the test harness, CPU, gloo) restart the 100M benchmark checkpoints with the
page cache dropped, every rank loading its own private copy of the folder it reads
(``UCP_HARNESS_PRIVATE_COPIES``): what is cached of a copy afterwards (``mincore``) is exactly what
that rank read of each file, as on a cluster where ranks do not share a page cache. Cases:

* ``8->4``: m100-dp8 resumed at DP 4; ``8->8``: m100-dp8 restarted at DP 8; ``4->3``: m100-dp4 at DP 3.

Routes (each case runs the ones that apply):

* ``stock-universal``: stock DeepSpeed's universal load of stock's converted folder (DP changes);
* ``stock-native``: stock DeepSpeed's native load (same DP);
* ``ours``: the hooks on the native tag (a DP change reshards, the same DP restarts natively), the
  module read once across the job (``module_read = distributed``, the default);
* ``ours-full``: the same with ``module_read = full`` (every rank reads the whole module, as DeepSpeed);
* ``ours-universal``: the hooks' universal route on megatron-ucp's converted folder (DP changes).

Per run: the load time (slowest rank's ``load_checkpoint`` between barriers), bytes each rank read of
the folder, the job's total over the folder's bytes, and peak RSS per rank (the process's maximum, and
its growth over the load). Medians over repetitions, routes in rotating order.
``benchmarks/results/reads-<cache>.{json,md}``.

    python benchmarks/bench_reads.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_convert as bc  # noqa: E402
import bench_resume as br  # noqa: E402
import make_checkpoint as mk  # noqa: E402

from tests.support.page_cache import evict, resident_bytes  # noqa: E402

CASES = {"8->4": ("m100-dp8", 4), "8->8": ("m100-dp8", 8), "4->3": ("m100-dp4", 3)}
ROUTES = ("stock-universal", "stock-native", "ours", "ours-full", "ours-universal")


def routes_of(case: str) -> list[str]:
    name, dp = CASES[case]
    if mk.SPECS[name].dp == dp:
        return ["stock-native", "ours", "ours-full"]
    return ["stock-universal", "ours", "ours-full", "ours-universal"]


def folder_of(route: str, roots: dict[str, Path]) -> tuple[Path, str]:
    """(root, tag) a route loads."""
    if route == "stock-universal":
        return roots["stock"], br.UNIVERSAL
    if route == "ours-universal":
        return roots["ours"], br.UNIVERSAL
    return roots["ours"], mk.TAG


def private_copies(root: Path, tag: str, base: Path, ranks: int) -> Path:
    """``base.rank<r>/<tag>`` per rank (the tag folder only), out of the page cache; returns ``base``."""
    for r in range(ranks):
        copy = base.with_name(f"{base.name}.rank{r}") / tag
        if not copy.is_dir():
            shutil.copytree(root / tag, copy)
        evict(copy)
    return base


def run(case: str, route: str, roots: dict[str, Path], scratch: Path) -> dict:
    from tests.support.dsharness import TrainSpec, run_training

    name, dp = CASES[case]
    spec = mk.SPECS[name]
    root, tag = folder_of(route, roots)
    base = private_copies(root, tag, scratch / f"{case.replace('->', 'to')}-{route}" / "ckpt", dp)
    hooks = route.startswith("ours")
    res = run_training(
        TrainSpec(
            dp=dp,
            optimizer="zero",
            steps=1,
            load_dir=base,
            load_tag=tag,
            load_universal=route == "stock-universal",
            plugin=hooks,
            plugin_kwargs={"module_read": "full" if route == "ours-full" else "distributed"},
            global_batch=dp,  # one sample per rank: nothing here depends on the batch
            hidden=spec.hidden,
            num_layers=spec.num_layers,
            vocab=spec.vocab,
            seq=8,
            uc_info=True,
            env={"UCP_HARNESS_PRIVATE_COPIES": "1"},
            timeout=1800,
        )
    )
    if not res.ok or res.loaded_step != 1:
        raise RuntimeError(f"{case} {route}: the load failed (exit {res.returncode}):\n{res.log[-4000:]}")
    files = sorted(str(p.relative_to(root / tag)) for p in (root / tag).rglob("*") if p.is_file() and p.suffix == ".pt")
    reads = []
    for r in range(dp):
        copy = base.with_name(f"{base.name}.rank{r}") / tag
        reads.append(sum(resident_bytes(copy / f) for f in files))
    folder = sum((root / tag / f).stat().st_size for f in files)
    stats = res.info["load_stats"]
    return {
        "case": case,
        "route": route,
        "load_s": max(s["wall"] for s in stats),
        "reads": reads,
        "folder_bytes": folder,
        "maxrss": [s["maxrss"] for s in stats],
        "rss_growth": [s["maxrss"] - s["rss_before"] for s in stats],
    }


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for case in CASES:
        for route in ROUTES:
            mine = [r for r in runs if r["case"] == case and r["route"] == route]
            if not mine:
                continue
            folder = mine[0]["folder_bytes"]
            out.setdefault(case, {})[route] = {
                "load_s": statistics.median(r["load_s"] for r in mine),
                "rank_read_mb_max": statistics.median(max(r["reads"]) for r in mine) / 1e6,
                "job_read_over_folder": statistics.median(sum(r["reads"]) / folder for r in mine),
                "folder_mb": folder / 1e6,
                "maxrss_mb": statistics.median(max(r["maxrss"]) for r in mine) / 1e6,
                "rss_growth_mb": statistics.median(max(r["rss_growth"]) for r in mine) / 1e6,
                "reps": len(mine),
            }
    return out


def markdown(summary: dict, meta: dict) -> str:
    m = meta["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB RAM; torch {m['torch']}, DeepSpeed "
        f"{m['deepspeed']}. Run {meta['date']}, `{meta['command']}`.",
        "",
        "Every rank loads its own copy of the folder, evicted from the page cache first: the bytes it read are "
        "what is cached of its copy afterwards (`mincore`), as on a cluster. Load: slowest rank, median. Job "
        "read: all ranks' bytes over the bytes of the folder loaded. RSS: the worst rank's peak, and its growth "
        "over the load.",
        "",
        "| case | route | load s | vs stock | worst rank read MB | job read / folder | peak RSS MB | RSS growth MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, routes in summary.items():
        stock = routes.get("stock-universal") or routes.get("stock-native")
        for route, row in routes.items():
            vs = f"{row['load_s'] / stock['load_s']:.2f}x" if stock else "-"
            lines.append(
                f"| {case} | {route} | {row['load_s']:.2f} | {vs} | {row['rank_read_mb_max']:.0f} | "
                f"{row['job_read_over_folder']:.2f}x | {row['maxrss_mb']:.0f} | {row['rss_growth_mb']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--results", default="reads-cold")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    meta = {
        "machine": bc.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/bench_reads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    runs = []
    for case in args.cases:
        roots = br.prepare(CASES[case][0])
        scratch = mk.CACHE_DIR / "reads-scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        routes = routes_of(case)
        try:
            for rep in range(args.reps):
                order = routes[rep % len(routes) :] + routes[: rep % len(routes)]
                for route in order:
                    result = run(case, route, roots, scratch)
                    result["rep"] = rep
                    runs.append(result)
                    print(
                        f"[bench_reads] {case} rep {rep + 1} {route}: load {result['load_s']:.2f} s, reads "
                        f"{sum(result['reads']) / result['folder_bytes']:.2f}x the folder",
                        flush=True,
                    )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs)
    bc.RESULTS_DIR.mkdir(exist_ok=True)
    (bc.RESULTS_DIR / f"{args.results}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1)
    )
    table = markdown(summary, meta)
    (bc.RESULTS_DIR / f"{args.results}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
