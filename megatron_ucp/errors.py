"""The package's one exception type.

Every user-facing failure raises :class:`UcpError` (or a subclass) with a message that names the
offending file, parameter or state and says what to do. The CLI turns it into one line on stderr
and a non-zero exit; nothing is reported with ``assert``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence


class UcpError(Exception):
    """A failure the user can act on. ``subject`` is the offending object (path, parameter, ...). ``damaged``: the
    checkpoint file or folder whose own damage this reports (missing, cut short, unreadable, written over since its
    save, a sum or a NaN that its save did not hold): whatever job reads it meets the same. None when the failure may
    be the job's (a model or optimizer that differs from the checkpoint's): a restart's fallback records the first
    as the tag's verdict and counts only the second against its load cap."""

    def __init__(self, message: str, subject: Any = None, damaged: Any = None):
        super().__init__(message)
        self.subject = subject
        self.damaged = damaged


class CheckpointFormatError(UcpError):
    """A checkpoint file or folder is missing, corrupt, inconsistent or not what it claims to be."""


class SaveFailedError(UcpError):
    """A rank could not write its files of a save: the save is not ``latest`` and the job must not go on as if
    it were."""


class PlanError(UcpError):
    """A conversion or load plan failed its checks (gap, overlap, out-of-bounds fragment)."""


class UnsupportedError(UcpError):
    """A configuration this version cannot handle correctly (ZeRO-3, an unknown DeepSpeed release, ...)."""


class StockFormError(UnsupportedError):
    """A save in a form megatron-ucp does not read and stock DeepSpeed's own load does (a ZeRO
    ``elastic_checkpoint``): a load steps aside to DeepSpeed's, with one warning, instead of refusing it."""


class OutputExistsError(UcpError):
    """The output is already there; pass ``--force`` (``force=True``) to replace it."""


class AlreadyConvertedError(OutputExistsError):
    """The output is a complete conversion of this very save: nothing to do (the CLI says so and exits 0)."""


class AccountingError(UcpError):
    """A load did not account for every tensor of the checkpoint (the PyTorch DCP lesson)."""


def described(exc: BaseException) -> str:
    """``Type: message`` of an exception. A foreign one's message goes on one line: a third party's may span
    several (pickle's does), and each problem this tool reports is one line; this tool's own errors keep the
    lines they were written with (a list of problems, one per line)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if isinstance(exc, UcpError) else " ".join(text.split())


def briefly(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an exception, the line cut at ``limit`` characters: a foreign failure quoted inside
    one of this tool's messages (gloo's span several lines)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {first[:limit]}"


def refuse_or_warn(
    strict: bool, error: UcpError, warnings: Sequence[str], logger: logging.Logger, say: bool, then: str = "continuing"
) -> None:
    """Strictness, decided in one place: ``error`` raised (``strict``, the default everywhere), else each of
    ``warnings`` logged, by the rank that speaks (``say``), saying what happens ``then``."""
    if strict:
        raise error
    if say:
        for warning in warnings:
            logger.warning("megatron-ucp (strict=False, %s): %s", then, warning)
