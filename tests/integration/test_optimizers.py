"""The fork's own optimizers under megatron-ucp, on the real Megatron-DeepSpeed (``--optimizer``).

Each of the fork's own choices that trains on this CPU (``megatron/optimizer/``: ``muon``, ``sophiag``, ``adopt``)
trains at DP 4 (BF16_Optimizer, ZeRO-1) through the runner with background conversion, saving at 3 and 6; from
iteration 3 it resumes at DP 3 through the native reshard and through the universal folder the background converter
made: the two routes give the same losses, on the uninterrupted curve (iterations 4-6, 2e-4). SophiaG keeps
``exp_avg`` and ``hessian``, ADOPT ``exp_avg`` and ``exp_avg_sq``: one number per element, as Adam's. Muon keeps,
besides its moments and step, a flag per parameter (``use_muon``): under ZeRO each flat partition is one parameter
to it, so one flag per partition, the same on every rank. Stock DeepSpeed's universal conversion has no place for it;
megatron-ucp carries it (a state of one value per partition), also through a TP change (TP 1 -> 2 at DP 2, through
the universal folder). Per release, only ``adam`` runs (tests/integration/test_megatron_deepspeed.py).
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

UNTESTED = {"zero_allow_untested_optimizer": True}
"""DeepSpeed's ZeRO asks for it with any optimizer not its own or torch's Adam (ALCF's configs set it too)."""
SAME_PADDING = ["--make-vocab-size-divisible-by", "256"]
"""The vocabulary padded to 512 rows at TP 1 and TP 2 alike, so that a TP change carries every row's state."""
STATES = {
    "muon": (["fp32", "moment1", "moment2", "step"], {"use_muon": ("value", False)}),
    "sophiag": (["exp_avg", "fp32", "hessian", "step"], None),
    "adopt": (["exp_avg", "exp_avg_sq", "fp32", "step"], None),
}
"""Each optimizer's state files per parameter in its twin, and its states of one value per partition (per group)."""


def _args(optimizer: str, *more: str) -> list[str]:
    return [*more, "--optimizer", optimizer, *SAME_PADDING]


def _trained(mds_checkout, mds_runs, optimizer: str) -> tuple[Path, MdsResult]:
    def train(folder: Path) -> tuple[Path, MdsResult]:
        root = folder / "ckpt"
        args = _args(optimizer, "--ucp-async-convert")
        run = MdsRun(nproc=4, ckpt=root, train_iters=6, save_interval=3, extra_args=args, ds_extra=UNTESTED)
        return root, run_mds(mds_checkout, run)

    return mds_runs.get(f"train-{optimizer}", train)


def _resumed(mds_checkout, mds_runs, optimizer: str, route: str, tp: int = 1) -> MdsResult:
    root, _ = _trained(mds_checkout, mds_runs, optimizer)

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        args = _args(optimizer, "--ucp-resume-route", route)
        nproc = 3 if tp == 1 else 4
        run = MdsRun(
            nproc=nproc, tp=tp, ckpt=ckpt, train_iters=6, save_interval=100, extra_args=args, ds_extra=UNTESTED
        )
        return run_mds(mds_checkout, run)

    return mds_runs.get(f"resume-{optimizer}-{route}-tp{tp}", resume)


@pytest.mark.parametrize("optimizer", list(STATES))
def test_the_forks_optimizer_converts_in_the_background_and_resumes_at_dp3_through_both_routes(
    mds_checkout, mds_runs, optimizer: str
):
    root, reference = _trained(mds_checkout, mds_runs, optimizer)
    assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6], reference.log[-3000:]
    files, scalars = STATES[optimizer]
    for tag in ("global_step3", "global_step6"):
        twin = root / F.universal_tag(tag)
        assert universal_state(twin) == "complete", reference.ucp_lines()[-10:]
        # the fork's optimizer, not Adam: its states under its own names, Muon's flag once per param group
        states = sorted(p.stem for p in (twin / "zero" / "language_model.output_layer.weight").glob("*.pt"))
        assert states == files, states
        common = torch.load(twin / "zero" / F.UNIVERSAL_OPTIMIZER_STATE_FILE, weights_only=False)
        assert common.get(F.UCP_PARTITION_SCALARS) == (None if scalars is None else {0: scalars, 1: scalars})
    native = _resumed(mds_checkout, mds_runs, optimizer, "auto")
    universal = _resumed(mds_checkout, mds_runs, optimizer, "universal")
    for res, route in ((native, "native reshard"), (universal, "universal load")):
        summary = assert_accounted(res)
        assert summary.startswith(f"megatron-ucp {route}:") and "DP 4 -> 3" in summary, summary
        assert all(name in summary for name in (scalars or {})), summary
        assert_continues(res, reference)
    assert {k: universal.losses[k] for k in (4, 5, 6)} == {k: native.losses[k] for k in (4, 5, 6)}


def test_muon_resumes_at_another_tp_size_with_its_flag(mds_checkout, mds_runs):
    """TP 1 -> 2 (DP 4 -> 2): through the universal folder, where each TP slice's partitions get the flag."""
    _, reference = _trained(mds_checkout, mds_runs, "muon")
    res = _resumed(mds_checkout, mds_runs, "muon", "auto", tp=2)
    assert any("TP changed 1 -> 2" in line for line in res.ucp_lines()), res.ucp_lines()
    summary = assert_accounted(res)
    assert summary.startswith("megatron-ucp universal load:") and "use_muon" in summary, summary
    assert_continues(res, reference)
