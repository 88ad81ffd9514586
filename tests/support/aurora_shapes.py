"""AuroraGPT-7B parameter shapes (``megatron_ucp.plan.llama_shapes.PRESETS["aurora-7b"]``), for metadata-only tests.

32 layers, hidden 4096, FFN 11008 (SwiGLU: dense_h_to_4h holds both halves), 32 heads without GQA,
vocabulary 32000, untied output layer, RMSNorm without biases. Two param groups as Megatron builds
them: weight decay (matrices) and no weight decay (the 65 RMSNorm weights: N = 65 * 4096 = 266,240).
"""

from __future__ import annotations

from megatron_ucp.plan.conversion import ParamSpec
from megatron_ucp.plan.llama_shapes import preset


def aurora_7b_param_groups() -> list[list[ParamSpec]]:
    return preset("aurora-7b").param_groups()
