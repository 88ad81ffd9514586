"""Convert a ZeRO-1/2 checkpoint into DeepSpeed's universal layout, streaming and bit-exact.

Call order: :func:`convert` resolves the source, reads metadata of every rank file (memory-mapped,
no tensor bytes), builds and checks the :class:`~megatron_ucp.plan.ConversionPlan`, opens the
staging sibling, then writes this share's parameters: each parameter is assembled once, state by
state, from the contiguous run of rank files that hold its fragments, and written once. There are
no per-fragment temporary files; memory is bounded by the largest parameter's largest state plus
the rank files' mapped pages. Work is split deterministically by bytes between shares (e.g. one
converter per node) and, inside a share, between worker processes. The last share to finish
writes the common files, verifies completeness, and commits (see :mod:`megatron_ucp.universal`).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from tqdm import tqdm

from . import __version__
from . import dsformat as F
from .errors import CheckpointFormatError, OutputExistsError, UcpError
from .plan import ConversionPlan, GroupPlan, ParamPlan, build_plan, share_of, split_by_bytes
from .reader import (CheckpointMeta, RankFile, ResolvedCheckpoint, human_bytes, load_torch_file, read_checkpoint,
                     resolve_checkpoint)
from .universal import COMPLETE, Staging, read_manifest, universal_state, write_latest_universal

log = logging.getLogger(__name__)

__all__ = ["ConvertOptions", "ConvertResult", "convert", "resolve_checkpoint", "default_output", "plan_checkpoint"]


@dataclass(frozen=True)
class ConvertOptions:
    source: Path
    """A checkpoint root (tag from ``tag`` or ``latest``) or a tag folder."""
    output: Optional[Path] = None
    """Default: ``<root>/<tag>_universal`` (next to the tag folder)."""
    tag: Optional[str] = None
    workers: int = 1
    force: bool = False
    update_latest: Optional[bool] = None
    """Write ``<root>/latest_universal``; default: when the output lives in the checkpoint root."""
    share_index: int = 0
    share_count: int = 1
    attempt_id: Optional[str] = None
    """Shares of one conversion pass the same id so they join one staging folder."""
    threads: int = 1
    progress: bool = True
    stale_after: float = 60.0
    start_method: str = "forkserver"
    verify_complete: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1 or self.threads < 1:
            raise UcpError(f"workers and threads must be >= 1 (got {self.workers}, {self.threads})")
        if not 0 <= self.share_index < self.share_count:
            raise UcpError(f"share index {self.share_index} out of range for {self.share_count} shares")


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    tag: str
    committed: bool
    """True when this call renamed the output into place (the last share to finish)."""
    params: int
    """Parameters this call wrote."""
    states: int
    bytes_written: int
    seconds: float
    source_dp: int
    optimizer: str
    share_index: int = 0
    share_count: int = 1
    skipped: bool = False
    """True when the output was already complete and nothing was done."""
    summary: str = field(default="", compare=False)


def default_output(ck: ResolvedCheckpoint) -> Path:
    return ck.tag_dir.parent / F.universal_tag(ck.tag)


def plan_checkpoint(meta: CheckpointMeta) -> ConversionPlan:
    return build_plan(meta.model.param_groups, meta.layouts, meta.model.output_rules())


class RankFileCache:
    """A few memory-mapped rank files, least recently used evicted (a worker walks ranks in order)."""

    def __init__(self, paths: Sequence[Path], capacity: int = 8):
        self.paths = list(paths)
        self.capacity = capacity
        self._open: OrderedDict[int, RankFile] = OrderedDict()

    def get(self, rank: int) -> RankFile:
        rf = self._open.get(rank)
        if rf is None:
            rf = RankFile(self.paths[rank], rank)
            self._open[rank] = rf
            while len(self._open) > self.capacity:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(rank)
        return rf


def _save(obj: Any, path: Path) -> int:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
        return fh.tell()


def assemble_state(p: ParamPlan, state: str, cache: RankFileCache) -> torch.Tensor:
    """One state of one parameter, in its output shape, from its fragments (the single copy)."""
    dtype = cache.get(p.items[0].rank).state_tensor(p.group, state).dtype if p.items else torch.float32
    out = torch.empty(p.out_numel, dtype=dtype)
    for item in p.items:
        src = cache.get(item.rank).state_tensor(p.group, state)
        out.narrow(0, item.dst_offset, item.length).copy_(src.narrow(0, item.src_offset, item.length))
    return out.view(p.out_shape)


def universal_entry(p: ParamPlan, tensor: torch.Tensor) -> dict:
    """The dict DeepSpeed's universal loader reads from ``zero/<param>/<state>.pt``."""
    entry: dict[str, Any] = {F.PARAM: tensor, F.CAT_DIM: p.cat_dim}
    if p.vocab_tensor:
        entry[F.VOCAB_TENSOR] = True
    if p.n_sub_params > 1:
        entry[F.PARAM_N_SUB_PARAMS] = p.n_sub_params
    return entry


@dataclass(frozen=True)
class _Chunk:
    params: tuple[ParamPlan, ...]
    groups: tuple[GroupPlan, ...]
    steps: tuple[Any, ...]
    rank_paths: tuple[str, ...]
    zero_dir: str
    threads: int


def _write_chunk(chunk: _Chunk, on_param: Optional[Callable[[int], None]] = None) -> int:
    """Write every state of the chunk's parameters; returns bytes written."""
    torch.set_num_threads(chunk.threads)
    cache = RankFileCache([Path(p) for p in chunk.rank_paths])
    written = 0
    for p in chunk.params:
        folder = Path(chunk.zero_dir) / p.name
        folder.mkdir(parents=True, exist_ok=True)
        group = chunk.groups[p.group]
        nbytes = 0
        for state in group.states:
            nbytes += _save(universal_entry(p, assemble_state(p, state, cache)), folder / f"{state}.pt")
        if group.has_step:
            nbytes += _save(chunk.steps[p.group], folder / f"{F.STEP_STATE}.pt")
        written += nbytes
        if on_param is not None:
            on_param(nbytes)
    return written


def _group_steps(meta: CheckpointMeta, plan: ConversionPlan) -> tuple[Any, ...]:
    """The optimizer step of each group (rank 0's object); every rank must agree (they step together)."""
    first = RankFile(meta.files.rank_files[0], 0)
    steps = []
    for g in plan.groups:
        value = first.step(g.index)
        for r in range(1, meta.dp):
            if meta.steps[r][g.index] != meta.steps[0][g.index]:
                raise CheckpointFormatError(f"{meta.files.rank_files[r]}: optimizer step {meta.steps[r][g.index]} of "
                                            f"param group {g.index} differs from rank 0's {meta.steps[0][g.index]}",
                                            subject=meta.files.rank_files[r])
        steps.append(value.clone() if torch.is_tensor(value) else value)
    return tuple(steps)


def _frozen_params(meta: CheckpointMeta, plan: ConversionPlan) -> dict[str, torch.Tensor]:
    """Module parameters the optimizer does not hold (frozen): stock writes their fp32 too."""
    module = meta.model.raw.get("module") or {}
    buffers = set(meta.model.raw.get("buffer_names") or ())
    planned = {p.name for p in plan.params}
    shared = set((meta.model.raw.get("shared_params") or {}).keys())
    frozen_shapes = meta.model.raw.get("frozen_param_shapes") or {}
    out = {}
    for name, tensor in module.items():
        if name in planned or name in buffers or name in shared or not torch.is_tensor(tensor):
            continue
        if frozen_shapes and name not in frozen_shapes:
            continue
        out[name] = tensor
    return out


def _write_common(staging: Staging, meta: CheckpointMeta, plan: ConversionPlan) -> list[str]:
    """optimizer_state.pt, the model-states file(s), and fp32 of frozen parameters."""
    common = RankFile(meta.files.rank_files[0], 0).common_state()
    _save(common, staging.path / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE)
    for src in sorted(meta.files.tag_dir.iterdir()):
        if F.MODEL_FILE_RE.match(src.name):
            shutil.copyfile(src, staging.path / src.name)
            with open(staging.path / src.name, "rb+") as fh:
                os.fsync(fh.fileno())
    frozen = _frozen_params(meta, plan)
    for name, tensor in frozen.items():
        folder = staging.path / F.UNIVERSAL_ZERO_DIR / name
        folder.mkdir(parents=True, exist_ok=True)
        _save({F.PARAM: tensor.float().clone()}, folder / f"{F.FP32_STATE}.pt")
    return sorted(frozen)


def check_complete(folder: Path, plan: ConversionPlan, frozen: Iterable[str] = ()) -> None:
    """Every planned parameter has exactly its state files (and step), and nothing else is there."""
    zero = Path(folder) / F.UNIVERSAL_ZERO_DIR
    expected = {p.name: {f"{s}.pt" for s in plan.groups[p.group].states}
                | ({f"{F.STEP_STATE}.pt"} if plan.groups[p.group].has_step else set()) for p in plan.params}
    for name in frozen:
        expected[name] = {f"{F.FP32_STATE}.pt"}
    found = {}
    for dirpath, dirnames, filenames in os.walk(zero):
        rel = os.path.relpath(dirpath, zero)
        if rel != "." and any(f.endswith(".pt") for f in filenames):
            found[rel.replace(os.sep, "/")] = set(filenames)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointFormatError(f"{zero}: no folder for parameters {missing[:5]}{'...' if len(missing) > 5 else ''}",
                                    subject=zero)
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointFormatError(f"{zero}: unexpected parameter folders {extra[:5]}", subject=zero)
    for name, files in expected.items():
        if found[name] != files:
            raise CheckpointFormatError(f"{zero / name}: has {sorted(found[name])}, expected {sorted(files)}",
                                        subject=zero / name)


def _manifest(meta: CheckpointMeta, ck: ResolvedCheckpoint, plan: ConversionPlan, frozen: Sequence[str],
              shares: Sequence[dict], seconds: float) -> dict:
    return {
        "format": F.MANIFEST_FORMAT,
        "version": F.MANIFEST_VERSION,
        "tool": f"megatron-ucp {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "source": {"tag": ck.tag, "path": str(meta.files.tag_dir.resolve()), "dp": meta.dp, "optimizer": meta.kind,
                   "ds_version": meta.ds_version, "zero_stage": meta.zero_stage,
                   "saved_with_megatron_ucp": meta.saved_with_ucp},
        "plan_fingerprint": plan.fingerprint(),
        "groups": [{"index": g.index, "numel": g.geometry.numel, "partition_size": g.geometry.partition_size,
                    "states": list(g.states), "step": g.has_step} for g in plan.groups],
        "params": {p.name: {"group": p.group, "shape": list(p.out_shape), "source_shape": list(p.shape)}
                   for p in plan.params},
        "frozen_params": list(frozen),
        "bytes": sum(int(s.get("bytes", 0)) for s in shares),
        "shares": len(shares),
        "seconds": round(seconds, 3),
    }


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert one tag (or this share of it); see the module docstring for the sequence."""
    t0 = time.perf_counter()
    ck = resolve_checkpoint(options.source, options.tag)
    output = Path(options.output) if options.output is not None else default_output(ck)
    state = universal_state(output)
    if state != "absent" and not options.force:
        if state == COMPLETE and options.share_count > 1:
            return ConvertResult(output=output, tag=ck.tag, committed=False, params=0, states=0, bytes_written=0,
                                 seconds=0.0, source_dp=0, optimizer="", share_index=options.share_index,
                                 share_count=options.share_count, skipped=True,
                                 summary=f"{output} is already complete")
        raise OutputExistsError(f"{output}: already exists ({state}); pass --force to replace it", subject=output)
    if not output.parent.is_dir():
        raise UcpError(f"{output.parent}: output's parent folder does not exist", subject=output.parent)
    if not os.access(output.parent, os.W_OK):
        raise UcpError(f"{output.parent}: not writable", subject=output.parent)

    meta = read_checkpoint(ck.tag_dir)
    plan = plan_checkpoint(meta)
    steps = _group_steps(meta, plan)
    mine = share_of(plan, options.share_index, options.share_count)
    staging = Staging(output, plan.fingerprint(), options.share_index, options.share_count, options.attempt_id,
                      options.stale_after).open()
    log.info("converting %s (DP=%d, %s, DeepSpeed %s): %d params, share %d/%d -> %s", ck.tag_dir, meta.dp, meta.kind,
             meta.ds_version, len(mine), options.share_index + 1, options.share_count, output)
    try:
        written = _write_params(mine, plan, steps, meta, staging, options)
        staging.mark_share_done({"share": options.share_index, "params": len(mine), "bytes": written,
                                 "host": socket.gethostname(), "pid": os.getpid()})
        committed = False
        if staging.claim_commit():
            frozen = _write_common(staging, meta, plan)
            if options.verify_complete:
                check_complete(staging.path, plan, frozen)
            shares = staging.shares_done()
            staging.close()
            staging.commit(_manifest(meta, ck, plan, frozen, shares, time.perf_counter() - t0), options.force)
            committed = True
            update = options.update_latest
            if update is None:
                update = ck.root is not None and output.parent.resolve() == ck.root.resolve()
            if update:
                if ck.root is None or output.parent.resolve() != ck.root.resolve():
                    log.warning("not updating latest_universal: output %s is not in the checkpoint root", output)
                else:
                    write_latest_universal(ck.root, output.name)
    except BaseException as exc:
        if options.share_count == 1:
            staging.discard()
        else:
            staging.mark_share_failed(f"{type(exc).__name__}: {exc}")
            staging.close()
        raise
    finally:
        staging.close()

    seconds = time.perf_counter() - t0
    n_states = sum(len(plan.groups[p.group].states) for p in mine)
    summary = (f"{'converted' if committed else 'wrote share of'} {ck.tag} (DP={meta.dp}, {meta.kind}, DeepSpeed "
               f"{meta.ds_version}): {len(mine)} params, {n_states} state tensors, {human_bytes(written)} in "
               f"{seconds:.2f}s ({human_bytes(written / max(seconds, 1e-9))}/s) -> {output}"
               + ("" if committed else f" [share {options.share_index + 1}/{options.share_count}; commit by the last]"))
    log.debug(summary)
    return ConvertResult(output=output, tag=ck.tag, committed=committed, params=len(mine), states=n_states,
                         bytes_written=written, seconds=seconds, source_dp=meta.dp, optimizer=meta.kind,
                         share_index=options.share_index, share_count=options.share_count, summary=summary)


def _write_params(mine: Sequence[ParamPlan], plan: ConversionPlan, steps: tuple, meta: CheckpointMeta,
                  staging: Staging, options: ConvertOptions) -> int:
    per_group = {g.index: len(g.states) for g in plan.groups}
    total = sum(p.out_numel * per_group[p.group] * 4 for p in mine)
    parts = 1 if options.workers == 1 else options.workers * 4
    chunks = [_Chunk(params=tuple(ps), groups=plan.groups, steps=steps,
                     rank_paths=tuple(str(p) for p in meta.files.rank_files),
                     zero_dir=str(staging.path / F.UNIVERSAL_ZERO_DIR), threads=options.threads)
              for ps in split_by_bytes(mine, parts, per_group) if ps]
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"convert {meta.files.tag_dir.name}",
               disable=not options.progress, leave=False)
    written = 0
    try:
        if options.workers == 1:
            for chunk in chunks:
                written += _write_chunk(chunk, on_param=bar.update)
        else:
            ctx = multiprocessing.get_context(options.start_method)
            if options.start_method == "forkserver":
                ctx.set_forkserver_preload(["torch", "megatron_ucp.convert"])
            with ProcessPoolExecutor(max_workers=options.workers, mp_context=ctx) as pool:
                futures = {pool.submit(_write_chunk, chunk): chunk for chunk in chunks}
                for fut in as_completed(futures):
                    nbytes = fut.result()
                    written += nbytes
                    bar.update(sum(p.out_numel * per_group[p.group] * 4 for p in futures[fut].params))
    finally:
        bar.close()
    return written
