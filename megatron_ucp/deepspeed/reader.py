"""Read DeepSpeed ZeRO-1/2 checkpoint folders: file discovery, metadata, and tensor access.

Size: the one reader of both file kinds (rank files and model states) and of how their records
differ between DeepSpeed releases; every other module asks it, none parses a checkpoint itself.

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
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.deepspeed.stage3_files import STAGE3_OPTIMIZER, Stage3RankFile, is_stage3_state
from megatron_ucp.deepspeed.torch_files import load_raw, load_torch_file  # noqa: F401  (re-exported: the hooks open files through the reader)
from megatron_ucp.deepspeed.versions import (
    BF16_LAST_RANK_PADDING_UNTIL,
    ZERO_PER_RANK_PADDING_SINCE,
    check_file_version,
)
from megatron_ucp.errors import CheckpointFormatError, PlanError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import normalize_tag, read_tag_file, special_kind
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.plan.conversion import Fragment, ParamSpec, RankGroupLayout, RankLayout
from megatron_ucp.plan.expert_plan import derive_param_groups
from megatron_ucp.plan.experts import (
    EXPERT_FILE_RE,
    ExpertFacts,
    expert_facts,
    recorded_expert_parallel,
    recorded_experts,
)
from megatron_ucp.plan.geometry import PaddingStyle
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.tensor_parallel import (
    TP_LAYOUT_KEY,
    MegatronPatterns,
    SavedRecord,
    TpLayout,
    layouts_known,
    merge_layout_records,
    resolve_layouts,
    tp_pp_of_states,
)

log = logging.getLogger(__name__)

BF16_OPTIMIZER = "BF16_Optimizer"
ZERO_OPTIMIZER = "DeepSpeedZeroOptimizer"
READABLE_STAGES = (1, 2, 3)
"""ZeRO stages whose files this reader reads (the hooks' own set is ``ELASTIC_STAGES``)."""


@dataclass(frozen=True)
class ResolvedCheckpoint:
    root: Optional[Path]
    """The checkpoint root (holding ``latest``), or None when given a bare tag folder."""
    tag: str
    tag_dir: Path


def resolve_checkpoint(path: os.PathLike | str, tag: Optional[str] = None) -> ResolvedCheckpoint:
    """Accept a checkpoint root (tag from ``tag`` or its ``latest`` file) or a tag folder.

    Tag names, given or read from ``latest``, are single folder names under the root
    (:mod:`megatron_ucp.format.paths`): a ``latest`` naming ``../other/T`` is refused, not followed.
    """
    p = Path(path)
    kind = special_kind(p)
    if kind is not None and kind != "a directory":
        raise CheckpointFormatError(f"{p}: is {kind}, not a checkpoint folder", subject=p)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory", subject=p)
    if not p.is_dir():
        raise CheckpointFormatError(f"{p}: not a directory (expected a checkpoint root or a tag folder)", subject=p)
    if tag is not None:
        tag = normalize_tag(tag, f"--tag {tag!r}")
        tag_dir = p / tag
        if not tag_dir.is_dir():
            if p.name == tag:
                return ResolvedCheckpoint(root=p.parent, tag=tag, tag_dir=p)
            _explain_missing_tag(tag_dir, f"tag {tag!r} not found under {p}")
        return ResolvedCheckpoint(root=p, tag=tag, tag_dir=tag_dir)
    latest = p / F.LATEST
    name = read_tag_file(latest) if latest.exists() or latest.is_symlink() else None
    if name is not None:
        tag_dir = p / name
        if not tag_dir.is_dir():
            _explain_missing_tag(tag_dir, f"{latest} names tag {name!r}, but {tag_dir} does not exist")
        return ResolvedCheckpoint(root=p, tag=name, tag_dir=tag_dir)
    if (p / F.MODEL_STATES_FILE).exists() or any(F.OPTIM_FILE_RE.match(n) for n in os.listdir(p)):
        root = p.parent if (p.parent / F.LATEST).is_file() else None
        return ResolvedCheckpoint(root=root, tag=p.name, tag_dir=p)
    raise CheckpointFormatError(
        f"{p}: not a DeepSpeed checkpoint: no '{F.LATEST}' file (checkpoint root) and no "
        f"{F.MODEL_STATES_FILE} / *_optim_states.pt files (tag folder)",
        subject=p,
    )


def _explain_missing_tag(tag_dir: Path, message: str) -> None:
    """Raise for a tag folder that is not a usable directory, saying what it is instead."""
    kind = special_kind(tag_dir)
    if tag_dir.is_symlink() and kind is None and not tag_dir.exists():
        message = f"{tag_dir}: a dangling symlink ({message})"
    elif kind not in (None, "a directory"):
        message = f"{tag_dir}: is {kind}, not a tag folder"
    elif tag_dir.is_file():
        message = f"{tag_dir}: is a file, not a tag folder"
    raise CheckpointFormatError(message, subject=tag_dir)


@dataclass(frozen=True)
class CheckpointFiles:
    tag_dir: Path
    model_states: Path
    """The first model-parallel rank's ``mp_rank_00_model_states.pt`` (ZeRO-3: its DP rank 0's file)."""
    rank_files: tuple[Path, ...]
    """Optimizer-state files, model-parallel rank major: index = ``mp * dp + dp_rank``."""
    model_files: tuple[Path, ...] = ()
    """``mp_rank_XX_model_states.pt``, index = model-parallel rank (``pp * TP + tp``); ZeRO-3: each
    model-parallel rank's DP rank 0 file."""
    layer_files: tuple[Path, ...] = ()
    """The pipeline model's ``layer_XX-model_YY-model_states.pt`` (module weights), when there are any."""
    zero3_model_files: tuple[Path, ...] = ()
    """ZeRO-3: every rank's ``zero_pp_rank_<d>_mp_rank_<m>_model_states.pt``, index as :attr:`rank_files`."""
    expert_files: tuple[str, ...] = ()
    """Stages 1/2: the names of DeepSpeed-MoE's ``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt`` files."""

    @property
    def model_parallel(self) -> int:
        return max(1, len(self.model_files))

    @property
    def dp(self) -> int:
        return len(self.rank_files) // self.model_parallel

    @property
    def partitioned_weights(self) -> bool:
        """A ZeRO-3 save (every rank its own model-states file)."""
        return bool(self.zero3_model_files)

    def identity_files(self) -> list[Path]:
        """Every file a conversion reads (what a twin is bound to): an MoE save's expert files too (copied, and
        their shapes read where DeepSpeed wrote no ``param_shapes``)."""
        models = self.zero3_model_files or self.model_files or (self.model_states,)
        return [*models, *self.rank_files, *(self.tag_dir / name for name in self.expert_files)]

    def coordinate_files(self, mp: int) -> tuple[Path, ...]:
        """The rank files of one model-parallel rank, index = DP rank."""
        return self.rank_files[mp * self.dp : (mp + 1) * self.dp]

    def copied_files(self) -> list[Path]:
        """The model-states (every rank's at ZeRO-3), layer and expert files a universal folder holds as they are
        (DeepSpeed's load reads an MoE model's experts from their own files, universal or not)."""
        models = self.zero3_model_files or self.model_files or (self.model_states,)
        return [*models, *self.layer_files, *(self.tag_dir / name for name in self.expert_files)]


def find_checkpoint_files(tag_dir: Path) -> CheckpointFiles:
    """List and validate the files of a ZeRO tag folder, at any TP and PP.

    Stages 1 and 2: every model-parallel rank ``mp`` (``pp * TP + tp``) has
    ``mp_rank_{mp:02d}_model_states.pt`` and one optimizer-state file per DP rank; all of them the same
    DP size. Stage 3: every rank has its own model-states file beside its optimizer-state file.
    """
    tag_dir = Path(tag_dir)
    names = sorted(os.listdir(tag_dir))
    model_files = [n for n in names if F.MODEL_FILE_RE.match(n)]
    zero3_models = [n for n in names if F.ZERO3_MODEL_FILE_RE.match(n)]
    if model_files and zero3_models:
        raise CheckpointFormatError(
            f"{tag_dir}: files of two ZeRO stages in one tag: {model_files[0]} (stages 1/2) and "
            f"{zero3_models[0]} (stage 3); remove the files the save of this tag did not write",
            subject=tag_dir / zero3_models[0],
        )
    if any(F.MODEL_FILE_RE.match(n).group("pp") for n in model_files):
        raise UnsupportedError(
            f"{tag_dir}: per-stage model files (mp_rank_XX_YYY_model_states.pt, the "
            "pipe-engine layout of very old DeepSpeed) are not supported",
            subject=tag_dir,
        )
    optim = [(n, F.OPTIM_FILE_RE.match(n)) for n in names]
    optim = [(n, m) for n, m in optim if m]
    if zero3_models:
        return _find_stage3_files(tag_dir, zero3_models, optim)
    if F.MODEL_STATES_FILE not in names:
        if optim:
            raise CheckpointFormatError(
                f"{tag_dir}: {F.MODEL_STATES_FILE} is missing (optimizer files present)",
                subject=tag_dir / F.MODEL_STATES_FILE,
            )
        raise CheckpointFormatError(
            f"{tag_dir}: not a DeepSpeed checkpoint tag folder (no {F.MODEL_STATES_FILE}, no *_optim_states.pt)",
            subject=tag_dir,
        )
    if not optim:
        raise CheckpointFormatError(
            f"{tag_dir}: no ZeRO optimizer-state files (*zero_pp_rank_*_optim_states.pt); "
            "only ZeRO checkpoints can be converted",
            subject=tag_dir,
        )
    model_mp = {int(F.MODEL_FILE_RE.match(n).group("mp")): n for n in model_files}
    optim_grid = _optimizer_grid(tag_dir, optim)
    mps = sorted(set(model_mp) | set(optim_grid))
    if mps != list(range(len(mps))):
        raise CheckpointFormatError(
            f"{tag_dir}: model-parallel ranks {mps} are not 0..{len(mps) - 1}: files of some ranks are missing",
            subject=tag_dir,
        )
    for mp in mps:
        if mp not in model_mp:
            name = f"mp_rank_{mp:02d}_model_states.pt"
            raise CheckpointFormatError(
                f"{tag_dir}: {name} is missing (optimizer files of model-parallel rank {mp} present)",
                subject=tag_dir / name,
            )
        if mp not in optim_grid:
            raise CheckpointFormatError(
                f"{tag_dir}: no optimizer-state files of model-parallel rank {mp} (*_mp_rank_{mp:02d}_optim_states.pt)",
                subject=tag_dir,
            )
    rank_files = _grid_files(tag_dir, optim_grid, "optimizer-state files")
    files = CheckpointFiles(
        tag_dir=tag_dir,
        model_states=tag_dir / F.MODEL_STATES_FILE,
        rank_files=tuple(rank_files),
        model_files=tuple(tag_dir / model_mp[mp] for mp in mps),
        layer_files=tuple(tag_dir / n for n in names if F.LAYER_FILE_RE.match(n)),
        expert_files=tuple(n for n in names if EXPERT_FILE_RE.match(n)),
    )
    _refuse_special(files.copied_files())
    return files


def _optimizer_grid(tag_dir: Path, optim: list) -> dict[int, dict[int, str]]:
    """``{mp: {dp: file name}}`` of the optimizer-state files; one prefix, one name per rank, plain files."""
    prefixes = {m.group("prefix") or "" for _, m in optim}
    if len(prefixes) > 1:
        raise CheckpointFormatError(
            f"{tag_dir}: mixed optimizer-file prefixes {sorted(prefixes)} (bf16_ and plain files from different runs?)",
            subject=tag_dir,
        )
    grid: dict[int, dict[int, str]] = {}
    for n, m in optim:
        by_rank = grid.setdefault(int(m.group("mp")), {})
        dp_rank = int(m.group("dp"))
        if dp_rank in by_rank:  # DeepSpeed writes exactly one name per rank: ambiguity is an error
            raise CheckpointFormatError(
                f"{tag_dir}: two files claim DP rank {dp_rank}: {by_rank[dp_rank]} and "
                f"{n}; remove the one DeepSpeed did not write",
                subject=tag_dir / n,
            )
        by_rank[dp_rank] = n
        kind = special_kind(tag_dir / n)
        if kind is not None:
            raise CheckpointFormatError(f"{tag_dir / n}: is {kind}, not a rank file", subject=tag_dir / n)
    return grid


def _grid_files(tag_dir: Path, grid: dict[int, dict[int, str]], what: str) -> list[Path]:
    """The files of a ``{mp: {dp: name}}`` grid, model-parallel rank major; every DP rank 0..D-1 of every
    model-parallel rank present, and the same D for all."""
    out: list[Path] = []
    dp_sizes = {}
    for mp in sorted(grid):
        by_rank = grid[mp]
        missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
        if missing:
            where = f" of model-parallel rank {mp}" if len(grid) > 1 else ""
            raise CheckpointFormatError(
                f"{tag_dir}: {what} for DP ranks {missing}{where} are missing (found ranks 0..{max(by_rank)})",
                subject=tag_dir,
            )
        dp_sizes[mp] = len(by_rank)
        out += [tag_dir / by_rank[r] for r in range(len(by_rank))]
    if len(set(dp_sizes.values())) > 1:
        raise CheckpointFormatError(
            f"{tag_dir}: model-parallel ranks hold different numbers of DP {what} "
            f"({dp_sizes}): files missing or mixed from different runs",
            subject=tag_dir,
        )
    return out


def _find_stage3_files(tag_dir: Path, model_names: list[str], optim: list) -> CheckpointFiles:
    """A ZeRO-3 tag: one model-states and one optimizer-state file per (model-parallel rank, DP rank),
    the two sets naming the same ranks; the first missing file is named."""
    if not optim:
        raise CheckpointFormatError(
            f"{tag_dir}: ZeRO-3 model states ({model_names[0]}, ...) but no optimizer-state files "
            "(*zero_pp_rank_*_optim_states.pt)",
            subject=tag_dir,
        )
    optim_grid = _optimizer_grid(tag_dir, optim)
    model_grid: dict[int, dict[int, str]] = {}
    for n in model_names:
        m = F.ZERO3_MODEL_FILE_RE.match(n)
        model_grid.setdefault(int(m.group("mp")), {})[int(m.group("dp"))] = n
    prefix = optim[0][1].group("prefix") or ""
    mps = sorted(set(model_grid) | set(optim_grid))
    if mps != list(range(len(mps))):
        raise CheckpointFormatError(
            f"{tag_dir}: model-parallel ranks {mps} are not 0..{len(mps) - 1}: files of some ranks are missing",
            subject=tag_dir,
        )
    for mp in mps:
        models, optims = model_grid.get(mp, {}), optim_grid.get(mp, {})
        width = max([*models, *optims]) + 1
        for d in range(width):
            if d not in models:
                name = F.zero3_model_file(d, mp)
                other = optims.get(d)
                raise CheckpointFormatError(
                    f"{tag_dir}: {name} is missing"
                    + (f" ({other} present)" if other else f" (DP ranks up to {width - 1} have files)"),
                    subject=tag_dir / name,
                )
            if d not in optims:
                name = f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt"
                raise CheckpointFormatError(
                    f"{tag_dir}: {name} is missing ({models[d]} present)",
                    subject=tag_dir / name,
                )
    rank_files = _grid_files(tag_dir, optim_grid, "optimizer-state files")
    model_files = _grid_files(tag_dir, model_grid, "model-states files")
    dp = len(rank_files) // len(mps)
    files = CheckpointFiles(
        tag_dir=tag_dir,
        model_states=model_files[0],
        rank_files=tuple(rank_files),
        model_files=tuple(model_files[mp * dp] for mp in mps),
        zero3_model_files=tuple(model_files),
    )
    _refuse_special(files.copied_files())
    return files


def _refuse_special(paths: Sequence[Path]) -> None:
    """Files copied into an output as they are: never a FIFO or a device."""
    for path in paths:
        kind = special_kind(path)
        if kind is not None:
            raise CheckpointFormatError(f"{path}: is {kind}, not a torch file", subject=path)


def _is_state_tensor(value: Any) -> bool:
    return isinstance(value, RawTensor) and value.dim() > 0


def _load_rank_file(path: Path) -> dict:
    """A rank file's dict (tensors located, not read); damage torch would reject is warned about."""
    damage: list[str] = []
    raw = load_raw(path, damage)
    if damage:
        log.warning(
            "%s: damaged zip structure (%s): torch.load would reject it, so a native DeepSpeed load of "
            "this tag fails; megatron-ucp reads its records directly and is not affected",
            path,
            damage[0],
        )
    if not isinstance(raw, dict) or not isinstance(raw.get(F.OPTIMIZER_STATE_DICT), dict):
        raise CheckpointFormatError(
            f"{path}: no '{F.OPTIMIZER_STATE_DICT}' dict: not a ZeRO optimizer-state file", subject=path
        )
    return raw


def open_rank_file(path: Path, dp_rank: int) -> "RankFile | Stage3RankFile":
    """One optimizer-state file, read as its stage wrote it: ZeRO-1/2 (:class:`RankFile`) or ZeRO-3
    (:class:`~megatron_ucp.deepspeed.stage3_files.Stage3RankFile`); both answer the same questions."""
    raw = _load_rank_file(Path(path))
    if is_stage3_state(raw[F.OPTIMIZER_STATE_DICT]):
        return Stage3RankFile(path, dp_rank, raw)
    return RankFile(path, dp_rank, raw)


class RankFile:
    """One rank's ZeRO-1/2 ``*_optim_states.pt``: metadata as pure values, tensors as flat views (mmap)."""

    def __init__(self, path: Path, dp_rank: int, raw: Optional[dict] = None):
        self.path = Path(path)
        self.dp_rank = dp_rank
        raw = raw if raw is not None else _load_rank_file(self.path)
        self.raw = raw
        self.sd: dict = raw[F.OPTIMIZER_STATE_DICT]
        for key in (F.PARAM_SLICE_MAPPINGS, F.SINGLE_PARTITION_OF_FP32_GROUPS, F.BASE_OPTIMIZER_STATE):
            if key not in self.sd:
                raise CheckpointFormatError(
                    f"{self.path}: optimizer state lacks '{key}' (DeepSpeed too old to "
                    "record it, or not a ZeRO-1/2 file)",
                    subject=self.path,
                )
        self.ds_version = str(self.sd.get(F.DS_VERSION) or raw.get(F.DS_VERSION) or "")
        if not self.ds_version:
            raise CheckpointFormatError(f"{self.path}: no ds_version recorded", subject=self.path)
        check_file_version(self.ds_version, str(self.path))
        self.kind = ZERO_OPTIMIZER if F.ZERO_STAGE in self.sd else BF16_OPTIMIZER
        counts = self.sd.get(F.PARTITION_COUNT)
        self.partition_counts = list(counts) if isinstance(counts, (list, tuple)) else None
        self._group_states = self._split_base_state()

    @property
    def num_groups(self) -> int:
        return len(self.sd[F.PARAM_SLICE_MAPPINGS])

    def _split_base_state(self) -> list[dict]:
        """Per-group optimizer state dicts, from torch's state_dict or ZeRO's elastic list form."""
        base = self.sd[F.BASE_OPTIMIZER_STATE]
        n = self.num_groups
        if isinstance(base, dict) and "state" in base:
            states = base["state"]
            return [dict(states.get(g, {})) for g in range(n)]
        if isinstance(base, (list, tuple)) and len(base) == n:
            step = self.sd.get("base_optimizer_state_step")
            out = [dict(s) for s in base]
            if step is not None:
                for s in out:
                    s.setdefault(F.STEP_STATE, step)
            return out
        raise CheckpointFormatError(
            f"{self.path}: unrecognised base_optimizer_state layout ({type(base).__name__})", subject=self.path
        )

    def state_names(self, g: int) -> list[str]:
        """Sharded states of group ``g``, discovered from the data (``fp32`` plus the optimizer's)."""
        names = ["fp32"]
        for key, value in self._group_states[g].items():
            if key == F.STEP_STATE:
                continue
            if not _is_state_tensor(value):
                raise UnsupportedError(
                    f"{self.path}: optimizer state {key!r} of param group {g} is not a per-element "
                    f"tensor ({type(value).__name__}); the universal format has no place for it",
                    subject=self.path,
                )
            names.append(str(key))
        return names

    def state_tensor(self, g: int, state: str) -> RawTensor:
        """The flat partition of one state of group ``g`` (a view of the mapped file)."""
        if state == "fp32":
            t = self.sd[F.SINGLE_PARTITION_OF_FP32_GROUPS][g]
        else:
            t = self._group_states[g][state]
        if not isinstance(t, RawTensor) or not t.is_contiguous():
            raise CheckpointFormatError(
                f"{self.path}: state {state!r} of param group {g} is not a contiguous tensor ({t!r:.80})",
                subject=self.path,
            )
        return t.reshape(-1)

    def step(self, g: int) -> Any:
        return self._group_states[g].get(F.STEP_STATE)

    def param_groups(self) -> list[dict]:
        base = self.sd[F.BASE_OPTIMIZER_STATE]
        if isinstance(base, dict) and F.PARAM_GROUPS in base:
            return base[F.PARAM_GROUPS]
        raise CheckpointFormatError(f"{self.path}: base optimizer state has no param_groups", subject=self.path)

    def group_paddings(self) -> Optional[list[int]]:
        value = self.sd.get(F.GROUP_PADDINGS)
        return [int(v) for v in value] if value is not None else None

    def layout(self) -> RankLayout:
        mappings = self.sd[F.PARAM_SLICE_MAPPINGS]
        paddings = self.group_paddings()
        true_lengths = self.sd.get(F.GROUP_TRUE_LENGTHS)
        align = self.sd.get(F.PARAM_ALIGNMENT_PADDINGS)
        groups = []
        for g in range(self.num_groups):
            frags = []
            for name, addr in mappings[g].items():
                try:
                    frags.append(Fragment(name=str(name), start=int(addr.start), numel=int(addr.numel)))
                except AttributeError as exc:
                    raise CheckpointFormatError(
                        f"{self.path}: param_slice_mappings entry for {name!r} has no start/numel", subject=self.path
                    ) from exc
            lengths = tuple((s, int(self.state_tensor(g, s).numel())) for s in self.state_names(g))
            groups.append(
                RankGroupLayout(
                    fragments=tuple(frags),
                    state_lengths=lengths,
                    recorded_padding=paddings[g] if paddings is not None and g < len(paddings) else None,
                    recorded_true_length=int(true_lengths[g]) if true_lengths is not None else None,
                    param_alignment_padding=int(sum(align[g])) if align is not None and g < len(align) else 0,
                    has_step=self.step(g) is not None,
                )
            )
        return RankLayout(rank=self.dp_rank, groups=tuple(groups), source=str(self.path))

    def common_state(self) -> dict:
        """What goes into the universal ``zero/optimizer_state.pt``: everything not sharded, plus param_groups."""
        per_rank = (*F.SHARDED_OPTIMIZER_KEYS, F.GROUP_TRUE_LENGTHS, F.ZERO_PARTITION_INFO)
        out = {k: v for k, v in self.sd.items() if k not in per_rank}
        out[F.PARAM_GROUPS] = self.param_groups()
        if F.GROUP_PADDINGS in out:  # a universal checkpoint holds no padding (as stock writes it)
            out[F.GROUP_PADDINGS] = [0] * len(out[F.GROUP_PADDINGS])
        return out


@dataclass
class ModelStates:
    path: Path
    raw: dict
    param_groups: list[list[ParamSpec]]
    dp_world_size: Optional[int]
    ds_version: str
    universal_checkpoint_info: Optional[dict]

    @property
    def ds_config(self) -> dict:
        cfg = self.raw.get(F.DS_CONFIG)
        return cfg if isinstance(cfg, dict) else {}

    def parallel_dimensions(self, model_parallel: int) -> tuple[int, int]:
        """(TP, PP) of the run that saved this file (:func:`parallel_dimensions`)."""
        return parallel_dimensions(self.raw, self.path, model_parallel)

    def patterns(self, saved_tp: int = 1) -> MegatronPatterns:
        """Megatron's ``universal_checkpoint_info`` patterns of this save (at TP ``saved_tp``)."""
        info = self.universal_checkpoint_info or {}

        def listed(key: str) -> tuple[str, ...]:
            return tuple(info.get(key, ()) or ())

        return MegatronPatterns(
            vocabulary_patterns=listed(F.VOCABULARY_PARAMETER_PATTERNS),
            original_vocab_size=info.get(F.ORIGINAL_VOCAB_SIZE),
            replicated_patterns=listed(F.TP_REPLICATED_PARAMETER_PATTERNS),
            row_parallel_patterns=listed(F.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS),
            two_sub_param_patterns=listed(F.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0),
            saved_tp=saved_tp,
        )

    @property
    def tp_layout_record(self) -> Optional[dict]:
        """What megatron-ucp's save hook recorded of this rank's parameters' TP layouts, if anything."""
        recorded = self.raw.get(TP_LAYOUT_KEY)
        return recorded if isinstance(recorded, dict) else None

    def param_names(self) -> tuple[str, ...]:
        return tuple(spec.name for group in self.param_groups for spec in group)


def parallel_dimensions(raw: dict, path: Path, model_parallel: int) -> tuple[int, int]:
    """(TP, PP) of the run that saved a model-states dict, with ``model_parallel`` = TP x PP files.

    From DeepSpeed's ``checkpoint_parallel_dimensions`` (0.19+), else Megatron's saved ``args``
    (:func:`~megatron_ucp.plan.tensor_parallel.tp_pp_of_states`); neither, with one model-parallel
    rank: (1, 1). What is recorded must multiply to the number of model-parallel files.
    """
    recorded = tp_pp_of_states(raw)
    if recorded is None:
        if model_parallel == 1:
            return 1, 1
        raise CheckpointFormatError(
            f"{path}: {model_parallel} model-parallel ranks, but neither "
            f"{F.CHECKPOINT_PARALLEL_DIMENSIONS!r} nor Megatron's args say how they "
            "divide into TP and PP",
            subject=path,
        )
    tp, pp = recorded
    if tp * pp != model_parallel:
        raise CheckpointFormatError(
            f"{path}: records TP={tp} x PP={pp}, but the folder holds {model_parallel} model-parallel ranks' files",
            subject=path,
        )
    return tp, pp


def flatten_module_states(saved: Any, prefix: str = "") -> dict[str, Any]:
    """A model-states ``module`` dict as flat ``a.b.c`` names.

    Megatron-DeepSpeed saves the module through ``state_dict_for_save_checkpoint``, a dict of
    dicts (``{'language_model': {'encoder': {...}}}``); DeepSpeed's own save is already flat.
    """
    flat: dict[str, Any] = {}
    if not isinstance(saved, dict):
        return flat
    for key, value in saved.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_module_states(value, name + "."))
        else:
            flat[name] = value
    return flat


def _check_shapes_against_module(path: Path, groups: Sequence[Sequence[ParamSpec]], module: Any) -> None:
    """``param_shapes`` must agree with the module's own tensors where the file holds them: the
    output's shape comes from ``param_shapes``, and a transposed entry has the same element count."""
    saved = flatten_module_states(module)
    for group in groups:
        for spec in group:
            shape = getattr(saved.get(spec.name), "shape", None)
            if shape is not None and tuple(shape) == (0,) and spec.numel:
                continue  # ZeRO-3 saves its partitioned parameters as empty placeholders
            if shape is not None and tuple(int(d) for d in shape) != spec.shape:
                raise CheckpointFormatError(
                    f"{path}: param_shapes gives {spec.name!r} the shape {spec.shape}, but the "
                    f"saved module holds it as {tuple(int(d) for d in shape)}",
                    subject=path,
                )


def model_states_path(tag_dir: Path) -> Optional[Path]:
    """The tag's ``mp_rank_00_model_states.pt`` (or the first model-states file of another name; ZeRO-3: DP
    rank 0's ``zero_pp_rank_0_mp_rank_00_model_states.pt``), or None."""
    if (tag_dir / F.MODEL_STATES_FILE).is_file():
        return tag_dir / F.MODEL_STATES_FILE
    found = sorted(p for p in Path(tag_dir).glob("*_model_states.pt") if F.MODEL_FILE_RE.match(p.name))
    if found:
        return found[0]
    zero3 = Path(tag_dir) / F.zero3_model_file(0, 0)
    return zero3 if zero3.is_file() else None


def recorded_sizes(tag_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """``dp_world_size`` and, for a mixture-of-experts save, the EP its model states record (one mapped read, no
    weight bytes); None for what the tag's model states (or their absence) do not say. A damaged file raises
    :class:`CheckpointFormatError`."""
    path = model_states_path(Path(tag_dir))
    if path is None:
        return None, None
    states = load_raw(path, random_access=True)
    dp = states.get(F.DP_WORLD_SIZE) if isinstance(states, dict) else None
    return (int(dp) if dp is not None else None), recorded_expert_parallel(states)


@dataclass(frozen=True)
class SavedLayout:
    """What the resume decision needs from a tag's first model-states file, read once (mapped, no
    weight bytes read)."""

    layout: Optional[ParallelLayout]
    """TP, PP and DP of the save; None when the file records no DP size."""
    param_names: frozenset[str]
    """The optimized parameters' names in that file (model-parallel rank 0's): the model class that saved it."""
    states: Optional[dict] = field(default=None, compare=False, repr=False)
    """The file's dict as read (tensors located, not read), for the reader's next questions."""
    per_parameter: bool = False
    """Saved at ZeRO stage 3 (every rank its own model states, each parameter partitioned on its own)."""
    path: Optional[Path] = None
    """The model-states file read."""


def saved_layout(tag_dir: Path) -> Optional[SavedLayout]:
    """DP, (TP, PP) (from the model states and the number of model-parallel files), parameter names and
    ZeRO-3-ness of a tag's save; None for a tag without model states. A damaged file raises
    :class:`CheckpointFormatError`."""
    path = model_states_path(Path(tag_dir))
    if path is None:
        return None
    raw = _model_states_dict(path)
    per_parameter = F.ZERO3_MODEL_FILE_RE.match(path.name) is not None
    if per_parameter:  # each model-parallel rank's DP rank 0 file
        files = [p for p in Path(tag_dir).iterdir() if (m := F.ZERO3_MODEL_FILE_RE.match(p.name)) and m["dp"] == "0"]
    else:
        files = [p for p in Path(tag_dir).iterdir() if F.MODEL_FILE_RE.match(p.name)]
    names = frozenset(str(n) for g in _param_shape_groups(raw) if isinstance(g, dict) for n in g)
    dp = raw.get(F.DP_WORLD_SIZE)
    tp, pp = parallel_dimensions(raw, path, max(1, len(files)))
    ep = _saved_ep(Path(tag_dir), int(dp)) if dp is not None and recorded_experts(raw.get("num_experts")) else 1
    layout = ParallelLayout(tp=tp, pp=pp, dp=int(dp), ep=ep) if dp is not None else None
    return SavedLayout(layout, names, raw, per_parameter, path)


def _saved_ep(tag_dir: Path, dp: int) -> int:
    """A mixture-of-experts save's EP from the partition counts in its first rank file (the pickle only); 1 when
    it has none (ZeRO-3, or experts partitioned over DP) or they do not add up (the reader says why)."""
    first = next(iter(sorted(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))), None)
    raw = load_raw(first, random_access=True) if first is not None else None
    counts = raw.get(F.OPTIMIZER_STATE_DICT, {}).get(F.PARTITION_COUNT) if isinstance(raw, dict) else None
    if not isinstance(counts, (list, tuple)):
        return 1
    experts = expert_facts((), counts, dp)
    return (experts.ep or 1) if experts is not None else 1


def rank_file_count_problem(tag_dir: Path, dp: int) -> Optional[str]:
    """Whether the folder holds the ``dp`` optimizer files of model-parallel rank 0 its model states
    say; else which side is wrong (the files' own ``partition_count`` breaks the tie), in words.
    None when they agree, or when the folder holds no ZeRO-1/2 optimizer files at all."""
    found = {}
    for path in Path(tag_dir).iterdir():
        match = F.OPTIM_FILE_RE.match(path.name)
        if match and int(match["mp"]) == 0:
            found[int(match["dp"])] = path
    if not found or sorted(found) == list(range(dp)):
        return None
    model = model_states_path(Path(tag_dir))
    first = found[min(found)]
    try:
        raw = load_raw(first)
        count = raw[F.OPTIMIZER_STATE_DICT].get(F.PARTITION_COUNT)
        saved_at = int(count[0] if isinstance(count, (list, tuple)) else count)
    except Exception:
        saved_at = None
    if saved_at == len(found) and sorted(found) == list(range(saved_at)):
        return (
            f"{model}: says DP={dp}, but the folder's {len(found)} rank files of model-parallel rank 0 were "
            f"saved at DP={saved_at}: the model states of another save?"
        )
    extra = [found[r].name for r in sorted(found) if r >= dp]
    missing = [r for r in range(dp) if r not in found]
    says = model.name if model is not None else "the model states"
    if missing and not extra:
        prefix = F.OPTIM_FILE_RE.match(first.name).group("prefix") or ""
        name = f"{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
        more = f" (DP ranks {missing[:5]} have none)" if len(missing) > 1 else ""
        return f"{Path(tag_dir) / name}: is missing{more}; {says} says DP={dp}"
    detail = f"extra: {', '.join(extra[:3])}" if extra else f"missing DP ranks {missing[:5]}"
    return (
        f"{tag_dir}: {len(found)} rank files of model-parallel rank 0 ({detail}), but {says} says DP={dp}: "
        "files of another save in the folder?"
    )


def _model_states_dict(path: Path) -> dict:
    raw = load_raw(path, random_access=True)  # the pickle only: no readahead into the weights after it
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{path}: not a DeepSpeed model-states dict", subject=path)
    return raw


def _param_shape_groups(raw: dict) -> list:
    """``param_shapes`` as a list of groups (older DeepSpeed saved a single group as a bare dict)."""
    shapes = raw.get(F.PARAM_SHAPES) or []
    return [shapes] if isinstance(shapes, dict) else shapes


def read_model_states(path: Path, shapes_optional: bool = False) -> ModelStates:
    """``shapes_optional``: a mixture-of-experts save, whose model states lack ``param_shapes`` before
    DeepSpeed 0.19 (the reader derives the groups from the rank files, :func:`_derive_expert_save_groups`)."""
    raw = _model_states_dict(path)
    shapes = _param_shape_groups(raw)
    if not shapes and not shapes_optional:
        raise CheckpointFormatError(f"{path}: no '{F.PARAM_SHAPES}' (not saved by a ZeRO engine?)", subject=path)
    groups = []
    for g, group in enumerate(shapes):
        groups.append(
            [ParamSpec(name=str(name), group=g, shape=tuple(int(d) for d in shape)) for name, shape in group.items()]
        )
    _check_shapes_against_module(path, groups, raw.get("module"))
    dp = raw.get(F.DP_WORLD_SIZE)
    return ModelStates(
        path=path,
        raw=raw,
        param_groups=groups,
        dp_world_size=int(dp) if dp is not None else None,
        ds_version=str(raw.get(F.DS_VERSION, "")),
        universal_checkpoint_info=raw.get(F.UNIVERSAL_CHECKPOINT_INFO),
    )


def padding_style(kind: str, ds_version: str, saved_with_ucp: bool) -> PaddingStyle:
    """How the files' ``group_paddings`` were recorded (only used to predict stock behaviour)."""
    from packaging.version import Version

    if saved_with_ucp:
        return PaddingStyle.PER_RANK
    v = Version(Version(ds_version).base_version)
    if kind == BF16_OPTIMIZER:
        return PaddingStyle.LAST_RANK_ONLY if v <= BF16_LAST_RANK_PADDING_UNTIL else PaddingStyle.PER_RANK
    return PaddingStyle.PER_RANK if v >= ZERO_PER_RANK_PADDING_SINCE else PaddingStyle.LAST_RANK_ONLY


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

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, ep=(self.experts.ep or 1) if self.experts else 1)

    @property
    def model_parallel(self) -> bool:
        return self.layout.model_parallel > 1

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
    layouts, kinds, versions, stages, ucp, steps = [], set(), set(), set(), set(), []
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
            _check_state_dtypes(rf, dtypes)
            del rf
        pp_rank, tp_rank = layout.coordinates_of(mp)
        coordinates.append(
            CoordinateMeta(mp=mp, pp=pp_rank, tp=tp_rank, model=model, layouts=tuple(layouts[first:]), first_file=first)
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
        raw = _model_states_dict(path)
        first = models[mp]
        if _param_shape_groups(raw) != _param_shape_groups(first.raw):
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
    recorded = _model_states_dict(files.model_states).get("num_experts")
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
