"""The objects DeepSpeed pickles into each file of a checkpoint, built from a spec instead of a run.

One function per file kind: :func:`rank_file_state` (``*_optim_states.pt``: one DP rank's flat
partitions and DeepSpeed's bookkeeping, exactly as ``BF16_Optimizer.state_dict`` or
``DeepSpeedZeroOptimizer.state_dict`` of the given release returns it, wrapped as the engine saves
it), :func:`model_states` (``mp_rank_XX_model_states.pt``: the engine's dict, then the client
state Megatron-DeepSpeed adds) and, for the pipeline model, :func:`layer_files` (``layer_XX-model_YY-
model_states.pt``: one per layer of a stage, as ``PipelineModule.save_state_dict`` writes them).
A model-parallel rank is numbered as DeepSpeed numbers it (:class:`~megatron_ucp.plan.parallel_layout.
ParallelLayout`). DeepSpeed's own objects (``fragment_address``, ``LossScaler``, ``ZeroStageEnum``)
are lightpickle stand-ins pickled as DeepSpeed pickles them, so the files load with DeepSpeed's
classes and nothing here imports DeepSpeed: any release's files are written from any environment.
Where a release differs, :class:`~megatron_ucp.deepspeed.versions.SavedFiles` says how.

Size: the three file kinds share the spec's values (:func:`state_range`) and the weights the
model states and layer files both hold; split, each part would re-derive them.
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_ucp.deepspeed.surface import layout_named
from megatron_ucp.deepspeed.versions import SavedFiles, saved_files
from megatron_ucp.errors import PlanError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.lightpickle import stand_in_class
from megatron_ucp.plan.conversion import ParamSpec, RankGroupLayout, RankLayout
from megatron_ucp.plan.experts import global_expert_name
from megatron_ucp.plan.geometry import GroupGeometry, PaddingStyle
from megatron_ucp.plan.llama_shapes import (
    EXPERT_PREFIX,
    EXPERTS,
    NO_WEIGHT_DECAY,
    ROTARY_BUFFER,
    TIED_EMBEDDING,
    LlamaShape,
    PipeStage,
)
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.reshard import Placement
from megatron_ucp.plan.save_record import partition_checksums, partition_record, save_identity
from megatron_ucp.plan.tensor_parallel import TP_LAYOUT_KEY
from megatron_ucp.synthetic.layouts import synthesize_layouts
from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS
from megatron_ucp.synthetic.values import flat_range

OPTIMIZERS = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer"}
STAGE3_CLASS = "DeepSpeedZeroOptimizer_Stage3"
FLAVOURS = ("megatron", "plain")
_FRAGMENT = stand_in_class("deepspeed.utils.tensor_fragment", "fragment_address")
LOSS_SCALER = stand_in_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
ZERO_STAGE_ENUM = stand_in_class("deepspeed.runtime.zero.config", "ZeroStageEnum")


@dataclass(frozen=True)
class SyntheticSpec:
    """A checkpoint as a Megatron-DeepSpeed (or plain DeepSpeed) ZeRO-1/2 bf16 run would save it.

    ``optimizer``: ``bf16`` (BF16_Optimizer: ``data_types.grad_accum_dtype: fp32``) or ``zero``
    (DeepSpeedZeroOptimizer, ZeRO stage ``zero_stage``). ``record``: saved with megatron-ucp's
    hooks (per-rank true lengths and paddings, partition info, TP layouts). ``flavour``:
    ``megatron`` (``pretrain_gpt_alcf.py``'s GPTModel: nested module dict, ``args``, RNG states,
    Megatron's param groups) or ``plain`` (an engine around a torch AdamW, no client state).
    ``pipeline``: Megatron's ``GPTModelPipe`` in ``pp`` stages (a DeepSpeed ``PipelineModule``:
    layer files, stage-local names); PP > 1 needs it, as in Megatron-DeepSpeed.
    ``ep``: a mixture-of-experts model's (``shape.experts``) expert-parallel size, as DeepSpeed-MoE saves it
    at TP = PP = 1 with ``--create-moe-param-group``: expert files, the expert group partitioned over
    expert-DP (DP / EP ranks), the release's MoE model states (:class:`~megatron_ucp.deepspeed.versions.MoeFiles`).
    """

    shape: LlamaShape
    dp: int
    tp: int = 1
    pp: int = 1
    pipeline: bool = False
    optimizer: str = "bf16"
    zero_stage: int = 1
    ds_version: str = "0.19.8"
    record: bool = False
    flavour: str = "megatron"
    iteration: int = 100
    seed: int = 0
    micro_batch: int = 1
    grad_accumulation: int = 1
    seq_length: int = 4096
    ep: int = 1
    base_optimizer: str = "adam"
    """The optimizer DeepSpeed wraps (:data:`~megatron_ucp.synthetic.values.BASE_OPTIMIZERS`): its states."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.zero_stage not in layout_named(self.optimizer_class).stages:
            raise PlanError(
                f"ZeRO stage {self.zero_stage} with {self.optimizer_class}: BF16_Optimizer is stage 1 only, "
                "DeepSpeedZeroOptimizer stage 1 or 2 (3: DeepSpeedZeroOptimizer_Stage3)"
            )
        if self.zero_stage == 3 and (self.pipeline or self.pp > 1):
            raise PlanError("ZeRO-3 with pipeline parallelism: DeepSpeed's pipeline engine runs stages 0 to 2 only")
        if self.base_optimizer not in BASE_OPTIMIZERS:
            raise PlanError(f"base optimizer must be one of {sorted(BASE_OPTIMIZERS)}, got {self.base_optimizer!r}")
        if self.flavour not in FLAVOURS:
            raise PlanError(f"flavour must be one of {FLAVOURS}, got {self.flavour!r}")
        if self.dp < 1 or self.iteration < 1:
            raise PlanError(f"DP size and iteration must be >= 1, got {self.dp}, {self.iteration}")
        if self.pp < 1 or (self.pp > 1 and not self.pipeline):
            raise PlanError(f"PP={self.pp}: pipeline parallelism needs the pipeline model (GPTModelPipe)")
        if self.pipeline and self.flavour != "megatron":
            raise PlanError("the pipeline model is Megatron-DeepSpeed's: flavour must be 'megatron'")
        self.shape.check_tp(self.tp)
        self.shape.param_groups(self.tp, self.stage(self.mp_size - 1), self.ep)
        saved_files(self.ds_version)
        if self.shape.experts or self.ep > 1:
            self._check_experts()

    def _check_experts(self) -> None:
        where = f"{self.shape.experts} experts at EP={self.ep}, DP={self.dp}"
        if not self.shape.experts:
            raise PlanError(f"EP={self.ep} for a model without experts (shape.experts = 0)")
        if self.mp_size > 1 or self.pipeline or self.flavour != "megatron" or self.zero_stage == 3:
            raise PlanError(f"{where}: the MoE writer writes the fork's GPTModel at TP = PP = 1, ZeRO-1/2")
        if self.dp % self.ep:
            raise PlanError(f"{where}: EP must divide DP (each expert-parallel rank's experts over DP / EP ranks)")
        if self.files.moe is None:
            raise PlanError(f"{where}: no record of how DeepSpeed {self.ds_version} writes a mixture-of-experts save")

    def optimizer_states(self, part: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        """One partition's state as the wrapped optimizer keeps it: its step, each per-element state from
        ``part(state)``, and its states of one value per partition."""
        per_element, scalars = BASE_OPTIMIZERS[self.base_optimizer]
        out: dict[str, Any] = {"step": torch.tensor(float(self.iteration))}
        out.update({state: part(state) for state in per_element})
        out.update({k: torch.tensor(v) if isinstance(v, float) else v for k, v in scalars.items()})
        return out

    @property
    def optimizer_class(self) -> str:
        return STAGE3_CLASS if self.optimizer == "zero" and self.zero_stage == 3 else OPTIMIZERS[self.optimizer]

    @property
    def per_parameter(self) -> bool:
        """ZeRO-3: every rank its own model states, each parameter partitioned on its own."""
        return self.zero_stage == 3

    @property
    def files(self) -> SavedFiles:
        return saved_files(self.ds_version)

    @property
    def tag(self) -> str:
        return f"global_step{self.iteration}"

    @property
    def save_id(self) -> str:
        """The identity a save "with our record" carries (reproducible, unlike a real save's random one)."""
        return f"synthetic-{self.seed}-{self.iteration}"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.dp * self.grad_accumulation

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    @property
    def mp_size(self) -> int:
        """Model-parallel ranks: one ``mp_rank_XX`` model-states file and one row of rank files each."""
        return self.layout.model_parallel

    def layout_text(self) -> str:
        model = (
            f"GPTModelPipe, PP={self.pp}" if self.pipeline else "GPTModel" if self.flavour == "megatron" else "plain"
        )
        experts = f", EP={self.ep} ({self.shape.experts} experts per MoE layer)" if self.shape.experts else ""
        return f"TP={self.tp}, DP={self.dp}{experts}, {model}"

    def stage(self, mp_rank: int) -> Optional[PipeStage]:
        """The pipeline stage that model-parallel rank holds (None: the non-pipeline GPTModel)."""
        stage, _ = self.layout.coordinates_of(mp_rank)
        return PipeStage(self.pp, stage) if self.pipeline else None

    def groups(self, mp_rank: int = 0) -> list[list[ParamSpec]]:
        """The param groups (an expert group under one expert-parallel rank's local names)."""
        return self.shape.param_groups(self.tp, self.stage(mp_rank), self.ep)

    @property
    def placement(self) -> Placement:
        """Which rank files hold which group's partitions (the expert group: over expert-DP)."""
        return Placement.of(self.ep, [EXPERTS] if self.shape.experts else [])

    def geometries(self, mp_rank: int = 0) -> list[GroupGeometry]:
        """Each group's geometry over its own number of partitions."""
        return [
            GroupGeometry(numel=sum(p.numel for p in g), dp=self.placement.size(i, self.dp))
            for i, g in enumerate(self.groups(mp_rank))
        ]

    def padding_style(self) -> PaddingStyle:
        """How this release's optimizer class records ``group_paddings`` (before our record replaces it)."""
        if self.optimizer == "zero" and self.files.zero_per_rank_padding:
            return PaddingStyle.PER_RANK
        return PaddingStyle.LAST_RANK_ONLY

    def ds_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "steps_per_print": 1000,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": True},
            "wall_clock_breakdown": False,
        }
        if self.optimizer == "bf16":
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config


# ---- values ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _group_facts(spec: SyntheticSpec, mp_rank: int, group: int) -> tuple[int, int]:
    """(real length, length of the tied embedding's copy at the start) of one flat group."""
    params = spec.groups(mp_rank)[group]
    stage = spec.stage(mp_rank)
    tied = params[0].numel if params and stage and stage.index > 0 and params[0].name.startswith(TIED_EMBEDDING) else 0
    return sum(p.numel for p in params), tied


def state_range(
    spec: SyntheticSpec, mp_rank: int, group: int, state: str, start: int, stop: int, expert_rank: int = 0
) -> torch.Tensor:
    """Elements ``[start, stop)`` of a group's flat ``state`` (``fp32``, ``exp_avg``, ``exp_avg_sq``) on a
    model-parallel rank, zero from its real length on. What a real run holds identically on several
    ranks is identical here: the TP-replicated parameters (the no-weight-decay group, the norms) on
    every TP rank of a stage, and a tied embedding on the last stage as on the first. The expert group:
    expert-parallel rank ``expert_rank``'s buffer (its own experts)."""
    stage, tp_rank = spec.layout.coordinates_of(mp_rank)
    real, tied = _group_facts(spec, mp_rank, group)
    if spec.placement.expert(group):
        return flat_range(spec.seed, f"s{stage}/e{expert_rank}/g{group}", state, start, stop, real)

    def buffer(at_stage: int) -> str:
        return f"s{at_stage}/{'replicated' if group == NO_WEIGHT_DECAY else f't{tp_rank}'}/g{group}"

    if start >= tied:
        return flat_range(spec.seed, buffer(stage), state, start, stop, real)
    head = flat_range(spec.seed, buffer(0), state, start, min(stop, tied), real)
    return torch.cat([head, flat_range(spec.seed, buffer(stage), state, tied, max(stop, tied), real)])


# ---- rank files ------------------------------------------------------------------------------
def param_group_hyperparameters(spec: SyntheticSpec, group: int) -> dict[str, Any]:
    if spec.placement.expert(group):  # the fork's --create-moe-param-group: weight decay, DeepSpeed's name
        head = {"name": f"ep_size_{spec.ep}", "wd_mult": 1.0, "lr_mult": 1.0, "moe": True}
        return {**head, **_adam(0.1), "decoupled_weight_decay": False, "params": [group]}
    adam = _adam(0.1 if group == 0 else 0.0)
    if spec.flavour == "megatron":  # Megatron's get_param_groups, then torch Adam (weight decay coupled)
        head = {
            "name": "wd_no_scale_lr" if group == 0 else "no_wd_no_scale_lr",
            "wd_mult": 1.0 if group == 0 else 0.0,
            "lr_mult": 1.0,
        }
        return {**head, **adam, "decoupled_weight_decay": False, "params": [group]}
    return {**adam, "decoupled_weight_decay": True, "params": [group]}


def _adam(weight_decay: float) -> dict[str, Any]:
    return {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-08,
        "weight_decay": weight_decay,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
    }


@functools.lru_cache(maxsize=8)
def rank_layouts(spec: SyntheticSpec, mp_rank: int = 0) -> list[RankLayout]:
    """Every DP rank's file as the reader sees it (fragments, stored lengths, recorded paddings),
    from metadata alone: :func:`~megatron_ucp.synthetic.layouts.synthesize_layouts` with this release's
    paddings. The writer takes ``param_slice_mappings`` from it; the 7B/768 plan needs nothing else.
    An expert group is laid out over its expert-DP ranks (every expert-parallel rank's the same)."""
    groups, placement = spec.groups(mp_rank), spec.placement
    per_size = {
        size: synthesize_layouts(
            groups,
            size,
            recorded_style=None if spec.record else spec.padding_style(),
            fp32_cut_style=spec.padding_style() if spec.optimizer == "zero" else None,
        )
        for size in {placement.size(g, spec.dp) for g in range(len(groups))}
    }
    return [
        RankLayout(
            rank=d,
            groups=tuple(
                per_size[placement.size(g, spec.dp)][placement.index(g, d)].groups[g] for g in range(len(groups))
            ),
        )
        for d in range(spec.dp)
    ]


def _slice_mappings(layout: RankGroupLayout) -> "collections.OrderedDict[str, Any]":
    out: collections.OrderedDict[str, Any] = collections.OrderedDict()
    for fragment in layout.fragments:
        out[fragment.name] = _FRAGMENT.__new__(_FRAGMENT)
        out[fragment.name].__setstate__({"numel": fragment.numel, "start": fragment.start})
    return out


def rank_file_state(spec: SyntheticSpec, mp_rank: int, dp_rank: int) -> dict[str, Any]:
    """What the engine saves as ``bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt``."""
    groups, geos, style = spec.groups(mp_rank), spec.geometries(mp_rank), spec.padding_style()
    layout = rank_layouts(spec, mp_rank)[dp_rank]
    at = [spec.placement.index(g, dp_rank) for g in range(len(geos))]
    fp32, masters, states, mappings, recorded = [], [], {}, [], []
    for g, geo in enumerate(geos):
        size = geo.partition_size
        start = at[g] * size

        def part(state: str) -> torch.Tensor:
            return state_range(spec, mp_rank, g, state, start, start + size, dp_rank % spec.ep)

        padding = geo.recorded_padding(at[g], style)
        master = part("fp32")
        masters.append(master)
        # DeepSpeedZeroOptimizer cuts its recorded padding off the fp32 partition (Python slice
        # semantics: a padding larger than the partition leaves a wrong, positive length).
        fp32.append(master[: size - padding] if spec.optimizer == "zero" else master)
        states[g] = spec.optimizer_states(part)
        mappings.append(_slice_mappings(layout.groups[g]))
        recorded.append(padding)
    base = {"state": states, "param_groups": [param_group_hyperparameters(spec, g) for g in range(len(geos))]}
    sd: dict[str, Any] = {}
    if spec.optimizer == "zero":
        scaler = LOSS_SCALER.__new__(LOSS_SCALER)
        scaler.__setstate__({"cur_scale": 1.0, "dynamic": False})
        sd.update({"loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False})
    sd.update({"clip_grad": 1.0, F.BASE_OPTIMIZER_STATE: base, F.SINGLE_PARTITION_OF_FP32_GROUPS: fp32})
    if spec.optimizer == "zero":
        sd[F.ZERO_STAGE] = ZERO_STAGE_ENUM(spec.zero_stage)
    sd[F.GROUP_PADDINGS] = recorded
    if spec.optimizer == "zero" and spec.files.param_alignment_paddings:
        sd[F.PARAM_ALIGNMENT_PADDINGS] = [[0] * len(g) for g in groups]
    counts = [geo.dp for geo in geos]
    sd.update({F.PARTITION_COUNT: counts, F.DS_VERSION: spec.ds_version, F.PARAM_SLICE_MAPPINGS: mappings})
    if spec.record:
        record = partition_record(
            [geo.numel for geo in geos],
            [geo.numel for geo in geos],
            [geo.padded_total for geo in geos],
            counts,
            at,
        )
        sd.update(record)
        sd.update(partition_checksums(masters, [states[g] for g in range(len(geos))], record))
        sd.update(save_identity(spec.save_id, spec.dp, dp_rank))
    return {F.OPTIMIZER_STATE_DICT: sd, F.DS_CONFIG: spec.ds_config(), F.DS_VERSION: spec.ds_version}


# ---- model states ------------------------------------------------------------------------------
def bf16_weights(spec: SyntheticSpec, mp_rank: int, expert_rank: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Each parameter's bf16 weight: the fp32 master rounded, as views of the group's flat buffer
    (DeepSpeed's parameters are views of it, so ``torch.save`` stores the padded buffer once). The expert
    group's, of expert-parallel rank ``expert_rank``, only when asked (local names)."""
    out = {}
    for g, (params, geo) in enumerate(zip(spec.groups(mp_rank), spec.geometries(mp_rank))):
        if spec.placement.expert(g) != (expert_rank is not None):
            continue
        flat = torch.zeros(geo.padded_total, dtype=torch.bfloat16)
        chunk = 1 << 24
        for lo in range(0, geo.numel, chunk):
            hi = min(lo + chunk, geo.numel)
            flat[lo:hi] = state_range(spec, mp_rank, g, "fp32", lo, hi, expert_rank or 0).to(torch.bfloat16)
        offset = 0
        for p in params:
            out[p.name] = flat[offset : offset + p.numel].view(p.shape)
            offset += p.numel
    return out


def expert_files(spec: SyntheticSpec, mp_rank: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt`` of a mixture-of-experts save: each expert's
    weights (its masters rounded, cloned) under its global index, ``l`` counting MoE layers only."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    local = spec.shape.local_experts(spec.ep)
    for r in range(spec.ep if spec.shape.experts else 0):
        for name, weight in bf16_weights(spec, mp_rank, expert_rank=r).items():
            layer = int(name.split("language_model.encoder.layers.", 1)[1].split(".", 1)[0])
            moe_layer = spec.shape.moe_layers().index(layer)
            expert = r * local + int(name.split(EXPERT_PREFIX, 1)[1].split(".", 1)[0])
            file = spec.layout.expert_file(moe_layer, expert, mp_rank)
            out.setdefault(file, {})[global_expert_name(name, r, local)] = weight.clone()
    return out


def expert_optimizer_files(spec: SyntheticSpec, mp_rank: int = 0) -> dict[str, dict[str, Any]]:
    """The ``expp_rank_<r>`` files a ZeRO MoE save writes before 0.19 (``{'optimizer': None}``)."""
    if not spec.shape.experts or spec.files.moe is None or not spec.files.moe.expert_optimizer_files:
        return {}
    return {spec.layout.expert_optimizer_file(r, mp_rank): {"optimizer": None} for r in range(spec.ep)}


def layer_file_name(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def layer_files(
    spec: SyntheticSpec, mp_rank: int, weights: Optional[dict[str, torch.Tensor]] = None
) -> dict[str, "collections.OrderedDict[str, Any]"]:
    """The pipeline model's per-layer files of one stage and TP rank (written by DP rank 0): each
    layer's own ``state_dict`` with its tensors cloned, for every layer that is a module (the tied
    embedding's second use is a function around the first, and saves nothing)."""
    if not spec.pipeline:
        return {}
    weights = bf16_weights(spec, mp_rank) if weights is None else weights
    stage, tp_rank = spec.stage(mp_rank), spec.layout.coordinates_of(mp_rank)[1]
    out = {}
    for layer in spec.shape.stage_layers(stage):
        if not layer.params or not layer.saves_file:
            continue
        prefix = TIED_EMBEDDING if layer.tied else f"{layer.index}."
        out[layer_file_name(layer.index, tp_rank)] = collections.OrderedDict(
            (k, weights[prefix + k].clone()) for k in layer.params
        )
    return out


def module_dict(spec: SyntheticSpec, weights: Optional[dict[str, torch.Tensor]]) -> Optional[dict[str, Any]]:
    if spec.pipeline or weights is None:  # a PipelineModule saves its layers in files of their own
        return None
    declared = spec.shape.module_names()  # declaration order, as the module's state_dict lists them
    if spec.shape.experts and spec.files.moe is not None and spec.files.moe.clones_module:
        weights = {name: weights[name].clone() for name in declared}
    if spec.flavour == "plain":
        return collections.OrderedDict((n, weights[n]) for n in declared)
    # Megatron's state_dict_for_save_checkpoint: nested by submodule, the encoder's keys flat
    prefix = "language_model.encoder."
    lm: dict[str, Any] = {
        "embedding": {
            "word_embeddings": collections.OrderedDict(
                weight=weights["language_model.embedding.word_embeddings.weight"]
            )
        }
    }
    lm["encoder"] = collections.OrderedDict((n[len(prefix) :], weights[n]) for n in declared if n.startswith(prefix))
    if not spec.shape.tied:
        lm["output_layer"] = collections.OrderedDict(weight=weights["language_model.output_layer.weight"])
    return {"language_model": lm}


def _megatron_args(spec: SyntheticSpec) -> argparse.Namespace:
    s = spec.shape
    pipeline = {
        "pipeline_model_parallel_size": spec.pp,
        "no_pipeline_parallel": not spec.pipeline,
        "ds_pipeline_enabled": spec.pipeline,
    }
    return argparse.Namespace(
        num_layers=s.layers,
        hidden_size=s.hidden,
        ffn_hidden_size=s.ffn,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        padded_vocab_size=s.vocab,
        swiglu=s.swiglu,
        untie_embeddings_and_output_weights=not s.tied,
        normalization="rmsnorm",
        add_bias_linear=False,
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        seq_length=spec.seq_length,
        tensor_model_parallel_size=spec.tp,
        **pipeline,
        data_parallel_size=spec.dp,
        world_size=spec.dp * spec.mp_size,
        rank=0,
        micro_batch_size=spec.micro_batch,
        global_batch_size=spec.global_batch,
        iteration=spec.iteration,
        consumed_train_samples=spec.iteration * spec.global_batch,
        consumed_valid_samples=0,
        deepspeed=True,
        bf16=True,
        fp16=False,
        zero_stage=spec.zero_stage,
    )


def _moe_args(spec: SyntheticSpec) -> dict[str, Any]:
    """What the fork's arguments say of the experts (the runner reads EP from them)."""
    return {
        "num_experts": [spec.shape.experts] if spec.shape.experts else [1],
        "expert_interval": spec.shape.expert_interval,
        "moe_expert_parallel_size": spec.ep,
        "create_moe_param_group": bool(spec.shape.experts),
        "enable_expert_tensor_parallelism": False,
    }


def _megatron_args_of(spec: SyntheticSpec, mp_rank: int) -> argparse.Namespace:
    args = _megatron_args(spec)
    if spec.shape.experts:
        vars(args).update(_moe_args(spec))
    # DP rank 0 of the stage saves it; Megatron orders ranks TP fastest, then DP, then PP
    stage, tp_rank = spec.layout.coordinates_of(mp_rank)
    args.rank = stage * spec.tp * spec.dp + tp_rank
    return args


def _rng_state(seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    state = gen.get_state()
    return [
        {
            "random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed).get_state(),
            "torch_rng_state": state,
            "cuda_rng_state": state.clone(),
            "rng_tracker_states": {"model-parallel-rng": state.clone()},
        }
    ]


def _universal_info(spec: SyntheticSpec) -> dict[str, Any]:
    """Megatron-DeepSpeed's ``universal_checkpoint_info``: its name patterns are the model class's."""
    s = spec.shape
    info: dict[str, Any] = {
        F.UNIVERSAL_CHECKPOINT_VERSION_KEY: spec.files.universal_checkpoint_version,
        F.ORIGINAL_VOCAB_SIZE: s.original_vocab,
        "padded_vocab_size": s.vocab,
    }
    if spec.pipeline:
        tied = [TIED_EMBEDDING + "word_embeddings.weight"]
        info[F.VOCABULARY_PARAMETER_PATTERNS] = (
            tied if s.tied else [r"\d+.word_embeddings.weight", r"\d+.lm_head.weight"]
        )
        info[F.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = tied if s.tied else []
        layers, final_norm = "", r"\d+.weight"
    else:
        info[F.VOCABULARY_PARAMETER_PATTERNS] = ["language_model.embedding.word_embeddings.weight"] + (
            [] if s.tied else ["language_model.output_layer.weight"]
        )
        layers, final_norm = "language_model.encoder.layers.", "language_model.encoder.final_layernorm.weight"
    if spec.tp > 1:
        info[F.TP_REPLICATED_PARAMETER_PATTERNS] = [
            layers + r"\d+.input_layernorm.weight",
            layers + r"\d+.post_attention_layernorm.weight",
            final_norm,
        ]
        info[F.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] = [
            layers + r"\d+.mlp.dense_4h_to_h.weight",
            layers + r"\d+.self_attention.dense.weight",
        ]
    info[F.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [layers + r"\d+.mlp.dense_h_to_4h.weight"] if s.swiglu else []
    return info


def megatron_client_state(spec: SyntheticSpec, mp_rank: int) -> dict[str, Any]:
    lr = {
        "max_lr": 3e-4,
        "lr_warmup_steps": 2000,
        "lr_warmup_tokens": None,
        "num_steps": spec.iteration,
        "num_tokens": spec.iteration * spec.global_batch * spec.seq_length,
        "lr_decay_style": "cosine",
        "lr_decay_steps": 10**6,
        "lr_decay_tokens": None,
        "min_lr": 3e-5,
        "start_wd": 0.1,
        "end_wd": 0.1,
        "wd_incr_style": "constant",
        "wd_incr_steps": 10**6,
    }
    return {
        "lr_scheduler": lr,
        F.UNIVERSAL_CHECKPOINT_INFO: _universal_info(spec),
        "args": _megatron_args_of(spec, mp_rank),
        "checkpoint_version": 3.0,
        "iteration": spec.iteration,
        "tokens": spec.iteration * spec.global_batch * spec.seq_length,
        "rng_state": _rng_state(spec.seed),
    }


def model_states(spec: SyntheticSpec, mp_rank: int, weights: Optional[dict[str, torch.Tensor]] = None) -> dict:
    """What the engine saves as ``mp_rank_{mp_rank:02d}_model_states.pt`` (client state included)."""
    weights = bf16_weights(spec, mp_rank) if weights is None and not spec.pipeline else weights
    files = spec.files
    client = megatron_client_state(spec, mp_rank) if spec.flavour == "megatron" else {}
    if spec.shape.experts and files.moe is not None and not files.moe.common_state:
        return _moe_model_states(spec, mp_rank, weights, client)
    frozen = collections.OrderedDict() if spec.zero_stage >= 2 else None
    state: dict[str, Any] = {
        "module": module_dict(spec, weights),
        "buffer_names": [ROTARY_BUFFER] if spec.flavour == "megatron" and not spec.pipeline else [],
        "optimizer": None,
        F.PARAM_SHAPES: [
            collections.OrderedDict((p.name, torch.Size(p.shape)) for p in g) for g in spec.groups(mp_rank)
        ],
        # ZeRO-2 and 3 (partitioned gradients) save the frozen parameters' shapes and fragments: none here
        "frozen_param_shapes": frozen,
        "shared_params": {},
        "frozen_param_fragments": frozen,
        "lr_scheduler": client.pop("lr_scheduler", {"last_batch_iteration": spec.iteration - 1}),
        "data_sampler": None,
        "random_ltd": None,
    }
    if files.sparse_tensor_module_names:
        state["sparse_tensor_module_names"] = set()
    state.update(
        {
            "skipped_steps": 0,
            "global_steps": spec.iteration,
            "global_samples": spec.iteration * spec.global_batch,
            F.DP_WORLD_SIZE: spec.dp,
            F.MP_WORLD_SIZE: spec.mp_size,
        }
    )
    if files.parallel_dimensions:
        state[F.CHECKPOINT_PARALLEL_DIMENSIONS] = {"pp_degree": spec.pp, "tp_degree": spec.tp}
    state.update({F.DS_CONFIG: spec.ds_config(), F.DS_VERSION: spec.ds_version})
    if spec.shape.experts:  # 0.19's MoE save: the common state, then the experts, cloned (shapes as tuples)
        state[F.PARAM_SHAPES] = [
            collections.OrderedDict((k, tuple(v)) for k, v in g.items()) for g in state[F.PARAM_SHAPES]
        ]
        state.update({"num_experts": _num_experts(spec), "ds_autoep_layers": None})
    return _with_client(spec, mp_rank, state, client)


def _num_experts(spec: SyntheticSpec) -> list[int]:
    """The engine's ``num_experts``: one entry per MoE layer."""
    return [spec.shape.experts] * len(spec.shape.moe_layers())


def _moe_model_states(
    spec: SyntheticSpec, mp_rank: int, weights: Optional[dict[str, torch.Tensor]], client: dict[str, Any]
) -> dict:
    """The model states of a mixture-of-experts save before 0.19: the module, the counters and
    ``num_experts`` only (no ``param_shapes``, ``ds_config`` nor ``ds_version``)."""
    state: dict[str, Any] = {
        "module": module_dict(spec, weights),
        "lr_scheduler": client.pop("lr_scheduler", {"last_batch_iteration": spec.iteration - 1}),
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": spec.iteration,
        "global_samples": spec.iteration * spec.global_batch,
        F.DP_WORLD_SIZE: spec.dp,
        F.MP_WORLD_SIZE: spec.mp_size,
        "num_experts": _num_experts(spec),
    }
    return _with_client(spec, mp_rank, state, client)


def _with_client(spec: SyntheticSpec, mp_rank: int, state: dict, client: dict[str, Any]) -> dict:
    """The client state Megatron adds, then the hooks' save identity and TP layouts."""
    state.update(client)
    if spec.record:
        state.update(save_identity(spec.save_id))
    if spec.record and spec.flavour == "megatron":
        state[TP_LAYOUT_KEY] = {
            name: layout.to_record() for name, layout in spec.shape.tp_layouts(spec.stage(mp_rank), spec.ep).items()
        }
    return state
