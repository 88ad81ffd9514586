"""What must hold on every DeepSpeed release megatron-ucp supports (run by the Makefile's matrix).

* ``versions.INTERNALS`` tells the truth about the installed release (the one place that says
  how releases differ is checked against each of them, not just written down), and every internal
  ``deepspeed.surface.SURFACE`` lists resolves on it; installing replaces only what that table marks
  replaced, and a missing entry stops the install naming it;
* the save hook records per-rank true lengths, partition info and corrected paddings with this
  release's optimizers (both classes, ZeRO stages 1 and 2), and the converter turns the result
  into a universal folder equal, bit for bit, to DeepSpeed's own gathered states.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.deepspeed.reader import RankFile, find_checkpoint_files
from megatron_ucp.deepspeed.versions import HOOKS_TESTED_DEEPSPEED, installed_deepspeed_version, internals
from megatron_ucp.format import dsformat as F


def test_installed_release_is_a_tested_one_and_its_internals_are_as_recorded():
    from deepspeed.runtime.engine import DeepSpeedEngine

    version = installed_deepspeed_version()
    assert version in HOOKS_TESTED_DEEPSPEED, f"the matrix runs an untested DeepSpeed {version}"
    facts = internals(version)
    assert hasattr(DeepSpeedEngine, "_commit_decoupled_checkpoint") == facts.decoupled_commit
    assert (importlib.util.find_spec("deepspeed.compression.compress") is not None) == facts.ships_compression
    from deepspeed.runtime import constants

    # DDP_BFLOAT16 appeared in 0.17; there it equals BFLOAT16, which sends bf16 + ZeRO-1 to FP16_UnfusedOptimizer
    assert (getattr(constants, "DDP_BFLOAT16", None) != constants.BFLOAT16) == facts.bf16_optimizer_selected
    import inspect

    moe_save = inspect.getsource(DeepSpeedEngine._save_moe_checkpoint)
    assert ("dict(universal_checkpoint_info)" not in moe_save) == facts.saves_fork_moe


def test_the_surface_table_resolves_and_install_replaces_only_what_it_lists(monkeypatch):
    import megatron_ucp
    from megatron_ucp.deepspeed import surface
    from megatron_ucp.errors import UnsupportedError

    assert surface.check_surface() >= 26
    replaced = {(e.owner, e.name) for e in surface.SURFACE if e.use is surface.Use.REPLACE and e.when(internals())}
    megatron_ucp.uninstall()
    try:
        megatron_ucp.install(async_convert=True, async_save=True)  # every hook module
        patched = {
            (e.owner, e.name)
            for e in surface.SURFACE
            if hasattr(getattr(surface.resolve(e.owner), e.name, None), "__megatron_ucp_original__")
        }
    finally:
        megatron_ucp.uninstall()
    # replaced for one load only (surface.scoped_replace), never by the install
    per_load = {
        (surface.SD_LOADERS, "get_sd_loader"),
        (surface.ENGINE, "load_module_state_dict"),
        (surface.ENGINE, "_load_zero_checkpoint"),  # ZeRO-3's optimizer load
    }
    assert patched == replaced - per_load, patched ^ replaced
    gone = surface.Internal(surface.ENGINE, "_no_such_internal", surface.Use.CALL, "a test's missing internal")
    monkeypatch.setattr(surface, "SURFACE", (*surface.SURFACE, gone))
    with pytest.raises(UnsupportedError, match=r"DeepSpeedEngine\._no_such_internal \(a test's missing internal\)"):
        megatron_ucp.install()
    assert megatron_ucp.active_config() is None and not hasattr(
        surface.resolve(surface.ENGINE).load_checkpoint, "__megatron_ucp_original__"
    )


# Norm group of the harness model: N=9 elements. At DP=4 (S=4) rank 3 holds only padding; at DP=2
# (S=6) none does. (true length, per-rank padding) of each rank:
NORMS = {4: [(4, 0), (4, 0), (1, 3), (0, 4)], 2: [(6, 0), (3, 3)]}


STOCK_CANNOT_TRAIN = {
    ("0.17", "bf16"): ("FP16_UnfusedOptimizer", "bf16 + ZeRO-1 + fp32 accumulation never builds BF16_Optimizer"),
    ("0.17", "zero", 4): ("IndexError", "DeepSpeedZeroOptimizer dies on a rank whose partition is all padding"),
    ("0.18", "zero", "torch>=2.13"): (
        "Output 0 of Split is a view",
        "DeepSpeedZeroOptimizer's step breaks on torch 2.13",
    ),
}
"""What stock DeepSpeed alone cannot train, by release line (seen in its runs: the first test below shows each), kept
here apart from ``versions.INTERNALS`` so that what the suite skips is decided by the environment, not by the code
under test, and the table is checked against it."""


def _stock_failure(optimizer: str, dp: int) -> tuple[str, str] | None:
    """(what DeepSpeed builds or raises, why) when the installed release cannot train the case at all."""
    line = ".".join(importlib.metadata.version("deepspeed").split(".")[:2])
    torch_213 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
    for key in ((line, optimizer), (line, optimizer, dp), (line, optimizer, "torch>=2.13" if torch_213 else "")):
        if key in STOCK_CANNOT_TRAIN:
            return STOCK_CANNOT_TRAIN[key]
    return None


def test_the_internals_table_agrees_with_what_stock_deepspeed_cannot_train():
    line = ".".join(importlib.metadata.version("deepspeed").split(".")[:2])
    facts = internals()
    assert ((line, "bf16") not in STOCK_CANNOT_TRAIN) == facts.bf16_optimizer_selected
    assert ((line, "zero", 4) not in STOCK_CANNOT_TRAIN) == facts.zero_trains_padding_only_rank
    assert ((line, "zero", "torch>=2.13") not in STOCK_CANNOT_TRAIN) == facts.zero_trains_with_torch_2_13


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,stage,dp", [("bf16", 1, 4), ("zero", 1, 4), ("zero", 2, 4), ("zero", 1, 2)])
def test_save_hook_records_and_conversion_is_bit_exact(
    ds_checkpoint, tmp_path: Path, optimizer: str, stage: int, dp: int
):
    stock = _stock_failure(optimizer, dp)
    if stock is not None:
        # This release cannot train the case with stock DeepSpeed (versions.Internals): show that it is
        # so, with stock DeepSpeed alone, rather than pretend the hooks were exercised.
        from tests.support.dsharness import TrainSpec, run_training

        res = run_training(
            TrainSpec(dp=dp, optimizer=optimizer, zero_stage=stage, steps=1, global_batch=12, expect_failure=True)
        )
        seen = res.optimizer_class if stock[0] == "FP16_UnfusedOptimizer" else res.log
        assert stock[0] in (seen or ""), (stock[1], res.returncode, res.log[-2000:])
        return
    ck = ds_checkpoint(optimizer=optimizer, dp=dp, plugin=True, zero_stage=stage)
    root = ck.copy_to(tmp_path / "ck")
    files = find_checkpoint_files(root / "global_step4")
    norms = []
    for rank, path in enumerate(files.rank_files):
        sd = RankFile(path, rank).sd
        info = sd[F.ZERO_PARTITION_INFO]
        assert (info["dp_size"], info["dp_rank"], info["alignment"]) == (dp, rank, 2 * dp)
        norms.append((sd[F.GROUP_TRUE_LENGTHS][1], sd[F.GROUP_PADDINGS][1]))
    assert norms == NORMS[dp]
    result = convert(ConvertOptions(source=root, progress=False))
    dump = torch.load(ck.dump("state_step4"), weights_only=False)
    for name, states in dump.items():
        for state, value in states.items():
            got = torch.load(result.output / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)
            if state == F.STEP_STATE:
                assert float(got) == float(value), (name, state)
            else:
                assert got[F.PARAM].dtype == value.dtype and torch.equal(got[F.PARAM], value), (name, state)
    assert verify_universal(result.output, source=root).ok


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,stage,dp", [("bf16", 1, 4), ("zero", 1, 4), ("zero", 2, 4), ("zero", 1, 2)])
def test_synthetic_writer_writes_what_this_release_saves(
    ds_checkpoint, tmp_path: Path, optimizer: str, stage: int, dp: int
):
    """The synthetic writer's files for this release equal the hooked save above, key for key (the
    same runs: nothing trains twice); tests/system/test_synthetic_checkpoint.py says how they compare."""
    from tests.system.test_synthetic_checkpoint import assert_same_files, harness_spec

    if _stock_failure(optimizer, dp) is not None:
        pytest.skip("this release cannot train the case (shown by the test above)")
    ck = ds_checkpoint(optimizer=optimizer, dp=dp, plugin=True, zero_stage=stage)
    assert_same_files(
        ck.tag_dir(2), harness_spec(optimizer, stage, True, installed_deepspeed_version(), dp=dp), tmp_path
    )
