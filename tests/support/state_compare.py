"""Two saved states compared tensor for tensor (an asynchronous save's files against a synchronous save's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

IDENTITY = ("ucp_save_record", "save_id")
"""The save's random identity (drawn anew by every save): the only thing two saves of one state differ in."""


def differences(a: Any, b: Any, where: str = "", alias: tuple[str, str] = ("", "")) -> list[str]:
    """Where two loaded states differ (tensors by dtype, shape and value; numpy arrays by value; containers by keys
    and length; other objects by their attributes or equality), the save's identity aside. ``alias``: a string of
    ``a`` reads ``alias[0]`` where ``b`` reads ``alias[1]`` (each run's own folder, in Megatron's saved arguments)."""
    if isinstance(a, str) and isinstance(b, str) and alias[0]:
        return [] if a.replace(*alias) == b else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if same and a.shape == b.shape and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a if str(k) not in IDENTITY for d in differences(a[k], b[k], f"{where}.{k}", alias)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]", alias)]
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return differences(vars(a), vars(b), where, alias)
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _real_mask(info: dict) -> list[torch.Tensor]:
    """A ZeRO-3 rank file's real elements per sub-group partition (``zero_partition_info``, the hooks' record): each
    parameter's slice ``ceil(n / dp)`` long, its tail past ``n`` padding, then the partition's tail. DeepSpeed allocates
    that padding uninitialized (``torch.empty``): two saves of one state differ there, and nothing reads it."""
    dp, rank, masks = int(info["dp_size"]), int(info["dp_rank"]), []
    for numels, size in zip(info["sub_group_numels"], info["partition_sizes"], strict=True):
        mask = torch.zeros(int(size), dtype=torch.bool)
        at = 0
        for n in numels:
            part = -(-int(n) // dp)
            mask[at : at + max(0, min(part, int(n) - rank * part))] = True
            at += part
        masks.append(mask)
    return masks


def _without_padding(state: Any) -> Any:
    """A ZeRO-3 rank file's fp32 partitions with their uninitialized padding zeroed (other files as they are)."""
    optim = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    info = optim.get("zero_partition_info") if isinstance(optim, dict) else None
    if not isinstance(info, dict) or info.get("zero_stage") != 3:
        return state
    flats = [t.masked_fill(~mask, 0) for t, mask in zip(optim["fp32_flat_groups"], _real_mask(info), strict=True)]
    return {**state, "optimizer_state_dict": {**optim, "fp32_flat_groups": flats}}


def record_sizes(path: Path) -> dict[str, int]:
    """A torch file's records by name (its archive folder's name left out) and size, the pickle aside: one record
    per storage, of the storage's size (a storage written larger than its tensors' differs here)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist() if not i.filename.endswith("data.pkl")}


def tag_differences(mine: Path, theirs: Path, alias: tuple[str, str] = ("", "")) -> list[str]:
    """Two tag folders' checkpoint files: the same names, each holding the same tensors (a ZeRO-3 partition's
    uninitialized padding aside: :func:`_real_mask`) in the same records of the same sizes (:func:`record_sizes`);
    ``alias`` as :func:`differences`."""
    names = sorted(p.name for p in mine.iterdir() if p.suffix == ".pt")
    other = sorted(p.name for p in theirs.iterdir() if p.suffix == ".pt")
    if names != other:
        return [f"{mine}: files {names} vs {other}"]
    out = []
    for name in names:
        a = _without_padding(torch.load(mine / name, map_location="cpu", weights_only=False))
        b = _without_padding(torch.load(theirs / name, map_location="cpu", weights_only=False))
        out += [f"{name}{d}" for d in differences(a, b, alias=alias)]
        if record_sizes(mine / name) != record_sizes(theirs / name):
            out.append(f"{name}: records {record_sizes(mine / name)} vs {record_sizes(theirs / name)}")
    return out
