"""Megatron-DeepSpeed's llama model as Hugging Face's ``LlamaForCausalLM``: its config and its tensors (pure).

What ``pretrain_gpt_alcf.py`` trains with AuroraGPT's flags (RMSNorm, SwiGLU, RoPE, GQA, no biases) computes
what ``LlamaForCausalLM`` computes, once three layouts are undone:

* ``query_key_value`` holds its rows grouped per KV head: for each of the ``nkv`` groups, the group's
  ``nq / nkv`` query heads, then its key head, then its value head (``ParallelAttention.forward`` views it as
  ``[nkv, nq / nkv + 2, head_dim]``; ``repeat_kv`` gives query head ``i`` the KV head ``i // (nq / nkv)``, as
  Hugging Face's does). ``q_proj``, ``k_proj`` and ``v_proj`` are those rows gathered per kind.
* SwiGLU's ``dense_h_to_4h`` is ``[gate; up]`` (``F.silu(x[0]) * x[1]`` of its output's two halves).
* the vocabulary parameters carry Megatron's padding rows: Hugging Face's have the tokenizer's rows only.

RoPE needs nothing: the fork rotates halves (``_rotate_half``), Hugging Face's llama too. Every tensor is
therefore a list of row ranges of one saved parameter (:class:`HfTensor`), which the exporter reads exactly,
in order, without holding any parameter whole. Anything else (experts, biases, LayerNorm, learned positions,
partial rotary) is not this model: :func:`architecture` and :func:`hf_tensors` refuse it, listing every
reason at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from megatron_ucp.errors import PlanError, UnsupportedError
from megatron_ucp.plan.names import canonical_names

Rows = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LlamaArchitecture:
    """What a ``LlamaConfig`` needs, read from the run's Megatron args."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    """The tokenizer's vocabulary (Megatron's padded rows dropped)."""
    max_positions: int
    rope_theta: float
    norm_eps: float
    tied: bool

    def config(self, dtype: str, token_ids: Mapping[str, int]) -> dict[str, Any]:
        """``config.json`` of ``LlamaForCausalLM``; ``dtype``: "bfloat16" or "float32"."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tied,
            "vocab_size": self.vocab,
            "torch_dtype": dtype,
            "use_cache": True,
            **dict(token_ids),
        }


_FORWARD_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("swiglu", True, "the MLP is not SwiGLU (--swiglu off)"),
    ("normalization", "rmsnorm", "the normalization is not RMSNorm (--normalization {})"),
    ("apply_layernorm_1p", False, "the norms add 1 to their weight (--apply-layernorm-1p)"),
    (
        "apply_residual_connection_post_layernorm",
        False,
        "residuals after the norm (--apply-residual-connection-post-layernorm)",
    ),
    ("add_bias_linear", False, "the linear layers have biases (no --disable-bias-linear)"),
    ("use_rotary_position_embeddings", True, "no rotary position embeddings (--use-rotary-position-embeddings off)"),
    ("rotary_percent", 1.0, "partial rotary embeddings (--rotary-percent {})"),
    ("retro_add_retriever", False, "a RETRO retriever (--retro-add-retriever)"),
)
"""Megatron args that change the forward, with the value ``LlamaForCausalLM`` computes (absent: the default)."""


def _experts(args: Mapping[str, Any]) -> int:
    experts = args.get("num_experts")
    if isinstance(experts, (list, tuple)):
        return max((int(e) for e in experts), default=1)
    return int(experts or 1)


def architecture(args: Mapping[str, Any], original_vocab: Optional[int], source: str) -> LlamaArchitecture:
    """The Llama config of a run from its saved Megatron ``args``; refused, with every reason, when the run's
    model computes something ``LlamaForCausalLM`` cannot. ``original_vocab``: the tokenizer's size
    (DeepSpeed's ``universal_checkpoint_info``), else the padded size."""
    problems = []
    if _experts(args) > 1:
        problems.append(f"mixture of experts (--num-experts {args.get('num_experts')})")
    for name, want, why in _FORWARD_FLAGS:
        value = args.get(name, want)
        if value != want:
            problems.append(why.format(value))
    if args.get("add_position_embedding") and not args.get("use_rotary_position_embeddings"):
        problems.append("learned absolute position embeddings")
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size")
    missing = [name for name in required if not isinstance(args.get(name), int)]
    if missing:
        problems.append(f"the saved args lack {', '.join(missing)}")
    if problems:
        raise UnsupportedError(
            f"{source}: cannot export as a Hugging Face LlamaForCausalLM: {'; '.join(problems)}", subject=source
        )
    heads = args["num_attention_heads"]
    kv_heads = args.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedError(f"{source}: {heads} attention heads in {kv_heads} KV groups", subject=source)
    vocab = original_vocab or args["padded_vocab_size"]
    return LlamaArchitecture(
        layers=args["num_layers"],
        hidden=args["hidden_size"],
        ffn=args["ffn_hidden_size"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=args.get("kv_channels") or args["hidden_size"] // heads,
        vocab=min(vocab, args["padded_vocab_size"]),
        max_positions=args.get("max_position_embeddings") or args.get("seq_length") or 4096,
        rope_theta=float(args.get("rope_theta") or 10000),
        norm_eps=float(args.get("layernorm_epsilon") or 1e-5),
        tied=not args.get("untie_embeddings_and_output_weights", False),
    )


@dataclass(frozen=True)
class HfTensor:
    """One Hugging Face tensor: the rows ``rows`` of the saved parameter ``source``, concatenated."""

    name: str
    source: str
    rows: Rows
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def qkv_rows(arch: LlamaArchitecture) -> dict[str, Rows]:
    """``query_key_value``'s rows of ``q_proj``, ``k_proj`` and ``v_proj`` (see the module docstring)."""
    per_group = arch.heads // arch.kv_heads
    hd = arch.head_dim
    block = (per_group + 2) * hd
    q, k, v = [], [], []
    for g in range(arch.kv_heads):
        start = g * block
        q.append((start, start + per_group * hd))
        k.append((start + per_group * hd, start + (per_group + 1) * hd))
        v.append((start + (per_group + 1) * hd, start + block))
    return {"q_proj": tuple(q), "k_proj": tuple(k), "v_proj": tuple(v)}


def _expected(arch: LlamaArchitecture) -> dict[tuple, tuple[tuple[str, Rows, tuple[int, ...]], ...]]:
    """Canonical Megatron parameter -> its Hugging Face tensors (name, rows, shape), with the shape the saved
    parameter must have (``(None, hidden)`` for a vocabulary parameter: any padded row count)."""
    h, f, hd = arch.hidden, arch.ffn, arch.head_dim
    q_rows, kv_rows = arch.heads * hd, arch.kv_heads * hd
    out: dict[tuple, Any] = {
        ("embedding", "word_embeddings.weight"): ("model.embed_tokens.weight", ((0, arch.vocab),), (arch.vocab, h)),
        ("final_norm", "weight"): ("model.norm.weight", ((0, h),), (h,)),
    }
    if not arch.tied:
        out[("output", "weight")] = ("lm_head.weight", ((0, arch.vocab),), (arch.vocab, h))
    for i in range(arch.layers):
        pre = f"model.layers.{i}."
        qkv = qkv_rows(arch)
        out[("layer", i, "input_layernorm.weight")] = (pre + "input_layernorm.weight", ((0, h),), (h,))
        out[("layer", i, "self_attention.query_key_value.weight")] = tuple(
            (f"{pre}self_attn.{kind}.weight", rows, (q_rows if kind == "q_proj" else kv_rows, h))
            for kind, rows in qkv.items()
        )
        out[("layer", i, "self_attention.dense.weight")] = (pre + "self_attn.o_proj.weight", ((0, h),), (h, q_rows))
        out[("layer", i, "post_attention_layernorm.weight")] = (
            pre + "post_attention_layernorm.weight",
            ((0, h),),
            (h,),
        )
        out[("layer", i, "mlp.dense_h_to_4h.weight")] = (
            (pre + "mlp.gate_proj.weight", ((0, f),), (f, h)),
            (pre + "mlp.up_proj.weight", ((f, 2 * f),), (f, h)),
        )
        out[("layer", i, "mlp.dense_4h_to_h.weight")] = (pre + "mlp.down_proj.weight", ((0, h),), (h, f))
    return {key: value if isinstance(value[0], tuple) else (value,) for key, value in out.items()}


def _source_shape(arch: LlamaArchitecture, canonical: tuple) -> tuple[Optional[int], ...]:
    h, f, hd = arch.hidden, arch.ffn, arch.head_dim
    rest = canonical[-1]
    return {
        "word_embeddings.weight": (None, h),
        "weight": (h,) if canonical[0] == "final_norm" else (None, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attention.query_key_value.weight": ((arch.heads + 2 * arch.kv_heads) * hd, h),
        "self_attention.dense.weight": (h, arch.heads * hd),
        "mlp.dense_h_to_4h.weight": (2 * f, h),
        "mlp.dense_4h_to_h.weight": (h, f),
    }[rest]


def hf_tensors(arch: LlamaArchitecture, shapes: Mapping[str, tuple[int, ...]], source: str) -> list[HfTensor]:
    """Every tensor of the exported model, in Hugging Face's order, from the saved parameters' names and shapes
    (``GPTModel``'s or ``GPTModelPipe``'s names). Refused, listing what it cannot map, when a saved parameter has
    no place, an expected one is missing, or a shape is not the architecture's."""
    try:
        canonical = canonical_names(shapes)
    except PlanError as exc:
        raise UnsupportedError(f"{source}: cannot export as a Hugging Face LlamaForCausalLM: {exc}", subject=source)
    expected = _expected(arch)
    by_canonical = {c: name for name, c in canonical.items()}
    problems = [f"{name} (no Llama tensor)" for name, c in sorted(canonical.items()) if c not in expected]
    problems += [
        f"no saved parameter for {' / '.join(t[0] for t in ts)}" for c, ts in expected.items() if c not in by_canonical
    ]
    out: list[HfTensor] = []
    for c, targets in expected.items():
        name = by_canonical.get(c)
        if name is None:
            continue
        shape, want = tuple(shapes[name]), _source_shape(arch, c)
        rows_needed = max(stop for _, rows, _ in targets for _, stop in rows)
        if (
            len(shape) != len(want)
            or any(w is not None and s != w for s, w in zip(shape, want))
            or shape[0] < rows_needed
        ):
            problems.append(
                f"{name} has shape {list(shape)}, the architecture needs {[w or rows_needed for w in want]}"
            )
            continue
        out += [HfTensor(hf_name, name, rows, hf_shape) for hf_name, rows, hf_shape in targets]
    if problems:
        raise UnsupportedError(
            f"{source}: cannot export as a Hugging Face LlamaForCausalLM: {'; '.join(problems)}", subject=source
        )
    return sorted(out, key=_hf_order)


def _hf_order(t: HfTensor) -> tuple:
    parts = t.name.split(".")
    if parts[0] == "lm_head":
        return (3, 0, t.name)
    if parts[1] == "embed_tokens":
        return (0, 0, t.name)
    if parts[1] == "norm":
        return (2, 0, t.name)
    return (1, int(parts[2]), _LAYER_ORDER.index(".".join(parts[3:-1])))


_LAYER_ORDER = (
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


def shards(tensors: Iterable[HfTensor], max_bytes: int, itemsize: int) -> list[list[HfTensor]]:
    """Consecutive tensors in shards of at most ``max_bytes`` (a tensor larger than that alone in its own)."""
    out: list[list[HfTensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel * itemsize
        if not out or size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out
