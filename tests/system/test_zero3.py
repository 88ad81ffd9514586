"""ZeRO-3 checkpoints from real DeepSpeed runs (4 processes, CPU, gloo): read, inspect, verify, convert.

The oracle is independent of our geometry: the harness dumps every parameter's full fp32 master and
optimizer states as DeepSpeed's own ZeRO-3 gather returns them (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``, its ``_z3_optimizer`` bookkeeping) at save time. The run cuts its
param groups into sub-groups (``sub_group_size`` 50): three sub-groups, and small parameters whose
slice on rank 3 is all padding. Stock DeepSpeed's stage-3 converter and loader (the installed
release) are run unmodified beside ours.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.inspection import format_report, inspect_checkpoint
from megatron_ucp.convert.universal import read_manifest
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.param_geometry import sub_groups
from tests.support.dsharness import TrainSpec, param_group_names, run_training
from tests.support.dsharness.checkpoints import rank_file
from tests.support.dsharness.model import build_model
from tests.support.dsharness.stock import stock_ds_to_universal

pytestmark = pytest.mark.slow

SUB_GROUP_SIZE = 50
ZERO3 = dict(optimizer="zero", dp=4, zero_stage=3, uc_info=True)
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def zero3(ds_checkpoint):
    return ds_checkpoint(**ZERO3, extra_config={"zero_optimization": {"sub_group_size": SUB_GROUP_SIZE}})


@pytest.fixture(scope="module")
def converted(zero3, tmp_path_factory):
    """A private copy of the save, its step-2 tag converted by megatron-ucp."""
    root = zero3.copy_to(tmp_path_factory.mktemp("zero3") / "ck")
    result = convert(ConvertOptions(source=root, tag="global_step2", progress=False))
    assert result.committed
    return root, result.output


def _param(folder: Path, name: str, state: str) -> torch.Tensor:
    got = torch.load(folder / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)
    return got[F.PARAM] if isinstance(got, dict) else got


def test_universal_folder_equals_deepspeeds_own_gather(zero3, converted):
    root, out = converted
    dump = torch.load(zero3.dump("state_step2"), weights_only=False)
    assert {e["sub_group"] for e in dump.values()} == {0, 1, 2}
    for name, entry in dump.items():
        for state in STATES:
            got = _param(out, name, state)
            assert got.dtype == entry[state].dtype and got.shape == entry[state].shape, (name, state)
            assert torch.equal(got, entry[state]), (name, state)
        step = torch.load(out / F.UNIVERSAL_ZERO_DIR / name / "step.pt", weights_only=False)
        assert float(step) == float(entry["step"]) == 2.0
    manifest = read_manifest(out)
    assert manifest["source"]["zero_stage"] == 3 and len(manifest["groups"]) == 3
    # the vocabulary parameter stays whole: stock's stage-3 loader partitions what it finds
    assert manifest["params"]["language_model.embedding.word_embeddings.weight"]["shape"] == [64, 3]
    assert sorted(p.name for p in out.glob("*_model_states.pt")) == [F.zero3_model_file(r, 0) for r in range(4)]
    report = verify_universal(out, source=root / "global_step2")
    assert report.ok and report.checksummed == 3 * len(dump), report.problems[:3]


def test_sub_groups_are_cut_as_deepspeed_cuts_them(zero3):
    """The pure rule (``sub_groups``) against the sub-groups the real run built."""
    dump = torch.load(zero3.dump("state_step2"), weights_only=False)
    model = build_model()
    shapes = dict(model.named_parameters())
    expected, first = {}, 0
    for names in param_group_names(model):
        for members in sub_groups([shapes[n].numel() for n in names], 4, SUB_GROUP_SIZE):
            expected.update({names[i]: first for i in members})
            first += 1
    assert {n: e["sub_group"] for n, e in dump.items()} == expected


def test_stock_converter_of_this_release_writes_the_same_tensors(zero3, converted, tmp_path):
    _, ours = converted
    tag = zero3.copy_to(tmp_path / "ck") / "global_step2"
    stock = stock_ds_to_universal(tag, tmp_path / "stock")
    assert stock.ok, stock.log[-2000:]
    names = sorted(p.name for p in (stock.output / F.UNIVERSAL_ZERO_DIR).iterdir() if p.is_dir())
    assert names == sorted(p.name for p in (ours / F.UNIVERSAL_ZERO_DIR).iterdir() if p.is_dir())
    for name in names:
        for state in STATES:
            a, b = _param(stock.output, name, state), _param(ours, name, state)
            assert torch.equal(a.reshape(-1), b.reshape(-1)), (name, state)


def test_stock_stage3_loader_resumes_our_folder_at_dp3(zero3, converted, tmp_path):
    """DeepSpeed's own stage-3 universal load, at a new DP size, gets back every saved element."""
    root, _ = converted
    dumps = tmp_path / "dumps"
    extra = {"zero_optimization": {"sub_group_size": SUB_GROUP_SIZE}}
    res = run_training(
        TrainSpec(
            dp=3,
            optimizer="zero",
            zero_stage=3,
            steps=3,
            uc_info=True,
            load_dir=root,
            load_universal=True,
            dump_dir=dumps,
            extra_config=extra,
        )
    )
    assert res.loaded_step == 2
    saved = torch.load(zero3.dump("state_step2"), weights_only=False)
    loaded = torch.load(dumps / "state_step2_loaded.pt", weights_only=False)
    for name in saved:
        for state in STATES:
            assert torch.equal(saved[name][state], loaded[name][state]), (name, state)
    # the loss of step 3 depends only on the loaded weights: the uninterrupted curve, to reduction noise
    assert abs(res.loss_at(3) - zero3.loss_at(3)) < 2e-4


def test_inspect_describes_per_parameter_partitions(converted):
    root, _ = converted
    report = inspect_checkpoint(root, "global_step2", [])
    assert report.zero_stage == 3 and report.optimizer == "DeepSpeedZeroOptimizer_Stage3"
    assert [g["params"] for g in report.sub_groups] == [2, 4, 3]
    assert report.sub_groups[2]["padding_only_example"]["ranks"] == [3]
    text = format_report(report)
    assert "per parameter" in text and "sub-group 2: N=9, 3 params; partition 3 per rank" in text
    assert report.stock_stage3 == []  # the installed release strips padding and reads every sub-group


def _tag_copy(zero3, tmp_path: Path) -> Path:
    return zero3.copy_to(tmp_path / "ck") / "global_step2"


def _refused(tag: Path, tmp_path: Path) -> CheckpointFormatError:
    with pytest.raises(CheckpointFormatError) as err:
        convert(ConvertOptions(source=tag, output=tmp_path / "out", progress=False))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    return err.value


def test_missing_model_states_or_optimizer_file_is_named(zero3, tmp_path):
    tag = _tag_copy(zero3, tmp_path)
    (tag / F.zero3_model_file(2, 0)).unlink()
    assert "zero_pp_rank_2_mp_rank_00_model_states.pt is missing" in str(_refused(tag, tmp_path))
    tag = zero3.copy_to(tmp_path / "ck2") / "global_step2"
    rank_file(tag, 1).unlink()
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in str(_refused(tag, tmp_path))


def test_files_of_two_stages_in_one_tag_are_named(zero3, ds_checkpoint, tmp_path):
    stage1 = ds_checkpoint(optimizer="bf16", dp=4)
    tag = _tag_copy(zero3, tmp_path)
    shutil.copy(stage1.tag_dir(2) / F.MODEL_STATES_FILE, tag / F.MODEL_STATES_FILE)
    assert "files of two ZeRO stages in one tag" in str(_refused(tag, tmp_path))
    tag = zero3.copy_to(tmp_path / "ck2") / "global_step2"
    shutil.copy(rank_file(stage1.tag_dir(2), 3), rank_file(tag, 3))
    message = str(_refused(tag, tmp_path))
    assert message.startswith(str(rank_file(tag, 3))) and "files of two ZeRO stages mixed" in message


def test_optimizer_file_of_another_save_is_named(zero3, tmp_path):
    """Rank 1's file of the step-4 save in the step-2 tag: same geometry, another step."""
    tag = _tag_copy(zero3, tmp_path)
    shutil.copy(rank_file(tag.parent / "global_step4", 1), rank_file(tag, 1))
    message = str(_refused(tag, tmp_path))
    assert message.startswith(str(rank_file(tag, 1))) and "differs from rank 0's" in message


def test_sub_group_count_that_differs_between_ranks_is_named(zero3, ds_checkpoint, tmp_path):
    """Rank 2's file from a save of the same model and DP with one sub-group per param group."""
    whole = ds_checkpoint(**ZERO3)
    tag = _tag_copy(zero3, tmp_path)
    shutil.copy(rank_file(whole.tag_dir(2), 2), rank_file(tag, 2))
    message = str(_refused(tag, tmp_path))
    assert (
        message.startswith(str(rank_file(tag, 2))) and "has 2 optimizer sub-groups, the model states list 3" in message
    )
