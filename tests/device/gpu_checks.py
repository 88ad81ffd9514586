"""megatron-ucp on an accelerator: the elastic loads, the save hook and the background conversion, with real
DeepSpeed runs of the test harness's tiny model (tests/support/dsharness), on ``--device cuda`` (NCCL) or
``--device cpu`` (gloo: the rehearsal).

Two steps, so that only the second needs the accelerator (``bash tests/device/gpu_checks.sh`` runs both):

* ``prepare DIR`` (here, on the CPU): three sources saved at DP 2 through the hooks, with background conversion
  (ZeRO-1 with BF16_Optimizer, ZeRO-1 with DeepSpeedZeroOptimizer, ZeRO-3 in three sub-groups), 4 steps, saved at
  steps 2 and 4, with the harness's dumps (each rank's partitions, each parameter's full state).
* ``check DIR --device D --report OUT``: for each source, the step-2 save resumed at DP 1 on the CPU through the
  native reshard (the reference), then on ``D`` through the native reshard and through the universal route:
  every partition bit for bit the CPU load's, the full state bit for bit what was saved, where the masters and
  states live after the load (and that they are the engine's own tensors), the losses of steps 3-4 against the
  CPU's; then a save on ``D`` through the hooks (true lengths recorded, converted in the background, the twin
  verified bit for bit against its source), resumed at DP 2 on the CPU (gloo): bit for bit, on the curve; and
  the load times on ``D`` (native reshard, universal route, a same-DP restart with and without megatron-ucp).

Writes ``OUT/report.md`` and ``OUT/report.json``; exits 1 when a check fails (every check runs regardless).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tests.support.dsharness import TrainResult, TrainSpec, run_training

TAG = "global_step2"
SOURCES = {
    "zero1-bf16": dict(optimizer="bf16", zero_stage=1),
    "zero1-zero": dict(optimizer="zero", zero_stage=1),
    "zero3": dict(
        optimizer="zero", zero_stage=3, uc_info=True, extra_config={"zero_optimization": {"sub_group_size": 50}}
    ),
}
HOOKS = {"async_convert": True, "converter_exit_wait": 300}
SAME_DEVICE = 1e-3
"""Loss tolerance between runs on one kind of device at different DP sizes (bf16 reduction order)."""
CROSS_DEVICE = 5e-3
"""Between the CPU and the accelerator: their bf16 kernels round differently; the state itself is compared bit
for bit, the losses only show that training continues on the curve."""


@dataclass
class Report:
    device: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    times: list[dict[str, Any]] = field(default_factory=list)
    placements: list[dict[str, Any]] = field(default_factory=list)
    losses: list[dict[str, Any]] = field(default_factory=list)

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"check": what, "ok": bool(ok), "detail": detail})
        print(f"{'ok    ' if ok else 'FAILED'} {what}" + (f": {detail}" if detail else ""), flush=True)

    def guarded(self, what: str, run: Callable[[], None]) -> None:
        """``run`` as one check: an exception is that check's failure, and the next checks still run."""
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - reported, and the script exits 1
            self.check(what, False, f"{type(exc).__name__}: {str(exc)[-1500:]}")

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
"""The optimizer on the host (helpers.sh's CPU_OPTIMIZER=1); DeepSpeed's CPU Adam needs its compiled op, so the
torch AdamW steps the host partitions."""


def _spec(name: str, dp: int, device: str, folder: Path, offload: bool = False, **fields: Any) -> TrainSpec:
    source = dict(SOURCES[name])
    config = dict(source.pop("extra_config", {}))
    if offload:
        config = {
            **config,
            **OFFLOAD,
            "zero_optimization": {**config.get("zero_optimization", {}), **OFFLOAD["zero_optimization"]},
        }
    env = {"DS_ACCELERATOR": device}
    return TrainSpec(
        dp=dp, steps=4, dump_dir=folder / "dumps", timeout=900, env=env, extra_config=config, **source, **fields
    )


def prepare(base: Path) -> None:
    """The sources, on the CPU at DP 2."""
    for name in SOURCES:
        folder = base / name
        if (folder / "result.json").is_file():
            continue
        res = run_training(
            _spec(name, 2, "cpu", folder, save_dir=folder / "ckpt", save_at=(2, 4), plugin=True, plugin_kwargs=HOOKS)
        )
        (folder / "result.json").write_text(json.dumps({"losses": res.losses, "steps": res.steps}))
        print(f"prepared {name}: {res.optimizer_class}, losses {res.losses}", flush=True)


def _resume(
    name: str, dp: int, device: str, load_dir: Path, folder: Path, route: str = "auto", plugin=True, offload=False
) -> TrainResult:
    kwargs = {"resume_route": route} if plugin else {}
    spec = _spec(
        name, dp, device, folder, offload, load_dir=load_dir, load_tag=TAG, plugin=plugin, plugin_kwargs=kwargs
    )
    return run_training(spec)


def _partitions(res: TrainResult, rank: int = 0) -> dict:
    return torch.load(res.dumps[f"rank{rank}_step2_loaded"], weights_only=False)


def _same_tensors(a: Any, b: Any, where: str) -> Optional[str]:
    """None when ``a`` and ``b`` hold the same values bit for bit (lists, dicts, tensors, numbers)."""
    if torch.is_tensor(a):
        if not torch.is_tensor(b) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(getattr(b, 'shape', ()))} {getattr(b, 'dtype', b)}"
        return None if torch.equal(_bits(a), _bits(b)) else f"{where}: differs"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} vs {sorted(b)}"
        return next((p for k in a if (p := _same_tensors(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} entries"
        return next(
            (p for i, (x, y) in enumerate(zip(a, b, strict=True)) if (p := _same_tensors(x, y, f"{where}[{i}]"))), None
        )
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, on the CPU: equal exactly when the values are bit for bit (NaNs and -0.0 too)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _full_state(path: Path) -> dict:
    """A dump's per-parameter state, less where ZeRO-3 put each parameter (its sub-group depends on DP)."""
    state = torch.load(path, weights_only=False)
    return {name: {k: v for k, v in entry.items() if k != "sub_group"} for name, entry in state.items()}


def _losses(res: TrainResult) -> dict[int, float]:
    return dict(zip(res.steps, res.losses, strict=True))


def _on_curve(report: Report, what: str, got: TrainResult, reference: dict[int, float], tolerance: float) -> None:
    mine = _losses(got)
    diffs = {s: abs(mine[s] - reference[s]) for s in (3, 4) if s in mine and s in reference}
    report.losses.append({"run": what, "losses": mine, "reference": {s: reference[s] for s in diffs}})
    ok = len(diffs) == 2 and max(diffs.values()) <= tolerance
    report.check(f"{what}: steps 3-4 on the curve (<= {tolerance:g})", ok, f"differences {diffs}")


def _placement(report: Report, what: str, res: TrainResult, device: str) -> None:
    for stats in res.info.get("load_stats", []):
        placement = stats["placement"]
        report.placements.append({"run": what, "rank": stats["rank"], **placement})
        where = "cpu" if device == "cpu" else f"{device}:{stats['rank']}"
        ok = placement["masters"] == [where] and placement["states"] == [where] and placement["masters_kept"]
        report.check(
            f"{what}: rank {stats['rank']}'s masters and states on {where}, the engine's own tensors",
            ok,
            json.dumps(placement),
        )


def _timed(report: Report, what: str, res: TrainResult) -> None:
    for stats in res.info.get("load_stats", []):
        report.times.append(
            {"load": what, "rank": stats["rank"], "seconds": stats["seconds"], "phases": stats["phases"]}
        )


def _route_said(res: TrainResult, words: str) -> bool:
    return any(words in line for line in res.log.splitlines() if "megatron-ucp" in line)


def check_source(report: Report, base: Path, name: str, device: str, out: Path) -> None:
    src = base / name
    saved = json.loads((src / "result.json").read_text())
    source_losses = dict(zip(saved["steps"], saved["losses"], strict=True))
    work = out / name
    runs: dict[str, TrainResult] = {}

    def cpu_reference() -> None:
        runs["cpu"] = _resume(name, 1, "cpu", src / "ckpt", work / "cpu-native")
        state = _same_tensors(
            _full_state(src / "dumps" / "state_step2.pt"), _full_state(runs["cpu"].dumps["state_step2_loaded"]), "state"
        )
        report.check(
            f"{name}: CPU, DP 2 -> 1, native reshard: every parameter's state as saved", state is None, state or ""
        )
        _on_curve(report, f"{name} CPU DP 1", runs["cpu"], source_losses, SAME_DEVICE)

    report.guarded(f"{name}: CPU reference load", cpu_reference)
    if "cpu" not in runs:
        return
    variants = [("auto", False), ("universal", False)] + ([("auto", True)] if name == "zero1-zero" else [])
    for route, offload in variants:
        said = "from its native rank files" if route == "auto" else f"{TAG}_universal"
        label = f"{name}: {device}, DP 2 -> 1, {'native reshard' if route == 'auto' else 'universal route'}"
        label += ", optimizer offloaded to the host" if offload else ""

        def on_device(route: str = route, said: str = said, label: str = label, offload: bool = offload) -> None:
            where = work / f"{device}-{route}{'-offload' if offload else ''}"
            res = _resume(name, 1, device, src / "ckpt", where, route=route, offload=offload)
            report.check(f"{label}: route taken", _route_said(res, said), said)
            differs = _same_tensors(_partitions(runs["cpu"]), _partitions(res), "rank 0")
            report.check(f"{label}: every partition bit for bit the CPU load's", differs is None, differs or "")
            _placement(report, label, res, "cpu" if offload else device)
            _timed(report, label, res)
            _on_curve(report, label, res, _losses(runs["cpu"]), CROSS_DEVICE if device != "cpu" else 0.0)

        report.guarded(label, on_device)


def check_device_save(report: Report, device: str, out: Path) -> None:
    """A save on the device through the hooks, converted in the background, resumed at DP 2 on the CPU."""
    from megatron_ucp.convert.universal import universal_state
    from megatron_ucp.convert.verify import verify_universal
    from megatron_ucp.format import dsformat as F

    name, work = "zero1-bf16", out / f"{device}-save"
    root = work / "train" / "ckpt"
    trained = run_training(
        _spec(name, 1, device, work / "train", save_dir=root, save_at=(2, 4), plugin=True, plugin_kwargs=HOOKS)
    )
    optim = torch.load(next((root / TAG).glob("*zero_pp_rank_0_*optim_states.pt")), weights_only=False)
    recorded = optim[F.OPTIMIZER_STATE_DICT].get(F.GROUP_TRUE_LENGTHS)
    report.check(
        f"save on {device}: true lengths recorded", recorded is not None, f"{F.GROUP_TRUE_LENGTHS} = {recorded}"
    )
    twin = root / F.universal_tag(TAG)
    report.check(f"save on {device}: converted in the background", universal_state(twin, root / TAG) == "complete")
    verified = verify_universal(twin, root / TAG)
    report.check(f"save on {device}: the twin bit for bit its source", verified.ok, verified.summary())
    back = _resume(name, 2, "cpu", root, work / "cpu-dp2")
    differs = _same_tensors(
        _full_state(trained.dumps["state_step2"]), _full_state(back.dumps["state_step2_loaded"]), "state"
    )
    report.check(
        f"save on {device} resumed at DP 2 on the CPU: every parameter's state as saved", differs is None, differs or ""
    )
    _on_curve(
        report,
        f"save on {device}, resumed at DP 2 on the CPU",
        back,
        _losses(trained),
        CROSS_DEVICE if device != "cpu" else SAME_DEVICE,
    )
    for plugin in (False, True):
        label = f"{device}: same-DP restart (DP 1) {'with megatron-ucp' if plugin else 'stock DeepSpeed'}"
        res = _resume(name, 1, device, root, work / f"same-dp-{plugin}", plugin=plugin)
        _timed(report, label, res)
        _on_curve(report, label, res, _losses(trained), SAME_DEVICE)


def check_device_async_save(report: Report, device: str, out: Path) -> None:
    """An asynchronous save on the device (device-to-host copies into pinned buffers, written in the background): the
    run and its files those of a synchronous save, and the time it held training, in absolute terms."""
    from tests.support.state_compare import tag_differences

    name, work, runs = "zero1-bf16", out / f"{device}-async-save", {}
    for mode in ("sync", "async"):
        root = work / mode / "ckpt"
        hooks = {**HOOKS, "async_save": mode == "async"}
        spec = _spec(name, 1, device, work / mode, save_dir=root, save_at=(2, 4), plugin=True, plugin_kwargs=hooks)
        runs[mode] = (root, run_training(spec))
    (sync_root, sync), (root, res) = runs["sync"], runs["async"]
    report.check(
        f"async save on {device}: the synchronous save's losses", _losses(res) == _losses(sync), f"{_losses(res)}"
    )
    for tag in ("global_step2", "global_step4"):
        diffs = tag_differences(root / tag, sync_root / tag)
        report.check(
            f"async save on {device}: {tag} tensor for tensor the synchronous save's", not diffs, str(diffs[:5])
        )
    copies = re.findall(r"copied into host memory in ([0-9.]+)s \(([0-9.]+) MB", res.log)
    report.check(f"async save on {device}: returned after the copy into host memory", len(copies) == 2, f"{copies}")
    report.check(f"async save on {device}: latest names the last save", (root / "latest").read_text() == "global_step4")


def check_device_pipeline_copies(report: Report, device: str) -> None:
    """DeepSpeed's ``PipelineModule`` on the device, saved three times through the asynchronous save's capture into
    one reused slot of pinned host buffers (tests/support/pipeline_copies.py): every layer file holds its own layer.
    Pinned buffers do not come from the allocator the saves' clones do, so even the first save meets freed ones."""
    import subprocess

    from tests.support.dsharness import free_port

    done = subprocess.run(
        [sys.executable, "-m", "tests.support.pipeline_copies", str(free_port()), device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("WRONG ")]
    wrong = json.loads(found[0][len("WRONG ") :]) if found else None
    report.check(
        f"pipeline model's async save on {device}: every layer file its own layer, save after save",
        done.returncode == 0 and wrong == [],
        f"wrong (save, layer, key): {wrong}" if found else done.stderr[-300:],
    )


def _markdown(report: Report, seconds: float) -> str:
    card = (
        torch.cuda.get_device_name(0)
        if report.device == "cuda" and torch.cuda.is_available()
        else platform.processor() or "CPU"
    )
    import deepspeed

    lines = [
        f"# megatron-ucp on {report.device} ({card})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
        f"DeepSpeed {deepspeed.__version__}, Python {platform.python_version()}; {seconds:.0f} s in all. "
        "`tests/device/gpu_checks.sh` wrote this.",
        "",
        f"{sum(c['ok'] for c in report.checks)} of {len(report.checks)} checks passed.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    lines += [
        f"| {c['check']} | {'ok' if c['ok'] else '**FAILED**'} | {c['detail'][:300].replace('|', '/')} |"
        for c in report.checks
    ]
    lines += [
        "",
        "## Load times (rank 0, seconds inside `load_checkpoint`)",
        "",
        "| load | seconds | phases |",
        "|---|---|---|",
    ]
    lines += [f"| {t['load']} | {t['seconds']:.3f} | {t['phases'] or ''} |" for t in report.times if t["rank"] == 0]
    lines += [
        "",
        "## Where the masters and states live after each load",
        "",
        "| load | rank | masters | states | the engine's own tensors |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['run']} | {p['rank']} | {p['masters']} | {p['states']} | {p['masters_kept']} |"
        for p in report.placements
    ]
    return "\n".join(lines) + "\n"


def check(base: Path, device: str, out: Path, runs: Path) -> int:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(device)
    if device != "cpu" and not torch.cuda.is_available():
        report.check(f"{device} is available to torch", False, "torch.cuda.is_available() is False")
    else:
        for name in SOURCES:
            check_source(report, base, name, device, runs)
        report.guarded(f"save on {device}", lambda: check_device_save(report, device, runs))
        report.guarded(f"async save on {device}", lambda: check_device_async_save(report, device, runs))
        report.guarded(f"pipeline async save on {device}", lambda: check_device_pipeline_copies(report, device))
    (out / "report.json").write_text(json.dumps(report.__dict__, indent=1, default=str))
    (out / "report.md").write_text(_markdown(report, time.perf_counter() - t0))
    failed = [c["check"] for c in report.checks if not c["ok"]]
    passed, seconds = len(report.checks) - len(failed), time.perf_counter() - t0
    print(f"gpu_checks on {device}: {passed} of {len(report.checks)} passed in {seconds:.0f} s; {out / 'report.md'}")
    return 0 if report.ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.device.gpu_checks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="save the sources on the CPU (here)")
    p.add_argument("base", type=Path)
    c = sub.add_parser("check", help="the loads and the save on --device")
    c.add_argument("base", type=Path)
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    c.add_argument("--report", type=Path, required=True, help="folder for report.md and report.json")
    c.add_argument("--runs", type=Path, required=True, help="folder for the runs' checkpoints, dumps and logs")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.base)
        return 0
    return check(args.base, args.device, args.report, args.runs)


if __name__ == "__main__":
    sys.exit(main())
