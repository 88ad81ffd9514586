"""ZeRO-3's runtime: what the hooks read from ``DeepSpeedZeroOptimizer_Stage3`` and its partitioned parameters,
and the two things they do to it (restore the loss-scaler state, make the bf16 partitions the masters
rounded), as DeepSpeed's own stage-3 load does them.

The optimizer's instance attributes are checked once per class by
:func:`megatron_ucp.deepspeed.surface.layout_of` (its :class:`~megatron_ucp.deepspeed.surface.OptimizerLayout`
and :data:`~megatron_ucp.deepspeed.surface.STAGE3_ATTRIBUTES`); the parameters' here, naming what is missing.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_ucp.deepspeed.surface import instance_attribute
from megatron_ucp.deepspeed.versions import installed_deepspeed_version
from megatron_ucp.errors import UnsupportedError

PARAM_ATTRIBUTES = ("ds_numel", "ds_shape", "ds_tensor")
"""What ZeRO-3 attaches to every partitioned parameter and the hooks read."""


def stage3_sub_groups(
    optimizer: Any, names: Optional[dict[Any, str]] = None
) -> tuple[list[list[tuple[str, int]]], list[int]]:
    """Each sub-group's parameters (name, numel) in partition order, and each sub-group's param group.
    Without ``names`` the parameters are named by place (``<sub-group>.<index>``)."""
    groups = instance_attribute(optimizer, "fp16_groups")
    out = []
    for group in groups:
        members = []
        for p in group:
            missing = [a for a in PARAM_ATTRIBUTES if not hasattr(p, a)]
            if missing:
                raise UnsupportedError(
                    f"DeepSpeed {installed_deepspeed_version()}: a ZeRO-3 parameter has no "
                    + ", ".join(repr(a) for a in missing)
                    + ", which megatron-ucp relies on; DeepSpeed internals changed",
                    subject=missing[0],
                )
            members.append((names[p] if names is not None else f"{len(out)}.{len(members)}", int(p.ds_numel)))
        out.append(members)
    owners = instance_attribute(optimizer, "sub_group_to_group_id")  # a dict: sub-group index -> param group
    return out, [int(owners[h]) for h in range(len(out))]


def param_shape(lp: Any) -> tuple[int, ...]:
    """A live parameter's whole shape (ZeRO-3 keeps an empty tensor in ``.data`` and the shape aside)."""
    shape = getattr(lp, "ds_shape", None)
    return tuple(int(d) for d in (shape if shape is not None else lp.shape))


def stage3_swaps(optimizer: Any) -> bool:
    """The optimizer states (or parameters) live on NVMe, swapped in and out: left to DeepSpeed."""
    return bool(getattr(optimizer, "swap_optimizer", False)) or any(
        flat is None for flat in getattr(optimizer, "fp16_partitioned_groups_flat", ())
    )


def load_stage3_global_state(optimizer: Any, state: dict) -> None:
    """The loss scaler state of a saved stage-3 optimizer dict, as DeepSpeed's own load restores it."""
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        if key in state:
            setattr(optimizer, key, state[key])


def stage3_weights_from_masters(optimizer: Any) -> None:
    """The bf16 partitions made the fp32 masters rounded, and each parameter's partition re-pointed at the
    flat buffer (what DeepSpeed's stage-3 load does after restoring the masters)."""
    import torch

    with torch.no_grad():
        for flat, master in zip(
            instance_attribute(optimizer, "fp16_partitioned_groups_flat"),
            instance_attribute(optimizer, "fp32_partitioned_groups_flat"),
        ):
            if master.numel() > 0:
                flat.data.copy_(master.data)
        unflatten = instance_attribute(optimizer, "unflatten")
        for flat, parts in zip(
            instance_attribute(optimizer, "fp16_partitioned_groups_flat"),
            instance_attribute(optimizer, "fp16_partitioned_groups"),
        ):
            for part, view in zip(parts, unflatten(flat, parts)):
                part.data = view.data
