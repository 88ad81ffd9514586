"""Write one-tensor ``torch.save`` files straight from memory-mapped fragments (the converter's hot path).

``torch.save`` needs the tensor in one contiguous buffer, so a parameter whose elements live in
several rank files must first be assembled (one extra copy of every byte) and then goes through
torch's writer. :func:`write_tensor_file` writes the same file directly: the small records
(pickle, format markers) are built in memory, the tensor record's bytes are written with
``os.write`` from the fragments themselves (memory-mapped rank files: the only copy is the
kernel's, into the page cache), and its CRC-32 is computed on the way (zlib, the GIL released).
Nothing is assembled, so memory does not grow with the parameter.

The output is byte-for-byte what ``torch.save({...}, path)`` writes for the same dict, except the
40-digit ``.data/serialization_id`` record (torch derives it internally; readers only log it).
:func:`fast_writer_available` proves this once per process against the installed torch on small
samples (bf16/fp32, the universal-entry keys); when it does not hold (another torch version's
layout), callers fall back to ``torch.save``. Files of 4 GB or more (zip64 record fields) and
empty tensors are refused (:class:`FastWriterUnsupported`) and the caller falls back as well.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import logging
import math
import os
import pickle
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

ALIGNMENT = 64
"""torch's storage alignment (``torch.utils.serialization.config.save.storage_alignment``)."""
_CHUNK = 1 << 20
"""CRC and write in pieces this large, so the bytes the CRC just read are still in cache."""
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 16)

_LFH = struct.Struct("<IHHHHHIIIHH")       # local file header
_DD = struct.Struct("<IIII")               # data descriptor (crc, sizes)
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names (what torch's miniz writer sets)


class FastWriterUnsupported(ValueError):
    """A file this writer does not produce (zip64 sizes, an empty tensor's record): use torch.save."""


class TensorSpec:
    """Stands for the tensor of an entry: dtype and shape only (the bytes come as ``pieces``)."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int]):
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= max(d, 1)
        return (torch._utils._rebuild_tensor_v2,
                (_StorageSpec(self.dtype, self.numel), 0, self.shape, tuple(reversed(stride)), False,
                 collections.OrderedDict()))


class _StorageSpec:
    def __init__(self, dtype: torch.dtype, numel: int):
        self.dtype = dtype
        self.numel = numel


@functools.lru_cache(maxsize=None)
def _storage_class(dtype: torch.dtype) -> Any:
    from torch.storage import _dtype_to_storage_type_map

    return getattr(torch, _dtype_to_storage_type_map()[dtype])


class _EntryPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageSpec):
            return ("storage", _storage_class(obj.dtype), "0", "cpu", obj.numel)
        return None


def entry_pickle(entry: dict) -> bytes:
    """``data.pkl`` of ``torch.save(entry)`` where the one :class:`TensorSpec` value is the tensor."""
    buf = _BytesSink()
    _EntryPickler(buf, protocol=2).dump(entry)
    return buf.value()


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
        cd = b"".join(_CDH.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
                      + name for name, offset, crc, size in self.records)
        cd_offset, n = self.cursor, len(self.records)
        eocd64_offset = cd_offset + len(cd)
        return (cd + _EOCD64.pack(0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, len(cd), cd_offset)
                + _EOCD64_LOCATOR.pack(0x07064B50, 0, eocd64_offset, 1)
                + _EOCD.pack(0x06054B50, 0, 0, n, n, len(cd), cd_offset, 0))


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _serialization_id(pkl: bytes, crc: int, size: int) -> bytes:
    digest = hashlib.blake2b(pkl + struct.pack("<IQ", crc, size), digest_size=16).digest()
    return f"{int.from_bytes(digest, 'little') % 10 ** 40:040d}".encode()


def write_tensor_file(path: os.PathLike | str, entry: dict, pieces: Iterable[Any], *, fd: Optional[int] = None,
                      crc: bool = True, serialization_id: Optional[bytes] = None) -> int:
    """Write ``torch.save(entry, path)`` where the entry's :class:`TensorSpec` holds ``pieces`` in order.

    ``pieces`` are buffers (memoryviews of mapped rank-file bytes); their total length must be the
    tensor's byte size. Writes to ``fd`` when given (positioned at 0, left open), else creates the
    file. Returns the file size. Not durable by itself: the caller fsyncs.
    """
    path = Path(path)
    specs = [v for v in entry.values() if isinstance(v, TensorSpec)]
    if len(specs) != 1:
        raise ValueError("entry must hold exactly one TensorSpec")
    spec = specs[0]
    pieces = [memoryview(p).cast("B") for p in pieces]
    size = sum(len(p) for p in pieces)
    if size != spec.nbytes:
        raise ValueError(f"{path}: pieces hold {size} bytes, the tensor {spec.shape} {spec.dtype} needs {spec.nbytes}")
    if size + 8192 > _ZIP32_LIMIT:
        raise FastWriterUnsupported(f"{path}: {size} bytes needs zip64 fields")
    if size == 0:  # torch writes an empty record without a data descriptor
        raise FastWriterUnsupported(f"{path}: empty tensor")
    pkl = entry_pickle(entry)
    arc = _Archive(archive_name(path), crc)
    head = b"".join((arc.small("data.pkl", pkl), arc.small(".format_version", b"1"),
                     arc.small(".storage_alignment", str(ALIGNMENT).encode()), arc.small("byteorder", b"little"),
                     arc.open_large("data/0")))
    own = fd is None
    if own:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, head)
        value = 0
        for piece in pieces:
            for start in range(0, len(piece), _CHUNK):
                part = piece[start:start + _CHUNK]
                if crc:
                    value = zlib.crc32(part, value)
                _write_all(fd, part)
        tail = arc.close_large(value, size) + arc.small("version", b"3\n")
        sid = serialization_id if serialization_id is not None else _serialization_id(pkl, value, size)
        tail += arc.small(".data/serialization_id", sid)
        directory = arc.directory()
        _write_all(fd, tail + directory)
    finally:
        if own:
            os.close(fd)
    return arc.cursor + len(directory)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (alive as long as ``t``'s storage is)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()) if t.dtype != torch.uint8 else memoryview(t.numpy())


# --- self-check against torch.save ------------------------------------------------------------------
def _samples() -> list[tuple[str, dict, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g)
    b = torch.randn(129, generator=g)
    c = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    return [
        ("fp32.pt", {"param": a, "cat_dim": 0}, a),
        ("exp_avg_sq.pt", {"param": b, "cat_dim": 0, "vocab_tensor": True}, b),
        ("exp_avg.pt", {"param": c, "cat_dim": 1, "param_n_sub_params": 2}, c),
    ]


def _serialization_id_of(path: Path) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".data/serialization_id"))
        return z.read(name)


@functools.lru_cache(maxsize=None)
def fast_writer_available() -> bool:
    """Whether :func:`write_tensor_file` reproduces the installed torch's ``torch.save`` bytes."""
    if os.environ.get("MEGATRON_UCP_TORCH_SAVE") == "1":
        log.info("MEGATRON_UCP_TORCH_SAVE=1: writing with torch.save")
        return False
    try:
        get, set_ = torch.serialization.get_crc32_options, torch.serialization.set_crc32_options
    except AttributeError:
        get = set_ = None
    try:
        with tempfile.TemporaryDirectory(prefix="megatron-ucp-selfcheck-") as tmp:
            for i, (name, entry, tensor) in enumerate(_samples()):
                ref, ours = Path(tmp) / f"ref{i}" / name, Path(tmp) / f"ours{i}" / name
                ref.parent.mkdir()
                ours.parent.mkdir()
                previous = get() if get is not None else None
                if set_ is not None:
                    set_(True)
                try:
                    torch.save(entry, ref)
                finally:
                    if set_ is not None and previous is not None:
                        set_(previous)
                spec_entry = {k: (TensorSpec(v.dtype, v.shape) if v is tensor else v) for k, v in entry.items()}
                write_tensor_file(ours, spec_entry, [tensor_bytes(tensor.contiguous())],
                                  serialization_id=_serialization_id_of(ref))
                if ref.read_bytes() != ours.read_bytes():
                    log.info("fast writer disabled: its %s differs from torch %s's torch.save", name,
                             torch.__version__)
                    return False
                back = torch.load(ours, weights_only=False)
                if not torch.equal(back["param"], tensor):
                    return False
    except Exception as exc:  # any surprise: use torch.save, which is always right
        log.info("fast writer disabled (%s: %s)", type(exc).__name__, exc)
        return False
    return True
