"""Scale benchmark: conversion against DP size on synthetic checkpoints, and the 7B/768 plan from metadata.

A DP = 768 run cannot train on a workstation; its files can be written (``megatron_ucp.synthetic``,
proven key for key against real saves by tests/system/test_synthetic_checkpoint.py) and every tool
that reads them measured, side by side in one run, one configuration on disk at a time:

* ``convert``: for each DP size, a synthetic checkpoint of one model (``--preset``, default
  ``llama-1b``: ~11.4 GB of fp32 master and Adam state), then, page cache dropped before each:
  ``megatron-ucp convert`` (ours), DeepSpeed's ``ds_to_universal`` (stock), the ALCF fork's
  ``ALCF/ds_to_universal.py`` (when ``../shared/third_party`` has it) and ``cp -r`` + ``sync`` of the
  same tag folder (the copy floor: read + write + fsync of the same bytes). Wall time, peak RSS of
  the process tree, or the crash's last line. Ours is checked afterwards (``megatron-ucp verify``).
* ``resume`` (on the checkpoint at the largest DP, converted by ours): one process plays rank ``r``
  of a ``W``-rank resume (``benchmarks/resume_probe.py``: the loader's read plan and copies, no
  collectives) for the first rank, a middle rank, the last rank holding real elements of the norm
  group and an all-padding rank where there is one, ``W`` in ``--resume-to``: planning time, load
  time, bytes read from storage against the rank's share, peak RSS, bit-exactness against the
  synthetic values; the same ranks again from the native tag itself (``--native``: the native
  reshard's code, no universal folder).
* ``shares``: the same conversion split over N converter processes (``--share I/N``), N in
  ``--shares``: wall time of the slowest, against N = 1.
* ``metadata``: ``megatron-ucp inspect`` and the conversion plan (built and checked) of the real
  AuroraGPT-7B shapes at DP 768, both optimizer classes, from metadata alone: time and peak RSS.
* ``--experts E --ep EP``: the preset as a mixture-of-experts model (every second layer's MLP E experts,
  the fork's ``--create-moe-param-group`` save at EP, files of a release that records MoE saves, e.g.
  ``--ds-version 0.19.5``): conversion against the copy floor, and the native reshard of sampled ranks at
  the same EP (each expert-parallel rank's experts over expert-DP: bytes read against the rank's share).

Results go to benchmarks/results/scale-<preset>-<flavour>.{json,md}. ::

    python benchmarks/bench_scale.py                      # llama-1b at DP 8, 64, 256, 768
    python benchmarks/bench_scale.py --preset llama-100m --dp 8,768 --tools ours,cp+sync
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
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

from megatron_ucp.plan.llama_shapes import PRESETS, preset  # noqa: E402
from megatron_ucp.synthetic.content import SyntheticSpec  # noqa: E402
from megatron_ucp.synthetic.writer import write_checkpoint  # noqa: E402

ALCF_CONVERTER = REPO_ROOT.parent / "shared" / "third_party" / "megatron-deepspeed" / "ALCF" / "ds_to_universal.py"
TOOLS = ("ours", "stock", "alcf", "cp+sync")
SLOW = ("stock", "alcf")
"""Run ``--slow-reps`` times (minutes each at 13 GB); the others ``--reps`` times, medians reported."""


def tool_argv(tool: str, tag: Path, out: Path, workers: int) -> list[list[str]]:
    if tool == "alcf":
        return [
            [
                bc.python(),
                str(ALCF_CONVERTER),
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
    return bc.tool_argv(tool, tag, out, workers)


def run_tool(tool: str, tag: Path, scratch: Path, workers: int) -> dict:
    out = scratch / f"out-{tool}"
    log = scratch / f"{tool}.log"
    shutil.rmtree(out, ignore_errors=True)
    bc.evict(tag)
    started, peak, result = time.perf_counter(), 0, {}
    try:
        # The ALCF script calls torch.load without weights_only=False, which torch >= 2.6 refuses for
        # any DeepSpeed file (it pickles DeepSpeed objects): the one environment edit it gets.
        env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"} if tool == "alcf" else None
        for argv in tool_argv(tool, tag, out, workers):
            step = bc.run_measured(argv, env=env, log=log)
            peak = max(peak, step["peak_rss"])
        result = {"seconds": time.perf_counter() - started, "peak_rss": peak}
        if tool == "ours":
            verify = subprocess.run(
                [bc.python(), "-m", "megatron_ucp.cli", "verify", str(out), "--source", str(tag)],
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
            )
            result["verified"] = verify.returncode == 0
    except RuntimeError:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        crash = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        result = {"crashed": crash.strip()[:300], "seconds": time.perf_counter() - started}
    shutil.rmtree(out, ignore_errors=True)
    for temp in scratch.glob("out-*"):
        shutil.rmtree(temp, ignore_errors=True)
    return result


def median_run(results: list[dict]) -> dict:
    """The run of median time (a crash, if any run crashed); ``runs``: how many."""
    crashed = [r for r in results if "crashed" in r]
    if crashed:
        return crashed[0]
    ordered = sorted(results, key=lambda r: r["seconds"])
    return {**ordered[len(ordered) // 2], "runs": len(results), "all_seconds": [r["seconds"] for r in results]}


def bench_convert_at(
    spec: SyntheticSpec,
    tools: list[str],
    workers: int,
    scratch: Path,
    resume_to: list[int] = (),
    shares: list[int] = (),
    reps: int = 3,
    slow_reps: int = 1,
) -> dict:
    root = scratch / f"ckpt-dp{spec.dp}"
    shutil.rmtree(root, ignore_errors=True)
    written = write_checkpoint(root, spec, progress=False)
    row = {"dp": spec.dp, "bytes": written.bytes, "files": written.files, "write_seconds": written.seconds}
    runs: dict[str, list[dict]] = {tool: [] for tool in tools}
    for rep in range(max(reps, slow_reps)):
        order = tools[rep % len(tools) :] + tools[: rep % len(tools)]  # rotated every repetition
        for tool in order:
            if rep >= (slow_reps if tool in SLOW else reps) or any("crashed" in r for r in runs[tool]):
                continue
            runs[tool].append(run_tool(tool, written.tag_dir, scratch, workers))
            print(f"  DP {spec.dp:4d} {tool:8s} {json.dumps(runs[tool][-1])}", flush=True)
    for tool, results in runs.items():
        row[tool] = median_run(results)
    if shares:
        row["shares"] = share_scaling(written.tag_dir, scratch, shares)
    if resume_to and spec.shape.experts:  # the native reshard at the same EP (the probe's universal route is dense)
        row["resume"] = resume_probe(spec, written.tag_dir, resume_to, native=True)
    elif resume_to:
        universal = scratch / "resume-universal"
        bc.run_measured(tool_argv("ours", written.tag_dir, universal, workers)[0])
        row["resume"] = resume_probe(spec, universal, resume_to) + resume_probe(
            spec, written.tag_dir, resume_to, native=True
        )
        shutil.rmtree(universal, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return row


def sampled_ranks(spec: SyntheticSpec, world: int) -> list[int]:
    """First, middle, last rank holding real elements of every group, first all-padding rank (if any).
    ZeRO-3: the last rank holding real elements of the smallest parameter, and the first whose slice of it
    is padding."""
    if spec.per_parameter:
        from megatron_ucp.synthetic.stage3_content import stage3_groups

        groups = stage3_groups(spec)
        smallest = min(groups.places, key=lambda n: groups.places[n].numel)
        part = groups.at_dp(world).partition_of(smallest)
        last_real = max(r for r in range(world) if part.true_length(r) > 0)
        return sorted({0, world // 2, last_real, *part.padding_only_ranks()[:1]})

    placement = spec.placement  # an expert group's partitions over expert-DP
    geos = placement.geometries(spec.geometries(), world)

    def real(r: int) -> list[bool]:
        return [geo.true_length(placement.index(g, r)) > 0 for g, geo in enumerate(geos)]

    last_real = max(r for r in range(world) if all(real(r)))
    padding_only = [r for r in range(world) if not all(real(r))]
    return sorted({0, world // 2, last_real, *padding_only[:1]})


def resume_probe(spec: SyntheticSpec, folder: Path, worlds: list[int], native: bool = False) -> list[dict]:
    """Sampled ranks of each resume, from the universal folder or (``native``) from the native tag."""
    rows = []
    for world in worlds:
        for rank in sampled_ranks(spec, world):
            bc.evict(folder)
            zero3 = ["--dp", str(spec.dp), "--flavour", spec.flavour] if spec.per_parameter else []
            out = subprocess.run(
                [
                    bc.python(),
                    str(BENCH_DIR / ("resume_probe_zero3.py" if spec.per_parameter else "resume_probe.py")),
                    str(folder),
                    "--preset",
                    spec_preset(spec),
                    "--world",
                    str(world),
                    "--rank",
                    str(rank),
                    "--seed",
                    str(spec.seed),
                    *zero3,
                    *(["--experts", str(spec.shape.experts), "--ep", str(spec.ep)] if spec.shape.experts else []),
                    *(["--native"] if native else []),
                    *(["--base-optimizer", spec.base_optimizer] if spec.base_optimizer != "adam" else []),
                ],
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
            )
            if out.returncode != 0 and not out.stdout.strip():
                raise RuntimeError(f"resume probe W={world} r={rank} failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  resume {spec.dp} -> {world} rank {rank}: {json.dumps(row)}", flush=True)
    return rows


def share_scaling(tag: Path, scratch: Path, counts: list[int]) -> list[dict]:
    """Wall time of N concurrent ``--share I/N`` converters of one tag into one output."""
    rows = []
    for n in counts:
        out = scratch / "out-shares"
        shutil.rmtree(out, ignore_errors=True)
        bc.evict(tag)
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [
                    bc.python(),
                    "-m",
                    "megatron_ucp.cli",
                    "-q",
                    "convert",
                    str(tag),
                    "--output",
                    str(out),
                    "--share",
                    f"{i}/{n}",
                    "--attempt-id",
                    f"bench-{n}",
                    "--no-latest",
                    "--no-progress",
                ],
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for i in range(n)
        ]
        codes = [proc.wait() for proc in procs]
        rows.append({"shares": n, "seconds": time.perf_counter() - started, "ok": codes == [0] * n})
        print(f"  {n} share(s): {json.dumps(rows[-1])}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def spec_preset(spec: SyntheticSpec) -> str:
    """The preset the spec's shape is (experts aside: the probe adds them back)."""
    shape = dataclasses.replace(spec.shape, experts=0)
    return next(name for name in PRESETS if PRESETS[name] == shape)


def metadata_probe(dp: int = 768) -> list[dict]:
    """Inspect and plan AuroraGPT-7B at ``dp`` from shapes alone, each in a fresh process."""
    out = []
    for optimizer in ("bf16", "zero"):
        code = (
            "import json,time\n"
            f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r})\n"
            "from resume_probe import peak_rss\n"
            "t=time.perf_counter()\n"
            "from megatron_ucp.plan.llama_shapes import preset\n"
            "from megatron_ucp.synthetic.content import SyntheticSpec, rank_layouts\n"
            "from megatron_ucp.plan.conversion import build_plan, check_plan\n"
            f"s=SyntheticSpec(shape=preset('aurora-7b'),dp={dp},optimizer='{optimizer}',ds_version='0.16.2')\n"
            "p=build_plan(s.groups(),rank_layouts(s)); check_plan(p)\n"
            "print(json.dumps({'seconds':time.perf_counter()-t,'peak_rss':peak_rss()}))\n"
        )
        plan = json.loads(
            subprocess.run([bc.python(), "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
            .stdout.strip()
            .splitlines()[-1]
        )
        groups = [sum(p.numel for p in g) for g in preset("aurora-7b").param_groups()]
        t0 = time.perf_counter()
        inspect = subprocess.run(
            [
                bc.python(),
                "-m",
                "megatron_ucp.cli",
                "inspect",
                "--group-numels",
                ",".join(map(str, groups)),
                "--dp",
                str(dp),
                "--optimizer",
                optimizer,
                "--ds-version",
                "0.16.2",
                "--target-dp",
                "1-1024",
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
        out.append(
            {
                "optimizer": optimizer,
                "dp": dp,
                "plan": plan,
                "inspect_seconds": time.perf_counter() - t0,
                "inspect_summary": inspect.stdout.strip().splitlines()[-1][:300],
            }
        )
        print(f"  7B DP {dp} {optimizer}: plan {plan}, inspect {out[-1]['inspect_seconds']:.2f} s", flush=True)
    return out


def _cell(result: dict, key: str = "seconds") -> str:
    if "crashed" in result:
        return f"crash: `{result['crashed'][:80]}`"
    return f"{result[key]:.1f} s" if key == "seconds" else f"{result[key] / 2**20:.0f} MiB"


def markdown(rows: list[dict], meta: list[dict], args: argparse.Namespace) -> str:
    tools = [t for t in TOOLS if t in args.tools]
    moe = f", {args.experts} experts every second layer at EP {args.ep}" if args.experts else ""
    lines = [
        f"Preset `{args.preset}`{moe} ({rows[0]['bytes'] / 1e9:.1f} GB per checkpoint), {args.optimizer}"
        f"{' ZeRO-3' if args.zero_stage == 3 else ''}, "
        f"DeepSpeed {args.ds_version} files ({args.flavour}), page cache dropped before each run, medians of "
        f"{args.reps} runs (stock and ALCF: {args.slow_reps}), tools rotated; {bc.machine()['cores']} cores.",
        "",
        "| DP | " + " | ".join(tools) + " | ours / copy floor | ours peak RSS |",
        "|---|" + "---|" * (len(tools) + 2),
    ]
    base = rows[0].get("ours", {}).get("seconds")
    for row in rows:
        ours, floor = row.get("ours", {}), row.get("cp+sync", {})
        frac = (
            f"{floor['seconds'] / ours['seconds']:.0%} of floor speed"
            if "seconds" in floor and "crashed" not in ours and "crashed" not in floor and "ours" in row
            else "-"
        )
        rss = _cell(ours, "peak_rss") if "peak_rss" in ours else "-"
        lines.append(f"| {row['dp']} | " + " | ".join(_cell(row[t]) for t in tools) + f" | {frac} | {rss} |")
    if base:
        lines += [
            "",
            "Ours against DP (time / time at DP "
            + str(rows[0]["dp"])
            + "): "
            + ", ".join(
                f"DP {r['dp']} {r['ours']['seconds'] / base:.2f}x"
                for r in rows
                if "seconds" in r.get("ours", {}) and "crashed" not in r["ours"]
            ),
        ]
    for row in rows:
        if row.get("shares"):
            one = row["shares"][0]["seconds"]
            lines += [
                "",
                f"Conversion at DP {row['dp']} split over N converter processes (`--share I/N`, one output, "
                "each with the CLI's default of 1 writer thread):",
                "",
                "| N | wall | speed-up vs N=1 | all ok |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {r['shares']} | {r['seconds']:.1f} s | {one / r['seconds']:.2f}x | {r['ok']} |"
                for r in row["shares"]
            ]
        if row.get("resume"):
            lines += [
                "",
                f"Resume from DP {row['dp']} (universal: ours' universal folder; native: the native "
                "rank files, no universal folder), one process playing each rank, page cache dropped before "
                "each. Native: reading the facts (the model states' shapes, old rank 0's optimizer-level "
                "state), which only the first rank of a DP group does, once, is not in the rank's bytes; "
                "its own bytes are below the table.",
                "",
                "| route | DP to | rank | plan | load | read / share | share | peak RSS | bit-exact |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {r.get('route', 'universal')} | {r['world']} | {r['rank']} | "
                f"{r['plan_seconds'] * 1e3:.2f} ms | {r['load_seconds']:.2f} s | "
                f"{r['read_bytes'] / max(r['share_bytes'], 1):.2f}x | {r['share_bytes'] / 2**20:.1f} MiB | "
                f"{r['peak_rss'] / 2**20:.0f} MiB | {r['bit_exact']} |"
                for r in row["resume"]
            ]
            facts = [r["facts_read_bytes"] for r in row["resume"] if "facts_read_bytes" in r]
            facts_s = [r["facts_seconds"] for r in row["resume"] if "facts_seconds" in r]
            if facts:
                lines += [
                    "",
                    f"Native facts, read by the first rank only: {min(facts) / 2**20:.1f}-"
                    f"{max(facts) / 2**20:.1f} MiB in {min(facts_s):.2f}-{max(facts_s):.2f} s.",
                ]
    if meta:
        lines += ["", "AuroraGPT-7B at DP 768 from metadata alone (no bytes on disk):", ""]
        lines += [
            f"- {m['optimizer']}: plan built and checked in {m['plan']['seconds']:.2f} s, peak RSS "
            f"{m['plan']['peak_rss'] / 2**20:.0f} MiB; `inspect` {m['inspect_seconds']:.2f} s: {m['inspect_summary']}"
            for m in meta
        ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--dp", default="8,64,256,768")
    parser.add_argument(
        "--optimizer",
        choices=["bf16", "zero"],
        default="zero",
        help="zero (default): the ALCF default at PP=1, which stock converts at 0.16.4+ files",
    )
    parser.add_argument("--ds-version", default="0.19.8")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="3: DeepSpeedZeroOptimizer_Stage3's files (every rank its model states, per-parameter partitions)",
    )
    parser.add_argument(
        "--flavour",
        choices=["megatron", "plain"],
        default="megatron",
        help="megatron: what pretrain_gpt_alcf.py saves (stock 0.19.8's ds_to_universal dies on its "
        "nested module dict at the end, as on a real save); plain: a bare engine's files",
    )
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scratch", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--no-metadata", action="store_true")
    parser.add_argument("--label", default="", help="appended to the results' file names")
    parser.add_argument("--reps", type=int, default=3, help="runs of ours and cp+sync per DP (median reported)")
    parser.add_argument("--slow-reps", type=int, default=1, help="runs of stock and the ALCF converter per DP")
    parser.add_argument(
        "--resume-to", default="384,767,1024,1536", help="DP sizes to resume the largest-DP checkpoint at ('' for none)"
    )
    parser.add_argument("--shares", default="1,2,4", help="converter counts for the --share scaling ('' for none)")
    parser.add_argument("--experts", type=int, default=0, help="a mixture-of-experts model: experts per MoE layer")
    parser.add_argument("--ep", type=int, default=1, help="with --experts: the expert-parallel size")
    parser.add_argument(
        "--base-optimizer", default="adam", help="the optimizer DeepSpeed wraps (synthetic.optimizers: adam, muon, ...)"
    )
    args = parser.parse_args(argv)
    args.tools = [t for t in args.tools.split(",") if t]
    if "alcf" in args.tools and not ALCF_CONVERTER.is_file():
        print(f"no {ALCF_CONVERTER}: leaving the ALCF converter out")
        args.tools.remove("alcf")
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="ucp-bench-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    sizes = [int(d) for d in args.dp.split(",")]
    resume_to = [int(w) for w in args.resume_to.split(",") if w]
    shares = [int(n) for n in args.shares.split(",") if n]
    try:
        for dp in sizes:
            shape = preset(args.preset)
            spec = SyntheticSpec(
                shape=dataclasses.replace(shape, experts=args.experts) if args.experts else shape,
                dp=dp,
                ep=args.ep,
                optimizer=args.optimizer,
                ds_version=args.ds_version,
                flavour=args.flavour,
                zero_stage=args.zero_stage,
                base_optimizer=args.base_optimizer,
            )
            last = dp == max(sizes)
            rows.append(
                bench_convert_at(
                    spec,
                    args.tools,
                    args.workers,
                    scratch,
                    resume_to if last else [],
                    shares if last else [],
                    args.reps,
                    args.slow_reps,
                )
            )
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    meta = [] if args.no_metadata else metadata_probe()
    results = BENCH_DIR / "results"
    data = {
        "machine": bc.machine(),
        "args": {k: v for k, v in vars(args).items() if k != "scratch"},
        "convert": rows,
        "metadata": meta,
    }
    stage = "-zero3" if args.zero_stage == 3 else f"-moe-ep{args.ep}" if args.experts else ""
    name = f"scale-{args.preset}-{args.flavour}{stage}" + (f"-{args.label}" if args.label else "")
    (results / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    table = markdown(rows, meta, args)
    (results / f"{name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
