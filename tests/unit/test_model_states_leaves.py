"""A model-states ``module`` dict's leaves replaced by flat name, the nesting kept (Megatron saves a dict of dicts)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from megatron_ucp.deepspeed.model_states import flatten_module_states, with_leaves_replaced


def test_leaves_named_flat_are_replaced_at_their_place_in_the_nesting() -> None:
    saved = OrderedDict(
        language_model=OrderedDict(
            embedding={"word_embeddings": {"weight": torch.ones(4, 2)}},
            encoder=OrderedDict([("layers.0.mlp.weight", torch.ones(3)), ("final_norm.weight", torch.ones(2))]),
        ),
        buffer=torch.zeros(1),
    )
    empty = torch.empty(0)
    out = with_leaves_replaced(
        saved,
        {"language_model.embedding.word_embeddings.weight": empty, "language_model.encoder.layers.0.mlp.weight": empty},
    )
    flat = flatten_module_states(out)
    assert list(flat) == list(flatten_module_states(saved))
    assert flat["language_model.embedding.word_embeddings.weight"] is empty
    assert flat["language_model.encoder.layers.0.mlp.weight"] is empty
    assert flat["language_model.encoder.final_norm.weight"] is saved["language_model"]["encoder"]["final_norm.weight"]
    assert type(out["language_model"]["encoder"]) is OrderedDict and flat["buffer"] is saved["buffer"]
    assert flatten_module_states(saved)["language_model.embedding.word_embeddings.weight"].numel() == 8  # untouched
