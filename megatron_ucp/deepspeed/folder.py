"""A checkpoint folder: which tag a path names, and which files the tag holds (the set checked, nothing read).

Every problem raises :class:`~megatron_ucp.errors.CheckpointFormatError` naming the path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp.errors import CheckpointFormatError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import normalize_tag, read_tag_file, special_kind
from megatron_ucp.plan.experts import (
    EXPERT_FILE_RE,
)


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


def is_native_tag(path: Path, model_states: bool = False) -> bool:
    """Whether a folder holds a native save's files (model states or rank files of any ZeRO stage), by name only;
    ``model_states``: its model states (what every save writes first; a folder of rank files alone is no save to
    load)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    patterns = (F.MODEL_FILE_RE, F.ZERO3_MODEL_FILE_RE) + (() if model_states else (F.OPTIM_FILE_RE,))
    return any(pattern.match(n) for n in names for pattern in patterns)


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
    mps = _model_parallel_ranks(tag_dir, model_mp, optim_grid)
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
                damaged=tag_dir / n,
            )
        by_rank[dp_rank] = n
        kind = special_kind(tag_dir / n)
        if kind is not None:
            raise CheckpointFormatError(
                f"{tag_dir / n}: is {kind}, not a rank file", subject=tag_dir / n, damaged=tag_dir / n
            )
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
                f"{tag_dir}: {what} for DP ranks {_spans(missing)}{where} are missing (found DP ranks "
                f"{_spans(sorted(by_rank))})",
                subject=tag_dir,
                damaged=tag_dir,
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


def _spans(ranks: list[int]) -> str:
    """Sorted ranks in words, runs joined (``0, 2-5``): 768 of them fit a line."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


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
    mps = _model_parallel_ranks(tag_dir, model_grid, optim_grid)
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


def _model_parallel_ranks(tag_dir: Path, models: dict, optims: dict) -> list[int]:
    """The model-parallel ranks the folder's files name, which must be 0..N-1 (else some ranks' files are missing)."""
    mps = sorted(set(models) | set(optims))
    if mps != list(range(len(mps))):
        raise CheckpointFormatError(
            f"{tag_dir}: model-parallel ranks {mps} are not 0..{len(mps) - 1}: files of some ranks are missing",
            subject=tag_dir,
        )
    return mps


def _refuse_special(paths: Sequence[Path]) -> None:
    """Files copied into an output as they are: never a FIFO or a device."""
    for path in paths:
        kind = special_kind(path)
        if kind is not None:
            raise CheckpointFormatError(f"{path}: is {kind}, not a torch file", subject=path)
