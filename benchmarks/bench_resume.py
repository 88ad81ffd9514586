"""Resume benchmark: a DP change, stock DeepSpeed's universal load vs megatron-ucp's routes.

The checkpoint is ``m100-dp8`` (``benchmarks/make_checkpoint.py``: a real DeepSpeed 0.19.8 ZeRO-1
bf16 run at DP=8, DeepSpeedZeroOptimizer, 100.7M parameters), converted once by each tool into
its own copy of the root (the native files hard-linked, the universal folders cached in
``benchmarks/.cache/resume-<name>/``). Every repetition then starts ``--dp`` real DeepSpeed
processes (CPU, gloo; the test harness ``tests/support/dsharness``) that build the same model and call
``engine.load_checkpoint`` once, in a rotating order of the routes:

* ``stock``: stock DeepSpeed's own loader (``"load_universal": true``) on stock's folder;
* ``ours``: the megatron-ucp hooks on megatron-ucp's folder (strict accounting, checksums from
  the manifest);
* ``ours-on-stock``: the hooks on stock's folder (no manifest: accounting on the slower path that
  checksums each parameter's file on one rank);
* ``reshard``: the hooks given the native DP=8 tag (resume route ``auto``): each rank copies its
  partitions straight out of the native rank files, no universal folder at all;
* ``native-same-dp``: stock DeepSpeed's own native load of the same model saved at the DP it
  resumes at (``m100-dp4``): what a restart costs when nothing changes, the reshard's yardstick;
* ``same-dp-checked`` and ``same-dp-unchecked``: the same model saved through the hooks at DP 4
  (``m100-dp4-hooked``) restarted at DP 4, with the hooks (every rank file bound to its position and
  its save before DeepSpeed's load; after it, the masters against the saved weights and every
  partition against its recorded checksum) and without them (stock's load of the same files): what
  the same-DP checks cost a restart;
* ``reshard-latest`` and ``fallback``: the reshard of the same tag with no tag given, as Megatron loads (the
  restart judges the tag ``latest`` names before loading: ``integration/resume/fallback.py``), on a root whose
  ``latest`` names it (what the judge adds to a plain restart), and on a root whose ``latest`` names a newer tag with
  one rank file cut short (hard links but for that file), so that the restart falls back to the tag (what a fallback
  costs over the plain reshard);
* ``floor``: the same number of plain processes reading, with ``os.pread``, exactly the bytes of the native
  DP=8 tag that the reshard's ranks copy (their planned ranges of fp32 and every state, planned outside the
  timing by the hooks' own planner; ``benchmarks/read_floor.py``), from the same cold files, and nothing
  else: what no route that reads each needed byte once can beat here. Every route's ``vs floor`` is its
  load time over the floor's, per repetition, median.

Per rank, the harness measures the time of ``load_checkpoint`` between two barriers (the slowest
rank's is the load time), bytes through ``read`` calls and bytes read from storage
(``/proc/self/io`` ``rchar`` and ``read_bytes``; with ``--cache cold`` the folders are evicted from
the page cache before every run, so the job's storage reads, memory-mapped pages included, are
real), peak RSS, and for our loader the time of the accounting (``AccountingReport.seconds``). Results: medians over the
repetitions, ratios per repetition then their median; ``benchmarks/results/resume-<cache>.{json,md}``
and the table between the markers in ``benchmarks/README.md``.

    python benchmarks/bench_resume.py                   # m100-dp8 -> DP 4, cold cache, 3 repetitions
    python benchmarks/bench_resume.py --reps 5 --cache warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_convert as bc  # noqa: E402
import make_checkpoint as mk  # noqa: E402
import read_floor  # noqa: E402

ROUTES = (
    "stock",
    "ours",
    "ours-on-stock",
    "reshard",
    "native-same-dp",
    "same-dp-checked",
    "same-dp-unchecked",
    "reshard-latest",
    "fallback",
    "floor",
)
SAME_DP = {"m100-dp8": "m100-dp4"}
"""The same model saved at the resumed DP size, per benchmark checkpoint."""
SAME_DP_HOOKED = {"m100-dp8": "m100-dp4-hooked"}
"""The same model saved through the hooks at the resumed DP size (the same-DP checks' cost)."""
CHECKED = ("same-dp-checked", "same-dp-unchecked")
FROM_LATEST = ("reshard-latest", "fallback")
"""Loads that name no tag: the restart's judge runs (and, on the damaged root, falls back)."""
UNIVERSAL = f"{mk.TAG}_universal"


def _linked_copy(src: Path, dest: Path) -> None:
    """The native checkpoint root without copying its bytes (hard links; the loaders only read it)."""
    shutil.copytree(src, dest, copy_function=os.link, ignore=shutil.ignore_patterns(mk.MARKER))


def prepare(name: str) -> dict[str, Path]:
    """The two converted roots (cached): ``ours`` and ``stock``, each with ``<tag>_universal``."""
    src = mk.build(mk.SPECS[name])
    base = mk.CACHE_DIR / f"resume-{name}"
    roots = {"ours": base / "ours", "stock": base / "stock", "fallback": base / "fallback"}
    marker = base / "prepared.json"
    if marker.is_file() and json.loads(marker.read_text()).get("source") == (src / mk.MARKER).read_text():
        if not roots["fallback"].is_dir():
            _damaged_newer(src, roots["fallback"])
        return roots
    shutil.rmtree(base, ignore_errors=True)
    for tool in ("ours", "stock"):  # the fallback's root is the native one, damaged (below)
        root = roots[tool]
        _linked_copy(src, root)
        out = root / UNIVERSAL
        print(f"[bench_resume] converting {name} with {tool} ...", flush=True)
        for argv in bc.tool_argv(tool, root / mk.TAG, out, workers=2):
            bc.run_measured(argv, env={**os.environ, "DS_ACCELERATOR": "cpu"}, log=base / f"convert-{tool}.log")
        subprocess.run(["sync"], check=False)
    (roots["ours"] / "latest_universal").unlink(missing_ok=True)  # the auto route finds the twin by itself
    _damaged_newer(src, base / "fallback")
    marker.write_text(json.dumps({"source": (src / mk.MARKER).read_text()}))
    return roots


NEWER = "global_step2"


def _damaged_newer(src: Path, root: Path) -> None:
    """The native root (hard links) with a newer tag that ``latest`` names: the same files, rank 1's optimizer
    file cut short (a real copy, so that the source stays whole)."""
    _linked_copy(src, root)
    shutil.copytree(root / mk.TAG, root / NEWER, copy_function=os.link)
    (victim,) = (root / NEWER).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data[: len(data) // 2])
    (root / "latest").write_text(NEWER)


def universal_state_bytes(folder: Path) -> int:
    """Bytes of the optimizer state files (fp32 and every optimizer state) of a universal folder."""
    return sum(
        p.stat().st_size for p in (folder / "zero").rglob("*.pt") if p.name not in ("step.pt", "optimizer_state.pt")
    )


def run_route(route: str, roots: dict[str, Path], spec: "mk.CkptSpec", dp: int, cache: str, scratch: Path) -> dict:
    from tests.support.dsharness import TrainSpec, run_training

    if route == "floor":
        folder = roots["ours"] / mk.TAG
        plans = read_floor.plan_ranges(folder, dp)  # outside the timing, before the files are evicted
        if cache == "cold":
            bc.evict(folder)
        else:
            bc.warm(folder)
        return read_floor.run(plans)
    if route == "native-same-dp" or route in CHECKED:
        root = mk.build(mk.SPECS[(SAME_DP_HOOKED if route in CHECKED else SAME_DP)[spec.name]])
        folder = root / mk.TAG
    elif route == "fallback":
        root = roots["fallback"]
        folder = root / mk.TAG
    else:
        root = roots["stock" if route in ("stock", "ours-on-stock") else "ours"]
        folder = root / (mk.TAG if route in ("reshard", "reshard-latest") else UNIVERSAL)
    if cache == "cold":
        bc.evict(folder)
        bc.evict(root / mk.TAG)
    else:
        bc.warm(folder)
    native = route in ("reshard", "native-same-dp", *CHECKED, *FROM_LATEST)
    run = TrainSpec(
        dp=dp,
        optimizer="zero",
        steps=1,
        load_dir=root,
        load_tag=None if route in FROM_LATEST else mk.TAG if native else UNIVERSAL,
        load_universal=not native,
        plugin=route not in ("stock", "native-same-dp", "same-dp-unchecked"),
        global_batch=spec.dp,
        hidden=spec.hidden,
        num_layers=spec.num_layers,
        vocab=spec.vocab,
        seq=8,
        uc_info=True,
        timeout=1200,
    )
    res = run_training(run)
    if not res.ok or res.loaded_step != 1:
        raise RuntimeError(f"{route}: the load failed (exit {res.returncode}):\n{res.log[-4000:]}")
    stats = res.info["load_stats"]
    if route == "same-dp-checked":
        checked = [line for line in res.log.splitlines() if "every partition checked against the save's" in line]
        if not checked:
            raise RuntimeError(f"{route}: the same-DP checks did not run:\n{res.log[-4000:]}")
    elif route not in ("stock", "native-same-dp", "same-dp-unchecked"):
        if route == "fallback" and "FALLING BACK" not in res.log:
            raise RuntimeError(f"{route}: the restart did not fall back:\n{res.log[-4000:]}")
        kind = "native reshard" if route in ("reshard", *FROM_LATEST) else "universal load"
        summary = [line for line in res.log.splitlines() if f"megatron-ucp {kind}:" in line]
        if not summary or "every element placed exactly once" not in summary[-1]:
            raise RuntimeError(f"{route}: no clean accounting summary:\n{res.log[-4000:]}")
    return {"route": route, "ranks": stats, "load_s": max(s["wall"] for s in stats)}


def summarize(runs: list[dict], needed: int) -> dict:
    """Per route: medians over repetitions of the slowest rank's time, worst-rank figures, job totals."""
    out: dict[str, dict] = {}
    for route in ROUTES:
        mine = [r for r in runs if r["route"] == route]
        if not mine:
            continue
        ours = mine[0]["ranks"][0].get("phases") is not None
        acct = [max(s["phases"]["accounting"] for s in r["ranks"]) for r in mine] if ours else []
        out[route] = {
            "load_s": statistics.median(r["load_s"] for r in mine),
            "accounting_s": statistics.median(acct) if acct else None,
            "rchar_mb_max": statistics.median(max(s["rchar"] for s in r["ranks"]) for r in mine) / 1e6,
            "storage_over_needed": statistics.median(sum(s["read_bytes"] for s in r["ranks"]) / needed for r in mine),
            "maxrss_mb": statistics.median(max(s["maxrss"] for s in r["ranks"]) for r in mine) / 1e6,
            "reps": len(mine),
        }
    by_rep: dict[int, dict[str, float]] = {}
    for r in runs:
        by_rep.setdefault(r["rep"], {})[r["route"]] = r["load_s"]
    for route in out:
        ratios = [rep[route] / rep["stock"] for rep in by_rep.values() if route in rep and "stock" in rep]
        out[route]["vs_stock"] = statistics.median(ratios) if ratios else None
        same = [
            rep[route] / rep["native-same-dp"] for rep in by_rep.values() if route in rep and "native-same-dp" in rep
        ]
        out[route]["vs_same_dp"] = statistics.median(same) if same and route != "native-same-dp" else None
        floor = [rep[route] / rep["floor"] for rep in by_rep.values() if route in rep and "floor" in rep]
        out[route]["vs_floor"] = statistics.median(floor) if floor and route != "floor" else None
        if route in FROM_LATEST:
            plain = [rep[route] / rep["reshard"] for rep in by_rep.values() if route in rep and "reshard" in rep]
            out[route]["vs_reshard"] = statistics.median(plain) if plain else None
        if route == "same-dp-checked":
            checks = [rep[route] / rep["same-dp-unchecked"] for rep in by_rep.values() if set(CHECKED) <= set(rep)]
            out[route]["vs_unchecked"] = statistics.median(checks) if checks else None
    return out


def markdown(result: dict, meta: dict) -> str:
    m = meta["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB RAM; Python {m['python']}, torch "
        f"{m['torch']}, DeepSpeed {m['deepspeed']}. Load average at start {m['load_average_start'][0]:.1f}. "
        f"Run {meta['date']}, `{meta['command']}`.",
        "",
        f"Checkpoint {result['name']} ({result['params'] / 1e6:.1f}M params, saved at DP={result['dp_from']}) "
        f"loaded at DP={result['dp_to']} by {result['dp_to']} processes on this machine; cache "
        f"{result['cache']}; {result['reps']} repetitions, routes in rotating order. Load: "
        "`engine.load_checkpoint` between two barriers, slowest rank, median; ratios: median of the "
        "per-repetition ratios. Accounting: checksums and checks, the rank that spent the most on them (the "
        "all-reduce is not counted: it waits for the slowest rank's reading). `read()` MB: bytes through read calls on "
        "the worst rank (stock `torch.load`s each whole state file it needs a fragment of; ours maps the "
        "files and touches only its fragments). Storage read: bytes all ranks read from storage, over "
        f"what the load needs once ({result['needed_bytes'] / 1e6:.0f} MB: optimizer state and model states; "
        "the ranks share one page cache here).",
        "",
        "| route | folder | load s | vs stock | vs floor | accounting s | accounting % | `read()` MB (worst rank) "
        "| storage read / needed | peak RSS MB (worst rank) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    folders = {
        "stock": "stock's universal",
        "ours": "ours (universal)",
        "ours-on-stock": "stock's universal (no checksums)",
        "reshard": "native DP=8 tag, no universal folder",
        "native-same-dp": "native DP=4 tag of the same model (stock load)",
        "same-dp-checked": "native DP=4 tag saved through the hooks, loaded with them",
        "same-dp-unchecked": "the same tag, stock load",
        "reshard-latest": "native DP=8 tag named by `latest`, no tag given (the restart's judge)",
        "fallback": "`latest` names a newer tag with a rank file cut short: falls back to the DP=8 tag",
        "floor": "native DP=8 tag: the reshard's ranges read with `pread`, nothing else",
    }
    for route, row in result["routes"].items():
        acct = row["accounting_s"]
        vs = "-" if row["vs_stock"] is None else f"{row['vs_stock']:.2f}x"
        if row.get("vs_same_dp") is not None and route not in CHECKED:
            vs += f" ({row['vs_same_dp']:.2f}x same-DP)"
        if row.get("vs_reshard") is not None:
            vs += f" ({row['vs_reshard']:.2f}x reshard)"
        if row.get("vs_unchecked") is not None:
            vs += f" ({row['vs_unchecked']:.2f}x unchecked)"
        floor = "-" if row.get("vs_floor") is None else f"{row['vs_floor']:.2f}x"
        acct_s = "-" if acct is None else f"{acct:.2f}"
        acct_pct = "-" if acct is None else f"{100 * acct / row['load_s']:.0f}%"
        lines.append(
            f"| {route} | {folders[route]} | {row['load_s']:.2f} | {vs} | {floor} | {acct_s} | {acct_pct} | "
            f"{row['rchar_mb_max']:.0f} | {row['storage_over_needed']:.2f}x | {row['maxrss_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="m100-dp8", choices=sorted(mk.SPECS))
    ap.add_argument("--dp", type=int, default=4, help="DP size to resume at (default 4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--results", help="results file stem (default resume-<cache>)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    spec = mk.SPECS[args.name]
    roots = prepare(args.name)
    meta = {
        "machine": bc.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/bench_resume.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    runs = []
    routes = list(args.routes)
    if "stock" not in routes:
        routes.insert(0, "stock")  # the ratios need it
    for rep in range(args.reps):
        order = routes[rep % len(routes) :] + routes[: rep % len(routes)]
        for route in order:
            t0 = time.perf_counter()
            run = run_route(route, roots, spec, args.dp, args.cache, mk.CACHE_DIR)
            run["rep"] = rep
            runs.append(run)
            print(
                f"[bench_resume] rep {rep + 1}/{args.reps} {route}: load {run['load_s']:.2f} s "
                f"(run {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    folder = roots["ours"] / UNIVERSAL
    needed = universal_state_bytes(folder) + (folder / "mp_rank_00_model_states.pt").stat().st_size
    meta["machine"]["load_average_end"] = os.getloadavg()
    result = {
        "name": args.name,
        "params": spec.params,
        "dp_from": spec.dp,
        "dp_to": args.dp,
        "cache": args.cache,
        "reps": args.reps,
        "needed_bytes": needed,
        "routes": summarize(runs, needed),
    }
    bc.RESULTS_DIR.mkdir(exist_ok=True)
    stem = args.results or f"resume-{args.cache}"
    (bc.RESULTS_DIR / f"{stem}.json").write_text(json.dumps({"meta": meta, "result": result, "runs": runs}, indent=1))
    table = markdown(result, meta)
    (bc.RESULTS_DIR / f"{stem}.md").write_text(table)
    if not args.no_readme:
        bc.update_readme(args.cache, table, bench="resume")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
