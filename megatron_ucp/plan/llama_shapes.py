"""The parameters of a Megatron-DeepSpeed llama-style ``GPTModel``, per TP rank, from its shape alone.

Pure (no I/O, no torch). What ``pretrain_gpt_alcf.py`` builds with ``--no-pipeline-parallel``,
``--normalization rmsnorm``, ``--disable-bias-linear``, RoPE and (optionally) ``--swiglu``,
``--num-key-value-heads`` and ``--untie-embeddings-and-output-weights``: the names DeepSpeed
records in ``param_shapes``, in declaration order, in Megatron's two param groups (weight decay:
the matrices; no weight decay: the RMSNorm weights), and each parameter's TP split as Megatron's
``tensor_model_parallel`` / ``partition_dim`` attributes give it. With a :class:`PipeStage`, the
same for one stage of the pipeline model ``GPTModelPipe`` (any PP): its layer list, DeepSpeed's
``type:transformer`` split of it (:mod:`~megatron_ucp.plan.pipeline_stages`) and its names. With
``experts`` (``--num-experts``), every ``expert_interval``-th layer's MLP is DeepSpeed-MoE's: a gate
(``mlp.deepspeed_moe.gate.wg.weight``, dense, weight decay) and, in a third param group of their own
(``--create-moe-param-group``), one expert-parallel rank's experts under local names. The
synthetic-checkpoint writer
and the metadata-only scale tools use it; a real save of the same shape is the proof
(``tests/system/test_synthetic_checkpoint.py``, ``tests/integration``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_ucp.errors import PlanError
from megatron_ucp.plan.conversion import ParamSpec
from megatron_ucp.plan.pipeline_stages import balanced_cuts
from megatron_ucp.plan.tensor_parallel import TpLayout, slice_shape

WEIGHT_DECAY, NO_WEIGHT_DECAY, EXPERTS = 0, 1, 2
EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
ROTARY_BUFFER = "language_model.rotary_pos_emb.inv_freq"
"""The one persistent buffer of a RoPE model (``buffer_names``; Megatron's own save leaves it out)."""
TIED_EMBEDDING = "tied_modules.embed."
"""Where ``GPTModelPipe`` keeps a tied embedding (``TiedLayerSpec("embed", ...)``): on the first and
the last stage, registered before the stage's numbered layers."""
_Declared = dict[str, tuple[tuple[int, ...], TpLayout]]


@dataclass(frozen=True)
class PipeStage:
    """Stage ``index`` of a ``GPTModelPipe`` cut into ``pp`` stages."""

    pp: int
    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.pp:
            raise PlanError(f"pipeline stage {self.index} of {self.pp} does not exist")

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1


@dataclass(frozen=True)
class PipeLayer:
    """One entry of ``GPTModelPipe``'s layer list: its position, its parameters (local names), and
    whether it is the tied embedding (``tied``: named ``tied_modules.embed.*``; only its first use
    is a module whose weights the stage saves in a ``layer_XX`` file)."""

    index: int
    params: _Declared = field(default_factory=dict)
    transformer: bool = False
    tied: bool = False
    saves_file: bool = True


@dataclass(frozen=True)
class LlamaShape:
    """A llama-style model's sizes. ``vocab`` is the padded vocabulary (``args.padded_vocab_size``)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: Optional[int] = None
    vocab: int = 32000
    original_vocab: Optional[int] = None
    """The tokenizer's vocabulary (``universal_checkpoint_info.original_vocab_size``); default ``vocab``."""
    tied: bool = False
    swiglu: bool = True
    experts: int = 0
    """Experts per MoE layer (``--num-experts``); 0: a dense model."""
    expert_interval: int = 2
    """Every ``expert_interval``-th layer is an MoE layer (``--expert-interval``, the fork's default 2)."""

    def __post_init__(self) -> None:
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        object.__setattr__(self, "kv_heads", kv)
        if self.original_vocab is None:
            object.__setattr__(self, "original_vocab", self.vocab)
        sizes = {
            "layers": self.layers,
            "hidden": self.hidden,
            "ffn": self.ffn,
            "heads": self.heads,
            "kv_heads": kv,
            "vocab": self.vocab,
        }
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise PlanError(f"llama shape: sizes must be positive integers, got {bad}")
        if self.hidden % self.heads or self.heads % kv:
            raise PlanError(
                f"llama shape: hidden {self.hidden} must divide into {self.heads} heads, and the heads "
                f"into {kv} key-value groups"
            )
        if not 0 < self.original_vocab <= self.vocab:
            raise PlanError(f"llama shape: original vocabulary {self.original_vocab} must be in 1..{self.vocab}")
        if self.experts < 0 or self.expert_interval < 1 or (self.experts and not self.moe_layers()):
            raise PlanError(
                f"llama shape: {self.experts} experts every {self.expert_interval} layers of {self.layers}: "
                "no MoE layer"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def check_tp(self, tp: int) -> None:
        parts = {"vocab": self.vocab, "heads": self.heads, "kv_heads": self.kv_heads, "ffn": self.ffn}
        bad = {k: v for k, v in parts.items() if v % tp}
        if tp < 1 or bad:
            raise PlanError(f"llama shape: TP={tp} must divide {bad or parts}")

    def param_groups(self, tp: int = 1, stage: Optional[PipeStage] = None, ep: int = 1) -> list[list[ParamSpec]]:
        """``[weight decay, no weight decay]``, each in declaration order, with one TP rank's shapes
        (of ``GPTModel``, or of one ``GPTModelPipe`` stage); with experts, then the expert group: the
        experts of one expert-parallel rank of ``ep`` under local names (every rank's have the same)."""
        self.check_tp(tp)
        groups: list[list[ParamSpec]] = [[], []]
        for name, (shape, layout) in self._declared(stage).items():
            group = NO_WEIGHT_DECAY if len(shape) == 1 else WEIGHT_DECAY  # Megatron: norms (and biases) 1-D
            groups[group].append(ParamSpec(name, group, slice_shape(shape, layout, tp, name)))
        if self.experts:
            groups.append([ParamSpec(name, EXPERTS, shape) for name, shape in self.expert_params(ep).items()])
        return groups

    def tp_layouts(self, stage: Optional[PipeStage] = None, ep: int = 1) -> dict[str, TpLayout]:
        """Each parameter's TP split as Megatron's attributes record it (what the save hook writes; an
        expert, which TP does not split, under its local name)."""
        layouts = {name: layout for name, (_, layout) in self._declared(stage).items()}
        return {**layouts, **{name: TpLayout(replicated=True) for name in self.expert_params(ep)}}

    def module_names(self, stage: Optional[PipeStage] = None) -> list[str]:
        """The module's own parameters in declaration order (an MoE layer's gate, not its experts)."""
        return list(self._declared(stage))

    def numel(self) -> int:
        """Every parameter, every expert of every MoE layer included."""
        dense = sum(p.numel for g in self.param_groups()[:2] for p in g)
        return dense + sum(math.prod(shape) for shape in self.expert_params(1).values())

    # ---- mixture of experts --------------------------------------------------------------------
    def moe_layers(self) -> list[int]:
        """The MoE layers' indices (the fork: layer number ``i + 1`` a multiple of the interval)."""
        if not self.experts:
            return []
        return [i for i in range(self.layers) if (i + 1) % self.expert_interval == 0]

    def local_experts(self, ep: int) -> int:
        if ep < 1 or self.experts % ep:
            raise PlanError(f"llama shape: EP={ep} does not divide {self.experts} experts")
        return self.experts // ep

    def expert_params(self, ep: int = 1) -> dict[str, tuple[int, ...]]:
        """One expert-parallel rank's experts, local names (``...deepspeed_experts.<k>...``) in flat order:
        layer by layer, expert by expert."""
        h, out = self.hidden, {}
        for i in self.moe_layers():
            for k in range(self.local_experts(ep)):
                prefix = f"language_model.encoder.layers.{i}.mlp.{EXPERT_PREFIX}{k}."
                out[prefix + "dense_h_to_4h.weight"] = ((2 if self.swiglu else 1) * self.ffn, h)
                out[prefix + "dense_4h_to_h.weight"] = (h, self.ffn)
        return out

    def _layer(self, moe: bool = False) -> _Declared:
        """One transformer layer's parameters, local names in declaration order (an MoE layer's MLP: its gate;
        its experts are in a group of their own)."""
        h = self.hidden
        column, row, replicated = TpLayout(dim=0), TpLayout(dim=1), TpLayout(replicated=True)
        mlp: _Declared = (
            {"mlp.deepspeed_moe.gate.wg.weight": ((self.experts, h), replicated)}
            if moe
            else {
                "mlp.dense_h_to_4h.weight": (((2 if self.swiglu else 1) * self.ffn, h), column),
                "mlp.dense_4h_to_h.weight": ((h, self.ffn), row),
            }
        )
        return {
            "input_layernorm.weight": ((h,), replicated),
            "self_attention.query_key_value.weight": ((self.qkv_rows, h), column),
            "self_attention.dense.weight": ((h, h), row),
            "post_attention_layernorm.weight": ((h,), replicated),
            **mlp,
        }

    def _declared(self, stage: Optional[PipeStage] = None) -> _Declared:
        if stage is not None:
            return self._stage_declared(stage)
        h = self.hidden
        out = {"language_model.embedding.word_embeddings.weight": ((self.vocab, h), TpLayout(dim=0))}
        moe = set(self.moe_layers())
        for i in range(self.layers):
            out.update({f"language_model.encoder.layers.{i}.{k}": v for k, v in self._layer(i in moe).items()})
        out["language_model.encoder.final_layernorm.weight"] = ((h,), TpLayout(replicated=True))
        if not self.tied:
            out["language_model.output_layer.weight"] = ((self.vocab, h), TpLayout(dim=0))
        return out

    # ---- the pipeline model ------------------------------------------------------------------
    def pipe_layers(self) -> list[PipeLayer]:
        """``GPTModelPipe``'s layer list (bf16 cast, embedding, layers, final norm, head, fp32 cast)."""
        if self.experts:
            raise PlanError("llama shape: the pipeline model with experts is not described (GPTModel only)")
        h = self.hidden
        embedding = {"word_embeddings.weight": ((self.vocab, h), TpLayout(dim=0))}
        out = [PipeLayer(0), PipeLayer(1, embedding, tied=self.tied)]
        out += [PipeLayer(2 + i, self._layer(), transformer=True) for i in range(self.layers)]
        out.append(PipeLayer(len(out), {"weight": ((h,), TpLayout(replicated=True))}))
        if self.tied:  # the second use of the tied embedding: a function around the shared module
            out.append(PipeLayer(len(out), embedding, tied=True, saves_file=False))
        else:
            out.append(PipeLayer(len(out), {"lm_head.weight": ((self.vocab, h), TpLayout(dim=0))}))
        out.append(PipeLayer(len(out)))
        return out

    def stage_layers(self, stage: PipeStage) -> list[PipeLayer]:
        """The layers DeepSpeed's ``type:transformer`` partition gives ``stage``."""
        layers = self.pipe_layers()
        if stage.pp > self.layers:
            raise PlanError(f"PP={stage.pp} stages for {self.layers} transformer layers: a stage would hold none")
        cuts = balanced_cuts([int(layer.transformer) for layer in layers], stage.pp)
        return layers[cuts[stage.index] : cuts[stage.index + 1]]

    def _stage_declared(self, stage: PipeStage) -> _Declared:
        layers = self.stage_layers(stage)
        out: _Declared = {}
        for layer in (x for x in layers if x.tied):  # tied_modules is registered before the numbered layers
            out.update({TIED_EMBEDDING + k: v for k, v in layer.params.items()})
        for layer in (x for x in layers if not x.tied):
            out.update({f"{layer.index}.{k}": v for k, v in layer.params.items()})
        return out


PRESETS = {
    "aurora-7b": LlamaShape(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
    "llama-1b": LlamaShape(layers=16, hidden=2048, ffn=5632, heads=16, kv_heads=16, vocab=32000),
    "llama-100m": LlamaShape(layers=8, hidden=768, ffn=2048, heads=12, kv_heads=4, vocab=32000),
}
"""``aurora-7b``: AuroraGPT-7B as ``train_aGPT_7B.sh`` configures it (Llama-2 tokenizer, no GQA).
``llama-1b``: the scale benchmark's ~1B shape (about 11.4 GB of fp32 master and Adam state)."""


def preset(name: str) -> LlamaShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise PlanError(f"unknown model preset {name!r}; one of {sorted(PRESETS)}") from None
