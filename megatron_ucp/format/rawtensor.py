"""Tensors as dtype, shape and bytes, without torch: what the converter handles between files.

Conversion copies bytes; it never computes on them. Importing torch to do that costs ~1.5 s of
every ``megatron-ucp convert`` on a small machine (as long as the conversion of a 1.4 GB
checkpoint itself), so the converter's path reads and writes torch files without it
(:mod:`megatron_ucp.format.torchload`, :mod:`megatron_ucp.format.torchfile`) and passes tensors around as
:class:`RawTensor`: a dtype from :data:`DTYPES`, a shape and strides, and a view of the storage's
bytes (usually a private memory mapping of the rank file, so nothing is read until used).
:meth:`RawTensor.to_torch` makes a real tensor over the same bytes where torch is wanted
(verification, the rare ``torch.save`` fallbacks).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = [
    "DType",
    "DTYPES",
    "DTYPE_BY_STORAGE",
    "Storage",
    "RawTensor",
    "from_torch",
    "raw_tensors_from_torch",
    "torch_tensors_from_raw",
    "torch_views_from_raw",
]


@dataclass(frozen=True)
class DType:
    name: str
    """torch's name (``torch.<name>``)."""
    itemsize: int
    storage: str
    """The legacy typed-storage class torch pickles for this dtype (``torch.<storage>``)."""
    struct_code: Optional[str] = None
    """``struct`` format of one element, for reading a scalar (None: not readable without torch)."""

    def __repr__(self) -> str:
        return f"torch.{self.name}"


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, "FloatStorage", "f"),
        DType("float64", 8, "DoubleStorage", "d"),
        DType("float16", 2, "HalfStorage", "e"),
        DType("bfloat16", 2, "BFloat16Storage"),
        DType("int64", 8, "LongStorage", "q"),
        DType("int32", 4, "IntStorage", "i"),
        DType("int16", 2, "ShortStorage", "h"),
        DType("int8", 1, "CharStorage", "b"),
        DType("uint8", 1, "ByteStorage", "B"),
        DType("bool", 1, "BoolStorage", "?"),
    )
}
DTYPE_BY_STORAGE: dict[str, DType] = {d.storage: d for d in DTYPES.values()}
UNTYPED_STORAGE = "UntypedStorage"
"""torch.UntypedStorage records hold bytes (uint8)."""


@dataclass(frozen=True, eq=False)
class Storage:
    """One storage record of a torch file: its bytes, and where they are mapped in this process."""

    key: str
    dtype: DType
    numel: int
    data: memoryview
    """The storage's bytes (a view of the file mapping, or of a torch tensor's memory)."""
    address: int
    """Address of ``data[0]`` in this process (for ``madvise``); 0 when unknown."""
    region: Optional[tuple[int, int]] = None
    """When ``data`` lies in a private mapping of an unmodified file: that whole mapping's address
    range (pages anywhere in it can be dropped safely). None: ordinary memory."""
    owner: Any = None
    """Keeps the memory behind ``data`` alive (a torch tensor), when it is not the mapping itself."""

    @property
    def mapped(self) -> bool:
        return self.region is not None


class RawTensor:
    """A strided view of a :class:`Storage` (the subset of ``torch.Tensor`` the converter uses)."""

    __slots__ = ("storage", "offset", "shape", "stride_", "requires_grad")

    def __init__(
        self, storage: Storage, offset: int, shape: Sequence[int], stride: Sequence[int], requires_grad: bool = False
    ):
        self.storage = storage
        self.offset = int(offset)
        self.shape = tuple(int(d) for d in shape)
        self.stride_ = tuple(int(s) for s in stride)
        self.requires_grad = bool(requires_grad)
        if len(self.shape) != len(self.stride_):
            raise ValueError(f"shape {self.shape} and stride {self.stride_} differ in length")
        if self.numel() and self.offset + self._span() > storage.numel:
            raise ValueError(
                f"view (offset {self.offset}, shape {self.shape}, stride {self.stride_}) runs past its "
                f"storage of {storage.numel} elements"
            )

    # --- the torch.Tensor vocabulary the converter uses --------------------------------------
    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def stride(self) -> tuple[int, ...]:
        return self.stride_

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride_)):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    def data_ptr(self) -> int:
        return self.storage.address + self.offset * self.dtype.itemsize if self.storage.address else 0

    def reshape(self, *shape: Any) -> "RawTensor":
        """Only what the converter needs: a contiguous tensor's flat (``-1``) or same-size view."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if shape == (-1,):
            shape = (self.numel(),)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        if not self.is_contiguous():
            raise ValueError("reshape of a non-contiguous tensor needs a copy (torch)")
        return RawTensor(self.storage, self.offset, shape, contiguous_stride(shape), self.requires_grad)

    def narrow(self, dim: int, start: int, length: int) -> "RawTensor":
        if self.dim() != 1 or dim != 0:
            raise ValueError("narrow is supported on flat tensors only")
        if start < 0 or length < 0 or start + length > self.shape[0]:
            raise ValueError(f"narrow({start}, {length}) outside a tensor of {self.shape[0]} elements")
        return RawTensor(self.storage, self.offset + start * self.stride_[0], (length,), self.stride_)

    def bytes_view(self) -> memoryview:
        """The bytes of a contiguous tensor, without a copy."""
        if not self.is_contiguous():
            raise ValueError("bytes_view needs a contiguous tensor")
        start = self.offset * self.dtype.itemsize
        return self.storage.data[start : start + self.nbytes]

    def item(self) -> Any:
        if self.numel() != 1:
            raise ValueError(f"item() of a tensor of {self.numel()} elements")
        if self.dtype.struct_code is None:
            return self.to_torch().item()
        return struct.unpack("<" + self.dtype.struct_code, self.bytes_view())[0]

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def to_torch(self) -> Any:
        """A ``torch.Tensor`` over the same bytes (no copy; imports torch)."""
        import torch

        dtype = getattr(torch, self.dtype.name)
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=dtype)
        start = self.offset * self.dtype.itemsize
        end = start + self._span() * self.dtype.itemsize
        flat = torch.frombuffer(self.storage.data[start:end], dtype=dtype)
        return flat.as_strided(self.shape, self.stride_)

    def _span(self) -> int:
        """Elements from the first to one past the last this view touches."""
        if not self.numel():
            return 0
        return 1 + sum((d - 1) * s for d, s in zip(self.shape, self.stride_))

    def __repr__(self) -> str:
        return f"RawTensor({self.dtype!r}, shape={self.shape}, storage {self.storage.key!r}@{self.offset})"


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def from_torch(t: Any, key: str = "0") -> RawTensor:
    """A :class:`RawTensor` over a CPU ``torch.Tensor``'s memory (kept alive by the result)."""
    import torch

    dtype = DTYPES.get(str(t.dtype).replace("torch.", ""))
    if dtype is None:
        raise ValueError(f"dtype {t.dtype} is not supported")
    if t.device.type != "cpu":
        raise ValueError("from_torch needs a CPU tensor")
    storage = t.untyped_storage()
    numel = storage.nbytes() // dtype.itemsize
    base = torch.empty(0, dtype=t.dtype).set_(storage, 0, (numel,), (1,))
    data = memoryview(base.view(torch.uint8).numpy()) if numel else memoryview(b"")
    raw = Storage(key=key, dtype=dtype, numel=numel, data=data, address=storage.data_ptr() if numel else 0, owner=base)
    return RawTensor(raw, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.requires_grad)


def _map_leaves(obj: Any, match: Any, convert: Any) -> Any:
    """``obj`` with the leaves for which ``match`` holds, inside dicts, lists and tuples, converted."""
    if match(obj):
        return convert(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map_leaves(v, match, convert)
        return out
    if isinstance(obj, list):
        return [_map_leaves(v, match, convert) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_map_leaves(v, match, convert) for v in obj)
    return obj


def raw_tensors_from_torch(obj: Any) -> Any:
    """``obj`` with every torch tensor inside dicts, lists and tuples replaced by a :class:`RawTensor`."""
    import torch

    return _map_leaves(obj, torch.is_tensor, lambda t: from_torch(t.detach()))


def torch_views_from_raw(obj: Any) -> Any:
    """:func:`torch_tensors_from_raw` without the copies: torch tensors over the same (mapped) bytes, read
    only when used (imports torch)."""
    return _map_leaves(obj, lambda v: isinstance(v, RawTensor), lambda t: t.to_torch())


def torch_tensors_from_raw(obj: Any) -> Any:
    """The inverse of :func:`raw_tensors_from_torch`, with copies (for ``torch.save``; imports torch)."""
    return _map_leaves(obj, lambda v: isinstance(v, RawTensor), lambda t: t.to_torch().clone())
