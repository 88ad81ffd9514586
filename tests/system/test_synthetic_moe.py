"""Mixture-of-experts checkpoints at sizes no CPU trains, from the synthetic writer (held key for key to the real
fork's MoE save in tests/integration): converted bit for bit against the generator's own values, every rank
file bound to its places, and each way a save's experts can fail to add up named before anything is written.

Cheap by design: a tiny model (4 layers, 2 of them MoE, 8 experts), DP 16 with EP 4, no launch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import read_manifest
from megatron_ucp.errors import UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.lightpickle import PICKLE_MODULE
from megatron_ucp.plan.llama_shapes import EXPERTS, LlamaShape
from megatron_ucp.synthetic.content import SyntheticSpec, state_range
from megatron_ucp.synthetic.writer import write_checkpoint
from tests.support.elastic_support import bind_folder
from tests.support.file_structure import load

SHAPE = LlamaShape(layers=4, hidden=8, ffn=16, heads=2, kv_heads=2, vocab=40, original_vocab=37, experts=8)
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _spec(ds_version: str, dp: int = 16, ep: int = 4) -> SyntheticSpec:
    return SyntheticSpec(shape=SHAPE, dp=dp, ep=ep, optimizer="zero", ds_version=ds_version, iteration=5, record=True)


def _expected_experts(spec: SyntheticSpec) -> dict[tuple[str, str], torch.Tensor]:
    """Every expert's states under its global name, from the generator: expert-parallel rank ``r``'s buffer
    holds its local experts layer by layer, expert by expert; global expert ``r * E/EP + k``."""
    local = SHAPE.experts // spec.ep
    out = {}
    for r in range(spec.ep):
        offset = 0
        for name, shape in SHAPE.expert_params(spec.ep).items():
            head, tail = name.split(".deepspeed_experts.", 1)
            k, rest = tail.split(".", 1)
            global_name = f"{head}.deepspeed_experts.{r * local + int(k)}.{rest}"
            numel = math.prod(shape)
            for state in STATES:
                out[(global_name, state)] = state_range(spec, 0, EXPERTS, state, offset, offset + numel, r).view(shape)
            offset += numel
    return out


@pytest.mark.parametrize("ds_version", ["0.16.9", "0.19.5"])
def test_every_expert_converts_to_the_generators_values_and_every_file_binds(tmp_path: Path, ds_version: str):
    """0.16.9 writes no ``param_shapes`` for an MoE save (the reader derives the groups), 0.19.5 does."""
    spec = _spec(ds_version)
    written = write_checkpoint(tmp_path, spec, progress=False)
    assert (F.PARAM_SHAPES in load(written.tag_dir / F.MODEL_STATES_FILE)) == (ds_version == "0.19.5")
    assert len(list(written.tag_dir.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))) == 2 * 8
    convert(ConvertOptions(source=tmp_path, progress=False))
    universal = tmp_path / F.universal_tag(spec.tag)
    assert read_manifest(universal)["parallel"]["ep"] == 4
    expected = _expected_experts(spec)
    assert len(expected) == 2 * 8 * 2 * 3  # MoE layers x experts x matrices x states
    for (name, state), want in expected.items():
        got = torch.load(universal / F.UNIVERSAL_ZERO_DIR / name / f"{state}.pt", weights_only=False)[F.PARAM]
        assert torch.equal(got, want) and want.abs().sum() > 0, (name, state)
    for name, weights in ((n, load(p)) for n, p in ((p.name, p) for p in written.tag_dir.glob("layer_*_expert_*"))):
        for key, weight in weights.items():  # each expert file: its masters rounded
            assert torch.equal(weight, expected[(key, "fp32")].to(torch.bfloat16)), (name, key)
    shapes = [[(p.name, p.shape) for p in group] for group in spec.groups()]

    def rank_file(r: int) -> Path:
        return written.tag_dir / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"

    assert bind_folder(written.tag_dir / F.MODEL_STATES_FILE, rank_file, shapes) == []


def _rewrite(path: Path, edit) -> None:
    sd = torch.load(path, weights_only=False, pickle_module=PICKLE_MODULE)
    edit(sd)
    torch.save(sd, path, pickle_module=PICKLE_MODULE)


def _recorded_experts(count: int):
    def edit(sd: dict) -> None:
        sd["num_experts"] = [count] * len(sd["num_experts"])

    return edit


def _partition_counts(counts: list[int]):
    def edit(sd: dict) -> None:
        sd[F.OPTIMIZER_STATE_DICT][F.PARTITION_COUNT] = counts

    return edit


def _data_first(sd: dict) -> None:
    sd[F.DS_CONFIG]["use_data_before_expert_parallelism"] = True


def _recorded_expert_dp_rank(rank: int):
    def edit(sd: dict) -> None:
        sd[F.OPTIMIZER_STATE_DICT][F.ZERO_PARTITION_INFO]["group_dp_ranks"][EXPERTS] = rank

    return edit


@pytest.mark.parametrize(
    "case",
    [
        "expert file missing",
        "expert count",
        "ep does not divide",
        "partitions do not add up",
        "d + e topology",
        "expert-dp rank",
    ],
)
def test_experts_that_do_not_add_up_are_named_before_anything_is_written(tmp_path: Path, case: str):
    spec = _spec("0.19.5", dp=4, ep=2)
    tag = write_checkpoint(tmp_path, spec, progress=False).tag_dir
    if case == "expert file missing":
        (tag / "layer_1_expert_5_mp_rank_00_model_states.pt").unlink()
        culprit, said = "layer_1_expert_5_mp_rank_00_model_states.pt", "is missing (expert 5 of MoE layer 1)"
    elif case == "expert count":
        _rewrite(tag / F.MODEL_STATES_FILE, _recorded_experts(6))
        culprit, said = "layer_*_expert_7_mp_rank_*_model_states.pt", "the model records 6 experts per MoE layer"
    elif case == "ep does not divide":  # 6 experts left, the expert groups over 1 rank of DP 4: EP 4
        for layer in range(2):
            for expert in (6, 7):
                (tag / f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt").unlink()
        _rewrite(tag / F.MODEL_STATES_FILE, _recorded_experts(6))
        for r in range(4):
            _rewrite(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", _partition_counts([4, 4, 1]))
        culprit, said = None, "EP=4 does not divide the 6 experts"
    elif case == "partitions do not add up":
        for r in range(4):
            _rewrite(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt", _partition_counts([4, 4, 3]))
        culprit, said = None, "partitioned over 3 ranks, which does not divide DP=4"
    elif case == "d + e topology":  # expert-parallel groups strided, not where the default E + D puts them
        _rewrite(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", _data_first)
        culprit, said = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "use_data_before_expert_parallelism"
    else:  # DP rank 2 is expert-DP rank 1 of expert-parallel rank 0 in E + D; its record says 0
        _rewrite(tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", _recorded_expert_dp_rank(0))
        culprit, said = "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", "records expert-data-parallel rank 0"
    with pytest.raises(UcpError) as caught:
        convert(ConvertOptions(source=tmp_path, progress=False))
    assert said in str(caught.value) and str(tag) in str(caught.value), str(caught.value)
    assert isinstance(caught.value, UnsupportedError) == (case == "d + e topology")
    if culprit is None:  # what does not add up is the save as a whole (every rank file agrees): the tag is named
        assert caught.value.subject is None, caught.value.subject
    else:
        assert caught.value.subject is not None and culprit in str(caught.value.subject), caught.value.subject
    assert not list(tmp_path.glob(f"*{spec.tag}_universal*")), list(tmp_path.iterdir())  # nothing written
