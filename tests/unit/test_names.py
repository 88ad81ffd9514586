"""GPTModel <-> GPTModelPipe parameter names (pure), with the names the real models use."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.names import is_pipeline_names, name_map

LAYER = (
    "input_layernorm.weight",
    "self_attention.query_key_value.weight",
    "self_attention.dense.weight",
    "post_attention_layernorm.weight",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_4h_to_h.weight",
)


def nonpipe(layers: int) -> list[str]:
    return (
        ["language_model.embedding.word_embeddings.weight"]
        + [f"language_model.encoder.layers.{i}.{rest}" for i in range(layers) for rest in LAYER]
        + ["language_model.encoder.final_layernorm.weight", "language_model.output_layer.weight"]
    )


def pipe(layers: int) -> list[str]:
    # as GPTModelPipe numbers its layer list: 0 is a function, 1 the embedding, then the layers
    return (
        ["1.word_embeddings.weight"]
        + [f"{i + 2}.{rest}" for i in range(layers) for rest in LAYER]
        + [f"{layers + 2}.weight", f"{layers + 3}.lm_head.weight"]
    )


@pytest.mark.parametrize("layers", [1, 2, 32])
def test_both_directions_pair_every_parameter(layers: int) -> None:
    forward = name_map(pipe(layers), nonpipe(layers))
    assert forward["2.self_attention.dense.weight"] == "language_model.encoder.layers.0.self_attention.dense.weight"
    assert forward[f"{layers + 2}.weight"] == "language_model.encoder.final_layernorm.weight"
    assert forward[f"{layers + 3}.lm_head.weight"] == "language_model.output_layer.weight"
    backward = name_map(nonpipe(layers), pipe(layers))
    assert backward == {v: k for k, v in forward.items()}
    assert is_pipeline_names(pipe(layers)) and not is_pipeline_names(nonpipe(layers))


def test_matching_names_need_no_map_and_a_subset_is_fine() -> None:
    assert name_map(pipe(2)[:4], pipe(2)) is None


def test_tied_embedding_and_mismatches_are_named() -> None:
    tied = ["tied_modules.embed.word_embeddings.weight"] + pipe(2)[1:-1]
    mapping = name_map(tied, nonpipe(2)[:-1])
    assert mapping["tied_modules.embed.word_embeddings.weight"] == "language_model.embedding.word_embeddings.weight"
    with pytest.raises(PlanError, match="without a live counterpart"):
        name_map(pipe(1), nonpipe(2))
    with pytest.raises(PlanError, match="without a saved counterpart"):
        name_map(pipe(2), nonpipe(1))
    with pytest.raises(PlanError, match="not a parameter name"):
        name_map(pipe(1), ["encoder.weight"])


def test_buffers_follow_the_parameters_scheme_and_unknown_names_are_left_out() -> None:
    from megatron_ucp.plan.names import counterpart_names

    gpt_params = [
        "language_model.embedding.word_embeddings.weight",
        "language_model.encoder.layers.0.mlp.w",
        "language_model.encoder.layers.1.mlp.w",
        "language_model.encoder.final_layernorm.weight",
    ]
    pipe_params = ["1.word_embeddings.weight", "2.mlp.w", "3.mlp.w", "4.weight"]
    buffers = ["language_model.encoder.layers.1.self_attention.window", "language_model.rotary_pos_emb.inv_freq"]
    saved = [*pipe_params, "2.self_attention.window", "3.self_attention.window"]
    assert counterpart_names(buffers, gpt_params, pipe_params, saved) == {
        "language_model.encoder.layers.1.self_attention.window": "3.self_attention.window"
    }
    assert counterpart_names(
        ["3.self_attention.window"], pipe_params, gpt_params, ["language_model.encoder.layers.1.self_attention.window"]
    ) == {"3.self_attention.window": "language_model.encoder.layers.1.self_attention.window"}
