"""The Hugging Face Llama mapping (pure): config from Megatron args, every tensor's rows, refusals, shards; and the
exporter's bf16 rounding against torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ucp.errors import UnsupportedError
from megatron_ucp.export.hf_export import bf16_bits
from megatron_ucp.plan.hf_llama import architecture, hf_tensors, qkv_rows, shards
from megatron_ucp.plan.llama_shapes import LlamaShape, PipeStage

ARGS = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "padded_vocab_size": 384,
    "max_position_embeddings": 128,
    "rope_theta": 500000,
    "layernorm_epsilon": 1e-6,
    "swiglu": True,
    "normalization": "rmsnorm",
    "add_bias_linear": False,
    "use_rotary_position_embeddings": True,
    "add_position_embedding": False,
    "untie_embeddings_and_output_weights": True,
    "num_experts": [1],
}
SHAPE = LlamaShape(layers=2, hidden=64, ffn=96, heads=8, kv_heads=2, vocab=384, original_vocab=257)


def _shapes(shape: LlamaShape, pp: int = 0) -> dict[str, tuple[int, ...]]:
    """Whole-parameter shapes as the universal folder holds them (vocabulary rows trimmed to the tokenizer's)."""
    stages = [None] if not pp else [PipeStage(pp, i) for i in range(pp)]
    out = {}
    for stage in stages:
        for group in shape.param_groups(1, stage):
            for spec in group:
                vocab = len(spec.shape) == 2 and spec.shape[0] == shape.vocab
                out[spec.name] = (shape.original_vocab, spec.shape[1]) if vocab else tuple(spec.shape)
    return out


def test_config_comes_from_the_runs_own_args():
    arch = architecture(ARGS, 257, "ckpt")
    config = arch.config("bfloat16", {"eos_token_id": 2})
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 8 and config["intermediate_size"] == 96
    assert (
        config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6 and config["max_position_embeddings"] == 128
    )
    assert config["vocab_size"] == 257 and config["tie_word_embeddings"] is False and config["eos_token_id"] == 2


def test_every_reason_a_model_is_not_llama_is_listed_at_once():
    args = {**ARGS, "num_experts": [8], "swiglu": False, "add_bias_linear": True, "normalization": "layernorm"}
    with pytest.raises(UnsupportedError) as err:
        architecture(args, 257, "/ckpt/global_step6_universal")
    message = str(err.value)
    assert message.startswith("/ckpt/global_step6_universal: cannot export as a Hugging Face LlamaForCausalLM")
    for reason in ("mixture of experts (--num-experts [8])", "not SwiGLU", "biases", "--normalization layernorm"):
        assert reason in message


def test_qkv_rows_undo_megatrons_grouping_per_kv_head():
    """Megatron's rows per KV group: its 4 query heads, its key head, its value head (head_dim 8)."""
    rows = qkv_rows(architecture(ARGS, 257, "ckpt"))
    assert rows["q_proj"] == ((0, 32), (48, 80))
    assert rows["k_proj"] == ((32, 40), (80, 88))
    assert rows["v_proj"] == ((40, 48), (88, 96))
    covered = sorted(r for kind in rows.values() for r in kind)
    assert (
        covered[0][0] == 0
        and covered[-1][1] == 96
        and all(a[1] == b[0] for a, b in zip(covered[:-1], covered[1:], strict=True))
    )


@pytest.mark.parametrize("pp", [0, 2], ids=["GPTModel", "GPTModelPipe"])
def test_both_model_classes_map_to_the_same_tensors(pp):
    arch = architecture(ARGS, 257, "ckpt")
    tensors = hf_tensors(arch, _shapes(SHAPE, pp), "ckpt")
    names = [t.name for t in tensors]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert names[1:10] == [
        f"model.layers.0.{n}.weight"
        for n in (
            "input_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    by_name = {t.name: t for t in tensors}
    assert by_name["model.layers.1.mlp.up_proj.weight"].rows == ((96, 192),)
    assert by_name["model.layers.1.self_attn.k_proj.weight"].shape == (16, 64)
    assert by_name["lm_head.weight"].shape == (257, 64)
    assert len(tensors) == 2 * 9 + 3


def test_tied_embeddings_export_no_lm_head():
    arch = architecture({**ARGS, "untie_embeddings_and_output_weights": False}, 257, "ckpt")
    tied = LlamaShape(layers=2, hidden=64, ffn=96, heads=8, kv_heads=2, vocab=384, original_vocab=257, tied=True)
    names = [t.name for t in hf_tensors(arch, _shapes(tied), "ckpt")]
    assert "lm_head.weight" not in names and arch.config("float32", {})["tie_word_embeddings"] is True


def test_unmapped_missing_and_misshapen_parameters_are_refused_by_name():
    arch = architecture(ARGS, 257, "ckpt")
    shapes = _shapes(SHAPE)
    shapes["language_model.encoder.layers.0.self_attention.dense.bias"] = (64,)
    del shapes["language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"]
    shapes["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"] = (96, 64)
    with pytest.raises(UnsupportedError) as err:
        hf_tensors(arch, shapes, "ckpt")
    message = str(err.value)
    assert "language_model.encoder.layers.0.self_attention.dense.bias (no Llama tensor)" in message
    assert "no saved parameter for model.layers.1.mlp.down_proj.weight" in message
    assert "dense_h_to_4h.weight has shape [96, 64], the architecture needs [192, 64]" in message


def test_shards_keep_the_order_and_the_bound():
    arch = architecture(ARGS, 257, "ckpt")
    tensors = hf_tensors(arch, _shapes(SHAPE), "ckpt")
    groups = shards(tensors, 40_000, 2)
    assert [t for g in groups for t in g] == tensors
    assert all(sum(t.numel * 2 for t in g) <= 40_000 or len(g) == 1 for g in groups)
    assert len(shards(tensors, 1, 2)) == len(tensors)


def test_bf16_rounding_is_torchs():
    special = np.array(
        [0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, -1e-40, 1.00390625, 1.01171875],
        dtype=np.float32,
    )
    values = np.concatenate([special, np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 1e3])
    ties = np.arange(0, 1 << 20, dtype=np.uint32) * np.uint32(4099) | np.uint32(0x8000)  # exact halfway cases
    values = np.concatenate([values, ties.view(np.float32)])
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bf16_bits(values)
    finite = ~np.isnan(values)
    assert np.array_equal(got[finite], want[finite])
    assert np.isnan(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()[~finite]).all()
