"""What the background Hugging Face export costs training, on the real Megatron-DeepSpeed.

::

    MEGATRON_DEEPSPEED_DIR=../shared/third_party/megatron-deepspeed \\
    PYTHONPATH=.venv-ds/0.19.5 .venv/bin/python benchmarks/hf_export_stall.py [--rounds 3]

As ``bench_save_overhead.py`` measures the background conversion: the same training (``pretrain_gpt_alcf.py``
through the runner, a llama model of ``--hidden`` x ``--layers``, DP 2, a save every ``--save-interval``
iterations) run with ``--ucp-async-convert`` alone and with ``--ucp-export-hf`` added, the order alternating per
round, so both see the same machine. From Megatron's own log: the time of each save (``saving checkpoint`` to
``successfully saved``: what training waits for), and ``elapsed_time_per_iteration_ms`` of the iterations right
after a save (when the background converter, and with the flag the export, run beside training) against the
others. Medians over rounds; paired differences. Writes ``benchmarks/results/hf-export-stall.{json,md}``. Never
asserted: the tests check that the export happens and is right, this measures what it costs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration.mds import MdsModel, MdsRun, deepspeed_version, prepare_checkout, run_mds  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]")
_ITER = re.compile(r"iteration=\s*(\d+)/.*?elapsed_time_per_iteration_ms=([0-9.]+)")


def _time(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    text = m.group(1)
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f" if "." in text else "%Y-%m-%d %H:%M:%S").timestamp()


def parse(log: str, interval: int) -> dict:
    """Save durations (s) and per-iteration times (ms), split into right after a save and the rest."""
    saves, started = [], None
    after, other = [], []
    for line in log.splitlines():
        if "saving checkpoint at iteration" in line:
            started = _time(line)
        elif "successfully saved checkpoint" in line and started is not None and _time(line) is not None:
            saves.append(_time(line) - started)
            started = None
        m = _ITER.search(line)
        if m:
            it, ms = int(m.group(1)), float(m.group(2))
            (after if it > interval and (it - 1) % interval < 2 else other).append(ms)
    return {"saves": saves, "after_save_ms": after, "other_ms": other}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--save-interval", type=int, default=6)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ucp-hf-stall-"))
    model = MdsModel(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4, ffn=4 * args.hidden, seq=128)
    rows: dict[str, list[dict]] = {"convert": [], "convert + export": []}
    try:
        co = prepare_checkout(work / "mds")
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(reversed(rows))
            for name in order:
                ckpt = work / f"ckpt-{r}-{name.replace(' ', '')}"
                extra = ["--ucp-async-convert", *(["--ucp-export-hf"] if "export" in name else [])]
                res = run_mds(
                    co,
                    MdsRun(
                        nproc=2,
                        ckpt=ckpt,
                        model=model,
                        train_iters=args.iters,
                        save_interval=args.save_interval,
                        extra_args=[*extra, "--make-vocab-size-divisible-by", "256"],
                        timeout=1200,
                    ),
                )
                parsed = parse(res.log, args.save_interval)
                parsed["exports"] = len(list(ckpt.glob("*_hf")))
                rows[name].append(parsed)
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(v for row in rows[name] for v in row[key])

    paired = [
        statistics.median(b["saves"]) - statistics.median(a["saves"])
        for a, b in zip(rows["convert"], rows["convert + export"], strict=True)
    ]
    h = args.hidden  # attention (q, o; k, v at half the heads) + SwiGLU (3 x h x 4h) per layer, two embeddings
    params = args.layers * (3 * h * h + 12 * h * h) + 2 * 512 * h
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "deepspeed": deepspeed_version(),
        "model": f"hidden {args.hidden}, {args.layers} layers (~{params / 1e6:.0f}M parameters), DP 2",
        "rounds": args.rounds,
        "rows": rows,
        "median": {
            name: {
                "save_s": med(name, "saves"),
                "after_save_ms": med(name, "after_save_ms"),
                "other_ms": med(name, "other_ms"),
                "exports": [row["exports"] for row in rows[name]],
            }
            for name in rows
        },
        "paired_save_difference_s": statistics.median(paired),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hf-export-stall.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# Background Hugging Face export: what training waits for ({summary['date']}, "
        f"DeepSpeed {summary['deepspeed']})",
        "",
        f"`pretrain_gpt_alcf.py` through the runner, {summary['model']}, {args.iters} iterations, a save every "
        f"{args.save_interval}; medians over {args.rounds} rounds, the order alternating.",
        "",
        "| background work | save (s) | iteration right after a save (ms) | other iterations (ms) | exports per run |",
        "|---|---|---|---|---|",
    ]
    for name, m in summary["median"].items():
        lines.append(
            f"| {name} | {m['save_s']:.2f} | {m['after_save_ms']:.0f} | {m['other_ms']:.0f} | {m['exports']} |"
        )
    paired_s = summary["paired_save_difference_s"]
    lines += ["", f"Median paired difference of the save time (export on - off): {paired_s:+.2f} s."]
    (RESULTS / "hf-export-stall.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
