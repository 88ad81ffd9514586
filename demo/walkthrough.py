"""``make demo``: stock DeepSpeed cannot resume at another DP size; megatron-ucp continues the curve.

What it runs, all on the CPU with the Megatron-DeepSpeed stand-in (train_scripts/cpu_demo.sh:
megatron-core GPT, DeepSpeed ZeRO-1 bf16, gloo):

1. **uninterrupted** -- DP=4 (default), K iterations, through the megatron-ucp runner with
   asynchronous conversion on; it saves at K/2 (and at K). Its loss curve is the reference. The
   save-time recording is switched off here, so the checkpoint is byte for byte what stock
   DeepSpeed writes (last-rank-only ``group_paddings``): the background converter copes with it.
2. **elastic** -- the K/2 checkpoint resumed at DP=3 through the runner, continued to K. Nothing on
   the command line says "universal": the runner keeps the checkpoint's global batch and re-seeds
   RNG; the elastic-load hook reshards each rank's partitions straight from the native rank files
   (``--ucp-resume-route universal`` would load the universal twin step 1 wrote in the background).
3. **stock DeepSpeed** on the same checkpoint, without the plugin: (a) a plain resume at DP=3,
   (b) DeepSpeed's ``ds_to_universal``, (c) ``--universal-checkpoint`` at DP=3 on a universal
   folder, (d) the same at DP=4, the size the checkpoint was saved at. Each error is reported as
   DeepSpeed prints it.

The tiny model's no-weight-decay group has 9 elements (3 RMSNorm weights of size 3). At DP=4
ZeRO aligns it to 16 elements, 4 per rank: 7 elements of padding, more than a partition, so the
last rank holds only padding. Stock ``ds_to_universal`` dies on the recorded padding, and stock
``load_universal`` dies on the all-padding rank -- the same two failures as AuroraGPT-7B at DP=768
(padding 1024 > partition 348; ranks 766 and 767). A rank holding only padding needs a group smaller
than about 2 x DP^2 elements, which is why the demo's group is tiny.

Outputs in ``demo_output/``: ``losses.png`` (both curves), ``losses.csv``, ``summary.txt`` and every
rank's log under ``logs/``. The pure parts (log parsing, the table) are separate functions so that
tests can check them without running anything.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("demo")

REPO = Path(__file__).resolve().parents[1]
CPU_DEMO = REPO / "train_scripts" / "cpu_demo.sh"

# The model of train_scripts/cpu_demo.sh, passed explicitly so the demo does not depend on its defaults.
MODEL_ARGS = (
    "--num-layers",
    "1",
    "--hidden-size",
    "3",
    "--num-attention-heads",
    "1",
    "--ffn-hidden-size",
    "32",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--normalization",
    "rmsnorm",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--standin-vocab-size",
    "32",
    "--make-vocab-size-divisible-by",
    "32",
    "--micro-batch-size",
    "1",
    "--lr",
    "0.1",
    "--lr-decay-style",
    "linear",
    "--seed",
    "1234",
    "--bf16",
    "--deepspeed",
    "--zero-stage",
    "1",
    "--no-pipeline-parallel",
)
GLOBAL_BATCH = 12
"""Divisible by micro batch x DP for DP = 1, 2, 3, 4, 6, 12."""

_LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?lm loss\s+([-+0-9.eE]+)")
_ERROR_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)):\s*(.*)$")


# ================================================================================================
# pure helpers
# ================================================================================================


def parse_losses(text: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from a stand-in (or Megatron-like) log; the last line for an iteration wins."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS_RE.finditer(text)}


def last_error(text: str) -> Optional[str]:
    """The last ``SomeError: message`` line of a traceback in a log, or None."""
    found = None
    for line in text.splitlines():
        m = _ERROR_RE.match(line.strip())
        if m:
            found = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    return found


@dataclass(frozen=True)
class Row:
    iteration: int
    reference: Optional[float]
    elastic: Optional[float]

    @property
    def difference(self) -> Optional[float]:
        if self.reference is None or self.elastic is None:
            return None
        return self.elastic - self.reference


def loss_rows(reference: dict[int, float], elastic: dict[int, float]) -> list[Row]:
    its = sorted(set(reference) | set(elastic))
    return [Row(i, reference.get(i), elastic.get(i)) for i in its]


def format_table(rows: Sequence[Row], resume_at: int, dp_train: int, dp_resume: int) -> str:
    def num(x: Optional[float]) -> str:
        return f"{x:.6f}" if x is not None else ""

    head_ref = f"uninterrupted (DP={dp_train})"
    head_el = f"elastic (DP={dp_train}->{dp_resume})"
    lines = [
        f"{'iter':>5} | {head_ref:>22} | {head_el:>22} | {'difference':>11}",
        f"{'-' * 5}-+-{'-' * 22}-+-{'-' * 22}-+-{'-' * 11}",
    ]
    for row in rows:
        el = num(row.elastic) if row.iteration > resume_at else ("checkpoint" if row.iteration == resume_at else "")
        diff = f"{row.difference:+.2e}" if row.difference is not None and row.iteration > resume_at else ""
        lines.append(f"{row.iteration:>5} | {num(row.reference):>22} | {el:>22} | {diff:>11}")
    return "\n".join(lines)


def max_abs_difference(rows: Sequence[Row], resume_at: int) -> Optional[float]:
    diffs = [abs(r.difference) for r in rows if r.iteration > resume_at and r.difference is not None]
    return max(diffs) if diffs else None


# ================================================================================================
# running things
# ================================================================================================


@dataclass
class Phase:
    name: str
    title: str
    returncode: int = 0
    seconds: float = 0.0
    logs: list[Path] = field(default_factory=list)
    error: Optional[str] = None
    error_ranks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def rank0(self) -> str:
        return self.logs[0].read_text(errors="replace") if self.logs and self.logs[0].exists() else ""


def _collect_errors(phase: Phase) -> None:
    """The error each rank died with (DeepSpeed's own words), and which ranks died of it."""
    by_rank = {}
    for i, path in enumerate(phase.logs):
        err = last_error(path.read_text(errors="replace")) if path.exists() else None
        if err:
            by_rank[i] = err
    if by_rank:
        # The root cause: prefer a non-distributed error (peers report broken collectives afterwards).
        ordered = sorted(by_rank.items(), key=lambda kv: ("ProcessGroup" in kv[1] or "gloo" in kv[1].lower(), kv[0]))
        phase.error = ordered[0][1]
        phase.error_ranks = [r for r, e in by_rank.items() if e == phase.error]


def private_extensions(env: dict[str, str]) -> dict[str, str]:
    """``env`` with a torch-extensions cache of this interpreter's own (unless one is set): DeepSpeed's CPU backend
    JIT-builds its ``deepspeed_shm_comm`` kernel into the shared ``~/.cache/torch_extensions``, where another
    DeepSpeed release's build of the same name would be loaded instead (``module 'deepspeed_shm_comm' has no
    attribute ...``), and the demo would report a failure that is not stock DeepSpeed's."""
    key = hashlib.sha1(f"{Path(sys.executable).absolute()}\0{env.get('PYTHONPATH', '')}".encode()).hexdigest()[:12]
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megatron-ucp-demo-extensions" / key))
    return env


def run_cpu_demo(phase: Phase, nproc: int, ucp: bool, args: Sequence[str], out: Path) -> Phase:
    """One training job through train_scripts/cpu_demo.sh (NPROC ranks on the CPU)."""
    env = private_extensions(
        dict(
            os.environ,
            NPROC=str(nproc),
            UCP="1" if ucp else "0",
            PYTHON=sys.executable,
            LOG_DIR=str(out / "logs"),
            RUN_NAME=phase.name,
            QUIET="1",
            CKPT_DIR=str(out / "unused_ckpt"),
            DS_ACCELERATOR="cpu",
        )
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(CPU_DEMO), *MODEL_ARGS, *args],
        env=env,
        cwd=out,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    phase.seconds = time.perf_counter() - t0
    phase.returncode = proc.returncode
    phase.logs = [out / "logs" / f"{phase.name}.rank{r}.log" for r in range(nproc)]
    if not phase.ok:
        _collect_errors(phase)
    return phase


def run_stock_converter(phase: Phase, source: Path, output: Path, out: Path) -> Phase:
    """DeepSpeed's own ``ds_to_universal`` (one process)."""
    log_path = out / "logs" / f"{phase.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(source),
                "--output_folder",
                str(output),
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=out,
            env=private_extensions(dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")),
        )
    phase.seconds = time.perf_counter() - t0
    phase.returncode = proc.returncode
    phase.logs = [log_path]
    if not phase.ok:
        _collect_errors(phase)
    return phase


STOCK_PADDING_CRASH = "IndexError"
"""What stock ``load_universal`` raises on a rank that holds only padding (``steps[0]`` of no fragment): the one
failure :func:`geometry_note` explains; any other is shown as its own error."""


def geometry_note(tag_dir: Path, dp_resume: int) -> list[str]:
    """Why stock DeepSpeed's universal loader dies at ``dp_resume``, from the checkpoint's own shapes."""
    from megatron_ucp.deepspeed.reader import read_model_states
    from megatron_ucp.plan.geometry import GroupGeometry, stock_loader_crash_ranks

    try:
        states = read_model_states(tag_dir / "mp_rank_00_model_states.pt")
    except Exception as exc:  # the note is an explanation, not a result
        return [f"(geometry not available: {exc})"]
    lines = []
    groups = []
    for g, params in enumerate(states.param_groups):
        numel = sum(math.prod(p.shape) for p in params)
        groups.append(GroupGeometry(numel=numel, dp=dp_resume))
    crash = stock_loader_crash_ranks(groups, dp_resume)
    for g, geo in enumerate(groups):
        if g in crash:
            lines.append(
                f"param group {g}: {geo.numel} elements; at DP={dp_resume} ZeRO pads it to {geo.padded_total} "
                f"(alignment {geo.alignment}), {geo.partition_size} per rank: rank(s) "
                f"{', '.join(map(str, crash[g]))} hold only padding"
            )
    return lines


LOSS_TOLERANCE = 1e-3
"""The band the resumed curve stays in: bf16 sums reduced in another order at another DP size, a difference that
grows over the ten resumed steps (the suite's bound for a DP change, tests/support/elastic_support.py; the first
resumed step, from the restored weights alone, is held to 2e-4 under the real Megatron-DeepSpeed)."""


def plot(
    rows: Sequence[Row], resume_at: int, dp_train: int, dp_resume: int, path: Path, stock_lines: Sequence[str]
) -> Optional[Path]:
    """Three panels: both loss curves; the per-step difference (resumed minus uninterrupted) against the
    tolerance band, where a curve drawn on top of the other could hide one; what stock DeepSpeed did with the
    same checkpoint (each of ``stock_lines``, marked by its outcome)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    ref = [(r.iteration, r.reference) for r in rows if r.reference is not None]
    el = [(r.iteration, r.elastic) for r in rows if r.elastic is not None and r.iteration > resume_at]
    start = [(r.iteration, r.reference) for r in rows if r.iteration == resume_at and r.reference is not None]
    diff = [(r.iteration, r.difference) for r in rows if r.difference is not None and r.iteration > resume_at]
    text_lines = sum(line.count("\n") + 1 for line in stock_lines)
    heights = [3, 1.6] + ([0.2 + 0.13 * text_lines] if stock_lines else [])
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(8, 2.2 * sum(heights) / 1.6 + 0.4), dpi=120, height_ratios=heights, squeeze=False
    )
    ax, dax = axes[0][0], axes[1][0]
    ax.plot(*zip(*ref), "o-", color="tab:blue", markersize=4, label=f"uninterrupted, DP={dp_train}")
    if el:
        ax.plot(
            *zip(*(start + el)),
            "s--",
            color="tab:orange",
            markerfacecolor="none",
            markersize=7,
            label=f"megatron-ucp: resumed from iteration {resume_at} at DP={dp_resume}",
        )
    saved = f"iteration {resume_at}: saved at DP={dp_train}, resumed at DP={dp_resume}"
    for a in (ax, dax):
        a.axvline(resume_at, color="gray", linestyle=":", linewidth=1)
        a.grid(alpha=0.3)
        a.xaxis.get_major_locator().set_params(integer=True)
    ax.annotate(
        saved,
        (resume_at, 1),
        xycoords=("data", "axes fraction"),
        xytext=(4, -12),
        textcoords="offset points",
        fontsize=7,
        color="dimgray",
    )
    ax.set_ylabel("lm loss (global mean)")
    ax.set_title("Elastic resume of a ZeRO-1 bf16 checkpoint (CPU stand-in of Megatron-DeepSpeed)")
    ax.legend(loc="lower left", fontsize=8)
    dax.axhspan(
        -LOSS_TOLERANCE,
        LOSS_TOLERANCE,
        color="tab:green",
        alpha=0.15,
        label=f"+/-{LOSS_TOLERANCE:g}: bf16 sums reduced in another order at another DP size",
    )
    dax.axhline(0, color="tab:blue", linewidth=0.8)
    if diff:
        dax.plot(*zip(*diff), "s", color="tab:orange", markerfacecolor="none", label="resumed - uninterrupted")
        worst = max(abs(d) for _, d in diff)
        dax.set_ylim(-max(worst, LOSS_TOLERANCE) * 1.6, max(worst, LOSS_TOLERANCE) * 1.6)
    dax.set_xlim(ax.get_xlim())
    dax.set_xlabel("iteration")
    dax.set_ylabel("difference")
    dax.legend(loc="lower left", fontsize=7)
    if stock_lines:
        tax = axes[2][0]
        tax.axis("off")
        note = "\n".join(["stock DeepSpeed (no megatron-ucp) on the same checkpoint:", *stock_lines])
        tax.text(0.0, 1.0, note, transform=tax.transAxes, ha="left", va="top", fontsize=7.5, family="monospace")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def stock_line(p: "Phase") -> str:
    """One line of the plot's stock panel: the attempt, marked by its outcome."""
    return _wrap(f"{'ok    ' if p.ok else 'FAILED'} {p.title}: {_outcome(p)}", 100)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in text.splitlines())


# ================================================================================================
# main
# ================================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--dp-train", type=int, default=4, help="DP size of the uninterrupted run (default 4)")
    p.add_argument("--dp-resume", type=int, default=3, help="DP size of the elastic resume (default 3)")
    p.add_argument("--iters", type=int, default=20, help="iterations K; the checkpoint is taken at K/2 (default 20)")
    p.add_argument(
        "--optimizer",
        choices=("BF16_Optimizer", "DeepSpeedZeroOptimizer"),
        default="BF16_Optimizer",
        help="DeepSpeed's ZeRO-1 bf16 optimizer (default BF16_Optimizer: data_types.grad_accum_dtype=fp32)",
    )
    p.add_argument("--skip-stock", action="store_true", help="do not run the stock DeepSpeed attempts")
    p.add_argument("--output", type=Path, default=Path("demo_output"), help="output folder (replaced)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if not CPU_DEMO.is_file():
        log.error("%s not found: the demo runs from a megatron-ucp checkout", CPU_DEMO)
        return 2
    for dp in (args.dp_train, args.dp_resume):
        if dp < 1 or dp > 4 or GLOBAL_BATCH % dp:
            log.error("DP sizes must be 1..4 and divide the global batch %d", GLOBAL_BATCH)
            return 2
    k, half = args.iters, args.iters // 2
    if half < 1:
        log.error("--iters must be >= 2")
        return 2
    out = args.output.resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    ref_dir, el_dir, stock_dir = out / "ckpt_uninterrupted", out / "ckpt_elastic", out / "ckpt_stock_universal"
    tag = f"global_step{half}"
    common = ("--train-iters", str(k), "--standin-zero-optimizer", args.optimizer)
    t_start = time.perf_counter()

    log.info(
        "megatron-ucp demo: tiny GPT (megatron-core, local spec), DeepSpeed ZeRO-1 bf16 (%s), CPU/gloo\n",
        args.optimizer,
    )
    log.info(
        "[1/3] uninterrupted run: DP=%d, %d iterations, saving at %d (megatron-ucp runner, async conversion; "
        "the save without the true-length record, --ucp-no-record-true-lengths, as stock DeepSpeed writes it, so "
        "that stock in [3/3] meets the same files)",
        args.dp_train,
        k,
        half,
    )
    ref = run_cpu_demo(
        Phase("uninterrupted", f"uninterrupted DP={args.dp_train}"),
        args.dp_train,
        True,
        [
            *common,
            "--standin-grad-acc-steps",
            str(GLOBAL_BATCH // args.dp_train),
            "--save",
            str(ref_dir),
            "--load",
            str(ref_dir),
            "--save-interval",
            str(half),
            "--ucp-async-convert",
            "--ucp-no-record-true-lengths",
        ],
        out,
    )
    log.info("      %s in %.0fs", "done" if ref.ok else f"FAILED ({ref.error})", ref.seconds)
    if not ref.ok:
        log.error("the uninterrupted run failed; see %s", ref.logs[0])
        return 1
    twin = ref_dir / f"{tag}_universal"
    done = (twin / "ucp_manifest.json").is_file()
    async_note = (
        f"async conversion wrote {twin.name} while training continued"
        if done
        else f"no {twin.name} after the run (async conversion not active in this build): "
        "the elastic load converts on demand"
    )
    log.info("      %s", async_note)

    log.info(
        "[2/3] elastic resume: %s at DP=%d through the megatron-ucp runner (no --universal-checkpoint, "
        "no --global-batch-size)",
        tag,
        args.dp_resume,
    )
    el = run_cpu_demo(
        Phase("elastic", f"elastic DP={args.dp_train}->{args.dp_resume}"),
        args.dp_resume,
        True,
        [
            *common,
            "--load",
            str(ref_dir),
            "--load-tag",
            tag,
            "--save",
            str(el_dir),
            "--save-interval",
            str(half),
            "--ucp-async-convert",
        ],
        out,
    )
    log.info("      %s in %.0fs", "done" if el.ok else f"FAILED ({el.error})", el.seconds)
    for line in el.rank0().splitlines():
        if line.startswith("megatron-ucp"):
            log.info("      | %s", line)

    stock: list[Phase] = []
    if not args.skip_stock:
        log.info("[3/3] stock DeepSpeed (no megatron-ucp) on the same checkpoint at DP=%d", args.dp_resume)
        p = run_cpu_demo(
            Phase("stock_resume", "plain resume"),
            args.dp_resume,
            False,
            [*common, "--load", str(ref_dir), "--load-tag", tag],
            out,
        )
        stock.append(p)
        log.info("      (a) plain resume: %s", _outcome(p))
        conv = run_stock_converter(
            Phase("stock_ds_to_universal", "ds_to_universal"), ref_dir / tag, stock_dir / f"{tag}_universal", out
        )
        stock.append(conv)
        log.info("      (b) ds_to_universal: %s", _outcome(conv))
        source = stock_dir if conv.ok else ref_dir if twin.is_dir() else None
        why = []
        if source is not None:
            what = "ds_to_universal's output" if conv.ok else "megatron-ucp's universal folder"
            for label, dp in (("(c)", args.dp_resume), ("(d)", args.dp_train)):
                p = run_cpu_demo(
                    Phase(f"stock_universal_dp{dp}", f"--universal-checkpoint at DP={dp} on {what}"),
                    dp,
                    False,
                    [*common, "--universal-checkpoint", "--load", str(source), "--load-tag", f"{tag}_universal"],
                    out,
                )
                stock.append(p)
                log.info("      %s --universal-checkpoint at DP=%d on %s: %s", label, dp, what, _outcome(p))
                if not p.ok and STOCK_PADDING_CRASH in (p.error or ""):  # the cause below, and no other
                    why += geometry_note(ref_dir / tag, dp)
        for line in why:
            log.info("      why: %s", line)
    else:
        why = []

    reference = parse_losses(ref.rank0())
    elastic = parse_losses(el.rank0()) if el.ok else {}
    rows = loss_rows(reference, elastic)
    table = format_table(rows, half, args.dp_train, args.dp_resume)
    worst = max_abs_difference(rows, half)
    log.info("\nlm loss, step by step:\n%s\n", table)
    with open(out / "losses.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["iteration", f"uninterrupted_dp{args.dp_train}", f"elastic_dp{args.dp_resume}", "difference"])
        for r in rows:
            writer.writerow(
                [
                    r.iteration,
                    r.reference,
                    r.elastic if r.iteration > half else None,
                    r.difference if r.iteration > half else None,
                ]
            )
    png = plot(
        rows,
        half,
        args.dp_train,
        args.dp_resume,
        out / "losses.png",
        [stock_line(p) for p in stock],
    )

    summary = [f"megatron-ucp demo ({time.perf_counter() - t_start:.0f}s)"]
    for p in stock:
        summary.append(f"  stock DeepSpeed, {p.title}: {_outcome(p)}")
    for line in why:
        summary.append(f"    why: {line}")
    if el.ok and elastic:
        summary.append(
            f"  megatron-ucp, {el.title}: resumed at iteration {half}, continued to {max(elastic)}; "
            f"max |loss difference| vs uninterrupted = {worst:.2e}"
            if worst is not None
            else ""
        )
    else:
        summary.append(f"  megatron-ucp, {el.title}: FAILED ({el.error}); see {el.logs[0] if el.logs else out}")
    summary.append(f"  {async_note}")
    if png:
        summary.append(f"  plot: {png}")
    summary.append(f"  table: {out / 'losses.csv'}; logs: {out / 'logs'}")
    (out / "summary.txt").write_text("\n".join(summary) + "\n\n" + table + "\n")
    log.info("%s", "\n".join(summary))
    return 0 if el.ok and len(elastic) == k - half else 1


def _outcome(p: Phase) -> str:
    if p.ok:
        return f"succeeded ({p.seconds:.0f}s)"
    ranks = f" on rank(s) {', '.join(map(str, p.error_ranks))}" if p.error_ranks and len(p.logs) > 1 else ""
    return f"died{ranks}: {p.error or f'exit status {p.returncode}'}"


if __name__ == "__main__":
    sys.exit(main())
