"""Every (TP, PP, DP) move of the README's tested-layout table, ours and stock DeepSpeed's, on the real
Megatron-DeepSpeed.

::

    MEGATRON_DEEPSPEED_DIR=../shared/third_party/megatron-deepspeed \\
    PYTHONPATH=.venv-ds/0.19.5 .venv/bin/python benchmarks/layout_moves.py [--only NAME ...]

Each training (6 iterations, saved at 2, 4 and 6) goes through the runner with ``--ucp-async-convert``;
each move restarts from iteration 4 at another layout. Ours: the runner, no flag. Stock: DeepSpeed's
``ds_to_universal`` on the same tag, then the script alone with ``--universal-checkpoint``, as
DeepSpeed's documentation says. The measure is max |loss - uninterrupted| over iterations 5 and 6
(Megatron's own ``lm loss``), or the first error line when a run stops. Writes
``benchmarks/results/layout-moves.{json,md}``; the README's table is that markdown.

Not a test (no assertion): ``tests/integration/test_model_parallel.py`` holds ours to 2e-4 on the
same moves. This measures stock beside it, which the tests check only where stock's outcome is the
point. About 12 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.mds_stock import first_error, short, stock_convert  # noqa: E402
from tests.integration.mds import (
    MdsModel,
    MdsRun,
    deepspeed_version,
    prepare_checkout,
    run_mds,
    snapshot_dir,
)

RESULTS = REPO_ROOT / "benchmarks" / "results"
SAME_PADDING = ("--make-vocab-size-divisible-by", "256")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    pipeline: bool
    untied: bool = True
    optimizer: str = "bf16"
    zero_stage: int = 1

    def describe(self) -> str:
        model = "GPTModelPipe" if self.pipeline else "GPTModel"
        extra = "" if self.untied else ", tied embeddings"
        if self.optimizer == "zero":
            extra += f", DeepSpeedZeroOptimizer ZeRO-{self.zero_stage}"
        return f"({self.tp},{self.pp},{self.dp}) {model}{extra}"

    def run(self, ckpt: Path, **kw) -> MdsRun:
        return MdsRun(
            nproc=self.tp * self.pp * self.dp,
            ckpt=ckpt,
            tp=self.tp,
            pp=self.pp,
            pipeline=self.pipeline,
            optimizer=self.optimizer,
            zero_stage=self.zero_stage,
            model=MdsModel(untied=self.untied),
            train_iters=6,
            save_interval=2,
            **kw,
        )


@dataclass(frozen=True)
class Move:
    name: str
    saved: Layout
    resumed: Layout
    vocab_divisor: str = "256"


PP2 = Layout(1, 2, 2, True)
TP2PP2 = Layout(2, 2, 1, True)
TP2 = Layout(2, 1, 2, False)
TP1 = Layout(1, 1, 4, False)
MOVES = [
    Move("pp2-dp", PP2, Layout(1, 2, 1, True)),
    Move("pp2-to-pp1", PP2, Layout(1, 1, 4, True)),
    Move("tp2pp2-to-tp1pp1", TP2PP2, Layout(1, 1, 4, False)),
    Move("tp2pp2-to-tp2pp1", TP2PP2, Layout(2, 1, 2, False)),
    Move("pipe-to-gpt-pp1", Layout(1, 1, 4, True), Layout(1, 1, 2, False)),
    Move("gpt-to-pipe-pp1", TP1, Layout(1, 1, 2, True)),
    Move("gpt-pp1-to-pipe-pp2", TP1, Layout(1, 2, 2, True)),
    Move("tp1-to-tp2", TP1, Layout(2, 1, 1, False)),
    Move("tp2-to-tp1", TP2, Layout(1, 1, 2, False)),
    Move("tp2-to-tp1-vocab-512-to-384", TP2, Layout(1, 1, 2, False), vocab_divisor="128"),
    Move("tp2-dp", TP2, Layout(2, 1, 1, False)),
    Move(
        "tp2-zero2-dp",
        Layout(2, 1, 2, False, optimizer="zero", zero_stage=2),
        Layout(2, 1, 1, False, optimizer="zero", zero_stage=2),
    ),
    Move("tied-pp2-dp", Layout(1, 2, 2, True, untied=False), Layout(1, 2, 1, True, untied=False)),
]


def _restart_copy(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, symlinks=True)
    (dest / "latest").write_text("global_step4")
    shutil.rmtree(dest / "global_step4_universal", ignore_errors=True)
    (dest / "latest_universal").unlink(missing_ok=True)
    return dest


def _outcome(res, full: dict[int, float]) -> dict:
    if res.returncode != 0 or not {5, 6} <= set(res.losses):
        return {"ok": False, "text": first_error(res.log)}
    diff = max(abs(res.losses[i] - full[i]) for i in (5, 6))
    return {"ok": True, "max_abs_loss_diff": diff, "text": f"{diff:.1e}"}


def measure(co, work: Path, moves: list[Move]) -> list[dict]:
    trained: dict[Layout, tuple[Path, dict]] = {}
    rows = []
    for move in moves:
        if move.saved not in trained:
            root = work / f"train-{len(trained)}" / "ckpt"
            res = run_mds(co, move.saved.run(root, extra_args=(*SAME_PADDING, "--ucp-async-convert")))
            trained[move.saved] = (root, res.losses)
        root, full = trained[move.saved]
        padding = ("--make-vocab-size-divisible-by", move.vocab_divisor)
        ours = run_mds(
            co,
            move.resumed.run(_restart_copy(root, work / f"{move.name}-ours"), extra_args=padding, expect_failure=True),
        )
        stock_dir = _restart_copy(root, work / f"{move.name}-stock")
        failed = stock_convert(co, stock_dir / "global_step4", stock_dir / "global_step4_universal")
        if failed is not None:
            stock = {"ok": False, "text": failed}
        else:
            (stock_dir / "latest_universal").write_text("global_step4_universal")
            res = run_mds(
                co,
                move.resumed.run(
                    stock_dir, route="plain", expect_failure=True, extra_args=(*padding, "--universal-checkpoint")
                ),
            )
            stock = _outcome(res, full)
        row = {
            "move": move.name,
            "saved": move.saved.describe(),
            "resumed": move.resumed.describe(),
            "padded_vocab": f"512 -> {384 if move.vocab_divisor == '128' else 512}",
            "ours": _outcome(ours, full),
            "stock": stock,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict], version: str) -> str:
    lines = [
        f"DeepSpeed {version}, argonne-lcf Megatron-DeepSpeed, CPU/gloo; max |loss - uninterrupted| over the two "
        "resumed iterations (5, 6), restarting from iteration 4.",
        "",
        "| saved (TP,PP,DP) | resumed (TP,PP,DP) | padded vocab | megatron-ucp (runner, no flag) | stock "
        "(`ds_to_universal` + `--universal-checkpoint`) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['saved']} | {r['resumed']} | {r['padded_vocab']} | {r['ours']['text']} | "
            f"{short(r['stock']['text'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="move names (default: all)")
    ap.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed after)")
    ap.add_argument("--table-only", action="store_true", help="rewrite results/layout-moves.md from the saved JSON")
    args = ap.parse_args()
    if args.table_only:
        saved = json.loads((RESULTS / "layout-moves.json").read_text())
        (RESULTS / "layout-moves.md").write_text(markdown(saved["rows"], saved["deepspeed"]))
        print(markdown(saved["rows"], saved["deepspeed"]))
        return 0
    if snapshot_dir() is None:
        print("set MEGATRON_DEEPSPEED_DIR to a Megatron-DeepSpeed checkout", file=sys.stderr)
        return 2
    moves = [m for m in MOVES if not args.only or m.name in args.only]
    work = args.work or Path(tempfile.mkdtemp(prefix="layout-moves-"))
    try:
        co = prepare_checkout(work)
        rows = measure(co, work, moves)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    version = deepspeed_version()
    (RESULTS / "layout-moves.json").write_text(json.dumps({"deepspeed": version, "rows": rows}, indent=1) + "\n")
    (RESULTS / "layout-moves.md").write_text(markdown(rows, version))
    print(markdown(rows, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
