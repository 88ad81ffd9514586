"""What only a ZeRO-3 save's files hold, read for a resume: its facts (:func:`read_stage3_facts`, the same
:class:`~megatron_ucp.integration.rank_files.SavedFacts` as any save, its layout the sub-groups) and each rank
file seen under ZeRO-1/2's keys (:func:`flat_view`), so that the binding of
:mod:`megatron_ucp.integration.rank_files` checks it as any other: the saved sub-groups' parameters
(``param_shapes`` of DP rank 0's model states), each sub-group's param group (the sub-group indices each param
group lists in old rank 0's file), every rank's model states present and of this save.

A ZeRO-3 file records no fragment map: a stock save's files swapped between positions have the same sizes
and are not told apart by their metadata; a hooked save's record names the position.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.deepspeed.stage3_files import model_states_of_another_save, sub_group_owners
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.rank_files import (
    RankFile,
    SavedFacts,
    absent,
    binding_message,
    check_presence,
    checksum_algorithm,
    in_memory,
    model_states_facts,
    tensor_states,
)
from megatron_ucp.plan.param_geometry import Stage3Groups

_PER_RANK = (F.FP32_FLAT_GROUPS, F.OPTIMIZER_STATE_DICT, F.UCP_SAVE_RECORD)
"""The per-rank parts of a ZeRO-3 optimizer dict; the rest (loss scaler, overflow, zero_stage) is global."""


def stage3_optimizer_state(path: Path) -> dict:
    """A ZeRO-3 rank file's optimizer dict, tensors located but not read (readahead off)."""
    raw = load_raw(path, random_access=True)
    sd = raw.get(F.OPTIMIZER_STATE_DICT) if isinstance(raw, dict) else None
    inner = sd.get(F.OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
    if not isinstance(sd, dict) or not isinstance(sd.get(F.FP32_FLAT_GROUPS), list) or not isinstance(inner, dict):
        raise CheckpointFormatError(
            f"{path}: not a ZeRO-3 optimizer file (no {F.OPTIMIZER_STATE_DICT} with {F.FP32_FLAT_GROUPS} and the "
            "wrapped optimizer's state): a file of another ZeRO stage?",
            subject=path,
        )
    return sd


def flat_view(path: Path) -> dict:
    """A ZeRO-3 rank file's optimizer dict under ZeRO-1/2's keys (fp32 partitions per sub-group, the wrapped
    optimizer's state per sub-group), for the per-file checks both stages share."""
    sd = stage3_optimizer_state(path)
    inner = sd[F.OPTIMIZER_STATE_DICT]
    view = {k: v for k, v in sd.items() if k not in (F.FP32_FLAT_GROUPS, F.OPTIMIZER_STATE_DICT)}
    view[F.SINGLE_PARTITION_OF_FP32_GROUPS] = sd[F.FP32_FLAT_GROUPS]
    view[F.BASE_OPTIMIZER_STATE] = {"state": inner.get("state", {}), "param_groups": inner.get(F.PARAM_GROUPS)}
    return view


def read_stage3_facts(model_states: Path, rank_file: RankFile, states: Optional[dict] = None) -> SavedFacts:
    """Step 1 (first rank): the facts, checked for the old files' presence and DP size."""
    states, dp_from, save_id = model_states_facts(model_states, states)
    expected = check_presence(model_states, rank_file, dp_from)
    mp = F.ZERO3_MODEL_FILE_RE.match(model_states.name)
    paths = [model_states.parent / F.zero3_model_file(r, int(mp["mp"]) if mp else 0) for r in range(dp_from)]
    for path in paths:  # every rank saved its own model states: none may be missing
        why = absent(path)
        if why is not None:
            raise CheckpointFormatError(f"{path}: {why} (the save's DP size is {dp_from})", subject=path)
    if save_id is not None:  # and every one of them is of this save (counters, config, frozen slices)
        others = model_states_of_another_save(paths, model_states, save_id)
        if others:
            raise CheckpointFormatError(binding_message(model_states.parent, others), subject=others[0].split(": ")[0])
    first = stage3_optimizer_state(expected[0])
    inner = first[F.OPTIMIZER_STATE_DICT]
    shapes = [group for group in states[F.PARAM_SHAPES] if isinstance(group, dict)]
    if len(shapes) != len(first[F.FP32_FLAT_GROUPS]):
        raise CheckpointFormatError(
            f"{expected[0]}: has {len(first[F.FP32_FLAT_GROUPS])} optimizer sub-groups, {model_states.name} lists "
            f"{len(shapes)}: files of another run, or another sub_group_size?",
            subject=expected[0],
        )
    groups = Stage3Groups(
        tuple(tuple((str(name), math.prod(shape)) for name, shape in group.items()) for group in shapes),
        tuple(sub_group_owners(inner.get(F.PARAM_GROUPS), len(shapes), expected[0])),
        dp_from,
    )
    per_group = [inner.get("state", {}).get(h, {}) for h in range(len(shapes))]
    return SavedFacts(
        dp_from=dp_from,
        layout=groups,
        global_state={k: v for k, v in first.items() if k not in _PER_RANK},
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in inner.get(F.PARAM_GROUPS) or []],
        states=tensor_states(per_group),
        steps=[in_memory(s.get(F.STEP_STATE)) for s in per_group],
        algorithm=checksum_algorithm(first, expected[0]),
        save_id=save_id,
        model_states=str(model_states),
        frozen=tuple(sorted(states.get(F.FROZEN_PARAM_SHAPES) or ())),
    )
