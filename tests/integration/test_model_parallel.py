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
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.background.status import root_status
from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.deepspeed.reader import flatten_module_states
from megatron_ucp.export.hf_export import ExportOptions, export_hf
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.save_record import partition_checksums
from tests.integration.hf_check import assert_computes, fork_logits, same_files
from tests.integration.mds import MdsModel, MdsRun, rank_env, run_mds
from tests.integration.shared_runs import SAME_PADDING, TRAININGS
from tests.integration.shared_runs import train as _train


def _resume(
    mds_checkout,
    mds_runs,
    name: str,
    dest: Path,
    nproc: int,
    tp: int = 1,
    pp: int = 1,
    pipeline: bool = False,
    extra_args=SAME_PADDING,
    **kw,
):
    """Restart ``name``'s training from iteration 4 through the runner, no flag, at another layout."""
    root, full = _train(mds_checkout, mds_runs, name)
    t = TRAININGS[name]
    ckpt = _resume_copy(root, dest)
    res = run_mds(
        mds_checkout,
        MdsRun(
            nproc=nproc,
            ckpt=ckpt,
            tp=tp,
            pp=pp,
            pipeline=pipeline,
            train_iters=6,
            save_interval=2,
            optimizer=t.optimizer,
            zero_stage=t.zero_stage,
            model=MdsModel(untied=t.untied),
            extra_args=extra_args,
            **kw,
        ),
    )
    return ckpt, res, full


def _assert_continues(res, full, *said: str, optimizer: str = "bf16") -> None:
    """The resumed run said ``said`` (and proved every element placed) and continued the uninterrupted
    curve: within 2e-4, after the first resumed update within 1e-3 on a release whose stock
    BF16_Optimizer is not DP-invariant (``versions.Internals.bf16_dp_invariant``: 0.18.9)."""
    from megatron_ucp.deepspeed.versions import internals

    lines = res.ucp_lines()
    for text in (*said, "every element placed exactly once"):
        assert any(text in line for line in lines), (text, lines)
    later = 2e-4 if optimizer != "bf16" or internals().bf16_dp_invariant else 1e-3
    for it, tolerance in ((5, 2e-4), (6, later)):
        assert abs(res.losses[it] - full.losses[it]) < tolerance, (it, res.losses, full.losses)


def _stock_convert(tag_dir: Path, out: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tag_dir),
            "--output_folder",
            str(out),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        env=rank_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.parametrize("name", ["tp2", "tp2zero", "tp2zero2", "pp2", "pp2-zero", "tied-pp2", "tp2pp2"])
def test_synthetic_writer_matches_a_model_parallel_save(mds_checkout, mds_runs, name, tmp_path):
    """At TP=2 and with the pipeline model at PP=2 (untied, tied, TP=2 x PP=2) the synthetic writer
    writes what Megatron-DeepSpeed saved (iteration 4): every model-parallel rank's model states,
    layer files and rank files, key for key (tests/support/file_structure.py), with and without the
    hooks' record, both optimizer classes, ZeRO-1 and ZeRO-2."""
    import deepspeed

    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.integration.mds import llama_shape
    from tests.support.file_structure import folder_differences, load

    root, _ = _train(mds_checkout, mds_runs, name)
    t, m = TRAININGS[name], MdsModel()
    dp = t.nproc // (t.tp * t.pp)
    shape = llama_shape(m, vocab=512, tied=not t.untied)
    spec = SyntheticSpec(
        shape=shape,
        dp=dp,
        tp=t.tp,
        pp=t.pp,
        pipeline=t.pipeline,
        optimizer=t.optimizer,
        zero_stage=t.zero_stage,
        record=t.hooked,
        ds_version=deepspeed.__version__,
        iteration=4,
        micro_batch=1,
        grad_accumulation=12 // dp,
        seq_length=m.seq,
    )
    written = write_checkpoint(tmp_path / "synthetic", spec, progress=False)
    diffs = folder_differences(root / "global_step4", written.tag_dir)
    assert not diffs, "\n".join(diffs[:40])
    for mp_rank in range(t.tp * t.pp):
        name_ = f"mp_rank_{mp_rank:02d}_model_states.pt"
        real_args = vars(load(root / "global_step4" / name_)["args"])
        ours = vars(load(written.tag_dir / name_)["args"])
        assert {k: (real_args.get(k), v) for k, v in ours.items() if real_args.get(k, "<absent>") != v} == {}


CONVERTED = ("tp2pp2", "tp2zero", "tied-pp2")
"""TP and PP merged at once (BF16_Optimizer), a stock save at TP 2 (DeepSpeedZeroOptimizer), tied embeddings. (The
background conversions of PP 2 at both classes are verified in test_pp2_hooked_...; TP 2 alone is in tp2pp2.)"""


@pytest.mark.parametrize("name", CONVERTED)
def test_model_parallel_checkpoint_converts_bit_exact_like_stock(mds_checkout, mds_runs, name, tmp_path):
    """Our conversion equals stock ``ds_to_universal`` (an oracle independent of our plan) in every
    state file; the save hook's TP-layout record is there exactly when the training went through it."""
    root, _ = _train(mds_checkout, mds_runs, name)
    tag_dir = root / "global_step4"
    ours = tmp_path / "ours"
    res = convert(ConvertOptions(source=tag_dir, output=ours, progress=False, update_latest=False))
    assert res.committed
    manifest = json.loads((ours / "ucp_manifest.json").read_text())
    t = TRAININGS[name]
    assert manifest["parallel"] == {
        "tp": t.tp,
        "pp": t.pp,
        "dp": t.nproc // (t.tp * t.pp),
        "layouts_recorded": t.hooked,
    }
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
    assert sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir()) == sorted(
        p.name for p in (stock / "zero").iterdir() if p.is_dir()
    )


def test_tp_merge_matches_megatrons_own_slices(mds_checkout, mds_runs, tmp_path):
    """bf16(merged fp32 master) == the bf16 weights each TP rank saved, put together Megatron's way."""
    root, _ = _train(mds_checkout, mds_runs, "tp2")
    tag_dir = root / "global_step6"
    out = tmp_path / "u"
    convert(ConvertOptions(source=tag_dir, output=out, progress=False, update_latest=False))
    slices = [
        flatten_module_states(torch.load(tag_dir / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)["module"])
        for t in range(2)
    ]
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


@pytest.mark.parametrize("name, route", [("tp2", "universal"), ("tp2zero", "auto"), ("tp2zero2", "auto")])
def test_tp2_resumed_at_dp1_continues_the_uninterrupted_curve(mds_checkout, mds_runs, tmp_path, name, route):
    """TP=2 kept, DP 2 -> 1: BF16_Optimizer, DeepSpeedZeroOptimizer at ZeRO-1 (saved without the hooks) and
    ZeRO-2. With no flag each TP coordinate reshards its own native files (BF16_Optimizer's: the fallback test
    below, after its refused tag); with ``--ucp-resume-route universal`` the same move goes through the universal
    twin, to the same losses."""
    t = TRAININGS[name]
    ckpt, res, full = _resume(
        mds_checkout,
        mds_runs,
        name,
        tmp_path / "ckpt",
        nproc=2,
        tp=2,
        extra_args=(*SAME_PADDING, "--ucp-resume-route", route),
    )
    if route == "universal":
        manifest = json.loads((ckpt / "global_step4_universal" / "ucp_manifest.json").read_text())
        assert manifest["source"]["optimizer"] == (
            "DeepSpeedZeroOptimizer" if t.optimizer == "zero" else "BF16_Optimizer"
        )
        if t.optimizer == "zero":  # BF16_Optimizer's files record no stage
            assert manifest["source"]["zero_stage"] == t.zero_stage
        _assert_continues(res, full, "DP changed 2 -> 1", "megatron-ucp universal load:")
        return
    _assert_resharded_at_dp1(res, full, optimizer=t.optimizer)


def _assert_resharded_at_dp1(res, full, optimizer: str = "bf16") -> None:
    """TP 2 kept, DP 2 -> 1 straight from global_step4's native rank files (no conversion), on the curve."""
    assert not any("converting" in line for line in res.ucp_lines()), res.ucp_lines()
    _assert_continues(
        res,
        full,
        "DP changed 2 -> 1: resharding global_step4 from its native rank files",
        "megatron-ucp native reshard:",
        optimizer=optimizer,
    )


def test_tp2_checkpoint_resumed_at_tp1_where_stock_cannot_load(mds_checkout, mds_runs, tmp_path):
    root, full = _train(mds_checkout, mds_runs, "tp2")
    ours = _resume_copy(root, tmp_path / "ours")
    res = run_mds(
        mds_checkout, MdsRun(nproc=2, ckpt=ours, tp=1, train_iters=6, save_interval=2, extra_args=SAME_PADDING)
    )
    lines = res.ucp_lines()
    assert any("run: TP changed 2 -> 1" in line for line in lines)
    assert any("adding --universal-checkpoint" in line for line in lines)
    _assert_continues(res, full, "TP changed 2 -> 1", "no global_step4_universal yet, converting")

    stock = _resume_copy(root, tmp_path / "stock")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    (stock / "latest_universal").write_text("global_step4_universal")
    failed = run_mds(
        mds_checkout,
        MdsRun(
            nproc=2,
            ckpt=stock,
            tp=1,
            train_iters=6,
            save_interval=2,
            route="plain",
            extra_args=(*SAME_PADDING, "--universal-checkpoint"),
            expect_failure=True,
        ),
    )
    assert failed.returncode != 0
    # its state-dict loader merges the two mp_rank files Megatron-style and asserts on this fork's names
    assert "key: attention.dense.weight is not found in the checkpoint" in failed.log


def _placed_elements(res) -> int:
    summary = next(line for line in res.ucp_lines() if "every element placed exactly once" in line)
    return int(summary.split(" elements")[0].rsplit(" ", 1)[1])


def test_a_smaller_padded_vocabulary_keeps_every_row_both_sides_have(mds_checkout, mds_runs, tmp_path):
    """TP 2 -> 1 with Megatron's default padding: 512 rows become 384. The 127 padded rows both sizes
    have (257..383) keep their trained state, and the ledger counts them: exactly those rows' elements
    more than a load of stock's folder, which zero-fills every padded row. Neither continues the curve
    to 2e-4: the softmax now covers 128 fewer rows (the tiny model is near uniform, so the loss drops
    by about log(512/384) = 0.288); the README has both numbers."""
    default = ("--make-vocab-size-divisible-by", "128")
    _, res, full = _resume(mds_checkout, mds_runs, "tp2", tmp_path / "ours", nproc=2, tp=1, extra_args=default)
    root, _ = _train(mds_checkout, mds_runs, "tp2")
    zeroed_dir = _resume_copy(root, tmp_path / "zeroed")  # stock's conversion: no padded rows kept
    _stock_convert(zeroed_dir / "global_step4", zeroed_dir / "global_step4_universal")
    (zeroed_dir / "latest_universal").write_text("global_step4_universal")
    zeroed = run_mds(
        mds_checkout, MdsRun(nproc=2, ckpt=zeroed_dir, tp=1, train_iters=6, save_interval=2, extra_args=default)
    )
    hidden, kept_rows, states, vocab_tensors = 64, 384 - 257, 3, 2  # fp32, exp_avg, exp_avg_sq; embedding, output
    assert _placed_elements(res) - _placed_elements(zeroed) == kept_rows * hidden * states * vocab_tensors
    ours, stock_rows = (abs(r.losses[5] - full.losses[5]) for r in (res, zeroed))
    print(
        f"padded vocabulary 512 -> 384: |loss - uninterrupted| at iteration 5: ours {ours:.4f}, "
        f"stock's zeroed rows {stock_rows:.4f}"
    )
    assert ours < stock_rows


def test_inspect_shows_the_3d_layout(mds_checkout, mds_runs):
    from megatron_ucp.convert.inspection import format_report, inspect_checkpoint

    root, _ = _train(mds_checkout, mds_runs, "tp2pp2")
    report = inspect_checkpoint(root, "global_step4", [1, 2])
    assert report.parallel == {"tp": 2, "pp": 2, "dp": 1}
    assert [(c["pp"], c["tp"]) for c in report.coordinates] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    text = format_report(report)
    assert "TP=2 x PP=2 x DP=1" in text and "split dim 1" in text and "replicated" in text


def _perturb(tag: Path, name: str, file_glob: str, amount: float = 0.5) -> None:
    """Add ``amount`` to the first 3 fp32 elements of ``name`` in the first rank file of ``file_glob`` holding it,
    as a drift the training itself had: the checksum the hooks recorded for that partition is the drifted one's
    (a change on disk after the save is refused by name, tests/system/test_save_check.py)."""
    for victim in sorted(tag.glob(file_glob)):
        sd = torch.load(victim, weights_only=False)
        osd = sd["optimizer_state_dict"]
        group = next((g for g, m in enumerate(osd["param_slice_mappings"]) if name in m), None)
        if group is not None:
            break
    addr = osd["param_slice_mappings"][group][name]
    with torch.no_grad():
        osd["single_partition_of_fp32_groups"][group].narrow(0, addr.start, 3).add_(amount)
    recorded = osd.get(F.ZERO_PARTITION_CHECKSUMS)
    if recorded is not None:
        fp32 = osd["single_partition_of_fp32_groups"]
        fresh = partition_checksums(fp32, [{} for _ in fp32], osd)[F.ZERO_PARTITION_CHECKSUMS]
        recorded["groups"][group][F.FP32_STATE] = fresh["groups"][group][F.FP32_STATE]
    torch.save(sd, victim)


def test_drifted_tp_replicas_are_reported_with_numbers(mds_checkout, mds_runs, tmp_path, caplog):
    """A layer norm that differs between TP ranks: stock asserts, megatron-ucp keeps TP rank 0's and says by how
    much."""
    root, _ = _train(mds_checkout, mds_runs, "tp2")
    tag = tmp_path / "global_step4"
    subprocess.run(["cp", "-a", str(root / "global_step4"), str(tag)], check=True)
    name = "language_model.encoder.layers.0.input_layernorm.weight"
    _perturb(tag, name, "*_mp_rank_01_optim_states.pt")  # TP rank 1's copy, whichever DP rank holds it
    out = tmp_path / "u"
    with caplog.at_level("WARNING"):
        convert(ConvertOptions(source=tag, output=out, progress=False, update_latest=False))
    drift = json.loads((out / "ucp_manifest.json").read_text())["replica_drift"]
    assert drift == [
        {
            "param": name,
            "state": "fp32",
            "copy": 1,
            "differing": 3,
            "numel": 64,
            "max_abs_diff": pytest.approx(0.5, abs=1e-6),
        }
    ]
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
    """A copy restarting from ``tag`` (``latest`` names it, as after a loss spike) without its universal
    twin (the resume converts on demand), ``latest_universal`` still naming the newest twin the
    training converted: the resume must follow ``latest``, not it."""
    subprocess.run(["cp", "-a", str(root), str(dest)], check=True)
    (dest / "latest").write_text(tag)
    subprocess.run(["rm", "-rf", str(dest / f"{tag}_universal")], check=True)
    twins = sorted(
        dest.glob("global_step*_universal"), key=lambda p: int(p.name[len("global_step") : -len("_universal")])
    )
    if twins:
        (dest / "latest_universal").write_text(twins[-1].name)
    return dest


def test_tp1_checkpoint_resumed_at_tp2_continues_the_curve(mds_checkout, mds_runs, tmp_path):
    """TP 1 -> 2, where stock goes wrong: its TP=1 folder says cat_dim 0 for the row-parallel weights."""
    ours, res, full = _resume(mds_checkout, mds_runs, "tp1", tmp_path / "ours", nproc=2, tp=2)
    _assert_continues(res, full, "run: TP changed 1 -> 2")
    manifest = json.loads((ours / "global_step4_universal" / "ucp_manifest.json").read_text())
    dense = "language_model.encoder.layers.0.self_attention.dense.weight"
    assert manifest["params"][dense]["tp_layout"] == "split dim 1"  # recorded at save, TP=1
    assert torch.load(ours / "global_step4_universal" / "zero" / dense / "fp32.pt", weights_only=False)["cat_dim"] == 1

    root, _ = _train(mds_checkout, mds_runs, "tp1")
    stock = _resume_copy(root, tmp_path / "stock")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    # stock's folder: the same shapes, but cat_dim 0 for the row-parallel weight (no pattern at TP=1):
    # a TP=2 load would cut it on the wrong dimension, and every element count would still agree
    assert torch.load(stock / "global_step4_universal" / "zero" / dense / "fp32.pt", weights_only=False)["cat_dim"] == 0
    (stock / "latest_universal").write_text("global_step4_universal")
    silent = run_mds(
        mds_checkout,
        MdsRun(
            nproc=2,
            ckpt=stock,
            tp=2,
            train_iters=6,
            save_interval=2,
            route="plain",
            extra_args=(*SAME_PADDING, "--universal-checkpoint"),
        ),
    )
    # stock loads without a word and trains on: 1e-2 off the curve (the row-parallel weights cut on dim 0)
    assert abs(silent.losses[5] - full.losses[5]) > 20 * abs(res.losses[5] - full.losses[5])
    assert abs(silent.losses[5] - full.losses[5]) > 1e-3


def test_nonpipeline_pp1_resumed_as_pipeline_pp2(mds_checkout, mds_runs, tmp_path):
    """AuroraGPT's GPTModel at PP=1 moves to GPTModelPipe at PP=2: names mapped, every element accounted for."""
    _, res, full = _resume(mds_checkout, mds_runs, "tp1", tmp_path / "ours", nproc=4, pp=2, pipeline=True)
    _assert_continues(res, full, "run: PP changed 1 -> 2", "saved by GPTModel, the model is GPTModelPipe")

    root, _ = _train(mds_checkout, mds_runs, "tp1")
    stock = _resume_copy(root, tmp_path / "stock")
    _stock_convert(stock / "global_step4", stock / "global_step4_universal")
    (stock / "latest_universal").write_text("global_step4_universal")
    failed = run_mds(
        mds_checkout,
        MdsRun(
            nproc=4,
            ckpt=stock,
            pp=2,
            pipeline=True,
            train_iters=6,
            save_interval=2,
            route="plain",
            extra_args=(*SAME_PADDING, "--universal-checkpoint"),
            expect_failure=True,
        ),
    )
    assert (
        failed.returncode != 0 and "No such file or directory" in failed.log and "word_embeddings.weight" in failed.log
    )


@pytest.mark.parametrize("saved, resumed", [("pipe-pp1", False), ("tp1", True)], ids=["pipe-to-gpt", "gpt-to-pipe"])
def test_model_class_changed_at_pp1(mds_checkout, mds_runs, tmp_path, saved, resumed):
    """GPTModelPipe saved, GPTModel resumed, and the other way, both at PP=1 (with DP 4 -> 2)."""
    _, res, full = _resume(mds_checkout, mds_runs, saved, tmp_path / "ours", nproc=2, pipeline=resumed)
    kinds = ("GPTModel", "GPTModelPipe") if resumed else ("GPTModelPipe", "GPTModel")
    _assert_continues(res, full, "DP changed 4 -> 2", "saved by {}, the model is {}".format(*kinds))


def test_tp2_training_converts_in_the_background(mds_checkout, mds_runs):
    root, res = _train(mds_checkout, mds_runs, "tp2")
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6]
    for tag in ("global_step2", "global_step6"):  # step 4 may be skipped: saved while 2 converted, superseded by 6
        manifest = json.loads((root / f"{tag}_universal" / "ucp_manifest.json").read_text())
        assert manifest["parallel"] == {"tp": 2, "pp": 1, "dp": 2, "layouts_recorded": True}
    assert (root / "latest_universal").read_text() == "global_step6_universal"
    # --ucp-export-hf: the converter exported each tag it converted, from its twin, in the background
    rows = {t.tag: t for t in root_status(root).tags}
    for tag in ("global_step2", "global_step6"):
        assert rows[tag].hf_export == "complete", rows[tag]
        marker = json.loads((root / f"{tag}_hf" / "ucp_export.json").read_text())
        assert marker["source"] == str(root.resolve() / f"{tag}_universal") and marker["dtype"] == "bf16"
    assert any("export-hf" in line for line in (root / ".ucp" / "events.log").read_text().splitlines())


HF_LAYOUTS = ("tp1", "tp2", "pp2", "tp2pp2")


def test_hf_exports_compute_the_forks_own_logits_at_every_layout(mds_checkout, mds_runs, tmp_path):
    """ZeRO-1 saves at (TP, PP) = (1, 1) and (2, 1) of ``GPTModel``, (1, 2) and (2, 2) of ``GPTModelPipe``, exported in
    fp32 from the universal folders the background made: each exported ``LlamaForCausalLM``'s logits are the fork's own
    ``GPTModel`` forward's on the same tokens, from the same masters (within 1e-4 relative)."""
    exports = []
    for name in HF_LAYOUTS:
        root, _ = _train(mds_checkout, mds_runs, name)
        options = ExportOptions(source=root, tag="global_step6", output=tmp_path / name, dtype="fp32", progress=False)
        result = export_hf(options)
        assert not result.converted and result.tensors == 2 * 9 + 3, result
        exports.append(result)
    for result, want in zip(exports, fork_logits(mds_checkout, [e.universal for e in exports], tmp_path), strict=True):
        assert_computes(result.output, want)


def test_one_training_state_exports_byte_identical_from_another_layout(mds_checkout, mds_runs, tmp_path):
    """``tp1``'s iteration 6 (TP 1, ``GPTModel``, DP 4) loaded at TP 2 x PP 2 (``GPTModelPipe``, DP 1) through
    the runner and saved again at once (``--train-iters 6``: nothing trained); both export (bf16) to the same bytes."""
    root, _ = _train(mds_checkout, mds_runs, "tp1")
    resaved = tmp_path / "resaved"
    res = run_mds(
        mds_checkout,
        MdsRun(
            nproc=4,
            ckpt=_resume_copy(root, tmp_path / "copy", tag="global_step6"),
            tp=2,
            pp=2,
            pipeline=True,
            train_iters=6,
            save_interval=100,
            extra_args=(*SAME_PADDING, "--save", str(resaved)),
        ),
    )
    assert not res.losses and (resaved / "global_step6").is_dir(), res.ucp_lines()[-10:]
    first = export_hf(ExportOptions(source=root, tag="global_step6", output=tmp_path / "tp1", progress=False))
    again = export_hf(ExportOptions(source=resaved, output=tmp_path / "tp2pp2", progress=False))
    assert again.converted and not same_files(first.output, again.output)


@pytest.mark.parametrize("optimizer", ["bf16", "zero"])
def test_pp2_hooked_converted_in_the_background_and_resumed_at_dp1(mds_checkout, mds_runs, tmp_path, optimizer):
    """The issue-19 flow, on every DeepSpeed release the fork imports: GPTModelPipe at (1, 2, 2) saved
    through the runner with background conversion (each stage's save records its own layers' TP
    layout), resumed at (1, 2, 1) through the runner with no flag."""
    name = "pp2" if optimizer == "bf16" else "pp2-zero"
    root, trained = _train(mds_checkout, mds_runs, name)
    assert sorted(trained.losses) == [1, 2, 3, 4, 5, 6]
    for tag in ("global_step2", "global_step6"):
        twin = root / f"{tag}_universal"
        assert json.loads((twin / "ucp_manifest.json").read_text())["parallel"]["layouts_recorded"] is True
        report = verify_universal(twin, source=root / tag)
        assert report.ok, report.problems[:5]
    _, res, full = _resume(mds_checkout, mds_runs, name, tmp_path / "ckpt", nproc=2, pp=2, pipeline=True)
    _assert_continues(
        res,
        full,
        "DP changed 2 -> 1: resharding global_step4 from its native rank files",
        "megatron-ucp native reshard:",
        optimizer=optimizer,
    )


def test_pipeline_pp2_resumed_as_pipeline_pp1(mds_checkout, mds_runs, tmp_path):
    """(1, 2, 2) -> (1, 1, 4), GPTModelPipe on both sides: a PP 2 -> 1 move (the universal flag added by
    the runner, the twin of `latest`'s tag loaded although latest_universal names a newer one)."""
    _, res, full = _resume(mds_checkout, mds_runs, "pp2", tmp_path / "ckpt", nproc=4, pipeline=True)
    _assert_continues(res, full, "PP changed 2 -> 1, DP changed 2 -> 4", "latest_universal names global_step6")


def test_pipeline_tp2_pp2_resumed_as_nonpipeline_tp2_pp1(mds_checkout, mds_runs, tmp_path):
    """(2, 2, 1) GPTModelPipe -> (2, 1, 2) GPTModel: PP 2 -> 1 and back to AuroraGPT's model class, TP kept."""
    _, res, full = _resume(mds_checkout, mds_runs, "tp2pp2", tmp_path / "ckpt", nproc=4, tp=2)
    _assert_continues(
        res, full, "run: PP changed 2 -> 1, DP changed 1 -> 2", "saved by GPTModelPipe, the model is GPTModel"
    )


def test_tp_and_pp_changed_in_one_resume(mds_checkout, mds_runs, tmp_path):
    """(2, 2, 1) GPTModelPipe -> (1, 1, 4) GPTModel: AuroraGPT's layout from a 3D checkpoint."""
    _, res, full = _resume(mds_checkout, mds_runs, "tp2pp2", tmp_path / "ckpt", nproc=4)
    _assert_continues(
        res,
        full,
        "run: TP changed 2 -> 1, PP changed 2 -> 1, DP changed 1 -> 4",
        "saved by GPTModelPipe, the model is GPTModel",
    )


TIED = "tied_modules.embed.word_embeddings.weight"


def test_tied_embeddings_across_pipeline_stages(mds_checkout, mds_runs, tmp_path, caplog):
    """Both stages hold the tied embedding: one parameter in the universal folder, a drift between the
    stages' copies reported with numbers, and both stages load it back (counted once per stage)."""
    root, _ = _train(mds_checkout, mds_runs, "tied-pp2")
    twin = root / "global_step6_universal"
    manifest = json.loads((twin / "ucp_manifest.json").read_text())
    assert [n for n in manifest["params"] if "word_embeddings" in n] == [TIED] and "replica_drift" not in manifest

    tag = tmp_path / "global_step4"
    subprocess.run(["cp", "-a", str(root / "global_step4"), str(tag)], check=True)
    _perturb(tag, TIED, "*_mp_rank_01_optim_states.pt", amount=0.25)  # the last stage's copy
    with caplog.at_level("WARNING"):
        convert(ConvertOptions(source=tag, output=tmp_path / "u", progress=False, update_latest=False))
    drift = json.loads((tmp_path / "u" / "ucp_manifest.json").read_text())["replica_drift"]
    assert [(d["param"], d["state"], d["differing"]) for d in drift] == [(TIED, "fp32", 3)]
    assert drift[0]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)

    ckpt, res, full = _resume(
        mds_checkout,
        mds_runs,
        "tied-pp2",
        tmp_path / "ckpt",
        nproc=2,
        pp=2,
        pipeline=True,
        extra_args=(*SAME_PADDING, "--ucp-resume-route", "universal"),
    )
    _assert_continues(res, full, "DP changed 2 -> 1")
    loaded = json.loads((ckpt / "global_step4_universal" / "ucp_manifest.json").read_text())["params"]
    once_each = sum(math.prod(p["source_shape"]) for p in loaded.values())
    states = 3  # fp32, exp_avg, exp_avg_sq
    assert _placed_elements(res) == states * (once_each + math.prod(loaded[TIED]["source_shape"]))


def test_pipeline_pp2_restart_reads_each_layer_file_once_per_dp_group(mds_checkout, mds_runs, tmp_path):
    """GPTModelPipe at (TP 1, PP 2, DP 2) restarted at the same layout through the runner, every rank
    loading its own evicted copy (tests/support/site): each rank reads about half (1/DP) of the layer
    files its stage loads (its range of the saved weights, the exactness check) and the pickles, not the
    whole stage as DeepSpeed's pipeline load does; the losses continue."""
    from tests.support.page_cache import evict, resident_bytes

    root, full = _train(mds_checkout, mds_runs, "pp2")
    base = tmp_path / "ckpt"
    for r in range(4):
        evict(_resume_copy(root, base.with_name(f"{base.name}.rank{r}")))
    res = run_mds(
        mds_checkout,
        MdsRun(
            nproc=4,
            ckpt=base,
            pp=2,
            pipeline=True,
            train_iters=6,
            save_interval=100,
            model=MdsModel(untied=True),
            extra_args=SAME_PADDING,
            env={"UCP_TEST_PRIVATE_LOAD": "1"},
        ),
    )
    page = 4096
    for r in range(4):
        tag = base.with_name(f"{base.name}.rank{r}") / "global_step4"
        layers = {p: resident_bytes(p) for p in tag.glob("layer_*-model_states.pt")}
        touched = {p: n for p, n in layers.items() if n}
        assert touched, (r, layers)
        size = sum(p.stat().st_size for p in touched)
        assert sum(touched.values()) <= size / 2 + 16 * page * len(touched), (r, touched, size)
    lines = res.ucp_lines()
    assert any("rebuilt from the masters (one all-gather), proven equal" in line for line in lines), lines
    for it in (5, 6):
        assert abs(res.losses[it] - full.losses[it]) < 2e-4, (it, res.losses, full.losses)


def test_a_tag_damaged_in_one_tp_coordinate_falls_back_on_every_rank(mds_checkout, mds_runs, tmp_path):
    """TP=2, DP 2 -> 1, no flag: global_step6 has one bit flipped in a rank file of TP coordinate 1. Only that
    coordinate's DP group reads it, and only its load's checksums refuse the tag; the other coordinate's load
    passes. Every rank must learn it (one all-reduce after each load), fall back to global_step4 together and
    continue the curve at 5 and 6 (without the agreement the two coordinates would train on different tags, or
    wait for each other until the collective timeout). The load that passes is BF16_Optimizer's DP 2 -> 1 at TP 2
    straight from the native files, no conversion."""
    from tests.support.elastic_support import fallback_announcements, flip_a_bit_in_the_largest_record

    root, full = _train(mds_checkout, mds_runs, "tp2")
    ckpt = _resume_copy(root, tmp_path / "ckpt", tag="global_step6")
    victim = ckpt / "global_step6" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    flip_a_bit_in_the_largest_record(victim)
    res = run_mds(
        mds_checkout,
        MdsRun(nproc=2, ckpt=ckpt, tp=2, train_iters=6, save_interval=100, extra_args=SAME_PADDING),
    )
    (said,) = fallback_announcements(res.log)
    assert "names global_step6, which cannot be resumed" in said and str(victim) in said, said
    assert "checksum mismatch" in said, said
    assert "failed on 1 rank(s) (global rank 1)" in said, said  # the other coordinate had passed
    assert "loading global_step4 instead (loses 2 iterations)" in said, said
    _assert_resharded_at_dp1(res, full)
