"""The live model's parallel layout at load time: where this rank sits in TP and PP, and how TP
divides each live parameter.

Read from the ``mpu`` DeepSpeed was given (Megatron's ``parallel_state``, or the pipeline engine's
grid) through DeepSpeed's own version-tolerant helpers (:mod:`megatron_ucp.deepspeed.surface`), and
from Megatron's per-parameter ``tensor_model_parallel`` / ``partition_dim`` attributes, which
describe the model being loaded into (the checkpoint's layout is the converter's business). The save
hook records the same attributes (:func:`tp_layout_record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_ucp.deepspeed import surface
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.tensor_parallel import TpLayout


@dataclass(frozen=True)
class TpPlace:
    """This rank's place in tensor parallelism at load time."""

    size: int = 1
    rank: int = 0


def tensor_parallel_of(optimizer: Any) -> TpPlace:
    """TP size and rank from the optimizer's ``mpu`` (Megatron's, or DeepSpeed's pipeline grid)."""
    return TpPlace(*surface.tp_size_and_rank(surface.optimizer_mpu(optimizer)))


def live_tp_layout(
    lp: Any, entry: Any, tp: int, file_shape: tuple[int, ...], shape: Optional[tuple[int, ...]] = None
) -> TpLayout:
    """How TP divides the live parameter: Megatron's ``tensor_model_parallel`` / ``partition_dim``
    attributes (set at every TP size), the sub-parameter count and vocabulary flag from the file.
    ``shape``: the live parameter's (TP slice's) shape, when ``lp.shape`` is not it (ZeRO-3)."""
    info = entry if isinstance(entry, dict) else {}
    sub = int(info.get(F.PARAM_N_SUB_PARAMS, 1) or 1)
    vocab = bool(info.get(F.VOCAB_TENSOR, False))
    if tp == 1:
        return TpLayout(sub_params=sub, vocab=vocab)
    if hasattr(lp, "tensor_model_parallel"):
        if not lp.tensor_model_parallel:
            return TpLayout(replicated=True, vocab=vocab)
        dim = int(getattr(lp, "partition_dim", info.get(F.CAT_DIM, 0)))
        return TpLayout(dim=0 if sub > 1 else dim, sub_params=sub, vocab=vocab)
    if tuple(shape if shape is not None else lp.shape) == tuple(file_shape):  # no attributes: replicated
        return TpLayout(replicated=True, vocab=vocab)
    return TpLayout(dim=0 if sub > 1 else int(info.get(F.CAT_DIM, 0)), sub_params=sub, vocab=vocab)


def tp_layout_record(named_parameters: Any) -> Optional[dict[str, dict]]:
    """Each parameter's TP layout as the save hook records it
    (:data:`~megatron_ucp.plan.tensor_parallel.TP_LAYOUT_KEY`).

    From Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes, which it sets at every
    TP size, TP=1 included: what Megatron's ``universal_checkpoint_info`` only says at TP > 1. None
    when no parameter carries them (not a Megatron model: nothing to record).
    """
    params = list(named_parameters)
    if not any(hasattr(p, "tensor_model_parallel") for _, p in params):
        return None
    record = {}
    for name, p in params:
        split = bool(getattr(p, "tensor_model_parallel", False))
        dim = int(getattr(p, "partition_dim", 0)) if split else 0
        record[name] = TpLayout(replicated=not split, dim=max(dim, 0)).to_record()
    return record


def current_layout(engine: Any) -> ParallelLayout:
    """The running engine's layout: TP and PP from its ``mpu`` (Megatron's, or the pipeline grid), DP
    from the engine (its sequence-data-parallel size: the ranks that share one optimizer partition), EP from
    its expert groups."""
    mpu = getattr(engine, "mpu", None)
    dp = int(engine.seq_dp_world_size)
    return ParallelLayout(tp=surface.tp_size_and_rank(mpu)[0], pp=surface.pp_size(mpu), dp=dp, ep=live_ep(engine))


def live_ep(engine: Any) -> int:
    """The expert-parallel size of a mixture-of-experts job: DP over its expert groups' partition count (1 for
    any other job, and for ZeRO-3, whose experts the hooks leave to stock DeepSpeed)."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(engine, "has_moe_layers", False) or optimizer is None:
        return 1
    layout = surface.engine_layout(engine)
    if layout is None or layout.per_parameter:
        return 1
    sizes = surface.group_dp_sizes(optimizer)
    return max(sizes) // min(sizes)
