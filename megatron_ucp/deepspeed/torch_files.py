"""Open DeepSpeed's torch files: memory-mapped, without torch when possible, damage named.

The one place a checkpoint file is opened for its objects; the reader (:mod:`megatron_ucp.deepspeed.reader`),
the ZeRO-3 rank files (:mod:`megatron_ucp.deepspeed.stage3_files`) and the hooks call it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from megatron_ucp.errors import CheckpointFormatError, described
from megatron_ucp.format.lightpickle import PICKLE_MODULE
from megatron_ucp.format.paths import special_kind
from megatron_ucp.format.rawtensor import raw_tensors_from_torch
from megatron_ucp.format.torchload import TorchNeeded
from megatron_ucp.format.torchload import load as load_without_torch

log = logging.getLogger(__name__)


def _check_size(path: Path) -> None:
    kind = special_kind(path)
    if kind is not None:  # never open a FIFO or a device: it would block, or never end
        raise CheckpointFormatError(f"{path}: is {kind}, not a torch file", subject=path, damaged=path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read: {exc.strerror}", subject=path, damaged=path) from exc
    if size == 0:
        raise CheckpointFormatError(f"{path}: empty file (truncated write?)", subject=path, damaged=path)


def load_torch_file(path: Path, mmap: bool = True) -> Any:
    """``torch.load`` on CPU, memory-mapped when the file format allows; corrupt files get a clear error."""
    import torch

    _check_size(path)
    # DeepSpeed objects inside (fragment_address, ZeroStageEnum, LossScaler) load as stand-ins while
    # deepspeed is not imported: importing it costs ~2 s; see megatron_ucp.format.lightpickle.
    pm = PICKLE_MODULE
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=pm)
        except RuntimeError as exc:
            if mmap and "mmap" in str(exc):  # legacy (non-zip) serialization cannot be mapped
                return torch.load(path, map_location="cpu", weights_only=False, pickle_module=pm)
            raise
    except CheckpointFormatError:
        raise
    except Exception as exc:  # torch raises RuntimeError/EOFError/UnpicklingError/... for damaged files
        raise CheckpointFormatError(
            f"{path}: unreadable torch file (truncated or corrupt?): {described(exc)}", subject=path, damaged=path
        ) from exc


def load_raw(path: Path, damage: Optional[list[str]] = None, random_access: bool = False) -> Any:
    """A torch file's object with tensors as :class:`RawTensor`: read without torch when possible.

    Zip-format files (torch >= 1.6, every DeepSpeed checkpoint this tool reads) are mapped and
    unpickled by :mod:`megatron_ucp.format.torchload`; files it does not rebuild faithfully (legacy
    format, unusual torch objects) and damaged ones go through ``torch.load``, whose tensors are
    then wrapped: the result is the same, and so are the errors. ``random_access``: the caller will
    read slices of the tensors itself (no readahead from the metadata reads into the tensor bytes).
    """
    path = Path(path)
    _check_size(path)
    try:
        return load_without_torch(path, damage, random_access)
    except TorchNeeded as why:
        log.debug("%s: reading with torch.load (%s)", path, why)
    except Exception as exc:  # damaged: let torch.load produce the diagnosis
        log.debug("%s: not readable without torch (%s: %s)", path, type(exc).__name__, exc)
    return raw_tensors_from_torch(load_torch_file(path, mmap=True))


def with_torch_values(value: Any) -> Any:
    """``value`` with every stand-in for a torch dtype or device (what a read without torch gives for them) replaced by
    torch's own, in containers and in objects' attributes (in place where they are mutable): what is handed to another
    rank (pickled by torch, which refuses a class that claims torch's name) or into the live optimizer (a loss
    scaler's dtype). Never raises: what it cannot rebuild (a frozen object, a structure nested past Python's
    recursion limit) is left as it was, and the sending rank's pickle check names it."""
    try:
        return _torch_values(value, set())
    except RecursionError:
        return value


def _torch_values(value: Any, seen: set) -> Any:
    import torch

    from megatron_ucp.format.lightpickle import is_stand_in

    if is_stand_in(value) and value._ucp_module == "torch":
        if isinstance(value, type):
            return getattr(torch, value._ucp_name, value)
        if value._ucp_name == "device":
            try:
                return torch.device(*(value.__dict__.get("_ucp_args") or ()))
            except (TypeError, RuntimeError):
                return value
        return value
    if isinstance(value, type):
        return value
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return value
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _torch_values(item, seen)
            if new is not item:
                value[key] = new
    elif isinstance(value, list):
        for i, item in enumerate(value):
            new = _torch_values(item, seen)
            if new is not item:
                value[i] = new
    elif isinstance(value, (tuple, set, frozenset)):
        items = [_torch_values(item, seen) for item in value]
        if any(new is not old for new, old in zip(items, value)):
            if hasattr(value, "_make"):  # a named tuple
                return type(value)._make(items)
            return type(value)(items)
    elif hasattr(value, "__dict__"):  # an object, a stand-in of another package's among them
        attributes = vars(value)
        for key, item in list(attributes.items()):
            new = _torch_values(item, seen)
            if new is not item:
                attributes[key] = new  # the instance's own dict: no property, __setattr__ or frozen check in the way
    return value
