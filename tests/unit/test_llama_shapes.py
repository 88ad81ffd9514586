"""The llama shapes behind the synthetic writer and the metadata-only scale tools (pure)."""

from __future__ import annotations

import pytest

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.llama_shapes import LlamaShape, preset


def test_aurora_7b_groups_are_the_design_facts():
    wd, no_wd = preset("aurora-7b").param_groups()
    assert sum(p.numel for p in no_wd) == 65 * 4096 == 266_240
    assert len(wd) == 2 + 4 * 32 and wd[0].name == "language_model.embedding.word_embeddings.weight"
    assert preset("aurora-7b").numel() == 6_738_415_616


def test_tp_splits_follow_megatron_attributes():
    shape = LlamaShape(layers=1, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=384)
    full = {p.name: p.shape for g in shape.param_groups(1) for p in g}
    half = {p.name: p.shape for g in shape.param_groups(2) for p in g}
    layouts = shape.tp_layouts()
    for name, shape_1 in full.items():
        layout = layouts[name]
        want = list(shape_1)
        if not layout.replicated:
            want[layout.dim] //= 2
        assert half[name] == tuple(want), name
    assert full["language_model.encoder.layers.0.self_attention.query_key_value.weight"] == ((4 + 2 * 2) * 16, 64)
    assert full["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"] == (256, 64)  # SwiGLU: both halves


def test_tied_model_has_no_output_layer_and_bad_shapes_are_refused():
    tied = LlamaShape(layers=1, hidden=8, ffn=16, heads=2, vocab=40, tied=True)
    assert not any("output_layer" in p.name for g in tied.param_groups() for p in g)
    with pytest.raises(PlanError, match="TP=3"):
        tied.param_groups(3)
    with pytest.raises(PlanError, match="heads"):
        LlamaShape(layers=1, hidden=10, ffn=16, heads=3)
    with pytest.raises(PlanError, match="original vocabulary"):
        LlamaShape(layers=1, hidden=8, ffn=16, heads=2, vocab=40, original_vocab=41)


def test_pipeline_stages_name_and_split_the_layers_as_gptmodelpipe():
    from megatron_ucp.plan.llama_shapes import PipeStage
    from megatron_ucp.plan.pipeline_stages import balanced_cuts, uniform_cuts

    untied = LlamaShape(layers=2, hidden=8, ffn=16, heads=2, vocab=40)
    first, last = (untied.param_groups(1, PipeStage(2, s)) for s in range(2))
    assert [p.name for p in first[0]][:2] == ["1.word_embeddings.weight", "2.self_attention.query_key_value.weight"]
    assert [p.name for p in last[0]][-1] == "5.lm_head.weight" and [p.name for p in last[1]][-1] == "4.weight"
    tied = LlamaShape(layers=5, hidden=8, ffn=16, heads=2, vocab=40, tied=True)
    stages = [tied.param_groups(1, PipeStage(3, s)) for s in range(3)]
    names = [p.name for groups in stages for g in groups for p in g]
    assert names.count("tied_modules.embed.word_embeddings.weight") == 2  # first and last stage, listed first
    assert stages[2][0][0].name == stages[0][0][0].name == "tied_modules.embed.word_embeddings.weight"
    layers = sorted({int(n.split(".")[0]) for n in names if n[0].isdigit() and "layernorm" in n})
    assert layers == [2, 3, 4, 5, 6]  # every transformer layer on exactly one stage
    assert len(names) - 1 == len({p.name for g in tied.param_groups() for p in g})
    saved = [x.index for x in tied.stage_layers(PipeStage(3, 2)) if x.params and x.saves_file]
    assert saved == [6, 7]  # the last layer and the final norm; the tied head is a function around stage 0's
    assert balanced_cuts([0, 0, 1, 1, 1, 1, 0, 0, 0], 2) == [0, 4, 9]
    assert uniform_cuts(7, 3) == [0, 3, 5, 7] and uniform_cuts(2, 3) == [0, 1, 2, 2]
    with pytest.raises(PlanError, match="a stage would hold none"):
        untied.param_groups(1, PipeStage(3, 0))
    with pytest.raises(PlanError, match="does not exist"):
        PipeStage(2, 2)
