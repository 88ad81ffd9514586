"""Which live jobs the hooks handle, and the one warning for those they leave to DeepSpeed.

A plugin must never turn a save or a load that works into one that fails. A job whose optimizer
the hooks cannot describe yet (a ZeRO stage or optimizer class without an
:class:`~megatron_ucp.deepspeed.surface.OptimizerLayout`; mixture-of-experts param groups, which
DeepSpeed partitions over the expert-data-parallel group instead of the DP group, at TP or PP > 1, or
with ZeRO-3) gets stock
DeepSpeed's save, load and no background conversion, and one warning per process that says so
(logged by the first rank only).

The answer is the job's, not one rank's: at PP > 1 only the stages holding MoE layers see them, and a rank that
took the hooks' way while another took stock's would meet it in different collectives (a save identity against
stock's save, a resume decision against the expert-layout check). So in a distributed job the ranks agree once
per engine, at its first save or load (every rank is there), and every rank follows the first reason any rank
has; the verdict is kept on the engine.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.errors import UcpError
from megatron_ucp.integration.collectives import JOB

log = logging.getLogger(__name__)

_warned: set[str] = set()


_AGREED = "_ucp_unhandled_reason"


def unhandled_reason(engine: Any) -> Optional[str]:
    """Why the hooks leave this engine to stock DeepSpeed, or None when they handle it: the same on every rank
    of a distributed job (collective at the engine's first call, which is a save or a load on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local_reason(engine)
    agreed = getattr(engine, "__dict__", {}).get(_AGREED, _UNSET)
    if agreed is not _UNSET:
        return agreed
    mine = local_reason(engine)
    reasons = JOB.gather_objects(mine)
    agreed = next(((r, reason) for r, reason in enumerate(reasons) if reason is not None), None)
    verdict = None if agreed is None else agreed[1] if agreed[1] == mine else f"{agreed[1]} (on rank {agreed[0]})"
    if hasattr(engine, "__dict__"):
        engine.__dict__[_AGREED] = verdict
    return verdict


_UNSET = object()


def local_reason(engine: Any) -> Optional[str]:
    """Why this rank's engine cannot be handled (its own layout and groups), or None."""
    optimizer = getattr(engine, "optimizer", None)
    try:
        layout = surface.engine_layout(engine)
    except UcpError as exc:  # the optimizer lacks an attribute its layout names: DeepSpeed changed
        return str(exc)
    if layout is None:
        stage = surface.zero_stage(engine)
        return f"{type(optimizer).__name__} at ZeRO stage {stage} is not one of the layouts megatron-ucp handles"
    if layout.per_parameter:
        if getattr(engine, "has_moe_layers", False):
            return "ZeRO-3 with mixture-of-experts layers is not handled yet"
        if stage3_runtime.stage3_swaps(optimizer):
            return "ZeRO-3 partitions swapped to NVMe (offload_optimizer or offload_param device nvme) are not handled"
        return None
    try:
        elastic = surface.elastic_checkpoint(optimizer)
    except UcpError as exc:  # DeepSpeed changed: stock behaviour, said once
        return str(exc)
    if elastic:
        return (
            "zero_optimization.elastic_checkpoint (each rank's optimizer states saved per group, without their "
            "padding or param groups, for DeepSpeed's own elastic load) is not one of the forms megatron-ucp handles"
        )
    sizes = surface.group_dp_sizes(optimizer)
    if len(set(sizes)) > 1 and not getattr(engine, "has_moe_layers", False):
        return f"param groups partitioned over data-parallel groups of different sizes {sizes} (not experts)"
    if len(set(sizes)) > 1 and surface.experts_data_first(engine):
        return (
            "mixture-of-experts groups in DeepSpeed's D + E topology (use_data_before_expert_parallelism) are not "
            "handled yet (megatron-ucp places experts as the default E + D topology does)"
        )
    if len(set(sizes)) > 1 and expert_model_parallel(engine) > 1:
        return (
            f"mixture-of-experts param groups (partitioned over data-parallel groups of sizes {sizes}) at "
            f"TP x PP = {expert_model_parallel(engine)} are not handled yet"
        )
    return None


def expert_model_parallel(engine: Any) -> int:
    """TP x PP of a job (megatron-ucp handles mixture-of-experts layers at TP = PP = 1)."""
    mpu = getattr(engine, "mpu", None)
    return surface.tp_size_and_rank(mpu)[0] * surface.pp_size(mpu)


def warn_once(reason: str, consequence: str) -> None:
    """Log ``reason: consequence`` once per process, on the first rank."""
    key = f"{reason}\0{consequence}"
    if key in _warned:
        return
    _warned.add(key)
    if _first_rank():
        log.warning("megatron-ucp: %s: %s", reason, consequence)


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


STOCK = "this job saves, loads and resumes as stock DeepSpeed does (no save record, no background conversion)"
"""What a job the hooks leave alone gets."""
