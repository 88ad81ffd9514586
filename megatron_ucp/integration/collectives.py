"""Collective helpers of the hooks: the process group's first rank decides, everyone learns.

The hooks run inside training, on every rank. A decision that needs the file system (which route
a load takes, what a folder holds) is made once, by the group's first rank, and broadcast; if
that rank fails, every rank raises the same error instead of some waiting forever
(:func:`decide_on_first`). Collectives go through ``torch.distributed`` itself and the
accelerator's device (gloo/CPU, ccl/XPU, nccl/CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import torch

from megatron_ucp.deepspeed import surface


def comm() -> Any:
    """``torch.distributed`` itself, not ``deepspeed.comm``: DeepSpeed's wrappers differ between
    versions (0.19.5's ``log_wrapper`` raises ``KeyError: 'log_name'`` on ``broadcast_object_list``
    when the comms logger is on, as Megatron-DeepSpeed configures it), while the process groups
    DeepSpeed hands out are torch's own."""
    import torch.distributed as dist

    return dist


def device() -> torch.device:
    """The accelerator's current device, as DeepSpeed's accelerator abstraction names it."""
    return torch.device(surface.accelerator().current_device_name())


def broadcast_from_first(value: Any, group: Any = None) -> Any:
    """``value`` of the group's first rank on every rank of the group."""
    dist = comm()
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def count_across(flag: int, group: Any = None) -> int:
    """Sum of one small integer across the group (also a barrier)."""
    dist = comm()
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device())
    dist.all_reduce(t, group=group)
    return int(t.item())


def gather_names(names: Iterable[str], group: Any = None) -> set[str]:
    """The union of every rank's ``names`` (small: parameter names), on every rank of the group."""
    dist = comm()
    boxes: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(boxes, sorted(names), group=group)
    return {name for box in boxes for name in box}


def is_first(group: Any = None) -> bool:
    return comm().get_rank(group=group) == 0


@dataclass(frozen=True)
class Failure:
    """An exception on the deciding rank, shipped to the others so that all raise together."""

    message: str


T = TypeVar("T")


def decide_on_first(decide: Callable[[], T], group: Any = None) -> "T | Failure":
    """``decide()`` on the group's first rank, its value on every rank.

    When it raises, every rank gets a :class:`Failure` naming the exception (the caller raises its
    own error with it), so that no rank is left waiting in a collective the first one never reaches.
    """
    outcome: Any = None
    if is_first(group):
        try:
            outcome = decide()
        except Exception as exc:
            outcome = Failure(f"{type(exc).__name__}: {exc}")
    return broadcast_from_first(outcome, group)
