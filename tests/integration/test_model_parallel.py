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
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.deepspeed.reader import flatten_module_states
from tests.integration.mds import MdsRun, point_latest_at, rank_env, run_mds

LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, True), "tp2pp2": (2, 2, True), "tp2zero": (2, 1, False)}
"""(TP, PP, pipeline model) of each training; ``tp2zero`` trains with DeepSpeedZeroOptimizer (the ALCF
default at PP=1), the others with BF16_Optimizer."""
SAME_PADDING = ("--make-vocab-size-divisible-by", "256")
"""257 tokens pad to 512 rows at TP=1 and at TP=2 (the default, 128, pads to 384 and 512): with the same
padded size every row's state carries over, so a TP change can be held to the uninterrupted curve."""


def _train(mds_checkout, mds_runs, name: str):
    if name == "tp1-hooked":  # AuroraGPT's layout, saved through the runner (TP layout recorded)
        tp, pp, pipeline, route, extra = 1, 1, False, "runner", SAME_PADDING
    elif name == "tp2":  # through the runner, converted in the background as it trains
        (tp, pp, pipeline), route, extra = LAYOUTS[name], "runner", ("--ucp-async-convert",)
    else:
        (tp, pp, pipeline), route, extra = LAYOUTS[name], "plain", ()
    optimizer = "zero" if name.endswith("zero") else "bf16"

    def make(folder: Path):
        return run_mds(mds_checkout, MdsRun(nproc=4, ckpt=folder / "ckpt", tp=tp, pp=pp, pipeline=pipeline,
                                            train_iters=6, save_interval=2, route=route, extra_args=extra,
                                            optimizer=optimizer))
    result = mds_runs.get(f"train-{name}", make)
    return mds_runs.base / f"train-{name}" / "ckpt", result


def _assert_continues(res, full, *said: str, tolerance: float = 2e-4) -> None:
    """The resumed run said ``said`` (and proved every element placed) and continued the uninterrupted curve."""
    lines = res.ucp_lines()
    for text in (*said, "every element placed exactly once"):
        assert any(text in line for line in lines), (text, lines)
    for it in (5, 6):
        assert abs(res.losses[it] - full.losses[it]) < tolerance, (it, res.losses, full.losses)


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
    checked = verify_universal(ours, source=tag_dir)  # whole parameters, bit for bit against the rank files
    assert checked.ok and checked.params == len(manifest["params"]), checked.problems
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


@pytest.mark.parametrize("name", ["tp2", "tp2zero"])
def test_tp2_resumed_at_dp1_continues_the_uninterrupted_curve(mds_checkout, mds_runs, tmp_path, name):
    root, full = _train(mds_checkout, mds_runs, name)
    resume = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(root), str(resume)], check=True)
    point_latest_at(resume, "global_step4")
    res = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=resume, tp=2, train_iters=6, save_interval=2,
                                       optimizer="zero" if name.endswith("zero") else "bf16"))
    wanted = "DeepSpeedZeroOptimizer" if name.endswith("zero") else "BF16_Optimizer"
    assert wanted in json.loads((resume / "global_step4_universal" / "ucp_manifest.json").read_text())["source"]["optimizer"]
    _assert_continues(res, full, "DP changed 2 -> 1")


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


def test_inspect_shows_the_3d_layout(mds_checkout, mds_runs):
    from megatron_ucp.convert.inspection import format_report, inspect_checkpoint

    root, _ = _train(mds_checkout, mds_runs, "tp2pp2")
    report = inspect_checkpoint(root, "global_step4", [1, 2])
    assert report.parallel == {"tp": 2, "pp": 2, "dp": 1}
    assert [(c["pp"], c["tp"]) for c in report.coordinates] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    text = format_report(report)
    assert "TP=2 x PP=2 x DP=1" in text and "split dim 1" in text and "replicated" in text


def test_drifted_tp_replicas_are_reported_with_numbers(mds_checkout, mds_runs, tmp_path, caplog):
    """A layer norm that differs between TP ranks: stock asserts, megatron-ucp keeps TP rank 0's and says by how much."""
    root, _ = _train(mds_checkout, mds_runs, "tp2")
    tag = tmp_path / "global_step4"
    subprocess.run(["cp", "-a", str(root / "global_step4"), str(tag)], check=True)
    name = "language_model.encoder.layers.0.input_layernorm.weight"
    for victim in sorted(tag.glob("*_mp_rank_01_optim_states.pt")):  # TP rank 1's copy, whichever DP rank holds it
        sd = torch.load(victim, weights_only=False)
        osd = sd["optimizer_state_dict"]
        group = next((g for g, m in enumerate(osd["param_slice_mappings"]) if name in m), None)
        if group is not None:
            break
    addr = osd["param_slice_mappings"][group][name]
    with torch.no_grad():
        osd["single_partition_of_fp32_groups"][group].narrow(0, addr.start, 3).add_(0.5)
    torch.save(sd, victim)
    out = tmp_path / "u"
    with caplog.at_level("WARNING"):
        convert(ConvertOptions(source=tag, output=out, progress=False, update_latest=False))
    drift = json.loads((out / "ucp_manifest.json").read_text())["replica_drift"]
    assert drift == [{"param": name, "state": "fp32", "copy": 1, "differing": 3, "numel": 64,
                      "max_abs_diff": pytest.approx(0.5, abs=1e-6)}]
    assert any(name in r.message and "3 of 64 elements" in r.message for r in caplog.records)
    clean = tmp_path / "clean"
    convert(ConvertOptions(source=root / "global_step4", output=clean, progress=False, update_latest=False))
    kept = torch.load(out / "zero" / name / "fp32.pt", weights_only=False)["param"]
    assert torch.equal(kept, torch.load(clean / "zero" / name / "fp32.pt", weights_only=False)["param"])
    assert "replica_drift" not in json.loads((clean / "ucp_manifest.json").read_text())
    with pytest.raises(subprocess.CalledProcessError) as stock:
        _stock_convert(tag, tmp_path / "stock")
    assert b"AssertionError" in stock.value.stderr + stock.value.stdout


def _resume_copy(root: Path, dest: Path, tag: str = "global_step4") -> Path:
    subprocess.run(["cp", "-a", str(root), str(dest)], check=True)
    point_latest_at(dest, tag)
    for twin in (dest / "latest_universal", *dest.glob("*_universal")):
        subprocess.run(["rm", "-rf", str(twin)], check=True)
    return dest


def test_tp1_checkpoint_resumed_at_tp2_continues_the_curve(mds_checkout, mds_runs, tmp_path):
    """TP 1 -> 2, where stock goes wrong: its TP=1 folder says cat_dim 0 for the row-parallel weights."""
    root, full = _train(mds_checkout, mds_runs, "tp1-hooked")
    ours = _resume_copy(root, tmp_path / "ours")
    res = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=ours, tp=2, train_iters=6, save_interval=2,
                                       extra_args=SAME_PADDING))
    _assert_continues(res, full, "run: TP changed 1 -> 2")
    manifest = json.loads((ours / "global_step4_universal" / "ucp_manifest.json").read_text())
    dense = "language_model.encoder.layers.0.self_attention.dense.weight"
    assert manifest["params"][dense]["tp_layout"] == "split dim 1"  # recorded at save, TP=1
    assert torch.load(ours / "global_step4_universal" / "zero" / dense / "fp32.pt", weights_only=False)["cat_dim"] == 1

    stock = _resume_copy(root, tmp_path / "stock")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    # stock's folder: the same shapes, but cat_dim 0 for the row-parallel weight (no pattern at TP=1):
    # a TP=2 load would cut it on the wrong dimension, and every element count would still agree
    assert torch.load(stock / "global_step4_universal" / "zero" / dense / "fp32.pt", weights_only=False)["cat_dim"] == 0
    (stock / "latest_universal").write_text("global_step4_universal")
    silent = run_mds(mds_checkout, MdsRun(nproc=2, ckpt=stock, tp=2, train_iters=6, save_interval=2, route="plain",
                                          extra_args=(*SAME_PADDING, "--universal-checkpoint")))
    # stock loads without a word and trains on: 1e-2 off the curve (measured: +0.0105 at iteration 5;
    # +0.014 of it the row-parallel weights cut on dim 0, -0.004 the padded vocabulary rows it zeroes)
    assert abs(silent.losses[5] - full.losses[5]) > 20 * abs(res.losses[5] - full.losses[5])
    assert abs(silent.losses[5] - full.losses[5]) > 1e-3


def test_nonpipeline_pp1_resumed_as_pipeline_pp2(mds_checkout, mds_runs, tmp_path):
    """AuroraGPT's GPTModel at PP=1 moves to GPTModelPipe at PP=2: names mapped, every element accounted for."""
    root, full = _train(mds_checkout, mds_runs, "tp1-hooked")
    ours = _resume_copy(root, tmp_path / "ours")
    res = run_mds(mds_checkout, MdsRun(nproc=4, ckpt=ours, pp=2, pipeline=True, train_iters=6, save_interval=2,
                                       extra_args=SAME_PADDING))
    _assert_continues(res, full, "run: PP changed 1 -> 2", "saved by GPTModel, the model is GPTModelPipe")

    stock = _resume_copy(root, tmp_path / "stock")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    (stock / "latest_universal").write_text("global_step4_universal")
    failed = run_mds(mds_checkout, MdsRun(nproc=4, ckpt=stock, pp=2, pipeline=True, train_iters=6, save_interval=2,
                                          route="plain", extra_args=(*SAME_PADDING, "--universal-checkpoint"),
                                          expect_failure=True))
    assert failed.returncode != 0 and "No such file or directory" in failed.log and "word_embeddings.weight" in failed.log


def test_tp2_training_converts_in_the_background(mds_checkout, mds_runs):
    root, res = _train(mds_checkout, mds_runs, "tp2")
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6]
    for tag in ("global_step2", "global_step6"):  # step 4 may be skipped: saved while 2 converted, superseded by 6
        manifest = json.loads((root / f"{tag}_universal" / "ucp_manifest.json").read_text())
        assert manifest["parallel"] == {"tp": 2, "pp": 1, "dp": 2, "layouts_recorded": True}
    assert (root / "latest_universal").read_text() == "global_step6_universal"


def test_pipeline_tp2_pp2_resumed_as_nonpipeline_tp2_pp1(mds_checkout, mds_runs, tmp_path):
    """(2, 2, 1) GPTModelPipe -> (2, 1, 2) GPTModel: PP 2 -> 1 and back to AuroraGPT's model class, TP kept."""
    root, full = _train(mds_checkout, mds_runs, "tp2pp2")
    ours = _resume_copy(root, tmp_path / "ours")
    res = run_mds(mds_checkout, MdsRun(nproc=4, ckpt=ours, tp=2, pp=1, train_iters=6, save_interval=2))
    _assert_continues(res, full, "run: PP changed 2 -> 1, DP changed 1 -> 2",
                      "saved by GPTModelPipe, the model is GPTModel")
