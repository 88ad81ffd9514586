"""Write one share's state files straight from the memory-mapped rank files.

:class:`RankFileCache` keeps each rank file open and mapped once; :func:`state_fragments` picks a
parameter's fragments of one state out of them; :class:`Writer` writes each state file once with
:func:`megatron_ucp.format.torchfile.write_tensors_file` (the bytes ``torch.save`` would write,
without assembling the tensor), computing the manifest checksum as the bytes pass, and
``torch.save`` of the assembled tensor (:func:`assemble_torch`) for what the direct writer
refuses. Files are fsynced together at the end (:meth:`Writer.make_durable`).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_ucp.deepspeed.reader import RankFile, Stage3RankFile, open_rank_file
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import integrity, osio
from megatron_ucp.format.lightpickle import PICKLE_MODULE, needs_light_pickler
from megatron_ucp.format.rawtensor import RawTensor, torch_tensors_from_raw
from megatron_ucp.format.torchfile import (
    FastWriterUnsupported,
    TensorSpec,
    save_object,
    tensor_bytes,
    write_tensors_file,
)
from megatron_ucp.plan.conversion import CopyItem, GroupPlan, ParamPlan


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
        self.capacity = (
            capacity if capacity is not None else max(16, min(len(self.paths), 4096, _descriptors_for(len(self.paths))))
        )
        self._open: OrderedDict[int, RankFile | Stage3RankFile] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rank: int) -> RankFile | Stage3RankFile:
        with self._lock:
            rf = self._open.get(rank)
            if rf is None:
                rf = open_rank_file(self.paths[rank], rank)
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


def save_file(obj: Any, path: Path, durable: bool = True) -> int:
    """Write ``obj`` as ``torch.save`` would (+ fsync when ``durable``); a failed write names the file.

    Tensors are :class:`RawTensor`; the direct writer handles them without torch, and torch.save
    (imported here) the rest. Objects read while DeepSpeed was not imported may hold stand-ins for
    DeepSpeed classes (:mod:`megatron_ucp.format.lightpickle`); both write them back as the originals.
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
    vocabulary rows, when there are any, under :data:`~megatron_ucp.format.dsformat.VOCAB_PADDED_ROWS`."""
    entry: dict[str, Any] = {F.PARAM: tensor, F.CAT_DIM: p.cat_dim}
    if p.vocab_tensor:
        entry[F.VOCAB_TENSOR] = True
    if p.vocab_whole:
        entry[F.VOCAB_ROWS_WHOLE] = True
    if p.n_sub_params > 1:
        entry[F.PARAM_N_SUB_PARAMS] = p.n_sub_params
    if padded_rows is not None:
        entry[F.VOCAB_PADDED_ROWS] = padded_rows
    return entry


def state_fragments(
    p: ParamPlan, state: str, cache: RankFileCache, items: Optional[Sequence[CopyItem]] = None
) -> list[RawTensor]:
    """The source fragments of one state of one parameter, in ``items`` order (default: all of
    ``p.items``; views, no copy)."""
    return [
        cache.get(item.rank)
        .state_tensor(p.group if item.group is None else item.group, state)
        .narrow(0, item.src_offset, item.length)
        for item in (p.items if items is None else items)
    ]


def prefetch(fragments: Sequence[RawTensor]) -> None:
    """Readahead for the mapped fragments about to be read (cold caches)."""
    for t in fragments:
        if t.storage.mapped:
            osio.will_need(t.data_ptr(), t.nbytes)


def release(fragments: Sequence[RawTensor]) -> None:
    """This process is done with these mapped pages: out of its RSS (they stay in the page cache)."""
    for t in fragments:
        if t.storage.mapped:
            osio.done_with(t.data_ptr(), t.nbytes, t.storage.region)


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
    rows = assemble_items_torch(
        p.padded_rows_items, p.padded_rows_shape, state_fragments(p, state, cache, p.padded_rows_items)
    )
    return kept, rows


@dataclass(frozen=True)
class Chunk:
    params: tuple[ParamPlan, ...]
    groups: tuple[GroupPlan, ...]
    steps: tuple[Any, ...]
    zero_dir: str


ReadObserver = Callable[[ParamPlan, str, Sequence[CopyItem], Sequence[RawTensor]], None]
"""Told what was read: a parameter, a state, the items and their fragments."""

FSYNC_THREADS = 8
"""Concurrent fsyncs at the end of a share (see :meth:`Writer.make_durable`)."""


class Writer:
    """Writes parameters' state files: fragments straight from the mapped rank files to disk.

    Shared by the writer threads of one converter: :meth:`write_param` is thread-safe. Files are
    not fsynced one by one (each fsync would wait for the disk before the next file starts):
    writeback is started as each file is finished and :meth:`make_durable` fsyncs them at the end.
    """

    def __init__(self, cache: RankFileCache, fast: bool = True, on_read: Optional[ReadObserver] = None):
        self.cache = cache
        self.fast = fast
        self.on_read = on_read
        """Told each parameter's fragments of each state after they are written, while their pages are still
        mapped (the save check sums them: :class:`megatron_ucp.convert.save_check.PartitionSums`)."""
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[Path] = []
        self.sums: dict[str, dict[str, int]] = {}
        """``"<param>/<state>"`` -> the file's elements and :mod:`~megatron_ucp.format.integrity` checksum,
        computed from the bytes on their way to disk (for the manifest; the loaders verify against it)."""

    def write_param(self, p: ParamPlan, group: GroupPlan, step: Any, zero_dir: str) -> int:
        folder = Path(zero_dir) / p.name
        folder.mkdir(parents=True, exist_ok=True)
        kept_items, rows_items = p.kept_items, p.padded_rows_items
        sources = {
            state: (
                state_fragments(p, state, self.cache, kept_items),
                state_fragments(p, state, self.cache, rows_items),
            )
            for state in group.states
        }
        prefetch([t for kept, rows in sources.values() for t in (*kept, *rows)])
        nbytes = 0
        written: list[Path] = []
        for state in group.states:
            path = folder / f"{state}.pt"
            kept, rows = sources[state]
            nbytes += self._write_state(p, kept, rows, path, f"{p.name}/{state}")
            written.append(path)
            if self.on_read is not None:
                self.on_read(p, state, kept_items, kept)
                self.on_read(p, state, rows_items, rows)
            release((*kept, *rows))
        if group.has_step:
            path = folder / f"{F.STEP_STATE}.pt"
            nbytes += save_file(step, path, durable=False)
            written.append(path)
        with self._lock:
            self._pending.extend(written)
        return nbytes

    def _record(self, key: str, sums: Sequence[integrity.StreamingSum]) -> None:
        """The file's elements and checksums: the tensor, then its kept vocabulary rows (which sit after
        the kept rows in the parameter's flat layout)."""
        entry: dict[str, int] = {}
        for prefix, stream in zip(("", "rows_"), sums):
            entry[f"{prefix}numel"] = stream.numel
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
                [integrity.StreamingSum(dtype.itemsize, kept_numel)] if rows_spec else []
            )
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
        padded = (
            assemble_items_torch(p.padded_rows_items, p.padded_rows_shape, rows)
            if p.padded_rows_shape is not None
            else None
        )
        sums = [integrity.StreamingSum(tensor.element_size())]
        sums[0].update(tensor_bytes(tensor))
        if padded is not None:
            sums.append(integrity.StreamingSum(padded.element_size(), tensor.numel()))
            sums[1].update(tensor_bytes(padded))
        self._record(key, sums)
        return save_file(universal_entry(p, tensor, padded), path, durable=False)

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
                osio.fsync_path(path)
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


def write_chunk(chunk: Chunk, writer: "Writer", on_param: Optional[Callable[[int], None]] = None) -> int:
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
