"""The synthetic-checkpoint writer tells the truth: its files are a real DeepSpeed save's, key for key.

* against real saves: the committed DeepSpeed 0.16.2 checkpoints (both optimizer classes, stock)
  and the session's 0.19.x harness trainings (stock and with the hooks, ZeRO-1 and ZeRO-2), every
  file name, key, tensor shape, dtype, storage size and geometry field equal (values a run
  decides, and the harness's own client state, aside). The same comparison runs on every release
  of the matrix (``test_deepspeed_versions``) and against the real Megatron-DeepSpeed
  (``tests/integration``);
* our conversion of a synthetic checkpoint equals an independent rebuild from its rank files (a
  plain concatenation of the partitions), at DP 8 and at DP 768 where most ranks hold only
  padding, and the two DP sizes give byte-identical universal folders; the same for the pipeline
  model at TP=2 x PP=2 with a tied embedding, merged across TP and stages by an independent merge,
  its replicas (TP-replicated norms, the tied embedding on both stages) identical as a run's are;
* the pipeline stages are DeepSpeed's own ``type:transformer`` split (against
  ``deepspeed.runtime.utils.partition_balanced``, every layer count and stage count up to 48 x 8).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import read_manifest
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.llama_shapes import LlamaShape
from megatron_ucp.synthetic.content import SyntheticSpec
from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS
from megatron_ucp.synthetic.writer import write_checkpoint
from tests.support.dsharness.checkpoints import legacy_fixture
from tests.support.file_structure import folder_differences, load

HARNESS = LlamaShape(layers=1, hidden=3, ffn=12, heads=1, vocab=64, original_vocab=60, swiglu=False)
"""The harness's TinyGPT (tests/support/dsharness/model.py) as a llama shape: no SwiGLU, one head."""
HARNESS_CLIENT_STATE = ("iteration", "universal_checkpoint_info")
"""What the harness adds to the model states (not DeepSpeed, not Megatron): left out of the comparison,
with its DeepSpeed config (the MDS comparison in tests/integration holds ``ds_config`` too)."""


def harness_spec(optimizer: str, stage: int, record: bool, ds_version: str, dp: int = 4, step: int = 2):
    return SyntheticSpec(
        shape=HARNESS,
        dp=dp,
        optimizer=optimizer,
        zero_stage=stage,
        record=record,
        flavour="plain",
        iteration=step,
        ds_version=ds_version,
        micro_batch=12 // dp,
    )


def assert_same_files(real_tag: Path, spec: SyntheticSpec, tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path / "synthetic", spec, progress=False)
    diffs = folder_differences(real_tag, written.tag_dir, ignore=["/ds_config"], drop=HARNESS_CLIENT_STATE)
    assert not diffs, "\n".join(diffs[:40])


@pytest.mark.parametrize("name", ["bf16_optimizer", "zero_optimizer"])
def test_synthetic_matches_deepspeed_0_16_2(name: str, tmp_path: Path):
    fixture = legacy_fixture(name)
    optimizer = "bf16" if name == "bf16_optimizer" else "zero"
    assert_same_files(fixture.tag_dir, harness_spec(optimizer, 1, False, "0.16.2"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer,stage,plugin", [("bf16", 1, False), ("zero", 1, False), ("bf16", 1, True), ("zero", 2, True)]
)
def test_synthetic_matches_the_installed_release(
    ds_checkpoint, tmp_path: Path, optimizer: str, stage: int, plugin: bool
):
    import deepspeed

    ck = ds_checkpoint(optimizer=optimizer, dp=4, plugin=plugin, **({"zero_stage": 2} if stage == 2 else {}))
    spec = harness_spec(optimizer, stage, plugin, deepspeed.__version__)
    assert_same_files(ck.tag_dir(2), spec, tmp_path)


SMALL = LlamaShape(layers=2, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=40, original_vocab=37)
"""1,616 elements in the weight-decay group and 40 in the norms: at DP 768 (S = 2 and 1) most ranks
of both groups hold only padding."""


def rebuild(tag_dir: Path, spec: SyntheticSpec, mp_rank: int = 0) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's fp32 and per-element optimizer states from one model-parallel rank's files alone:
    concatenate the partitions (each stored tensor zero-filled to the partition size), then cut in
    ``param_shapes`` order."""
    states = ("fp32", *BASE_OPTIMIZERS[spec.base_optimizer][0])
    flats: dict[tuple[int, str], list[torch.Tensor]] = {}
    for r in range(spec.dp):
        sd = load(tag_dir / f"bf16_zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_optim_states.pt")[F.OPTIMIZER_STATE_DICT]
        for g, master in enumerate(sd[F.SINGLE_PARTITION_OF_FP32_GROUPS]):
            size = sd[F.BASE_OPTIMIZER_STATE]["state"][g][states[1]].numel()
            pieces = {"fp32": master, **{s: sd[F.BASE_OPTIMIZER_STATE]["state"][g][s] for s in states[1:]}}
            for state, t in pieces.items():
                full = torch.zeros(size)
                full[: min(t.numel(), size)] = t[:size]
                flats.setdefault((g, state), []).append(full)
    shapes = load(tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")[F.PARAM_SHAPES]
    out = {}
    for g, group in enumerate(shapes):
        for state in states:
            flat, offset = torch.cat(flats[(g, state)]), 0
            for name, shape in group.items():
                out[(name, state)] = flat[offset : offset + shape.numel()].view(shape)
                offset += shape.numel()
    return out


@pytest.mark.parametrize(
    "optimizer,ds_version,base", [("bf16", "0.19.8", "adam"), ("zero", "0.16.2", "adam"), ("bf16", "0.19.8", "muon")]
)
def test_conversion_of_a_synthetic_checkpoint_equals_an_independent_rebuild(
    tmp_path: Path, optimizer: str, ds_version: str, base: str
):
    outputs = []
    for dp in (8, 768):
        spec = SyntheticSpec(
            shape=SMALL, dp=dp, optimizer=optimizer, ds_version=ds_version, iteration=7, base_optimizer=base
        )
        root = tmp_path / f"dp{dp}"
        written = write_checkpoint(root, spec, progress=False)
        convert(ConvertOptions(source=root, progress=False))
        universal = root / F.universal_tag(spec.tag)
        expected = rebuild(written.tag_dir, spec)
        for (name, state), want in expected.items():
            entry = torch.load(universal / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)
            got = entry[F.PARAM]
            if F.VOCAB_PADDED_ROWS in entry:  # the padded vocabulary rows, kept beside the trimmed tensor
                assert got.shape[0] == SMALL.original_vocab
                got = torch.cat([got, entry[F.VOCAB_PADDED_ROWS]])
            assert torch.equal(got, want), (dp, name, state)
            assert want.abs().sum() > 0, (dp, name, state)  # real values, not a zero-filled hole
        common = torch.load(universal / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE, weights_only=False)
        scalars = {g: {"use_muon": ("value", False)} for g in range(2)} if base == "muon" else None
        assert common.get(F.UCP_PARTITION_SCALARS) == scalars  # Muon's flag, once per param group
        outputs.append(universal)
    zero = outputs[0] / F.UNIVERSAL_ZERO_DIR
    files = sorted(p.relative_to(outputs[0]) for p in zero.glob("*/*.pt"))
    assert len(files) == 4 * sum(len(g) for g in SMALL.param_groups())
    for path in files:  # every parameter's state files, whatever DP the checkpoint was saved at
        assert (outputs[0] / path).read_bytes() == (outputs[1] / path).read_bytes(), path


def _universal_state(universal: Path, name: str, state: str) -> torch.Tensor:
    entry = torch.load(universal / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)
    got = entry[F.PARAM]
    if F.VOCAB_PADDED_ROWS in entry:  # the padded vocabulary rows, kept beside the trimmed tensor
        got = torch.cat([got, entry[F.VOCAB_PADDED_ROWS]])
    return got


def _tp_merge(slices: list[torch.Tensor], name: str) -> torch.Tensor:
    """Megatron's TP split undone by hand: norms replicated, row-parallel matrices on dim 1, SwiGLU's
    stacked halves half by half, the rest on dim 0."""
    if slices[0].dim() == 1:
        assert all(torch.equal(s, slices[0]) for s in slices), name  # replicas, as a run holds them
        return slices[0]
    if name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
        return torch.cat(slices, dim=1)
    if name.endswith("mlp.dense_h_to_4h.weight"):
        halves = [s.chunk(2, dim=0) for s in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(slices)


def test_pipeline_checkpoint_converts_to_an_independent_merge(tmp_path: Path):
    """GPTModelPipe at TP=2 x PP=2 x DP=3, tied embedding: the universal state of every parameter is
    the TP merge of the stages' rebuilt partitions; the tied embedding is the same on both stages,
    and the converter finds no drifted replica."""
    shape = LlamaShape(layers=3, hidden=8, ffn=16, heads=2, kv_heads=2, vocab=40, original_vocab=37, tied=True)
    spec = SyntheticSpec(shape=shape, dp=3, tp=2, pp=2, pipeline=True, optimizer="bf16", iteration=5)
    written = write_checkpoint(tmp_path, spec, progress=False)
    assert len(list(written.tag_dir.glob("layer_*-model_*-model_states.pt"))) == 2 * (1 + 3 + 1)
    convert(ConvertOptions(source=tmp_path, progress=False))
    universal = tmp_path / F.universal_tag(spec.tag)
    manifest = read_manifest(universal)
    assert "replica_drift" not in manifest, manifest["replica_drift"]
    per_stage = [[rebuild(written.tag_dir, spec, stage * 2 + tp) for tp in range(2)] for stage in range(2)]
    tied = [key for key in per_stage[0][0] if key[0].startswith("tied_modules.")]
    assert len(tied) == 3
    for key in tied:  # each stage's copy, TP rank by TP rank
        assert all(torch.equal(per_stage[0][tp][key], per_stage[1][tp][key]) for tp in range(2)), key
    checked = set()
    for stage in range(2):
        for key in per_stage[stage][0]:
            want = _tp_merge([per_stage[stage][tp][key] for tp in range(2)], key[0])
            assert torch.equal(_universal_state(universal, *key), want), key
            assert want.abs().sum() > 0, key
            checked.add(key[0])
    assert len(checked) == len({p.name for s in range(2) for g in spec.groups(2 * s) for p in g})


def test_pipeline_stages_are_deepspeeds_own_split():
    from deepspeed.runtime.utils import partition_balanced

    from megatron_ucp.plan.pipeline_stages import balanced_cuts

    for layers in range(1, 49):
        weights = [0, 0] + [1] * layers + [0, 0, 0]  # GPTModelPipe's list: casts, embedding, norm, head
        for pp in range(1, 9):
            assert balanced_cuts(weights, pp) == [int(c) for c in partition_balanced(weights, pp)], (layers, pp)


def test_synthesize_command_writes_once_and_refuses_what_it_cannot(tmp_path: Path, capsys):
    from megatron_ucp.cli import main

    args = [
        "synthesize",
        str(tmp_path / "ck"),
        "--layers",
        "1",
        "--hidden",
        "8",
        "--ffn",
        "16",
        "--heads",
        "2",
        "--vocab",
        "40",
        "--dp",
        "3",
        "--optimizer",
        "zero",
        "--ds-version",
        "0.16.2",
        "--no-progress",
    ]
    assert main(args) == 0
    assert (tmp_path / "ck" / "latest").read_text() == "global_step100"
    assert len(list((tmp_path / "ck" / "global_step100").glob("*_optim_states.pt"))) == 3
    assert main(args) == 2  # the tag exists: never overwritten
    assert "already exists" in capsys.readouterr().err
    assert main(["synthesize", str(tmp_path / "other"), "--layers", "1", "--dp", "2"]) == 2
    assert "--hidden" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    assert main(["synthesize", str(tmp_path / "pipe"), *args[2:10], "--dp", "2", "--pp", "2", "--no-progress"]) == 2
    assert "PP=2 stages for 1 transformer layers" in capsys.readouterr().err
    assert (
        main(
            [
                "synthesize",
                str(tmp_path / "pipe"),
                "--layers",
                "2",
                *args[4:10],
                "--dp",
                "2",
                "--pp",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "GPTModelPipe, PP=2" in capsys.readouterr().out
    tag = tmp_path / "pipe" / "global_step100"
    assert sorted(p.name for p in tag.glob("layer_*")) == [
        f"layer_0{i}-model_00-model_states.pt" for i in (1, 2, 3, 4, 5)
    ]
    assert len(list(tag.glob("*_optim_states.pt"))) == 4
