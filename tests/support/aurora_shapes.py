"""AuroraGPT-7B parameter shapes (Llama-style, as train_aGPT_7B.sh configures it), for metadata-only tests.

32 layers, hidden 4096, FFN 11008 (SwiGLU: dense_h_to_4h holds both halves), 32 heads without GQA,
vocabulary 32000, untied output layer, RMSNorm without biases. Two param groups as Megatron builds
them: weight decay (matrices) and no weight decay (the 65 RMSNorm weights: N = 65 * 4096 = 266,240).
"""
from __future__ import annotations

from megatron_ucp.plan.conversion import ParamSpec

HIDDEN, FFN, LAYERS, VOCAB = 4096, 11008, 32, 32000


def aurora_7b_param_groups() -> list[list[ParamSpec]]:
    wd = [ParamSpec("language_model.embedding.word_embeddings.weight", 0, (VOCAB, HIDDEN))]
    no_wd = []
    for i in range(LAYERS):
        p = f"language_model.encoder.layers.{i}."
        no_wd.append(ParamSpec(p + "input_layernorm.weight", 1, (HIDDEN,)))
        wd.append(ParamSpec(p + "self_attention.query_key_value.weight", 0, (3 * HIDDEN, HIDDEN)))
        wd.append(ParamSpec(p + "self_attention.dense.weight", 0, (HIDDEN, HIDDEN)))
        no_wd.append(ParamSpec(p + "post_attention_layernorm.weight", 1, (HIDDEN,)))
        wd.append(ParamSpec(p + "mlp.dense_h_to_4h.weight", 0, (2 * FFN, HIDDEN)))
        wd.append(ParamSpec(p + "mlp.dense_4h_to_h.weight", 0, (HIDDEN, FFN)))
    no_wd.append(ParamSpec("language_model.encoder.final_layernorm.weight", 1, (HIDDEN,)))
    wd.append(ParamSpec("language_model.output_layer.weight", 0, (VOCAB, HIDDEN)))
    return [wd, no_wd]
