"""Write ``torch.save`` files without torch: straight from memory-mapped fragments (the hot path).

``torch.save`` needs the tensor in one contiguous buffer, so a parameter whose elements live in
several rank files must first be assembled (one extra copy of every byte) and then goes through
torch's writer; and importing torch costs more than converting a 1.4 GB checkpoint. This module
writes torch's zip format itself:

* :func:`write_tensor_file`: a universal entry (``{"param": tensor, "cat_dim": ...}``) whose tensor
  is given as ``pieces``, buffers (memoryviews of mapped rank-file bytes) written in order with
  ``os.write``: the only copy is the kernel's, into the page cache; the CRC-32 is computed on the
  way (zlib, the GIL released). Nothing is assembled, so memory does not grow with the parameter.
* :func:`save_object`: any picklable object whose tensors are :class:`~megatron_ucp.format.rawtensor.RawTensor`
  (the step, the common optimizer state); each tensor is written as a storage of its own, as
  ``torch.save`` writes a ``clone()``.

The output is byte-for-byte what ``torch.save`` writes for the same object with torch 2.13 (the
tests prove it against the installed torch: :func:`matches_torch_save`), except the 40-digit
``.data/serialization_id`` record (torch derives it internally; readers only log it). torch >= 1.6
reads the format. Files of 4 GB or more (zip64 record fields) and empty tensors are refused
(:class:`FastWriterUnsupported`): callers fall back to ``torch.save``.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import struct
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_ucp.format.lightpickle import Pickler as _LightPickler
from megatron_ucp.format.lightpickle import stand_in_class
from megatron_ucp.format.rawtensor import DTYPES, DType, RawTensor, contiguous_stride, from_torch

log = logging.getLogger(__name__)

ALIGNMENT = 64
"""torch's storage alignment (``torch.utils.serialization.config.save.storage_alignment``)."""
_CHUNK = 1 << 20
"""CRC and write in pieces this large, so the bytes the CRC just read are still in cache."""
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 16)
_PROTOCOL = 2
"""torch.save's pickle protocol."""

_LFH = struct.Struct("<IHHHHHIIIHH")  # local file header
_DD = struct.Struct("<IIII")  # data descriptor (crc, sizes)
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names (what torch's miniz writer sets)


class FastWriterUnsupported(ValueError):
    """A file this writer does not produce (zip64 sizes, an empty tensor's record): use torch.save."""


def as_dtype(dtype: Any) -> DType:
    """A :class:`DType` from itself, a ``torch.dtype`` or its name."""
    if isinstance(dtype, DType):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise FastWriterUnsupported(f"dtype {dtype} is not supported")
    return DTYPES[name]


class TensorSpec:
    """Stands for the tensor of an entry: dtype and shape only (the bytes come as ``pieces``)."""

    def __init__(self, dtype: Any, shape: Sequence[int]):
        self.dtype = as_dtype(dtype)
        self.shape = tuple(int(d) for d in shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class _StorageRecord:
    """A storage to write: its key, dtype, element count, and its bytes (None: given as pieces)."""

    def __init__(self, key: str, dtype: DType, numel: int, data: Optional[memoryview]):
        self.key, self.dtype, self.numel, self.data = key, dtype, numel, data


_REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")


class _TorchPickler(_LightPickler):
    """Pickles like ``torch.save``: tensors as ``_rebuild_tensor_v2`` over numbered storage records."""

    def __init__(self, file: Any):
        super().__init__(file, protocol=_PROTOCOL)
        self.storages: list[_StorageRecord] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorSpec):
            record = self._add(obj.dtype, obj.numel, None)
        elif isinstance(obj, RawTensor):
            if not obj.is_contiguous():
                raise FastWriterUnsupported("a non-contiguous tensor")
            record = self._add(obj.dtype, obj.numel(), obj.bytes_view())
        elif _is_torch_tensor(obj):
            raise FastWriterUnsupported("a torch.Tensor (torch.save writes those)")
        else:
            return NotImplemented
        return (
            stand_in_class(*_REBUILD_TENSOR),
            (record, 0, obj.shape, contiguous_stride(obj.shape), False, collections.OrderedDict()),
        )

    def _add(self, dtype: DType, numel: int, data: Optional[memoryview]) -> _StorageRecord:
        record = _StorageRecord(str(len(self.storages)), dtype, numel, data)
        self.storages.append(record)
        return record

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRecord):
            return ("storage", stand_in_class("torch", obj.dtype.storage), obj.key, "cpu", obj.numel)
        return None


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_tensor(obj)


def _pickle(obj: Any) -> tuple[bytes, list[_StorageRecord]]:
    buf = _BytesSink()
    pickler = _TorchPickler(buf)
    pickler.dump(obj)
    return buf.value(), pickler.storages


class _BytesSink:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def value(self) -> bytes:
        return b"".join(self.parts)


def archive_name(path: Path) -> str:
    """The record prefix torch.save uses for a file path: its name without the last extension."""
    name = Path(path).name
    return name.rsplit(".", 1)[0] if "." in name else name


def _local_header(prefix: str, name: str, cursor: int) -> bytes:
    full = f"{prefix}/{name}".encode("utf-8")
    start = cursor + _LFH.size + len(full) + 4
    pad = (-start) % ALIGNMENT
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return _LFH.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra


class _Archive:
    """Record bookkeeping for one file; the caller writes the bytes in order."""

    def __init__(self, prefix: str, crc: bool):
        self.prefix = prefix
        self.crc = crc
        self.cursor = 0
        self.records: list[tuple[bytes, int, int, int]] = []  # (full name, header offset, crc, size)

    def small(self, name: str, data: bytes) -> bytes:
        head = _local_header(self.prefix, name, self.cursor)
        crc = zlib.crc32(data) if self.crc else 0
        out = head + data + _DD.pack(0x08074B50, crc, len(data), len(data))
        self.records.append((f"{self.prefix}/{name}".encode(), self.cursor, crc, len(data)))
        self.cursor += len(out)
        return out

    def open_large(self, name: str) -> bytes:
        head = _local_header(self.prefix, name, self.cursor)
        self._large = (f"{self.prefix}/{name}".encode(), self.cursor)
        self.cursor += len(head)
        return head

    def close_large(self, crc: int, size: int) -> bytes:
        name, offset = self._large
        crc = crc if self.crc else 0
        self.records.append((name, offset, crc, size))
        self.cursor += size + _DD.size
        return _DD.pack(0x08074B50, crc, size, size)

    def directory(self) -> bytes:
        cd = b"".join(
            _CDH.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset) + name
            for name, offset, crc, size in self.records
        )
        cd_offset, n = self.cursor, len(self.records)
        eocd64_offset = cd_offset + len(cd)
        return (
            cd
            + _EOCD64.pack(0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, len(cd), cd_offset)
            + _EOCD64_LOCATOR.pack(0x07064B50, 0, eocd64_offset, 1)
            + _EOCD.pack(0x06054B50, 0, 0, n, n, len(cd), cd_offset, 0)
        )


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _serialization_id(pkl: bytes, crcs: Sequence[int], size: int) -> bytes:
    digest = hashlib.blake2b(
        pkl + b"".join(struct.pack("<I", c) for c in crcs) + struct.pack("<Q", size), digest_size=16
    ).digest()
    return f"{int.from_bytes(digest, 'little') % 10**40:040d}".encode()


def _check_sizes(path: Path, records: Sequence[_StorageRecord], pkl: bytes) -> None:
    total = sum(r.numel * r.dtype.itemsize for r in records) + len(pkl)
    if total + 8192 + 128 * len(records) > _ZIP32_LIMIT:
        raise FastWriterUnsupported(f"{path}: {total} bytes needs zip64 fields")
    if any(r.numel == 0 for r in records):  # torch writes an empty record without a data descriptor
        raise FastWriterUnsupported(f"{path}: empty tensor")


def _write_file(
    path: Path,
    pkl: bytes,
    storages: Sequence[Sequence[memoryview]],
    fd: Optional[int],
    crc: bool,
    serialization_id: Optional[bytes],
    observers: Optional[Sequence[Callable[[memoryview], None]]] = None,
) -> int:
    """The records of a torch file, in torch.save's order; storage ``i``'s bytes are ``storages[i]``.
    ``observers[i]`` sees storage ``i``'s bytes chunk by chunk, in order, while they are in the CPU cache."""
    arc = _Archive(archive_name(path), crc)
    head = b"".join(
        (
            arc.small("data.pkl", pkl),
            arc.small(".format_version", b"1"),
            arc.small(".storage_alignment", str(ALIGNMENT).encode()),
            arc.small("byteorder", b"little"),
        )
    )
    own = fd is None
    if own:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        crcs, total = [], 0
        for key, pieces in enumerate(storages):
            head += arc.open_large(f"data/{key}")
            _write_all(fd, head)
            value = size = 0
            observe = observers[key] if observers is not None else None
            for piece in pieces:
                for start in range(0, len(piece), _CHUNK):
                    part = piece[start : start + _CHUNK]
                    if crc:
                        value = zlib.crc32(part, value)
                    if observe is not None:
                        observe(part)
                    _write_all(fd, part)
                size += len(piece)
            head = arc.close_large(value, size)
            crcs.append(value)
            total += size
        tail = head + arc.small("version", b"3\n")
        sid = serialization_id if serialization_id is not None else _serialization_id(pkl, crcs, total)
        tail += arc.small(".data/serialization_id", sid)
        directory = arc.directory()
        _write_all(fd, tail + directory)
    finally:
        if own:
            os.close(fd)
    return arc.cursor + len(directory)


def write_tensor_file(
    path: os.PathLike | str,
    entry: dict,
    pieces: Iterable[Any],
    *,
    fd: Optional[int] = None,
    crc: bool = True,
    serialization_id: Optional[bytes] = None,
) -> int:
    """Write ``torch.save(entry, path)`` where the entry's one :class:`TensorSpec` holds ``pieces`` in order.

    ``pieces`` are buffers (memoryviews of mapped rank-file bytes); their total length must be the
    tensor's byte size. Writes to ``fd`` when given (positioned at 0, left open), else creates the
    file. Returns the file size. Not durable by itself: the caller fsyncs.
    """
    return write_tensors_file(path, entry, [pieces], fd=fd, crc=crc, serialization_id=serialization_id)


def write_tensors_file(
    path: os.PathLike | str,
    entry: dict,
    pieces: Sequence[Iterable[Any]],
    *,
    fd: Optional[int] = None,
    crc: bool = True,
    serialization_id: Optional[bytes] = None,
    observers: Optional[Sequence[Callable[[memoryview], None]]] = None,
) -> int:
    """:func:`write_tensor_file` for an entry with several :class:`TensorSpec` values: ``pieces[i]``
    holds the bytes of the i-th one in the entry's order (the order ``torch.save`` writes them);
    ``observers[i]``, when given, is called with those bytes chunk by chunk as they are written."""
    path = Path(path)
    specs = [v for v in entry.values() if isinstance(v, TensorSpec)]
    if not specs or len(specs) != len(pieces):
        raise ValueError(f"entry holds {len(specs)} TensorSpec values, {len(pieces)} piece lists given")
    views = []
    for spec, parts in zip(specs, pieces):
        parts = [memoryview(p).cast("B") for p in parts]
        size = sum(len(p) for p in parts)
        if size != spec.nbytes:
            raise ValueError(
                f"{path}: pieces hold {size} bytes, the tensor {spec.shape} {spec.dtype} needs {spec.nbytes}"
            )
        views.append(parts)
    if observers is not None and len(observers) != len(views):
        raise ValueError(f"{len(observers)} observers for {len(views)} tensors")
    pkl, records = _pickle(entry)
    _check_sizes(path, records, pkl)
    return _write_file(path, pkl, views, fd, crc, serialization_id, observers)


def save_object(obj: Any, path: os.PathLike | str, *, fd: Optional[int] = None) -> int:
    """``torch.save(obj, path)`` for objects whose tensors are :class:`RawTensor` (each its own storage).

    DeepSpeed stand-ins (:mod:`megatron_ucp.format.lightpickle`) pickle back as the original classes.
    Returns the file size; not durable by itself.
    """
    path = Path(path)
    pkl, records = _pickle(obj)
    _check_sizes(path, records, pkl)
    return _write_file(path, pkl, [[r.data] for r in records], fd, True, None)


def tensor_bytes(t: Any) -> memoryview:
    """The bytes of a contiguous :class:`RawTensor` or CPU ``torch.Tensor``, without a copy."""
    if isinstance(t, RawTensor):
        return t.bytes_view()
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    import torch

    return memoryview(t.view(torch.uint8).numpy()) if t.dtype != torch.uint8 else memoryview(t.numpy())


# --- proof against torch.save (tests; diagnostics) -----------------------------------------------
def _serialization_id_of(path: Path) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".data/serialization_id"))
        return z.read(name)


@functools.lru_cache(maxsize=None)
def matches_torch_save() -> bool:
    """Whether this module writes the installed torch's ``torch.save`` bytes (imports torch)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g)
    b = torch.randn(129, generator=g)
    c = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    samples = [
        ("fp32.pt", {"param": a, "cat_dim": 0}),
        ("exp_avg_sq.pt", {"param": b, "cat_dim": 0, "vocab_tensor": True}),
        ("exp_avg.pt", {"param": c, "cat_dim": 1, "param_n_sub_params": 2}),
        ("step.pt", torch.tensor(7.0)),
    ]
    with tempfile.TemporaryDirectory(prefix="megatron-ucp-selfcheck-") as tmp:
        for i, (name, obj) in enumerate(samples):
            ref, ours = Path(tmp) / f"ref{i}" / name, Path(tmp) / f"ours{i}" / name
            ref.parent.mkdir()
            ours.parent.mkdir()
            torch.save(obj, ref)
            sid = _serialization_id_of(ref)
            if isinstance(obj, dict):
                t = obj["param"]
                entry = {k: (TensorSpec(v.dtype, v.shape) if v is t else v) for k, v in obj.items()}
                write_tensor_file(ours, entry, [tensor_bytes(t)], serialization_id=sid)
            else:
                pkl, records = _pickle(from_torch(obj))
                _write_file(ours, pkl, [[r.data] for r in records], None, True, sid)
            if ref.read_bytes() != ours.read_bytes():
                log.info("the direct writer's %s differs from torch %s's torch.save", name, torch.__version__)
                return False
    return True
