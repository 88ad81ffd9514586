"""STAND-IN for argonne-lcf/Megatron-DeepSpeed's ``pretrain_gpt_alcf.py`` (CPU, tiny models).

Megatron-DeepSpeed is not on any package registry, and its code must not be copied here. This
script is written from scratch to behave like ``pretrain_gpt_alcf.py`` + ``megatron/training.py``
+ ``megatron/checkpointing.py`` in every way megatron-ucp touches, so that the runner
(``python -m megatron_ucp.run``), the hooks and the demo can be exercised end to end on a laptop:

* Megatron-style argv (``--num-layers --hidden-size ... --save --load --save-interval
  --universal-checkpoint --no-load-rng --bf16 --zero-stage --deepspeed_config``); unknown
  Megatron options are rejected, as Megatron's argparse would.
* ``--universal-checkpoint`` puts ``"checkpoint": {"load_universal": true}`` into the DeepSpeed
  config (Megatron's ``_create_ds_config_dict``).
* Without ``--global-batch-size`` the global batch is WORLD_SIZE x micro x GAS (``GLOBAL_BATCH_MAX``
  in ALCF/helpers.sh; Megatron's own default micro x DP is the GAS=1 case); the engine's batch is
  re-set from it every iteration (``set_train_batch_size``), as Megatron's training loop does.
* Save: ``engine.save_checkpoint(save, client_state=...)`` with ``args``, ``iteration``,
  ``checkpoint_version``, ``tokens``, ``rng_state`` (a list indexed by DP rank when
  ``--data-parallel-random-init``, else ``[rank 0's state]``) and ``universal_checkpoint_info``
  (vocabulary parameter patterns, original vocab size); then a barrier, then rank 0 writes
  ``latest_checkpointed_iteration.txt`` where ``megatron.checkpointing.get_checkpoint_tracker_filename`` says (the
  stand-in provides that one function of Megatron's module when no ``megatron.checkpointing`` is loaded: looked up
  at each write, as Megatron's own module looks up its global), then a barrier. Like Megatron, it saves every
  ``--save-interval`` iterations and once more when training ends.
* Load: ``engine.load_checkpoint(load, tag=--load-tag)``; restores iteration, consumed samples,
  and (unless ``--no-load-rng``) the RNG states of ``rng_state[dp_rank or 0]``.
* A model built by megatron-core's ``GPTModel`` with the local (non-Transformer-Engine) layer
  spec; the optimizer param groups follow Megatron's rule (biases and 1-D params get no weight
  decay: ``wd_no_scale_lr`` / ``no_wd_no_scale_lr``), with a Megatron-like LR/WD scheduler.
* Deterministic synthetic data indexed by global sample index: iteration ``i`` trains on samples
  ``[i*GB, (i+1)*GB)`` whatever the DP size, so the same global batch gives the same data.
* One log line per iteration on rank 0: ``iteration 5/20 | consumed samples 80 | lm loss
  3.456789E+00 | grad norm ... | lr ... | dp 4`` (the lm loss is the global mean).

CPU workarounds (megatron-core 0.16.1 assumes CUDA in three places; documented in docs/megatron.md):
1. ``parallel_state``'s global memory buffer allocates on ``torch.cuda.current_device()``: it is
   replaced with a buffer that allocates on the CPU.
2. The model-parallel RNG tracker stores CUDA generator states: it is initialised as megatron-core's
   no-op tracker (``inference_rng_tracker=True``), so dropout inside ``fork()`` draws from the CPU
   generator. With TP=1 nothing else depends on it (AuroraGPT runs with dropout 0 anyway).
3. Without an explicit attention mask megatron-core builds its causal mask on ``device="cuda"``:
   the script passes Megatron's own left-to-right mask explicitly (as ``get_batch`` does).
4. megatron-core's non-TE linear layers add ``<layer>._extra_state: None`` entries to the state
   dict (for Transformer Engine compatibility). Megatron-DeepSpeed's own GPT model has none, and
   stock ``ds_to_universal`` 0.19.8 dies on them (``AttributeError: 'NoneType' object has no
   attribute 'float'``), so :func:`drop_te_extra_state` gives those layers torch's default
   (empty) extra state and the checkpoints look like Megatron-DeepSpeed's.
Also, megatron-core 0.16.1's ``parallel_state`` lacks ``get_model_parallel_rank`` /
``get_model_parallel_world_size`` that DeepSpeed calls on its ``mpu``; :class:`MpuAdapter` adds
them the way Megatron-DeepSpeed's own ``megatron.core.mpu`` defines them.

Stand-in-only options start with ``--standin-`` (vocabulary size instead of a tokenizer, and the
choice between DeepSpeed's two ZeRO-1 bf16 optimizers when the DeepSpeed config is built inline).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from typing import Any, Optional

import numpy as np
import torch

log = logging.getLogger("pretrain_gpt_standin")

BF16_OPTIMIZER = "BF16_Optimizer"
ZERO_OPTIMIZER = "DeepSpeedZeroOptimizer"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron's get_checkpoint_tracker_filename
CHECKPOINT_VERSION = 3.0


# ------------------------------------------------------------------------------------------------
# Arguments (Megatron names; stand-in-only options are prefixed --standin-)
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Megatron-DeepSpeed's option names for everything the training path and checkpoints use."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt_standin.py",
        allow_abbrev=False,
        description="CPU stand-in for Megatron-DeepSpeed's pretrain_gpt_alcf.py",
    )
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--ffn-hidden-size", type=int, default=None)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--num-key-value-heads", type=int, default=None)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--max-position-embeddings", type=int, required=True)
    m.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm")
    m.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--use-rotary-position-embeddings", action="store_true")
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--tensor-model-parallel-size", type=int, default=1)
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    m.add_argument("--ds-sequence-parallel-size", type=int, default=1)

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, required=True)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument("--train-iters", type=int, required=True)
    t.add_argument("--exit-interval", type=int, default=None)
    t.add_argument("--log-interval", type=int, default=1)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--data-parallel-random-init", action="store_true")
    t.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    t.add_argument("--lr", type=float, required=True)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, default=None)
    t.add_argument("--override-opt_param-scheduler", action="store_true")
    t.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--fp16", action="store_true")
    t.add_argument("--distributed-backend", default=None, help="default: gloo on CPU, else the accelerator's")
    t.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")

    c = p.add_argument_group("checkpointing")
    c.add_argument("--save", default=None)
    c.add_argument("--save-interval", type=int, default=None)
    c.add_argument("--load", default=None)
    c.add_argument("--load-tag", default=None)
    c.add_argument("--no-save-rng", action="store_true")
    c.add_argument("--no-load-rng", action="store_true")
    c.add_argument("--no-load-optim", action="store_true")
    c.add_argument("--finetune", action="store_true")
    c.add_argument("--universal-checkpoint", action="store_true")

    d = p.add_argument_group("deepspeed")
    d.add_argument("--deepspeed", action="store_true")
    d.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    d.add_argument("--zero-stage", type=int, default=1)
    d.add_argument("--no-pipeline-parallel", action="store_true")

    s = p.add_argument_group("stand-in only (no Megatron equivalent)")
    s.add_argument(
        "--standin-vocab-size",
        type=int,
        default=128,
        help="vocabulary of the synthetic tokenizer (Megatron takes it from --tokenizer-type)",
    )
    s.add_argument(
        "--standin-zero-optimizer",
        choices=(ZERO_OPTIMIZER, BF16_OPTIMIZER),
        default=ZERO_OPTIMIZER,
        help="inline DeepSpeed config only: BF16_Optimizer sets data_types.grad_accum_dtype=fp32 "
        "(DeepSpeed then picks BF16_Optimizer); DeepSpeedZeroOptimizer is the ALCF default at PP=1",
    )
    s.add_argument(
        "--standin-grad-acc-steps",
        type=int,
        default=1,
        help="GAS for the default global batch when no DeepSpeed config file gives one",
    )
    return p


def world_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment, like ezpz.setup_torch."""

    def first(*names: str, default: int) -> int:
        for n in names:
            if os.environ.get(n, "").strip():
                return int(os.environ[n])
        return default

    rank = first("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "SLURM_PROCID", default=0)
    world = first("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = first("LOCAL_RANK", "PALS_LOCAL_RANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", default=0)
    return rank, world, local


def read_ds_config_file(path: Optional[str]) -> dict:
    if path is None:
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def validate_args(args: argparse.Namespace, world_size: int, ds_file_config: dict) -> argparse.Namespace:
    """Derived values the way Megatron's validate_args computes them (pure)."""
    if args.fp16 and args.bf16:
        raise SystemExit("--fp16 and --bf16 are exclusive")
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.ds_sequence_parallel_size
    if world_size % mp:
        raise SystemExit(f"world size {world_size} is not divisible by TP*PP*SP={mp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // mp
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_key_value_heads is None:
        args.num_key_value_heads = args.num_attention_heads
    if args.global_batch_size is None:
        gas = int(ds_file_config.get("gradient_accumulation_steps", args.standin_grad_acc_steps))
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size * gas
        args.global_batch_size_was_default = True
    else:
        args.global_batch_size_was_default = False
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise SystemExit(
            f"global batch size ({args.global_batch_size}) is not divisible by micro batch size "
            f"({args.micro_batch_size}) times data parallel size ({args.data_parallel_size})"
        )
    args.num_micro_batches = args.global_batch_size // per_step
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = int(math.ceil(args.standin_vocab_size / multiple) * multiple)
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.consumed_train_tokens = 0
    args.iteration = 0
    return args


def build_ds_config(args: argparse.Namespace, file_config: dict) -> dict:
    """The DeepSpeed config: the --deepspeed_config file, or one built inline like helpers.sh's
    generateDSconfig; then ``checkpoint.load_universal`` when --universal-checkpoint (as Megatron)."""
    if file_config:
        cfg = json.loads(json.dumps(file_config))
    else:
        cfg = {
            "train_batch_size": args.global_batch_size,
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": args.num_micro_batches,
            "gradient_clipping": args.clip_grad,
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "wall_clock_breakdown": False,
            "zero_optimization": {"stage": args.zero_stage},
            "bf16": {"enabled": bool(args.bf16)},
            "fp16": {"enabled": bool(args.fp16)},
        }
        if args.standin_zero_optimizer == BF16_OPTIMIZER:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if args.universal_checkpoint:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


# ------------------------------------------------------------------------------------------------
# CPU workarounds for megatron-core 0.16.1 (see module docstring)
# ------------------------------------------------------------------------------------------------


def apply_cpu_workarounds() -> None:
    """Make megatron-core's CUDA-only global buffer and RNG tracker usable on a CPU-only torch."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
        """Allocates on the CPU (megatron-core's version asks torch.cuda for the device)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[override]
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def drop_te_extra_state(model: torch.nn.Module) -> int:
    """CPU/stand-in workaround 4: no ``_extra_state`` entries (see module docstring). Returns the count."""
    base_get, base_set = torch.nn.Module.get_extra_state, torch.nn.Module.set_extra_state
    swapped: dict[type, type] = {}
    count = 0
    for module in model.modules():
        cls = type(module)
        if getattr(cls, "get_extra_state", base_get) is base_get:
            continue
        if module.get_extra_state() is not None:
            continue  # a real extra state (Transformer Engine): keep it
        if cls not in swapped:
            swapped[cls] = type(
                cls.__name__,
                (cls,),
                {"get_extra_state": base_get, "set_extra_state": base_set, "__module__": cls.__module__},
            )
        module.__class__ = swapped[cls]
        # megatron-core also registers a load pre-hook (a lambda in __init__) that inserts the key.
        owners = tuple(f"{k.__name__}.__init__." for k in cls.__mro__)
        for key, hook in list(module._load_state_dict_pre_hooks.items()):
            qualname = getattr(getattr(hook, "hook", hook), "__qualname__", "")
            if qualname.endswith("<lambda>") and qualname.startswith(owners):
                del module._load_state_dict_pre_hooks[key]
        count += 1
    return count


class MpuAdapter:
    """DeepSpeed's ``mpu``: megatron-core's parallel_state plus the two functions Megatron-DeepSpeed's
    own ``megatron.core.mpu`` has and megatron-core 0.16 dropped (model parallel = tensor parallel)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state

        self._ps = parallel_state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ps, name)

    def get_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_sequence_parallel_world_size(self) -> int:
        return 1

    def get_sequence_parallel_rank(self) -> int:
        return 0


# ------------------------------------------------------------------------------------------------
# Model, optimizer groups, LR scheduler
# ------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """megatron-core GPTModel with the local layer spec, configured from Megatron-style args."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    norm = "RMSNorm" if args.normalization == "rmsnorm" else "LayerNorm"
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        normalization=norm,
        layernorm_epsilon=args.layernorm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    spec = get_gpt_layer_local_spec(normalization=norm)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope" if args.use_rotary_position_embeddings else "learned_absolute",
    )


def universal_checkpoint_info(args: argparse.Namespace) -> dict:
    """What Megatron's ``_universal_checkpoint_info`` records, with megatron-core parameter names."""
    patterns = ["embedding.word_embeddings.weight"]
    if args.untie_embeddings_and_output_weights:
        patterns.append("output_layer.weight")
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": args.standin_vocab_size,
        "padded_vocab_size": args.padded_vocab_size,
        "vocabulary_parameter_patterns": patterns,
        "parameter_with_2_sub_params_cat_dim_0": [r".*mlp\.linear_fc1\.weight"] if args.swiglu else [],
    }


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Megatron's get_param_groups without lr scaling: biases and 1-D params get no weight decay."""
    wd, no_wd = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_wd if name.endswith(".bias") or param.dim() == 1 else wd).append(param)
    groups = []
    if wd:
        groups.append({"name": "wd_no_scale_lr", "params": wd, "wd_mult": 1.0, "lr_mult": 1.0})
    if no_wd:
        groups.append({"name": "no_wd_no_scale_lr", "params": no_wd, "wd_mult": 0.0, "lr_mult": 1.0})
    return groups


class ParamScheduler:
    """Megatron-like OptimizerParamScheduler: warmup then linear/cosine decay, counted in samples;
    sets each group's lr (x lr_mult) and weight decay (x wd_mult). DeepSpeed saves its state_dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr = args.lr, args.min_lr
        self.weight_decay = args.weight_decay
        self.style = args.lr_decay_style
        gb = args.global_batch_size
        self.warmup_steps = args.lr_warmup_iters * gb
        self.decay_steps = (args.lr_decay_iters or args.train_iters) * gb
        self.num_steps = 0
        # Megatron's two ways past a schedule that differs from the checkpoint's: this run's values, or the checkpoint's
        self.override_opt_param_scheduler = args.override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = args.use_checkpoint_opt_param_scheduler
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise SystemExit("both override and use-checkpoint are set.")
        self.step(0)

    def get_lr(self) -> float:
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.style == "constant" or self.num_steps > self.decay_steps:
            return self.max_lr if self.style == "constant" else self.min_lr
        ratio = (self.num_steps - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 0) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "num_steps": self.num_steps,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.style,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.use_checkpoint_opt_param_scheduler:
            self.max_lr, self.min_lr = state["max_lr"], state["min_lr"]
            self.warmup_steps, self.decay_steps = state["warmup_steps"], state["decay_steps"]
            self.style = state["decay_style"]
        self.num_steps = int(state["num_steps"])
        self.step(0)


# ------------------------------------------------------------------------------------------------
# Deterministic synthetic data, indexed by global sample index
# ------------------------------------------------------------------------------------------------


def synthetic_sample(index: int, seed: int, vocab: int, seq_length: int) -> torch.Tensor:
    """``seq_length + 1`` tokens; mostly ``next = prev + stride`` (learnable), 20% random tokens.
    Depends only on (seed, index), so any DP layout sees the same sample at the same index."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**62))
    start = int(torch.randint(0, vocab, (1,), generator=g))
    stride = 1
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab
    noise = torch.rand(seq_length + 1, generator=g) < 0.2
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens


def micro_batch_indices(iteration: int, micro_step: int, dp_rank: int, args: argparse.Namespace) -> list[int]:
    """Global sample indices of one micro batch, in Megatron's pretraining-sampler order: each
    micro step takes ``micro x DP`` consecutive samples and DP rank ``r`` gets the r-th slice."""
    base = iteration * args.global_batch_size + micro_step * args.micro_batch_size * args.data_parallel_size
    start = base + dp_rank * args.micro_batch_size
    return list(range(start, start + args.micro_batch_size))


def get_batch(indices: list[int], args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    data = torch.stack([synthetic_sample(i, args.seed, args.standin_vocab_size, args.seq_length) for i in indices])
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    s = tokens.size(1)
    # Megatron's get_ltor_masks_and_position_ids: True = masked (CPU workaround 3: always explicit).
    attention_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    return tokens, labels, loss_mask, attention_mask, position_ids


# ------------------------------------------------------------------------------------------------
# RNG state, checkpoint save/load (Megatron's checkpointing.py behaviour)
# ------------------------------------------------------------------------------------------------


def get_rng_state(args: argparse.Namespace) -> list[dict]:
    from deepspeed.accelerator import get_accelerator
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": get_accelerator().get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    dp = parallel_state.get_data_parallel_world_size()
    if torch.distributed.is_initialized() and dp > 1 and args.data_parallel_random_init:
        states: list[Any] = [None] * dp
        torch.distributed.all_gather_object(states, state, group=parallel_state.get_data_parallel_group())
        return states
    return [state]


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    get_accelerator().set_rng_state(state["cuda_rng_state"])
    # rng_tracker_states: CUDA-only tracker (CPU workaround 2), nothing to restore on CPU.


def set_random_seed(seed: int, args: argparse.Namespace) -> None:
    """Megatron's _set_random_seed: + 100 x PP rank, + 10 x DP rank with --data-parallel-random-init."""
    from deepspeed.accelerator import get_accelerator
    from megatron.core import parallel_state

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if args.data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def save_checkpoint(iteration: int, engine: Any, args: argparse.Namespace) -> None:
    """engine.save_checkpoint with Megatron's client state; barrier; rank 0 writes the tracker file."""
    log.info("saving checkpoint at iteration %7d to %s", iteration, args.save)
    rng_state = get_rng_state(args)
    args.iteration = iteration
    state = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "tokens": args.consumed_train_tokens,
        "universal_checkpoint_info": universal_checkpoint_info(args),
    }
    if not args.no_save_rng:
        state["rng_state"] = rng_state
    engine.save_checkpoint(args.save, client_state=state)
    torch.distributed.barrier()
    log.info("  successfully saved checkpoint at iteration %7d to %s", iteration, args.save)
    if torch.distributed.get_rank() == 0:
        with open(megatron_checkpointing().get_checkpoint_tracker_filename(args.save), "w") as fh:
            fh.write(str(iteration))
    torch.distributed.barrier()


def megatron_checkpointing() -> Any:
    """Megatron's ``megatron.checkpointing`` module, or the stand-in's share of it (its tracker's name), registered
    under that name as Megatron-DeepSpeed's is: what names the tracker is whatever the module holds at the write."""
    module = sys.modules.get("megatron.checkpointing")
    if module is None:
        import types

        module = types.ModuleType("megatron.checkpointing", "the stand-in's share of Megatron's checkpointing")
        module.get_checkpoint_tracker_filename = lambda checkpoints_path: os.path.join(checkpoints_path, TRACKER_FILE)
        sys.modules["megatron.checkpointing"] = module
    return module


def check_checkpoint_args(ckpt: argparse.Namespace, args: argparse.Namespace) -> None:
    """Megatron's check_checkpoint_args: the model shape must match the checkpoint's."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        old, new = getattr(ckpt, name, None), getattr(args, name)
        if old is not None and old != new:
            raise SystemExit(f"{name} value from checkpoint ({old}) is not equal to the input argument value ({new}).")


def load_checkpoint(engine: Any, scheduler: ParamScheduler, args: argparse.Namespace) -> int:
    """engine.load_checkpoint, then iteration, consumed samples and (unless --no-load-rng) RNG."""
    from megatron.core import parallel_state

    load_path, state = engine.load_checkpoint(
        args.load,
        tag=args.load_tag,
        load_optimizer_states=not (args.finetune or args.no_load_optim),
        load_lr_scheduler_states=not args.finetune,
        load_module_only=args.finetune,
    )
    if load_path is None:
        log.info(
            "WARNING: could not find the metadata file %s; will not load any checkpoints and will start from random",
            args.load,
        )
        return 0
    if args.finetune:
        engine.global_steps = 0
        return 0
    iteration = int(state["iteration"])
    args.consumed_train_tokens = state.get("tokens", 0)
    ckpt_args = state.get("args")
    if ckpt_args is not None:
        check_checkpoint_args(ckpt_args, args)
        args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
    if not args.no_load_rng:
        try:
            states = state["rng_state"]
            index = parallel_state.get_data_parallel_rank() if args.data_parallel_random_init else 0
            set_rng_state(states[index])
        except KeyError:
            raise SystemExit(
                f"Unable to load rng state from checkpoint {load_path}. Specify --no-load-rng or "
                "--finetune to prevent attempting to load the rng state, exiting ..."
            )
    torch.distributed.barrier()
    log.info("  successfully loaded checkpoint from %s at iteration %d", args.load, iteration)
    return iteration


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def setup_logging(rank: int) -> None:
    """The script owns its log: ``force`` replaces a root handler a library installed at import
    (intel-extension-for-pytorch calls ``logging.basicConfig``, which made this call a no-op)."""
    level = os.environ.get("LOG_LEVEL", "INFO").upper() if rank == 0 else "WARNING"
    logging.basicConfig(
        level=level, stream=sys.stdout, format="[%(asctime)s][%(name)s] %(message)s", datefmt="%H:%M:%S", force=True
    )


def train(args: argparse.Namespace) -> int:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from megatron.core import parallel_state

    accelerator = get_accelerator()
    backend = args.distributed_backend or (
        "gloo" if accelerator.device_name() == "cpu" else accelerator.communication_backend_name()
    )
    deepspeed.init_distributed(dist_backend=backend)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if accelerator.device_name() == "cpu":
        apply_cpu_workarounds()
    set_random_seed(args.seed, args)
    dp_rank = parallel_state.get_data_parallel_rank()

    model = build_model(args)
    drop_te_extra_state(model)
    groups = param_groups(model)
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    optimizer = opt_cls(
        groups, lr=args.lr, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
    )
    scheduler = ParamScheduler(optimizer, args)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, mpu=MpuAdapter(), config=args.deepspeed_config_dict
    )
    log.info(
        "DeepSpeed %s: ZeRO stage %d, %s, DP=%d, global batch %d (micro %d x DP %d x GAS %d)",
        deepspeed.__version__,
        engine.zero_optimization_stage(),
        type(engine.optimizer).__name__,
        args.data_parallel_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        args.num_micro_batches,
    )

    iteration = load_checkpoint(engine, scheduler, args) if args.load else 0
    args.iteration = iteration
    if args.consumed_train_samples == 0 and iteration > 0:
        args.consumed_train_samples = iteration * args.global_batch_size
    saved = False
    while iteration < args.train_iters:
        engine.set_train_batch_size(args.global_batch_size)
        start = time.perf_counter()
        losses = []
        for micro_step in range(args.num_micro_batches):
            tokens, labels, loss_mask, mask, pos = get_batch(
                micro_batch_indices(iteration, micro_step, dp_rank, args), args
            )
            per_token = engine(tokens, pos, mask, labels=labels)
            loss = torch.sum(per_token.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
            engine.backward(loss)
            engine.step(lr_kwargs={"increment": args.global_batch_size})
            losses.append(loss.detach().float())
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += args.global_batch_size
        args.consumed_train_tokens += args.global_batch_size * args.seq_length
        mean = torch.stack(losses).sum().reshape(1)
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        mean = float(mean) / (args.num_micro_batches * args.data_parallel_size)
        if iteration % args.log_interval == 0:
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            log.info(
                "iteration %d/%d | consumed samples %d | lm loss %.6E | grad norm %.6E | lr %.6E | dp %d | "
                "elapsed ms %.1f",
                iteration,
                args.train_iters,
                args.consumed_train_samples,
                mean,
                grad_norm,
                optimizer.param_groups[0]["lr"],
                args.data_parallel_size,
                1e3 * (time.perf_counter() - start),
            )
        saved = False
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, engine, args)
            saved = True
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and not saved:
                save_checkpoint(iteration, engine, args)
            log.info("exiting program at iteration %d", iteration)
            torch.distributed.barrier()
            return 0
    if args.save and iteration != 0:
        save_checkpoint(iteration, engine, args)  # Megatron's pretrain() saves again at the end
    log.info("after training is done (iteration %d)", iteration)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    args = build_parser().parse_args(argv)
    rank, world_size, _ = world_info()
    setup_logging(rank)
    args = validate_args(args, world_size, read_ds_config_file(args.deepspeed_config))
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise SystemExit("the stand-in builds TP=1, PP=1 models only")
    args.deepspeed_config_dict = build_ds_config(args, read_ds_config_file(args.deepspeed_config))
    args.deepspeed_config = None  # Megatron clears the path once the dict is built
    if args.global_batch_size_was_default:
        log.info("setting global batch size to %d", args.global_batch_size)
    megatron_checkpointing()  # loaded before training, as Megatron's is
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
