"""Where an export's fp32 masters come from: a finished universal folder, converted first when there is none.

The universal folder holds each parameter whole in fp32, merged across TP, PP and every ZeRO stage, beside the
run's model-states files (Megatron's ``args``, DeepSpeed's ``universal_checkpoint_info``): everything a Hugging
Face export needs, whatever layout saved the tag. Given a native tag, its twin ``<tag>_universal`` is used when
it is complete and made from this save; otherwise the tag is converted into it first (as the background
converter would), so an export never reads a half-written or stale folder.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import is_universal_folder, list_zero_folder, read_manifest, universal_state
from megatron_ucp.deepspeed.folder import resolve_checkpoint
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.integrity import RecordedChecksums, recorded_checksums
from megatron_ucp.plan.resume import TwinState

log = logging.getLogger(__name__)
HF_SUFFIX = "_hf"


@dataclass(frozen=True)
class UniversalSource:
    """A finished universal folder and what the export reads of it besides the tensors."""

    folder: Path
    tag: str
    """The native tag it holds (its name without ``_universal``)."""
    args: dict[str, Any]
    """Megatron's saved ``args``."""
    original_vocab: Optional[int]
    shapes: dict[str, tuple[int, ...]]
    """Each parameter's fp32 master shape (vocabulary parameters: the tokenizer's rows)."""
    checksums: Optional[RecordedChecksums]
    converted: bool
    """Whether this export converted the tag first."""

    def fp32_file(self, name: str) -> Path:
        return self.folder / F.UNIVERSAL_ZERO_DIR / name / f"{F.FP32_STATE}.pt"


def hf_name(tag: str) -> str:
    """The export's default folder name beside the tag: global_step100 -> global_step100_hf."""
    return tag.removesuffix(F.UNIVERSAL_SUFFIX) + HF_SUFFIX


def universal_source(
    path: Path, tag: Optional[str], workers: int, progress: bool, check: Callable[[dict[str, Any], str], Any]
) -> UniversalSource:
    """The universal folder to export ``path`` (a checkpoint root, a native tag folder, or a universal folder)
    from, converting the native tag first when its twin is absent or stale. ``check(args, folder)`` judges the
    run's Megatron args first (raising to refuse): a model the export cannot map is refused before any conversion."""
    path = Path(path)
    if tag is None and is_universal_folder(path):
        if universal_state(path) is TwinState.FOREIGN:
            log.info("%s: no megatron-ucp manifest (stock DeepSpeed's conversion?): exported without checksums", path)
        return _read(path, path.name, converted=False, check=check)
    resolved = resolve_checkpoint(path, tag)
    twin = (resolved.root or resolved.tag_dir.parent) / F.universal_tag(resolved.tag)
    state = universal_state(twin, resolved.tag_dir)
    if state is TwinState.COMPLETE:
        log.info("exporting %s from its universal folder %s", resolved.tag, twin)
        return _read(twin, resolved.tag, converted=False, check=check)
    check(_model_args(resolved.tag_dir)[0], str(resolved.tag_dir))
    if state is TwinState.FOREIGN:
        raise CheckpointFormatError(
            f"{twin}: a folder without megatron-ucp's manifest is where {resolved.tag}'s universal folder goes; "
            "export it by naming it, or remove it to let the export convert the tag",
            subject=twin,
        )
    log.info("%s has no finished universal folder (%s): converting it first into %s", resolved.tag, state, twin)
    convert(
        ConvertOptions(
            source=resolved.tag_dir,
            output=twin,
            workers=workers,
            replace_stale=state is TwinState.STALE,
            update_latest=False,
            progress=progress,
        )
    )
    return _read(twin, resolved.tag, converted=True, check=check)


def _model_states_file(folder: Path) -> Path:
    names = sorted(os.listdir(folder))
    for pattern in (F.MODEL_FILE_RE, F.ZERO3_MODEL_FILE_RE):
        found = [n for n in names if pattern.match(n)]
        if found:
            return folder / found[0]
    raise CheckpointFormatError(
        f"{folder}: no model-states file (mp_rank_00_model_states.pt): the run's Megatron args are not there",
        subject=folder,
    )


def _model_args(folder: Path) -> tuple[dict[str, Any], Optional[int]]:
    """Megatron's saved args and the tokenizer's vocabulary size, from a folder's first model-states file (a native
    tag's or a universal folder's copy)."""
    states_file = _model_states_file(folder)
    states = load_raw(states_file)
    args = getattr(states.get("args") if isinstance(states, dict) else None, "__dict__", None)
    if not isinstance(args, dict) or not args:
        raise CheckpointFormatError(
            f"{states_file}: holds no Megatron args: not a Megatron-DeepSpeed checkpoint", subject=states_file
        )
    info = states.get(F.UNIVERSAL_CHECKPOINT_INFO) or {}
    original = info.get(F.ORIGINAL_VOCAB_SIZE) if isinstance(info, dict) else None
    return args, int(original) if isinstance(original, int) else None


def _read(folder: Path, tag: str, converted: bool, check: Callable[[dict[str, Any], str], Any]) -> UniversalSource:
    args, original = _model_args(folder)
    check(args, str(folder))
    shapes = {}
    for name, kinds in list_zero_folder(folder / F.UNIVERSAL_ZERO_DIR).items():
        if f"{F.FP32_STATE}.pt" not in kinds:
            raise CheckpointFormatError(f"{folder / F.UNIVERSAL_ZERO_DIR / name}: no fp32.pt", subject=folder)
        entry = load_raw(folder / F.UNIVERSAL_ZERO_DIR / name / f"{F.FP32_STATE}.pt", random_access=True)
        shapes[name] = tuple(entry["param"].shape)
    return UniversalSource(
        folder=folder,
        tag=tag.removesuffix(F.UNIVERSAL_SUFFIX),
        args=args,
        original_vocab=original,
        shapes=shapes,
        checksums=recorded_checksums(read_manifest(folder)),
        converted=converted,
    )
