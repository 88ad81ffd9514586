"""Interleaved A/B of the resume benchmark between two source trees, with the read floor.

Each round runs ``benchmarks/bench_resume.py`` of tree B, then of tree A (the order alternates between rounds),
each its own code on the same cached checkpoints (``benchmarks/.cache``, which tree A must share: link it), the
same interpreter, the same routes. Tree B's runs add the ``floor`` route (the same ranks reading the same bytes
of the same cold files and nothing else, ``benchmarks/read_floor.py``); a tree whose benchmark has no floor
route is compared with tree B's floor of the same round. Results: per route and tree, the median load time
over every repetition, the median per-repetition ratio to stock's load in the same run, B over A, and each
route over the floor; ``benchmarks/results/<name>.{json,md}``.

    git worktree add /tmp/old <commit> && ln -s $PWD/benchmarks/.cache /tmp/old/benchmarks/.cache
    python benchmarks/ab_resume.py --a /tmp/old --b . --rounds 3 --name resume-ab-2026-11-27-vs-eda1ee0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_convert as bc  # noqa: E402

DEFAULT_ROUTES = ("stock", "reshard", "same-dp-checked", "same-dp-unchecked")


def _has_floor(tree: Path) -> bool:
    return '"floor"' in (tree / "benchmarks" / "bench_resume.py").read_text()


def one_run(tree: Path, routes: list[str], reps: int, stem: str, cache: str = "cold") -> list[dict]:
    """One ``bench_resume.py`` run of ``tree``; its runs, each with the run's stem."""
    wanted = [*routes, "floor"] if _has_floor(tree) else routes
    argv = [sys.executable, "benchmarks/bench_resume.py", "--routes", *wanted, "--reps", str(reps), "--cache", cache]
    argv += ["--no-readme", "--results", stem]
    subprocess.run(argv, cwd=tree, env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True)
    runs = json.loads((tree / "benchmarks" / "results" / f"{stem}.json").read_text())["runs"]
    return [{**run, "stem": stem} for run in runs]


def summarize(runs: dict[str, list[dict]], routes: list[str]) -> dict:
    """Per tree and route: median load, median ratio to stock in the same run and repetition, to the floor."""
    floors = {(r["stem"].rsplit("-", 1)[-1], r["rep"]): r["load_s"] for r in runs["B"] if r["route"] == "floor"}
    out: dict[str, dict] = {}
    for tree, mine in runs.items():
        stock = {(r["stem"], r["rep"]): r["load_s"] for r in mine if r["route"] == "stock"}
        for route in [*routes, "floor"]:
            these = [r for r in mine if r["route"] == route]
            if not these:
                continue
            to_stock = [r["load_s"] / stock[(r["stem"], r["rep"])] for r in these if (r["stem"], r["rep"]) in stock]
            to_floor = [
                r["load_s"] / floors[key]
                for r in these
                if (key := (r["stem"].rsplit("-", 1)[-1], r["rep"])) in floors and route != "floor"
            ]
            out.setdefault(route, {})[tree] = {
                "load_s": statistics.median(r["load_s"] for r in these),
                "loads": [r["load_s"] for r in these],
                "vs_stock": statistics.median(to_stock) if to_stock else None,
                "vs_floor": statistics.median(to_floor) if to_floor else None,
            }
    for row in out.values():
        if "A" in row and "B" in row:
            row["b_over_a"] = row["B"]["load_s"] / row["A"]["load_s"]
    return out


def markdown(summary: dict, meta: dict) -> str:
    m = meta["machine"]
    lines = [
        f"# Resume A/B ({meta['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"DeepSpeed {m['deepspeed']})",
        "",
        f"A = `{meta['a']}`, B = `{meta['b']}`; {meta['rounds']} rounds of `bench_resume.py` per tree (alternating, "
        f"{meta['reps']} repetitions each, cache {meta.get('cache', 'cold')}), {meta['checkpoint']} -> "
        f"DP {meta['dp']}. Load: the slowest "
        "rank's `engine.load_checkpoint`, median over every repetition; `vs stock`: median of the per-repetition "
        "ratios to stock's universal load in the same run; `vs floor`: to the floor of the same round and "
        "repetition (the same ranks reading the same bytes of the same cold files, nothing else).",
        "",
        "| route | A load s | B load s | B / A | A vs stock | B vs stock | A vs floor | B vs floor |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Optional[float], unit: str = "") -> str:
        return "-" if value is None else f"{value:.2f}{unit}"

    for route, row in summary.items():
        a, b = row.get("A", {}), row.get("B", {})
        lines.append(
            f"| {route} | {fmt(a.get('load_s'))} | {fmt(b.get('load_s'))} | {fmt(row.get('b_over_a'), 'x')} | "
            f"{fmt(a.get('vs_stock'), 'x')} | {fmt(b.get('vs_stock'), 'x')} | {fmt(a.get('vs_floor'), 'x')} | "
            f"{fmt(b.get('vs_floor'), 'x')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="tree A (the baseline)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--routes", nargs="+", default=list(DEFAULT_ROUTES))
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold", help="bench_resume.py's page cache (cold)")
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        order = ("B", "A") if round_ % 2 == 0 else ("A", "B")
        for tree in order:
            runs[tree] += one_run(trees[tree], args.routes, args.reps, f"{args.name}-{tree}-{round_}", args.cache)
    meta = {
        "machine": bc.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "a": str(args.a),
        "b": str(args.b),
        "rounds": args.rounds,
        "reps": args.reps,
        "cache": args.cache,
        "checkpoint": "m100-dp8",
        "dp": 4,
    }
    summary = summarize(runs, args.routes)
    bc.RESULTS_DIR.mkdir(exist_ok=True)
    (bc.RESULTS_DIR / f"{args.name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}))
    table = markdown(summary, meta)
    (bc.RESULTS_DIR / f"{args.name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
