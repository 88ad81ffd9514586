"""``megatron-ucp convert`` on real DeepSpeed checkpoints (4 processes, CPU, gloo), both optimizer classes.

The oracle is independent of our plan: the harness dumps every parameter's full fp32 master and
optimizer states gathered by DeepSpeed itself (safe_get_full_fp32_param / safe_get_full_optimizer_state)
at save time; each universal tensor must equal it bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import read_manifest
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.deepspeed.reader import RankFile, find_checkpoint_files
from megatron_ucp.format import dsformat as F

pytestmark = pytest.mark.slow


def assert_matches_dump(universal: Path, dump: dict, vocab_rows: dict | None = None) -> int:
    """Every tensor of the universal folder equals DeepSpeed's own gathered value; returns tensors checked."""
    checked = 0
    for name, states in dump.items():
        folder = universal / F.UNIVERSAL_ZERO_DIR / name
        for state, value in states.items():
            got = torch.load(folder / f"{state}.pt", weights_only=False)
            if state == F.STEP_STATE:
                assert float(got) == float(value), (name, state)
                continue
            tensor = got[F.PARAM]
            want = value
            if vocab_rows and name in vocab_rows:
                want = value[: vocab_rows[name]]
                assert got.get(F.VOCAB_TENSOR) is True
                # nothing lost: the padded rows sit beside the trimmed tensor, bit for bit
                rows = got[F.VOCAB_PADDED_ROWS]
                assert rows.dtype == value.dtype and torch.equal(rows, value[vocab_rows[name] :]), (name, state)
            else:
                assert F.VOCAB_PADDED_ROWS not in got
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, (name, state)
            assert torch.equal(tensor, want), (name, state)
            checked += 1
    return checked


@pytest.mark.parametrize("optimizer", ["bf16", "zero"])
def test_convert_is_bit_exact_against_deepspeed_gathered_state(optimizer, tmp_path, ds_checkpoint):
    ck = ds_checkpoint(optimizer=optimizer, dp=4)
    root = ck.copy_to(tmp_path / "ck")
    result = convert(ConvertOptions(source=root, progress=False))
    assert result.committed and result.output == root / "global_step4_universal"
    assert (root / F.LATEST_UNIVERSAL).read_text() == "global_step4_universal"
    dump = torch.load(ck.dump("state_step4"), weights_only=False)
    n = assert_matches_dump(result.output, dump)
    assert n == sum(len(s) - 1 for s in dump.values())  # every state but step of every param
    manifest = read_manifest(result.output)
    assert manifest["source"]["dp"] == 4 and set(manifest["params"]) == set(dump)
    assert verify_universal(result.output, source=root).ok
    assert not list(root.glob(".*ucp-staging"))


def test_vocabulary_rows_are_trimmed_and_padded_rows_kept_when_megatron_info_present(tmp_path, ds_checkpoint):
    ck = ds_checkpoint(optimizer="bf16", dp=4, uc_info=True)
    root = ck.copy_to(tmp_path / "ck")
    result = convert(ConvertOptions(source=root, progress=False))
    dump = torch.load(ck.dump("state_step4"), weights_only=False)
    info = torch.load(root / "global_step4" / F.MODEL_STATES_FILE, weights_only=False)[F.UNIVERSAL_CHECKPOINT_INFO]
    import re

    vocab_params = {
        n: info[F.ORIGINAL_VOCAB_SIZE]
        for n in dump
        if any(re.match(p, n) for p in info[F.VOCABULARY_PARAMETER_PATTERNS])
    }
    assert vocab_params, "harness model should expose a vocabulary parameter"
    assert_matches_dump(result.output, dump, vocab_rows=vocab_params)
    assert verify_universal(result.output, source=root).ok


def test_identical_to_stock_converter_where_stock_works(tmp_path, ds_checkpoint):
    """DeepSpeedZeroOptimizer 0.19.8 files have correct per-rank paddings: stock converts them; we match it."""
    root = ds_checkpoint(optimizer="zero", dp=4).copy_to(tmp_path / "ck")
    ours = convert(ConvertOptions(source=root, progress=False)).output
    stock = tmp_path / "stock"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(root / "global_step4"),
            "--output_folder",
            str(stock),
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for folder in sorted((stock / "zero").iterdir()):
        if folder.is_file():
            continue
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            p.name for p in (ours / "zero" / folder.name).iterdir()
        )
        for f in folder.iterdir():
            a = torch.load(f, weights_only=False)
            b = torch.load(ours / "zero" / folder.name / f.name, weights_only=False)
            if isinstance(a, dict):
                assert a.keys() == b.keys() and torch.equal(a[F.PARAM], b[F.PARAM]), f
            else:
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), f
    a = torch.load(stock / "zero" / F.UNIVERSAL_OPTIMIZER_STATE_FILE, weights_only=False)
    b = torch.load(ours / "zero" / F.UNIVERSAL_OPTIMIZER_STATE_FILE, weights_only=False)
    assert sorted(a) == sorted(b) and a[F.PARAM_GROUPS] == b[F.PARAM_GROUPS]
    assert a[F.GROUP_PADDINGS] == b[F.GROUP_PADDINGS]
    for key in a:  # DeepSpeed objects (loss scaler, stage enum) must come back as DeepSpeed's own classes
        assert type(a[key]) is type(b[key]), (key, type(a[key]), type(b[key]))
        assert type(a[key]).__module__.split(".")[0] != "megatron_ucp", key
    assert vars(a["loss_scaler"]) == vars(b["loss_scaler"])


def test_workers_and_shares_give_the_same_bytes(tmp_path, ds_checkpoint):
    root = ds_checkpoint(optimizer="bf16", dp=4).copy_to(tmp_path / "ck")
    single = convert(ConvertOptions(source=root, output=tmp_path / "single", progress=False)).output
    multi = convert(ConvertOptions(source=root, output=tmp_path / "multi", workers=2, progress=False)).output
    first = convert(
        ConvertOptions(
            source=root, output=tmp_path / "shared", share_index=1, share_count=2, attempt_id="job-1", progress=False
        )
    )
    assert not first.committed and not (tmp_path / "shared").exists()
    second = convert(
        ConvertOptions(
            source=root, output=tmp_path / "shared", share_index=0, share_count=2, attempt_id="job-1", progress=False
        )
    )
    assert second.committed and first.params + second.params == len(read_manifest(single)["params"])
    for other in (multi, tmp_path / "shared"):
        for f in sorted((single / "zero").rglob("*.pt")):
            rel = f.relative_to(single)
            a, b = torch.load(f, weights_only=False), torch.load(other / rel, weights_only=False)
            if f.name == F.UNIVERSAL_OPTIMIZER_STATE_FILE:
                assert a[F.PARAM_GROUPS] == b[F.PARAM_GROUPS]
            elif isinstance(a, dict):
                assert a.keys() == b.keys() and torch.equal(a[F.PARAM], b[F.PARAM]), rel
            else:
                assert float(a) == float(b), rel
        assert verify_universal(other, source=root).ok


def test_save_hook_records_true_lengths_and_stock_converter_then_works(tmp_path, ds_checkpoint):
    """With megatron_ucp installed at save time, BF16_Optimizer files carry per-rank paddings and true lengths."""
    root = ds_checkpoint(optimizer="bf16", dp=4, plugin=True).copy_to(tmp_path / "ck")
    files = find_checkpoint_files(root / "global_step4")
    norms = []
    for r, path in enumerate(files.rank_files):
        sd = RankFile(path, r).sd
        info = sd[F.ZERO_PARTITION_INFO]
        assert info["dp_size"] == 4 and info["dp_rank"] == r and info["alignment"] == 8
        assert info["group_numels"][1] == 9 and info["partition_sizes"][1] == 4
        norms.append((sd[F.GROUP_TRUE_LENGTHS][1], sd[F.GROUP_PADDINGS][1]))
    assert norms == [(4, 0), (4, 0), (1, 3), (0, 4)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(root / "global_step4"),
            "--output_folder",
            str(tmp_path / "stock"),
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = convert(ConvertOptions(source=root, progress=False))
    assert verify_universal(ours.output, source=root).ok


def test_stock_loader_reads_our_output(tmp_path, ds_checkpoint):
    """Round trip through stock DeepSpeed: its own load_universal (no plugin) at a DP where it works (2)."""
    from tests.support.dsharness import TrainSpec, run_training

    ck = ds_checkpoint(optimizer="bf16", dp=4)
    root = ck.copy_to(tmp_path / "ck")
    convert(ConvertOptions(source=root, progress=False))
    dumps = tmp_path / "dumps"
    run_training(TrainSpec(dp=2, optimizer="bf16", steps=4, load_dir=root, load_universal=True, dump_dir=dumps))
    loaded = torch.load(dumps / "state_step4_loaded.pt", weights_only=False)
    source = torch.load(ck.dump("state_step4"), weights_only=False)
    assert loaded.keys() == source.keys()
    for name in source:
        for state, value in source[name].items():
            if state == F.STEP_STATE:
                assert float(loaded[name][state]) == float(value)
            else:
                assert torch.equal(loaded[name][state], value), (name, state)


@pytest.mark.parametrize("optimizer", ["bf16_optimizer", "zero_optimizer"])
def test_legacy_deepspeed_0_16_2_checkpoints(optimizer, tmp_path, legacy_fixture):
    fixture = legacy_fixture(optimizer)
    root = fixture.copy_to(tmp_path / "ck")
    result = convert(ConvertOptions(source=root, progress=False))
    assert result.committed and result.source_dp == 4
    info = torch.load(fixture.tag_dir / F.MODEL_STATES_FILE, weights_only=False).get(F.UNIVERSAL_CHECKPOINT_INFO)
    reference = torch.load(fixture.reference, weights_only=False)
    vocab = {}
    if info:  # Megatron-style info in the fixture: vocabulary rows are trimmed, as stock does
        import re

        vocab = {
            n: info[F.ORIGINAL_VOCAB_SIZE]
            for n in reference
            if any(re.match(p, n) for p in info[F.VOCABULARY_PARAMETER_PATTERNS])
        }
        assert vocab
    assert_matches_dump(result.output, reference, vocab_rows=vocab)
    assert verify_universal(result.output, source=root).ok


def test_converting_an_older_tag_keeps_latest_universal_on_the_newer(tmp_path, ds_checkpoint):
    root = ds_checkpoint(optimizer="bf16", dp=4).copy_to(tmp_path / "ck")
    convert(ConvertOptions(source=root, progress=False))  # latest: global_step4
    older = convert(ConvertOptions(source=root, tag="global_step2", progress=False))
    assert older.committed and older.output == root / "global_step2_universal"
    assert (root / F.LATEST_UNIVERSAL).read_text() == "global_step4_universal"
    assert verify_universal(older.output, source=root / "global_step2").ok
