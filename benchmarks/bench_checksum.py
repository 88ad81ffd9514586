"""Throughput of the manifest checksum: ``ucp-wsum64-v3`` against ``ucp-wsum64-v2``, interleaved, one run.

::

    .venv/bin/python benchmarks/bench_checksum.py [--mb 256] [--reps 7]

Hashes the same in-memory float32 and bf16 buffers (random bits) with each algorithm in turn, as
the converter does while it writes (``fragment_sum`` over whole tensors) and as a loading rank does
over its fragments (1 MiB pieces at their offsets); reports the median GB/s of each and the ratio
v3 / v2. Writes ``benchmarks/results/checksum.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_ucp.format import integrity  # noqa: E402


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="buffer size in MB (default 256)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=args.mb << 20, dtype=np.uint8)
    rows = []
    for kind, width in (("float32", "<u4"), ("bf16", "<u2")):
        values = raw.view(width)
        piece = (1 << 20) // values.itemsize
        cases = {
            "whole tensor": lambda a: integrity.fragment_sum(values, 0, a),
            "1 MiB fragments": lambda a: [
                integrity.fragment_sum(values[s : s + piece], s, a) for s in range(0, values.size, piece)
            ],
        }
        for case, fn in cases.items():
            times = {a: [] for a in integrity.KNOWN_ALGORITHMS}
            for _ in range(args.reps):
                for algorithm in integrity.KNOWN_ALGORITHMS:  # interleaved: drift hits both alike
                    times[algorithm].append(_time(lambda: fn(algorithm)))
            speed = {a: raw.nbytes / statistics.median(t) / 1e9 for a, t in times.items()}
            row = {
                "dtype": kind,
                "case": case,
                **{f"{a} GB/s": round(v, 2) for a, v in speed.items()},
                "v3 / v2": round(speed[integrity.ALGORITHM] / speed[integrity.LEGACY_ALGORITHM], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = REPO_ROOT / "benchmarks" / "results" / "checksum.json"
    out.write_text(json.dumps({"mb": args.mb, "reps": args.reps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
