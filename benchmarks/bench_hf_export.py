"""Hugging Face export at scale: time and peak memory of ``megatron-ucp export-hf`` against a durable copy.

On a synthetic Megatron llama checkpoint (``--preset``, default ``llama-1b``) converted once by ``megatron-ucp
convert``, page cache dropped before each run, one run after the other, ``--reps`` times each (medians):

* ``export bf16`` at each ``--shard-gib`` (the bound on what the exporter holds: peak RSS should follow it,
  not the model's size), and ``export fp32``;
* the floor: ``cp -r`` + ``sync`` of the bf16 export's own files (read, write and fsync of the bytes an export
  writes: what any exporter must at least do; the export reads twice as many, the fp32 masters).

Then, on paper, what a 7B and a 70B export cost at the measured rate relative to that floor. ::

    python benchmarks/bench_hf_export.py                          # llama-1b at DP 8, 3 runs each
    python benchmarks/bench_hf_export.py --preset llama-100m --reps 3

Results: ``benchmarks/results/hf-export-<preset>.{json,md}``. Never asserted (timings are the machine's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_convert as bc  # noqa: E402  (shared measuring helpers)

from megatron_ucp.plan.llama_shapes import preset  # noqa: E402
from megatron_ucp.synthetic.content import SyntheticSpec  # noqa: E402
from megatron_ucp.synthetic.writer import write_checkpoint  # noqa: E402

PAPER = {"AuroraGPT-7B": 6.74e9, "Llama-70B": 70.6e9}
"""Parameters of the models costed on paper (bf16 export: 2 bytes each)."""


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in bc.folder_files(path))


def _export(universal: Path, out: Path, dtype: str, shard_gib: float) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    bc.evict(universal)
    argv = [bc.python(), "-m", "megatron_ucp.cli", "-q", "export-hf", str(universal), "--output", str(out)]
    argv += ["--dtype", dtype, "--max-shard-size", str(shard_gib), "--no-progress"]
    result = bc.run_measured(argv, log=out.with_suffix(".log"))
    return {**result, "bytes": _folder_bytes(out)}


def _copy(source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    bc.evict(source)
    result = bc.run_measured(["bash", "-c", f"cp -r '{source}' '{out}' && sync"])
    return {**result, "bytes": _folder_bytes(out)}


def _median(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[len(ordered) // 2], "all_seconds": [round(r["seconds"], 3) for r in runs]}


def markdown(result: dict) -> str:
    floor = result["runs"]["copy bf16 export"]
    lines = [
        f"# Hugging Face export, {result['preset']} ({result['params'] / 1e9:.2f} B parameters), DP {result['dp']}",
        "",
        f"{result['date']}, {result['machine']}; medians of {result['reps']} runs, page cache dropped before each. "
        f"Universal folder: {result['universal_bytes'] / 2**30:.2f} GiB.",
        "",
        "| run | seconds | x copy | MB/s written | peak RSS | bytes |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        lines.append(
            f"| {name} | {run['seconds']:.2f} | {run['seconds'] / floor['seconds']:.2f} | "
            f"{run['bytes'] / run['seconds'] / 1e6:.0f} | {run['peak_rss'] / 2**20:.0f} MiB | "
            f"{run['bytes'] / 2**30:.2f} GiB |"
        )
    lines += ["", "On paper (bf16 export, at this machine's measured rate, and at the copy floor's ratio):", ""]
    lines += ["| model | bf16 bytes | export here | per 1 GB/s of file-system bandwidth |", "|---|---|---|---|"]
    for name, row in result["paper"].items():
        lines.append(
            f"| {name} | {row['bytes'] / 1e9:.1f} GB | {row['seconds_here'] / 60:.1f} min | "
            f"{row['seconds_per_gbps']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shard-gib", default="2,0.25", help="bf16 shard bounds to measure (GiB, comma-separated)")
    parser.add_argument("--scratch", type=Path, default=None)
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="ucp-hf-", dir=args.scratch))
    try:
        shape = preset(args.preset)
        spec = SyntheticSpec(shape=shape, dp=args.dp, seq_length=2048)
        tag = write_checkpoint(scratch / "ckpt", spec, progress=False).tag_dir
        universal = scratch / "ckpt" / f"{tag.name}_universal"
        bc.run_measured([bc.python(), "-m", "megatron_ucp.cli", "-q", "convert", str(tag), "--no-progress"])
        runs: dict[str, list[dict]] = {}
        for _ in range(args.reps):
            for gib in [float(g) for g in args.shard_gib.split(",")]:
                runs.setdefault(f"export bf16, shards <= {gib:g} GiB", []).append(
                    _export(universal, scratch / "bf16", "bf16", gib)
                )
            runs.setdefault("export fp32, shards <= 2 GiB", []).append(_export(universal, scratch / "fp32", "fp32", 2))
            shutil.rmtree(scratch / "fp32", ignore_errors=True)
            runs.setdefault("copy bf16 export", []).append(_copy(scratch / "bf16", scratch / "copy"))
            shutil.rmtree(scratch / "copy", ignore_errors=True)
        medians = {name: _median(r) for name, r in runs.items()}
        export = next(iter(medians.values()))
        floor = medians["copy bf16 export"]
        rate = export["bytes"] / export["seconds"]
        result = {
            "preset": args.preset,
            "params": shape.numel(),
            "dp": args.dp,
            "reps": args.reps,
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{bc.machine()['cpu']}, {bc.machine()['cores']} cores",
            "universal_bytes": _folder_bytes(universal),
            "runs": medians,
            "paper": {
                name: {
                    "bytes": 2 * n,
                    "seconds_here": 2 * n / rate,
                    "seconds_per_gbps": 2 * n / 1e9 * export["seconds"] / floor["seconds"],
                }
                for name, n in PAPER.items()
            },
        }
        out = BENCH_DIR / "results" / f"hf-export-{args.preset}"
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        print(f"median export / copy: {statistics.median([export['seconds'] / floor['seconds']]):.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
