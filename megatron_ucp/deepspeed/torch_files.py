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
        raise CheckpointFormatError(f"{path}: is {kind}, not a torch file", subject=path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read: {exc.strerror}", subject=path) from exc
    if size == 0:
        raise CheckpointFormatError(f"{path}: empty file (truncated write?)", subject=path)


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
            f"{path}: unreadable torch file (truncated or corrupt?): {described(exc)}", subject=path
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


def with_torch_values(value: Any, _seen: Optional[set] = None) -> Any:
    """``value`` with every stand-in for a torch dtype or device (what a read without torch gives for them) replaced by
    torch's own, in containers and in objects' attributes (in place): what is handed to another rank (pickled by torch,
    which refuses a class that claims torch's name) or into the live optimizer (a loss scaler's dtype)."""
    import torch

    from megatron_ucp.format.lightpickle import is_stand_in

    seen = set() if _seen is None else _seen
    if isinstance(value, type) and is_stand_in(value) and getattr(value, "_ucp_module", "") == "torch":
        return getattr(torch, getattr(value, "_ucp_name", ""), value)
    if id(value) in seen:
        return value
    if isinstance(value, dict):
        seen.add(id(value))
        for key in list(value):
            value[key] = with_torch_values(value[key], seen)
    elif isinstance(value, list):
        seen.add(id(value))
        value[:] = [with_torch_values(item, seen) for item in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(with_torch_values(item, seen) for item in value)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not is_stand_in(value):
        seen.add(id(value))
        for key, item in list(vars(value).items()):
            setattr(value, key, with_torch_values(item, seen))
    return value
