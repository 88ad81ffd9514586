"""Load ``torch.save`` files (the zip format, torch >= 1.6) without importing torch.

A torch file is an uncompressed zip: ``<name>/data.pkl`` (a pickle whose tensors refer to storage
records by key) and one ``<name>/data/<key>`` record per storage. :func:`load` maps the file
privately (copy-on-write, like ``torch.load(mmap=True)``), unpickles ``data.pkl`` and returns its
object with every tensor as a :class:`~megatron_ucp.format.rawtensor.RawTensor` over the mapped bytes:
nothing but the pickle is read until a tensor's bytes are used.

Only what DeepSpeed and Megatron checkpoints hold is rebuilt: plain tensors and parameters,
storages of the dtypes in :data:`~megatron_ucp.format.rawtensor.DTYPES`, ``torch.Size``, dtypes and
devices (as stand-ins that pickle back to the same global). Classes of ``deepspeed`` and
``megatron`` load as stand-ins while those packages are not imported (see
:mod:`megatron_ucp.format.lightpickle`). Anything else from torch (tensor subclasses, sparse or quantized
tensors, backward hooks), the legacy non-zip format, big-endian files and compressed records
raise :class:`TorchNeeded`: the caller then uses ``torch.load``, which is always right.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

from megatron_ucp.errors import CheckpointFormatError, described
from megatron_ucp.format.lightpickle import Unpickler as _LightUnpickler
from megatron_ucp.format.lightpickle import stand_in_class
from megatron_ucp.format.paths import open_checkpoint_file
from megatron_ucp.format.rawtensor import DTYPE_BY_STORAGE, DTYPES, UNTYPED_STORAGE, RawTensor, Storage

__all__ = ["TorchNeeded", "load", "is_zip_file"]

_LFH = struct.Struct("<IHHHHHIIIHH")
_STAND_IN_ROOTS = ("megatron",)
"""Besides ``deepspeed`` (lightpickle's): packages that import torch, so never imported to unpickle."""


class TorchNeeded(Exception):
    """The file needs torch to be read faithfully (the reason is the message)."""


def is_zip_file(path: os.PathLike | str) -> bool:
    try:
        with open_checkpoint_file(path) as fh:
            return fh.read(4) == b"PK\x03\x04"
    except (OSError, CheckpointFormatError):
        return False


class TorchSize(tuple):
    """``torch.Size`` without torch: a tuple that pickles back as ``torch.Size``."""

    def __reduce__(self) -> tuple:
        return (stand_in_class("torch", "Size"), (tuple(self),))


class _StorageType:
    def __init__(self, name: str):
        self.name = name
        self.dtype = DTYPES["uint8"] if name == UNTYPED_STORAGE else DTYPE_BY_STORAGE[name]


def _rebuild_tensor_v2(
    storage: Storage,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> RawTensor:
    if backward_hooks:
        raise TorchNeeded("a tensor with backward hooks")
    if metadata:
        raise TorchNeeded("a tensor with Python attributes")
    return RawTensor(storage, storage_offset, tuple(size), tuple(stride), requires_grad)


def _rebuild_parameter(data: RawTensor, requires_grad: bool, backward_hooks: Any = None) -> RawTensor:
    if backward_hooks:
        raise TorchNeeded("a parameter with backward hooks")
    if not isinstance(data, RawTensor):
        raise TorchNeeded("a parameter that is not a plain tensor")
    return RawTensor(data.storage, data.offset, data.shape, data.stride_, requires_grad)


_TORCH_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch", "Size"): TorchSize,
}


class _Unpickler(_LightUnpickler):
    def __init__(self, file: Any, archive: "_Archive"):
        super().__init__(file)
        self.archive = archive
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        root = module.split(".", 1)[0]
        if root == "torch":
            found = _TORCH_GLOBALS.get((module, name))
            if found is not None:
                return found
            if module == "torch" and (name in DTYPE_BY_STORAGE or name == UNTYPED_STORAGE):
                return _StorageType(name)
            if module == "torch" and (name in DTYPES or name == "device"):
                return stand_in_class(module, name)
            raise TorchNeeded(f"{module}.{name}")
        if root in _STAND_IN_ROOTS and root not in sys.modules:
            return stand_in_class(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise TorchNeeded(f"persistent id {pid!r:.80}")
        _, kind, key, _location, numel = pid
        key = str(key)
        storage = self.storages.get(key)
        if storage is None:
            storage = self.archive.storage(key, kind.dtype, int(numel))
            self.storages[key] = storage
        return storage


def _record_problems(info: zipfile.ZipInfo, head: bytes, name: bytes) -> list[str]:
    """What PyTorch's zip reader would reject about one record: its local header (``head``, then the
    ``name`` bytes that follow it) against its central-directory entry."""
    if len(head) != _LFH.size or _LFH.unpack(head)[0] != 0x04034B50:
        return [f"{info.filename}: no local header at offset {info.header_offset}"]
    (_, _, flags, method, _, _, crc, csize, usize, _, _) = _LFH.unpack(head)
    problems = []
    if name.decode("utf-8", "replace") != info.filename:
        problems.append(f"{info.filename}: the local header names it {name!r}")
    if method != info.compress_type:
        problems.append(f"{info.filename}: compression method {method} locally, {info.compress_type} in the directory")
    if (
        not flags & 0x08
        and 0xFFFFFFFF not in (csize, usize)
        and (crc, csize, usize) != (info.CRC, info.compress_size, info.file_size)
    ):
        problems.append(f"{info.filename}: local header and central directory disagree on CRC or size")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        problems.append(
            f"{info.filename}: stored record with {info.compress_size} bytes on disk but "
            f"{info.file_size} in the directory"
        )
    return problems


def _read_local_header(fd: int, info: zipfile.ZipInfo) -> tuple[bytes, bytes]:
    """(fixed local header, the name bytes after it), in one ``pread``."""
    name_len = len(info.orig_filename.encode("utf-8"))
    data = os.pread(fd, _LFH.size + name_len, info.header_offset)
    return data[: _LFH.size], data[_LFH.size :]


class _Archive:
    """The records of one mapped torch zip file.

    Headers, the pickle and storages smaller than a page (optimizer steps) are read with
    ``pread``, not through the mapping: touching a mapped page maps its cached neighbours too
    (fault-around), which at DP=768 made the process resident in ~100 MB of tensor bytes next to
    the step of every rank file. The mapping is only read when tensor bytes are copied (and the
    converter releases them again).
    """

    def __init__(self, path: Path, random_access: bool = False):
        self.path = path
        self.damage: list[str] = []
        with open_checkpoint_file(path) as fh:
            if random_access and hasattr(os, "posix_fadvise"):
                # the header and small-record reads below would otherwise leave readahead markers in
                # the tensor bytes after them, and a later exact read of a slice would set them off
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            if fh.read(4) != b"PK\x03\x04":
                raise TorchNeeded("not a zip-format torch file (legacy serialization)")
            fh.seek(0)
            with zipfile.ZipFile(fh) as z:
                infos = z.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise TorchNeeded(f"{len(pickles)} data.pkl records")
            self.prefix = pickles[0].filename[: -len("data.pkl")]
            fd = fh.fileno()
            size = os.fstat(fd).st_size
            self.spans = {
                i.filename[len(self.prefix) :]: self._span(fd, i, size)
                for i in infos
                if i.filename.startswith(self.prefix)
            }
            self.small = {
                name: self._read(fd, name)
                for name in self.spans
                if name in ("data.pkl", "byteorder")
                or (name.startswith("data/") and self.spans[name][1] < mmap.PAGESIZE)
            }
            self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private, like torch's mmap load
            if random_access and hasattr(mmap, "MADV_RANDOM"):
                # a fault on the mapping (a caller touching a small tensor: an RNG state) reads its page,
                # not the readahead window after it (the fadvise above governs read calls only)
                self.map.madvise(mmap.MADV_RANDOM)
        anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open (every view keeps it open)

    def _span(self, fd: int, info: zipfile.ZipInfo, file_size: int) -> tuple[int, int]:
        """(offset of the data, size) of a record, from its local header; what torch would reject
        about the record but this reader can read around is collected in ``self.damage``."""
        if info.compress_type != zipfile.ZIP_STORED:
            raise TorchNeeded(f"compressed record {info.filename}")
        head, name = _read_local_header(fd, info)
        if len(head) != _LFH.size or _LFH.unpack(head)[0] != 0x04034B50:
            raise zipfile.BadZipFile(f"bad local header for {info.filename}")
        self.damage.extend(_record_problems(info, head, name))
        fields = _LFH.unpack(head)
        start = info.header_offset + _LFH.size + fields[9] + fields[10]
        if start + info.file_size > file_size:
            raise zipfile.BadZipFile(f"record {info.filename} runs past the end of the file")
        return start, info.file_size

    def _read(self, fd: int, name: str) -> bytes:
        start, size = self.spans[name]
        data = os.pread(fd, size, start)
        if len(data) != size:
            raise zipfile.BadZipFile(f"record {self.prefix}{name} is truncated")
        return data

    def storage(self, key: str, dtype: Any, numel: int) -> Storage:
        span = self.spans.get(f"data/{key}")
        if span is None:
            raise zipfile.BadZipFile(f"no record {self.prefix}data/{key}")
        start, size = span
        if size < numel * dtype.itemsize:
            raise zipfile.BadZipFile(f"storage {key} holds {size} bytes, needs {numel * dtype.itemsize}")
        nbytes = numel * dtype.itemsize
        small = self.small.get(f"data/{key}")
        if small is not None:  # a writable copy, as torch.load's tensors are writable
            return Storage(key=key, dtype=dtype, numel=numel, data=memoryview(bytearray(small[:nbytes])), address=0)
        data = memoryview(self.map)[start : start + nbytes]
        return Storage(
            key=key,
            dtype=dtype,
            numel=numel,
            data=data,
            address=self.address + start,
            region=(self.address, self.address + len(self.map)),
        )


def load(path: os.PathLike | str, damage: list[str] | None = None, random_access: bool = False) -> Any:
    """The object ``torch.load(path, mmap=True)`` would return, with tensors as :class:`RawTensor`.

    Raises :class:`TorchNeeded` when only torch can rebuild it, ``zipfile.BadZipFile`` /
    ``pickle.UnpicklingError`` / ``EOFError`` when the file is damaged. Damage this reader reads
    around but ``torch.load`` rejects (:func:`structure_problems`) is appended to ``damage``.
    """
    archive = _Archive(Path(path), random_access)
    if damage is not None:
        damage.extend(archive.damage)
    if archive.small.get("byteorder", b"little") != b"little":
        raise TorchNeeded("a big-endian file")
    if "data.pkl" not in archive.small:
        raise zipfile.BadZipFile(f"{path}: no data.pkl record")
    unpickler = _Unpickler(io.BytesIO(archive.small["data.pkl"]), archive)
    return unpickler.load()


def structure_problems(path: os.PathLike | str) -> list[str]:
    """Damage that ``torch.load`` rejects but a tolerant reader would not notice, one line each.

    What PyTorch's zip reader (miniz) validates and a tolerant reader may skip: every central
    directory entry against its record's local header (signature, name, method, and CRC and sizes
    where the local header carries them), stored records' two sizes, records within the file.
    CRC-32s are not recomputed: torch does not check them either (and files saved with
    ``torch.serialization.set_crc32_options(False)`` hold none). Reads headers only (``pread``).
    An empty list when the file is sound; a file that is not a zip at all is one problem.
    """
    path = Path(path)
    problems: list[str] = []
    try:
        with open_checkpoint_file(path) as fh, zipfile.ZipFile(fh) as z:
            fd = fh.fileno()
            size = os.fstat(fd).st_size
            for info in z.infolist():
                head, name = _read_local_header(fd, info)
                found = _record_problems(info, head, name)
                problems += found
                if found and found[0].endswith(f"offset {info.header_offset}"):
                    continue
                start = info.header_offset + _LFH.size + _LFH.unpack(head)[9] + _LFH.unpack(head)[10]
                if start + info.compress_size > size:
                    problems.append(f"{info.filename}: runs past the end of the file")
    except CheckpointFormatError:
        raise  # not a regular file: said in the opener's words
    except Exception as exc:  # zipfile raises BadZipFile, ValueError, NotImplementedError, struct.error, ...
        problems.append(f"not a readable zip archive ({described(exc)})")
    return problems


def crc_problems(path: os.PathLike | str) -> list[str]:
    """Records whose bytes no longer hash to the CRC-32 their directory entry recorded, one line each: every
    byte of the file read (what ``status --deep`` and ``verify`` of a native tag add to
    :func:`structure_problems`). Records saved without a CRC (``set_crc32_options(False)``: recorded 0) are
    read but cannot be judged."""
    problems: list[str] = []
    try:
        with open_checkpoint_file(path) as fh, zipfile.ZipFile(fh) as z:
            for info in z.infolist():
                if info.CRC == 0 and info.file_size:
                    continue
                try:
                    with z.open(info) as record:
                        while record.read(1 << 24):
                            pass
                except (zipfile.BadZipFile, EOFError, OSError) as exc:
                    problems.append(f"{info.filename}: {exc}")
    except CheckpointFormatError:
        raise
    except Exception as exc:  # see structure_problems
        problems.append(f"not a readable zip archive ({described(exc)})")
    return problems


_REFUSAL_TAIL = ". This is an internal miniz error"
_READER_CHILD = f"""
import json, sys
import torch
refused = {{}}
for line in sys.stdin:
    path = line.rstrip("\\n")
    try:
        torch._C.PyTorchFileReader(path)
    except Exception as exc:
        refused[path] = (str(exc).split({_REFUSAL_TAIL!r})[0].strip().splitlines() or [type(exc).__name__])[0]
print(json.dumps(refused))
"""


def torch_reader_problem(path: os.PathLike | str) -> str | None:
    """Why torch's own zip reader (``PyTorchFileReader``, what ``torch.load`` opens a file with)
    refuses ``path``, or None. Parses the archive's directory only. Imports torch: for processes
    that have it already (the elastic-load hook); a converter uses :class:`TorchReaderCheck`."""
    import torch

    with open_checkpoint_file(path):  # never hand a FIFO to torch
        pass
    try:
        torch._C.PyTorchFileReader(os.fspath(path))
    except Exception as exc:  # RuntimeError from miniz / caffe2's enforce
        return (str(exc).split(_REFUSAL_TAIL)[0].strip().splitlines() or [type(exc).__name__])[0]
    return None


class TorchReaderCheck:
    """torch's own zip reader run over files of an output, in a child process.

    A converter writes its state files with its own zip writer (byte-identical to ``torch.save``'s, by
    test) and copies model-states and layer files as they are; DeepSpeed's loader opens all of them
    with ``torch.load``. A copied file our tolerant reader reads but torch refuses would make a
    "complete" folder no load can open. A copied file in exactly ``torch.save``'s form
    (:func:`megatron_ucp.format.torch_archive.unproven` is None) needs no more; any other is opened by
    torch itself before the commit (``PyTorchFileReader``: the directory and the version record),
    which catches every kind of damage torch rejects, not only the kinds known today. ``start``: begin
    importing torch now (about 2 s), to overlap the work, when the caller already knows it will ask;
    else the child starts at the first question. The converter itself never imports torch; a process
    that has torch already (a test, the training job) asks it directly. Paths must be regular files
    (:func:`~megatron_ucp.format.paths.open_checkpoint_file`'s check): a FIFO would block.
    """

    def __init__(self, start: bool = True) -> None:
        self._proc = None
        if start:
            self._start()

    def _start(self) -> None:
        import subprocess

        if self._proc is None and "torch" not in sys.modules:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _READER_CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )

    def refused(self, paths: "list[os.PathLike | str]", timeout: float = 600.0) -> dict[str, str]:
        """Path -> torch's reason, for each of ``paths`` torch's reader refuses (once per check)."""
        import json

        names = [os.fspath(p) for p in paths]
        if not names:
            return {}
        self._start()
        if self._proc is None:
            return {p: why for p in names if (why := torch_reader_problem(p)) is not None}
        if any("\n" in p for p in names):
            raise ValueError("a path with a newline cannot be passed to torch's reader")
        out, err = self._proc.communicate("".join(p + "\n" for p in names).encode(), timeout=timeout)
        if self._proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(
                f"torch's zip reader could not be run over {len(names)} file(s) "
                f"(exit {self._proc.returncode}): {tail[0]}"
            )
        return json.loads(out.decode())

    def cancel(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.communicate()
