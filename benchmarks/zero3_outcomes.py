"""ZeRO-3 resumes at new layouts on the real Megatron-DeepSpeed: megatron-ucp's outcome and stock DeepSpeed's
on the same saves, for the DeepSpeed release on ``PYTHONPATH``.

::

    MEGATRON_DEEPSPEED_DIR=../shared/third_party/megatron-deepspeed \\
    PYTHONPATH=.venv-ds/0.19.5 .venv/bin/python benchmarks/zero3_outcomes.py [--only NAME ...]

Each training (``--zero-stage 3``, 12 iterations at DP 4, saved at 6 and 12) goes through the runner with
``--ucp-async-convert``; each move restarts from iteration 6. Ours: the runner, no flag. Stock, on copies of
the same saves: the script alone with no flag (DeepSpeed's native load), and DeepSpeed's ``ds_to_universal``
on the tag then the script with ``--universal-checkpoint``, as DeepSpeed's documentation says. The measure is
max |loss - uninterrupted| over iterations 7 to 12, or the first error line when a run stops. Writes
``benchmarks/results/zero3-outcomes-<version>.{json,md}``; the README's table gathers them.

Not a test (no assertion): ``tests/integration/test_zero3_megatron.py`` holds ours to 2e-4.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.mds_stock import first_error, short, stock_convert  # noqa: E402
from tests.integration.mds import MdsRun, deepspeed_version, prepare_checkout, run_mds, snapshot_dir  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
RESUMED = tuple(range(7, 13))


SAME_PADDING = ("--make-vocab-size-divisible-by", "256")
"""512 vocabulary rows at TP 1 and 2 (Megatron's default pads to 128 x TP: a softmax over another number of rows
moves every loss by log(512/384), for anyone)."""


@dataclass(frozen=True)
class Move:
    name: str
    saved_tp: int
    resumed_nproc: int
    resumed_tp: int = 1
    ds_extra: dict = field(default_factory=dict, hash=False, compare=False)

    def describe(self) -> str:
        hpz = " hpZ 2" if self.ds_extra else ""
        saved, resumed = (self.saved_tp, 4 // self.saved_tp), (self.resumed_tp, self.resumed_nproc // self.resumed_tp)
        return f"(TP,DP) {saved} -> {resumed}{hpz}".replace(", ", ",")


HPZ = {"zero_optimization": {"zero_hpz_partition_size": 2}}
MOVES = [
    Move("dp4-to-dp3", 1, 3),
    Move("dp4-to-dp2", 1, 2),
    Move("tp2-to-tp1", 2, 2),
    Move("hpz-dp4-to-dp2", 1, 2, ds_extra=HPZ),
]


def _outcome(res, full: dict[int, float]) -> dict:
    if res.returncode != 0 or not set(RESUMED) <= set(res.losses):
        return {"ok": False, "text": first_error(res.log)}
    diff = max(abs(res.losses[i] - full[i]) for i in RESUMED)
    return {"ok": True, "max_abs_loss_diff": diff, "text": f"{diff:.1e}"}


def _restart_copy(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(".ucp", "*_universal", "latest_universal"))
    (dest / "latest").write_text("global_step6")
    return dest


def _run(tp: int, nproc: int, ckpt: Path, ds_extra: dict, **kw) -> MdsRun:
    kw["extra_args"] = [*kw.pop("extra_args", ()), *SAME_PADDING]
    return MdsRun(
        nproc=nproc,
        ckpt=ckpt,
        optimizer="zero",
        zero_stage=3,
        tp=tp,
        train_iters=12,
        save_interval=kw.pop("save_interval", 100),
        ds_extra=ds_extra,
        **kw,
    )


def measure(co, work: Path, moves: list[Move]) -> list[dict]:
    trained: dict[tuple, tuple[Path, dict]] = {}
    rows = []
    for move in moves:
        key = (move.saved_tp, json.dumps(move.ds_extra, sort_keys=True))
        if key not in trained:
            root = work / f"train-{len(trained)}" / "ckpt"
            res = run_mds(
                co, _run(move.saved_tp, 4, root, move.ds_extra, save_interval=6, extra_args=["--ucp-async-convert"])
            )
            trained[key] = (root, res.losses)
        root, full = trained[key]
        ours = run_mds(
            co,
            _run(
                move.resumed_tp,
                move.resumed_nproc,
                _restart_copy(root, work / f"{move.name}-ours"),
                move.ds_extra,
                expect_failure=True,
            ),
        )
        native = run_mds(
            co,
            _run(
                move.resumed_tp,
                move.resumed_nproc,
                _restart_copy(root, work / f"{move.name}-stock-native"),
                move.ds_extra,
                route="plain",
                expect_failure=True,
            ),
        )
        stock_dir = _restart_copy(root, work / f"{move.name}-stock-universal")
        failed = stock_convert(co, stock_dir / "global_step6", stock_dir / "global_step6_universal")
        if failed is not None:
            universal = {"ok": False, "text": failed}
        else:
            (stock_dir / "latest_universal").write_text("global_step6_universal")
            res = run_mds(
                co,
                _run(
                    move.resumed_tp,
                    move.resumed_nproc,
                    stock_dir,
                    move.ds_extra,
                    route="plain",
                    expect_failure=True,
                    extra_args=["--universal-checkpoint"],
                ),
            )
            universal = _outcome(res, full)
        row = {
            "move": move.name,
            "layouts": move.describe(),
            "ours": _outcome(ours, full),
            "stock_native": _outcome(native, full),
            "stock_universal": universal,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict], version: str) -> str:
    lines = [
        f"DeepSpeed {version}, argonne-lcf Megatron-DeepSpeed `--zero-stage 3`, CPU/gloo; max |loss - uninterrupted| "
        "over iterations 7-12, restarting from iteration 6.",
        "",
        "| move | megatron-ucp (runner, no flag) | stock, no flag | stock (`ds_to_universal` + "
        "`--universal-checkpoint`) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layouts']} | {r['ours']['text']} | {short(r['stock_native']['text'])} | "
            f"{short(r['stock_universal']['text'])} |"
        )
    return "\n".join(lines) + "\n"


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """A run of some moves replaces those rows of the release's results and keeps the others, in MOVES order."""
    if not path.is_file():
        return rows
    measured = {r["move"] for r in rows}
    kept = [r for r in json.loads(path.read_text())["rows"] if r["move"] not in measured]
    order = [m.name for m in MOVES]
    return sorted(kept + rows, key=lambda r: order.index(r["move"]) if r["move"] in order else len(order))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="move names (default: all)")
    ap.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed after)")
    args = ap.parse_args()
    if snapshot_dir() is None:
        print("set MEGATRON_DEEPSPEED_DIR to a Megatron-DeepSpeed checkout", file=sys.stderr)
        return 2
    moves = [m for m in MOVES if not args.only or m.name in args.only]
    work = args.work or Path(tempfile.mkdtemp(prefix="zero3-outcomes-"))
    try:
        co = prepare_checkout(work)
        rows = measure(co, work, moves)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    version = deepspeed_version()
    rows = merged(RESULTS / f"zero3-outcomes-{version}.json", rows)
    (RESULTS / f"zero3-outcomes-{version}.json").write_text(
        json.dumps({"deepspeed": version, "rows": rows}, indent=1) + "\n"
    )
    (RESULTS / f"zero3-outcomes-{version}.md").write_text(markdown(rows, version))
    print(markdown(rows, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
