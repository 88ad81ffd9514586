"""``megatron-ucp export-hf``: a checkpoint as a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

From the fp32 masters of the universal folder (:mod:`~megatron_ucp.export.hf_source`), whatever TP, PP, DP and
ZeRO stage saved them, mapped by :mod:`megatron_ucp.plan.hf_llama`. Streaming: each Hugging Face tensor is a
list of row ranges of one master, read exactly (``preadv``, readahead off) into the shard being built, so the
memory held is one shard (``max_shard_bytes``, or the largest tensor when that is larger), whatever the model's
size. Every master is read whole exactly once across its tensors, and its checksum is compared with the one the
converter recorded: an export never carries a master that changed on disk. Written with the ``safetensors``
library into a staging sibling, committed by rename after ``ucp_export.json`` (written last, like the universal
folder's manifest): a half-written export is never taken for a finished one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from tqdm import tqdm

from megatron_ucp.convert.universal import Staging, write_text_atomic
from megatron_ucp.deepspeed.torch_files import load_raw
from megatron_ucp.errors import CheckpointFormatError, OutputExistsError, UcpError
from megatron_ucp.export.hf_source import UniversalSource, hf_name, universal_source
from megatron_ucp.export.hf_tokenizer import tokenizer_export, write_tokenizer
from megatron_ucp.format import integrity, osio
from megatron_ucp.format.exact_read import RangeReader, file_offset
from megatron_ucp.format.paths import check_output_placement
from megatron_ucp.plan.hf_llama import HfTensor, architecture, hf_tensors, shards
from megatron_ucp.version import __version__

log = logging.getLogger(__name__)
EXPORT_MARKER = "ucp_export.json"
"""Written last into an export: the folder is finished."""
DTYPES = {"bf16": ("bfloat16", 2), "fp32": ("float32", 4)}
DEFAULT_SHARD_BYTES = 2 * 2**30
_CHUNK_ELEMENTS = 4 * 2**20
"""fp32 elements read at a time for a bf16 output (16 MiB)."""


@dataclass(frozen=True)
class ExportOptions:
    source: Path
    """A checkpoint root (tag from ``tag`` or ``latest``), a native tag folder, or a universal folder."""
    tag: Optional[str] = None
    output: Optional[Path] = None
    """Default: ``<root>/<tag>_hf`` beside the tag."""
    dtype: str = "bf16"
    force: bool = False
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    workers: int = 1
    """Writer threads of a conversion the export runs first."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UcpError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.max_shard_bytes < 1:
            raise UcpError(f"the shard size must be positive (got {self.max_shard_bytes})")


@dataclass(frozen=True)
class ExportResult:
    output: Path
    universal: Path
    converted: bool
    tensors: int
    shards: int
    bytes_written: int
    seconds: float
    tokenizer: str

    def summary(self) -> str:
        return (
            f"exported {self.output} ({self.tensors} tensors in {self.shards} shards, "
            f"{self.bytes_written / 2**20:.1f} MiB, {self.seconds:.1f}s) from {self.universal.name}"
            f"{' (converted first)' if self.converted else ''}; {self.tokenizer}"
        )


def bf16_bits(values: np.ndarray, out: Optional[np.ndarray] = None, scratch: Optional[np.ndarray] = None) -> np.ndarray:
    """fp32 -> bf16 bit patterns (into ``out``, uint16), rounded to nearest even as torch's ``.to(torch.bfloat16)``
    rounds (NaN kept a quiet NaN of the same sign). In place through ``scratch`` (uint32, at least as long): no
    temporary arrays, ``values`` untouched."""
    bits = values.view(np.uint32)
    out = np.empty(bits.size, dtype=np.uint16) if out is None else out
    tmp = np.empty(bits.size, dtype=np.uint32) if scratch is None else scratch[: bits.size]
    np.right_shift(bits, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, bits, out=tmp)
    np.right_shift(tmp, 16, out=tmp)
    np.copyto(out, tmp, casting="unsafe")
    if bits.size and np.isnan(np.max(values)):  # a NaN propagates through max: one pass, no mask when there is none
        nan = np.isnan(values)
        out[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return out


class _Masters:
    """The fp32 masters, opened one at a time in the order the tensors ask for them; each master's rows are
    hashed as they pass and checked against the manifest once all of them passed."""

    def __init__(self, source: UniversalSource):
        self.source = source
        self.name: Optional[str] = None
        self.checked = 0
        self.scratch = np.empty(_CHUNK_ELEMENTS, dtype=np.float32)
        """Each piece is read here (the one buffer of a read: no allocation per piece)."""

    def _open(self, name: str) -> None:
        self._finish()
        path = self.source.fp32_file(name)
        self.param = load_raw(path, random_access=True)["param"]
        if self.param.dtype.name != "float32" or not self.param.is_contiguous():
            raise CheckpointFormatError(f"{path}: the master is not a contiguous fp32 tensor", subject=path)
        self.path, self.name = path, name
        self.reader = RangeReader(path)
        self.width = self.param.numel() // max(1, self.param.shape[0])
        self.sum, self.seen = 0, 0

    def rows(self, t: HfTensor) -> Iterator[np.ndarray]:
        """The fp32 values of ``t``'s rows, in pieces of at most ``_CHUNK_ELEMENTS`` (each a view of one buffer,
        overwritten by the next: use it before asking for the next)."""
        if t.source != self.name:
            self._open(t.source)
        step = max(1, _CHUNK_ELEMENTS // self.width)
        if step * self.width > self.scratch.size:  # one row wider than a chunk
            self.scratch = np.empty(step * self.width, dtype=np.float32)
        for start, stop in t.rows:
            for a in range(start, stop, step):
                b = min(stop, a + step)
                out = self.scratch[: (b - a) * self.width]
                offset = file_offset(self.param, a * self.width)
                if offset is None:
                    out[:] = np.frombuffer(self.param.bytes_view(), dtype=np.float32)[a * self.width : b * self.width]
                else:
                    self.reader.read(offset, memoryview(out).cast("B"))
                self.sum = integrity.combine([self.sum, integrity.fragment_sum(out.view(np.uint32), a * self.width)])
                self.seen += out.size
                yield out

    def _finish(self) -> None:
        if self.name is None:
            return
        self.reader.close()
        recorded = self.source.checksums
        record = recorded.files.get(f"{self.name}/fp32") if recorded is not None else None
        if record is None or self.seen != self.param.numel():
            return
        if recorded.algorithm != integrity.ALGORITHM:
            return  # an older folder's algorithm: `megatron-ucp verify` checks it
        if int(record.get("numel", -1)) != self.seen or int(record["sum"]) != self.sum:
            raise CheckpointFormatError(
                f"{self.path}: the fp32 master differs from what the conversion wrote (checksum): "
                "the universal folder changed on disk; nothing was exported",
                subject=self.path,
            )
        self.checked += 1

    def close(self) -> None:
        self._finish()
        self.name = None

    def abandon(self) -> None:
        """Close the open master without judging it (the export failed part-way)."""
        if self.name is not None:
            self.reader.close()
            self.name = None


def _safetensors() -> Any:
    """The ``safetensors`` module (the ``[hf]`` extra; nothing else in the package imports it)."""
    try:
        import safetensors
    except ImportError as exc:
        raise UcpError(f"the Hugging Face export writes with safetensors ({exc}): pip install 'megatron-ucp[hf]'")
    return safetensors


def _write_shard(path: Path, tensors: list[HfTensor], masters: _Masters, dtype: str, bar: Any) -> int:
    """One safetensors file of ``tensors``; bytes written."""
    name, itemsize = DTYPES[dtype]
    buffer = np.empty(sum(t.numel for t in tensors) * itemsize, dtype=np.uint8)
    scratch = np.empty(_CHUNK_ELEMENTS, dtype=np.uint32) if dtype == "bf16" else None
    specs, at = {}, 0
    for t in tensors:
        start = at
        for piece in masters.rows(t):
            nbytes = piece.size * itemsize
            if scratch is not None:
                scratch = scratch if scratch.size >= piece.size else np.empty(piece.size, dtype=np.uint32)
                bf16_bits(piece, buffer[at : at + nbytes].view(np.uint16), scratch)
            else:
                buffer[at : at + nbytes] = piece.view(np.uint8)
            at += nbytes
            bar.update(nbytes)
        specs[t.name] = (list(t.shape), start, at - start)
    _safetensors().serialize_file(_specs(specs, buffer, name), str(path), {"format": "pt"})
    os.chmod(path, 0o644)  # safetensors writes through a private temporary file (0600): readable as every other file
    osio.fsync_path(path)  # durable before the commit, as every file of a universal folder
    return int(path.stat().st_size)


def _specs(specs: dict[str, tuple[list[int], int, int]], buffer: np.ndarray, dtype: str) -> dict[str, Any]:
    """safetensors' description of each tensor in ``buffer``: ``TensorSpec`` pointers (0.8+, no copy) or, for
    the releases before it, dicts holding the bytes."""
    spec = getattr(_safetensors(), "TensorSpec", None)
    if spec is None:
        view = memoryview(buffer)
        return {
            k: {"dtype": dtype, "shape": shape, "data": bytes(view[a : a + n])} for k, (shape, a, n) in specs.items()
        }
    base = buffer.ctypes.data
    return {k: spec(dtype=dtype, shape=shape, data_ptr=base + a, data_len=n) for k, (shape, a, n) in specs.items()}


def export_hf(options: ExportOptions) -> ExportResult:
    """Export one tag (see the module docstring); raises :class:`UcpError` naming what it cannot map or read."""
    started = time.monotonic()
    _safetensors()  # before anything is converted
    source = universal_source(
        options.source,
        options.tag,
        options.workers,
        options.progress,
        check=lambda args, where: architecture(args, None, where),
    )
    output = Path(options.output) if options.output else source.folder.parent / hf_name(source.tag)
    check_output_placement(output, [source.folder])
    if output.exists() and not options.force:
        raise OutputExistsError(f"{output}: already exists; pass --force to replace it", subject=output)
    arch = architecture(source.args, source.original_vocab, str(source.folder))
    tensors = hf_tensors(arch, source.shapes, str(source.folder))
    dtype_name, itemsize = DTYPES[options.dtype]
    groups = shards(tensors, options.max_shard_bytes, itemsize)
    tokenizer = tokenizer_export(source.args, arch.max_positions)
    log.info(
        "export %s: %d layers, hidden %d, %d/%d heads, vocabulary %d%s -> %d tensors in %d shards (%s)",
        source.tag,
        arch.layers,
        arch.hidden,
        arch.heads,
        arch.kv_heads,
        arch.vocab,
        ", tied" if arch.tied else "",
        len(tensors),
        len(groups),
        options.dtype,
    )
    staging = Staging(output, f"hf:{source.folder}:{options.dtype}", content=(), marker=EXPORT_MARKER).open()
    masters = _Masters(source)
    total = sum(t.numel for t in tensors) * itemsize
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"export {source.tag}", disable=not options.progress)
    try:
        weight_map, written = {}, 0
        for i, group in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            written += _write_shard(staging.path / name, group, masters, options.dtype, bar)
            weight_map.update({t.name: name for t in group})
        masters.close()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files = {
            "model.safetensors.index.json": index,
            "config.json": arch.config(dtype_name, tokenizer.token_ids),
            "generation_config.json": {"_from_model_config": True, **tokenizer.token_ids},
        }
        for file_name, content in files.items():
            write_text_atomic(staging.path / file_name, json.dumps(content, indent=2) + "\n")
        tokenizer_files = write_tokenizer(tokenizer, staging.path)
        marker = {
            "megatron_ucp_version": __version__,
            "source": str(source.folder),
            "tag": source.tag,
            "dtype": options.dtype,
            "tensors": len(tensors),
            "shards": len(groups),
            "masters_checked": masters.checked,
            "tokenizer_files": tokenizer_files,
        }
        staging.commit(marker, force=options.force)
    except BaseException:
        masters.abandon()
        staging.discard()
        raise
    finally:
        bar.close()
        staging.close()
    if not masters.checked and source.checksums is not None:
        log.warning("export %s: no master's checksum could be compared (an older folder's algorithm)", source.tag)
    result = ExportResult(
        output=output,
        universal=source.folder,
        converted=source.converted,
        tensors=len(tensors),
        shards=len(groups),
        bytes_written=written,
        seconds=time.monotonic() - started,
        tokenizer=tokenizer.summary,
    )
    log.info("%s", result.summary())
    return result
