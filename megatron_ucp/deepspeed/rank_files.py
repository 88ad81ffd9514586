"""The old rank files of a save (ZeRO-1/2, and ZeRO-3's through its own view), read for a resume: the save's facts
(:func:`read_facts`, on the first rank) and each file opened and checked on its own (:func:`inspect_file`),
metadata only. The bind that puts them together, and the call order, are
:func:`megatron_ucp.integration.resume.native.binding.bind_save`'s.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_ucp.deepspeed.model_states import rank_file_count_problem
from megatron_ucp.deepspeed.optimizer_files import optimizer_state
from megatron_ucp.deepspeed.quantized_states import dequantized_view, expanded, packed_states
from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.deepspeed.stage3_files import flat_view, model_states_of_another_save, sub_group_owners
from megatron_ucp.deepspeed.state_kinds import partition_scalars, portable, tensor_states, unplaceable_states
from megatron_ucp.deepspeed.tensor_reads import read_tensor_range
from megatron_ucp.deepspeed.torch_files import with_torch_values
from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, save_files
from megatron_ucp.format.exact_read import RangeReader
from megatron_ucp.format.paths import special_kind
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.plan.experts import expert_facts, recorded_experts
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.partitioned import FlatGroups, Partitioned
from megatron_ucp.plan.rank_binding import (
    FileExpectation,
    FileFacts,
    cross_check,
    file_problems,
    recorded_sums,
    save_record_of,
)
from megatron_ucp.plan.reshard import DENSE, Placement, Read

log = logging.getLogger(__name__)

_PARTITIONS = (F.BASE_OPTIMIZER_STATE, F.SINGLE_PARTITION_OF_FP32_GROUPS, F.PARAM_SLICE_MAPPINGS)
"""The per-rank parts of an optimizer file; the rest (loss scaler, clip_grad, ds_version) is global."""
RankFile = Callable[[int], Path]
"""Old DP rank -> its optimizer file for this rank's model-parallel coordinate (the engine names it)."""
SHOWN_PROBLEMS = 20


@dataclass(frozen=True)
class SavedFacts:
    """What the DP group's first rank reads once and broadcasts: a save of any ZeRO stage, its layout a value."""

    dp_from: int
    layout: Partitioned
    """Where each rank file's real elements sit: :class:`~megatron_ucp.plan.partitioned.FlatGroups` (ZeRO-1/2,
    its groups' parameters and shapes, expert groups over expert-DP) or
    :class:`~megatron_ucp.plan.param_geometry.Stage3Groups` (ZeRO-3 sub-groups)."""
    global_state: dict
    """Old rank 0's optimizer-level state (loss scaler, clip_grad, ds_version, ...)."""
    param_groups: list[dict]
    """The base optimizer's hyperparameters per param group (``params`` left out)."""
    states: list[tuple[str, ...]]
    """Each group's tensor states in the files (``exp_avg``, ``exp_avg_sq``, ...)."""
    steps: list[Any]
    """Each group's optimizer step (old rank 0's)."""
    scalars: list[dict[str, Any]] = field(default_factory=list)
    """Each group's other states of one value per partition (NAdam's ``mu_product``, a flag): old rank 0's,
    the same in every rank file (checked), so carried to any DP size as they are."""
    unplaceable: tuple[str, ...] = ()
    """Old rank 0's states no copy places at another DP size (:func:`unplaceable_states`)."""
    unplaceable_file: str = ""
    algorithm: Optional[str] = None
    """The checksum algorithm of old rank 0's ``zero_partition_checksums``; None: saved without them."""
    save_id: Optional[str] = None
    """The save's identity in the model states (saved through the hooks); None: saved without it."""
    model_states: str = ""
    frozen: tuple[str, ...] = ()
    """Frozen parameters of a ZeRO-3 save: their slices live in every rank's model states."""
    requantized: tuple[str, ...] = ()
    """bitsandbytes' states read as values out of its 8-bit dict (``--ucp-requantize-8bit``): copied like any
    per-element state (their codes hashed against the save's checksums), quantized again in the live optimizer."""

    def view(self, view: Callable[[Path], dict]) -> Callable[[Path], dict]:
        """How each rank file of this save is read: ``view``, with bitsandbytes' dicts expanded when requantizing."""
        return dequantized_view(view) if self.requantized else view


def absent(path: Path) -> Optional[str]:
    """Why ``path`` cannot be read as a rank file (missing, a FIFO, a directory, a symlink loop,
    a dangling link), or None for a regular file."""
    if path.is_file():
        return None
    kind = special_kind(path)
    if kind is not None:
        return f"is {kind}, not a rank file"
    return "is a dangling symbolic link" if path.is_symlink() else "is missing"


def model_states_facts(
    model_states: Path, states: Optional[dict] = None, shapes_optional: bool = False
) -> tuple[dict, int, Optional[str]]:
    """The model-states dict (read without the weights' bytes unless given), its DP size and save identity.
    ``shapes_optional``: a save without ``param_shapes`` is taken (the caller knows the shapes otherwise)."""
    if states is None:
        states = load_raw(model_states, random_access=True)
    if not isinstance(states, dict) or not (shapes_optional or isinstance(states.get(F.PARAM_SHAPES), list)):
        raise CheckpointFormatError(
            f"{model_states}: no param_shapes (not a ZeRO-1/2 model-states file)", subject=model_states
        )
    dp_from = states.get(F.DP_WORLD_SIZE)
    if not isinstance(dp_from, int) or dp_from < 1:
        raise CheckpointFormatError(f"{model_states}: no valid dp_world_size ({dp_from!r})", subject=model_states)
    record = states.get(F.UCP_SAVE_RECORD)
    save_id = record.get("save_id") if isinstance(record, dict) else None
    return states, dp_from, str(save_id) if save_id is not None else None


def read_facts(
    model_states: Path,
    rank_file: RankFile,
    states: Optional[dict] = None,
    live_shapes: Optional[list[list[tuple[str, tuple[int, ...]]]]] = None,
    per_parameter: bool = False,
    requantize: bool = False,
) -> SavedFacts:
    """Step 1 (first rank): the facts of any save, checked for the old files' presence and DP size. ``states``:
    the model states already read from ``model_states`` (else read here, without the weights' bytes).
    ``live_shapes``: the job's param groups, taken as the saved ones for a mixture-of-experts save (its model
    states record ``num_experts``) whose model states list none (DeepSpeed before 0.19); every rank file's
    ``param_slice_mappings`` is then checked against them, fragment by fragment, before anything is read.
    ``per_parameter``: a ZeRO-3 save (``model_states``: DP rank 0's), whose files are read under ZeRO-1/2's
    keys (:func:`~megatron_ucp.deepspeed.stage3_files.flat_view`) and whose layout is its sub-groups.
    ``requantize``: bitsandbytes' 8-bit dicts are read as their two states (``--ucp-requantize-8bit``; ZeRO-1/2 at
    a DP change)."""
    states, dp_from, save_id = model_states_facts(model_states, states, shapes_optional=not per_parameter)
    saved_shapes = states.get(F.PARAM_SHAPES)
    if not isinstance(saved_shapes, list):
        if live_shapes is None or not recorded_experts(states.get("num_experts")):
            raise CheckpointFormatError(
                f"{model_states}: no param_shapes (not a ZeRO-1/2 model-states file)", subject=model_states
            )
        saved_shapes = [dict(group) for group in live_shapes]
    saved_shapes = [group for group in saved_shapes if isinstance(group, dict)]
    expected = check_presence(model_states, rank_file, dp_from)
    save_files.check(model_states.parent, save_id)  # every file of the save (layer and expert files too) as written
    if per_parameter:
        _check_stage3_model_states(model_states, dp_from, save_id)
    try:  # tensors located, not read; a damaged file is said as any rank's is (binding_message)
        first = (flat_view if per_parameter else optimizer_state)(expected[0])
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(
            binding_message(model_states.parent, [str(exc)]), subject=expected[0], damaged=expected[0]
        ) from exc
    per_group_states = first[F.BASE_OPTIMIZER_STATE].get("state", {}).values()
    packed = packed_states(per_group_states) if requantize and not per_parameter else ()
    if packed:
        first = expanded(first, expected[0])
    base = first[F.BASE_OPTIMIZER_STATE]
    groups = base.get("param_groups") or []
    if per_parameter:
        count = len(first[F.SINGLE_PARTITION_OF_FP32_GROUPS])
        if len(saved_shapes) != count:
            raise CheckpointFormatError(
                f"{expected[0]}: has {count} optimizer sub-groups, {model_states.name} lists {len(saved_shapes)}: "
                "files of another run, or another sub_group_size?",
                subject=expected[0],
                damaged=expected[0],
            )
        layout: Partitioned = Stage3Groups(
            tuple(tuple((str(name), math.prod(shape)) for name, shape in group.items()) for group in saved_shapes),
            tuple(sub_group_owners(groups, count, expected[0])),
            dp_from,
        )
    else:
        count = len(groups)
        placement = saved_placement(first.get(F.PARTITION_COUNT), dp_from, expected[0])
        layout = FlatGroups.of(
            [[(name, tuple(shape)) for name, shape in group.items()] for group in saved_shapes], dp_from, placement
        )
    per_group = [base["state"].get(g, {}) for g in range(count)]
    return SavedFacts(
        dp_from=dp_from,
        layout=layout,
        global_state=with_torch_values(
            {k: v for k, v in first.items() if k not in _PARTITIONS and k != F.UCP_SAVE_RECORD}
        ),
        param_groups=[{k: v for k, v in group.items() if k != "params"} for group in groups],
        states=tensor_states(per_group),
        steps=[in_memory(s.get(F.STEP_STATE)) for s in per_group],
        scalars=[{k: in_memory(v) for k, v in partition_scalars(s)} for s in per_group],
        unplaceable=unplaceable_states(per_group, first[F.SINGLE_PARTITION_OF_FP32_GROUPS], layout.unit),
        unplaceable_file=str(expected[0]),
        algorithm=checksum_algorithm(first, expected[0]),
        save_id=save_id,
        model_states=str(model_states),
        frozen=tuple(sorted(states.get(F.FROZEN_PARAM_SHAPES) or ())) if per_parameter else (),
        requantized=packed,
    )


def _check_stage3_model_states(model_states: Path, dp_from: int, save_id: Optional[str]) -> None:
    """Every ZeRO-3 rank saved its own model states (counters, config, frozen slices): none may be missing,
    and, saved through the hooks, every one is of this save."""
    paths = [model_states.parent / F.zero3_model_file(r, F.mp_rank_of(model_states.name)) for r in range(dp_from)]
    for path in paths:
        why = absent(path)
        if why is not None:
            raise CheckpointFormatError(f"{path}: {why} (the save's DP size is {dp_from})", subject=path, damaged=path)
    if save_id is not None:
        others = model_states_of_another_save(paths, model_states, save_id)
        if others:
            culprit = others[0].split(": ")[0]
            raise CheckpointFormatError(binding_message(model_states.parent, others), subject=culprit, damaged=culprit)


def saved_placement(counts: Any, dp_from: int, path: Path) -> Placement:
    """Which groups a save partitioned over fewer ranks than DP (its experts, over expert-DP), from its
    ``partition_count`` per group; raises naming ``path`` when they do not make one expert-parallel size.
    A file none of whose groups is over DP is left to the per-file checks (a rank file of another save)."""
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise CheckpointFormatError(f"{path}: no valid partition_count ({counts!r})", subject=path)
    experts = expert_facts((), counts, dp_from)
    # an MoE save has dense groups too: a file none of whose groups is over DP is of another DP size, said per file
    if experts is None or len(experts.expert_groups) == len(counts):
        return DENSE
    if experts.ep is None:  # expert groups over different sizes, or over one that does not divide DP
        raise CheckpointFormatError(f"{path}: {experts.problems()[0][1]}", subject=path)
    return Placement.of(experts.ep, experts.expert_groups)


def check_presence(model_states: Path, rank_file: RankFile, dp_from: int) -> list[Path]:
    """The ``dp_from`` old rank files the model states name, each a readable file, and no other of this
    model-parallel rank in the folder; raises naming the first that is not. Returns their paths."""
    expected = [rank_file(r) for r in range(dp_from)]
    unreadable = [(p, why) for p in expected if (why := absent(p)) is not None]
    if unreadable:
        path, why = unreadable[0]
        more = f" ({len(unreadable)} of the {dp_from} rank files the model states' DP={dp_from} needs are unreadable)"
        saved = sorted(p.name for p in model_states.parent.glob("*optim_states.pt"))[:2]
        if len(unreadable) == len(expected) and saved:  # none by the job's names: another optimizer's, not damage
            raise CheckpointFormatError(
                f"{path}: {why}: this job names its rank files {path.name!r}, the save's are {saved} (another "
                "optimizer, precision or ZeRO stage than the save's?)",
                subject=path,
            )
        raise CheckpointFormatError(f"{path}: {why}{more if len(unreadable) > 1 else ''}", subject=path, damaged=path)
    problem = rank_file_count_problem(model_states.parent, dp_from, like=expected[0].name)
    if problem is not None:
        raise CheckpointFormatError(problem, subject=model_states.parent, damaged=model_states.parent)
    return expected


def checksum_algorithm(optim: dict, path: Path) -> Optional[str]:
    """The algorithm of a hooked save's partition checksums (None: saved without them); an unknown one
    is refused, naming the file."""
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    algorithm = record.get("algorithm") if isinstance(record, dict) else None
    if algorithm is not None and algorithm not in integrity.KNOWN_ALGORITHMS:
        raise CheckpointFormatError(
            f"{path}: partition checksums of unknown algorithm {algorithm!r} "
            f"(known: {', '.join(integrity.KNOWN_ALGORITHMS)})",
            subject=path,
        )
    return algorithm


def in_memory(value: Any) -> Any:
    """A step as the optimizer keeps it: a torch tensor of its own (copied out of the file), or a number."""
    return value.to_torch().clone() if isinstance(value, RawTensor) else value


def _step_value(value: Any) -> Any:
    """A step as a plain number (or its shape, for a non-scalar tensor), to compare across files."""
    if isinstance(value, RawTensor) or torch.is_tensor(value):
        return float(value) if value.numel() == 1 else ("tensor", tuple(value.shape))
    return value


def expectation(facts: SavedFacts, position: int, reads: Sequence[Sequence[Read]]) -> FileExpectation:
    """What the file at ``position`` must hold, for ``reads`` (the planned reads of the rank that opens it),
    as the save's layout says."""
    layout = facts.layout
    return FileExpectation(
        position=position,
        dp=facts.dp_from,
        partition_sizes=tuple(layout.partition_sizes()),
        states=tuple(facts.states),
        needs=tuple(layout.needs(position, reads)),
        fragments=layout.fragments(position),
        true_lengths=tuple(layout.true_lengths(position)),
        save_id=facts.save_id,
        unit=layout.unit,
        partition_counts=layout.partition_counts(),
    )


@dataclass
class Source:
    """One old rank file: its fp32 partitions and optimizer states per group (where they lie in the
    file), and the file, to read the planned ranges from (exactly those bytes)."""

    path: Path
    fp32: list[RawTensor]
    states: list[dict[str, Any]]
    sums: Optional[Sequence[dict[str, Any]]] = None
    """Per group, state -> (real elements, checksum) recorded at save (None: saved without them)."""
    reader: Optional[RangeReader] = None

    def read_into(self, tensor: RawTensor, start: int, dest: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + dest.numel())`` of ``tensor`` into ``dest``; returns what to hash (``dest``, or
        the 8-bit codes of a state read as values)."""
        return read_tensor_range(self.reader_of(), tensor, start, dest)

    def reader_of(self) -> RangeReader:
        if self.reader is None:
            self.reader = RangeReader(self.path)
        return self.reader

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def inspect_file(
    path: Path, facts: SavedFacts, exp: FileExpectation, view: Callable[[Path], dict] = optimizer_state
) -> tuple[Optional[Source], FileFacts]:
    """Step 2 for one file: open it (metadata only: tensors are located, not read) and check it on its
    own. Never raises for a bad file: what is wrong is in the returned facts (and no source). ``view``:
    the file's optimizer dict with ZeRO-1/2's keys (a ZeRO-3 file is read through its own view)."""
    try:
        optim = view(path)
    except UcpError as exc:
        return None, FileFacts(exp.position, str(path), problems=(str(exc),))
    problems = file_problems(str(path), optim, exp)
    base = optim[F.BASE_OPTIMIZER_STATE].get("state", {})
    states = [base.get(g, {}) for g in range(len(exp.partition_sizes))]
    record = save_record_of(optim)
    sums = recorded_sums(optim, len(exp.partition_sizes)) if facts.algorithm is not None else None
    problems += _sum_problems(str(path), optim, sums, facts, exp)
    steps = tuple(_step_value(s.get(F.STEP_STATE)) if isinstance(s, dict) else None for s in states)
    scalars = tuple(
        tuple((k, portable(v)) for k, v in partition_scalars(s)) if isinstance(s, dict) else () for s in states
    )
    save_id = str(record.get("save_id")) if record is not None and record.get("save_id") is not None else None
    file_facts = FileFacts(exp.position, str(path), steps, save_id, tuple(problems), sums, scalars)
    if problems:
        return None, file_facts
    return Source(path, list(optim[F.SINGLE_PARTITION_OF_FP32_GROUPS]), states, sums), file_facts


def _sum_problems(path: str, optim: dict, sums: Any, facts: SavedFacts, exp: FileExpectation) -> list[str]:
    """A hooked save's partition checksums: present in every file, of the save's algorithm, one per
    state with the position's real length."""
    if facts.algorithm is None:
        return []
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    if sums is None or not isinstance(record, dict) or record.get("algorithm") != facts.algorithm:
        return [
            f"{path}: no {facts.algorithm} partition checksums for {len(exp.partition_sizes)} groups, "
            "although old rank 0's file has them (a rank file of another save?)"
        ]
    for g, real in enumerate(exp.true_lengths or ()):
        for state in (F.FP32_STATE, *facts.states[g]):
            entry = sums[g].get(state)
            if entry is None or entry[0] != real:
                return [f"{path}: {exp.unit} {g}'s recorded checksum of {state!r} is {entry!r}, not [{real}, <sum>]"]
    return []


def verdict(facts: SavedFacts, seen: Sequence[FileFacts]) -> list[str]:
    """Every problem the files of a save have, on their own (by position) and together."""
    problems = list(dict.fromkeys(p for f in sorted(seen, key=lambda f: f.position) for p in f.problems))
    return problems + cross_check(facts.model_states, facts.save_id, seen, facts.layout.unit)


def binding_message(folder: Path, problems: Sequence[str], loaded: bool = False) -> str:
    """One error for every rank; ``loaded``: DeepSpeed's own load had already run (the job must stop)."""
    shown = "\n  ".join(problems[:SHOWN_PROBLEMS])
    more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
    state = "the engine is half-loaded: do not train on it" if loaded else "nothing was loaded"
    return (
        f"cannot resume from {folder}: its files are damaged or do not belong together ({len(problems)} problem(s)); "
        f"{state}:"
        f"\n  {shown}{more}"
    )
