"""What one rank reads of a DP 768 checkpoint when it restarts at another size, the module included.

A synthetic checkpoint (``megatron-ucp synthesize``, held to real saves by the tests) at DP 768; sampled
ranks of a resume at DP 384 / 767 / 1024 / 1536, each played by one process
(``resume_probe.py --native --module``: the native reshard's own code for the optimizer ranges, then the
rank's part of the model states as ``module_read = distributed`` reads it: the pickle and its partition's
range of the saved weights, compared with its masters rounded). The folder is evicted from the page cache
before every probe, so ``read_bytes`` is what that rank read.
``benchmarks/results/module-read-scale-<preset>.{json,md}``.

    python benchmarks/bench_module_scale.py --preset llama-100m
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT))

import bench_convert as bc  # noqa: E402
import make_checkpoint as mk  # noqa: E402

from tests.support.page_cache import evict  # noqa: E402

WORLDS = (384, 767, 1024, 1536)


def checkpoint(preset: str, dp: int) -> Path:
    root = mk.CACHE_DIR / f"module-scale-{preset}-dp{dp}"
    if not (root / "latest").is_file():
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "megatron_ucp.cli", "synthesize", str(root), "--preset", preset, "--dp", str(dp),
             "--flavour", "plain", "--iteration", "7", "--no-progress"],
            check=True,
            cwd=REPO_ROOT,
        )  # fmt: skip
    return root / "global_step7"


def sampled(world: int) -> list[int]:
    return sorted({0, world // 2, world - 1})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-100m")
    ap.add_argument("--dp", type=int, default=768)
    ap.add_argument("--table-only", action="store_true", help="re-render the table of the last run")
    args = ap.parse_args(argv)
    tag = checkpoint(args.preset, args.dp)
    rows = []
    if "--table-only" in sys.argv:  # re-render the last run
        rows = json.loads((bc.RESULTS_DIR / f"module-read-scale-{args.preset}.json").read_text())["rows"]
    for world in WORLDS if not rows else ():
        for rank in sampled(world):
            evict(tag)
            out = subprocess.run(
                [sys.executable, str(BENCH_DIR / "resume_probe.py"), str(tag), "--native", "--module",
                 "--preset", args.preset, "--world", str(world), "--rank", str(rank)],
                capture_output=True, text=True, cwd=REPO_ROOT, check=False,
            )  # fmt: skip
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            if out.returncode != 0 or not line.startswith("{"):
                raise RuntimeError(f"probe {world}/{rank} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            rows.append(json.loads(line))
            print(f"[module-scale] {world} rank {rank}: {line[:160]}", flush=True)
    m = bc.machine()
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores; {time.strftime('%Y-%m-%d %H:%M')}, "
        f"`python benchmarks/bench_module_scale.py --preset {args.preset}`.",
        "",
        f"Synthetic {args.preset} checkpoint at DP {args.dp}; each sampled rank of the resumed job played by one "
        "process, the folder evicted before each. Optimizer: the rank's ranges of the old rank files (the native "
        "reshard's reads), over its share. Pickles: the model states' and old rank 0's (what the facts need; the "
        "first rank reads them for the job, every rank reads the model states' one). Model states: the rank's "
        "partition's range of the saved "
        "weights (compared, bit for bit, with its masters rounded), against the whole file every rank of a "
        "DeepSpeed restart reads.",
        "",
        "| DP to | rank | optimizer read / share | pickles KB | weights read KB | weights share KB | model-states "
        "file MB | file / what the rank read of it | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['rank']} | {r['read_bytes'] / max(1, r['share_bytes']):.2f}x | "
            f"{r['facts_read_bytes'] / 1e3:.0f} | {r['module_read_bytes'] / 1e3:.0f} | "
            f"{r['module_share_bytes'] / 1e3:.0f} | {r['module_file_bytes'] / 1e6:.1f} | "
            f"{r['module_file_bytes'] / max(1, r['module_read_bytes'] + r['facts_read_bytes']):.0f}x | "
            f"{r['bit_exact'] and r['weights_exact']} |"
        )
    stem = bc.RESULTS_DIR / f"module-read-scale-{args.preset}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": m, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
