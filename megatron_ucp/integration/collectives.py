"""The hooks' collectives, in one wrapper (:class:`Collective`): the group's first rank decides and everyone
learns; sums, gathers and refusals reach every rank alike, so that a failure on one rank is the same error on every
rank, never a rank left waiting. Through ``torch.distributed`` itself and the accelerator's device.
"""

from __future__ import annotations

import atexit
import collections
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import torch

from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import StockFormError, UcpError, briefly, described, refuse_or_warn


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


def let_go_at_exit() -> None:
    """At the exit, after collectives an exit handler waited for: the backend's threads given the moment to let go of
    their tensors (:data:`_LENT`)."""
    time.sleep(_EXIT_GRACE_S)


def _lend(*tensors: torch.Tensor) -> None:
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(time.sleep, _EXIT_GRACE_S)  # the interpreter lock released: the backend's threads let go
    _LENT.extend(t for t in tensors if t.numel() * t.element_size() <= _LEND_MAX_BYTES)


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


class Collective:
    """One process group's collectives (None: the whole job), shaped like PyTorch DCP's ``_DistWrapper``: each either
    gives every rank of the group the same value or raises the same error on every rank, so that no rank is left
    waiting in a collective another never reaches. Every collective of the save and the resume goes through here,
    on the accelerator's device (gloo/CPU, ccl/XPU, nccl/CUDA), or on the host for a gloo group beside them
    (``host``: the memory saves')."""

    def __init__(self, group: Any = None, host: bool = False) -> None:
        self.group = group
        self.host = host
        """Its tensors on the host: a gloo group beside an accelerator's backend."""

    def tensor_device(self) -> torch.device:
        """Where this group's tensors live: the host for a host group, else the accelerator's device."""
        return torch.device("cpu") if self.host else device()

    @property
    def rank(self) -> int:
        return comm().get_rank(group=self.group)

    @property
    def size(self) -> int:
        return comm().get_world_size(group=self.group)

    @property
    def first(self) -> bool:
        """This rank is the group's first: the one that decides, and the one that speaks."""
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """``value`` of the group's first rank on every rank of the group."""
        dist = comm()
        box = [value]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def decide(self, decide: Callable[[], T]) -> "T | Failure":
        """``decide()`` on the group's first rank, its value on every rank. When it raises, every rank gets a
        :class:`Failure` naming the exception (the caller raises its own error with it); so does every rank when the
        decision cannot be sent, or cannot be read on any rank (one more small all-reduce: agreed)."""
        payload: Optional[bytes] = None
        if self.first:
            try:  # what cannot be sent fails here, on the first rank, not inside the broadcast
                payload = pickle.dumps(decide())
            except Exception as exc:
                damaged = getattr(exc, "damaged", None)
                payload = pickle.dumps(
                    Failure(described(exc), type(exc).__name__, None if damaged is None else str(damaged))
                )
        payload = self.broadcast(payload)  # bytes: every rank receives them
        try:  # what one rank cannot read (a class only the first rank imports) fails every rank alike
            outcome, unread = pickle.loads(payload), None
        except Exception as exc:
            outcome, unread = None, exc
        if self.count(1 if unread is not None else 0):
            why = described(unread) if unread is not None else "another rank could not read it"
            return Failure(f"the first rank's decision could not be read here: {why}", "UcpError")
        return outcome

    def decided(self, decide: Callable[[], T], what: str, subject: Any = None, kind: Optional[type] = None) -> T:
        """:meth:`decide`'s value, or its failure raised on every rank as ``what: message``, of ``kind`` (None: the
        failing exception's own class; a :class:`~megatron_ucp.errors.StockFormError` stays one: the caller steps
        aside to DeepSpeed's own load)."""
        outcome = self.decide(decide)
        if not isinstance(outcome, Failure):
            return outcome
        error = outcome.error(f"{what}: {outcome.message}", subject)
        if kind is not None and not isinstance(error, StockFormError):
            error = kind(str(error), subject=subject, damaged=error.damaged)
        raise error

    def sum(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        """``tensor`` summed (or ``op``) across the group, in place."""
        dist = comm()
        _lend(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
        return tensor

    def total(self, table: torch.Tensor) -> torch.Tensor:
        """A host table summed over the group (on the device, back on the host): the same rows on every rank."""
        return self.sum(table.to(self.tensor_device())).cpu()

    def count(self, flag: int) -> int:
        """Sum of one small integer across the group (also a barrier)."""
        return int(self.sum(torch.tensor([int(flag)], dtype=torch.int64, device=self.tensor_device())).item())

    def gather(self, boxes: list[torch.Tensor], mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``mine`` into ``boxes``."""
        _lend(mine, *boxes)
        comm().all_gather(boxes, mine, group=self.group)
        return boxes

    def gather_objects(self, mine: Any) -> list[Any]:
        """Every rank's small picklable ``mine``, in rank order, on every rank."""
        boxes: list[Any] = [None] * self.size
        comm().all_gather_object(boxes, mine, group=self.group)
        return boxes

    def names(self, names: Iterable[str]) -> set[str]:
        """The union of every rank's ``names`` (small: parameter names)."""
        return {name for box in self.gather_objects(sorted(names)) for name in box}

    def refuse_or_warn(
        self, strict: bool, error: UcpError, warnings: Sequence[str], logger: Any, then: str = "continuing"
    ) -> None:
        """:func:`~megatron_ucp.errors.refuse_or_warn`, a decision every rank makes alike; the first rank speaks."""
        refuse_or_warn(strict, error, warnings, logger, say=self.first, then=then)

    def together(self, error: Optional[BaseException], what: str, subject: Any = None) -> None:
        """After a step each rank did on its own: when any rank failed (``error``), every rank raises one error
        carrying the failing ranks' own messages (each names its file). A small all-reduce when nobody failed."""
        if self.count(1 if error is not None else 0):
            self.raise_gathered(error, what, subject)

    def raise_gathered(self, error: Optional[BaseException], what: str, subject: Any = None) -> None:
        """The second half of :meth:`together`, for callers that learned "somebody failed" from a collective of
        their own: every rank calls it, every rank raises the same error."""
        damaged = getattr(error, "damaged", None)
        mine = None
        if error is not None:
            mine = (
                comm().get_rank(),
                type(error).__name__,
                str(error).strip(),
                None if damaged is None else str(damaged),
            )
        reports = [box for box in self.gather_objects(mine) if box is not None]
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

    def agreed(self, step: Callable[[], T], what: str, subject: Any = None) -> T:
        """``step()``'s value, or, when it raised a package error on any rank of the group, that error on every rank.

        For a step whose own checks agree only within smaller groups (a load binds each DP group's rank files: at TP
        or PP > 1, or with expert groups, a damaged file refuses it in one group alone) and which must not leave the
        other ranks going on. Inside ``step``, no rank may start a collective of this group after a point where
        another may have raised."""
        error: Optional[UcpError] = None
        result: Any = None
        try:
            result = step()
        except UcpError as exc:
            error = exc
        try:
            failed = self.count(1 if error is not None else 0)
        except Exception as exc:  # a rank died: this rank's own error says more than the broken collective
            if error is not None:
                raise error from exc
            raise UcpError(
                f"megatron-ucp: {what}: the job's agreement after it failed ({briefly(exc)}): another "
                "rank died or failed; do not train on this engine, restart the job",
                subject=subject,
            ) from exc
        if error is not None and failed == self.size:
            raise error  # every rank has its own, naming its files
        if failed:
            self.raise_gathered(error, what, subject)
        return result


JOB = Collective()
"""The whole job's collectives."""


def is_first(group: Any = None) -> bool:
    return Collective(group).first


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
