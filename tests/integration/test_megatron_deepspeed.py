"""megatron-ucp on the real Megatron-DeepSpeed (argonne-lcf fork), unedited, on the CPU.

Each optimizer class trains a llama-style model (RoPE, RMSNorm, SwiGLU, GQA, untied embeddings,
a NullTokenizer vocabulary of 257 padded to 384) at DP=4 through the runner with background
conversion, saving at iterations 3 and 6. Then, from the iteration-3 checkpoint, in strict mode:

* DP=3 with no flag (each rank reshards its partitions straight from the native rank files), and
  with ``--ucp-resume-route universal`` (the twin the background converter made) to the same losses;
* DP=2 with ``--universal-checkpoint`` (BF16_Optimizer through the runner, DeepSpeedZeroOptimizer
  through the two-line patch of ``pretrain_gpt_alcf.py`` in ``patches/megatron-deepspeed``).

The losses of iterations 4-6 must match the uninterrupted DP=4 run's within 2e-4 (bf16 reduction
noise; a dropped padded-vocabulary row moves them by ~1e-2). A second model is so small that at
DP=4 one rank's share of the norm weights is all padding: saved there, and loaded back at DP=4
from the universal folder, where stock DeepSpeed dies with IndexError.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.universal import read_manifest, universal_state
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.format import dsformat as F
from tests.integration.mds import MdsModel, MdsResult, MdsRun, point_latest_at, run_mds
from tests.integration.shared_runs import MOE_ARGS
from tests.integration.shared_runs import moe_trained as _moe_trained
from tests.support.elastic_support import fallback_announcements
from tests.support.state_compare import tag_differences

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LOSS_TOLERANCE = 2e-4
PATCH = Path(__file__).resolve().parents[2] / "patches" / "megatron-deepspeed" / "0001-install-megatron-ucp.patch"
PADDING_MODEL = MdsModel(layers=1, hidden=6, heads=3, kv_heads=3, ffn=16)
"""Three RMSNorm weights of 6: N=18 no-weight-decay elements, padded to 24 at DP=4 (S=6): rank 3
holds only padding."""


def _train(co, folder: Path, optimizer: str, model: MdsModel = MdsModel(), args=(), **fields) -> tuple[Path, MdsResult]:
    root = folder / "ckpt"
    res = run_mds(
        co,
        MdsRun(
            nproc=4,
            ckpt=root,
            optimizer=optimizer,
            model=model,
            train_iters=6,
            save_interval=3,
            extra_args=["--ucp-async-convert", *args],
            **fields,
        ),
    )
    return root, res


def _restart_copy(root: Path, dest: Path) -> Path:
    """A copy of the run's checkpoints restarting from iteration 3 (``latest`` names global_step3)."""
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(".ucp"))
    point_latest_at(dest, "global_step3")
    return dest


DP_VARIANT_TOLERANCE = 1e-3
"""After the first resumed update, on releases whose stock training is not DP-invariant
(``versions.Internals.bf16_dp_invariant``: 0.18.9 diverges 4e-4 between DP=3 and DP=4 without
megatron-ucp). The first resumed iteration's loss, computed from the restored weights before any
update, is held to LOSS_TOLERANCE everywhere."""


def assert_continues(resumed: MdsResult, reference: MdsResult, steps=(4, 5, 6), optimizer: str = "bf16") -> None:
    from megatron_ucp.deepspeed.versions import internals

    later = LOSS_TOLERANCE if optimizer != "bf16" or internals().bf16_dp_invariant else DP_VARIANT_TOLERANCE
    for i, step in enumerate(steps):
        assert step in resumed.losses, (step, sorted(resumed.losses), resumed.log[-3000:])
        diff = abs(resumed.losses[step] - reference.losses[step])
        assert diff <= (LOSS_TOLERANCE if i == 0 else later), (step, resumed.losses[step], reference.losses[step])


def assert_accounted(res: MdsResult) -> str:
    """Strict accounting passed and said so in one summary line; returns it, from its first word (the ranks share
    one output stream: another rank's unfinished line may precede it on the same line)."""
    lines = [line for line in res.ucp_lines() if "every element placed exactly once" in line]
    assert lines, "\n".join(res.ucp_lines()[-20:])
    assert not any("ERROR" in line or "AccountingError" in line for line in res.ucp_lines())
    return lines[0][lines[0].index("megatron-ucp ") :]


@pytest.fixture(scope="module", params=["bf16", "zero"])
def trained(request, mds_checkout, mds_runs):
    optimizer = request.param
    root, res = mds_runs.get(f"train-{optimizer}", lambda f: _train(mds_checkout, f, optimizer))
    return optimizer, root, res


def test_training_saves_and_converts_in_the_background(trained):
    optimizer, root, res = trained
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6]
    assert (root / "global_step3" / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").is_file()
    wanted_class = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer"}[optimizer]
    for tag in ("global_step3", "global_step6"):
        twin = root / F.universal_tag(tag)
        assert universal_state(twin) == "complete", tag
        manifest = read_manifest(twin)
        assert manifest["source"]["dp"] == 4 and manifest["source"]["optimizer"] == wanted_class
        report = verify_universal(twin, source=root / tag)
        assert report.ok, report.problems[:5]
    assert (root / F.LATEST_UNIVERSAL).read_text() == "global_step6_universal"
    # Megatron's vocabulary: 257 real rows of 384; the padded rows are kept beside the trimmed tensor
    entry = torch.load(
        root / "global_step3_universal" / "zero" / "language_model.output_layer.weight" / "exp_avg.pt",
        weights_only=False,
    )
    assert entry[F.PARAM].shape[0] == 257 and entry[F.VOCAB_PADDED_ROWS].shape[0] == 384 - 257


def test_synthetic_writer_matches_the_training_save(trained, tmp_path):
    """The synthetic writer (megatron flavour, with the save record) writes what this Megatron-DeepSpeed
    run saved at iteration 3: every file, key, shape, dtype, storage size, ``args`` field it
    writes and geometry field (tests/support/file_structure.py); schedule counters and RNG states
    compared by kind."""
    import deepspeed

    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.integration.mds import llama_shape
    from tests.support.file_structure import folder_differences, load

    optimizer, root, _ = trained
    m = MdsModel()
    spec = SyntheticSpec(
        shape=llama_shape(m),
        dp=4,
        optimizer=optimizer,
        record=True,
        ds_version=deepspeed.__version__,
        iteration=3,
        micro_batch=1,
        grad_accumulation=3,
        seq_length=m.seq,
    )
    written = write_checkpoint(tmp_path / "synthetic", spec, progress=False)
    diffs = folder_differences(root / "global_step3", written.tag_dir)
    assert not diffs, "\n".join(diffs[:40])
    real_args = vars(load(root / "global_step3" / "mp_rank_00_model_states.pt")["args"])
    ours = vars(load(written.tag_dir / "mp_rank_00_model_states.pt")["args"])
    assert {k: (real_args.get(k, "<absent>"), v) for k, v in ours.items() if real_args.get(k, "<absent>") != v} == {}


def _dp3(mds_checkout, mds_runs, optimizer: str, root: Path, route: str) -> MdsResult:
    """The iteration-3 checkpoint resumed at DP=3 through the runner, no flag but the resume route."""

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        return run_mds(
            mds_checkout,
            MdsRun(
                nproc=3,
                ckpt=ckpt,
                optimizer=optimizer,
                train_iters=6,
                save_interval=100,
                extra_args=["--ucp-resume-route", route],
            ),
        )

    return mds_runs.get(f"dp3-{route}-{optimizer}", resume)


def test_resume_at_dp3_with_no_flag(trained, mds_checkout, mds_runs):
    optimizer, root, reference = trained
    res = _dp3(mds_checkout, mds_runs, optimizer, root, "auto")
    decided = [line for line in res.ucp_lines() if "DP changed 4 -> 3" in line]
    assert decided and "resharding global_step3 from its native rank files" in decided[0], res.ucp_lines()
    summary = assert_accounted(res)
    assert summary.startswith("megatron-ucp native reshard:") and "DP 4 -> 3" in summary
    assert_continues(res, reference, optimizer=optimizer)


def test_resume_at_dp3_through_the_universal_route_gives_the_same_losses(trained, mds_checkout, mds_runs):
    """``--ucp-resume-route universal``: the twin the background converter made, loaded by our
    universal loader (buffers Megatron's save leaves out reported), to the losses the native reshard
    gives, bit for bit."""
    optimizer, root, reference = trained
    res = _dp3(mds_checkout, mds_runs, optimizer, root, "universal")
    decided = [line for line in res.ucp_lines() if "DP changed 4 -> 3" in line]
    assert decided and "global_step3_universal" in decided[0], res.ucp_lines()
    summary = assert_accounted(res)
    assert "Megatron's save never writes" in summary and "rotary_pos_emb.inv_freq" in summary
    native = _dp3(mds_checkout, mds_runs, optimizer, root, "auto")
    assert {k: res.losses[k] for k in (4, 5, 6)} == {k: native.losses[k] for k in (4, 5, 6)}
    assert_continues(res, reference, optimizer=optimizer)


def test_resume_at_dp2_with_universal_checkpoint_flag(trained, mds_checkout, mds_runs):
    """BF16_Optimizer through the runner; DeepSpeedZeroOptimizer through patches/megatron-deepspeed."""
    optimizer, root, reference = trained

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        if optimizer == "bf16":
            run = MdsRun(
                nproc=2, ckpt=ckpt, optimizer=optimizer, save_interval=100, extra_args=["--universal-checkpoint"]
            )
        else:
            patched = mds_checkout.root / "pretrain_gpt_alcf_ucp_patched.py"
            if not patched.exists():
                subprocess.run(
                    ["patch", "-p1", "-o", str(patched), "pretrain_gpt_alcf.py", str(PATCH)],
                    cwd=mds_checkout.root,
                    check=True,
                    capture_output=True,
                )
            run = MdsRun(
                nproc=2,
                ckpt=ckpt,
                optimizer=optimizer,
                save_interval=100,
                route="script",
                entry=patched,
                extra_args=["--universal-checkpoint", "--no-load-rng"],
            )
        return run_mds(mds_checkout, run)

    res = mds_runs.get(f"dp2-{optimizer}", resume)
    summary = assert_accounted(res)  # the flag was heard: the universal loader ran, not the native reshard
    assert "megatron-ucp universal load:" in summary and "DP 4 -> 2:" in summary, summary
    assert_continues(res, reference, optimizer=optimizer)


def test_padding_only_rank_saved_and_loaded(mds_checkout, mds_runs):
    """Rank 3 of 4 holds only padding of the norm group (shown from the rank files themselves, and said by
    ``inspect``), and megatron-ucp converts the save and loads it back at DP=4 with ``--universal-checkpoint``:
    the case where stock's ``load_universal`` dies with IndexError (shown with real DeepSpeed in
    tests/system/test_stock_failures.py; ``inspect`` predicts it here too)."""
    root, reference = mds_runs.get("train-pad", lambda f: _train(mds_checkout, f, "bf16", PADDING_MODEL))
    tag = root / "global_step3"
    # the oracle: 3 RMSNorm weights of hidden 6 are the 18 no-weight-decay elements; the 4 fp32 partitions of that
    # group have one size S, rank r holding elements [r*S, (r+1)*S): rank 3 holds only padding when 3*S >= 18
    norms = 3 * PADDING_MODEL.hidden
    sizes = []
    for r in range(4):
        sd = torch.load(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
        sizes.append([t.numel() for t in sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]])
    group = min(range(len(sizes[0])), key=lambda g: sizes[0][g])  # the norms' group is the small one
    assert len({s[group] for s in sizes}) == 1 and 3 * sizes[0][group] >= norms, sizes
    inspected = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.cli", "inspect", str(root), "--tag", "global_step3", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(inspected.stdout)
    padded = {g["numel"]: g["padding_only_ranks"] for g in report["groups"]}
    assert padded.get(norms) == [3] and all(ranks == [] for n, ranks in padded.items() if n != norms), padded
    assert 4 in report["stock_loader_crash_dps"], report["stock_loader_crash_dps"]

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        return run_mds(
            mds_checkout,
            MdsRun(
                nproc=4,
                ckpt=ckpt,
                optimizer="bf16",
                model=PADDING_MODEL,
                save_interval=100,
                extra_args=["--universal-checkpoint"],
            ),
        )

    res = mds_runs.get("pad-dp4-universal", resume)
    summary = assert_accounted(res)
    assert "megatron-ucp universal load:" in summary and "-> 4:" in summary, summary
    assert_continues(res, reference)


# ------------------------------------------------------------------------------------------------
# Optimizer offload (helpers.sh's CPU_OPTIMIZER=1): the masters and states live in host memory
# ------------------------------------------------------------------------------------------------

OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
"""DeepSpeed's CPU Adam needs its compiled op: the wrapped torch Adam steps the host partitions instead."""


def test_offloaded_optimizer_resumes_at_a_new_dp_size(mds_checkout, mds_runs):
    """``offload_optimizer: cpu`` at ZeRO-2, saved at DP 4 through the runner with background conversion, resumed at
    DP 3 with no flag: the native reshard writes the engine's host partitions (where both elastic loads put them at
    every stage, ZeRO-3 included: tests/system/test_zero3_resume.py's recording accelerator), iterations 4-6 on the
    curve."""
    stage = 2

    def run(folder: Path, nproc: int, ckpt: Path, **kw) -> MdsResult:
        return run_mds(
            mds_checkout,
            MdsRun(nproc=nproc, ckpt=ckpt, optimizer="zero", zero_stage=stage, ds_extra=OFFLOAD, **kw),
        )

    root = mds_runs.base / f"offload{stage}-train" / "ckpt"
    reference = mds_runs.get(f"offload{stage}-train", lambda f: run(f, 4, root, extra_args=["--ucp-async-convert"]))
    res = mds_runs.get(
        f"offload{stage}-resume", lambda f: run(f, 3, _restart_copy(root, f / "ckpt"), save_interval=100)
    )
    decided = [line for line in res.ucp_lines() if "DP changed 4 -> 3" in line]
    assert decided and "resharding global_step3 from its native rank files" in decided[0], res.ucp_lines()
    assert_accounted(res)
    assert_continues(res, reference, optimizer="zero")


# ------------------------------------------------------------------------------------------------
# The AuroraGPT workflow: train_aGPT_7B_ucp.sh -> train_aGPT_7B.sh -> ALCF/helpers.sh -> ezpz launch
# ------------------------------------------------------------------------------------------------

WRAPPER_LOSS_TOLERANCE = 5e-4
"""helpers.sh's DeepSpeed config accumulates gradients in bf16 (DeepSpeedZeroOptimizer without
``grad_accum_dtype: fp32``): 4 vs 3 accumulation steps round differently (2e-4 seen); a lost
padded-vocabulary row moves the loss by 1e-2."""


def test_alcf_wrapper_fresh_then_resumed_on_fewer_ranks(mds_checkout, tmp_path):
    from tests.integration.alcf_job import AlcfJob

    job = AlcfJob.create(mds_checkout, tmp_path / "job")
    try:
        log, fresh = job.run(ranks=4, extra_env={"GRAD_ACC_STEPS": "3"})  # global batch 12
        assert sorted(fresh) == [1, 2, 3, 4, 5, 6], log[-4000:]
        assert "launching train_aGPT_7B.sh through megatron-ucp" in log
        assert "hooks installed" in log and "ezpz" in log
        for tag in ("global_step3", "global_step6"):
            assert universal_state(job.ckpt / F.universal_tag(tag)) == "complete", tag
        point_latest_at(job.ckpt, "global_step3")

        log, resumed = job.run(ranks=3)  # fewer slots; the wrapper picks GRAD_ACC_STEPS to keep 12
        assert "keeping the global batch 12" in log and "GRAD_ACC_STEPS=4 at DP=3" in log, log[-4000:]
        # No flag: DeepSpeed's native files are resharded in place (the twins are there but not needed).
        assert "DP changed 4 -> 3: resharding global_step3 from its native rank files" in log, log[-4000:]
        assert "megatron-ucp native reshard:" in log and "every element placed exactly once" in log
        for step in (4, 5, 6):
            assert abs(resumed[step] - fresh[step]) <= WRAPPER_LOSS_TOLERANCE, (step, resumed, fresh)
    finally:
        job.close()


# ------------------------------------------------------------------------------------------------
# Mixture of experts: saved through the hooks, converted in the background, resumed at another DP and EP
# ------------------------------------------------------------------------------------------------


def _experts_from_rank_files(tag: Path, dp: int, ep: int, experts: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per state (``fp32`` and the optimizer's), each global expert parameter's values: its fragments in the
    expert groups' partitions, in expert-DP order, under the global name (the rank files name local experts).
    An independent rebuild: torch.load, the saved mappings and DeepSpeed-MoE's E + D topology as its
    ``_create_expert_and_data_parallel`` states it (DP rank ``d`` is expert-parallel rank ``d % EP``, expert-DP
    rank ``d // EP``), nothing of megatron-ucp."""
    local = experts // ep
    files = {r: [d for d in range(dp) if d % ep == r] for r in range(ep)}  # in expert-DP order

    def global_name(name: str, r: int) -> str:
        renamed, found = re.subn(r"(\.deepspeed_experts\.)(\d+)\.", lambda m: f"{m[1]}{r * local + int(m[2])}.", name)
        assert found == 1, name  # an expert group holds expert parameters only
        return renamed

    saved = {
        d: torch.load(next(tag.glob(f"*zero_pp_rank_{d}_mp_rank_00_optim_states.pt")), weights_only=False)
        for d in range(dp)
    }
    states = {d: sd["optimizer_state_dict"] for d, sd in saved.items()}
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    for g, count in enumerate(states[0]["partition_count"]):
        if count == dp:
            continue  # a dense group
        for r, ranks in files.items():
            for d in ranks:
                held = {"fp32": states[d]["single_partition_of_fp32_groups"][g]}
                held.update({k: v for k, v in states[d]["base_optimizer_state"]["state"][g].items() if k != "step"})
                for name, address in states[d]["param_slice_mappings"][g].items():
                    name = global_name(name, r)
                    for state, flat in held.items():
                        pieces.setdefault(state, {}).setdefault(name, []).append(
                            flat.narrow(0, address.start, address.numel)
                        )
    return {state: {name: torch.cat(parts) for name, parts in by_name.items()} for state, by_name in pieces.items()}


def _moe_resumed(mds_checkout, mds_runs, root: Path, dp: int, ep: int, optimizer: str = "zero") -> MdsResult:
    """The iteration-3 checkpoint resumed at DP ``dp`` with EP ``ep`` through the runner, no flag."""

    def resume(folder: Path) -> MdsResult:
        ckpt = _restart_copy(root, folder / "ckpt")
        run = MdsRun(nproc=dp, ckpt=ckpt, optimizer=optimizer, train_iters=6, save_interval=100)
        run.extra_args = [*MOE_ARGS[:3], str(ep), *MOE_ARGS[4:]]
        return run_mds(mds_checkout, run)

    return mds_runs.get(f"moe-dp{dp}-ep{ep}-{optimizer}", resume)


def _moe_dp_change_optimizer() -> str:
    """The class the DP-change resume trains: BF16_Optimizer where it takes MoE steps (0.19 here), so that both
    classes' MoE saves are converted and resumed."""
    import deepspeed
    from packaging.version import Version

    return "bf16" if Version(deepspeed.__version__) >= Version("0.19") else "zero"


def test_moe_job_saves_through_the_hooks_and_converts_every_expert_in_the_background(mds_checkout, mds_runs):
    """The save records the expert groups' true lengths over expert-DP, the background converter writes every
    expert as a parameter of its own under its global index, each state bit for bit what an independent rebuild
    from the rank files gives (torch.load and the saved mappings); inspect and status show EP. On releases whose
    own MoE save of this fork dies inside DeepSpeed (``versions.Internals.saves_fork_moe``: 0.19's ``dict()`` of
    the model's method), the hooks hand the save Megatron's info as it wants it (``integration/save/experts.py``)."""
    root, res = _moe_trained(mds_checkout, mds_runs)
    assert sorted(res.losses) == [1, 2, 3, 4, 5, 6], res.log[-3000:]
    assert not [line for line in res.ucp_lines() if "WARNING" in line or "not handled" in line], res.ucp_lines()
    experts = sorted(p.name for p in (root / "global_step3").glob("layer_*_expert_*_mp_rank_00_model_states.pt"))
    assert len(experts) == 4, experts  # one file per expert of the MoE layer (0.16 also writes expp_rank_* files)
    model = torch.load(root / "global_step3" / F.MODEL_STATES_FILE, map_location="cpu", weights_only=False)
    assert F.UCP_SAVE_RECORD in model  # saved through the hooks
    info = model[F.UNIVERSAL_CHECKPOINT_INFO]  # Megatron's info, a dict on every release
    assert isinstance(info, dict) and info["padded_vocab_size"] == model["args"].padded_vocab_size, info
    assert not [key for key in model["module"] if "expert" in key], list(model["module"])  # in their own files
    optim = torch.load(next((root / "global_step3").glob("*zero_pp_rank_3_*optim_states.pt")), weights_only=False)
    record = optim["optimizer_state_dict"]
    assert record["partition_count"] == [4, 4, 2] and record[F.ZERO_PARTITION_INFO]["group_dp_ranks"] == [3, 3, 1]
    # where each expert's masters and states live (plan/experts.py): rebuilt from the expert-DP partitions under
    # their global names, every expert's fp32 masters round to the bf16 weights its own expert file holds
    said = "mixture of experts (4 experts in each of 1 MoE layer(s); param group(s) 2 partitioned over "
    said += "expert-data-parallel size 2 at DP=4: EP=2)"
    rebuilt = _experts_from_rank_files(root / "global_step3", dp=4, ep=2, experts=4)
    saved = {}
    for name in experts:
        saved.update(torch.load(root / "global_step3" / name, weights_only=False))
    assert sorted(rebuilt["fp32"]) == sorted(saved) and len(saved) == 8
    assert sorted(rebuilt) == ["exp_avg", "exp_avg_sq", "fp32"]
    for name, weight in saved.items():
        assert torch.equal(rebuilt["fp32"][name].view(weight.shape).to(torch.bfloat16), weight), name
    # the background conversion: every expert a parameter of its own under its global name, each state bit for bit
    # the independent rebuild's; the dense groups and the gate verified against the source; the expert files copied
    out = root / "global_step3_universal"
    assert universal_state(out) == "complete" and read_manifest(out)["parallel"]["ep"] == 2
    for state, by_name in rebuilt.items():
        for name, values in by_name.items():
            converted = torch.load(out / "zero" / name / f"{state}.pt", weights_only=False)[F.PARAM]
            assert torch.equal(converted, values.view(saved[name].shape)), (state, name)
    gates = [p.name for p in (out / "zero").iterdir() if ".gate." in p.name]
    assert gates and all((out / "zero" / g / "exp_avg_sq.pt").is_file() for g in gates), gates
    assert sorted(p.name for p in out.glob("layer_*_expert_*")) == experts
    report = verify_universal(out, source=root / "global_step3")
    assert report.ok and report.params == 22, report.problems[:5]
    from megatron_ucp.background.status import root_status
    from megatron_ucp.background.status_text import format_status
    from megatron_ucp.convert.inspection import format_report, inspect_checkpoint

    inspected = format_report(inspect_checkpoint(root, "global_step3", range(1, 9)))  # what `inspect` prints
    assert said in inspected and "group 2: N=49,152, 4 params (one expert-parallel rank's experts" in inspected
    status = format_status(root_status(root))  # what `status` prints
    assert re.search(r"global_step3 +yes +sound +complete +4 \(EP=2\)", status), status  # judged by its conversion
    from megatron_ucp.deepspeed.reader import read_checkpoint
    from megatron_ucp.errors import CheckpointFormatError

    broken = mds_runs.base / "moe-broken" / "global_step3"
    shutil.copytree(root / "global_step3", broken, dirs_exist_ok=True)
    (broken / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"layer_0_expert_3_mp_rank_00_model_states\.pt is missing"):
        read_checkpoint(broken)
    _moe_rank_files_are_bound_to_their_places(root / "global_step3", mds_runs.base / "moe-swapped" / "global_step3")
    _synthetic_moe_save_is_the_real_one(root / "global_step3", mds_runs.base / "moe-synthetic")


def _synthetic_moe_save_is_the_real_one(tag: Path, out: Path) -> None:
    """The synthetic writer's MoE checkpoint (4 experts, EP 2, DP 4, with the save record) is this save, key for
    key: file names (expert files, and the ``expp_rank`` files before 0.19), every key, shape, dtype, storage
    size, the model states of this release's MoE save, and the ``args`` fields it writes."""
    import dataclasses

    import deepspeed

    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.integration.mds import llama_shape
    from tests.support.file_structure import folder_differences, load

    m = MdsModel()
    spec = SyntheticSpec(
        shape=dataclasses.replace(llama_shape(m), experts=4),
        dp=4,
        ep=2,
        optimizer="zero",
        record=True,
        ds_version=deepspeed.__version__,
        iteration=3,
        grad_accumulation=3,
        seq_length=m.seq,
    )
    written = write_checkpoint(out, spec, progress=False)
    diffs = folder_differences(tag, written.tag_dir)
    assert not diffs, "\n".join(diffs[:40])
    real_args = vars(load(tag / F.MODEL_STATES_FILE)["args"])
    ours = vars(load(written.tag_dir / F.MODEL_STATES_FILE)["args"])
    assert {k: (real_args.get(k, "<absent>"), v) for k, v in ours.items() if real_args.get(k, "<absent>") != v} == {}


def _moe_rank_files_are_bound_to_their_places(tag: Path, swapped: Path) -> None:
    """What a native resume binds before reading anything: every rank file of the MoE save at its DP place, the
    expert groups' partitions at their expert-DP place (the files of one expert-parallel rank, 1 and 3, swapped;
    then files of two expert-parallel ranks, 0 and 1)."""
    from megatron_ucp.deepspeed.reader import read_checkpoint
    from tests.support.elastic_support import bind_folder

    def rank_file(folder: Path, r: int) -> Path:
        return next(folder.glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))

    # the groups as the job has them (local expert names), which a resume takes where DeepSpeed < 0.19 saved none
    shapes = [[(spec.name, spec.shape) for spec in group] for group in read_checkpoint(tag).model.param_groups]
    assert bind_folder(tag / F.MODEL_STATES_FILE, lambda r: rank_file(tag, r), shapes) == []
    for a, b in ((1, 3), (0, 1)):
        shutil.copytree(tag, swapped, dirs_exist_ok=True)
        first, second = rank_file(swapped, a), rank_file(swapped, b)
        first.rename(swapped / "swap.tmp")
        second.rename(first)
        (swapped / "swap.tmp").rename(second)
        problems = bind_folder(swapped / F.MODEL_STATES_FILE, lambda r: rank_file(swapped, r), shapes)
        named = {problem.split(": ", 1)[0] for problem in problems}
        assert named == {str(first), str(second)} and "swapped" in problems[0], problems


def test_moe_job_resumes_at_the_same_layout_as_deepspeed_loads_it(mds_checkout, mds_runs):
    """DeepSpeed's own load, every rank file bound to its position and save first and every partition it loaded
    checked against the checksum its save recorded (expert partitions at their expert-DP place)."""
    root, reference = _moe_trained(mds_checkout, mds_runs)
    resumed = _moe_resumed(mds_checkout, mds_runs, root, dp=4, ep=2)
    assert any("DP unchanged (4): native load of global_step3" in line for line in resumed.ucp_lines())
    checked = "global_step3 loaded at DP 4: every partition checked against the save's checksums and the saved weights"
    assert any(checked in line for line in resumed.ucp_lines()), resumed.ucp_lines()
    assert_continues(resumed, reference, optimizer="zero")


RESHARDED = "resharding global_step3 from its native rank files, EP=2 kept: each expert-parallel rank's experts over "
RESHARDED += "expert-DP 2 -> 1"


@pytest.mark.parametrize(
    "dp, ep, changed, route",
    [
        (2, 2, "DP changed 4 -> 2", RESHARDED),
        (4, 4, "EP changed 2 -> 4", "loading global_step3_universal"),
        (4, 1, "EP changed 2 -> 1", "loading global_step3_universal"),
    ],
    ids=["dp2", "ep4", "ep1"],
)
def test_moe_job_resumes_at_another_dp_or_ep(mds_checkout, mds_runs, dp, ep, changed, route):
    """A DP change at the same EP straight from the native files: each expert-parallel rank's expert buffer
    resharded over its expert-DP ranks, every rank file bound to its position first. An EP change through the
    universal folder: every expert found under its global index by the ranks that hold it now. Every element
    accounted for, and the curve continues. The DP change trains BF16_Optimizer where it takes MoE steps (0.19):
    its background conversion is checked bit for bit too."""
    optimizer = _moe_dp_change_optimizer() if ep == 2 else "zero"
    root, reference = _moe_trained(mds_checkout, mds_runs, optimizer)
    if optimizer == "bf16":  # its background conversion, every expert bit for bit against the independent rebuild
        assert sorted(reference.losses) == [1, 2, 3, 4, 5, 6], reference.log[-3000:]
        out = root / "global_step3_universal"
        assert universal_state(out) == "complete", out
        for state, by_name in _experts_from_rank_files(root / "global_step3", dp=4, ep=2, experts=4).items():
            for name, values in by_name.items():
                converted = torch.load(out / "zero" / name / f"{state}.pt", weights_only=False)[F.PARAM]
                assert torch.equal(converted.reshape(-1), values), (state, name)
        assert verify_universal(out, source=root / "global_step3").ok
    resumed = _moe_resumed(mds_checkout, mds_runs, root, dp=dp, ep=ep, optimizer=optimizer)
    decided = [line for line in resumed.ucp_lines() if changed in line]
    assert decided and route in decided[0], resumed.ucp_lines()
    said = f"was saved at EP=2 (4), this job runs at EP={ep}: the elastic-resume hook loads the universal twin"
    assert dp != 4 or any(said in line for line in resumed.ucp_lines()), resumed.ucp_lines()  # the runner, before
    summary = assert_accounted(resumed)
    assert f"DP 4 -> {dp}" in summary, summary
    assert_continues(resumed, reference, optimizer=optimizer)


# ------------------------------------------------------------------------------------------------
# Each byte read once across the job: what every rank reads from storage when it restarts
# ------------------------------------------------------------------------------------------------


def _evicted_copies(root: Path, base: Path, ranks: int) -> Path:
    """``base.rank<r>`` per rank, restarting from iteration 3, out of the page cache; returns ``base``."""
    from tests.support.page_cache import evict

    for r in range(ranks):
        evict(_restart_copy(root, base.with_name(f"{base.name}.rank{r}")))
    return base


@pytest.mark.parametrize("trained", ["zero"], indirect=True)  # what a rank reads does not depend on the class
@pytest.mark.parametrize("dp", [3, 4], ids=["reshard", "same-dp"])
def test_each_rank_reads_its_share_of_the_checkpoint(trained, mds_checkout, mds_runs, dp: int):
    """Through the runner, each rank loading its own evicted copy (tests/support/site): every rank reads
    its share (its optimizer ranges, the model-states pickle and 1/DP of the saved weights, read exactly,
    measured per file with ``mincore``), the job the checkpoint once, and the losses continue the
    uninterrupted run."""
    from tests.support.page_cache import resident_bytes

    optimizer, root, reference = trained
    tag = root / "global_step3"
    files = sorted(p.name for p in tag.iterdir() if p.is_file() and p.name.endswith("_states.pt"))
    checkpoint = sum((tag / name).stat().st_size for name in files)
    module = (tag / F.MODEL_STATES_FILE).stat().st_size

    def restart(folder: Path) -> MdsResult:
        base = _evicted_copies(root, folder / "ckpt", dp)
        run = MdsRun(nproc=dp, ckpt=base, optimizer=optimizer, save_interval=100)
        run.env = {"UCP_TEST_PRIVATE_LOAD": "1"}
        res = run_mds(mds_checkout, run)
        copies = [base.with_name(f"{base.name}.rank{r}") / "global_step3" for r in range(dp)]
        res.reads = [{name: resident_bytes(copy / name) for name in files} for copy in copies]
        return res

    res = mds_runs.get(f"reads-dp{dp}-{optimizer}", restart)
    page = 4096
    for rank, read in enumerate(res.reads):  # the model states: its pickle and zip directory, 1/DP of the weights
        assert page <= read[F.MODEL_STATES_FILE] <= module / dp + 16 * page, (rank, read, module)
    # the control: every element of every optimizer state lands on some rank, so the job's copies together hold
    # (almost: padding is never read) every byte of the optimizer files; a measurement that saw nothing fails here
    optimizer_files = sum((tag / name).stat().st_size for name in files if name != F.MODEL_STATES_FILE)
    optimizer_read = sum(v for read in res.reads for name, v in read.items() if name != F.MODEL_STATES_FILE)
    assert optimizer_read >= 0.9 * optimizer_files, (optimizer_read, optimizer_files, res.reads)
    total = sum(sum(read.values()) for read in res.reads)
    assert total <= 1.05 * checkpoint + dp * len(files) * 2 * page, (total, checkpoint, res.reads)
    assert any("rebuilt from the masters" in line for line in res.ucp_lines()), res.ucp_lines()
    assert_continues(res, reference, optimizer=optimizer)


# ------------------------------------------------------------------------------------------------
# A restart never dies on a bad checkpoint (issue 44), and a failed save never becomes latest
# ------------------------------------------------------------------------------------------------

RANK1_FILE = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _flip_a_bit(path: Path) -> None:
    from tests.support.elastic_support import flip_a_bit_in_the_largest_record

    flip_a_bit_in_the_largest_record(path)


def _nan_in_a_master(path: Path) -> None:
    states = torch.load(path, weights_only=False)
    with torch.no_grad():
        states["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][7] = float("nan")
    torch.save(states, path)


def _another_saves_model_states(path: Path) -> None:
    shutil.copyfile(path.parent.with_name("global_step3") / F.MODEL_STATES_FILE, path.parent / F.MODEL_STATES_FILE)


DAMAGE = {  # what a file system (or a mix-up) does to global_step6, and what the load says of it
    "flipped-bit": (_flip_a_bit, RANK1_FILE, "checksum mismatch"),
    "nan-in-a-master": (_nan_in_a_master, RANK1_FILE, "checksum mismatch"),
    "another-saves-model-states": (_another_saves_model_states, RANK1_FILE, F.MODEL_STATES_FILE),
}
"""A rank file cut short or replaced (unreadable, refused at the binding): the harness's fallback test
(tests/system/test_fallback.py) and the failed save's below (a folder in its place); a stock save with a NaN: the
harness's too."""


def assert_refused_on(res: MdsResult, rank: int, error: str, then: str) -> None:
    """Rank ``rank``'s own traceback (torch prints each rank's with a "[rankN]:" prefix) ends in one ``error``
    followed by ``then``."""
    raised = [line for line in res.log.splitlines() if line.startswith(f"[rank{rank}]: ") and error in line]
    assert len(raised) == 1 and then in raised[0], (rank, raised, res.log[-3000:])


def _damaged_restart(trained, mds_checkout, mds_runs, damage: str) -> tuple[MdsResult, Path]:
    """The trained run's copy with global_step6 damaged, restarted at DP 3 to iteration 6 (which the fork saves at
    the end of training): the run, and the copy's root."""
    optimizer, root, _ = trained
    harm, name, _ = DAMAGE.get(damage, DAMAGE["another-saves-model-states"])

    def restart(folder: Path):
        ckpt = folder / "ckpt"
        shutil.copytree(root, ckpt)
        harm(ckpt / "global_step6" / name)
        extra = ["--ucp-no-fallback"] if damage == "no-fallback" else []
        run = MdsRun(
            nproc=3, ckpt=ckpt, optimizer=optimizer, save_interval=100, expect_failure=bool(extra), extra_args=extra
        )
        return run_mds(mds_checkout, run), ckpt

    return mds_runs.get(f"damage-{damage}-{optimizer}", restart)


@pytest.mark.parametrize("trained", ["zero"], indirect=True)
@pytest.mark.parametrize("damage", ["flipped-bit", "nan-in-a-master", "no-fallback"])
def test_a_restart_falls_back_past_each_kind_of_damage(trained, mds_checkout, mds_runs, damage: str):
    """Through the runner, no flag: global_step6 (saved through the hooks, judged sound by the background
    conversion) damaged as a file system or a mix-up would damage it; the resume at DP 3 refuses it on every rank
    before anything trains, loads global_step3 instead, says which file and why, and continues the curve at 4 to 6.
    A flipped bit and a NaN are refused by the reshard's checksums after DeepSpeed's own load (which had loaded
    Megatron's additive learning-rate scheduler: the fallback's load must not add to it). ``--ucp-no-fallback``, with
    another save's model states in place: the binding's refusal naming the file, nothing trained."""
    optimizer, root, reference = trained
    _, name, said_of_it = DAMAGE.get(damage, DAMAGE["another-saves-model-states"])
    res, ckpt = _damaged_restart(trained, mds_checkout, mds_runs, damage)
    if damage == "no-fallback":
        assert res.returncode != 0 and not res.losses and "FALLING BACK" not in res.log, res.log[-3000:]
        for rank in range(3):  # each rank's own traceback (torch's "[rankN]:" prefix): the binding's refusal, why
            assert_refused_on(
                res, rank, "CheckpointFormatError: cannot resume from", f"{ckpt / 'global_step6'}: its files"
            )
            why = [
                line for line in res.log.splitlines() if line.startswith(f"[rank{rank}]:   {ckpt / 'global_step6'}/")
            ]
            assert len(why) == 1 and f"{said_of_it}: from another save" in why[0], why
        return
    (said,) = fallback_announcements(res.log)  # the announcement alone: the older tag's own load says other things
    assert "names global_step6, which cannot be resumed" in said, said
    assert str(ckpt / "global_step6" / name) in said and said_of_it in said, said
    assert "loading global_step3 instead (loses 3 iterations)" in said, said
    assert_continues(res, reference, steps=(4, 5, 6), optimizer=optimizer)


@pytest.mark.parametrize("trained", ["zero"], indirect=True)
def test_the_tag_saved_again_after_a_fallback_holds_one_save_and_the_next_restart_resumes_from_it(
    trained, mds_checkout, mds_runs
):
    """The sequence a requeued job meets, under the real fork: global_step6 (DP 4) with a bit flipped, the restart at
    DP 3 falls back to global_step3 and, training to 6, saves global_step6 again at DP 3 into the same folder (the
    previous test's run). That folder then holds the DP-3 save alone, and the next restart at DP 3 resumes from it,
    with no fallback (it used to find the DP-4 save's fourth rank file there, refuse the folder, fall back to
    global_step3 again and retrain the same iterations at every restart)."""
    optimizer = trained[0]
    res, ckpt = _damaged_restart(trained, mds_checkout, mds_runs, "flipped-bit")
    assert len(fallback_announcements(res.log)) == 1, res.log[-3000:]
    assert any("already holds a save of global_step6; this save replaces it" in line for line in res.ucp_lines())
    files = sorted(p.name for p in (ckpt / "global_step6").glob("*optim_states.pt"))
    assert files == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)], files
    assert (ckpt / "latest").read_text().strip() == "global_step6"

    def again(folder: Path):
        run = MdsRun(nproc=3, ckpt=ckpt, optimizer=optimizer, save_interval=100, train_iters=6)
        return run_mds(mds_checkout, run)

    second = mds_runs.get(f"damage-flipped-bit-again-{optimizer}", again)
    assert second.returncode == 0 and fallback_announcements(second.log) == [], second.log[-3000:]
    assert "successfully loaded checkpoint from" in second.log and "at iteration 6" in second.log, second.log[-3000:]
    assert not second.losses  # nothing left to train: it resumed where the re-saved tag ends


@pytest.mark.parametrize("trained", ["zero"], indirect=True)  # what a file system does does not depend on the class
def test_a_restart_falls_back_past_a_damaged_tag_and_a_failed_save_never_becomes_latest(
    trained, mds_checkout, mds_runs
):
    """Through the runner, no flag. The newest tag, global_step6 (saved through the hooks, judged sound by the
    background conversion), loses rank 1's rank file, its path taken by a folder. Resumed at DP 3, the load's
    binding refuses global_step6 on every rank before DeepSpeed's load; the restart falls back to global_step3,
    says so, and continues the curve at 4 and 5. Saving at 5, rank 1's write fails for real (a folder holds its
    file's path): every rank stops at once, naming rank 1, the file and the OS error; ``latest`` still names
    global_step6 and Megatron's ``latest_checkpointed_iteration.txt`` 6."""
    from megatron_ucp.background.store import read_fallbacks

    optimizer, root, reference = trained

    def restart(folder: Path):
        ckpt = folder / "ckpt"
        shutil.copytree(root, ckpt)  # with its store, where the background conversion left its verdicts
        victim = ckpt / "global_step6" / RANK1_FILE
        victim.unlink()
        victim.mkdir()
        blocked = ckpt / "global_step5" / RANK1_FILE
        blocked.mkdir(parents=True)
        run = MdsRun(nproc=3, ckpt=ckpt, optimizer=optimizer, save_interval=5, expect_failure=True)
        return run_mds(mds_checkout, run), ckpt, victim, blocked

    res, ckpt, victim, blocked = mds_runs.get(f"fallback-{optimizer}", restart)
    said = "\n".join(res.ucp_lines())
    assert "names global_step6, which cannot be resumed" in res.log and str(victim) in res.log, said
    assert "loading global_step3 instead (loses 3 iterations)" in res.log, said
    assert "resharding global_step3 from its native rank files" in said, said
    assert_continues(res, reference, steps=(4, 5), optimizer=optimizer)
    (event,) = read_fallbacks(ckpt)
    assert (event["latest"], event["loaded"]) == ("global_step6", "global_step3")
    assert [f["tag"] for f in event["failed"]] == ["global_step6"]  # global_step5 holds no model states: no save

    assert res.returncode != 0 and 6 not in res.losses, res.log[-3000:]
    assert "SaveFailedError: saving global_step5" in res.log and "(global rank 1)" in res.log, res.log[-3000:]
    assert f"{blocked}: write failed: Is a directory" in res.log, res.log[-3000:]
    assert (ckpt / "latest").read_text().strip() == "global_step6"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    # every rank raised the one error (none waited in a barrier for the collective timeout, none was killed): each
    # rank's own traceback (torch's "[rankN]:" prefix) ends in it
    raised = [line for line in res.log.splitlines() if "SaveFailedError: saving global_step5" in line]
    assert sorted(line.split("]")[0] for line in raised) == ["[rank0", "[rank1", "[rank2"], raised


# ================================================================================================
# asynchronous saves (--ucp-async-save): the same training, the same files, committed after every rank's
# ================================================================================================

ASYNC_SAVE = ["--ucp-async-save"]


@pytest.fixture(scope="module", params=["bf16"])
def trained_async(request, mds_checkout, mds_runs):
    """The training of ``trained`` again (BF16_Optimizer unless a test asks for another class), its saves
    asynchronous."""
    optimizer = request.param
    root, res = mds_runs.get(
        f"train-{optimizer}-async-save", lambda f: _train(mds_checkout, f, optimizer, args=ASYNC_SAVE)
    )
    return optimizer, root, res


@pytest.mark.parametrize("trained_async", ["bf16", "zero"], indirect=True)
def test_an_async_save_trains_saves_and_converts_as_a_synchronous_save(trained_async, mds_checkout, mds_runs):
    optimizer, root, res = trained_async
    sync_root, sync = mds_runs.get(f"train-{optimizer}", lambda f: _train(mds_checkout, f, optimizer))
    assert res.losses == sync.losses and sorted(res.losses) == [1, 2, 3, 4, 5, 6]
    for tag in ("global_step3", "global_step6"):
        assert tag_differences(root / tag, sync_root / tag, (str(root.parent), str(sync_root.parent))) == [], tag
        assert universal_state(root / F.universal_tag(tag)) == "complete", tag  # converted after its commit
    assert (root / F.LATEST).read_text() == "global_step6"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"
    said = "\n".join(res.ucp_lines())
    assert "global_step3 committed: every rank's files durable" in said, said[-3000:]
    assert "global_step6 committed at the end of the run" in said, said[-3000:]


def test_an_async_save_resumes_at_dp3_through_its_universal_twin_on_the_curve(trained_async, mds_checkout, mds_runs):
    _, root, reference = trained_async

    def resume(folder: Path) -> MdsResult:
        run = MdsRun(
            nproc=3,
            ckpt=_restart_copy(root, folder / "ckpt"),
            optimizer="bf16",
            save_interval=100,
            extra_args=["--ucp-resume-route", "universal"],
        )
        return run_mds(mds_checkout, run)

    res = mds_runs.get("dp3-universal-async", resume)
    decided = [line for line in res.ucp_lines() if "DP changed 4 -> 3" in line]
    assert decided and "global_step3_universal" in decided[0], res.ucp_lines()
    assert_accounted(res)
    assert_continues(res, reference)


def test_a_job_killed_while_an_async_save_is_written_resumes_from_the_previous_one_at_dp3_on_the_curve(
    trained_async, mds_checkout, tmp_path
):
    """Rank 1 dies writing its first file of iteration 6: ``latest`` and Megatron's tracker still name iteration 3
    (saved asynchronously), from which the restart at DP 3 reshards, on the curve, and saves iteration 6 again over the
    partial folder."""
    _, _, reference = trained_async
    ckpt = tmp_path / "ckpt"
    die = {"MEGATRON_UCP_TEST_DIE": "async write global_step6:1"}
    killed = run_mds(
        mds_checkout,
        MdsRun(nproc=4, ckpt=ckpt, optimizer="bf16", extra_args=ASYNC_SAVE, env=die, expect_failure=True),
    )
    assert killed.returncode != 0 and "exits at async write global_step6" in killed.log, killed.log[-3000:]
    assert (ckpt / F.LATEST).read_text() == "global_step3"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = run_mds(mds_checkout, MdsRun(nproc=3, ckpt=ckpt, optimizer="bf16", extra_args=ASYNC_SAVE))
    assert assert_accounted(resumed).startswith("megatron-ucp native reshard:")
    assert_continues(resumed, reference)
    assert (ckpt / F.LATEST).read_text() == "global_step6"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert len(list((ckpt / "global_step6").glob("*optim_states.pt"))) == 3  # the new save alone


def _memory_args(folder: Path) -> list[str]:
    return ["--ucp-memory-save-interval", "1", "--ucp-local-dir", str(folder / "local" / "{node}")]


def _assert_weights_left_to_the_masters(folder: Path, step: int, durable: Path) -> None:
    """Node 0's memory save of ``step`` (under ``folder``) says it left the optimized weights to the masters, and each
    of its weight files (a pipeline model's layer files, else the model states) holds the durable save's keys, every
    tensor an empty placeholder (the fork's GPT models have no buffers or frozen parameters to keep)."""
    from megatron_ucp.deepspeed.model_states import flatten_module_states

    gen = next(folder.rglob(f"iter_{step:07d}"))
    assert json.loads((gen / "node0.json").read_text())["weights_from_masters"] is True
    files = sorted((gen / "node0" / f"global_step{step}").glob("layer_*")) or sorted(
        (gen / "node0" / f"global_step{step}").glob("mp_rank_*_model_states.pt")
    )
    assert files
    for path in files:
        memory, saved = (torch.load(p, map_location="cpu", weights_only=False) for p in (path, durable / path.name))
        memory, saved = (flatten_module_states(sd.get("module", sd)) for sd in (memory, saved))
        assert memory and memory.keys() == saved.keys(), (path.name, sorted(memory), sorted(saved))
        kept = [k for k, t in memory.items() if torch.is_tensor(t) and t.numel()]
        assert not kept and all(t.numel() for t in saved.values() if torch.is_tensor(t)), (path.name, kept)


@pytest.mark.parametrize("trained", ["bf16"], indirect=True)
def test_a_lost_node_resumes_from_the_memory_save_at_the_new_node_count_on_the_curve(trained, mds_checkout, tmp_path):
    """Four ranks as four nodes, a memory save at the entry of every iteration (durable at 3 and 6): rank 1 dies right
    after the memory save of iteration 5 commits (in its writer thread; the durable save of 6 waits for that commit);
    its node's folder is gone. The three survivors resume from
    iteration 5 (node 1's files from their replica on node 2, nothing read from the checkpoint root) at DP 3, through
    the native reshard, and iteration 6 continues the uninterrupted run."""
    _, _, reference = trained
    ckpt = tmp_path / "ckpt"
    killed = run_mds(
        mds_checkout,
        MdsRun(
            nproc=4,
            ckpt=ckpt,
            optimizer="bf16",
            extra_args=_memory_args(tmp_path),
            env={"MEGATRON_UCP_NODE_NAMES": "n0,n1,n2,n3", "MEGATRON_UCP_TEST_DIE": "memory 5: committed:1"},
            expect_failure=True,
        ),
    )
    assert killed.returncode != 0 and "exits at memory 5: committed" in killed.log, killed.log[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"  # the durable saves untouched
    lr_state = ckpt / "lr_state_dict.yaml"  # Megatron's, written as a durable save starts: never by a memory save
    assert not lr_state.exists() or "iteration: 5" not in lr_state.read_text(), lr_state.read_text()
    _assert_weights_left_to_the_masters(tmp_path / "local" / "n0", 5, ckpt / "global_step3")
    shutil.rmtree(tmp_path / "local" / "n1")
    resumed = run_mds(
        mds_checkout,
        MdsRun(
            nproc=3,
            ckpt=ckpt,
            optimizer="bf16",
            extra_args=_memory_args(tmp_path),
            env={"MEGATRON_UCP_NODE_NAMES": "n0,n2,n3"},
        ),
    )
    said = "\n".join(resumed.ucp_lines())
    assert "restarting from the memory save of iteration 5 (global_step5, saved by 4 node(s)) on 3 node(s)" in said, (
        said[-3000:]
    )
    assert "replicas used for node 1; its weights to be rebuilt from the masters" in said, said[-3000:]
    assert "0 iteration(s) lost (the run had completed iteration 5)" in said  # it died right after that memory save
    assert assert_accounted(resumed).startswith("megatron-ucp native reshard:")
    assert sorted(resumed.losses) == [6], sorted(resumed.losses)
    assert_continues(resumed, reference, steps=(6,))


MEMORY_LAYOUTS = {"pp2": dict(pp=2, pipeline=True), "tp2": dict(tp=2)}
"""The model-parallel layouts resumed from memory (the shared training of the same name is the curve)."""


@pytest.mark.parametrize("layout", sorted(MEMORY_LAYOUTS))
def test_a_model_parallel_job_that_lost_a_node_resumes_from_memory_at_half_the_data_parallel_size(
    mds_checkout, mds_runs, tmp_path, layout
):
    """``GPTModelPipe`` at PP 2 x DP 2, or TP 2 x DP 2, four ranks as four nodes, a memory save at every iteration
    the durable saves (every 2) do not take: rank 1 dies after the memory save of iteration 5 commits; the survivors
    n0 and n2 resume from it at DP 1 (node 1's files from its replica on node 2: each stage's layer files and rank
    files, or every rank file of the node's model-parallel coordinates, brought up front), through the native
    reshard, on the curve."""
    from tests.integration.shared_runs import SAME_PADDING
    from tests.integration.shared_runs import train as shared_train

    _, reference = shared_train(mds_checkout, mds_runs, layout)
    ckpt = tmp_path / "ckpt"
    common = dict(ckpt=ckpt, train_iters=6, save_interval=2, optimizer="bf16", **MEMORY_LAYOUTS[layout])
    args = (*SAME_PADDING, *_memory_args(tmp_path))
    die = {"MEGATRON_UCP_NODE_NAMES": "n0,n1,n2,n3", "MEGATRON_UCP_TEST_DIE": "memory 5: committed:1"}
    killed = run_mds(mds_checkout, MdsRun(nproc=4, extra_args=args, env=die, expect_failure=True, **common))
    assert killed.returncode != 0 and "exits at memory 5: committed" in killed.log, killed.log[-3000:]
    _assert_weights_left_to_the_masters(tmp_path / "local" / "n0", 5, ckpt / "global_step4")
    shutil.rmtree(tmp_path / "local" / "n1")
    resumed = run_mds(
        mds_checkout, MdsRun(nproc=2, extra_args=args, env={"MEGATRON_UCP_NODE_NAMES": "n0,n2"}, **common)
    )
    said = "\n".join(resumed.ucp_lines())
    assert "restarting from the memory save of iteration 5 (global_step5, saved by 4 node(s)) on 2 node(s)" in said, (
        said[-3000:]
    )
    assert "replicas used for node 1" in said and "; its weights to be rebuilt from the masters;" in said, said[-3000:]
    assert assert_accounted(resumed).startswith("megatron-ucp native reshard:")
    assert sorted(resumed.losses) == [6], (sorted(resumed.losses), resumed.log[-3000:])
    assert_continues(resumed, reference, steps=(6,))
