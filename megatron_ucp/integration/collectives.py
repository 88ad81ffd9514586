"""Collective helpers of the hooks: the process group's first rank decides, everyone learns.

The hooks run inside training, on every rank. A decision that needs the file system (which route
a load takes, what a folder holds) is made once, by the group's first rank, and broadcast; if
that rank fails, every rank raises the same error instead of some waiting forever
(:func:`decide_on_first`). Collectives go through ``torch.distributed`` itself and the
accelerator's device (gloo/CPU, ccl/XPU, nccl/CUDA).
"""

from __future__ import annotations

import atexit
import collections
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import UcpError, briefly, described


def comm() -> Any:
    """``torch.distributed`` itself, not ``deepspeed.comm``: DeepSpeed's wrappers differ between
    versions (0.19.5's ``log_wrapper`` raises ``KeyError: 'log_name'`` on ``broadcast_object_list``
    when the comms logger is on, as Megatron-DeepSpeed configures it), while the process groups
    DeepSpeed hands out are torch's own."""
    import torch.distributed as dist

    return dist


def device() -> torch.device:
    """The accelerator's current device, as DeepSpeed's accelerator abstraction names it."""
    return torch.device(surface.accelerator().current_device_name())


def broadcast_from_first(value: Any, group: Any = None) -> Any:
    """``value`` of the group's first rank on every rank of the group."""
    dist = comm()
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


_LENT: "collections.deque[torch.Tensor]" = collections.deque(maxlen=16)
"""The small tensors of the latest collectives (tallies, flags), held a while longer than the caller holds them. The
backend's worker thread (gloo's run loop) drops its reference to a finished collective's tensors after the caller's
wait returns; when that reference is the last, freeing the tensor's Python object takes the interpreter lock there,
and at the interpreter's exit that thread is ended by it: ``terminate called without an active exception``, the
rank killed by SIGABRT. Held here, they are freed by the main thread, and the exit handler gives that thread a
moment to let go of them first (a busy machine may not have run it since the last collective). A job's last
collective is such a tally (the load's agreement); large buffers are not held (memory), their collectives are never
the last."""
_LEND_MAX_BYTES = 1 << 20
_EXIT_GRACE_S = 0.05
_AT_EXIT = {"registered": False}


def _lend(*tensors: torch.Tensor) -> None:
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(time.sleep, _EXIT_GRACE_S)  # the interpreter lock released: the backend's threads let go
    _LENT.extend(t for t in tensors if t.numel() * t.element_size() <= _LEND_MAX_BYTES)


def all_reduce(tensor: torch.Tensor, group: Any = None, op: Any = None) -> torch.Tensor:
    """``tensor`` summed (or ``op``) across the group, in place; every hooked all-reduce goes through here."""
    dist = comm()
    _lend(tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


def all_gather(boxes: list[torch.Tensor], mine: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``mine`` into ``boxes`` (small ones held as :data:`_LENT` says)."""
    _lend(mine, *boxes)
    comm().all_gather(boxes, mine, group=group)
    return boxes


def count_across(flag: int, group: Any = None) -> int:
    """Sum of one small integer across the group (also a barrier)."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device())
    return int(all_reduce(t, group).item())


def gather_names(names: Iterable[str], group: Any = None) -> set[str]:
    """The union of every rank's ``names`` (small: parameter names), on every rank of the group."""
    dist = comm()
    boxes: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(boxes, sorted(names), group=group)
    return {name for box in boxes for name in box}


def is_first(group: Any = None) -> bool:
    return comm().get_rank(group=group) == 0


@dataclass(frozen=True)
class Failure:
    """An exception on the deciding rank, shipped to the others so that all raise together."""

    message: str
    kind: str = "UcpError"
    """The exception's class name: :meth:`error` raises the package's class of that name."""
    damaged: Optional[str] = None
    """The exception's :attr:`~megatron_ucp.errors.UcpError.damaged`, as a string."""

    def error(self, message: str, subject: Any = None) -> Exception:
        damaged = Path(self.damaged) if self.damaged is not None else None
        return _error_class(self.kind)(message, subject=subject, damaged=damaged)


T = TypeVar("T")


def decide_on_first(decide: Callable[[], T], group: Any = None) -> "T | Failure":
    """``decide()`` on the group's first rank, its value on every rank.

    When it raises, every rank gets a :class:`Failure` naming the exception (the caller raises its
    own error with it), so that no rank is left waiting in a collective the first one never reaches; so does every
    rank when the decision cannot be sent, or cannot be read on any rank (one more small all-reduce: agreed).
    """
    payload: Optional[bytes] = None
    if is_first(group):
        try:  # what cannot be sent fails here, on the first rank, not inside the broadcast
            payload = pickle.dumps(decide())
        except Exception as exc:
            damaged = getattr(exc, "damaged", None)
            payload = pickle.dumps(
                Failure(described(exc), type(exc).__name__, None if damaged is None else str(damaged))
            )
    payload = broadcast_from_first(payload, group)  # bytes: every rank receives them
    try:  # what one rank cannot read (a class only the first rank imports) fails every rank alike
        outcome, unread = pickle.loads(payload), None
    except Exception as exc:
        outcome, unread = None, exc
    if count_across(1 if unread is not None else 0, group):
        why = described(unread) if unread is not None else "another rank could not read it"
        return Failure(f"the first rank's decision could not be read here: {why}", "UcpError")
    return outcome


def raise_together(error: Optional[BaseException], what: str, subject: Any = None, group: Any = None) -> None:
    """The cross-rank failure protocol after a step each rank did on its own: when any rank of the group
    failed (``error``), every rank raises one error carrying the failing ranks' own messages (each names
    its file), not "see their log". Collective: every rank calls it, failed or not; a small integer
    all-reduce when nobody failed, and one gather of the messages when somebody did."""
    if count_across(1 if error is not None else 0, group):
        raise_gathered(error, what, subject, group)


def agreed(step: Callable[[], T], what: str, subject: Any = None) -> T:
    """``step()``'s value, or, when it raised a package error on any rank of the job, that error on every rank.

    For a step whose own checks agree only within smaller groups (a load binds each DP group's rank files: at TP or
    PP > 1, or with expert groups, a damaged file refuses it in one group alone) and which must not leave the other
    ranks going on. One small all-reduce after the step (a gather of the messages when only some ranks failed).
    Inside ``step``, no rank may start a job-wide collective after a point where another may have raised."""
    error: Optional[UcpError] = None
    result: Any = None
    try:
        result = step()
    except UcpError as exc:
        error = exc
    try:
        failed = count_across(1 if error is not None else 0)
    except Exception as exc:  # a rank died: this rank's own error says more than the broken collective
        if error is not None:
            raise error from exc
        raise UcpError(
            f"megatron-ucp: {what}: the job's agreement after it failed ({briefly(exc)}): another "
            "rank died or failed; do not train on this engine, restart the job",
            subject=subject,
        ) from exc
    if error is not None and failed == comm().get_world_size():
        raise error  # every rank has its own, naming its files
    if failed:
        raise_gathered(error, what, subject)
    return result


def raise_gathered(error: Optional[BaseException], what: str, subject: Any = None, group: Any = None) -> None:
    """The second half of :func:`raise_together`, for callers that learned "somebody failed" from a
    collective of their own: every rank calls it, and every rank raises the same error."""
    dist = comm()
    boxes: list[Any] = [None] * dist.get_world_size(group=group)
    damaged = getattr(error, "damaged", None)
    mine = None
    if error is not None:
        mine = (dist.get_rank(), type(error).__name__, str(error).strip(), None if damaged is None else str(damaged))
    dist.all_gather_object(boxes, mine, group=group)
    reports = [box for box in boxes if box is not None]
    messages = list(dict.fromkeys(message for _, _, message, _ in reports))
    shown = "\n  ".join(messages[:SHOWN_FAILURES])
    more = f"\n  ... and {len(messages) - SHOWN_FAILURES} more" if len(messages) > SHOWN_FAILURES else ""
    ranks = ", ".join(str(rank) for rank, _, _, _ in reports[:8]) + (" ..." if len(reports) > 8 else "")
    kind = _one_class([_error_class(name) for _, name, _, _ in reports])
    # one rank's file found damaged makes the checkpoint's damage the error, whatever the other ranks found
    damaged = next((Path(found) for _, _, _, found in reports if found is not None), None)
    raise kind(
        f"{what} failed on {len(reports)} rank(s) (global rank {ranks}):\n  {shown}{more}",
        subject=subject,
        damaged=damaged,
    )


SHOWN_FAILURES = 10


def _one_class(classes: list[type]) -> type:
    """The class of an error several ranks raised in their own classes, whatever the ranks' order: theirs when they
    agree; a refusal of the checkpoint when every one is (a format or accounting problem); else the package's base
    class (what is not a refusal is not taken for one)."""
    from megatron_ucp import errors

    if len(set(classes)) == 1:
        return classes[0]
    if all(issubclass(c, (errors.CheckpointFormatError, errors.AccountingError)) for c in classes):
        return errors.CheckpointFormatError
    return errors.UcpError


def _error_class(name: str) -> type:
    """The package's error class of that name (the failing rank's kind), else :class:`UcpError`."""
    from megatron_ucp import errors

    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, errors.UcpError) else errors.UcpError
