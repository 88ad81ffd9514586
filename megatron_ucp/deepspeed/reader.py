"""Read DeepSpeed ZeRO-1/2/3 checkpoint folders: file discovery, metadata, and tensor access.

The reader of a whole tag: each file kind has its own module (:mod:`~megatron_ucp.deepspeed.folder`,
:mod:`~megatron_ucp.deepspeed.optimizer_files`, :mod:`~megatron_ucp.deepspeed.model_states`), re-exported here;
this one reads them together and cross-checks what they say. Every other module asks the reader, none parses a
checkpoint itself.

Call order: :func:`resolve_checkpoint` (a root holding ``latest`` or a tag folder) ->
:func:`find_checkpoint_files` (validates the set of files) -> :func:`read_checkpoint` (metadata
of every rank file into pure :class:`~megatron_ucp.plan.conversion.RankLayout` values, plus the model
states). Files are loaded memory-mapped and without torch (:func:`load_raw`: tensors are
:class:`~megatron_ucp.format.rawtensor.RawTensor`), so reading metadata touches no tensor bytes, a
converter reads each fragment's bytes exactly once when it copies them, and a conversion does not
pay torch's import. Every problem raises :class:`CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.deepspeed.folder import (  # noqa: F401  (re-exported: the reader answers for every file kind)
    CheckpointFiles,
    ResolvedCheckpoint,
    find_checkpoint_files,
    resolve_checkpoint,
)
from megatron_ucp.deepspeed.model_states import (  # noqa: F401  (re-exported)
    ModelStates,
    SavedLayout,
    flatten_module_states,
    model_states_dict,
    model_states_path,
    padding_style,
    parallel_dimensions,
    param_shape_groups,
    rank_file_count_problem,
    read_model_states,
    recorded_sizes,
    saved_layout,
    saved_partition_counts,
)
from megatron_ucp.deepspeed.optimizer_files import (  # noqa: F401  (re-exported)
    BF16_OPTIMIZER,
    ZERO_OPTIMIZER,
    RankFile,
    open_rank_file,
)
from megatron_ucp.deepspeed.stage3_files import STAGE3_OPTIMIZER, Stage3RankFile, sub_group_owners
from megatron_ucp.deepspeed.state_kinds import portable
from megatron_ucp.deepspeed.torch_files import load_raw, load_torch_file  # noqa: F401  (re-exported: the hooks open files through the reader)
from megatron_ucp.errors import CheckpointFormatError, PlanError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.conversion import ParamSpec, RankLayout
from megatron_ucp.plan.expert_plan import derive_param_groups
from megatron_ucp.plan.experts import (
    ExpertFacts,
    expert_facts,
)
from megatron_ucp.plan.geometry import PaddingStyle
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.partitioned import FlatGroups, Partitioned
from megatron_ucp.plan.reshard import DENSE, Placement
from megatron_ucp.plan.tensor_parallel import (
    SavedRecord,
    TpLayout,
    layouts_known,
    merge_layout_records,
    resolve_layouts,
)

log = logging.getLogger(__name__)

READABLE_STAGES = (1, 2, 3)
"""ZeRO stages whose files this reader reads (the hooks' own set is ``ELASTIC_STAGES``)."""


@dataclass(frozen=True)
class CoordinateMeta:
    """One model-parallel rank (``mp = pp * TP + tp``): its own parameters and DP partition geometry."""

    mp: int
    pp: int
    tp: int
    model: "ModelStates"
    layouts: tuple[RankLayout, ...]
    """Index = DP rank; ``RankLayout.rank`` is the DP rank."""
    first_file: int
    """Index of its DP rank 0 in :attr:`CheckpointFiles.rank_files`."""
    saved_param_groups: tuple[Any, ...] = ()
    """ZeRO-3: the param groups its DP rank 0 file lists (each names its sub-groups)."""


@dataclass
class CheckpointMeta:
    """Everything known about a tag folder without reading tensor bytes."""

    files: CheckpointFiles
    model: ModelStates
    """The first model-parallel rank's model states."""
    layouts: list[RankLayout]
    """Every rank file's layout, in :attr:`CheckpointFiles.rank_files` order."""
    kind: str
    ds_version: str
    saved_with_ucp: bool
    zero_stage: Optional[int]
    steps: list[list[Optional[float]]]
    """steps[file][group]: the optimizer step each rank file records (None when absent)."""
    dp: int = 0
    tp: int = 1
    pp: int = 1
    coordinates: tuple[CoordinateMeta, ...] = ()
    experts: Optional[ExpertFacts] = None
    """A mixture-of-experts save's experts (expert files, groups partitioned over expert-DP, EP)."""
    scalars: list[list[tuple[tuple[str, tuple], ...]]] = field(default_factory=list)
    """scalars[file][group]: its states of one value per partition besides the step, as
    (name, :func:`~megatron_ucp.deepspeed.state_kinds.portable`) sorted by name."""
    _partitioned: dict[int, Partitioned] = field(default_factory=dict, repr=False, compare=False)

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, ep=(self.experts.ep or 1) if self.experts else 1)

    @property
    def model_parallel(self) -> bool:
        return self.layout.model_parallel > 1

    def partitioned(self, coordinate: CoordinateMeta) -> Partitioned:
        """Where the real elements of each of ``coordinate``'s rank files sit, as the save partitioned them:
        its flat groups (ZeRO-1/2; expert groups over expert-DP) or its sub-groups (ZeRO-3), the one value the
        checks of a save and the plans of a load ask (:mod:`~megatron_ucp.plan.partitioned`)."""
        known = self._partitioned.get(coordinate.mp)
        if known is not None:
            return known
        groups = coordinate.model.param_groups
        layout: Partitioned
        if self.files.partitioned_weights:
            path = self.files.coordinate_files(coordinate.mp)[0]
            owners = sub_group_owners(list(coordinate.saved_param_groups), len(groups), path)
            layout = Stage3Groups(tuple(tuple((p.name, p.numel) for p in g) for g in groups), tuple(owners), self.dp)
        else:
            ep = self.experts.ep if self.experts is not None else None
            placement = Placement.of(ep, self.experts.expert_groups) if ep and self.experts else DENSE
            layout = FlatGroups.of([[(p.name, p.shape) for p in g] for g in groups], self.dp, placement)
        self._partitioned[coordinate.mp] = layout
        return layout

    @property
    def padding_style(self) -> PaddingStyle:
        return padding_style(self.kind, self.ds_version, self.saved_with_ucp)

    def tp_layout_record(self) -> Optional[dict[str, Any]]:
        """The save hook's TP-layout records of every model-states file, merged and cross-checked
        (:func:`~megatron_ucp.plan.tensor_parallel.merge_layout_records`); None when saved without it."""
        coordinates = self.coordinates or (CoordinateMeta(0, 0, 0, self.model, tuple(self.layouts), 0),)
        saved = [
            SavedRecord(
                source=f"{c.model.path} (pipeline stage {c.pp}, TP rank {c.tp})"
                if self.model_parallel
                else str(c.model.path),
                record=c.model.tp_layout_record,
                params=c.model.param_names(),
            )
            for c in coordinates
        ]
        try:
            return merge_layout_records(saved)
        except PlanError as exc:
            raise CheckpointFormatError(str(exc), subject=self.files.tag_dir) from exc

    def tp_layouts(self, names: Sequence[str]) -> dict[str, TpLayout]:
        """Each parameter's TP layout: recorded by megatron-ucp's save hook (every stage's file), else
        Megatron's patterns."""
        try:
            return resolve_layouts(
                names, self.tp_layout_record(), self.model.patterns(self.tp), str(self.files.tag_dir)
            )
        except PlanError as exc:
            raise CheckpointFormatError(str(exc), subject=self.files.tag_dir) from exc

    def tp_layouts_known(self) -> bool:
        """Whether the layouts hold at another TP size: recorded at save, or Megatron's patterns of a TP > 1 save."""
        return layouts_known(self.tp_layout_record(), self.model.patterns(self.tp))

    def describe(self) -> str:
        """``DP=4`` or ``TP=2 x PP=2 x DP=1``, for logs."""
        return self.layout.describe()


def _check_state_dtypes(rf: "RankFile", seen: dict[tuple[int, str], tuple[str, Path]]) -> None:
    """Every rank holds each (group, state) in one dtype: a file that disagrees is named, not mixed
    into the output."""
    for g in range(rf.num_groups):
        for state in rf.state_names(g):
            dtype = rf.state_tensor(g, state).dtype.name
            first = seen.setdefault((g, state), (dtype, rf.path))
            if first[0] != dtype:
                raise CheckpointFormatError(
                    f"{rf.path}: state {state!r} of param group {g} is {dtype}, but "
                    f"{first[1].name} holds it as {first[0]}: files from different runs?",
                    subject=rf.path,
                )


def read_checkpoint(
    tag_dir: Path, rank_files: Optional[Sequence[RankFile]] = None, files: Optional[CheckpointFiles] = None
) -> CheckpointMeta:
    """Read and cross-check the metadata of every file of a tag folder (every model-parallel rank).

    ``files``: the folder's listing when the caller already made it (the tag folder is listed once)."""
    files = files if files is not None else find_checkpoint_files(Path(tag_dir))
    experts = _check_experts(files, rank_files)
    models = [read_model_states(path, shapes_optional=experts is not None) for path in files.model_files]
    tp, pp = models[0].parallel_dimensions(len(models))
    dp = files.dp
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    if files.partitioned_weights:
        _check_zero3_model_files(files, models)
    layouts, kinds, versions, stages, ucp, steps, scalars = [], set(), set(), set(), set(), [], []
    first_kind: Optional[tuple[str, Path]] = None
    dtypes: dict[tuple[int, str], tuple[str, Path]] = {}
    coordinates = []
    for mp, model in enumerate(models):
        if model.dp_world_size is not None and model.dp_world_size != dp:
            raise CheckpointFormatError(
                f"{model.path} records dp_world_size={model.dp_world_size} but the folder has "
                f"{dp} optimizer-state files per model-parallel rank: missing or extra rank "
                "files?",
                subject=files.tag_dir,
            )
        recorded_mp = model.raw.get(F.MP_WORLD_SIZE)
        if recorded_mp is not None and int(recorded_mp) != len(models):
            raise CheckpointFormatError(
                f"{model.path} records mp_world_size={recorded_mp} but the folder holds "
                f"{len(models)} model-states files",
                subject=model.path,
            )
        first = layout.rank_file_index(mp, 0)
        saved_param_groups: tuple[Any, ...] = ()
        for r, path in enumerate(files.coordinate_files(mp)):
            index = first + r
            rf = rank_files[index] if rank_files is not None else open_rank_file(path, r)
            first_kind = first_kind or (rf.kind, path)
            _check_stage(rf, path, first_kind, files)
            _check_rank_file(rf, path, r, dp, experts.partition_counts if experts else None)
            layouts.append(replace(rf.layout(), rank=r))  # a cache numbers files across coordinates
            kinds.add(rf.kind)
            versions.add(rf.ds_version)
            stages.add(rf.sd.get(F.ZERO_STAGE))
            ucp.add(F.GROUP_TRUE_LENGTHS in rf.sd)
            steps.append([None if rf.step(g) is None else float(rf.step(g)) for g in range(rf.num_groups)])
            scalars.append([tuple((k, portable(v)) for k, v in rf.partition_scalars(g)) for g in range(rf.num_groups)])
            _check_state_dtypes(rf, dtypes)
            if r == 0 and files.partitioned_weights:
                saved_param_groups = tuple(rf.param_groups())
            del rf
        pp_rank, tp_rank = layout.coordinates_of(mp)
        coordinates.append(
            CoordinateMeta(mp, pp_rank, tp_rank, model, tuple(layouts[first:]), first, saved_param_groups)
        )
    if len(kinds) > 1 or len(versions) > 1 or len(stages) > 1:
        raise CheckpointFormatError(
            f"{files.tag_dir}: rank files disagree (optimizers {sorted(kinds)}, DeepSpeed "
            f"{sorted(versions)}): files from different runs mixed?",
            subject=files.tag_dir,
        )
    if experts is not None and not models[0].param_groups:
        models[0].param_groups = _derive_expert_save_groups(files, models[0], layouts, experts)
    stage = stages.pop()
    if stage is not None and int(stage) > max(READABLE_STAGES):
        raise UnsupportedError(
            f"{files.tag_dir}: ZeRO stage {int(stage)}; only stages {', '.join(map(str, READABLE_STAGES))} are "
            "supported",
            subject=files.tag_dir,
        )
    return CheckpointMeta(
        files=files,
        model=models[0],
        layouts=layouts,
        kind=kinds.pop(),
        ds_version=versions.pop(),
        saved_with_ucp=all(ucp),
        zero_stage=int(stage) if stage is not None else None,
        steps=steps,
        scalars=scalars,
        dp=dp,
        tp=tp,
        pp=pp,
        coordinates=tuple(coordinates),
        experts=experts,
    )


def _check_stage(rf: "RankFile | Stage3RankFile", path: Path, first: tuple[str, Path], files: CheckpointFiles) -> None:
    """Every rank file of the stage the folder's model states say, and of the same optimizer class."""
    stage3 = rf.kind == STAGE3_OPTIMIZER
    if stage3 != files.partitioned_weights:
        models = files.zero3_model_files[0].name if files.partitioned_weights else files.model_states.name
        raise CheckpointFormatError(
            f"{path}: a ZeRO stage {'3' if stage3 else '1/2'} optimizer file, but the tag's model states "
            f"({models}) are stage {'3' if files.partitioned_weights else '1/2'}'s: files of two ZeRO stages mixed",
            subject=path,
        )
    if rf.kind != first[0]:
        raise CheckpointFormatError(
            f"{path}: written by {rf.kind}, but {first[1].name} by {first[0]}: files from different runs mixed?",
            subject=path,
        )


def _check_zero3_model_files(files: CheckpointFiles, models: Sequence["ModelStates"]) -> None:
    """Every DP rank's ZeRO-3 model states describe the same parameters at the same DP size as its
    model-parallel rank's DP rank 0 (metadata only: their module tensors are empty placeholders)."""
    dp = files.dp
    for index, path in enumerate(files.zero3_model_files):
        mp, d = divmod(index, dp)
        if d == 0:
            continue
        raw = model_states_dict(path)
        first = models[mp]
        if param_shape_groups(raw) != param_shape_groups(first.raw):
            raise CheckpointFormatError(
                f"{path}: its param_shapes differ from {first.path.name}'s: model states of another model "
                "or another sub_group_size",
                subject=path,
            )
        recorded = raw.get(F.DP_WORLD_SIZE)
        if recorded is not None and int(recorded) != dp:
            raise CheckpointFormatError(
                f"{path}: records dp_world_size={recorded} but the folder holds {dp} ranks' files", subject=path
            )


def _check_experts(files: CheckpointFiles, rank_files: Optional[Sequence["RankFile"]]) -> Optional[ExpertFacts]:
    """A mixture-of-experts save (expert files beside the rank files): its experts, checked before anything else
    of it is read (a missing expert file, counts that do not add up); None for any other save."""
    if not files.expert_files or not files.rank_files:
        return None
    first = rank_files[0] if rank_files else open_rank_file(files.rank_files[0], 0)
    recorded = model_states_dict(files.model_states).get("num_experts")
    experts = expert_facts(files.expert_files, first.partition_counts or [], files.dp, files.model_parallel, recorded)
    for name, problem in experts.problems() if experts else ():
        raise CheckpointFormatError(f"{files.tag_dir}: {problem}", subject=files.tag_dir / name if name else None)
    config = getattr(first, "raw", {}).get(F.DS_CONFIG) if experts is not None and experts.expert_groups else None
    if isinstance(config, dict) and config.get("use_data_before_expert_parallelism"):
        raise UnsupportedError(
            f"{first.path}: saved with use_data_before_expert_parallelism (DeepSpeed-MoE's D + E topology): "
            "megatron-ucp places experts as the default E + D topology does",
            subject=first.path,
        )
    if experts is not None and files.model_parallel > 1:
        raise UnsupportedError(
            f"{files.tag_dir}: {experts.describe()} at {files.model_parallel} model-parallel ranks: megatron-ucp "
            "converts mixture-of-experts saves at TP = PP = 1; with the hooks, such a job saves, loads and resumes "
            "at the same DP as stock DeepSpeed does",
            subject=files.tag_dir,
        )
    return experts


def _derive_expert_save_groups(
    files: CheckpointFiles, model: "ModelStates", layouts: Sequence[RankLayout], experts: ExpertFacts
) -> list[list[ParamSpec]]:
    """An MoE save's param groups when its model states list none (DeepSpeed before 0.19): names in flat order
    from the rank files, shapes from the saved module and the expert files."""
    shapes = {
        name: t.shape for name, t in flatten_module_states(model.raw.get("module")).items() if hasattr(t, "shape")
    }
    for name in files.expert_files:
        saved = load_raw(files.tag_dir / name, random_access=True)
        shapes.update({key: t.shape for key, t in flatten_module_states(saved).items() if hasattr(t, "shape")})
    try:
        return derive_param_groups(layouts, experts.expert_groups, experts.ep or 1, shapes)
    except PlanError as exc:
        raise CheckpointFormatError(f"{model.path}: no '{F.PARAM_SHAPES}' and {exc}", subject=model.path) from exc


def _check_rank_file(rf: "RankFile", path: Path, r: int, dp: int, counts: Optional[Sequence[int]] = None) -> None:
    """A rank file's own record of its DP size and rank agrees with where the folder puts it (``counts``: a
    mixture-of-experts save's partition count per group, expert groups over expert-DP)."""
    if rf.partition_counts is not None and counts is not None and list(rf.partition_counts) != list(counts):
        raise CheckpointFormatError(
            f"{path}: its param groups are partitioned over {list(rf.partition_counts)} ranks, rank 0's over "
            f"{list(counts)}: files of different DP or EP sizes mixed?",
            subject=path,
        )
    if rf.partition_counts is not None and counts is None and any(c != dp for c in rf.partition_counts):
        raise CheckpointFormatError(
            f"{path}: written at DP={rf.partition_counts[0]} but the folder holds {dp} rank "
            "files: files of different DP sizes mixed?",
            subject=path,
        )
    info = rf.sd.get(F.ZERO_PARTITION_INFO)
    if isinstance(info, dict) and info.get("dp_size") not in (None, dp):
        raise CheckpointFormatError(
            f"{path}: records dp_size={info.get('dp_size')}, folder holds {dp} rank files", subject=path
        )
    if isinstance(info, dict) and info.get("dp_rank") not in (None, r):
        raise CheckpointFormatError(
            f"{path}: records dp_rank={info.get('dp_rank')} but is named as rank {r}", subject=path
        )
    ranks = info.get("group_dp_ranks") if isinstance(info, dict) else None
    if counts is not None and isinstance(ranks, list) and len(ranks) == len(counts):
        for g, (count, recorded) in enumerate(zip(counts, ranks)):
            placed = r // (dp // count) if count and dp % count == 0 else r
            if recorded != placed:
                raise CheckpointFormatError(
                    f"{path}: records expert-data-parallel rank {recorded} in param group {g}, where DeepSpeed-MoE's "
                    f"E + D topology puts DP rank {r} at {placed} (saved with use_data_before_expert_parallelism, "
                    "or a file of another position?)",
                    subject=path,
                )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
