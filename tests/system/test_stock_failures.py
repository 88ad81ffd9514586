"""The two stock DeepSpeed failures that megatron-ucp fixes, reproduced with real DeepSpeed.

These tests document upstream bugs (docs/how-it-works.md); they pass
while stock DeepSpeed still fails. Nothing of megatron-ucp is installed here.

The tiny model's no-weight-decay group is 3 norm weights of 3 elements: N = 9. At DP=4 the
alignment is 8, the padded length 16, the partition 4: rank 2 holds 1 real element, rank 3 none,
and the recorded padding 7 (BF16_Optimizer, and ZeRO before 0.16.4, put it all on the last rank)
exceeds the partition.

1. ``ds_to_universal`` dies with ``narrow(): length must be non-negative`` when a rank's recorded
   padding exceeds its partition: BF16_Optimizer checkpoints (0.19.8 and 0.16.2) and ZeRO
   checkpoints of 0.16.2. A 0.19.8 DeepSpeedZeroOptimizer checkpoint (per-rank padding) converts.
2. Loading a universal checkpoint (``"checkpoint": {"load_universal": true}``) at a DP size where
   some rank's partition of a group is all padding dies with ``IndexError: list index out of range``
   in ``load_hp_checkpoint_state_from_checkpoint_dir`` (its list of per-fragment steps is empty).
   At a DP size without such a rank (DP=2 here) the same universal checkpoint loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.dsharness import TrainSpec, run_training
from tests.support.dsharness.checkpoints import Geometry, group_numels
from tests.support.dsharness.stock import StockRun, stock_ds_to_universal

pytestmark = pytest.mark.slow

NARROW = "narrow(): length must be non-negative"


def test_geometry_of_the_reproduction() -> None:
    wd, no_wd = group_numels()
    assert no_wd == 9
    g4 = Geometry(no_wd, 4)
    assert (g4.padded, g4.partition, g4.padded - no_wd) == (16, 4, 7)
    assert g4.all_padding_ranks == [3] and g4.true_length(2) == 1
    assert Geometry(no_wd, 2).all_padding_ranks == []
    assert Geometry(wd, 4).all_padding_ranks == []


def _assert_narrow_crash(run: StockRun, root: Path) -> None:
    assert run.returncode != 0, run.log[-3000:]
    assert NARROW in run.log, run.log[-3000:]
    assert "_strip_tensor_paddings" in run.log, run.log[-3000:]
    assert not (root / "latest_universal").exists()


def test_ds_to_universal_crashes_on_bf16_optimizer_0_19_8(ds_checkpoint, tmp_path: Path) -> None:
    ck = ds_checkpoint("bf16", 4)
    assert ck.result.optimizer_class == "BF16_Optimizer"
    root = ck.copy_to(tmp_path / "ckpt")
    run = stock_ds_to_universal(root / "global_step2", root / "global_step2_universal")
    _assert_narrow_crash(run, root)


@pytest.mark.parametrize("name", ["bf16_optimizer", "zero_optimizer"])
def test_ds_to_universal_crashes_on_legacy_0_16_2(legacy_fixture, name: str, tmp_path: Path) -> None:
    fx = legacy_fixture(name)
    root = fx.copy_to(tmp_path / name)
    tag = fx.tag_dir.name
    run = stock_ds_to_universal(root / tag, root / f"{tag}_universal")
    _assert_narrow_crash(run, root)


@pytest.fixture(scope="module")
def stock_universal_zero(ds_checkpoint, tmp_path_factory):
    """0.19.8 DeepSpeedZeroOptimizer DP=4 checkpoint, converted by stock ds_to_universal at step 2."""
    ck = ds_checkpoint("zero", 4)
    root = ck.copy_to(tmp_path_factory.mktemp("stock_universal") / "ckpt")
    run = stock_ds_to_universal(root / "global_step2", root / "global_step2_universal")
    return ck, root, run


def test_ds_to_universal_converts_zero_optimizer_0_19_8(stock_universal_zero) -> None:
    ck, root, run = stock_universal_zero
    assert ck.result.optimizer_class == "DeepSpeedZeroOptimizer"
    assert run.ok, run.log[-3000:]
    assert (root / "latest_universal").read_text().strip() == "global_step2_universal"
    for name in ck.result.info["group_names"][1]:
        assert (root / "global_step2_universal" / "zero" / name / "fp32.pt").is_file()


def test_universal_load_crashes_on_all_padding_rank(stock_universal_zero, tmp_path: Path) -> None:
    ck, root, run = stock_universal_zero
    assert run.ok, run.log[-3000:]
    res = run_training(
        TrainSpec(dp=4, optimizer="zero", steps=3, load_dir=root, load_universal=True, expect_failure=True, timeout=240)
    )
    assert res.returncode != 0
    assert "IndexError: list index out of range" in res.log, res.log[-4000:]
    assert "load_hp_checkpoint_state_from_checkpoint_dir" in res.log
    assert res.losses == []


def test_universal_load_works_without_all_padding_rank(stock_universal_zero, tmp_path: Path) -> None:
    """DP=4 -> DP=2 through stock DeepSpeed: state restored bit for bit, loss curve continues."""
    ck, root, run = stock_universal_zero
    assert run.ok, run.log[-3000:]
    res = run_training(
        TrainSpec(
            dp=2,
            optimizer="zero",
            steps=4,
            load_dir=root,
            load_universal=True,
            dump_dir=tmp_path / "dumps",
            timeout=240,
        )
    )
    assert res.loaded_step == 2 and res.steps == [3, 4]
    saved = torch.load(ck.dump("state_step2"))
    loaded = torch.load(res.dumps["state_step2_loaded"])
    assert saved.keys() == loaded.keys()
    for name, states in saved.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(states[key], loaded[name][key]), f"{name}/{key}"
    for step, loss in zip(res.steps, res.losses, strict=True):
        assert loss == pytest.approx(ck.loss_at(step), abs=1e-3)
