"""The commit of a conversion: what the last share does once every share wrote its parameters.

The common files (model states, the optimizer's common state, frozen parameters) are written into the staging
folder, the folder is checked whole before anything is committed (every parameter's files; the replicas of each
TP/PP copy against each other; every partition against the checksums the save recorded; what is not finite; what
torch's own reader refuses among the files copied as they are), then the manifest is written and the staging folder
renamed into place (:class:`~megatron_ucp.convert.universal.Staging`): a half-written conversion is never taken for a
finished one.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_ucp.convert.finite import FiniteCheck
from megatron_ucp.convert.replicas import ReplicaDrift, compare_replicas
from megatron_ucp.convert.save_check import PartitionSums, check_partitions, merge_records
from megatron_ucp.convert.universal import (
    Staging,
    list_zero_folder,
    move_latest_universal,
)
from megatron_ucp.convert.writer import (
    RankFileCache,
    save_file,
)
from megatron_ucp.deepspeed.reader import (
    CheckpointFiles,
    CheckpointMeta,
    ResolvedCheckpoint,
)
from megatron_ucp.errors import (
    CheckpointFormatError,
    UcpError,
    UnsupportedError,
)
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, osio
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.format.torch_archive import unproven
from megatron_ucp.format.torchload import TorchReaderCheck
from megatron_ucp.plan.conversion import ConversionPlan
from megatron_ucp.version import __version__

log = logging.getLogger(__name__)


def partition_scalars_by_param_group(meta: CheckpointMeta) -> dict[int, dict[str, tuple]]:
    """Per param group, its states of one value per partition besides the step (portable values), which every
    rank file and every group of the param group must agree on: one value is what carries them to another cut."""
    seen: dict[int, tuple[tuple, int, int]] = {}
    for index, per_group in enumerate(meta.scalars):
        layout = meta.partitioned(meta.coordinates[index // meta.dp]) if meta.files.partitioned_weights else None
        for g, values in enumerate(per_group):
            pg = layout.param_group(g) if layout is not None else g
            known = seen.setdefault(pg, (values, index, g))
            if known[0] != values:
                path = meta.files.rank_files[index]
                raise CheckpointFormatError(
                    f"{path}: the states of one value per partition of its group {g} ({dict(values)}) differ from "
                    f"those of {meta.files.rank_files[known[1]].name}'s group {known[2]} ({dict(known[0])}) in the "
                    "same param group: no one value carries them to another DP size",
                    subject=path,
                )
    return {pg: dict(values) for pg, (values, _, _) in sorted(seen.items()) if values}


def _frozen_params(meta: CheckpointMeta, plan: ConversionPlan) -> dict[str, Any]:
    """Module parameters the optimizer does not hold (frozen): stock writes their fp32 too."""
    if meta.files.partitioned_weights:
        return _zero3_frozen_params(meta)
    module = meta.model.raw.get("module") or {}
    buffers = set(meta.model.raw.get("buffer_names") or ())
    planned = {p.name for p in plan.params}
    shared = set((meta.model.raw.get("shared_params") or {}).keys())
    frozen_shapes = meta.model.raw.get("frozen_param_shapes") or {}
    out = {}
    for name, tensor in module.items():
        if name in planned or name in buffers or name in shared or not isinstance(tensor, RawTensor):
            continue
        if frozen_shapes and name not in frozen_shapes:
            continue
        out[name] = tensor
    if out and meta.model_parallel:
        raise UnsupportedError(
            f"{meta.files.model_states}: frozen parameters ({sorted(out)[:3]}) in a "
            f"{meta.describe()} checkpoint: their TP slices are not merged yet",
            subject=meta.files.model_states,
        )
    return out


def copy_model_files(meta: CheckpointMeta, staging: Staging) -> list[Path]:
    """Copy the model-states file(s) into the output (kernel-side copy), writeback started, not fsynced."""
    copies = []
    for src in meta.files.copied_files():
        dest = staging.path / src.name
        try:
            shutil.copyfile(src, dest)
        except OSError as exc:  # the kernel copy reports the source's name even for a write failure
            if not os.access(src, os.R_OK):
                raise UcpError(f"{src}: cannot read: {exc.strerror or exc}", subject=src) from exc
            raise UcpError(
                f"{dest}: write failed while copying {src.name}: {exc.strerror or exc}", subject=dest
            ) from exc
        with open(dest, "rb") as fh:
            osio.start_writeback(fh.fileno())
        copies.append(dest)
    return copies


def _write_common(
    staging: Staging, meta: CheckpointMeta, plan: ConversionPlan, cache: RankFileCache, model_files_copied: bool
) -> list[str]:
    """optimizer_state.pt, the model-states file(s) unless already copied, and fp32 of frozen parameters."""
    common = cache.get(0).common_state()
    carried = partition_scalars_by_param_group(meta)
    if carried:
        common[F.UCP_PARTITION_SCALARS] = carried
    save_file(common, staging.path / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE)
    if not model_files_copied:
        for dest in copy_model_files(meta, staging):
            osio.fsync_path(dest)
    frozen = _frozen_params(meta, plan)
    for name, tensor in frozen.items():
        folder = staging.path / F.UNIVERSAL_ZERO_DIR / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file({F.PARAM: _as_fp32(tensor)}, folder / f"{F.FP32_STATE}.pt")
    return sorted(frozen)


def _zero3_frozen_params(meta: CheckpointMeta) -> dict[str, Any]:
    """ZeRO-3 frozen parameters: every DP rank's model states hold its slice (``frozen_param_fragments``,
    ``ceil(n / dp)`` elements with tail padding); the parameter is their real elements, in rank order."""
    shapes = meta.model.raw.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if meta.model_parallel:
        raise UnsupportedError(
            f"{meta.files.model_states}: frozen parameters ({sorted(shapes)[:3]}) in a {meta.describe()} "
            "ZeRO-3 checkpoint: their TP slices are not merged yet",
            subject=meta.files.model_states,
        )
    import torch

    from megatron_ucp.deepspeed.reader import load_raw
    from megatron_ucp.plan.param_geometry import ParamPartition

    fragments = [(path, (load_raw(path).get("frozen_param_fragments") or {})) for path in meta.files.zero3_model_files]
    out = {}
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        part = ParamPartition(math.prod(shape), meta.dp)
        pieces = []
        for r, (path, held) in enumerate(fragments):
            frag = held.get(name)
            if frag is None or frag.numel() != part.partition_size:
                held_text = "no slice" if frag is None else f"{frag.numel()} elements"
                raise CheckpointFormatError(
                    f"{path}: frozen parameter {name!r} has {held_text}, expected {part.partition_size} "
                    f"(ceil({part.numel}/{meta.dp}))",
                    subject=path,
                )
            pieces.append(frag.reshape(-1).narrow(0, 0, part.true_length(r)).to_torch())
        out[name] = torch.cat(pieces).float().view(shape)
    return out


def _as_fp32(tensor: Any) -> Any:
    """fp32 of a frozen parameter (a torch tensor when it must be converted: torch does the rounding)."""
    if not isinstance(tensor, RawTensor):
        return tensor
    if tensor.dtype.name == "float32" and tensor.is_contiguous():
        return tensor
    return tensor.to_torch().float().clone()


def check_complete(folder: Path, plan: ConversionPlan, frozen: Iterable[str] = ()) -> None:
    """Every planned parameter has exactly its state files (and step), and nothing else is there."""
    zero = Path(folder) / F.UNIVERSAL_ZERO_DIR
    expected = {
        p.name: {f"{s}.pt" for s in plan.groups[p.group].states}
        | ({f"{F.STEP_STATE}.pt"} if plan.groups[p.group].has_step else set())
        for p in plan.params
    }
    for name in frozen:
        expected[name] = {f"{F.FP32_STATE}.pt"}
    found = {name: set(files) for name, files in list_zero_folder(zero).items()}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointFormatError(
            f"{zero}: no folder for parameters {missing[:5]}{'...' if len(missing) > 5 else ''}", subject=zero
        )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointFormatError(f"{zero}: unexpected parameter folders {extra[:5]}", subject=zero)
    for name, files in expected.items():
        if found[name] != files:
            raise CheckpointFormatError(
                f"{zero / name}: has {sorted(found[name])}, expected {sorted(files)}", subject=zero / name
            )


def files_copied_as_they_are(files: CheckpointFiles) -> list[Path]:
    """The model-states and layer files: the output holds them byte for byte, and DeepSpeed's loader
    opens them with ``torch.load``."""
    return files.copied_files()


def _refuse_what_torch_refuses(check: TorchReaderCheck, folder: Path, sources: list[Path]) -> None:
    """Before the commit, every file the output copied as it is opens with torch's own zip reader:
    judged without torch when it has ``torch.save``'s form (headers only), by torch otherwise (whatever
    it rejects), named by its source. The files our writer wrote need neither: they are ``torch.save``'s
    bytes (``tests/system/test_torchless_io.py``), and the manifest's checksums cover their content."""
    copied = {folder / src.name: src for src in sources}
    judged = sorted(path for path in copied if unproven(path) is not None)
    for path, reason in sorted(check.refused(judged).items()):
        name = copied.get(Path(path), Path(path))
        raise CheckpointFormatError(
            f"{name}: damaged (torch's zip reader: {reason}): torch.load, which DeepSpeed's "
            "loader uses, rejects it; the universal folder would carry it",
            subject=name,
        )


def _merged_sums(plan: ConversionPlan, shares: Sequence[dict]) -> Optional[dict]:
    """Every share's checksums as the manifest records them; None unless every planned state file
    has one (a share from an older converter of the same attempt cannot happen, but never half)."""
    files: dict[str, dict] = {}
    for share in shares:
        files.update(share.get("checksums") or {})
    wanted = {f"{p.name}/{state}" for p in plan.params for state in plan.groups[p.group].states}
    if not wanted <= set(files):
        return None
    return {"algorithm": integrity.ALGORITHM, "files": {k: files[k] for k in sorted(wanted)}}


def _manifest(
    meta: CheckpointMeta,
    ck: ResolvedCheckpoint,
    plan: ConversionPlan,
    frozen: Sequence[str],
    shares: Sequence[dict],
    seconds: float,
    identity: dict,
    drift: Sequence[ReplicaDrift] = (),
) -> dict:
    sums = _merged_sums(plan, shares)
    parallel = {"tp": meta.tp, "pp": meta.pp, "dp": meta.dp, "layouts_recorded": meta.tp_layout_record() is not None}
    if meta.experts is not None:  # expert parameters under global names: the model states list local ones
        parallel["ep"] = meta.layout.ep
        parallel["experts"] = meta.experts.experts
        parallel["expert_groups"] = list(meta.experts.expert_groups)
    return {
        "format": F.MANIFEST_FORMAT,
        "version": F.MANIFEST_VERSION,
        "tool": f"megatron-ucp {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "source": {
            "tag": ck.tag,
            "path": str(meta.files.tag_dir.resolve()),
            "dp": meta.dp,
            "optimizer": meta.kind,
            "ds_version": meta.ds_version,
            "zero_stage": meta.zero_stage,
            "saved_with_megatron_ucp": meta.saved_with_ucp,
        },
        "source_files": identity,
        "plan_fingerprint": plan.fingerprint(),
        "groups": [
            {
                "index": g.index,
                "numel": g.geometry.numel,
                "partition_size": g.geometry.partition_size,
                "states": list(g.states),
                "step": g.has_step,
            }
            for g in plan.groups
        ],
        "params": {
            p.name: {
                "group": p.group,
                "shape": list(p.out_shape),
                "source_shape": list(p.shape),
                **({"tp_layout": p.tp_layout} if p.tp_layout else {}),
            }
            for p in plan.params
        },
        "parallel": parallel,
        **({"replica_drift": [d.to_record() for d in drift]} if drift else {}),
        "frozen_params": list(frozen),
        **({"checksums": sums} if sums is not None else {}),
        "bytes": sum(int(s.get("bytes", 0)) for s in shares),
        "shares": len(shares),
        "seconds": round(seconds, 3),
    }


def commit_conversion(
    ck: ResolvedCheckpoint,
    files: CheckpointFiles,
    identity: Any,
    meta: CheckpointMeta,
    plan: ConversionPlan,
    cache: RankFileCache,
    staging: Staging,
    options: Any,
    force: bool,
    t0: float,
    reader_check: TorchReaderCheck,
) -> None:
    """The last share's commit (it claimed it): the common files written, the folder checked whole (every
    parameter's files, the replicas against each other, every partition against the checksums the save recorded,
    what is not finite, what torch's reader refuses), the manifest written and the folder renamed into place, and
    ``latest_universal`` moved to it where it applies. ``options``: the conversion's
    :class:`~megatron_ucp.convert.execute.ConvertOptions`."""
    output = staging.output
    frozen = _write_common(staging, meta, plan, cache, model_files_copied=options.share_count == 1)
    if options.verify_complete:
        check_complete(staging.path, plan, frozen)
    shares = staging.shares_done()
    replicas_read, finite = PartitionSums(meta, cache), FiniteCheck(cache.paths)
    drift = compare_replicas(plan, cache, on_read=lambda *read: (replicas_read.add(*read), finite.add(*read)))
    for d in drift:
        log.warning("%s: %s", ck.tag_dir, d.describe())
    records = [s.get("partition_sums") for s in shares] + [replicas_read.to_record()]
    checked = check_partitions(meta, cache, merge_records(records))
    non_finite = finite.merge(s.get("non_finite") for s in shares).problems()
    for line in non_finite:
        log.warning("%s: not finite: %s", ck.tag_dir, line)
    if checked.checked:
        log.info(
            "%s: %d partitions match the checksums the save recorded (%d hashed whole, the rest as written)",
            ck.tag_dir,
            checked.checked,
            checked.hashed_again,
        )
    _refuse_what_torch_refuses(reader_check, staging.path, files_copied_as_they_are(files))
    staging.close()
    manifest = _manifest(meta, ck, plan, frozen, shares, time.perf_counter() - t0, identity, drift)
    staging.commit({**manifest, **({"non_finite": non_finite} if non_finite else {})}, force)
    update = options.update_latest
    if update is None:
        update = ck.root is not None and output.parent.resolve() == ck.root.resolve()
    if update:
        if ck.root is None or output.parent.resolve() != ck.root.resolve():
            log.warning("not updating latest_universal: output %s is not in the checkpoint root", output)
        elif non_finite:  # a restart should not be pointed at NaN
            log.warning("%s", not_finite_pointer(ck.tag))
        else:
            log.info("%s", move_latest_universal(ck.root, output))


def not_finite_pointer(tag: str) -> str:
    """Why ``latest_universal`` does not move to a twin whose masters or optimizer states are not finite."""
    return f"latest_universal unchanged: {tag}'s masters or optimizer states are not finite"
