"""A restart that falls back to the newest sound tag when the one ``latest`` names is not (docs/resume.md).

Each candidate, newest first, is judged on the first rank from what is known without reading its bytes (its folder,
its verdict: :mod:`megatron_ucp.background.restart_judge`, shared with ``status --check``); the first that passes is
loaded, and the load judges the rest. A refusal for damage in the tag's own files becomes its verdict; refusals that
may be the job's fault count against the load cap. Loudly, recorded in the store, nothing of a bad tag modified.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.background.restart_judge import (
    CAPPED,
    FILES,
    LATEST,
    LOAD,
    TWIN,
    UNREAD,
    Judgement,
    judge,
    older_tags,
)
from megatron_ucp.background.store import (
    FALLBACKS_LOG,
    clear_refused_restart,
    read_fallbacks,
    record_fallback,
    record_refused_restart,
    ucp_dir,
)
from megatron_ucp.background.verdicts import identity_digest, record_verdict, tag_identity
from megatron_ucp.errors import AccountingError, CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import tag_to_load
from megatron_ucp.integration.collectives import JOB, Failure, is_first
from megatron_ucp.plan.restart_walk import MAX_LOADS
from megatron_ucp.plan.tags import iterations_lost, tag_step

log = logging.getLogger(__name__)

CHECKED_BY = "restart"


@dataclass(frozen=True)
class Failed:
    tag: str
    problems: tuple[str, ...]
    kind: str = LOAD
    """``files``: the tag's own damage (found before any load from a recorded verdict or its save's file list, or by
    its load in the tag's own files); ``load``: its load refused it for what may be the job's fault; ``twin``: its
    universal twin is missing or was refused (not the tag's verdict); ``latest``: the ``latest`` file itself;
    ``capped``: not tried (:data:`~megatron_ucp.plan.restart_walk.MAX_LOADS`)."""

    def first(self) -> str:
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{self.problems[0]}{more}" if self.problems else "?"


def load_with_fallback(
    root: Path, load: Callable[[Optional[str]], Any], universal: bool, scheduler: Optional[Any] = None
) -> Any:
    """``load(tag)`` of the newest tag that passes (None: the tag ``latest`` names, loaded as today), falling back
    as the module says. ``load`` raises on every rank or on none (:meth:`~megatron_ucp.integration.collectives.
    Collective.agreed`), so that every rank walks the same candidates. ``universal``: the job loads universal folders
    (``--universal-checkpoint``), so an older tag is loaded through its complete twin. ``scheduler``: the engine's
    learning-rate scheduler, put back as it was before each load after a refused one (:class:`SchedulerAsBefore`).
    """
    latest, unreadable = JOB.decided(
        lambda: _start(root), f"{root}: cannot start the restart", root, kind=CheckpointFormatError
    )
    if latest is None and unreadable is None:
        return load(None)  # nothing to fall back from: DeepSpeed says there is no checkpoint
    as_before = SchedulerAsBefore(scheduler)
    failed: list[Failed] = [Failed(F.LATEST, (unreadable,), LATEST)] if unreadable is not None else []
    loads = tried = 0  # loads refused for what may be the job's fault; loads tried
    for tag in _candidates(root, latest):
        through_twin = universal and tag != latest
        problems, kind = _problems_of(JOB.decide(lambda: judge(root, tag, through_twin)))
        if problems:
            failed.append(Failed(tag, problems, kind))
            continue
        if loads == MAX_LOADS:
            failed.append(Failed(tag, (f"not tried: {MAX_LOADS} loads were refused before it",), CAPPED))
            break
        if tried:
            as_before.restore()
        tried += 1
        repeats = _repeats(root, latest, tag) if failed and is_first() else 0  # the store read once per tag loaded
        if failed and is_first():
            _announce(root, failed, tag, latest, repeats)
        try:
            result = load(None if tag == latest else _name_to_load(tag, universal))
        except UcpError as exc:  # raised on every rank alike (agreed), nothing trained
            kind = _refusal_kind(exc, root / tag, universal)  # under universal, latest's load reads its twin too
            if kind is None:
                raise
            failed.append(Failed(tag, (str(exc),), kind))
            loads += kind != FILES
            if is_first():
                log.error("megatron-ucp: the restart cannot load %s: %s", tag, _short(str(exc)))
            continue
        if is_first():
            clear_refused_restart(root)
            if failed:
                _record(root, failed, tag, latest, repeats)
        return result
    if is_first():
        _record_refused(root, failed, latest)
    raise CheckpointFormatError(_none_passed(root, failed), subject=root / F.LATEST)


def _refusal_kind(exc: UcpError, tag_dir: Path, universal: bool) -> Optional[str]:
    """Agreed on every rank (every rank has its own error; collective): ``files`` when any rank's error is damage in
    the tag's own files (:attr:`~megatron_ucp.errors.UcpError.damaged`), else ``load`` (``twin`` when the job loads
    universal folders: the twin's damage is not the tag's); None (raise it) when any rank's error is not a refusal of
    the checkpoint, or the agreement itself fails (a rank died: its own error says more)."""
    refusal = isinstance(exc, (CheckpointFormatError, AccountingError))
    damaged = getattr(exc, "damaged", None)
    here = os.path.abspath(tag_dir)
    own = damaged is not None and (os.path.abspath(damaged) + os.sep).startswith(here + os.sep)
    try:
        if JOB.count(0 if refusal else 1):
            return None
        if JOB.count(1 if own else 0):
            return FILES
    except Exception:  # the group is broken: raise this rank's own error
        return None
    return TWIN if universal else LOAD


class SchedulerAsBefore:
    """A learning-rate scheduler's own values (numbers, strings, their lists) as they were before the first load.

    A refused load may get as far as DeepSpeed's, which loads the scheduler; Megatron's ``OptimizerParamScheduler``
    adds the saved step count to its own there (``step(increment=num_steps)``), so the next load would count the
    refused tag's steps too (found under the real fork: 72 + 36 steps after falling back from global_step6 to
    global_step3). Every other thing a load places, it replaces whole."""

    def __init__(self, scheduler: Optional[Any]) -> None:
        self.scheduler = scheduler
        self.values = {k: copy.deepcopy(v) for k, v in vars(scheduler).items() if _plain(v)} if scheduler else {}

    def restore(self) -> None:
        for name, value in self.values.items():
            setattr(self.scheduler, name, copy.deepcopy(value))


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _start(root: Path) -> tuple[Optional[str], Optional[str]]:
    """First rank: ``(the tag latest names, why latest cannot be read)`` (both None: no ``latest``). Read once and
    shared: a rank that read ``latest`` on its own could see another value than the first (a save committing on a
    shared file system) and take a path without the others' collectives."""
    try:
        return tag_to_load(root, None, universal=False).tag, None
    except CheckpointFormatError as exc:  # empty after a power loss, garbage: the tags are still there
        return None, str(exc)


def _candidates(root: Path, latest: Optional[str]) -> Iterator[str]:
    """``latest``'s tag, then (only if it is needed: the root listed once, on the first rank) the older ones (every
    tag, newest first, when ``latest`` names none). Every rank walks the same candidates in the same order, so the
    collectives of the judge and the loads match."""
    if latest is not None:
        yield latest
    yield from JOB.decided(
        lambda: older_tags(root, latest),
        f"{root}: cannot list its tags to fall back to",
        root,
        kind=CheckpointFormatError,
    )


def _name_to_load(tag: str, universal: bool) -> str:
    return F.universal_tag(tag) if universal else tag


def _problems_of(outcome: "Judgement | Failure") -> tuple[tuple[str, ...], str]:
    if isinstance(outcome, Failure):  # the judge itself failed (an I/O error): passed over, no verdict
        return (outcome.message,), UNREAD
    return outcome.problems, outcome.kind


def _repeats(root: Path, latest: Optional[str], tag: str) -> int:
    """How many earlier restarts (the store's record) fell back from ``latest``, its files as they are now, to
    ``tag``: the same work lost again at each (a later save of ``latest`` that is damaged anew starts a new count)."""
    if latest is None:
        return 0
    files = identity_digest(root / latest)
    return sum(
        1
        for e in read_fallbacks(root)
        if e.get("latest") == latest and e.get("loaded") == tag and e.get("latest_files", files) == files
    )


def _announce(root: Path, failed: list[Failed], tag: str, latest: Optional[str], repeats: int) -> None:
    lines = "\n  ".join(f"{f.tag}: {_short(f.first())}" for f in failed)
    if repeats:
        new, old = tag_step(latest), tag_step(tag)
        total = f"{(repeats + 1) * (new - old)} iterations" if new is not None and old is not None else "more"
        log.error(
            "megatron-ucp: !!! REPEATED FALLBACK: this is restart %d to fall back from %s to %s (%s lost in all, "
            "recorded in %s): every restart since the first has trained the same iterations again. The job does "
            "not get past %s: look at its log before requeueing it (docs/resume.md: stopping a requeue loop)",
            repeats + 1,
            latest,
            tag,
            total,
            ucp_dir(root) / FALLBACKS_LOG,
            latest,
        )
    log.warning(
        "megatron-ucp: !!! FALLING BACK: %s %s, which cannot be resumed:\n  %s\n"
        "loading %s instead (loses %s); nothing of the failed tag(s) is changed (--ucp-no-fallback: stop instead)",
        root / F.LATEST,
        f"names {latest}" if latest is not None else "names no tag",
        lines,
        tag,
        _lost(root, latest, tag),
    )


def _record(root: Path, failed: list[Failed], tag: str, latest: Optional[str], repeats: int) -> None:
    """The restart's fallback and each failed tag's verdict, in the store (never raises: the job goes on)."""
    for f in failed:
        if _verdict_to_record(root, f):
            record_verdict(root, f.tag, list(f.problems), CHECKED_BY, tag_identity(root / f.tag))
    entry = {
        "at": time.time(),
        "latest": latest,
        "loaded": tag,
        "lost": _lost(root, latest, tag),
        "repeat": repeats + 1,
        "latest_files": identity_digest(root / latest) if latest is not None else None,
        "failed": [{"tag": f.tag, "problems": list(f.problems[:5])} for f in failed],
    }
    record_fallback(root, entry)


def _verdict_to_record(root: Path, f: Failed) -> bool:
    """A failed tag whose problems become its verdict: damage in its own files (found before a load or by it), not
    already a recorded verdict, its folder there; never a refusal the job may be at fault for, nor one of its
    universal twin (the tag itself may be sound)."""
    if f.kind != FILES or not f.problems:
        return False
    return "(found by " not in f.problems[0] and (root / f.tag).is_dir()


def _lost(root: Path, latest: Optional[str], tag: str) -> str:
    return iterations_lost(latest, tag, latest is None or (root / latest).is_dir())


def _record_refused(root: Path, failed: list[Failed], latest: Optional[str]) -> None:
    """No tag passed: each tag tried, its first problem, the kind and its files as they were, for ``status`` (a
    restart as it is fails again until a file or the job changes). Verdicts only for damage in a tag's own files: a
    load refused otherwise is not one (the job itself may be at fault)."""
    for f in failed:
        if f.kind == FILES and _verdict_to_record(root, f):
            record_verdict(root, f.tag, list(f.problems), CHECKED_BY, tag_identity(root / f.tag))
    record_refused_restart(
        root,
        {
            "at": time.time(),
            "latest": latest,
            "failed": [
                {"tag": f.tag, "problem": _short(f.first()), "kind": f.kind, "files": identity_digest(root / f.tag)}
                for f in failed
                if f.tag != F.LATEST
            ],
        },
    )


def _none_passed(root: Path, failed: list[Failed]) -> str:
    lines = "\n  ".join(f"{f.tag}: {_short(f.first())}" for f in failed)
    refused = [f for f in failed if f.kind in (LOAD, TWIN)]
    why = (
        f"{len(refused)} load(s) refused for what may be this job's fault, not the tags' files (a model, optimizer or "
        "command line that differs from the checkpoint's: the first refusal below says which and what to change)"
        if refused
        else "every tag's own files are damaged"
    )
    return (
        f"cannot resume from {root}: no tag passes ({len(failed)} tried, newest first; {why}); nothing was "
        f"trained:\n  {lines}\n`megatron-ucp status {root}` shows every tag; `megatron-ucp verify {root} --tag TAG` "
        "checks one"
    )


def _short(message: str, limit: int = 600) -> str:
    one = " ".join(message.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."
