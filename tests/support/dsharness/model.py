"""A tiny GPT-like model with Megatron-DeepSpeed parameter names, and its deterministic data.

Only torch is imported here (no DeepSpeed, no Megatron), so the module also loads under the legacy
DeepSpeed venv used by ``tests/fixtures/make_legacy_fixtures.py``.

Parameter names follow Megatron-DeepSpeed's ``GPTModel`` with ``--disable-bias-linear``,
``--normalization rmsnorm`` and ``--untie-embeddings-and-output-weights`` (the AuroraGPT setup)::

    language_model.embedding.word_embeddings.weight            [vocab, hidden]
    language_model.encoder.layers.{i}.input_layernorm.weight   [hidden]
    language_model.encoder.layers.{i}.self_attention.query_key_value.weight  [3*hidden, hidden]
    language_model.encoder.layers.{i}.self_attention.dense.weight            [hidden, hidden]
    language_model.encoder.layers.{i}.post_attention_layernorm.weight        [hidden]
    language_model.encoder.layers.{i}.mlp.dense_h_to_4h.weight               [4*hidden, hidden]
    language_model.encoder.layers.{i}.mlp.dense_4h_to_h.weight               [hidden, 4*hidden]
    language_model.encoder.final_layernorm.weight              [hidden]
    language_model.output_layer.weight                         [vocab, hidden]

Param groups follow Megatron's ``get_param_groups``: group 0 = weight decay (everything but the
norms), group 1 = no weight decay (the norm weights), each in declaration order. With the defaults
(hidden=3, num_layers=1) the no-weight-decay group is 3 norm weights of 3 elements: N = 9, so at
DP=4 the padded length is 16, the partition 4, the padding 7 > 4 and ranks 2 and 3 hold only padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Rows at the end of the vocabulary that no data token ever uses (Megatron's vocabulary padding);
#: ``original_vocab_size = vocab - VOCAB_PADDING``.
VOCAB_PADDING = 4


def original_vocab_size(vocab: int) -> int:
    """The "real" vocabulary size recorded in ``universal_checkpoint_info``; data tokens stay below it."""
    if vocab <= VOCAB_PADDING + 1:
        raise ValueError(f"vocab must be > {VOCAB_PADDING + 1}, got {vocab}")
    return vocab - VOCAB_PADDING


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class SelfAttention(nn.Module):
    """Single-head causal attention, fused QKV, no biases."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=False)
        self.dense = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        seq = x.shape[1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype)
        return self.dense(probs @ v)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden, bias=False)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attention = SelfAttention(hidden)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)


class Encoder(nn.Module):
    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(hidden) for _ in range(num_layers))
        self.final_layernorm = RMSNorm(hidden)


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = Embedding(vocab, hidden)
        self.encoder = Encoder(hidden, num_layers)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)


class TinyGPT(nn.Module):
    """``forward(tokens, labels) -> mean cross-entropy`` (fp32) over all positions."""

    def __init__(self, vocab: int = 64, hidden: int = 3, num_layers: int = 1) -> None:
        super().__init__()
        self.vocab = vocab
        self.language_model = LanguageModel(vocab, hidden, num_layers)
        # Megatron-like init: small normal weights, norms at one.
        for name, p in self.named_parameters():
            if not name.endswith("layernorm.weight"):
                nn.init.normal_(p, mean=0.0, std=0.5)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lm = self.language_model
        x = lm.embedding.word_embeddings(tokens)
        for layer in lm.encoder.layers:
            x = layer(x)
        x = lm.encoder.final_layernorm(x)
        logits = lm.output_layer(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(vocab: int = 64, hidden: int = 3, num_layers: int = 1, seed: int = 1234) -> TinyGPT:
    """The same weights for the same arguments, on every rank and in every process."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return TinyGPT(vocab=vocab, hidden=hidden, num_layers=num_layers)
    finally:
        torch.random.set_rng_state(gen_state)


def is_no_weight_decay(name: str) -> bool:
    """Norm weights (and biases, of which this model has none) get no weight decay, as in Megatron."""
    return name.endswith("norm.weight") or name.endswith(".bias")


def tiny_model_param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """``[weight-decay group, no-weight-decay group]``, parameters in declaration order.

    Groups hold only what torch optimizers accept; :func:`param_group_names` gives the parameter
    names of each group in the same (flat) order.
    """
    wd, no_wd = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_wd if is_no_weight_decay(name) else wd).append(p)
    return [
        {"params": wd, "weight_decay": weight_decay},
        {"params": no_wd, "weight_decay": 0.0},
    ]


def param_group_names(model: nn.Module) -> list[list[str]]:
    """Parameter names of the groups of :func:`tiny_model_param_groups`, in the same (flat) order."""
    wd, no_wd = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_wd if is_no_weight_decay(name) else wd).append(name)
    return [wd, no_wd]


def global_batch_tokens(step: int, global_batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Token ids ``[global_batch, seq + 1]`` of the 0-based training step ``step``.

    Sample ``i`` of step ``k`` depends only on ``(seed, k, i)``: never on the DP size. Tokens are
    below ``original_vocab_size(vocab)``, so padded vocabulary rows never see a lookup.
    """
    high = original_vocab_size(vocab)
    rows = []
    for i in range(global_batch):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + i)
        rows.append(torch.randint(0, high, (seq + 1,), generator=gen))
    return torch.stack(rows)


def rank_batch(
    step: int, rank: int, dp: int, global_batch: int, seq: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)`` of rank ``rank``: a contiguous slice of the global batch."""
    if global_batch % dp:
        raise ValueError(f"global_batch {global_batch} is not divisible by dp {dp}")
    micro = global_batch // dp
    data = global_batch_tokens(step, global_batch, seq, vocab, seed)[rank * micro : (rank + 1) * micro]
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
