"""Every old rank file of a native load bound to its position and its save, before DeepSpeed's own load touches the
engine: the save's facts, read once by the group's first rank; the live optimizer checked against them; one bind
of the files, each inspected by the rank that reads it, one verdict on every rank. Every ZeRO stage and route."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.model_states import rank_file_count_problem
from megatron_ucp.deepspeed.optimizer_files import optimizer_state
from megatron_ucp.deepspeed.quantized_states import dequantized_view, expanded, packed_states
from megatron_ucp.deepspeed.reader import load_raw
from megatron_ucp.deepspeed.stage3_files import flat_view, model_states_of_another_save, sub_group_owners
from megatron_ucp.deepspeed.state_kinds import (
    partition_scalars,
    portable,
    tensor_states,
    unplaceable_error,
    unplaceable_states,
)
from megatron_ucp.deepspeed.tensor_reads import Source
from megatron_ucp.deepspeed.torch_files import with_torch_values
from megatron_ucp.errors import CheckpointFormatError, PlanError, UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, save_files
from megatron_ucp.format.paths import special_kind
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.integration import node_memory
from megatron_ucp.integration.collectives import Collective, comm
from megatron_ucp.integration.live_job import LiveJob, live_stage3_groups
from megatron_ucp.integration.resume.native.requantize import blocksize_of_live
from megatron_ucp.plan.experts import recorded_experts, saved_placement
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.partitioned import FlatGroups, Partitioned, check_live_model, checked_positions
from megatron_ucp.plan.rank_binding import (
    FileExpectation,
    FileFacts,
    binding_message,
    cross_check,
    file_problems,
    recorded_sums,
    save_record_of,
    step_value,
)
from megatron_ucp.plan.reshard import Placement, Read

log = logging.getLogger(__name__)

_PARTITIONS = (F.BASE_OPTIMIZER_STATE, F.SINGLE_PARTITION_OF_FP32_GROUPS, F.PARAM_SLICE_MAPPINGS)
"""The per-rank parts of an optimizer file; the rest (loss scaler, clip_grad, ds_version) is global."""
RankFile = Callable[[int], Path]
"""Old DP rank -> its optimizer file for this rank's model-parallel coordinate (the engine names it)."""


@dataclass(frozen=True)
class SavedFacts:
    """What the DP group's first rank reads once and broadcasts: a save of any ZeRO stage, its layout a value."""

    dp_from: int
    layout: Partitioned
    """Where each rank file's real elements sit: :class:`~megatron_ucp.plan.partitioned.FlatGroups` (ZeRO-1/2,
    expert groups over expert-DP) or :class:`~megatron_ucp.plan.param_geometry.Stage3Groups` (ZeRO-3 sub-groups)."""
    global_state: dict
    """Old rank 0's optimizer-level state (loss scaler, clip_grad, ds_version, ...)."""
    param_groups: list[dict]
    """The base optimizer's hyperparameters per param group (``params`` left out)."""
    states: list[tuple[str, ...]]
    """Each group's tensor states in the files (``exp_avg``, ``exp_avg_sq``, ...)."""
    steps: list[Any]
    """Each group's optimizer step (old rank 0's), as the optimizer keeps it."""
    scalars: list[dict[str, Any]] = field(default_factory=list)
    """Each group's states of one value per partition (NAdam's ``mu_product``, a flag): old rank 0's, the same in
    every rank file (checked), so carried to any DP size as they are."""
    unplaceable: tuple[str, ...] = ()
    """Old rank 0's states no copy places at another DP size (:func:`unplaceable_states`)."""
    unplaceable_file: str = ""
    algorithm: Optional[str] = None
    """The algorithm of old rank 0's ``zero_partition_checksums``; None: saved without them."""
    save_id: Optional[str] = None
    """The save's identity in the model states (saved through the hooks); None: saved without it."""
    model_states: str = ""
    frozen: tuple[str, ...] = ()
    """Frozen parameters of a ZeRO-3 save: their slices live in every rank's model states."""
    requantized: tuple[str, ...] = ()
    """bitsandbytes' states read as values out of its 8-bit dict (``--ucp-requantize-8bit``), quantized again."""
    per_parameter: bool = False
    """A ZeRO-3 save: its files are read under ZeRO-1/2's keys (:func:`~megatron_ucp.deepspeed.stage3_files.
    flat_view`)."""

    def read(self, path: Path) -> dict:
        """A rank file of this save as ZeRO-1/2's optimizer dict (tensors located, not read)."""
        view = flat_view if self.per_parameter else optimizer_state
        return (dequantized_view(view) if self.requantized else view)(path)


def absent(path: Path) -> Optional[str]:
    """Why ``path`` cannot be read as a rank file (missing, a FIFO, a directory, a symlink loop, a dangling link),
    or None for a regular file."""
    if path.is_file():
        return None
    kind = special_kind(path)
    if kind is not None:
        return f"is {kind}, not a rank file"
    return "is a dangling symbolic link" if path.is_symlink() else "is missing"


def read_facts(
    model_states: Path,
    rank_file: RankFile,
    states: Optional[dict] = None,
    live_shapes: Optional[list[list[tuple[str, tuple[int, ...]]]]] = None,
    per_parameter: bool = False,
    requantize: bool = False,
) -> SavedFacts:
    """The facts of any save (first rank), with the old files' presence and DP size checked. ``states``: the model
    states already read (else read here, without the weights' bytes). ``live_shapes``: the job's param groups, taken
    as the saved ones for a mixture-of-experts save whose model states list none (DeepSpeed before 0.19: the rank
    files' ``param_slice_mappings`` are then checked against them). ``per_parameter``: a ZeRO-3 save
    (``model_states``: DP rank 0's). ``requantize``: bitsandbytes' 8-bit dicts read as their two states."""
    if states is None:
        states = load_raw(model_states, random_access=True)
    saved_shapes = states.get(F.PARAM_SHAPES) if isinstance(states, dict) else None
    if not isinstance(saved_shapes, list):
        if per_parameter or live_shapes is None or not recorded_experts(_get(states, "num_experts")):
            raise CheckpointFormatError(
                f"{model_states}: no param_shapes (not a ZeRO-1/2 model-states file)", subject=model_states
            )
        saved_shapes = [dict(group) for group in live_shapes]
    saved_shapes = [group for group in saved_shapes if isinstance(group, dict)]
    dp_from = _get(states, F.DP_WORLD_SIZE)
    if not isinstance(dp_from, int) or dp_from < 1:
        raise CheckpointFormatError(f"{model_states}: no valid dp_world_size ({dp_from!r})", subject=model_states)
    record = states.get(F.UCP_SAVE_RECORD)
    save_id = str(record["save_id"]) if isinstance(record, dict) and record.get("save_id") is not None else None
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
        layout = FlatGroups.of(
            [[(name, tuple(shape)) for name, shape in group.items()] for group in saved_shapes],
            dp_from,
            _placement(first.get(F.PARTITION_COUNT), dp_from, expected[0]),
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
        steps=[_in_memory(s.get(F.STEP_STATE)) for s in per_group],
        scalars=[{k: _in_memory(v) for k, v in partition_scalars(s)} for s in per_group],
        unplaceable=unplaceable_states(per_group, first[F.SINGLE_PARTITION_OF_FP32_GROUPS], layout.unit),
        unplaceable_file=str(expected[0]),
        algorithm=_checksum_algorithm(first, expected[0]),
        save_id=save_id,
        model_states=str(model_states),
        frozen=tuple(sorted(states.get(F.FROZEN_PARAM_SHAPES) or ())) if per_parameter else (),
        requantized=packed,
        per_parameter=per_parameter,
    )


def _get(states: Any, key: str) -> Any:
    return states.get(key) if isinstance(states, dict) else None


def _check_stage3_model_states(model_states: Path, dp_from: int, save_id: Optional[str]) -> None:
    """Every ZeRO-3 rank saved its own model states (counters, config, frozen slices): none may be missing, and,
    saved through the hooks, every one is of this save."""
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


def _placement(counts: Any, dp_from: int, path: Path) -> Placement:
    """:func:`~megatron_ucp.plan.experts.saved_placement` of a rank file's ``partition_count``, refusals naming it."""
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise CheckpointFormatError(f"{path}: no valid partition_count ({counts!r})", subject=path)
    try:
        return saved_placement(counts, dp_from)
    except PlanError as exc:
        raise CheckpointFormatError(f"{path}: {exc}", subject=path) from exc


def check_presence(model_states: Path, rank_file: RankFile, dp_from: int) -> list[Path]:
    """The ``dp_from`` old rank files the model states name, each a readable file, and no other of this
    model-parallel rank in the folder; raises naming the first that is not. Returns their paths."""
    expected = [rank_file(r) for r in range(dp_from)]
    elsewhere = set(node_memory.names_elsewhere(model_states.parent))  # a memory save's, on other nodes: not missing
    unreadable = [(p, why) for p in expected if (why := absent(p)) is not None and p.name not in elsewhere]
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
    problem = rank_file_count_problem(model_states.parent, dp_from, like=expected[0].name, held=sorted(elsewhere))
    if problem is not None:
        raise CheckpointFormatError(problem, subject=model_states.parent, damaged=model_states.parent)
    return expected


def _checksum_algorithm(optim: dict, path: Path) -> Optional[str]:
    """The algorithm of a hooked save's partition checksums (None: saved without them); an unknown one is refused."""
    record = optim.get(F.ZERO_PARTITION_CHECKSUMS)
    algorithm = record.get("algorithm") if isinstance(record, dict) else None
    if algorithm is not None and algorithm not in integrity.KNOWN_ALGORITHMS:
        raise CheckpointFormatError(
            f"{path}: partition checksums of unknown algorithm {algorithm!r} "
            f"(known: {', '.join(integrity.KNOWN_ALGORITHMS)})",
            subject=path,
        )
    return algorithm


def _in_memory(value: Any) -> Any:
    """A value as the optimizer keeps it: a torch tensor of its own (copied out of the file), or a number."""
    return value.to_torch().clone() if isinstance(value, RawTensor) else value


def expectation(facts: SavedFacts, position: int, reads: Sequence[Sequence[Read]]) -> FileExpectation:
    """What the file at ``position`` must hold, for ``reads`` (those of the rank that opens it)."""
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
        algorithm=facts.algorithm,
    )


def inspect_file(path: Path, facts: SavedFacts, exp: FileExpectation) -> tuple[Optional[Source], FileFacts]:
    """One file opened (metadata only) and checked on its own. Never raises for a bad file: what is wrong is in the
    returned facts (and no source)."""
    try:
        optim = facts.read(path)
    except UcpError as exc:
        return None, FileFacts(exp.position, str(path), problems=(str(exc),))
    problems = file_problems(str(path), optim, exp)
    base = optim[F.BASE_OPTIMIZER_STATE].get("state", {})
    states = [base.get(g, {}) for g in range(len(exp.partition_sizes))]
    record = save_record_of(optim)
    sums = recorded_sums(optim, len(exp.partition_sizes)) if facts.algorithm is not None else None
    steps = tuple(step_value(s.get(F.STEP_STATE)) if isinstance(s, dict) else None for s in states)
    scalars = tuple(
        tuple((k, portable(v)) for k, v in partition_scalars(s)) if isinstance(s, dict) else () for s in states
    )
    save_id = str(record.get("save_id")) if record is not None and record.get("save_id") is not None else None
    file_facts = FileFacts(exp.position, str(path), steps, save_id, tuple(problems), sums, scalars)
    if problems:
        return None, file_facts
    return Source(path, list(optim[F.SINGLE_PARTITION_OF_FP32_GROUPS]), states, sums), file_facts


def verdict(facts: SavedFacts, seen: Sequence[FileFacts]) -> list[str]:
    """Every problem the files of a save have, on their own (by position) and together."""
    problems = list(dict.fromkeys(p for f in sorted(seen, key=lambda f: f.position) for p in f.problems))
    return problems + cross_check(facts.model_states, facts.save_id, seen, facts.layout.unit)


@dataclass
class BoundSave:
    """What the binding established on this rank, before DeepSpeed's own load."""

    facts: SavedFacts
    new: Partitioned
    """The live optimizer's layout (this job's DP size)."""
    reads: list[list[Read]]
    """Per live group, what this rank copies out of which old file."""
    sources: dict[int, Source]
    rank_file: RankFile
    rank: int
    seconds: float
    files: list[FileFacts]
    """What every rank saw of every old file (the same on every rank)."""

    @property
    def old(self) -> Partitioned:
        return self.facts.layout

    @property
    def dp_to(self) -> int:
        return self.new.dp

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def bind_save(
    job: LiveJob,
    model_states: Path,
    rank_file: RankFile,
    states: Optional[dict] = None,
    same_dp: bool = False,
    requantize: bool = False,
) -> Optional[BoundSave]:
    """The binding (collective over the optimizer's DP group); the same error on every rank when the files do not
    belong together. ``model_states``: this rank's, as the engine names it. ``states``: the model states the first
    rank already read. ``same_dp``: a restart at the saved DP size, where a ZeRO-1/2 model the flat plan cannot
    describe is left to DeepSpeed unbound (None) instead of refused. ``requantize``: ``--ucp-requantize-8bit``."""
    t0 = time.perf_counter()
    group, rank = job.dp_group, job.dp_rank
    per_parameter = job.per_parameter
    if per_parameter:  # every ZeRO-3 rank saves its own model states; the facts are in DP rank 0's
        model_states = model_states.parent / F.zero3_model_file(0, F.mp_rank_of(rank_file(0).name))
    calls = Collective(group)
    node_memory.fetch([rank_file(0)] if rank == 0 else [])  # a memory save's: the file the facts are read from
    facts = calls.decided(
        lambda: read_facts(
            model_states,
            rank_file,
            states,
            None if per_parameter else _live_shapes(job),
            per_parameter,
            requantize=requantize and not same_dp,
        ),
        f"cannot resume from {model_states.parent}",
        subject=model_states,
        kind=CheckpointFormatError,  # a StockFormError stays one: a form DeepSpeed's own load takes
    )
    if facts.requantized:  # the same facts on every rank; the live optimizer is the same class everywhere
        blocksize_of_live(job.base)
        if rank == 0:
            log.warning(
                "megatron-ucp: --ucp-requantize-8bit: bitsandbytes' 8-bit states %s are read as values and quantized "
                "again in the new partitions (not exact: one more quantization, measured in the summary)",
                "/".join(facts.requantized),
            )
    if facts.unplaceable:  # the same facts on every rank: the same decision everywhere
        error = unplaceable_error(facts.unplaceable_file, facts.unplaceable, type(job.base).__name__)
        if not same_dp:
            raise error
        if rank == 0:
            log.warning("megatron-ucp: %s; at the saved DP size DeepSpeed's own load reads it as it is", error)
        return None
    try:
        new = live_layout(job, facts, model_states, same_dp)
        reads = facts.layout.reads_to(new, rank)
    except PlanError as exc:  # the same facts and model on every rank: the same error everywhere
        raise UcpError(f"{model_states.parent}: {exc}", subject=model_states.parent) from exc
    except UcpError:
        if same_dp and not per_parameter:
            return None  # the same answer on every rank: the facts and the live model are the same everywhere
        raise
    sources, files = _bind_files(facts, reads, checked_positions(facts.layout, new.dp, rank, reads), rank_file, calls)
    return BoundSave(facts, new, reads, sources, rank_file, rank, time.perf_counter() - t0, files)


def _bind_files(
    facts: SavedFacts, reads: Sequence[Sequence[Read]], positions: Sequence[int], rank_file: RankFile, calls: Collective
) -> tuple[dict[int, Source], list[FileFacts]]:
    """This rank inspects ``positions`` (the files it reads, and the padding-only ones that fall to it) and keeps the
    sources of those it reads; every rank shares what it saw; every rank raises the same error when any file, or the
    set, is wrong. Returns the sources and what every rank saw of every file."""
    readers = {r.source_rank for g in reads for r in g}
    node_memory.fetch([rank_file(p) for p in positions])  # a memory save's: the files this rank reads, brought here
    mine: list[FileFacts] = []
    sources: dict[int, Source] = {}
    for position in positions:
        source, seen = inspect_file(rank_file(position), facts, expectation(facts, position, reads))
        mine.append(replace(seen, sums=None))
        if source is not None and position in readers:
            sources[position] = source
    seen = [f for box in calls.gather_objects(mine) for f in box]
    problems = verdict(facts, seen)
    if problems:
        for source in sources.values():
            source.close()
        folder = Path(facts.model_states).parent  # every problem the verdict finds is in the tag's own files
        raise CheckpointFormatError(
            binding_message(folder, problems), subject=problems[0].split(": ", 1)[0], damaged=folder
        )
    return sources, seen


def live_layout(job: LiveJob, facts: SavedFacts, model_states: Path, same_dp: bool = False) -> Partitioned:
    """The live optimizer as a layout of the save's kind, checked against the facts; raises naming the first
    difference (another model, another expert layout, padding the plan does not describe)."""
    where = model_states.parent
    if not isinstance(facts.layout, FlatGroups):
        if facts.frozen and not same_dp:
            raise UnsupportedError(
                f"{model_states}: frozen parameters ({', '.join(facts.frozen[:3])}) in a ZeRO-3 save: their slices "
                "live in every rank's model states and are not resharded yet; resume at the saved DP size",
                subject=model_states,
            )
        return live_stage3_groups(job.optimizer, job.names)
    dp_to = job.dp_size
    check_expert_groups(job, facts.layout, dp_to, where)
    flats = [g["params"][0] for g in job.base.param_groups]
    return check_live_model(facts.layout, _live_shapes(job), [f.numel() for f in flats], dp_to, where)


def _live_shapes(job: LiveJob) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The live flat groups' parameters, in flat order, with their shapes."""
    return [[(job.names[lp], tuple(lp.shape)) for lp in lps] for lps in job.groups]


def check_expert_groups(job: LiveJob, saved: FlatGroups, dp_to: int, where: Path) -> None:
    """The live groups are partitioned over as many ranks as the save's placement gives them at this DP size (the
    same expert-parallel size), and this rank holds the partition the placement says. Raises naming what differs:
    an expert layout change is the universal route's."""
    dist = comm()
    placement, rank = saved.placement, job.dp_rank
    groups = job.group_dp_groups
    if placement.ep == 1 and all(dist.get_world_size(group=pg) == dp_to for pg in groups):
        return  # no experts on either side: every group over the DP group, as the plan takes it
    for g, pg in enumerate(groups):
        size, mine = dist.get_world_size(group=pg), dist.get_rank(group=pg)
        want = placement.size(g, dp_to) if g < len(saved.shapes) else size
        if (size, mine) != (want, placement.index(g, rank)):
            raise UcpError(
                f"{where}: param group {g} is partitioned over {size} ranks in this job (this rank holds partition "
                f"{mine}); the save's experts (EP={placement.ep}) put it over {want} (partition "
                f"{placement.index(g, rank)}): an expert-parallel change goes through the universal folder",
                subject=where,
            )


def engine_save_files(job: LiveJob, load_dir: str, tag: str) -> tuple[RankFile, Path]:
    """How the engine names the files of a tag for this rank: old DP rank -> its optimizer file of this rank's
    model-parallel coordinate, and this rank's model-states file."""
    own = Path(surface.own_optimizer_file(job.engine, load_dir, tag)).name
    found = F.OPTIM_FILE_RE.match(own)
    if found is None:
        raise UnsupportedError(
            f"this DeepSpeed names its optimizer files {own!r}; the native reshard does not know "
            "the pattern (use --ucp-resume-route universal)",
            subject=own,
        )
    mp_rank, bf16 = int(found["mp"]), found["prefix"] == "bf16_"

    def rank_file(dp_rank: int) -> Path:
        return Path(surface.rank_optimizer_file(job.engine, load_dir, tag, mp_rank, dp_rank, bf16))

    return rank_file, Path(surface.model_states_file(job.engine, load_dir, tag))
