"""The fork's own optimizers under megatron-ucp, on the real Megatron-DeepSpeed (``--optimizer``).

Muon (``megatron/optimizer/muon.py``) keeps, besides its per-element moments and step, a flag per parameter
(``use_muon``): under ZeRO each flat partition is one parameter to it, so one flag per partition, the same on every
rank. Stock DeepSpeed's universal conversion has no place for it; megatron-ucp carries it (a state of one value
per partition). Trained at DP 4 (BF16_Optimizer, ZeRO-1) through the runner with background conversion, saved
at 3 and 6; from iteration 3 at DP 3 through the native reshard and through the universal folder the background
converter made: the two routes give the same losses, on the uninterrupted curve (iterations 4-6, 2e-4).
The other choices of the fork that train on this CPU keep only per-element states (Adam's kind) and go the same
way as ``adam``; per-release, only ``adam`` runs (tests/integration/test_megatron_deepspeed.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.universal import universal_state
from megatron_ucp.format import dsformat as F
from tests.integration.mds import MdsResult, MdsRun, run_mds
from tests.integration.test_megatron_deepspeed import _restart_copy, assert_accounted, assert_continues

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MUON = ["--optimizer", "muon"]
UNTESTED = {"zero_allow_untested_optimizer": True}
"""DeepSpeed's ZeRO asks for it with any optimizer not its own or torch's Adam (ALCF's configs set it too)."""


def _trained(mds_checkout, mds_runs) -> tuple[Path, MdsResult]:
    def train(folder: Path) -> tuple[Path, MdsResult]:
        root = folder / "ckpt"
        run = MdsRun(
            nproc=4,
            ckpt=root,
            train_iters=6,
            save_interval=3,
            extra_args=["--ucp-async-convert", *MUON],
            ds_extra=UNTESTED,
        )
        return root, run_mds(mds_checkout, run)

    return mds_runs.get("train-muon", train)


def _resumed(mds_checkout, mds_runs, route: str) -> MdsResult:
    root, _ = _trained(mds_checkout, mds_runs)

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        args = ["--ucp-resume-route", route, *MUON]
        run = MdsRun(nproc=3, ckpt=ckpt, train_iters=6, save_interval=100, extra_args=args, ds_extra=UNTESTED)
        return run_mds(mds_checkout, run)

    return mds_runs.get(f"dp3-{route}-muon", resume)


def test_muon_converts_in_the_background_and_resumes_at_dp3_through_both_routes(mds_checkout, mds_runs):
    root, reference = _trained(mds_checkout, mds_runs)
    assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6], reference.log[-3000:]
    for tag in ("global_step3", "global_step6"):
        twin = root / F.universal_tag(tag)
        assert universal_state(twin) == "complete", reference.ucp_lines()[-10:]
        # the fork's Muon, not Adam: its moments under its own names, its flag once per param group
        states = sorted(p.stem for p in (twin / "zero" / "language_model.output_layer.weight").glob("*.pt"))
        assert states == ["fp32", "moment1", "moment2", "step"], states
        common = torch.load(twin / "zero" / F.UNIVERSAL_OPTIMIZER_STATE_FILE, weights_only=False)
        assert common[F.UCP_PARTITION_SCALARS] == {0: {"use_muon": ("value", False)}, 1: {"use_muon": ("value", False)}}
    native = _resumed(mds_checkout, mds_runs, "auto")
    universal = _resumed(mds_checkout, mds_runs, "universal")
    for res, route in ((native, "native reshard"), (universal, "universal load")):
        summary = assert_accounted(res)
        assert summary.startswith(f"megatron-ucp {route}:") and "DP 4 -> 3" in summary, summary
        assert "use_muon" in summary, summary
        assert_continues(res, reference)
    assert {k: universal.losses[k] for k in (4, 5, 6)} == {k: native.losses[k] for k in (4, 5, 6)}
