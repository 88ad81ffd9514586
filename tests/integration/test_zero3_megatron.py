"""ZeRO-3 on the real Megatron-DeepSpeed (argonne-lcf fork, unedited, CPU, gloo): ``helpers.sh``'s
``ZERO_STAGE=3`` (``--zero-stage 3``: the model built under ``deepspeed.zero.Init``).

``pretrain_gpt_alcf.py`` trains 12 iterations at DP 4 through the runner with background conversion,
saving at 6 and 12 through the hooks (a 512-row padded vocabulary, so that TP 1 and 2 pad alike). From
iteration 6, with no flag: DP 3 and DP 2 reshard the native rank files (the universal route gives the same
partitions bit for bit: tests/system/test_zero3_resume.py); TP 1 -> 2 and TP 2 -> 1 go through the universal
folder; hpZ (``zero_hpz_partition_size`` 2, secondary partitions per host) saves and resumes at
DP 2. Iterations 7 to 12 continue the uninterrupted curve within 2e-4. The synthetic writer's stage-3 files
equal the save key for key. On the other releases of the matrix: the training and DP 3 (test names with
``zero3`` and ``trains`` or ``dp3``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.universal import read_manifest, universal_state
from megatron_ucp.convert.verify import verify_universal
from megatron_ucp.export.hf_export import ExportOptions, export_hf
from megatron_ucp.format import dsformat as F
from tests.integration.hf_check import assert_computes, fork_logits, same_files
from tests.integration.mds import MdsResult, MdsRun, point_latest_at, run_mds

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LOSS_TOLERANCE = 2e-4
RESUMED = tuple(range(7, 13))
HPZ = {"zero_optimization": {"zero_hpz_partition_size": 2}}
SAME_PADDING = ["--make-vocab-size-divisible-by", "256"]
"""Every run: 512 vocabulary rows at TP 1 and 2 (Megatron pads to a multiple of 128 x TP by default: 384 at TP 1,
512 at TP 2, and no resume can continue a curve across a softmax over another number of rows)."""


def _train(co, folder: Path, tp: int = 1, ds_extra: dict | None = None, args=()) -> tuple[Path, MdsResult]:
    root = folder / "ckpt"
    res = run_mds(
        co,
        MdsRun(
            nproc=4,
            ckpt=root,
            optimizer="zero",
            zero_stage=3,
            tp=tp,
            train_iters=12,
            save_interval=6,
            ds_extra=ds_extra or {},
            extra_args=["--ucp-async-convert", *SAME_PADDING, *args],
        ),
    )
    return root, res


def _resume(co, root: Path, folder: Path, nproc: int, tp: int = 1, ds_extra=None, args=()) -> MdsResult:
    ckpt = folder / "ckpt"
    shutil.copytree(root, ckpt, ignore=shutil.ignore_patterns(".ucp"))
    point_latest_at(ckpt, "global_step6")
    return run_mds(
        co,
        MdsRun(
            nproc=nproc,
            ckpt=ckpt,
            optimizer="zero",
            zero_stage=3,
            tp=tp,
            train_iters=12,
            save_interval=100,
            ds_extra=ds_extra or {},
            extra_args=[*SAME_PADDING, *args],
        ),
    )


def assert_continues(resumed: MdsResult, reference: MdsResult) -> None:
    for step in RESUMED:
        assert step in resumed.losses, (step, sorted(resumed.losses), resumed.log[-3000:])
        diff = abs(resumed.losses[step] - reference.losses[step])
        assert diff <= LOSS_TOLERANCE, (step, resumed.losses[step], reference.losses[step])


def _accounted(res: MdsResult, route: str) -> str:
    lines = [line for line in res.ucp_lines() if f"megatron-ucp {route}:" in line]
    assert len(lines) == 1 and "every element placed exactly once" in lines[0], res.ucp_lines()[-20:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(mds_checkout, mds_runs):
    return mds_runs.get("zero3-train", lambda f: _train(mds_checkout, f))


def test_zero3_trains_saves_through_the_hooks_and_converts_in_the_background(trained):
    root, res = trained
    assert sorted(res.losses) == list(range(1, 13)), res.log[-3000:]
    tag = root / "global_step6"
    assert sorted(p.name for p in tag.glob("zero_pp_rank_*_model_states.pt")) == [
        F.zero3_model_file(r, 0) for r in range(4)
    ]
    assert not (tag / F.MODEL_STATES_FILE).exists()
    sd = torch.load(tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", weights_only=False)
    sd = sd[F.OPTIMIZER_STATE_DICT]
    assert sd[F.ZERO_PARTITION_INFO]["zero_stage"] == 3 and sd[F.UCP_SAVE_RECORD]["dp_rank"] == 3
    assert F.ZERO_PARTITION_CHECKSUMS in sd and F.PARAM_TRUE_LENGTHS in sd
    for name in ("global_step6", "global_step12"):
        twin = root / F.universal_tag(name)
        assert universal_state(twin) == "complete", name
        manifest = read_manifest(twin)
        assert manifest["source"]["zero_stage"] == 3 and manifest["source"]["dp"] == 4
        report = verify_universal(twin, source=root / name)
        assert report.ok, report.problems[:5]
    assert (root / F.LATEST_UNIVERSAL).read_text() == "global_step12_universal"


def test_zero3_synthetic_writer_matches_the_training_save(trained, tmp_path):
    """The synthetic writer's ZeRO-3 files (with the save record) are this run's iteration-6 save, key for key:
    every rank's model states and rank file, Megatron's one param group under ``zero.Init``, the sub-groups."""
    import deepspeed

    from megatron_ucp.synthetic.content import SyntheticSpec
    from megatron_ucp.synthetic.writer import write_checkpoint
    from tests.integration.mds import MdsModel, llama_shape
    from tests.support.file_structure import folder_differences

    root, _ = trained
    m = MdsModel()
    spec = SyntheticSpec(
        shape=llama_shape(m, vocab=512),
        dp=4,
        optimizer="zero",
        zero_stage=3,
        record=True,
        ds_version=deepspeed.__version__,
        iteration=6,
        micro_batch=1,
        grad_accumulation=3,
        seq_length=m.seq,
    )
    written = write_checkpoint(tmp_path / "synthetic", spec, progress=False)
    diffs = folder_differences(root / "global_step6", written.tag_dir)
    assert not diffs, "\n".join(diffs[:40])


@pytest.mark.parametrize("dp", [3, 2], ids=["dp3", "dp2"])
def test_zero3_resume_with_no_flag(dp, trained, mds_checkout, mds_runs):
    root, reference = trained
    res = mds_runs.get(f"zero3-dp{dp}", lambda f: _resume(mds_checkout, root, f, dp))
    decided = [line for line in res.ucp_lines() if f"DP changed 4 -> {dp}" in line]
    assert decided and "resharding global_step6 from its native rank files" in decided[0], res.ucp_lines()
    summary = _accounted(res, "native reshard")
    assert "checked against the save's partition checksums" in summary
    assert not list((mds_runs.base / f"zero3-dp{dp}" / "ckpt").glob("global_step6_universal.*"))
    assert_continues(res, reference)


def test_zero3_tp2_to_tp1_goes_through_the_universal_folder(mds_checkout, mds_runs):
    """The runner sees the TP change and adds ``--universal-checkpoint``; the hook loads the twin the background
    converter made (``latest_universal`` names it), each rank reading its TP=1 slice of each parameter's files."""
    root, reference = mds_runs.get("zero3-train-tp2", lambda f: _train(mds_checkout, f, tp=2))
    res = mds_runs.get("zero3-tp1", lambda f: _resume(mds_checkout, root, f, 2))
    lines = res.ucp_lines()
    assert any("TP changed 2 -> 1" in line for line in lines), lines
    assert any("adding --universal-checkpoint" in line for line in lines), lines
    assert any("load_universal is set" in line for line in lines), lines
    _accounted(res, "universal load")
    assert_continues(res, reference)


def test_zero3_tp1_to_tp2_goes_through_the_universal_folder(trained, mds_checkout, mds_runs):
    """Each rank of TP 2 reads its TP slice of its DP slice of each parameter (the TP place from the engine's
    ``mpu``: ZeRO-3's optimizer keeps none)."""
    root, reference = trained
    res = mds_runs.get("zero3-tp2", lambda f: _resume(mds_checkout, root, f, 4, tp=2))
    lines = res.ucp_lines()
    assert any("TP changed 1 -> 2" in line for line in lines), lines
    _accounted(res, "universal load")
    assert_continues(res, reference)


def test_zero3_hf_exports_compute_the_forks_own_logits_at_tp1_and_tp2(trained, mds_checkout, mds_runs, tmp_path):
    """ZeRO-3 saves at TP 1 and TP 2 (iteration 12), exported in fp32 from their background twins: each exported
    ``LlamaForCausalLM``'s logits are the fork's own ``GPTModel`` forward's on the same tokens (within 1e-4)."""
    roots = [trained[0], mds_runs.get("zero3-train-tp2", lambda f: _train(mds_checkout, f, tp=2))[0]]
    exports = [
        export_hf(
            ExportOptions(source=r, tag="global_step12", output=tmp_path / f"tp{i + 1}", dtype="fp32", progress=False)
        )
        for i, r in enumerate(roots)
    ]
    assert not any(e.converted for e in exports)
    for result, want in zip(exports, fork_logits(mds_checkout, [e.universal for e in exports], tmp_path), strict=True):
        assert_computes(result.output, want)


def test_zero3_state_exports_byte_identical_after_a_tp_change(trained, mds_checkout, tmp_path):
    """Iteration 6 of the TP 1 training loaded at TP 2 (DP 2) and saved again at once (``--train-iters 6``): both
    saves export (bf16) to the same bytes."""
    ckpt, resaved = tmp_path / "ckpt", tmp_path / "resaved"
    shutil.copytree(trained[0], ckpt, ignore=shutil.ignore_patterns(".ucp"))
    point_latest_at(ckpt, "global_step6")
    res = run_mds(
        mds_checkout,
        MdsRun(
            nproc=4,
            ckpt=ckpt,
            optimizer="zero",
            zero_stage=3,
            tp=2,
            train_iters=6,
            save_interval=100,
            extra_args=[
                *SAME_PADDING,
                "--save",
                str(resaved),
                "--use-checkpoint-opt_param-scheduler",
            ],  # its 12 iterations
        ),
    )
    assert not res.losses and (resaved / "global_step6").is_dir(), res.ucp_lines()[-10:]
    first = export_hf(ExportOptions(source=trained[0], tag="global_step6", output=tmp_path / "tp1", progress=False))
    again = export_hf(ExportOptions(source=resaved, output=tmp_path / "tp2", progress=False))
    assert again.converted and not same_files(first.output, again.output)


def test_zero3_hpz_saves_and_resumes_at_dp2(mds_checkout, mds_runs):
    """hpZ keeps a secondary copy of each partition within a host group: the files are the primary
    partitions over the whole DP group, resharded as any stage-3 save."""
    root, reference = mds_runs.get("zero3-train-hpz", lambda f: _train(mds_checkout, f, ds_extra=HPZ))
    res = mds_runs.get("zero3-hpz-dp2", lambda f: _resume(mds_checkout, root, f, 2, ds_extra=HPZ))
    decided = [line for line in res.ucp_lines() if "DP changed 4 -> 2" in line]
    assert decided and "resharding global_step6" in decided[0], res.ucp_lines()
    _accounted(res, "native reshard")
    assert_continues(res, reference)


def test_zero3_async_save_writes_what_a_synchronous_save_writes_and_resumes_through_its_universal_twin(
    trained, mds_checkout, mds_runs
):
    """``--ucp-async-save`` at ZeRO-3: the synchronous run's losses and files (every rank's model states and rank
    file, the save's random identity aside), each save converted once committed; resumed at DP 3 from the universal
    twin of the asynchronous save (``--ucp-resume-route universal``), on the curve."""
    from tests.support.state_compare import tag_differences

    sync_root, sync = trained
    root, res = mds_runs.get("zero3-train-async", lambda f: _train(mds_checkout, f, args=["--ucp-async-save"]))
    assert res.losses == sync.losses and sorted(res.losses) == list(range(1, 13)), res.log[-3000:]
    for tag in ("global_step6", "global_step12"):
        assert tag_differences(root / tag, sync_root / tag, (str(root.parent), str(sync_root.parent))) == [], tag
        assert universal_state(root / F.universal_tag(tag)) == "complete", tag
    assert (root / F.LATEST).read_text() == "global_step12"
    said = "\n".join(res.ucp_lines())
    assert "global_step6 committed: every rank's files durable" in said, said[-3000:]
    resumed = mds_runs.get(
        "zero3-async-dp3-universal",
        lambda f: _resume(mds_checkout, root, f, 3, args=["--ucp-resume-route", "universal"]),
    )
    assert any("global_step6_universal" in line for line in resumed.ucp_lines()), resumed.ucp_lines()[-20:]
    _accounted(resumed, "universal load")
    assert_continues(resumed, sync)
