"""Tensor- and pipeline-parallel checkpoints of the real Megatron-DeepSpeed (argonne-lcf fork).

Saved at (TP, PP, DP) = (2, 1, 2) with AuroraGPT's non-pipeline ``GPTModel``, and (1, 2, 2), (2, 2, 1)
with the pipeline model ``GPTModelPipe``, 4 ranks each. Conversion is compared element for element
with stock ``ds_to_universal`` on the same folder, and the merged TP=2 fp32 masters with the bf16 TP
slices Megatron saved in its model states (Megatron's own slicing, independent of both converters).
Resumes: TP=2 at DP 2 -> 1 continues the uninterrupted curve; TP 2 -> 1 through the runner loads with
every element accounted for, where stock DeepSpeed's universal load stops on the model-states count.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.deepspeed.reader import flatten_module_states
from tests.integration.mds import MdsRun, point_latest_at, rank_env, run_mds

LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, True), "tp2pp2": (2, 2, True)}


def _train(mds_checkout, mds_runs, name: str):
    tp, pp, pipeline = LAYOUTS[name]

    def make(folder: Path):
        return run_mds(mds_checkout, MdsRun(nproc=4, ckpt=folder / "ckpt", tp=tp, pp=pp, pipeline=pipeline,
                                            train_iters=6, save_interval=2, route="plain"))
    result = mds_runs.get(f"train-{name}", make)
    return mds_runs.base / f"train-{name}" / "ckpt", result


def _stock_convert(tag_dir: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                    "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   env=rank_env(), check=True, capture_output=True, timeout=300)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_model_parallel_checkpoint_converts_bit_exact_like_stock(mds_checkout, mds_runs, name, tmp_path):
    root, _ = _train(mds_checkout, mds_runs, name)
    tag_dir = root / "global_step4"
    ours = tmp_path / "ours"
    res = convert(ConvertOptions(source=tag_dir, output=ours, progress=False, update_latest=False))
    assert res.committed
    manifest = json.loads((ours / "ucp_manifest.json").read_text())
    tp, pp, _ = LAYOUTS[name]
    assert manifest["parallel"]["tp"] == tp and manifest["parallel"]["pp"] == pp
    stock = tmp_path / "stock"
    _stock_convert(tag_dir, stock)
    compared = 0
    for pdir in sorted(p for p in (ours / "zero").iterdir() if p.is_dir()):
        for f in sorted(pdir.iterdir()):
            theirs = stock / "zero" / pdir.name / f.name
            assert theirs.is_file(), f"stock has no {theirs}"
            if f.name == "step.pt":
                continue
            a = torch.load(f, weights_only=False)
            b = torch.load(theirs, weights_only=False)
            assert a["param"].shape == b["param"].shape and torch.equal(a["param"], b["param"]), f
            for key in ("param_n_sub_params", "vocab_tensor"):
                assert a.get(key) == b.get(key), (f, key)
            compared += 1
    assert compared == 3 * len(manifest["params"])  # fp32, exp_avg, exp_avg_sq of every parameter
    assert sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir()) == \
        sorted(p.name for p in (stock / "zero").iterdir() if p.is_dir())


def test_tp_merge_matches_megatrons_own_slices(mds_checkout, mds_runs, tmp_path):
    """bf16(merged fp32 master) == the bf16 weights each TP rank saved, put together Megatron's way."""
    root, _ = _train(mds_checkout, mds_runs, "tp2")
    tag_dir = root / "global_step6"
    out = tmp_path / "u"
    convert(ConvertOptions(source=tag_dir, output=out, progress=False, update_latest=False))
    slices = [flatten_module_states(torch.load(tag_dir / f"mp_rank_{t:02d}_model_states.pt",
                                               weights_only=False)["module"]) for t in range(2)]
    manifest = json.loads((out / "ucp_manifest.json").read_text())
    checked = set()
    for name, info in manifest["params"].items():
        key = name if name in slices[0] else next((k for k in slices[0] if k.endswith(name)), None)
        assert key is not None, (name, sorted(slices[0])[:4])
        entry = torch.load(out / "zero" / name / "fp32.pt", weights_only=False)
        merged = entry["param"]
        rows = entry.get("ucp_padded_vocab_rows")
        if rows is not None:
            merged = torch.cat([merged, rows])
        layout = info["tp_layout"]
        a, b = slices[0][key], slices[1][key]
        if layout == "replicated":
            want = a
            assert torch.equal(a, b), name
        elif "sub-params" in layout:  # rank k holds [W1_k; W2_k]; the whole is [W1_0; W1_1; W2_0; W2_1]
            (a1, a2), (b1, b2) = torch.chunk(a, 2), torch.chunk(b, 2)
            want = torch.cat([a1, b1, a2, b2])
        else:
            want = torch.cat([a, b], dim=int(layout.split("dim ")[1][0]))
        assert torch.equal(merged.to(torch.bfloat16), want), name
        checked.add(layout.split(",")[0])
    assert {"replicated", "split dim 0", "split dim 1"} <= checked


def test_tp2_resumed_at_dp1_continues_the_uninterrupted_curve(mds_checkout, mds_runs, tmp_path):
    root, full = _train(mds_checkout, mds_runs, "tp2")
    resume = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(root), str(resume)], check=True)
    point_latest_at(resume, "global_step4")
    res = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=resume, tp=2, train_iters=6, save_interval=2))
    assert any("DP changed 2 -> 1" in line for line in res.ucp_lines())
    assert any("every element placed exactly once" in line for line in res.ucp_lines())
    for it in (5, 6):
        assert abs(res.losses[it] - full.losses[it]) < 2e-4, (it, res.losses, full.losses)


def test_tp2_checkpoint_resumed_at_tp1_where_stock_cannot_load(mds_checkout, mds_runs, tmp_path):
    root, full = _train(mds_checkout, mds_runs, "tp2")
    ours = tmp_path / "ours"
    subprocess.run(["cp", "-a", str(root), str(ours)], check=True)
    point_latest_at(ours, "global_step4")
    for stale in (ours / "latest_universal", *ours.glob("*_universal")):
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    res = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=ours, tp=1, train_iters=6, save_interval=2))
    lines = res.ucp_lines()
    assert any("run: TP changed 2 -> 1" in line for line in lines)
    assert any("adding --universal-checkpoint" in line for line in lines)
    assert any("TP changed 2 -> 1: no global_step4_universal yet, converting" in line for line in lines)
    assert any("every element placed exactly once" in line for line in lines)
    assert set(res.losses) == {5, 6} and all(abs(v) < 20 for v in res.losses.values())
    # The vocabulary is padded to 512 rows at TP=2 and 384 at TP=1: real rows carry over, padded
    # rows start at zero (as stock's would), so the curve moves a little; it does not restart.
    assert abs(res.losses[5] - full.losses[5]) < 0.5

    stock = tmp_path / "stock"
    subprocess.run(["cp", "-a", str(root), str(stock)], check=True)
    point_latest_at(stock, "global_step4")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    (stock / "latest_universal").write_text("global_step4_universal")
    failed = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=stock, tp=1, train_iters=6, save_interval=2,
                                          route="plain", extra_args=("--universal-checkpoint",),
                                          expect_failure=True))
    assert failed.returncode != 0
    # its state-dict loader merges the two mp_rank files Megatron-style and asserts on this fork's names
    assert "key: attention.dense.weight is not found in the checkpoint" in failed.log
