"""Elastic resume with real DeepSpeed (CPU, gloo): save at DP=4, continue at DP=2, 3, 4 and 2 -> 4.

Source: the harness's session checkpoint of each optimizer class (DP=4, saved at step 2; the
no-weight-decay group has N=9, so at DP=4 rank 3 holds only padding). Every resume is a plugin
run with no conversion step and, except where the explicit flag is the point, no flag:

* DP=2 (``load_tag="global_step2"``): the DP change is noticed, the tag converted, the twin loaded;
  it also saves at step 3, the source of the scale-up 2 -> 4.
* DP=3: the twin now exists and is loaded as is.
* DP=4 with ``"checkpoint": {"load_universal": true}``: the explicit route at the source DP size,
  where stock DeepSpeed dies with ``IndexError`` on rank 3 (tests/system/test_stock_failures.py shows it
  on the very folder the zero case loads here: stock ``ds_to_universal`` output).
* DP=4 from the DP=2 run's step-3 checkpoint: scale up.

After each load the full fp32 and optimizer states equal the source's bit for bit, and the losses
of the continued steps equal the uninterrupted run's (tolerance for bf16 reduction order only).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.integrity import LEGACY_ALGORITHM
from tests.support.dsharness import TrainResult, TrainSpec, run_training
from tests.support.dsharness.stock import stock_ds_to_universal
from tests.support.elastic_support import (
    ElasticRuns,
    assert_losses_continue,
    assert_same_state,
    flip_a_data_bit,
    private_copy,
    resume,
    rewrite_manifest_checksums,
    summary_lines,
    ucp_lines,
)

pytestmark = pytest.mark.slow

OPTIMIZERS = ("bf16", "zero")
CLASSES = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer"}
UNIVERSAL = {"resume_route": "universal"}
"""Every load here takes the universal route (a DP change reshards the native files by default:
tests/system/test_native_reshard.py)."""
NORMS = (
    "language_model.encoder.layers.0.input_layernorm.weight",
    "language_model.encoder.layers.0.post_attention_layernorm.weight",
    "language_model.encoder.final_layernorm.weight",
)
QKV = "language_model.encoder.layers.0.self_attention.query_key_value.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ElasticRuns:
    return ElasticRuns(tmp_path_factory.mktemp("elastic"))


def _source(ds_checkpoint, runs: ElasticRuns, opt: str):
    """The shared DP=4 checkpoint (read-only) and this module's private copy of it."""
    ck = ds_checkpoint(opt, 4)
    assert ck.result.optimizer_class == CLASSES[opt]
    root = runs.get(f"{opt}-root", lambda folder: private_copy(ck.root, folder / "ckpt"))
    return ck, root


def _dp2(ds_checkpoint, runs: ElasticRuns, opt: str) -> TrainResult:
    ck, root = _source(ds_checkpoint, runs, opt)
    return runs.get(
        f"{opt}-dp2",
        lambda f: resume(
            2, opt, root, f, load_tag="global_step2", save_dir=f / "ckpt", plugin_kwargs=UNIVERSAL, save_at=(3,)
        ),
    )


def _dp3(ds_checkpoint, runs: ElasticRuns, opt: str) -> TrainResult:
    _dp2(ds_checkpoint, runs, opt)  # made the twin
    ck, root = _source(ds_checkpoint, runs, opt)
    return runs.get(f"{opt}-dp3", lambda f: resume(3, opt, root, f, load_tag="global_step2", plugin_kwargs=UNIVERSAL))


def _stock_converts(opt: str) -> bool:
    """Stock ds_to_universal converts DeepSpeedZeroOptimizer checkpoints written with per-rank paddings
    (DeepSpeed 0.16.4 on); BF16_Optimizer ones (last-rank-only paddings, every version) never here."""
    import deepspeed
    from packaging.version import Version

    from megatron_ucp.deepspeed.versions import ZERO_PER_RANK_PADDING_SINCE

    return opt == "zero" and Version(Version(deepspeed.__version__).base_version) >= ZERO_PER_RANK_PADDING_SINCE


def _dp4(ds_checkpoint, runs: ElasticRuns, opt: str) -> TrainResult:
    """Explicit route at DP=4 from the stock ds_to_universal output where stock converts the checkpoint
    (zero, DeepSpeed >= 0.16.4), else from ours (stock dies with narrow(): length must be non-negative)."""
    ck, root = _source(ds_checkpoint, runs, opt)

    def make(folder: Path) -> TrainResult:
        if _stock_converts(opt):
            own = private_copy(ck.root, folder / "ckpt")
            stock = stock_ds_to_universal(own / "global_step2", own / "global_step2_universal")
            assert stock.ok, stock.log[-3000:]
        else:
            _dp2(ds_checkpoint, runs, opt)
            own = root
        return resume(4, opt, own, folder, load_tag="global_step2_universal", load_universal=True)

    return runs.get(f"{opt}-dp4", make)


def _scale_up(ds_checkpoint, runs: ElasticRuns, opt: str) -> TrainResult:
    """DP=2's step-3 checkpoint (tag from ``latest``) at DP=4; zero: as 2 nodes of 2, one converter each."""
    dp2 = _dp2(ds_checkpoint, runs, opt)
    saved_at_2 = Path(dp2.dumps["state_step3"]).parent.parent / "ckpt"
    kwargs = {**UNIVERSAL, **({"ranks_per_node": 2} if opt == "zero" else {})}
    return runs.get(
        f"{opt}-up", lambda f: resume(4, opt, private_copy(saved_at_2, f / "ckpt"), f, plugin_kwargs=kwargs)
    )


RESUMES = {2: _dp2, 3: _dp3, 4: _dp4}


# ------------------------------------------------------------------------------------------------
# bit-exact state and continuous loss at every DP size
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_resume_restores_state_bit_for_bit_and_continues(ds_checkpoint, runs, opt: str, dp: int) -> None:
    ck, _ = _source(ds_checkpoint, runs, opt)
    res = RESUMES[dp](ds_checkpoint, runs, opt)
    assert res.optimizer_class == CLASSES[opt]
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"]) == 9 * 4
    assert_losses_continue(res, ck.loss_at)
    summary = summary_lines(res.log)
    assert len(summary) == 1, ucp_lines(res.log)
    assert f"DP 4 -> {dp}" in summary[0] and "every element placed exactly once" in summary[0]
    assert "9 params, 27 state tensors (fp32, exp_avg, exp_avg_sq, step)" in summary[0]
    # our folders carry checksums, so no rank reads a whole parameter; stock's take the logged slower path
    assert ("has no checksums in" in res.log) == (dp == 4 and _stock_converts(opt)), ucp_lines(res.log)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_scale_up_from_2_to_4(ds_checkpoint, runs, opt: str) -> None:
    ck, _ = _source(ds_checkpoint, runs, opt)
    dp2 = _dp2(ds_checkpoint, runs, opt)
    up = _scale_up(ds_checkpoint, runs, opt)
    assert up.loaded_step == 3 and up.steps == [4]
    assert "DP changed 2 -> 4: no global_step3_universal yet, converting global_step3 now" in "\n".join(
        ucp_lines(up.log)
    )
    assert_same_state(dp2.dumps["state_step3"], up.dumps["state_step3_loaded"])
    assert_losses_continue(up, ck.loss_at)
    assert "DP 2 -> 4" in summary_lines(up.log)[0]
    root = Path(up.dumps["state_step3_loaded"]).parent.parent / "ckpt"
    # the tag came from `latest`, so the twin becomes latest_universal
    assert (root / "latest_universal").read_text().strip() == "global_step3_universal"
    if opt == "zero":  # two converters shared the work; rank 0 ran share 1 of 2
        assert "share 1/2" in "\n".join(ucp_lines(up.log))


# ------------------------------------------------------------------------------------------------
# automatic mode, the explicit route, all-padding ranks, training state
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_dp_change_converts_by_itself_then_reuses_the_twin(ds_checkpoint, runs, opt: str) -> None:
    _, root = _source(ds_checkpoint, runs, opt)
    first = "\n".join(ucp_lines(_dp2(ds_checkpoint, runs, opt).log))
    assert (
        "DP changed 4 -> 2: no global_step2_universal yet, converting global_step2 now, then loading "
        "global_step2_universal"
    ) in first
    assert (root / "global_step2_universal" / "ucp_manifest.json").is_file()
    # an explicitly requested tag does not move latest_universal
    assert not (root / "latest_universal").exists()
    second = "\n".join(ucp_lines(_dp3(ds_checkpoint, runs, opt).log))
    assert "DP changed 4 -> 3: loading global_step2_universal" in second
    assert "converting" not in second


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_explicit_flag_loads_at_source_dp_with_an_all_padding_rank(ds_checkpoint, runs, opt: str) -> None:
    res = _dp4(ds_checkpoint, runs, opt)
    lines = "\n".join(ucp_lines(res.log))
    assert "load_universal is set: loading global_step2_universal in universal mode at DP=4" in lines
    if opt == "zero":
        assert "no megatron-ucp manifest" not in lines  # explicit route: the user chose the folder
    ranks = [torch.load(res.dumps[f"rank{r}_step2_loaded"], weights_only=False) for r in range(4)]
    # rank 3 holds only padding of the norm group: it still has every state (zeros) and the step
    padding_rank = ranks[3]["optim_state"][1]
    assert set(padding_rank) == {"exp_avg", "exp_avg_sq", "step"}
    assert not padding_rank["exp_avg"].any() and not padding_rank["exp_avg_sq"].any()
    assert torch.equal(padding_rank["step"], ranks[0]["optim_state"][1]["step"])
    assert all(r["param_groups"] == ranks[0]["param_groups"] for r in ranks)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_training_state_is_restored(ds_checkpoint, runs, opt: str) -> None:
    ck, _ = _source(ds_checkpoint, runs, opt)
    saved = torch.load(ck.dump("rank0_step2"), weights_only=False)
    loaded = torch.load(_dp3(ds_checkpoint, runs, opt).dumps["rank0_step2_loaded"], weights_only=False)
    for key in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps", "param_groups"):
        assert loaded[key] == saved[key], key
    summary = summary_lines(_dp3(ds_checkpoint, runs, opt).log)[0]
    assert "global_steps=2 global_samples=24 skipped_steps=0" in summary and "lr scheduler restored" in summary


# ------------------------------------------------------------------------------------------------
# strictness: a damaged universal folder is an error naming parameter and state
# ------------------------------------------------------------------------------------------------

EXTRA = "language_model.encoder.layers.7.mlp.dense_h_to_4h.weight"


def _damaged(ds_checkpoint, runs: ElasticRuns) -> Path:
    """A copy of the bf16 root whose universal twin lacks one state file, has a stray parameter folder,
    and has no exp_avg_sq for the norm group (a state AdamW would otherwise create lazily)."""
    _dp2(ds_checkpoint, runs, "bf16")
    _, root = _source(ds_checkpoint, runs, "bf16")

    def make(folder: Path) -> Path:
        copy = private_copy(root, folder / "ckpt")
        zero = copy / "global_step2_universal" / "zero"
        (zero / QKV / "exp_avg.pt").unlink()
        shutil.copytree(zero / NORMS[0], zero / EXTRA)
        for norm in NORMS:
            (zero / norm / "exp_avg_sq.pt").unlink()
        return copy

    return runs.get("damaged", make)


def _strict_run(ds_checkpoint, runs: ElasticRuns, strict: bool) -> TrainResult:
    """DP=1 loads of the damaged twin; the non-strict one also halves the global batch (12 -> 6)."""
    damaged = _damaged(ds_checkpoint, runs)
    return runs.get(
        f"damaged-strict{int(strict)}",
        lambda f: run_training(
            TrainSpec(
                dp=1,
                optimizer="bf16",
                steps=3,
                load_dir=damaged,
                load_tag="global_step2",
                plugin=True,
                plugin_kwargs={"strict": strict, **UNIVERSAL},
                expect_failure=strict,
                global_batch=12 if strict else 6,
                timeout=600,
            )
        ),
    )


@pytest.mark.parametrize("what", ["missing state file", "extra folder", "lazily created state"])
def test_strict_load_names_every_unaccounted_tensor(ds_checkpoint, runs, what: str) -> None:
    res = _strict_run(ds_checkpoint, runs, strict=True)
    assert res.returncode != 0 and res.losses == []
    assert "AccountingError" in res.log and "3 problem(s)" in res.log, res.log[-4000:]
    expected = {
        "missing state file": f"state file missing: parameter '{QKV}', state 'exp_avg'",
        "extra folder": f"checkpoint folder without a parameter: parameter '{EXTRA}'",
        "lazily created state": f"live optimizer state not restored: parameter '{NORMS[0]}', state 'exp_avg_sq'",
    }[what]
    assert expected in res.log, res.log[-4000:]


def test_non_strict_load_warns_and_continues(ds_checkpoint, runs) -> None:
    res = _strict_run(ds_checkpoint, runs, strict=False)
    assert res.ok and res.steps == [3]
    warnings = [line for line in ucp_lines(res.log) if "strict=False, continuing" in line]
    assert len(warnings) == 3, ucp_lines(res.log)
    assert "3 PROBLEM(S)" in summary_lines(res.log)[0]


def test_changed_global_batch_is_warned_about_loudly(ds_checkpoint, runs) -> None:
    res = _strict_run(ds_checkpoint, runs, strict=False)
    batch = [line for line in ucp_lines(res.log) if "GLOBAL BATCH CHANGED" in line]
    assert len(batch) == 1, ucp_lines(res.log)
    assert "global batch of 12 (DP=4)" in batch[0] and "this run uses 6 (DP=1)" in batch[0]
    # consumed samples keep counting in the checkpoint's batch
    assert "global_steps=2 global_samples=24" in summary_lines(res.log)[0]


# ------------------------------------------------------------------------------------------------
# install / uninstall (in-process, no training)
# ------------------------------------------------------------------------------------------------


def test_install_patches_both_load_paths_and_uninstall_restores_them(monkeypatch) -> None:
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

    import megatron_ucp
    from megatron_ucp.errors import UnsupportedError

    before = (DeepSpeedEngine.load_checkpoint, ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir)
    megatron_ucp.install(record_true_lengths=False, async_convert=False)
    try:
        assert DeepSpeedEngine.load_checkpoint is not before[0]
        assert ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir is not before[1]
    finally:
        megatron_ucp.uninstall()
    assert (DeepSpeedEngine.load_checkpoint, ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir) == before

    monkeypatch.delattr(ZeROOptimizer, "load_hp_checkpoint_state_from_checkpoint_dir")
    with pytest.raises(UnsupportedError, match="load_hp_checkpoint_state_from_checkpoint_dir"):
        megatron_ucp.install(record_true_lengths=False, async_convert=False)
    assert megatron_ucp.active_config() is None and DeepSpeedEngine.load_checkpoint is before[0]


# ------------------------------------------------------------------------------------------------
# Megatron's vocabulary trimming; buffers and frozen parameters
# ------------------------------------------------------------------------------------------------

EMBEDDING = "language_model.embedding.word_embeddings.weight"


def test_padded_vocabulary_rows_survive_the_round_trip(ds_checkpoint, runs) -> None:
    """With Megatron's universal_checkpoint_info the converter trims the vocabulary tensor to
    original_vocab_size (as DeepSpeed does, so stock's loader reads it) and keeps the padded rows
    beside it; the load puts them back: every element of every state, padded rows included, equals
    the saved one, and the accounting counts them."""
    ck = ds_checkpoint("bf16", 4, uc_info=True)
    root = runs.get("vocab-root", lambda f: private_copy(ck.root, f / "ckpt"))
    res = runs.get("vocab-dp2", lambda f: resume(2, "bf16", root, f, load_tag="global_step2", plugin_kwargs=UNIVERSAL))
    saved = torch.load(ck.dump("state_step2"), weights_only=False)
    assert_same_state(ck.dump("state_step2"), res.dumps["state_step2_loaded"])
    entry = torch.load(root / "global_step2_universal" / "zero" / EMBEDDING / "fp32.pt", weights_only=False)
    assert entry["param"].shape[0] < saved[EMBEDDING]["fp32"].shape[0]
    assert entry["param"].shape[0] + entry[F.VOCAB_PADDED_ROWS].shape[0] == saved[EMBEDDING]["fp32"].shape[0]
    assert_losses_continue(res, ck.loss_at)
    summary = summary_lines(res.log)[0]
    assert "every element placed exactly once" in summary and "1503 elements" in summary


def test_layout_restores_kept_rows_and_zero_fills_without_them() -> None:
    """Unit view of the vocabulary rule: rows kept by megatron-ucp come back exactly, up to the
    smaller of the saved and the new padded size; a folder without them (stock's) zero-fills them
    and does not count them. Any fragment, also one straddling the kept rows, is cut out without
    building the whole tensor."""
    from megatron_ucp.integration.resume.universal.state_layout import state_layout as _layout
    from megatron_ucp.plan.accounting import checksum

    def whole(layout):
        return layout.narrow(0, layout.numel)

    lp = (5, 2)  # the whole live parameter's shape
    trimmed, rows = torch.arange(6.0).view(3, 2), torch.arange(6.0, 10.0).view(2, 2)
    layout = _layout(trimmed, {F.VOCAB_TENSOR: True, F.VOCAB_PADDED_ROWS: rows}, lp, "w", "fp32", Path("f"))
    assert layout.held == 10 and layout.rows_restored and whole(layout).tolist() == list(range(10))
    assert layout.narrow(4, 4).tolist() == [4, 5, 6, 7]  # straddles the two pieces
    assert layout.narrow(0, 3).data_ptr() == trimmed.data_ptr()  # inside one piece: a view, no copy
    assert layout.source_sum() == checksum(torch.arange(10.0))
    layout = _layout(trimmed, {F.VOCAB_TENSOR: True}, lp, "w", "fp32", Path("f"))
    assert layout.held == 6 and whole(layout).tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    assert layout.narrow(5, 3).tolist() == [5, 0, 0] and layout.source_sum() == checksum(torch.arange(6.0))
    more_rows = torch.arange(6.0, 12.0).view(3, 2)  # saved at a larger padded size (TP 2 -> 1): the first 2 rows
    layout = _layout(trimmed, {F.VOCAB_TENSOR: True, F.VOCAB_PADDED_ROWS: more_rows}, lp, "w", "fp32", Path("f"))
    assert layout.held == 10 and layout.rows_cut and whole(layout).tolist() == list(range(10))
    layout = _layout(trimmed, {F.VOCAB_TENSOR: True, F.VOCAB_PADDED_ROWS: rows}, (6, 2), "w", "fp32", Path("f"))
    assert layout.held == 10 and not layout.rows_cut  # a smaller padded size (TP 1 -> 2): the new row is zero
    assert whole(layout).tolist() == [*range(10), 0, 0]
    with pytest.raises(CheckpointFormatError, match="shape"):
        _layout(torch.zeros(2, 5), {}, lp, "w", "fp32", Path("f"))  # same numel, transposed


def test_buffers_and_frozen_parameters_are_restored(tmp_path: Path) -> None:
    from megatron_ucp.integration.resume.finish import restore_module_tensors

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trained = torch.nn.Linear(2, 2)
            self.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
            self.other_frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
            self.register_buffer("running", torch.zeros(4))
            self.register_buffer("scratch", torch.zeros(1), persistent=False)

    net = Net()
    (tmp_path / "zero" / "frozen").mkdir(parents=True)
    torch.save({"param": torch.tensor([1.0, 2.0, 3.0])}, tmp_path / "zero" / "frozen" / "fp32.pt")
    states = {"module": {"running": torch.arange(4.0), "other_frozen": torch.tensor([5.0, 6.0])}}
    problems, extras = restore_module_tensors(net, {"trained.weight", "trained.bias"}, tmp_path, states)
    assert problems == [] and extras == ["1 buffers, 2 frozen params restored"]
    assert net.frozen.tolist() == [1.0, 2.0, 3.0] and net.other_frozen.tolist() == [5.0, 6.0]
    assert net.running.tolist() == [0.0, 1.0, 2.0, 3.0]

    # A persistent buffer the checkpoint lacks would keep its initial value: an error, like a frozen
    # parameter the checkpoint lacks; a non-persistent one ("scratch") is part of no checkpoint.
    problems, extras = restore_module_tensors(Net(), {"trained.weight", "trained.bias"}, tmp_path, {"module": {}})
    assert {(p.param, p.state) for p in problems} == {("other_frozen", "fp32"), ("running", "buffer")}
    assert "persistent buffer missing" in next(p.detail for p in problems if p.param == "running")

    class MegatronNet(Net):  # Megatron's save leaves "running" out (as it does RoPE's inv_freq): listed, no error
        def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
            return {k: v for k, v in self.state_dict(prefix=prefix, keep_vars=keep_vars).items() if k != "running"}

    problems, extras = restore_module_tensors(
        MegatronNet(),
        {"trained.weight", "trained.bias"},
        tmp_path,
        {"module": {"other_frozen": torch.tensor([5.0, 6.0])}},
    )
    assert problems == [] and any("Megatron's save never writes" in e and "running" in e for e in extras)

    # Held, but of another shape: an error naming it.
    states = {"module": {"running": torch.zeros(5), "other_frozen": torch.tensor([5.0, 6.0])}}
    problems, _ = restore_module_tensors(Net(), {"trained.weight", "trained.bias"}, tmp_path, states)
    assert [(p.param, p.state) for p in problems] == [("running", "buffer")] and "(5,)" in problems[0].detail


def test_megatron_nested_module_states_are_flattened(tmp_path: Path) -> None:
    """Megatron-DeepSpeed saves ``state_dict_for_save_checkpoint``: dicts of dicts."""
    from megatron_ucp.deepspeed.reader import flatten_module_states
    from megatron_ucp.integration.resume.finish import restore_module_tensors

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.zeros(3))
            self.register_buffer("inv_freq", torch.ones(2))

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language_model = Inner()

        def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
            return {"language_model": {"table": self.language_model.table}}  # inv_freq left out, as Megatron does

    nested = {"language_model": {"table": torch.arange(3.0)}}
    assert set(flatten_module_states(nested)) == {"language_model.table"}
    net = Outer()
    problems, extras = restore_module_tensors(net, set(), tmp_path, {"module": nested})
    assert problems == [] and net.language_model.table.tolist() == [0.0, 1.0, 2.0]
    assert any("language_model.inv_freq" in e for e in extras)


def test_buffers_saved_by_the_pipeline_model_reach_the_non_pipeline_one(tmp_path: Path) -> None:
    """GPTModelPipe saves module tensors per layer file; a GPTModel resuming from it gets them through the name map."""
    from megatron_ucp.integration.resume.finish import restore_module_tensors

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Linear(2, 2, bias=False)
            self.register_buffer("window", torch.zeros(3))

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    class Gpt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language_model = torch.nn.Module()
            self.language_model.encoder = Encoder()

    for index in (2, 3):  # pipeline layers 2 and 3 are transformer layers 0 and 1
        torch.save(
            {"mlp.weight": torch.zeros(2, 2), "window": torch.full((3,), float(index))},
            tmp_path / f"layer_{index:02d}-model_00-model_states.pt",
        )
        (tmp_path / "zero" / f"{index}.mlp.weight").mkdir(parents=True)
    net = Gpt()
    optimized = {n for n, _ in net.named_parameters()}
    problems, extras = restore_module_tensors(net, optimized, tmp_path, {"module": None})
    assert problems == [] and extras == ["2 buffers, 0 frozen params restored"]
    assert [layer.window.tolist() for layer in net.language_model.encoder.layers] == [[2.0] * 3, [3.0] * 3]


@pytest.mark.parametrize(
    "damage", ["transposed fp32", "truncated model states", "bit rot in exp_avg", "bit rot in exp_avg, v2 manifest"]
)
def test_a_damaged_universal_folder_is_refused_naming_the_file(ds_checkpoint, runs, damage: str) -> None:
    """A universal fp32.pt replaced by its transpose (same element count) must not load as if it were
    the parameter; a truncated model-states file is named, not reported as a raw zip error; one flipped
    bit in a state file that torch.load reads without complaint fails the manifest's checksum."""
    _dp2(ds_checkpoint, runs, "bf16")
    _, root = _source(ds_checkpoint, runs, "bf16")

    def make(folder: Path) -> TrainResult:
        copy = private_copy(root, folder / "ckpt")
        uni = copy / "global_step2_universal"
        if damage == "transposed fp32":
            victim = uni / "zero" / QKV / "fp32.pt"
            entry = torch.load(victim, weights_only=False)
            entry["param"] = entry["param"].t().contiguous()
            torch.save(entry, victim)
        elif damage.startswith("bit rot in exp_avg"):
            if damage.endswith("v2 manifest"):  # converted before ucp-wsum64-v3: checked with v2 on both sides
                rewrite_manifest_checksums(uni, LEGACY_ALGORITHM)
            victim = uni / "zero" / QKV / "exp_avg.pt"
            flip_a_data_bit(victim)
        else:
            victim = uni / F.MODEL_STATES_FILE
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        res = run_training(
            TrainSpec(
                dp=2,
                optimizer="bf16",
                steps=3,
                load_dir=copy,
                load_tag="global_step2",
                plugin=True,
                plugin_kwargs=UNIVERSAL,
                expect_failure=True,
                timeout=600,
            )
        )
        return res, victim

    res, victim = runs.get(f"damaged-{damage}", make)
    assert res.returncode != 0 and res.losses == [], res.log[-3000:]
    if damage.startswith("bit rot in exp_avg"):  # the one damaged file, not every file (a wrong algorithm would)
        mismatches = re.findall(r"checksum mismatch: parameter '([^']+)', state '([^']+)'", res.log)
        assert set(mismatches) == {(QKV, "exp_avg")}, res.log[-3000:]
        return
    assert str(victim) in res.log and ("shape" in res.log or "damaged" in res.log), res.log[-3000:]
