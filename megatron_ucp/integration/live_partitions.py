"""This rank's share of the live optimizer, as flat partitions and the parameter fragments in them.

A load fills flat fp32 partitions (and the optimizer states kept under them) one fragment of one parameter
at a time; where those sit depends on the optimizer's layout: ZeRO-1/2 keep one flat partition per param
group and DeepSpeed's own fragment map (:func:`megatron_ucp.deepspeed.surface.fragment_address`), ZeRO-3 one
per sub-group, each parameter partitioned on its own (:class:`~megatron_ucp.plan.param_geometry.Stage3Groups`).
:func:`live_groups` gives both as the same values, so that one loader serves every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.integration.collectives import comm
from megatron_ucp.plan.param_geometry import Stage3Groups


@dataclass(frozen=True)
class LiveFragment:
    """The elements ``[start, start + numel)`` of one live parameter this rank holds, at ``offset`` of its
    flat partition (of the whole parameter of ``shape``: a TP slice under tensor parallelism)."""

    lp: Any
    shape: tuple[int, ...]
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class LiveGroup:
    """One flat partition this rank fills: a ZeRO-1/2 param group's, or a ZeRO-3 sub-group's."""

    param_group: int
    """Index into the wrapped optimizer's ``param_groups`` (its hyperparameters)."""
    flat: Any
    """This rank's fp32 partition; the optimizer keeps its states under it."""
    lps: list
    """Every live parameter of the group (held here or not): the folders the group needs."""
    fragments: list[LiveFragment]
    padding_unset: bool = False
    """ZeRO-3: DeepSpeed allocates a partition's tail padding uninitialized (``torch.empty``), so a load
    zeroes the partition before filling it (DeepSpeed's own universal load writes zeros there too)."""


def live_groups(optimizer: Any, names: dict[Any, str]) -> list[LiveGroup]:
    """This rank's flat partitions and the fragments in them, as the optimizer's layout keeps them:
    ZeRO-1/2 from DeepSpeed's fragment addresses, ZeRO-3 from the per-parameter geometry."""
    layout = surface.layout_of(optimizer)
    if not layout.per_parameter:
        base = surface.base_optimizer(optimizer)
        out = []
        for i, (param_group, lps) in enumerate(zip(base.param_groups, layout.groups(optimizer))):
            fragments = []
            for lp in lps:
                address = surface.fragment_address(lp)
                if address is not None:
                    fragments.append(LiveFragment(lp, tuple(lp.shape), *address))
            out.append(LiveGroup(i, param_group["params"][0], list(lps), fragments))
        return out
    groups = live_stage3_groups(optimizer, names)
    rank = comm().get_rank(group=surface.dp_group(optimizer))
    by_name = {names[lp]: lp for group in layout.groups(optimizer) for lp in group}
    return [
        LiveGroup(
            groups.param_group_of[h],
            flat,
            list(lps),
            [
                LiveFragment(
                    by_name[run.param],
                    stage3_runtime.param_shape(by_name[run.param]),
                    run.start,
                    run.length,
                    run.offset,
                )
                for run in groups.runs(rank, h)
            ],
            padding_unset=True,
        )
        for h, (flat, lps) in enumerate(zip(layout.masters(optimizer), layout.groups(optimizer)))
    ]


def live_stage3_groups(optimizer: Any, names: dict[Any, str]) -> Stage3Groups:
    """The live ZeRO-3 optimizer's sub-groups as a pure layout value (at its DP size)."""
    sub_groups, owners = stage3_runtime.stage3_sub_groups(optimizer, names)
    dp = comm().get_world_size(group=surface.dp_group(optimizer))
    return Stage3Groups(tuple(tuple(g) for g in sub_groups), tuple(owners), dp)
