"""Convert a ZeRO-1/2 checkpoint into DeepSpeed's universal layout, streaming and bit-exact.

Call order: :func:`convert` resolves the source, reads metadata of every rank file (memory-mapped,
no tensor bytes), builds and checks the :class:`~megatron_ucp.plan.ConversionPlan`, opens the
staging sibling, then writes this share's parameters: each state file is written once, straight
from the fragments in the memory-mapped rank files (:mod:`megatron_ucp.torchfile`: the bytes
``torch.save`` would write, without assembling the tensor first), and the pages read are released
as soon as the file is written. Nothing on this path imports torch (files are read by
:mod:`megatron_ucp.torchload`); ``torch.save`` is the fallback for what the direct writer
refuses. There are no per-fragment temporary files; resident memory is bounded by the state
being written in each writer thread. Work is split deterministically by
bytes between shares (e.g. one converter per node) and, inside a share, between writer threads.
The last share to finish writes the common files, verifies completeness, and commits (see
:mod:`megatron_ucp.universal`).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from tqdm import tqdm

from . import __version__
from . import dsformat as F
from . import integrity, osio
from .errors import CheckpointFormatError, OutputExistsError, UcpError
from .lightpickle import PICKLE_MODULE, needs_light_pickler
from .paths import check_output_placement, special_kind
from .plan import ConversionPlan, CopyItem, GroupPlan, ParamPlan, build_plan, share_of, split_by_bytes
from .rawtensor import RawTensor, torch_tensors_from_raw
from .reader import (CheckpointFiles, CheckpointMeta, RankFile, ResolvedCheckpoint, find_checkpoint_files, human_bytes,
                     read_checkpoint, resolve_checkpoint)
from .torchfile import FastWriterUnsupported, TensorSpec, save_object, tensor_bytes, write_tensors_file
from .torchload import structure_problems
from .universal import (COMPLETE, STALE, Staging, inspect_staging, latest_universal_target, read_manifest,
                        source_identity, stale_reason, universal_state, write_latest_universal)

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
    replace_stale: bool = False
    """Replace an existing output made from an earlier save of the tag (the async converter and the
    elastic loader do; the CLI asks for --force)."""
    update_latest: Optional[bool] = None
    """Write ``<root>/latest_universal``; default: when the output lives in the checkpoint root."""
    share_index: int = 0
    share_count: int = 1
    attempt_id: Optional[str] = None
    """Shares of one conversion pass the same id so they join one staging folder."""
    progress: bool = True
    stale_after: float = 60.0
    verify_complete: bool = True
    on_progress: Optional[Callable[[int, int], None]] = field(default=None, compare=False)
    """Called in the converting process as parameters finish: (bytes done, bytes expected) of this share."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UcpError(f"workers must be >= 1 (got {self.workers})")
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
    """Memory-mapped rank files shared by the writer threads, opened on first use.

    Opening a rank file maps it and unpickles its metadata (no tensor bytes): address space and
    under a millisecond each, so by default every file stays open (a parameter at DP=768 spans up
    to hundreds of ranks, and a small cache would reopen them for every state). Each mapping holds
    a file descriptor: the soft limit on open files is raised towards the hard one when needed,
    and ``capacity`` (default: what the limit allows, at most 4096) bounds the number open; the
    least recently used is dropped first.
    """

    def __init__(self, paths: Sequence[Path], capacity: Optional[int] = None):
        self.paths = list(paths)
        self.capacity = capacity if capacity is not None else max(16, min(len(self.paths), 4096,
                                                                           _descriptors_for(len(self.paths))))
        self._open: OrderedDict[int, RankFile] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rank: int) -> RankFile:
        with self._lock:
            rf = self._open.get(rank)
            if rf is None:
                rf = RankFile(self.paths[rank], rank)
                self._open[rank] = rf
                while len(self._open) > self.capacity:
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(rank)
            return rf


def _descriptors_for(wanted: int) -> int:
    """Raise the soft limit on open files so ``wanted`` more fit (up to the hard limit); how many fit."""
    try:
        import resource
    except ImportError:  # not POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + 256  # stdio, writers, fsync threads, the staging folder
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else max(16, soft - 256)


def torch_save_forced() -> bool:
    """``MEGATRON_UCP_TORCH_SAVE=1`` writes every file with torch.save (an escape hatch; slower)."""
    return os.environ.get("MEGATRON_UCP_TORCH_SAVE") == "1"


def _save(obj: Any, path: Path, durable: bool = True) -> int:
    """Write ``obj`` as ``torch.save`` would (+ fsync when ``durable``); a failed write names the file.

    Tensors are :class:`RawTensor`; the direct writer handles them without torch, and torch.save
    (imported here) the rest. Objects read while DeepSpeed was not imported may hold stand-ins for
    DeepSpeed classes (:mod:`megatron_ucp.lightpickle`); both write them back as the originals.
    """
    try:
        with open(path, "wb") as fh:
            try:
                if torch_save_forced():
                    raise FastWriterUnsupported("MEGATRON_UCP_TORCH_SAVE=1")
                save_object(obj, path, fd=fh.fileno())
            except FastWriterUnsupported:
                import torch

                fh.seek(0)
                fh.truncate()
                extra = {"pickle_module": PICKLE_MODULE} if needs_light_pickler() else {}
                torch.save(torch_tensors_from_raw(obj), fh, **extra)
                fh.flush()
            if durable:
                os.fsync(fh.fileno())
            else:
                osio.start_writeback(fh.fileno())
            return os.fstat(fh.fileno()).st_size
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UcpError(f"{path}: write failed: {reason}", subject=path) from exc


def universal_entry(p: ParamPlan, tensor: Any, padded_rows: Any = None) -> dict:
    """The dict DeepSpeed's universal loader reads from ``zero/<param>/<state>.pt``; the trimmed
    vocabulary rows, when there are any, under :data:`~megatron_ucp.dsformat.VOCAB_PADDED_ROWS`."""
    entry: dict[str, Any] = {F.PARAM: tensor, F.CAT_DIM: p.cat_dim}
    if p.vocab_tensor:
        entry[F.VOCAB_TENSOR] = True
    if p.n_sub_params > 1:
        entry[F.PARAM_N_SUB_PARAMS] = p.n_sub_params
    if padded_rows is not None:
        entry[F.VOCAB_PADDED_ROWS] = padded_rows
    return entry


def state_fragments(p: ParamPlan, state: str, cache: RankFileCache,
                    items: Optional[Sequence[CopyItem]] = None) -> list[RawTensor]:
    """The source fragments of one state of one parameter, in ``items`` order (default: all of
    ``p.items``; views, no copy)."""
    return [cache.get(item.rank).state_tensor(p.group, state).narrow(0, item.src_offset, item.length)
            for item in (p.items if items is None else items)]


def assemble_items_torch(items: Sequence[CopyItem], shape: Sequence[int], parts: Sequence[RawTensor]) -> Any:
    """A ``torch.Tensor`` of ``shape`` copied from its fragments (imports torch)."""
    import torch

    numel = math.prod(shape)
    out = torch.empty(numel, dtype=getattr(torch, parts[0].dtype.name) if parts else torch.float32)
    for item, t in zip(items, parts):
        out.narrow(0, item.dst_offset, item.length).copy_(t.to_torch())
    return out.view(tuple(shape))


def assemble_torch(p: ParamPlan, state: str, cache: RankFileCache) -> tuple[Any, Any]:
    """One state as torch tensors: the ``param`` tensor (``out_shape``) and the trimmed vocabulary
    rows (None when there are none)."""
    kept = assemble_items_torch(p.kept_items, p.out_shape, state_fragments(p, state, cache, p.kept_items))
    if p.padded_rows_shape is None:
        return kept, None
    rows = assemble_items_torch(p.padded_rows_items, p.padded_rows_shape,
                                state_fragments(p, state, cache, p.padded_rows_items))
    return kept, rows


@dataclass(frozen=True)
class _Chunk:
    params: tuple[ParamPlan, ...]
    groups: tuple[GroupPlan, ...]
    steps: tuple[Any, ...]
    zero_dir: str


FSYNC_THREADS = 8
"""Concurrent fsyncs at the end of a share (see :meth:`_Writer.make_durable`)."""


class _Writer:
    """Writes parameters' state files: fragments straight from the mapped rank files to disk.

    Shared by the writer threads of one converter: :meth:`write_param` is thread-safe. Files are
    not fsynced one by one (each fsync would wait for the disk before the next file starts):
    writeback is started as each file is finished and :meth:`make_durable` fsyncs them at the end.
    """

    def __init__(self, cache: RankFileCache, fast: bool = True):
        self.cache = cache
        self.fast = fast
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[Path] = []
        self.sums: dict[str, dict[str, int]] = {}
        """``"<param>/<state>"`` -> the file's elements and :mod:`~megatron_ucp.integrity` checksum,
        computed from the bytes on their way to disk (for the manifest; the loaders verify against it)."""

    def write_param(self, p: ParamPlan, group: GroupPlan, step: Any, zero_dir: str) -> int:
        folder = Path(zero_dir) / p.name
        folder.mkdir(parents=True, exist_ok=True)
        kept_items, rows_items = p.kept_items, p.padded_rows_items
        sources = {state: (state_fragments(p, state, self.cache, kept_items),
                           state_fragments(p, state, self.cache, rows_items)) for state in group.states}
        for kept, rows in sources.values():  # readahead for this parameter (cold caches)
            for t in (*kept, *rows):
                if t.storage.mapped:
                    osio.will_need(t.data_ptr(), t.nbytes)
        nbytes = 0
        written: list[Path] = []
        for state in group.states:
            path = folder / f"{state}.pt"
            kept, rows = sources[state]
            nbytes += self._write_state(p, kept, rows, path, f"{p.name}/{state}")
            written.append(path)
            for t in (*kept, *rows):  # this process is done with these pages
                if t.storage.mapped:
                    osio.done_with(t.data_ptr(), t.nbytes, t.storage.region)
        if group.has_step:
            path = folder / f"{F.STEP_STATE}.pt"
            nbytes += _save(step, path, durable=False)
            written.append(path)
        with self._lock:
            self._pending.extend(written)
        return nbytes

    def _record(self, key: str, sums: Sequence[integrity.StreamingSum]) -> None:
        """The file's elements and checksums: the tensor, then its kept vocabulary rows (which sit after
        the kept rows in the parameter's flat layout)."""
        entry: dict[str, int] = {}
        for prefix, stream in zip(("", "rows_"), sums):
            entry[f"{prefix}numel"] = stream.offset - (sums[0].offset if prefix else 0)
            entry[f"{prefix}sum"] = stream.result()
        with self._lock:
            self.sums[key] = entry

    def _write_state(self, p: ParamPlan, kept: list[RawTensor], rows: list[RawTensor], path: Path, key: str) -> int:
        """``param`` from the ``kept`` fragments, and the trimmed vocabulary rows from ``rows`` (if any)."""
        parts = [*kept, *rows]
        if self.fast and parts and all(t.dtype == parts[0].dtype for t in parts):
            dtype = parts[0].dtype
            rows_spec = TensorSpec(dtype, p.padded_rows_shape) if p.padded_rows_shape is not None else None
            entry = universal_entry(p, TensorSpec(dtype, p.out_shape), rows_spec)
            pieces = [[t.bytes_view() for t in kept]] + ([[t.bytes_view() for t in rows]] if rows_spec else [])
            kept_numel = sum(t.numel() for t in kept)
            sums = [integrity.StreamingSum(dtype.itemsize)] + (
                [integrity.StreamingSum(dtype.itemsize, kept_numel)] if rows_spec else [])
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
                try:
                    size = write_tensors_file(path, entry, pieces, fd=fd, observers=[s.update for s in sums])
                    osio.start_writeback(fd)
                finally:
                    os.close(fd)
                self._record(key, sums)
                return size
            except FastWriterUnsupported:
                pass
            except OSError as exc:
                raise UcpError(f"{path}: write failed: {exc.strerror or exc}", subject=path) from exc
        # what the direct writer refuses: assembled in memory, torch.save
        tensor = assemble_items_torch(p.kept_items, p.out_shape, kept)
        padded = (assemble_items_torch(p.padded_rows_items, p.padded_rows_shape, rows)
                  if p.padded_rows_shape is not None else None)
        sums = [integrity.StreamingSum(tensor.element_size())]
        sums[0].update(tensor_bytes(tensor))
        if padded is not None:
            sums.append(integrity.StreamingSum(padded.element_size(), tensor.numel()))
            sums[1].update(tensor_bytes(padded))
        self._record(key, sums)
        return _save(universal_entry(p, tensor, padded), path, durable=False)

    def add_pending(self, paths: Iterable[Path]) -> None:
        """Files written elsewhere that :meth:`make_durable` must fsync too."""
        with self._lock:
            self._pending.extend(paths)

    def make_durable(self) -> None:
        """fsync every file written (their writeback started as each was finished).

        Several at a time: the file system commits concurrent fsyncs together, and the disk
        queue stays full; one after the other, each would wait for its own journal commit.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        # then the folders holding them (their entries), so the commit's directory pass finds them clean
        pending += sorted({p.parent for p in pending}, key=str)

        def sync(path: Path) -> None:
            try:
                osio.fsync_file(path)
            except OSError as exc:
                raise UcpError(f"{path}: fsync failed: {exc.strerror or exc}", subject=path) from exc

        files = [p for p in pending if not p.is_dir()]
        folders = [p for p in pending if p.is_dir()]
        for batch in (files, folders):
            if len(batch) <= 1:
                for path in batch:
                    sync(path)
                continue
            with ThreadPoolExecutor(max_workers=min(FSYNC_THREADS, len(batch)), thread_name_prefix="ucp-fsync") as pool:
                for _ in pool.map(sync, batch):
                    pass


def _write_chunk(chunk: _Chunk, writer: "_Writer", on_param: Optional[Callable[[int], None]] = None) -> int:
    """Write every state of the chunk's parameters; returns bytes written."""
    written = 0
    for p in chunk.params:
        if writer.stop.is_set():
            break
        nbytes = writer.write_param(p, chunk.groups[p.group], chunk.steps[p.group], chunk.zero_dir)
        written += nbytes
        if on_param is not None:
            on_param(nbytes)
    return written


def _group_steps(meta: CheckpointMeta, plan: ConversionPlan, cache: RankFileCache) -> tuple[Any, ...]:
    """The optimizer step of each group (rank 0's object); every rank must agree (they step together)."""
    first = cache.get(0)
    steps = []
    for g in plan.groups:
        value = first.step(g.index)
        for r in range(1, meta.dp):
            if meta.steps[r][g.index] != meta.steps[0][g.index]:
                raise CheckpointFormatError(f"{meta.files.rank_files[r]}: optimizer step {meta.steps[r][g.index]} of "
                                            f"param group {g.index} differs from rank 0's {meta.steps[0][g.index]}",
                                            subject=meta.files.rank_files[r])
        steps.append(value)
    return tuple(steps)


def _frozen_params(meta: CheckpointMeta, plan: ConversionPlan) -> dict[str, RawTensor]:
    """Module parameters the optimizer does not hold (frozen): stock writes their fp32 too."""
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
    return out


def _model_files(meta: CheckpointMeta) -> list[Path]:
    return [src for src in sorted(meta.files.tag_dir.iterdir()) if F.MODEL_FILE_RE.match(src.name)]


def _copy_model_files(meta: CheckpointMeta, staging: Staging) -> list[Path]:
    """Copy the model-states file(s) into the output (kernel-side copy), writeback started, not fsynced."""
    copies = []
    for src in _model_files(meta):
        dest = staging.path / src.name
        try:
            shutil.copyfile(src, dest)
        except OSError as exc:  # the kernel copy reports the source's name even for a write failure
            if not os.access(src, os.R_OK):
                raise UcpError(f"{src}: cannot read: {exc.strerror or exc}", subject=src) from exc
            raise UcpError(f"{dest}: write failed while copying {src.name}: {exc.strerror or exc}",
                           subject=dest) from exc
        with open(dest, "rb") as fh:
            osio.start_writeback(fh.fileno())
        copies.append(dest)
    return copies


def _write_common(staging: Staging, meta: CheckpointMeta, plan: ConversionPlan, cache: RankFileCache,
                  model_files_copied: bool) -> list[str]:
    """optimizer_state.pt, the model-states file(s) unless already copied, and fp32 of frozen parameters."""
    common = cache.get(0).common_state()
    _save(common, staging.path / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE)
    if not model_files_copied:
        for dest in _copy_model_files(meta, staging):
            osio.fsync_file(dest)
    frozen = _frozen_params(meta, plan)
    for name, tensor in frozen.items():
        folder = staging.path / F.UNIVERSAL_ZERO_DIR / name
        folder.mkdir(parents=True, exist_ok=True)
        _save({F.PARAM: _as_fp32(tensor)}, folder / f"{F.FP32_STATE}.pt")
    return sorted(frozen)


def _as_fp32(tensor: RawTensor) -> Any:
    """fp32 of a frozen parameter (a torch tensor when it must be converted: torch does the rounding)."""
    if tensor.dtype.name == "float32" and tensor.is_contiguous():
        return tensor
    return tensor.to_torch().float().clone()


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


def _latest_applies(ck: ResolvedCheckpoint, output: Path, options: ConvertOptions) -> bool:
    if options.update_latest is False:
        return False
    return ck.root is not None and output.parent.resolve() == ck.root.resolve()


def _repair_interrupted(ck: ResolvedCheckpoint, output: Path, options: ConvertOptions) -> list[str]:
    """What an interrupted earlier run left next to a complete output, undone; one line each.

    A ``--force`` run killed mid-way leaves its dead staging folder (the size of a conversion); a
    run killed between the commit rename and ``latest_universal`` leaves no pointer. Both are
    repaired by the next ``convert`` of the tag, without reconverting.
    """
    done = []
    info = inspect_staging(output)
    if info is not None and not info.is_live(options.stale_after):
        shutil.rmtree(info.path, ignore_errors=True)
        if not info.path.exists():
            done.append(f"removed {info.path.name}, left by an interrupted earlier run")
    if _latest_applies(ck, output, options) and not (ck.root / F.LATEST_UNIVERSAL).exists():
        write_latest_universal(ck.root, output.name)
        done.append(f"{F.LATEST_UNIVERSAL} was missing and now names it")
    for line in done:
        log.info("%s: %s", output, line)
    return done


def check_torch_loadable(files: CheckpointFiles) -> None:
    """The model-states file is copied into the output as it is, and DeepSpeed's loader reads it with
    ``torch.load``: damage torch rejects is an error here, not a "complete" folder that cannot load.
    Rank files are only read by this converter (tolerantly, correctly): the reader warns about their
    damage (a native DeepSpeed load of this tag would fail) as it reads their headers anyway."""
    problems = structure_problems(files.model_states)
    if problems:
        raise CheckpointFormatError(f"{files.model_states}: damaged ({problems[0]}"
                                    + (f"; {len(problems) - 1} more" if len(problems) > 1 else "")
                                    + "): torch.load, which DeepSpeed's loader uses, rejects it; the universal folder "
                                    "would carry it", subject=files.model_states)


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


def _manifest(meta: CheckpointMeta, ck: ResolvedCheckpoint, plan: ConversionPlan, frozen: Sequence[str],
              shares: Sequence[dict], seconds: float, identity: dict) -> dict:
    sums = _merged_sums(plan, shares)
    return {
        "format": F.MANIFEST_FORMAT,
        "version": F.MANIFEST_VERSION,
        "tool": f"megatron-ucp {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "source": {"tag": ck.tag, "path": str(meta.files.tag_dir.resolve()), "dp": meta.dp, "optimizer": meta.kind,
                   "ds_version": meta.ds_version, "zero_stage": meta.zero_stage,
                   "saved_with_megatron_ucp": meta.saved_with_ucp},
        "source_files": identity,
        "plan_fingerprint": plan.fingerprint(),
        "groups": [{"index": g.index, "numel": g.geometry.numel, "partition_size": g.geometry.partition_size,
                    "states": list(g.states), "step": g.has_step} for g in plan.groups],
        "params": {p.name: {"group": p.group, "shape": list(p.out_shape), "source_shape": list(p.shape)}
                   for p in plan.params},
        "frozen_params": list(frozen),
        **({"checksums": sums} if sums is not None else {}),
        "bytes": sum(int(s.get("bytes", 0)) for s in shares),
        "shares": len(shares),
        "seconds": round(seconds, 3),
    }


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert one tag (or this share of it); see the module docstring for the sequence."""
    t0 = time.perf_counter()
    ck = resolve_checkpoint(options.source, options.tag)
    output = Path(options.output) if options.output is not None else default_output(ck)
    check_output_placement(output, [ck.tag_dir])  # --force replaces the output: never a source
    if output.exists() and not output.is_dir():
        raise UcpError(f"{output}: exists and is not a folder; choose another --output", subject=output)
    pointer = ck.root / F.LATEST_UNIVERSAL if ck.root is not None else None
    pointer_kind = special_kind(pointer) if pointer is not None and _latest_applies(ck, output, options) else None
    if pointer_kind is not None:
        raise UcpError(f"{pointer}: is {pointer_kind}, not a tag file; remove it (or pass --no-latest) "
                       "before converting", subject=pointer)
    files = find_checkpoint_files(ck.tag_dir)
    identity = source_identity([files.model_states, *files.rank_files])  # before reading: what this converts
    state = universal_state(output)
    stale = stale_reason(output, ck.tag_dir, current=identity) if state == COMPLETE else None
    if stale is not None:
        state = STALE
    force = options.force or (state == STALE and options.replace_stale)
    if state == STALE and not force:
        raise OutputExistsError(f"{output}: exists but is stale: {stale}; pass --force to reconvert it", subject=output)
    if state != "absent" and not force:
        if state == COMPLETE and options.share_count > 1:
            return ConvertResult(output=output, tag=ck.tag, committed=False, params=0, states=0, bytes_written=0,
                                 seconds=0.0, source_dp=0, optimizer="", share_index=options.share_index,
                                 share_count=options.share_count, skipped=True,
                                 summary=f"{output} is already complete")
        repaired = _repair_interrupted(ck, output, options) if state == COMPLETE else []
        raise OutputExistsError(f"{output}: already exists ({state}{'; ' + '; '.join(repaired) if repaired else ''}); "
                                "pass --force to replace it", subject=output)
    if not output.parent.is_dir():
        raise UcpError(f"{output.parent}: output's parent folder does not exist", subject=output.parent)
    if not os.access(output.parent, os.W_OK):
        raise UcpError(f"{output.parent}: not writable", subject=output.parent)

    # Each rank file is opened (mapped, metadata unpickled) once: the metadata pass, the step check,
    # the writers and the common state all use the same cached objects.
    check_torch_loadable(files)
    cache = RankFileCache(list(files.rank_files))
    meta = read_checkpoint(ck.tag_dir, rank_files=[cache.get(r) for r in range(len(files.rank_files))])
    plan = plan_checkpoint(meta)
    steps = _group_steps(meta, plan, cache)
    mine = share_of(plan, options.share_index, options.share_count)
    try:
        staging = Staging(output, plan.fingerprint(), options.share_index, options.share_count, options.attempt_id,
                          options.stale_after).open()
    except OSError as exc:
        raise UcpError(f"{exc.filename or output.parent}: cannot create the staging folder: {exc.strerror}",
                       subject=output) from exc
    log.info("converting %s (DP=%d, %s, DeepSpeed %s): %d params, share %d/%d -> %s", ck.tag_dir, meta.dp, meta.kind,
             meta.ds_version, len(mine), options.share_index + 1, options.share_count, output)
    try:
        written, sums = _write_params(mine, plan, steps, meta, staging, options, cache)
        staging.mark_share_done({"share": options.share_index, "params": len(mine), "bytes": written,
                                 "host": socket.gethostname(), "pid": os.getpid(), "checksums": sums})
        committed = False
        if staging.claim_commit():
            frozen = _write_common(staging, meta, plan, cache, model_files_copied=options.share_count == 1)
            if options.verify_complete:
                check_complete(staging.path, plan, frozen)
            shares = staging.shares_done()
            staging.close()
            staging.commit(_manifest(meta, ck, plan, frozen, shares, time.perf_counter() - t0, identity), force)
            committed = True
            update = options.update_latest
            if update is None:
                update = ck.root is not None and output.parent.resolve() == ck.root.resolve()
            if update:
                if ck.root is None or output.parent.resolve() != ck.root.resolve():
                    log.warning("not updating latest_universal: output %s is not in the checkpoint root", output)
                else:
                    _move_latest_universal(ck.root, output)
    except OSError as exc:
        _abandon(staging, options, exc)
        raise UcpError(f"{exc.filename or staging.path}: {exc.strerror or exc}", subject=exc.filename) from exc
    except BaseException as exc:
        _abandon(staging, options, exc)
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


def _move_latest_universal(root: Path, output: Path) -> None:
    """Point ``latest_universal`` at ``output`` unless it already names a newer complete folder."""
    from .background import should_update_latest

    current = latest_universal_target(root)
    if should_update_latest((output.name, (output / F.MANIFEST_FILE).stat().st_mtime), current):
        write_latest_universal(root, output.name)
    else:
        log.info("latest_universal left at the newer %s (converted the older %s)", current[0], output.name)


def _abandon(staging: Staging, options: ConvertOptions, exc: BaseException) -> None:
    """A single converter removes its staging folder; a share leaves a failure note for the others."""
    if options.share_count == 1:
        staging.discard()
    else:
        staging.mark_share_failed(f"{type(exc).__name__}: {exc}")
        staging.close()


def _write_params(mine: Sequence[ParamPlan], plan: ConversionPlan, steps: tuple, meta: CheckpointMeta,
                  staging: Staging, options: ConvertOptions, cache: RankFileCache) -> tuple[int, dict]:
    """Write this share's parameters with ``options.workers`` threads over contiguous, byte-balanced chunks;
    return the bytes written and the state files' checksums (:attr:`_Writer.sums`).

    Threads, not processes: the work is system calls (write, madvise, fsync) and zlib's CRC, all of
    which release the GIL, so threads overlap as well as processes would, without starting
    interpreters (seconds on a small machine). Memory: each thread holds the pages of the
    parameter it is writing, nothing more (see :class:`_Writer`). A single converter (one share)
    also copies the model-states file(s) beside the writers, so that copy (~15% of the bytes of a
    checkpoint, fsynced with the rest) does not wait for the commit.
    """
    per_group = {g.index: len(g.states) for g in plan.groups}
    total = sum(p.out_numel * per_group[p.group] * 4 for p in mine)
    workers = max(1, min(options.workers, len(mine)))
    parts = 1 if workers == 1 else workers * 4
    zero_dir = str(staging.path / F.UNIVERSAL_ZERO_DIR)
    chunks = [_Chunk(params=tuple(ps), groups=plan.groups, steps=steps, zero_dir=zero_dir)
              for ps in split_by_bytes(mine, parts, per_group) if ps]
    writer = _Writer(cache, fast=not torch_save_forced())
    prefetch = [meta.files.model_states] if options.share_count == 1 else []  # the committer copies it
    prefetch += [meta.files.rank_files[r] for r in sorted({i.rank for p in mine for i in p.items})]
    threading.Thread(target=osio.read_ahead, args=(prefetch,), name="ucp-readahead", daemon=True).start()
    if not writer.fast:
        log.info("writing with torch.save (MEGATRON_UCP_TORCH_SAVE=1)")
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"convert {meta.files.tag_dir.name}",
               disable=not options.progress, leave=False)
    written = 0
    done = 0
    lock = threading.Lock()

    def advance(nbytes: int) -> None:
        nonlocal done
        with lock:
            bar.update(nbytes)
            done += nbytes
            if options.on_progress is not None:
                options.on_progress(done, total)

    copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-model-copy")
    model_copy = copier.submit(_copy_model_files, meta, staging) if options.share_count == 1 else None
    try:
        if workers == 1:
            for chunk in chunks:
                written += _write_chunk(chunk, writer, on_param=advance)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ucp-writer") as pool:
                futures = [pool.submit(_write_chunk, chunk, writer, advance) for chunk in chunks]
                try:
                    for fut in as_completed(futures):
                        written += fut.result()
                except BaseException:
                    writer.stop.set()
                    for fut in futures:
                        fut.cancel()
                    raise
        if model_copy is not None:
            writer.add_pending(model_copy.result())
        writer.make_durable()
    finally:
        copier.shutdown(wait=True)  # never leave it writing into a staging folder being discarded
        bar.close()
    return written, dict(writer.sums)
