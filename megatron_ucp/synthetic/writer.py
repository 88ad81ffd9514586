"""Write a synthetic checkpoint to disk: the tag folder DeepSpeed would write, then ``latest``.

The tag is built in a staging sibling (``.<tag>.synthetic-staging``) and renamed into place once
every file is written and fsynced; ``latest`` (and Megatron's ``latest_checkpointed_iteration.txt``)
are replaced last, by rename. A half-written synthetic checkpoint is never taken for one.
Files are saved with ``torch.save`` and :data:`~megatron_ucp.format.lightpickle.PICKLE_MODULE`
(DeepSpeed's objects as stand-ins), as DeepSpeed saves them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.lightpickle import PICKLE_MODULE
from megatron_ucp.format.osio import fsync_path
from megatron_ucp.synthetic.content import (
    SyntheticSpec,
    bf16_weights,
    expert_files,
    expert_optimizer_files,
    layer_files,
    model_states,
    rank_file_state,
)
from megatron_ucp.synthetic.stage3_content import stage3_model_states, stage3_rank_file_state

log = logging.getLogger(__name__)
STAGING_SUFFIX = ".synthetic-staging"


@dataclass(frozen=True)
class Written:
    tag_dir: Path
    files: int
    bytes: int
    seconds: float


def rank_file_name(mp_rank: int, dp_rank: int) -> str:
    return f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_states_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def _save(obj: object, path: Path) -> int:
    torch.save(obj, path, pickle_module=PICKLE_MODULE)
    fsync_path(path)
    return path.stat().st_size


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)


def _recovery_scripts(spec: SyntheticSpec, root: Path) -> None:
    """The scripts the engine copies next to ``latest``, from the installed DeepSpeed when there is one."""
    found = importlib.util.find_spec("deepspeed")
    where = Path(next(iter(found.submodule_search_locations or []), "")) / "utils" if found else None
    for name in spec.files.recovery_scripts:
        if where is not None and (where / name).is_file():
            shutil.copyfile(where / name, root / name)


def write_checkpoint(
    root: os.PathLike | str, spec: SyntheticSpec, progress: bool = True, rank_files: Optional[range] = None
) -> Written:
    """Write ``root/<spec.tag>`` and point ``latest`` at it. ``rank_files`` (DP ranks) limits the
    optimizer files written (a partial folder for metadata-only work; ``latest`` is then not moved)."""
    root = Path(root)
    tag_dir = root / spec.tag
    if tag_dir.exists():
        raise UcpError(
            f"{tag_dir}: already exists; the synthetic writer does not overwrite checkpoints", subject=str(tag_dir)
        )
    staging = root / f".{spec.tag}{STAGING_SUFFIX}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    ranks = range(spec.dp) if rank_files is None else rank_files
    started = time.perf_counter()
    total = files = 0
    bar = tqdm(
        total=spec.mp_size * (len(ranks) + 1),
        unit="file",
        disable=not progress,
        desc=f"synthetic {spec.tag} ({spec.layout_text()})",
    )
    try:
        for mp_rank in range(spec.mp_size) if spec.per_parameter else ():
            bar.total = spec.mp_size * 2 * len(ranks)
            for dp_rank in ranks:
                model = stage3_model_states(spec, mp_rank, dp_rank)
                total += _save(model, staging / F.zero3_model_file(dp_rank, mp_rank))
                state = stage3_rank_file_state(spec, mp_rank, dp_rank)
                total += _save(state, staging / rank_file_name(mp_rank, dp_rank))
                files += 2
                bar.update(2)
        for mp_rank in range(spec.mp_size) if not spec.per_parameter else ():
            weights = bf16_weights(spec, mp_rank)
            extra = {**layer_files(spec, mp_rank, weights), **expert_files(spec, mp_rank)}
            for name, content in {**extra, **expert_optimizer_files(spec, mp_rank)}.items():
                total += _save(content, staging / name)
                files += 1
            total += _save(model_states(spec, mp_rank, weights), staging / model_states_name(mp_rank))
            files += 1
            bar.update()
            for dp_rank in ranks:
                total += _save(rank_file_state(spec, mp_rank, dp_rank), staging / rank_file_name(mp_rank, dp_rank))
                files += 1
                bar.update()
    except BaseException:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    bar.close()
    fsync_path(staging)
    os.rename(staging, tag_dir)
    fsync_path(root)
    if rank_files is None:
        _recovery_scripts(spec, root)
        if spec.flavour == "megatron":
            _replace_text(root / F.MEGATRON_TRACKER, str(spec.iteration))
        _replace_text(root / F.LATEST, spec.tag)
    seconds = time.perf_counter() - started
    log.debug(  # the CLI prints its own completion line
        "synthetic checkpoint %s: %d files, %.2f GB in %.1f s (%s, %s, DeepSpeed %s files%s)",
        tag_dir,
        files,
        total / 1e9,
        seconds,
        spec.optimizer_class,
        spec.layout_text(),
        spec.ds_version,
        ", with megatron-ucp's save record" if spec.record else "",
    )
    return Written(tag_dir=tag_dir, files=files, bytes=total, seconds=seconds)
