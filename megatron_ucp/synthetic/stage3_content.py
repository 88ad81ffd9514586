"""The objects a ZeRO-3 save pickles into each file, built from a spec instead of a run.

At stage 3 every rank saves two files: ``zero_pp_rank_<d>_mp_rank_<m>_model_states.pt`` (the engine's dict
as at stages 1 and 2, but the module's parameters are the empty placeholders ZeRO-3 leaves in ``.data`` and
``param_shapes`` lists each optimizer sub-group) and ``bf16_zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt``
(``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``: per sub-group its fp32 partition, the wrapped optimizer's
state keyed by sub-group, its param groups listing their sub-groups). How the parameters fall into groups is
the job's: Megatron-DeepSpeed builds its model under ``deepspeed.zero.Init``, where every parameter's ``.shape``
is ``(0,)``, so its weight-decay rule ("1-D: no decay") puts every parameter in one no-weight-decay group (seen
in real saves of the fork); a plain DeepSpeed job keeps its two groups. Sub-groups are cut as DeepSpeed cuts
them (``sub_group_size``, 1e9 by default).

Values: each parameter's elements come from :func:`~megatron_ucp.synthetic.values.flat_range` of a buffer of
its own (TP-replicated parameters: the same on every TP rank), so a rank's slice is made without the rest, and
the same model at any DP size holds the same numbers.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.save_record import save_identity, stage3_partition_checksums, stage3_partition_record
from megatron_ucp.synthetic.content import (
    LOSS_SCALER,
    ZERO_STAGE_ENUM,
    SyntheticSpec,
    model_states,
    param_group_hyperparameters,
)
from megatron_ucp.synthetic.optimizers import BASE_OPTIMIZERS
from megatron_ucp.synthetic.values import flat_range

SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size``."""


def declared_params(spec: SyntheticSpec, mp_rank: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of a model-parallel rank (its TP slice's shape), in declaration order."""
    shapes = {p.name: p.shape for group in spec.groups(mp_rank) for p in group}
    return [(name, tuple(shapes[name])) for name in spec.shape.tp_layouts(spec.stage(mp_rank))]


@functools.lru_cache(maxsize=8)
def stage3_groups(spec: SyntheticSpec, mp_rank: int = 0) -> Stage3Groups:
    """The optimizer's sub-groups at ``spec.dp``: Megatron's one group under ``zero.Init``, or the plain
    job's two, cut by DeepSpeed's default ``sub_group_size``."""
    if spec.flavour == "megatron":
        params = [(name, _numel(shape)) for name, shape in declared_params(spec, mp_rank)]
        whole = Stage3Groups((tuple(params),), (0,), spec.dp)
    else:
        groups = spec.groups(mp_rank)
        whole = Stage3Groups(
            tuple(tuple((p.name, p.numel) for p in g) for g in groups), tuple(range(len(groups))), spec.dp
        )
    return whole.at_dp(spec.dp, SUB_GROUP_SIZE)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def param_range(spec: SyntheticSpec, mp_rank: int, name: str, state: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of one parameter's ``state`` (its TP slice) on a model-parallel rank."""
    tp_rank = spec.layout.coordinates_of(mp_rank)[1]
    replicated = spec.shape.tp_layouts(spec.stage(mp_rank))[name].replicated
    numel = stage3_groups(spec, mp_rank).places[name].numel
    return flat_range(
        spec.seed, f"z3/{'replicated' if replicated else f't{tp_rank}'}/{name}", state, start, stop, numel
    )


def partitions(spec: SyntheticSpec, mp_rank: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Per sub-group, this rank's partition of every state (each parameter's slice, tail padding zero)."""
    groups = stage3_groups(spec, mp_rank)
    out = []
    for h in range(len(groups.sub_groups)):
        size = groups.geometry(h).partition_size
        per_element = BASE_OPTIMIZERS[spec.base_optimizer][0]
        parts = {state: torch.zeros(size, dtype=torch.float32) for state in (F.FP32_STATE, *per_element)}
        for run in groups.runs(dp_rank, h):
            for state, part in parts.items():
                part[run.offset : run.offset + run.length] = param_range(
                    spec, mp_rank, run.param, state, run.start, run.start + run.length
                )
        out.append(parts)
    return out


def _param_groups(spec: SyntheticSpec, groups: Stage3Groups) -> list[dict[str, Any]]:
    """The wrapped optimizer's param groups as ``state_dict`` lists them: each with its sub-groups' indices."""
    out = []
    for g in range(len(groups.param_groups)):
        hyper = param_group_hyperparameters(spec, 1 if spec.flavour == "megatron" else g)  # Megatron: no decay
        hyper["params"] = [h for h, owner in enumerate(groups.param_group_of) if owner == g]
        out.append(hyper)
    return out


def stage3_rank_file_state(spec: SyntheticSpec, mp_rank: int, dp_rank: int) -> dict[str, Any]:
    """What the engine saves as ``bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt`` at stage 3."""
    groups = stage3_groups(spec, mp_rank)
    parts = partitions(spec, mp_rank, dp_rank)
    fp32 = [p["fp32"] for p in parts]
    states = {h: spec.optimizer_states(p.__getitem__) for h, p in enumerate(parts)}
    scaler = LOSS_SCALER.__new__(LOSS_SCALER)
    scaler.__setstate__({"cur_scale": 1.0, "dynamic": False})
    sd: dict[str, Any] = {
        F.ZERO_STAGE: ZERO_STAGE_ENUM(3),
        "loss_scaler": scaler,
        "dynamic_loss_scale": False,
        "overflow": False,
        F.PARTITION_COUNT: spec.dp,
        F.OPTIMIZER_STATE_DICT: {"state": states, "param_groups": _param_groups(spec, groups)},
        F.FP32_FLAT_GROUPS: fp32,
    }
    if spec.record:
        sd.update(stage3_partition_record(groups, dp_rank))
        sd.update(stage3_partition_checksums(fp32, [states[h] for h in range(len(parts))], groups, dp_rank))
        sd.update(save_identity(spec.save_id, spec.dp, dp_rank))
    return {F.OPTIMIZER_STATE_DICT: sd, F.DS_CONFIG: spec.ds_config(), F.DS_VERSION: spec.ds_version}


def _placeholders(module: Any) -> Any:
    """The module dict with every tensor the empty bf16 placeholder ZeRO-3 keeps in ``.data``."""
    if isinstance(module, dict):
        kind = type(module)
        return kind((k, _placeholders(v)) for k, v in module.items())
    return torch.empty(0, dtype=torch.bfloat16)


def stage3_model_states(spec: SyntheticSpec, mp_rank: int, dp_rank: int) -> dict[str, Any]:
    """What the engine saves as ``zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt``."""
    groups = stage3_groups(spec, mp_rank)
    declared = dict(declared_params(spec, mp_rank))
    weights = {name: torch.empty(0, dtype=torch.bfloat16) for name in declared}
    state = model_states(spec, mp_rank, weights)
    state["module"] = _placeholders(state["module"])
    state[F.PARAM_SHAPES] = [
        collections.OrderedDict((name, torch.Size(declared[name])) for name, _ in group) for group in groups.sub_groups
    ]
    args = state.get("args")
    if args is not None:  # Megatron's args of the rank that saved it: TP fastest, then DP
        args.rank = dp_rank * spec.tp + spec.layout.coordinates_of(mp_rank)[1]
    return state
