"""The old rank files of a ZeRO-3 save, read for a resume: the facts once, each file opened and bound to
its DP position and its save, one verdict on every rank (the stage-3 counterpart of
:mod:`megatron_ucp.integration.rank_files`, whose checks and collective it reuses).

Call order (collective over the optimizer's DP group):

1. the group's first rank reads the facts once (:func:`read_stage3_facts`): the saved sub-groups'
   parameters (``param_shapes`` of DP rank 0's model states), each sub-group's param group (the sub-group
   indices each param group lists in old rank 0's file), the old DP size, the save's identity, old rank 0's
   loss-scaler state and hyperparameters;
2. every rank opens the old files it reads and the padding-only ones that fall to it, metadata only, each
   seen through :func:`flat_view` (ZeRO-1/2's keys), so that the same per-file checks apply
   (:func:`megatron_ucp.plan.rank_binding.file_problems`: partition count, every state exactly one
   partition long, the save record's position and true lengths, the recorded checksums);
3. every rank shares what it saw and reaches the same verdict
   (:func:`megatron_ucp.integration.rank_files.bind_positions`).

A ZeRO-3 file records no fragment map: a stock save's files swapped between positions have the same sizes
and are not told apart by their metadata; a hooked save's record names the position.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.deepspeed.stage3_files import model_states_of_another_save, sub_group_owners
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.integration.rank_files import (
    RankFile,
    Source,
    absent,
    bind_positions,
    binding_message,
    check_presence,
    checksum_algorithm,
    inspect_file,
    model_states_facts,
)
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.rank_binding import FileExpectation, FileFacts
from megatron_ucp.plan.reshard import Read

UNIT = Stage3Groups.unit

_PER_RANK = (F.FP32_FLAT_GROUPS, F.OPTIMIZER_STATE_DICT, F.UCP_SAVE_RECORD)
"""The per-rank parts of a ZeRO-3 optimizer dict; the rest (loss scaler, overflow, zero_stage) is global."""


@dataclass(frozen=True)
class Stage3Facts:
    """What the DP group's first rank reads once and broadcasts."""

    dp_from: int
    groups: Stage3Groups
    """The save's layout: its sub-groups, their parameters and param groups, at ``dp_from``."""
    global_state: dict
    """Old rank 0's optimizer-level state (loss scaler, dynamic_loss_scale, overflow, ...)."""
    param_groups: list[dict]
    """The wrapped optimizer's hyperparameters per param group (``params`` left out)."""
    states: list[tuple[str, ...]]
    """Each sub-group's tensor states in the files (``exp_avg``, ``exp_avg_sq``, ...)."""
    steps: list[Any]
    """Each sub-group's optimizer step (old rank 0's)."""
    algorithm: Optional[str] = None
    save_id: Optional[str] = None
    model_states: str = ""
    frozen: tuple[str, ...] = ()
    """Frozen parameters: their slices live in every rank's model states (``frozen_param_fragments``)."""

    def layout(self) -> Stage3Groups:
        """Where each rank file's real elements sit (:class:`~megatron_ucp.plan.partitioned.Partitioned`)."""
        return self.groups


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


def read_stage3_facts(model_states: Path, rank_file: RankFile, states: Optional[dict] = None) -> Stage3Facts:
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
        tuple(tuple((str(name), _numel(shape)) for name, shape in group.items()) for group in shapes),
        tuple(sub_group_owners(inner.get(F.PARAM_GROUPS), len(shapes), expected[0])),
        dp_from,
    )
    per_group = [inner.get("state", {}).get(h, {}) for h in range(len(shapes))]
    return Stage3Facts(
        dp_from=dp_from,
        groups=groups,
        global_state={k: v for k, v in first.items() if k not in _PER_RANK},
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in inner.get(F.PARAM_GROUPS) or []],
        states=[
            tuple(k for k, v in sorted(s.items()) if isinstance(v, RawTensor) and k != F.STEP_STATE) for s in per_group
        ],
        steps=[_in_memory(s.get(F.STEP_STATE)) for s in per_group],
        algorithm=checksum_algorithm(first, expected[0]),
        save_id=save_id,
        model_states=str(model_states),
        frozen=tuple(sorted(states.get(F.FROZEN_PARAM_SHAPES) or ())),
    )


def _numel(shape: Any) -> int:
    n = 1
    for d in tuple(shape):
        n *= int(d)
    return n


def _in_memory(value: Any) -> Any:
    return value.to_torch().clone() if isinstance(value, RawTensor) else value


def expectation(facts: Stage3Facts, position: int) -> FileExpectation:
    """What the file at ``position`` holds: every sub-group's partition whole (any slice may be read)."""
    sizes = tuple(facts.groups.partition_sizes())
    return FileExpectation(
        position=position,
        dp=facts.dp_from,
        partition_sizes=sizes,
        states=tuple(facts.states),
        needs=sizes,
        fragments=None,
        true_lengths=tuple(facts.groups.true_lengths(position)),
        save_id=facts.save_id,
        unit=UNIT,
    )


def bind_stage3_files(
    facts: Stage3Facts,
    reads: Sequence[Sequence[Read]],
    positions: Sequence[int],
    rank_file: RankFile,
    group: Any,
) -> tuple[dict[int, Source], list[FileFacts]]:
    """Steps 2 and 3 (collective over ``group``): the sources this rank reads, and what every rank saw of
    every file; the same error on every rank when any file, or the set, is wrong."""

    def inspect(position: int) -> tuple[Optional[Source], FileFacts]:
        return inspect_file(rank_file(position), facts, expectation(facts, position), view=flat_view)

    readers = {r.source_rank for g in reads for r in g}
    return bind_positions(facts, positions, readers, inspect, group)
