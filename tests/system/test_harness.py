"""The test harness itself: model and data invariants (fast), what real DeepSpeed writes for each
optimizer class (the facts the converter relies on), and that a same-DP resume is exact."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from tests.support.dsharness import (
    TrainSpec,
    build_model,
    global_batch_tokens,
    param_group_names,
    rank_batch,
    run_training,
    tiny_model_param_groups,
)
from tests.support.dsharness.checkpoints import Geometry, group_numels, model_states_file, rank_file

MEGATRON_NAMES = [
    "language_model.embedding.word_embeddings.weight",
    "language_model.encoder.layers.0.input_layernorm.weight",
    "language_model.encoder.layers.0.self_attention.query_key_value.weight",
    "language_model.encoder.layers.0.self_attention.dense.weight",
    "language_model.encoder.layers.0.post_attention_layernorm.weight",
    "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight",
    "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight",
    "language_model.encoder.final_layernorm.weight",
    "language_model.output_layer.weight",
]
NORMS = [n for n in MEGATRON_NAMES if n.endswith("layernorm.weight")]


# --- fast: no DeepSpeed -------------------------------------------------------------------------


def test_model_has_megatron_names_and_groups() -> None:
    model = build_model()
    assert [n for n, _ in model.named_parameters()] == MEGATRON_NAMES
    wd, no_wd = param_group_names(model)
    assert no_wd == NORMS
    assert wd == [n for n in MEGATRON_NAMES if n not in NORMS]
    groups = tiny_model_param_groups(model)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert group_numels() == [sum(p.numel() for p in g["params"]) for g in groups] == [492, 9]
    assert torch.equal(build_model().language_model.output_layer.weight, model.language_model.output_layer.weight)
    g = Geometry(9, 4)
    assert g.padded - g.numel > g.partition  # the DP=768 situation in miniature


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6])
def test_data_does_not_depend_on_dp(dp: int) -> None:
    for step in (0, 3):
        full = global_batch_tokens(step, 12, 4, 64, 1234)
        parts = [rank_batch(step, r, dp, 12, 4, 64, 1234) for r in range(dp)]
        tokens = torch.cat([t for t, _ in parts])
        labels = torch.cat([lab for _, lab in parts])
        assert torch.equal(tokens, full[:, :-1]) and torch.equal(labels, full[:, 1:])
        assert int(full.max()) < 60  # original_vocab_size: padded vocabulary rows never used
    assert not torch.equal(global_batch_tokens(0, 12, 4, 64, 1234), global_batch_tokens(1, 12, 4, 64, 1234))


def test_spec_validation_and_json_round_trip(tmp_path: Path) -> None:
    spec = TrainSpec(dp=3, optimizer="zero", zero_stage=2, save_dir=str(tmp_path), save_at=[2], extra_config={"a": 1})
    assert spec.save_dir == tmp_path and spec.save_at == (2,)
    assert TrainSpec.from_json(spec.to_json()) == spec
    for bad in (
        dict(optimizer="adam"),
        dict(optimizer="bf16", zero_stage=2),
        dict(dp=5),
        dict(save_at=(2,)),
        dict(load_universal=True),
        dict(zero_stage=3),
    ):
        with pytest.raises(ValueError):
            TrainSpec(**bad)


def test_launcher_reports_failure(tmp_path: Path) -> None:
    """A rank that cannot start: RuntimeError with the log, or a result with expect_failure."""
    with pytest.raises(RuntimeError, match="exit"):
        run_training(TrainSpec(dp=2, steps=1, python="/bin/false"))
    res = run_training(TrainSpec(dp=2, steps=1, python="/bin/false", expect_failure=True))
    assert res.returncode != 0 and res.losses == []


def test_launcher_kills_on_timeout(tmp_path: Path) -> None:
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(sleeper.stat().st_mode | stat.S_IEXEC)
    res = run_training(TrainSpec(dp=2, steps=1, python=str(sleeper), timeout=1, expect_failure=True))
    assert res.returncode == 124 and "timeout" in res.log  # killed: a sleeper that ran out its 60 s exits 0


# --- real DeepSpeed runs (cached per session) ----------------------------------------------------


def _rank_files(tag_dir: Path) -> list[dict]:
    return [
        torch.load(rank_file(tag_dir, r), map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for r in range(4)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,cls", [("bf16", "BF16_Optimizer"), ("zero", "DeepSpeedZeroOptimizer")])
def test_checkpoint_files_and_dumps(ds_checkpoint, optimizer: str, cls: str) -> None:
    ck = ds_checkpoint(optimizer, 4)
    res = ck.result
    assert res.optimizer_class == cls and res.ds_version == "0.19.8"
    assert res.steps == [1, 2, 3, 4] and len(res.losses) == 4 and all(x == x for x in res.losses)
    assert (ck.root / "latest").read_text().strip() == "global_step4"
    for step in (2, 4):
        tag = ck.tag_dir(step)
        assert model_states_file(tag).is_file()
        assert all(rank_file(tag, r).is_file() for r in range(4))
    osds = _rank_files(ck.tag_dir(2))
    # What stock DeepSpeed 0.19.8 records (docs/how-it-works.md): BF16_Optimizer puts the whole padding
    # on the last rank and saves full-length fp32 partitions; ZeRO records per-rank padding and saves
    # fp32 partitions cut to their true length.
    if optimizer == "bf16":
        assert [o["group_paddings"] for o in osds] == [[0, 0], [0, 0], [0, 0], [4, 7]]
        assert [[t.numel() for t in o["single_partition_of_fp32_groups"]] for o in osds] == [[124, 4]] * 4
    else:
        assert [o["group_paddings"] for o in osds] == [[0, 0], [0, 0], [0, 3], [4, 4]]
        assert [[t.numel() for t in o["single_partition_of_fp32_groups"]] for o in osds] == [
            [124, 4],
            [124, 4],
            [124, 1],
            [120, 0],
        ]
    assert [sorted(o["param_slice_mappings"][1]) for o in osds] == [
        sorted(NORMS[:2]),
        sorted(NORMS[1:]),
        [NORMS[2]],
        [],
    ]

    # Dumps: the full per-parameter states are the concatenation of the ranks' true fragments.
    full = torch.load(ck.dump("state_step2"))
    assert list(full) == MEGATRON_NAMES
    ranks = [torch.load(ck.dump(f"rank{r}_step2")) for r in range(4)]
    for g, names in enumerate(res.info["group_names"]):
        n = sum(full[name]["fp32"].numel() for name in names)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            flat = torch.cat([(rk["fp32"][g] if key == "fp32" else rk["optim_state"][g][key]) for rk in ranks])
            want = torch.cat([full[name][key].reshape(-1) for name in names])
            assert torch.equal(flat[:n], want), (g, key)
        assert all(float(full[name]["step"]) == 2 for name in names)
    assert ranks[0]["lr_scheduler"] == {"last_batch_iteration": 1}
    assert ranks[0]["global_samples"] == 24
    # DeepSpeedZeroOptimizer links optimizer-state views only for param group 0 (see worker.dump).
    report = res.info["dumps"]["state_step2"]
    assert report["safe_get_differs"] == []
    assert bool(report["safe_get_unavailable"]) == (optimizer == "zero")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["bf16", "zero"])
def test_resume_same_dp_is_exact(ds_checkpoint, optimizer: str, tmp_path: Path) -> None:
    ck = ds_checkpoint(optimizer, 4)
    res = run_training(
        TrainSpec(
            dp=4, optimizer=optimizer, steps=4, load_dir=ck.root, load_tag="global_step2", dump_dir=tmp_path / "dumps"
        )
    )
    assert res.loaded_step == 2 and res.steps == [3, 4]
    assert res.losses == [ck.loss_at(3), ck.loss_at(4)]  # same DP, same reduction order: bit-exact
    saved, loaded = torch.load(ck.dump("state_step2")), torch.load(res.dumps["state_step2_loaded"])
    for name in MEGATRON_NAMES:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[name][key], loaded[name][key]), f"{name}/{key}"
    for r in range(4):
        a, b = torch.load(ck.dump(f"rank{r}_step2")), torch.load(res.dumps[f"rank{r}_step2_loaded"])
        assert all(torch.equal(x, y) for x, y in zip(a["fp32"], b["fp32"], strict=True))
        assert a["lr_scheduler"] == b["lr_scheduler"] and a["global_samples"] == b["global_samples"]


@pytest.mark.slow
def test_zero_stage2_runs(tmp_path: Path) -> None:
    res = run_training(TrainSpec(dp=2, optimizer="zero", zero_stage=2, steps=2, save_dir=tmp_path / "ck", save_at=(2,)))
    assert res.optimizer_class == "DeepSpeedZeroOptimizer"
    osd = torch.load(rank_file(tmp_path / "ck" / "global_step2", 1), weights_only=False)["optimizer_state_dict"]
    assert osd["zero_stage"] == 2


# --- committed DeepSpeed 0.16.2 fixtures (no DeepSpeed run) ---------------------------------------


@pytest.mark.parametrize(
    "name,cls", [("bf16_optimizer", "BF16_Optimizer"), ("zero_optimizer", "DeepSpeedZeroOptimizer")]
)
def test_legacy_fixture_is_consistent(legacy_fixture, name: str, cls: str) -> None:
    """The 0.16.2 files show the legacy defects, and the reference equals their real fragments."""
    fx = legacy_fixture(name)
    assert fx.facts["optimizer_class"] == cls and fx.tag_dir.name == "global_step2"
    osds = _rank_files(fx.tag_dir)
    assert {o["ds_version"] for o in osds} == {"0.16.2"}
    # 0.16.2: the whole padding on the last rank, for both classes ...
    assert [o["group_paddings"] for o in osds] == [[0, 0], [0, 0], [0, 0], [4, 7]]
    # ... and ZeRO cut the last rank's fp32 with it: group 1 keeps 4 - 7 -> [:-3] = 1 element.
    fp32_lengths = [[t.numel() for t in o["single_partition_of_fp32_groups"]] for o in osds]
    assert fp32_lengths == ([[124, 4]] * 4 if name == "bf16_optimizer" else [[124, 4]] * 3 + [[120, 1]])
    reference = torch.load(fx.reference)
    assert list(reference) == MEGATRON_NAMES
    offset = {n: 0 for n in MEGATRON_NAMES}  # a parameter's fragments follow each other in rank order
    for o in osds:
        state = o["base_optimizer_state"]["state"]
        for g, mappings in enumerate(o["param_slice_mappings"]):
            for pname, frag in mappings.items():
                for key in ("fp32", "exp_avg", "exp_avg_sq"):
                    src = o["single_partition_of_fp32_groups"][g] if key == "fp32" else state[g][key]
                    want = reference[pname][key].reshape(-1).narrow(0, offset[pname], frag.numel)
                    assert torch.equal(src.narrow(0, frag.start, frag.numel), want), (pname, key)
                offset[pname] += frag.numel
    assert offset == {n: reference[n]["fp32"].numel() for n in MEGATRON_NAMES}
    model_states = torch.load(fx.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    assert model_states["universal_checkpoint_info"]["original_vocab_size"] == 60
