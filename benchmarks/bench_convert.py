"""Conversion benchmark: ``megatron-ucp convert`` vs DeepSpeed's ``ds_to_universal`` vs copying the bytes.

For every checkpoint (real DeepSpeed ZeRO-1 bf16 runs, built once and cached by
``benchmarks/make_checkpoint.py`` in ``benchmarks/.cache/``), each repetition runs, in a rotating
order so that neither side always goes first on a noisy shared machine:

* ``stock``: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` with
  ``--num_extract_workers W --num_merge_workers W``;
* ``ours``: ``megatron-ucp convert TAG --output OUT --workers W`` (durable: every file fsynced);
* ``cp``: ``cp -r TAG OUT`` (the I/O floor: the same bytes copied, page cache only);
* ``cp+sync``: ``cp -r TAG OUT`` then ``sync`` of the copied files (the durable I/O floor);
* ``verify`` (not in the default set): ``megatron-ucp verify TAG``, the read a background verify job makes of
  each save (``--ucp-verify-saves``): every file whole, one save, every recorded partition, every element finite.

Every tool runs as a child process; wall time and the peak resident memory of the whole process
tree (sum of RSS over the process and its descendants, sampled every 10 ms with psutil) are
recorded. After every ``ours`` run, ``megatron-ucp verify OUT --source TAG`` checks the output
bit for bit (not timed). Caches: ``--cache warm`` (default) reads the source once before the
repetitions; ``--cache cold`` evicts the source files from the page cache before every run
(``posix_fadvise(DONTNEED)`` per file: no root needed, other users' caches untouched). Results
(medians) go to ``benchmarks/results/<name>.{json,md}`` and the table between the markers in
``benchmarks/README.md``.

    python benchmarks/bench_convert.py                        # everything, warm, 3 repetitions
    python benchmarks/bench_convert.py --only m100-dp8 --reps 5 --cache cold
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

import make_checkpoint as mk  # noqa: E402

RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
TOOLS = ("stock", "ours", "cp", "cp+sync")
EXTRA_TOOLS = ("verify",)
"""Run only when named (``--tools``); in the results' JSON and ratios, not in the README table."""
#: The default suite: the headline checkpoint, the DP series (fixed model; DP=768 re-partitioned from the
#: real DP=8 run, see make_checkpoint.synthesize) and the model-size series (DP=8).
SUITE = ("m100-dp8", "m25-dp8", "m25-dp16", "m25-dp32", "m25-dp8-as-dp768", "m50-dp8")
SYNTHETIC = {"m25-dp8-as-dp768": ("m25-dp8", 768)}


def ensure(name: str) -> Path:
    if name in SYNTHETIC:
        mk.synthesize(*SYNTHETIC[name])
        return mk.checkpoint_root(name)
    return mk.build(mk.SPECS[name])


def spec_of(name: str) -> "mk.CkptSpec":
    return mk.SPECS[SYNTHETIC[name][0]] if name in SYNTHETIC else mk.SPECS[name]


def python() -> str:
    return sys.executable


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(
    argv: list[str], env: Optional[dict] = None, log: Optional[Path] = None, cwd: Optional[Path] = None
) -> dict:
    """Run ``argv`` (in ``cwd``, default the repository: ``python -m`` imports from there first); wall
    time, peak tree RSS; raise on failure with the log tail."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd or REPO_ROOT)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    if log:
        out.close()
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:] if log else ""
        raise RuntimeError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{tail}")
    return {"seconds": wall, "peak_rss": peak}


def folder_files(path: Path) -> list[Path]:
    return [p for p in Path(path).rglob("*") if p.is_file()]


def evict(path: Path) -> None:
    """Drop a folder's files from the page cache (clean pages only; needs no privileges)."""
    for f in folder_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: Path) -> None:
    for f in folder_files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def cached_fraction(path: Path) -> Optional[float]:
    """Fraction of the folder's bytes in the page cache (util-linux ``fincore``), None if unavailable."""
    files = folder_files(path)
    if not shutil.which("fincore") or not files:
        return None
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *map(str, files)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        res = size = 0
        for line in out.splitlines():
            a, b = line.split()
            res, size = res + int(a), size + int(b)
        return res / size if size else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def tool_argv(tool: str, tag: Path, out: Path, workers: int) -> list[list[str]]:
    if tool == "stock":
        return [
            [
                python(),
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(tag),
                "--output_folder",
                str(out),
                "--inject_missing_state",
                "--num_extract_workers",
                str(workers),
                "--num_merge_workers",
                str(workers),
            ]
        ]
    if tool == "ours":
        return [
            [
                python(),
                "-m",
                "megatron_ucp.cli",
                "convert",
                str(tag),
                "--output",
                str(out),
                "--workers",
                str(workers),
                "--no-progress",
            ]
        ]
    if tool == "verify":
        return [[python(), "-m", "megatron_ucp.cli", "verify", str(tag), "--no-progress"]]
    if tool == "cp":
        return [["cp", "-r", str(tag), str(out)]]
    if tool == "cp+sync":
        return [["cp", "-r", str(tag), str(out)], ["sh", "-c", f'sync "{out}"/* "{out}"']]
    raise ValueError(tool)


def baseline_rss() -> tuple[int, bool]:
    """Resident memory of a process that has imported the converter and nothing more (the fixed
    overhead), and whether that import brought torch in."""
    code = (
        "import sys, megatron_ucp.convert.execute, megatron_ucp.cli, megatron_ucp.cli.convert, psutil, os; "
        "print(psutil.Process(os.getpid()).memory_info().rss, int('torch' in sys.modules))"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    rss, torch_imported = subprocess.run(
        [python(), "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT, check=True
    ).stdout.split()[-2:]
    return int(rss), bool(int(torch_imported))


def startup_probe(reps: int = 5) -> float:
    """Median seconds for a process to start and import the converter (the CLI's fixed cost)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(
            [python(), "-c", "import megatron_ucp.cli, megatron_ucp.convert.execute, megatron_ucp.cli.convert"],
            check=True,
            env=env,
            cwd=REPO_ROOT,
        )
        times.append(time.perf_counter() - t0)
    return median(times)


def metadata_probe(name: str) -> dict:
    """RSS and time to read every rank file's metadata and build the plan (memory-mapped: no tensor bytes)."""
    tag = ensure(name) / mk.TAG
    code = (
        "import os, time, psutil, sys; from pathlib import Path; import megatron_ucp.convert.execute as C, "
        "megatron_ucp.deepspeed.reader as R; p = psutil.Process(); b = p.memory_info().rss; t = time.perf_counter(); "
        f"m = R.read_checkpoint(Path({str(tag)!r})); plan = C.plan_checkpoint(m); "
        "print(m.dp, time.perf_counter() - t, p.memory_info().rss - b, b)"
    )
    out = subprocess.run(
        [python(), "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    ).stdout.split()
    dp, seconds, delta, base = int(out[0]), float(out[1]), int(out[2]), int(out[3])
    return {"name": name, "dp": dp, "seconds": round(seconds, 3), "rss_delta": delta, "rss_base": base}


def machine() -> dict:
    import torch

    try:
        import deepspeed  # noqa: F401

        ds = deepspeed.__version__
    except Exception:  # pragma: no cover
        ds = "?"
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    disk = shutil.disk_usage(BENCH_DIR)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "disk_free_gb": round(disk.free / 1e9, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": ds,
        "load_average_start": os.getloadavg(),
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_one(
    name: str, reps: int, workers: int, cache: str, tools: tuple[str, ...], scratch: Path, verify: bool
) -> dict:
    root = ensure(name)
    tag = root / mk.TAG
    info = mk.info(name)
    nbytes = mk.folder_bytes(tag)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    runs: dict[str, list[dict]] = {t: [] for t in tools}
    if cache == "warm":
        warm(tag)
    cached_before = cached_fraction(tag)
    print(
        f"[bench] {name}: {info['params'] / 1e6:.1f}M params, DP={info['dp']}, {nbytes / 1e9:.2f} GB, "
        f"{reps} reps, cache {cache} (cached {cached_before if cached_before is None else f'{cached_before:.0%}'})",
        flush=True,
    )
    for rep in range(reps):
        order = tools[rep % len(tools) :] + tools[: rep % len(tools)]
        for tool in order:
            out = scratch / f"{name}-{tool.replace('+', '_')}"
            shutil.rmtree(out, ignore_errors=True)
            if cache == "cold":
                evict(tag)
            log = scratch / f"{name}-{tool.replace('+', '_')}.log"
            total = {"seconds": 0.0, "peak_rss": 0}
            for argv in tool_argv(tool, tag, out, workers):
                r = run_measured(argv, env=env, log=log)
                total["seconds"] += r["seconds"]
                total["peak_rss"] = max(total["peak_rss"], r["peak_rss"])
            if tool == "ours" and verify:
                v = subprocess.run(
                    [python(), "-m", "megatron_ucp.cli", "verify", str(out), "--source", str(tag), "--no-progress"],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=REPO_ROOT,
                )
                total["verified"] = v.returncode == 0
                if v.returncode != 0:
                    raise RuntimeError(f"verify failed for {out}:\n{v.stdout[-2000:]}{v.stderr[-2000:]}")
            runs[tool].append(total)
            print(
                f"[bench]   rep {rep + 1} {tool:8s} {total['seconds']:7.2f} s  peak RSS "
                f"{total['peak_rss'] / 1e6:7.0f} MB" + ("  verified bit-exact" if total.get("verified") else ""),
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
    med = {
        t: {"seconds": median([r["seconds"] for r in runs[t]]), "peak_rss": median([r["peak_rss"] for r in runs[t]])}
        for t in tools
    }
    # Ratios per repetition (the runs of one repetition are adjacent in time, so they share the
    # machine's load of the moment), then the median: steadier than a ratio of medians.
    ratios = {}
    for a, b in (("stock", "ours"), ("ours", "cp"), ("ours", "cp+sync"), ("verify", "ours"), ("verify", "stock")):
        if a in runs and b in runs:
            ratios[f"{a}/{b}"] = median([x["seconds"] / y["seconds"] for x, y in zip(runs[a], runs[b])])
    return {
        "name": name,
        "params": info["params"],
        "dp": info["dp"],
        "bytes": nbytes,
        "largest_param_state_bytes": spec_of(name).largest_param * 4,
        "optimizer": info["optimizer_class"],
        "synthetic": name in SYNTHETIC,
        "cache": cache,
        "cached_fraction_before": cached_before,
        "reps": reps,
        "workers": workers,
        "runs": runs,
        "median": med,
        "ratios": ratios,
    }


def ratio(result: dict, key: str) -> str:
    value = result.get("ratios", {}).get(key)
    return f"{value:.2f}x" if value else "-"


def markdown(results: list[dict], meta: dict) -> str:
    lines = []
    m = meta["machine"]
    lines.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB RAM, Linux {m['kernel']}; "
        f"Python {m['python']}, torch {m['torch']}, DeepSpeed {m['deepspeed']}. Load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_average_start'])} (a shared machine: medians, ratios "
        f"from runs interleaved in one session). Run {meta['date']}, `{meta['command']}`."
    )
    lines.append("")
    runtime = (
        "Python + torch" if meta.get("converter_imports_torch", True) else "Python; the converter does not import torch"
    )
    lines.append(
        f"Times: medians over the repetitions; ratios: the median of the per-repetition ratios. Fixed "
        f"overhead: a process that has only imported the converter holds {meta['baseline_rss'] / 1e6:.0f} MB "
        f"({runtime}). Peak RSS: the sum over the process tree, sampled every 10 ms."
    )
    lines.append("")
    if meta.get("startup_seconds"):
        lines.append(
            f"Start-up: a process that starts and imports the converter ({runtime}) takes "
            f"{meta['startup_seconds']:.2f} s (median of 5): included in every `ours` time."
        )
        lines.append("")
    probe = meta.get("metadata_probe")
    if probe:
        lines.append(
            f"Metadata at DP={probe['dp']}: reading all {probe['dp']} rank files (memory-mapped) and "
            f"building the plan took {probe['seconds']:.2f} s and {probe['rss_delta'] / 1e6:.1f} MB of RSS."
        )
        lines.append("")
    lines.append(
        "| checkpoint | params | DP | GB | cache | stock s | ours s | cp s | cp+sync s | stock/ours | "
        "ours/cp | ours/(cp+sync) | ours MB/s | stock peak MB | ours peak MB | ours peak - fixed MB | "
        "largest state MB |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        md = r["median"]

        def s(tool: str) -> Optional[float]:
            return md[tool]["seconds"] if tool in md else None

        def rss(tool: str) -> str:
            return f"{md[tool]['peak_rss'] / 1e6:.0f}" if tool in md else "-"

        ours_rss = md["ours"]["peak_rss"] if "ours" in md else None
        label = r["name"] + (" (synthetic)" if r.get("synthetic") else "")
        lines.append(
            f"| {label} | {r['params'] / 1e6:.1f}M | {r['dp']} | {r['bytes'] / 1e9:.2f} | {r['cache']} | "
            + " | ".join(f"{s(t):.2f}" if s(t) else "-" for t in TOOLS)
            + f" | {ratio(r, 'stock/ours')} | {ratio(r, 'ours/cp')} | {ratio(r, 'ours/cp+sync')} | "
            f"{(r['bytes'] / s('ours') / 1e6) if s('ours') else 0:.0f} | {rss('stock')} | {rss('ours')} | "
            f"{(ours_rss - meta['baseline_rss']) / 1e6 if ours_rss else 0:.0f} | "
            f"{r['largest_param_state_bytes'] / 1e6:.0f} |"
        )
    return "\n".join(lines) + "\n"


def update_readme(cache: str, table: str, bench: str = "convert") -> None:
    """Replace the README block of this benchmark and cache mode (``<!-- bench-<bench>:<cache>:begin/end -->``)."""
    begin, end = f"<!-- bench-{bench}:{cache}:begin -->", f"<!-- bench-{bench}:{cache}:end -->"
    text = README.read_text() if README.exists() else ""
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    README.write_text(text)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        nargs="+",
        choices=sorted(set(mk.SPECS) | set(SYNTHETIC)),
        help="checkpoints to run (default: the suite)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2, help="workers for both converters (default 2)")
    ap.add_argument("--cache", choices=("warm", "cold", "both"), default="warm")
    ap.add_argument("--tools", nargs="+", choices=TOOLS + EXTRA_TOOLS, default=list(TOOLS))
    ap.add_argument("--scratch", type=Path, help="where outputs go (default: a temp folder next to the cache)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of our outputs")
    ap.add_argument("--name", default="latest", help="results file name (benchmarks/results/<name>.{json,md})")
    ap.add_argument("--no-readme", action="store_true", help="do not update the README table")
    ap.add_argument(
        "--render",
        nargs="+",
        metavar="NAME",
        help="only rebuild the README tables from saved results/<NAME>.json (no runs)",
    )
    args = ap.parse_args(argv)
    if args.render:
        for name in args.render:
            data = json.loads((RESULTS_DIR / f"{name}.json").read_text())
            for cache in ("warm", "cold"):
                rows = [r for r in data["results"] if r["cache"] == cache]
                if rows:
                    update_readme(cache, markdown(rows, data["meta"]))
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    names = args.only or list(SUITE)
    caches = ("warm", "cold") if args.cache == "both" else (args.cache,)
    mk.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="scratch-", dir=mk.CACHE_DIR))
    scratch.mkdir(parents=True, exist_ok=True)
    rss, torch_imported = baseline_rss()
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "baseline_rss": rss,
        "converter_imports_torch": torch_imported,
        "startup_seconds": startup_probe(),
        "command": "python benchmarks/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if "m25-dp8-as-dp768" in names:
        meta["metadata_probe"] = metadata_probe("m25-dp8-as-dp768")
    results = []
    try:
        for name in names:
            for cache in caches:
                results.append(
                    bench_one(name, args.reps, args.workers, cache, tuple(args.tools), scratch, not args.no_verify)
                )
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    meta["machine"]["load_average_end"] = os.getloadavg()
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    tables = []
    for cache in caches:
        table = markdown([r for r in results if r["cache"] == cache], meta)
        tables.append(table)
        if not args.no_readme:
            update_readme(cache, table)
    table = "\n".join(tables)
    (RESULTS_DIR / f"{args.name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
