"""Which tags a restart's fallback walks and what it knows of each before a load: one answer for the restart and for
``status --check``, so that what ``--check`` says is what the next restart does.

The walk itself (what is skipped, what is loaded, the load cap) is :mod:`megatron_ucp.plan.restart_walk`; this module
reads what it needs from the root: the tags (folder names and modification times), their recorded verdicts, their
saves' file lists, the universal twins, and the last restart that resumed from no tag. Nothing of a tag's weights is
read (a restart reads each byte of a checkpoint once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_ucp.background.store import read_refused_restart
from megatron_ucp.background.verdicts import (
    identity_digest,
    listed_damage,
    read_verdict,
    tag_identity,
)
from megatron_ucp.convert.universal import COMPLETE, universal_state
from megatron_ucp.deepspeed.folder import is_native_tag
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.restart_walk import Candidate, Walk, walk
from megatron_ucp.plan.tags import chronological, iterations_lost

FILES, LOAD, TWIN, LATEST, CAPPED, UNREAD = "files", "load", "twin", "latest", "capped", "unread"
"""Why a tag was passed over: its own damage (known before a load, or its load refused its files); its load refused
for what may be the job's fault; its universal twin missing or refused (not the tag's fault); the ``latest`` file;
the cap; the judge could not look at it (an I/O error: no verdict)."""


@dataclass(frozen=True)
class Judgement:
    """A tag's problems known before a load, and their kind (one of the constants above); no problems: load it."""

    problems: tuple[str, ...] = ()
    kind: str = ""
    sound: bool = False
    """No problems, and a sound verdict on its files as they are now (read whole: its load passes)."""


def older_tags(root: Path, latest: Optional[str]) -> list[str]:
    """Native tags under ``root`` older than ``latest`` (every one when None), newest first (any ZeRO stage's files):
    the candidates after ``latest``'s own tag."""
    tags = []
    for entry in os.scandir(root):
        if entry.name == latest or entry.name.startswith(".") or entry.name.endswith(F.UNIVERSAL_SUFFIX):
            continue
        try:
            if entry.is_dir() and is_native_tag(Path(entry.path), model_states=True):
                tags.append((entry.name, entry.stat().st_mtime))
        except OSError:  # a symlink loop, a folder gone meanwhile: not a tag to load
            continue
    if latest is None:
        return list(reversed([tag for tag, _ in chronological(tags)]))
    try:
        mine = (latest, (root / latest).stat().st_mtime)
    except OSError:
        mine = (latest, float("inf"))
    ordered = [tag for tag, _ in chronological([*tags, mine])]
    return list(reversed(ordered[: ordered.index(latest)]))


def judge(root: Path, tag: str, through_twin: bool) -> Judgement:
    """The tag's problems known before anything is loaded, from names, sizes and records: its folder, an unsound
    verdict on its files as they are, its save's file list, and (``through_twin``: an older tag under
    ``--universal-checkpoint``) its complete universal twin (the tag ``latest`` names is converted at load when its
    twin is missing, as without a fallback)."""
    tag_dir = root / tag
    if not tag_dir.is_dir():
        return Judgement((f"{tag_dir}: missing",), FILES)
    verdict = read_verdict(root, tag)
    applies = verdict is not None and verdict.applies_to(tag_identity(tag_dir))  # the files listed once
    if applies and not verdict.sound:
        return Judgement(tuple(f"{p} (found by {verdict.checked_by})" for p in verdict.problems), FILES)
    damage = listed_damage(tag_dir)
    if damage:
        return Judgement(damage, FILES)
    if not _loadable_folder(tag_dir):
        return Judgement((f"{tag_dir}: not a checkpoint (no model states)",), FILES)
    if through_twin:
        twin = root / F.universal_tag(tag)
        if universal_state(twin, tag_dir) != COMPLETE:
            return Judgement((f"{twin}: no complete universal twin to load with --universal-checkpoint",), TWIN)
    return Judgement(sound=applies)


def refused_loads(root: Path) -> dict[str, str]:
    """Per tag, the problem the last restart that resumed from no tag met loading it, for what may be the job's
    fault, while the tag's files are still the ones it tried (the same job refuses them again)."""
    entry = read_refused_restart(root) or {}
    out = {}
    for f in entry.get("failed") or []:
        tag, kind = str(f.get("tag")), f.get("kind", LOAD)
        if kind == LOAD and not str(f.get("problem", "")).startswith("not tried") and (root / tag).is_dir():
            if identity_digest(root / tag) == f.get("files"):
                out[tag] = str(f.get("problem"))
    return out


def predict(root: Path, latest: Optional[str], latest_unreadable: Optional[str]) -> tuple[Walk, str]:
    """What a restart of ``root`` does (the fallback on, without ``--universal-checkpoint``, any DP size), and the
    sentence that says it. Only for a root whose ``latest`` names a tag or cannot be read."""
    refused = refused_loads(root)
    names = ([latest] if latest is not None else []) + older_tags(root, latest)
    candidates = []
    for tag in names:
        judged = judge(root, tag, through_twin=False)
        candidates.append(Candidate(tag, judged.problems, sound=judged.sound, refused=refused.get(tag)))
    result = walk(candidates)
    before = [f"{F.LATEST}: {latest_unreadable}"] if latest is None else []
    return result, _said(root, latest, result, before)


def _loadable_folder(tag_dir: Path) -> bool:
    return is_native_tag(tag_dir, model_states=True) or universal_state(tag_dir) == COMPLETE


def _said(root: Path, latest: Optional[str], w: Walk, before: list[str]) -> str:
    skipped = before + list(w.skipped)
    why = "; ".join(skipped)
    if not w.tries:
        if w.capped or any(": the last restart's load refused it" in s for s in skipped):
            return (
                "a restart fails again: no tag passes, and the loads the last restart tried were refused for what may "
                f"be the job's fault (a changed model or optimizer? its log says why), not the tags' files: {why}"
            )
        return "no tag here can be resumed: " + why
    first, rest = w.tries[0], w.tries[1:]
    lost = iterations_lost(latest, first, latest is None or (root / latest).is_dir())
    known = "found sound" if w.certain and not rest else "not read yet: its load checks it"
    verb = f"falls back to {first} ({known}; loses {lost})" if skipped else f"resumes from {first} ({known})"
    said = f"a restart {verb}"
    if not (w.certain and not rest):
        then = [f"{t} ({'found sound' if w.certain and t == rest[-1] else 'not read yet'})" for t in rest]
        more = f"{len(then) - 3} more" + (", the last found sound" if w.certain else "")
        then = then[:3] + ([more] if len(then) > 3 else []) + ([] if w.certain else ["no tag"])
        said += f"; if its files are damaged: {', then '.join(then)} (`megatron-ucp status {root} --deep` reads them)"
    return said + (f": {why}" if skipped else "")
