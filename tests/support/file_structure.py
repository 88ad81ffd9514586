"""What a checkpoint file holds, as a flat map path -> description, to compare two saves key for key.

A description keeps what the layout is made of (types, tensor shapes, dtypes, the size of the
storage a tensor views, ints and bools, DeepSpeed objects' pickled arguments and state) and drops
what a run decides (floats: learning rates, losses, RNG tuples). Loaded with lightpickle, so
DeepSpeed's objects compare by how they were pickled, not by which DeepSpeed is installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from megatron_ucp.format.lightpickle import PICKLE_MODULE, StandIn


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=PICKLE_MODULE)


def describe(obj: Any, path: str = "", out: Optional[dict[str, Any]] = None, values: bool = True) -> dict[str, Any]:
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage().nbytes() // max(obj.element_size(), 1)
        out[path] = ("tensor", tuple(obj.shape), str(obj.dtype), storage)
    elif isinstance(obj, dict):
        out[path] = (type(obj).__name__, len(obj))
        for k, v in obj.items():
            describe(v, f"{path}/{k}", out, values)
    elif isinstance(obj, (list, tuple)):
        out[path] = (type(obj).__name__, len(obj))
        if all(isinstance(x, (bool, int, str)) for x in obj) and values:
            out[path] += (tuple(obj),)
        else:
            for i, x in enumerate(obj):
                describe(x, f"{path}[{i}]", out, values)
    elif isinstance(obj, StandIn):
        out[path] = (
            "deepspeed",
            type(obj)._ucp_module,
            type(obj)._ucp_name,
            obj.__dict__.get("_ucp_how"),
            repr(obj.__dict__.get("_ucp_args")) if values else None,
            sorted((obj.__dict__.get("_ucp_state") or {}).keys())
            if isinstance(obj.__dict__.get("_ucp_state"), dict)
            else None,
        )
    elif isinstance(obj, argparse.Namespace):
        out[path] = ("Namespace",)
    elif isinstance(obj, (bool, int, str)) or obj is None:
        out[path] = (type(obj).__name__, obj if values else None)
    else:
        out[path] = (type(obj).__name__,)
    return out


RUN_VALUES = (
    "/lr_scheduler/",
    "/rng_state",
    "/optimizer_state_dict/zero_partition_checksums/groups",
    "/ucp_save_record/save_id",
    "/optimizer_state_dict/ucp_save_record/save_id",
)
"""Where a value is what the run did (schedule counters, RNG states, the checksums of its values, the
save's random identity): compared by kind, not value."""


def differences(real: dict[str, Any], synthetic: dict[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """Lines naming every path where the two descriptions differ (``ignore``: path prefixes)."""
    skip = tuple(ignore)
    lines = []
    for key in sorted(set(real) | set(synthetic)):
        if skip and key.startswith(skip):
            continue
        a, b = real.get(key, "<absent>"), synthetic.get(key, "<absent>")
        if key.startswith(RUN_VALUES) and isinstance(a, tuple) and isinstance(b, tuple):
            a, b = a[:2] if a[0] in ("tuple", "list") else a[:1], b[:2] if b[0] in ("tuple", "list") else b[:1]
        if a != b:
            lines.append(f"{key or '/'}: real {str(a)[:200]} != synthetic {str(b)[:200]}")
    return lines


def folder_differences(
    real_tag: Path, synthetic_tag: Path, ignore: Iterable[str] = (), drop: Iterable[str] = ()
) -> list[str]:
    """File names, then every file's description, of two tag folders. ``drop``: top-level keys
    removed from both before comparing (a client state one side has and the other cannot)."""
    names_real = sorted(p.name for p in real_tag.iterdir())
    names_syn = sorted(p.name for p in synthetic_tag.iterdir())
    if names_real != names_syn:
        return [f"files: real {names_real} != synthetic {names_syn}"]
    lines = []
    for name in names_real:
        real, synthetic = load(real_tag / name), load(synthetic_tag / name)
        for key in drop:
            real.pop(key, None)
            synthetic.pop(key, None)
        lines += [f"{name}: {d}" for d in differences(describe(real), describe(synthetic), ignore)]
    return lines
