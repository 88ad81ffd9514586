"""The fork's own optimizers under megatron-ucp, on the real Megatron-DeepSpeed (``--optimizer``).

Each of the fork's own choices that trains on this CPU (``megatron/optimizer/``: ``muon``, ``muonclip``,
``sophiag``, ``adopt``) trains at DP 4 (BF16_Optimizer, ZeRO-1) through the runner with background conversion, saving
at 3 and 6; from iteration 3 it resumes at DP 3 through the native reshard and through the universal folder the
background converter made: the two routes give the same losses, on the uninterrupted curve (iterations 4-6, 2e-4).
SophiaG keeps ``exp_avg`` and ``hessian``, ADOPT ``exp_avg`` and ``exp_avg_sq``: one number per element, as Adam's.
Muon (and MuonClip, its subclass) keeps, besides its moments and step, a flag per parameter (``use_muon``): under ZeRO
each flat partition is one parameter to it, so one flag per partition, the same on every rank. Stock DeepSpeed's
universal conversion has no place for it; megatron-ucp carries it (a state of one value per partition). Each also
resumes at TP 2 (TP 1 -> 2 at DP 2, through the universal folder), on the curve. IPEX's ``Lamb`` (``ipex.lamb``)
does the same in the torch 2.8 + IPEX environment.

bitsandbytes' ``adam8bit`` keeps blockwise 8-bit state no cut can move exactly: its background conversion is refused
in its own words, a DP change is refused by name on every rank before DeepSpeed's load, on both routes, and at its own
DP size DeepSpeed's load takes it with one warning. The choices the fork itself cannot train on the CPU are shown
failing without megatron-ucp. Per release, only ``adam`` runs (tests/integration/test_megatron_deepspeed.py).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_ucp.background.status import root_status
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
    "muonclip": (["fp32", "moment1", "moment2", "step"], {"use_muon": ("value", False)}),
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


def assert_resumed_and_saved(res: MdsResult) -> None:
    """A resume ran to its end: trained to iteration 6, saved there through the hooks (the fork saves at the end of
    training when ``--save`` is set), and exited 0 (a failure in that save or at exit is not hidden by the refused
    resumes' ``expect_failure``)."""
    assert res.returncode == 0 and max(res.losses, default=0) == 6, res.log[-3000:]
    assert "successfully saved checkpoint at iteration       6" in res.log, res.log[-3000:]


def _resumed(mds_checkout, mds_runs, optimizer: str, route: str, tp: int = 1, nproc: int = 0, *more: str) -> MdsResult:
    """From iteration 3 on ``nproc`` ranks (DP 3 at TP 1, DP 2 at TP 2 unless given); a refused resume is returned."""
    root, _ = _trained(mds_checkout, mds_runs, optimizer)
    nproc = nproc or (3 if tp == 1 else 4)

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        args = _args(optimizer, "--ucp-resume-route", route, *more)
        run = MdsRun(
            nproc=nproc,
            tp=tp,
            ckpt=ckpt,
            train_iters=6,
            save_interval=100,
            extra_args=args,
            ds_extra=UNTESTED,
            expect_failure=True,
        )
        return run_mds(mds_checkout, run)

    return mds_runs.get(f"resume-{optimizer}-{route}-tp{tp}-n{nproc}{''.join(more)}", resume)


@pytest.mark.parametrize("optimizer", list(STATES))
def test_the_forks_optimizer_converts_in_the_background_and_resumes_at_dp3_through_both_routes_and_at_tp2(
    mds_checkout, mds_runs, optimizer: str
):
    _converts_and_resumes_through_both_routes(mds_checkout, mds_runs, optimizer, *STATES[optimizer])


def test_ipex_lamb_converts_in_the_background_and_resumes_at_dp3_through_both_routes_and_at_tp2(mds_checkout, mds_runs):
    """``--optimizer ipex.lamb`` (IPEX's ``Lamb``, CPU kernels): in the torch 2.8 + IPEX environment only."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        pytest.skip("IPEX is not installed here (the torch 2.8 + IPEX environment runs this)")
    _converts_and_resumes_through_both_routes(
        mds_checkout, mds_runs, "ipex.lamb", ["exp_avg", "exp_avg_sq", "fp32", "step"], None
    )


def _converts_and_resumes_through_both_routes(mds_checkout, mds_runs, optimizer: str, files, scalars) -> None:
    root, reference = _trained(mds_checkout, mds_runs, optimizer)
    assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6], reference.log[-3000:]
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
        assert_resumed_and_saved(res)
        summary = assert_accounted(res)
        assert summary.startswith(f"megatron-ucp {route}:") and "DP 4 -> 3" in summary, summary
        assert all(name in summary for name in (scalars or {})), summary
        assert_continues(res, reference)
    assert {k: universal.losses[k] for k in (4, 5, 6)} == {k: native.losses[k] for k in (4, 5, 6)}
    # TP 1 -> 2 (DP 4 -> 2): through the universal folder, where each TP slice's partitions get the states
    res = _resumed(mds_checkout, mds_runs, optimizer, "auto", tp=2)
    assert_resumed_and_saved(res)
    assert any("TP changed 1 -> 2" in line for line in res.ucp_lines()), res.ucp_lines()
    summary = assert_accounted(res)
    assert summary.startswith("megatron-ucp universal load:"), summary
    assert all(name in summary for name in (scalars or {})), summary
    assert_continues(res, reference)


BNB_STATE = "__bnb_optimizer_quant_state__"
"""bitsandbytes' per-partition quantization state (uint8 codes, per-block ``absmax``, code books) in one dict."""


def test_adam8bit_is_refused_by_name_at_a_dp_change_on_every_route_and_resumes_at_its_own_size(mds_checkout, mds_runs):
    """``--optimizer adam8bit`` (bitsandbytes' ``Adam8bit``): its blockwise state cannot be cut at another DP size
    without requantizing (docs/limitations.md). The background conversion refuses each save in its own words, in the
    training's log and in ``status``; a resume at DP 3 is refused by name on every rank before DeepSpeed's load, through
    either route (the job stopped before DeepSpeed's ``get_flat_partition`` died of it); at DP 4 one warning and
    DeepSpeed's own load, on the curve."""
    root, reference = _trained(mds_checkout, mds_runs, "adam8bit")
    assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6], reference.log[-3000:]
    rows = {t.tag: t for t in root_status(root).tags}
    for tag in ("global_step3", "global_step6"):
        assert rows[tag].universal == "failed" and BNB_STATE in rows[tag].detail, rows[tag]
    said = [line for line in reference.ucp_lines() if BNB_STATE in line and "not a per-element tensor" in line]
    assert said, reference.ucp_lines()[-20:]
    for route in ("auto", "universal"):
        refused = _resumed(mds_checkout, mds_runs, "adam8bit", route)
        assert refused.returncode != 0 and max(refused.losses, default=0) <= 3, refused.log[-3000:]
        raised = [line for line in refused.log.splitlines() if "megatron_ucp.errors.UnsupportedError" in line]
        assert {line.split("]")[0] for line in raised} == {"[rank0", "[rank1", "[rank2"}, refused.log[-3000:]
        named = "Adam8bit keeps optimizer state" if route == "auto" else "not a per-element tensor (dict)"
        assert any(BNB_STATE in line and named in line for line in refused.log.splitlines()), refused.log[-3000:]
        assert "get_flat_partition" not in refused.log
    same = _resumed(mds_checkout, mds_runs, "adam8bit", "auto", nproc=4)
    assert same.returncode == 0, same.log[-3000:]
    warned = [line for line in same.ucp_lines() if "at the saved DP size DeepSpeed's own load" in line]
    assert len(warned) == 1, same.ucp_lines()
    assert_continues(same, reference)


REQUANTIZED = re.compile(
    r"partitions of (\d+) elements in 8-bit blocks of (\d+), largest change ([0-9.e+-]+) of a block's scale; "
    r"partitions of (\d+) elements kept in fp32"
)


def _group_sizes_at(root: Path, tag: str, dp: int) -> list[int]:
    """Each param group's elements at ``dp`` (padded to a multiple of ``2 * dp`` as DeepSpeed pads a flat group), from
    the parameter shapes the save wrote: independent of the project's reader and planner."""
    shapes = torch.load(root / tag / F.MODEL_STATES_FILE, weights_only=False)["param_shapes"]
    numels = [sum(math.prod(shape) for shape in group.values()) for group in shapes]
    return [-(-n // (2 * dp)) * 2 * dp for n in numels]


def test_adam8bit_moves_to_dp3_when_asked_to_requantize(mds_checkout, mds_runs):
    """``--ucp-requantize-8bit``: the same save at DP 3 through the native reshard, every 8-bit code read as its
    value, accounted for, and quantized again by bitsandbytes in the new partitions (the norms' group's partitions,
    108 elements each, stay fp32, as bitsandbytes keeps them): the summary says so, how many elements each way and how
    far one quantization moved the states; the losses continue the uninterrupted curve (not bit for bit: measured in
    the test's tolerance)."""
    root, reference = _trained(mds_checkout, mds_runs, "adam8bit")
    res = _resumed(mds_checkout, mds_runs, "adam8bit", "auto", 1, 3, "--ucp-requantize-8bit")
    assert_resumed_and_saved(res)
    summary = assert_accounted(res)
    assert summary.startswith("megatron-ucp native reshard:") and "DP 4 -> 3" in summary, summary
    assert "state1" in summary and "quantized again (--ucp-requantize-8bit, not exact)" in summary, summary
    (found,) = REQUANTIZED.findall(summary)
    quantized, blocksize, change, kept = int(found[0]), int(found[1]), float(found[2]), int(found[3])
    big, norms = _group_sizes_at(root, "global_step3", 3)
    # the norms' group: 5 RMSNorm weights of 64 (2 layers x 2, the final one), 320 elements padded to 324 at DP 3;
    # bitsandbytes' min_8bit_size (4096) between its partitions and the large group's
    assert norms == 324 and norms // 3 < 4096 <= big // 3, (big, norms)
    assert (quantized, blocksize, kept) == (big, 256, norms), summary
    assert 0 < change < 0.02, summary  # one 8-bit rounding of the dynamic map: under 2% of its block's scale
    warned = [line for line in res.ucp_lines() if "--ucp-requantize-8bit: bitsandbytes' 8-bit states" in line]
    assert len(warned) == 1, res.ucp_lines()
    assert_continues(res, reference)


def _flip_a_code(path: Path) -> None:
    """One 8-bit code of param group 0's ``state1`` changed in a rank file (rewritten whole by torch.save)."""
    states = torch.load(path, weights_only=False)
    packed = states["optimizer_state_dict"]["base_optimizer_state"]["state"][0][BNB_STATE]
    assert packed["state1"].dtype == torch.uint8, packed["state1"].dtype
    packed["state1"][100] ^= 1
    torch.save(states, path)


def test_a_flipped_8bit_code_is_refused_naming_its_file_and_state(mds_checkout, mds_runs, tmp_path: Path):
    """The codes ``--ucp-requantize-8bit`` reads are checked against the save's own checksums (which are of the codes):
    one code changed in rank 1's file stops the DP 3 load on every rank, naming that file, param group 0 and
    ``state1``; nothing trains."""
    root, _ = _trained(mds_checkout, mds_runs, "adam8bit")
    ckpt = _restart_copy(root, tmp_path / "ckpt")
    victim = ckpt / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip_a_code(victim)
    args = _args("adam8bit", "--ucp-requantize-8bit")
    run = MdsRun(
        nproc=3, ckpt=ckpt, train_iters=6, save_interval=100, extra_args=args, ds_extra=UNTESTED, expect_failure=True
    )
    res = run_mds(mds_checkout, run)
    assert res.returncode != 0 and max(res.losses, default=0) <= 3, res.log[-3000:]
    for rank in range(3):  # each rank's own traceback (torch's "[rankN]:" prefix) ends in the one refusal
        said = [line for line in res.log.splitlines() if line.startswith(f"[rank{rank}]: ")]
        raised = [line for line in said if "megatron_ucp.errors.CheckpointFormatError: cannot resume from" in line]
        why = [line for line in said if line.startswith(f"[rank{rank}]:   global_step3: ")]
        assert len(raised) == 1 and len(why) == 1, (rank, said[-10:])
        assert "checksum mismatch" in why[0] and f"{victim}, param group 0's 'state1'" in why[0], why


FORK_FAILURES = {
    "adamwschedulefree-zero": ("adamwschedulefree", "zero", "IndexError: list index out of range"),
    "adamwschedulefree-bf16": ("adamwschedulefree", "bf16", "number_of_skipped_iterations=  1"),
    "sgdschedulefree-zero": ("sgdschedulefree", "zero", "IndexError: list index out of range"),
    "galoreadamw": ("galoreadamw", "bf16", "TypeError: galoreadamw optimizer is not supported"),
    "ds.onebitlamb": ("ds.onebitlamb", "bf16", "TypeError: ds.onebitlamb optimizer is not supported"),
    "ds.fusedlamb": ("ds.fusedlamb", "bf16", "ValueError: This op had not been implemented on CPU backend"),
}
"""What the fork does with these choices on its own: schedule-free's (AdamW's, SGD's) step under
DeepSpeedZeroOptimizer dies in DeepSpeed's ``get_flat_partition`` at iteration 2, under BF16_Optimizer it is skipped
at every iteration (no loss, a learning rate of 0); ``--optimizer galoreadamw*`` never reaches GaLore
(``get_megatron_optimizer`` tests for ``galore_adamw``, the argument's choices spell ``galoreadamw``) and
``ds.onebitlamb`` has no branch there at all; DeepSpeed's ``FusedLamb`` has no CPU kernel (not tried on a GPU)."""


@pytest.mark.parametrize("case", list(FORK_FAILURES))
def test_the_fork_itself_cannot_run_this_optimizer_on_the_cpu(mds_checkout, tmp_path, case: str):
    """Without megatron-ucp (the script alone), so that docs/limitations.md says what the fork does, and this test
    fails (and the choice joins the matrix above) the day the fork trains it."""
    optimizer, engine, failure = FORK_FAILURES[case]
    run = MdsRun(
        nproc=2,
        ckpt=tmp_path / "ckpt",
        train_iters=4,
        save_interval=100,
        route="plain",
        optimizer=engine,
        extra_args=["--optimizer", optimizer],
        ds_extra=UNTESTED,
        expect_failure=True,
    )
    res = run_mds(mds_checkout, run)
    assert not res.losses and failure in res.log, res.log[-3000:]
    assert (res.returncode == 0) == (case == "adamwschedulefree-bf16"), res.log[-3000:]
