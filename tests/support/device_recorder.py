"""A recording accelerator for harness ranks: every device megatron-ucp asks for, places a tensor on,
or hands to a collective, written down at run time.

Installed by the harness worker when ``UCP_HARNESS_RECORD_DEVICES=1`` (``TrainSpec.env``), before
``deepspeed.initialize``; each rank writes its records to ``<dump_dir>/devices_rank<r>.json``.

On a CPU the engine's device and the host are the same device, so a hook that assumed ``cpu`` would
pass every test. Here DeepSpeed's accelerator hands megatron-ucp (and only megatron-ucp: DeepSpeed
itself still gets ``cpu``) a device spelled ``cpu:0``, which no default and no hard-coded ``"cpu"``
spells. A ``TorchFunctionMode`` then records, for every torch call made from a ``megatron_ucp``
frame, the device it places on (``device=``, ``.to(device)``), and wrappers around
``torch.distributed`` record every collective and group our code calls. What the records must show
(``tests/support/device_policy.py``): placements on the accelerator's device, or on the host at the
listed places; collectives only on tensors placed through the accelerator, on groups the job made.
It also writes down every opening of a checkpoint's ``*_states.pt`` file for reading, by anyone (the
native reshard promises each rank opens its model-states file once).
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MARKED = "cpu:0"
"""How the recording accelerator spells its device to megatron-ucp."""
PACKAGE = "megatron_ucp"
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "all_to_all_single",
)
GROUP_MAKERS = ("new_group", "init_process_group")


def _caller(depth: int) -> Any:
    """The frame that made the call, and only that one: torch's own Python code calling torch (an
    object collective's inner broadcast) is torch's placement, not ours."""
    return sys._getframe(depth + 1)


def _ours(frame: Any) -> bool:
    return frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == PACKAGE


def _where(frame: Any) -> dict[str, Any]:
    path = Path(frame.f_code.co_filename)
    parts = path.parts
    rel = "/".join(parts[len(parts) - 1 - parts[::-1].index(PACKAGE) + 1 :]) if PACKAGE in parts else path.name
    return {"file": rel, "function": frame.f_code.co_name, "line": frame.f_lineno}


def _placement(func: Any, args: tuple, kwargs: dict) -> "Any | None":
    """The device a torch call places its result on, when it names one."""
    if "device" in kwargs:
        return kwargs["device"]
    if getattr(func, "__name__", "") == "to":
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                return arg
    return None


def _spell(device: Any) -> str:
    return (
        str(device)
        if isinstance(device, str)
        else f"{device.type}:{device.index}"
        if device.index is not None
        else device.type
    )


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._placed: dict[int, torch.Tensor] = {}  # tensors placed with the accelerator's device (kept alive)

    def note(self, kind: str, frame: Any, **fields: Any) -> None:
        self.events.append({"kind": kind, **_where(frame), **fields})

    def placed(self, frame: Any, device: Any, out: Any) -> None:
        spelled = _spell(device)
        self.note("place", frame, device=spelled, numel=int(out.numel()) if torch.is_tensor(out) else None)
        if spelled == MARKED and torch.is_tensor(out):
            self._placed[id(out)] = out

    def collective(self, frame: Any, name: str, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        self.note(
            "collective",
            frame,
            name=name,
            tensors=len(tensors),
            through_accelerator=all(id(t) in self._placed for t in tensors),
        )

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.events, indent=0))


class _RecordingMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = _placement(func, args, kwargs)
        if device is not None:
            frame = _caller(1)
            if _ours(frame):
                self.recorder.placed(frame, device, out)
        return out


def _recording_accelerator(base: type, recorder: Recorder) -> Any:
    class RecordingAccelerator(base):
        """DeepSpeed's CPU accelerator, spelling its device ``cpu:0`` to megatron-ucp."""

        def current_device_name(self):
            frame = _caller(1)
            if _ours(frame):
                recorder.note("ask", frame)
                return MARKED
            return super().current_device_name()

    return RecordingAccelerator()


def _wrap_distributed(recorder: Recorder) -> None:
    import torch.distributed as dist

    def wrap(name: str, record: Any) -> None:
        original = getattr(dist, name)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            frame = _caller(1)
            if _ours(frame):
                record(frame, name, args, kwargs)
            return original(*args, **kwargs)

        setattr(dist, name, recorded)

    for name in COLLECTIVES:
        if hasattr(dist, name):
            wrap(name, recorder.collective)
    for name in GROUP_MAKERS:
        wrap(
            name,
            lambda frame, name, args, kwargs: recorder.note(
                "group", frame, name=name, backend=str(kwargs.get("backend"))
            ),
        )


STATES_SUFFIX = "_states.pt"


def _opener(frame: Any) -> str:
    """The innermost megatron-ucp or DeepSpeed function on the stack (who asked for the file)."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] in (PACKAGE, "deepspeed"):
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _record_reads(recorder: Recorder) -> None:
    """Note each opening of a ``*_states.pt`` file for reading (``open`` and ``os.open``)."""
    original_open, original_os_open = builtins.open, os.open

    def note(path: Any) -> None:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(STATES_SUFFIX):
            recorder.events.append({"kind": "read", "path": os.fspath(path), "by": _opener(sys._getframe(2))})

    @functools.wraps(original_open)
    def recording_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not set(mode) & set("wax+"):
            note(file)
        return original_open(file, mode, *args, **kwargs)

    @functools.wraps(original_os_open)
    def recording_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
        if flags & os.O_ACCMODE == os.O_RDONLY:
            note(path)
        return original_os_open(path, flags, *args, **kwargs)

    builtins.open, os.open = recording_open, recording_os_open


def install() -> Recorder:
    """Swap in the recording accelerator, wrap the collectives, enter the recording mode (for the
    rest of the process)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    recorder = Recorder()
    set_accelerator(_recording_accelerator(type(get_accelerator()), recorder))
    _wrap_distributed(recorder)
    _record_reads(recorder)
    _RecordingMode(recorder).__enter__()
    return recorder
