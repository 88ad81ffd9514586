"""What a save writes, copied into host memory, so that training may change the live tensors while it is written.

An asynchronous save (:mod:`megatron_ucp.integration.save.async_save`) hands the writer a copy of each state dict
DeepSpeed saves: the same containers, and every tensor a view of a host copy of its storage at the same offset,
shape and stride. ``torch.save`` writes one record per storage, so the copy's file holds what the live state's
file would have held, storage for storage (a module's parameters that are views of one flat buffer stay views of
one copied buffer); a reader sees the same tensors.

A storage is known by its identity (torch's own key) only within one state dict (one file), whose tensors keep
their storages alive while it is copied: DeepSpeed's pipeline, expert and (0.19.8) model-state saves clone each
file's tensors, save the clone and free it, so the next file's clone may get a freed clone's address and identity;
taken as the same storage across files, it would be written from the earlier file's copy. The copy of a storage is
exactly its size (a view of the buffer's first bytes as a storage of its own): the file holds the records a
synchronous save writes, byte for byte.

The host buffers are allocated once and reused by the next save of the same structure (:class:`HostBuffers`): a
save's k-th storage goes to the k-th buffer when it fits. On an accelerator they are pinned (page-locked), so that
the device-to-host copies run at the link's speed and overlap; one synchronisation ends the copy before the save
returns. A buffer that cannot be had raises :class:`HostMemoryShort`: the caller saves synchronously instead.

A value computed from saved tensors (the save record's checksums) may wait for the copy (:class:`WhenWritten`): its
tensors are copied with the rest, and it is computed from the copies by the writer, just before the file is written
(:func:`written_form`), so that the hashing is not part of the save's stall; it describes the bytes written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


class HostMemoryShort(RuntimeError):
    """The host buffers a copy needs could not be allocated (pinned memory exhausted, or host memory)."""


@dataclass
class HostBuffers:
    """Reusable host buffers, one per storage position of a save (bytes; ``pin``: how the accelerator pins a host
    tensor, None on the CPU)."""

    pin: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def take(self, position: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the save's ``position``-th buffer (grown, never shrunk), as a tensor whose storage is
        exactly ``nbytes`` long (what ``torch.save`` writes of it)."""
        while len(self.buffers) <= position:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
        held = self.buffers[position]
        if held.numel() < nbytes:
            try:
                held = torch.empty(nbytes, dtype=torch.uint8)
                held = self.pin(held) if self.pin is not None else held
            except RuntimeError as exc:
                what = "pinned host memory" if self.pin is not None else "host memory"
                raise HostMemoryShort(f"cannot allocate {nbytes} bytes of {what}: {exc}") from exc
            self.buffers[position] = held
        return torch.from_numpy(held.numpy()[:nbytes])  # a storage of its own over the buffer's first bytes


@dataclass
class WhenWritten:
    """A value of a saved dict computed from saved tensors when its file is written: ``compute(*args)``."""

    compute: Callable[..., Any]
    args: tuple

    def __reduce__(self) -> Any:
        raise TypeError("a value computed when its file is written reached pickle unresolved (see written_form)")


def written_form(value: Any) -> Any:
    """``value`` as it is written: each :class:`WhenWritten` in it (containers rebuilt) replaced by its value."""
    if isinstance(value, WhenWritten):
        return value.compute(*value.args)
    if isinstance(value, dict) and _holds_deferred(value):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = written_form(item)
        return out
    if isinstance(value, list) and _holds_deferred(value):
        return [written_form(item) for item in value]
    return value


def _holds_deferred(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(isinstance(item, WhenWritten) or _holds_deferred(item) for item in items)


@dataclass
class HostCopy:
    """One save's copy: each file's storages copied once each, in the order met, into the save's next buffers."""

    buffers: HostBuffers
    positions: int = 0
    """Storages copied so far by this save (the next one's buffer)."""
    copied_bytes: int = 0
    devices: set = field(default_factory=set)

    def of(self, value: Any) -> Any:
        """``value`` (one file's state dict) with every tensor in it replaced by its host copy (containers rebuilt,
        other leaves deep-copied: training may change them after the save returns). Its storages are told apart
        within ``value`` alone, which holds them alive (the module docstring)."""
        storages: dict[tuple[Any, int], torch.UntypedStorage] = {}  # this file's, by torch's storage key
        return _rebuild(value, lambda tensor: self._tensor(tensor, storages))

    def _tensor(self, tensor: torch.Tensor, storages: dict[tuple[Any, int], torch.UntypedStorage]) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage._cdata)  # as torch.save tells storages apart (an empty one has no address)
        host = storages.get(key)
        if host is None:
            nbytes = storage.nbytes()
            buffer = self.buffers.take(self.positions, nbytes)
            self.positions += 1
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            buffer.copy_(source, non_blocking=self.buffers.pin is not None and not tensor.is_cpu)
            host = buffer.untyped_storage()
            storages[key] = host
            self.copied_bytes += nbytes
            if not tensor.is_cpu:
                self.devices.add(tensor.device)
        view = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
        return view

    def finish(self, synchronize: Callable[[], None]) -> None:
        """Wait for the asynchronous device-to-host copies (``synchronize()``: the accelerator's)."""
        if self.devices:
            synchronize()


def _rebuild(value: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, WhenWritten):  # computed from the copies
        return WhenWritten(value.compute, _rebuild(value.args, tensor))
    if isinstance(value, dict):
        out = copy.copy(value)  # the same dict type (OrderedDict and the like), then each entry replaced
        for key, item in value.items():
            out[key] = _rebuild(item, tensor)
        return out
    if isinstance(value, list):
        return [_rebuild(item, tensor) for item in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(item, tensor) for item in value))
    if type(value) is tuple:
        return tuple(_rebuild(item, tensor) for item in value)
    try:
        return copy.deepcopy(value)  # torch.Size, numbers, strings, argparse namespaces, ...
    except Exception:
        return value  # not copyable (a handle): pickled as it is when written
