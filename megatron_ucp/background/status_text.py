"""What ``megatron-ucp status`` prints: the table of tags, the details that do not fit in it, what a restart would
load, the command that fixes what can be fixed, and why a folder given is not a checkpoint root."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from megatron_ucp.background import queue as B
from megatron_ucp.background.status import RootStatus, TwinState, UniversalStatus, to_repoint
from megatron_ucp.deepspeed.folder import is_native_tag
from megatron_ucp.deepspeed.reader import human_bytes
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.relaunch import loop_summary


def _size(n: Optional[int]) -> str:

    return "-" if n is None else human_bytes(n)


def format_status(rs: RootStatus) -> str:
    """A table, one row per tag, then the details that do not fit in it."""
    hf = any(t.hf_export for t in rs.tags)
    header = ("tag", "native", "verified", "universal", "DP", "native size", "universal size", "conversion")
    header += ("HF export",) if hf else ()
    table = [header]
    for t in rs.tags:
        marks = (" [latest]" if t.latest else "") + (" [latest_universal]" if t.latest_universal else "")
        uni = t.universal.value + (f" {t.detail}" if t.universal is UniversalStatus.IN_PROGRESS and t.detail else "")
        table.append(
            (
                t.tag + marks,
                "yes" if t.native else "no",
                (t.verified or "-") if t.native else "-",
                uni,
                (str(t.dp) if t.dp is not None else "-") + (f" (EP={t.ep})" if t.ep is not None else ""),
                _size(t.native_bytes),
                _size(t.universal_bytes),
                B.fmt_seconds(t.seconds),
                *((t.hf_export or "-",) if hf else ()),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"{rs.root}: latest = {rs.latest or '-'}, latest_universal = {rs.latest_universal or '-'}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    notes = [
        f"  {t.tag}: {t.universal.value}: {t.detail}"
        for t in rs.tags
        if t.detail and t.universal is not UniversalStatus.IN_PROGRESS
    ]
    notes += [f"  {t.tag}: {t.verified}: {t.verdict}" for t in rs.tags if t.verified in ("unsound", "outdated")]
    notes += [f"  {t.hf_detail}" for t in rs.tags if t.hf_export not in (None, TwinState.COMPLETE.value, "removed")]
    notes += [f"  {problem}" for problem in rs.problems]
    if rs.last_fallback is not None:
        f = rs.last_fallback
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(f.get("at", 0))))
        failed = "; ".join(f"{x.get('tag')}: {(x.get('problems') or ['?'])[0]}" for x in f.get("failed") or [])
        notes.append(
            f"  last restart that fell back ({when}): loaded {f.get('loaded')} ({f.get('lost')} lost): {failed}"
        )
    if rs.relaunches:
        first = rs.relaunches[0]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(first.get("started", first.get("at", 0)))))
        notes.append(f"  last relaunch loop ({when}): {loop_summary(rs.relaunches)}")
    if rs.memory_restart is not None:
        m = rs.memory_restart
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(m.get("at", 0))))
        notes.append(f"  last restart with memory saves on its nodes ({when}): {m.get('said')}")
    if notes:
        lines += ["", "details:"] + notes
    lines += [""] + ([f"background converters: {c}" for c in rs.converters] or ["background converters: none running"])
    lines.append(f"restart: {rs.resume_answer().said}")
    latest_row = next((t for t in rs.tags if t.tag == rs.latest), None)
    if rs.latest_missing:
        lines.append(f"NOTE: {rs.latest_problem()}; {to_repoint(rs)}")
    elif latest_row is not None and latest_row.universal is UniversalStatus.STALE:
        lines.append(f"NOTE: {rs.latest}'s universal checkpoint is stale (see details)")
    elif (
        latest_row is not None
        and latest_row.native
        and latest_row.verified != "unsound"
        and not rs.latest_converted
        and not any(problem.startswith(f"{rs.latest}: ") and _unsettled(problem) for problem in rs.problems)
    ):
        lines.append(
            f"NOTE: {rs.latest} has no complete universal checkpoint: a DP change reads its native files; "
            f"--universal-checkpoint (and a TP or PP change) needs one: {_to_convert(rs)}"
        )
    lines.append(CHECKED_SHALLOW)
    return "\n".join(lines)


def _unsettled(problem: str) -> bool:
    """A save of the tag left half-done (set aside, in progress, its commit cut short): its folder is not a save to
    convert until the next start settles it (:func:`megatron_ucp.background.set_aside.leftovers`' words)."""
    return any(words in problem for words in ("did not commit", "a save of it in progress", "a commit cut short"))


def not_a_root(path: Path) -> Optional[str]:
    """Why ``path`` is not a checkpoint root, and where the root is when that can be seen (None: it is one, or may
    be: it holds a ``latest`` file, a tag or the store)."""
    path = Path(path).resolve()
    try:
        if os.path.lexists(path / F.LATEST) or (path / ".ucp").is_dir():
            return None  # a root (whatever its 'latest' holds: status says what is wrong with it)
        if is_native_tag(path):
            return f"{path} is a tag folder, not a checkpoint root: `megatron-ucp status {path.parent}` shows its root"
        entries = [e for e in os.scandir(path) if not e.name.startswith(".")] if path.is_dir() else []
        if any(e.is_dir() and (is_native_tag(Path(e.path)) or e.name.endswith(F.UNIVERSAL_SUFFIX)) for e in entries):
            return None
        roots = sorted(e.name for e in entries if e.is_dir() and os.path.lexists(Path(e.path) / F.LATEST))
    except OSError as exc:
        return f"{path}: cannot be listed ({exc.strerror or exc})"
    if roots:
        return (
            f"{path} holds no checkpoint; checkpoint roots under it: {', '.join(roots[:8])}: "
            f"`megatron-ucp status {path / roots[0]}` shows the first"
        )
    return f"{path} holds no checkpoint (no '{F.LATEST}' file, no tag folder): not a checkpoint root"


def _to_convert(rs: RootStatus) -> str:
    """The command that converts the latest tag as its twin stands now (a folder already there needs --force;
    one a converter is writing needs nothing but time)."""
    row = next(t for t in rs.tags if t.tag == rs.latest)
    if row.universal in (UniversalStatus.IN_PROGRESS, UniversalStatus.PENDING):
        return f"the background converter is on it ({row.universal.value})"
    twin = rs.root / F.universal_tag(row.tag)
    force = " --force" if twin.exists() or twin.is_symlink() else ""
    return f"`megatron-ucp convert {rs.root} --tag {row.tag}{force}` makes it"


CHECKED_SHALLOW = (
    "checked: folder names, markers, manifests and the model states' sizes; no rank file or tensor was read "
    "(--deep reads and verifies every file)"
)
