"""Each native tag's verdict under ``<root>/.ucp/verdicts/``: what the last full read of its files found (sound, or
the problems, each naming its file), by whom, and for which files (a verdict on files written again since does not
apply). Written by whatever read the whole tag (the background converter and verifier, ``megatron-ucp verify``,
``convert`` and ``status --deep``, a restart's fallback); read by ``status`` and the fallback, which trust a current
verdict instead of reading the tag again."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp.background.store import quick_json, ucp_dir
from megatron_ucp.convert.universal import read_manifest, source_identity
from megatron_ucp.deepspeed.model_states import recorded_save_id
from megatron_ucp.deepspeed.reader import find_checkpoint_files
from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import save_files
from megatron_ucp.plan.tags import newer

log = logging.getLogger(__name__)

VERDICTS_DIR = "verdicts"
"""``verdicts/<tag>.json``: whether a native tag was found sound, by whom, and for which files."""


@dataclass(frozen=True)
class Verdict:
    """What the last full read of a native tag found: sound (every file this save's, every recorded checksum
    matching, every master and optimizer state finite) or the problems, each naming its file."""

    tag: str
    sound: bool
    problems: tuple[str, ...]
    checked_by: str
    """``background conversion`` or ``megatron-ucp verify``."""
    source_files: dict
    """The tag's files as they were read (:func:`megatron_ucp.convert.universal.source_identity`): a verdict
    on files rewritten since (a re-save of the tag) does not apply to them."""
    at: float

    def applies_to(self, current: dict) -> bool:
        return self.source_files == current

    def describe(self) -> str:
        if self.sound:
            return f"sound (checked by {self.checked_by})"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{self.problems[0] if self.problems else '?'}{more} (checked by {self.checked_by})"


VERDICT_PROBLEMS_KEPT = 20


def record_verdict(
    root: Path, tag: str, problems: Sequence[str], checked_by: str, source_files: dict, say: bool = True
) -> Verdict:
    """Write the tag's verdict into the store (replaced atomically) and log it (``say``; a command that prints the
    problems itself passes False); a store that cannot be written is said in the log, never raised (the verdict's
    caller is a converter or a check)."""
    verdict = Verdict(tag, not problems, tuple(problems[:VERDICT_PROBLEMS_KEPT]), checked_by, source_files, time.time())
    folder = ucp_dir(root) / VERDICTS_DIR
    record = {
        "tag": tag,
        "sound": verdict.sound,
        "problems": list(verdict.problems),
        "problem_count": len(problems),
        "checked_by": checked_by,
        "source_files": source_files,
        "at": verdict.at,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        quick_json(folder / f"{tag}.json", record)
    except OSError as exc:
        log.error("%s: cannot record the verdict on %s: %s", folder, tag, exc)
    if say:
        (log.info if verdict.sound else log.error)("%s: %s", tag, verdict.describe())
    return verdict


def read_verdict(root: Path, tag: str) -> Optional[Verdict]:
    """The tag's recorded verdict; None when there is none or it cannot be read (said in the log)."""
    path = ucp_dir(root) / VERDICTS_DIR / f"{tag}.json"
    try:
        raw = json.loads(path.read_text())
        return Verdict(
            str(raw["tag"]),
            bool(raw["sound"]),
            tuple(str(x) for x in raw["problems"]),
            str(raw["checked_by"]),
            dict(raw["source_files"]),
            float(raw["at"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable verdict, ignored (%s)", path, exc)
        return None


def record_refusal(root: Path, tag: str, exc: BaseException, checked_by: str, read: dict) -> Optional[Verdict]:
    """A conversion refused for what it found in the tag's own files (another save's file, a checksum that does not
    match, a file that is not one checkpoint's): the tag is unsound, and the store says so, so that ``status`` and the
    next restart's fallback know it without reading the tag again. ``read``: the tag's files as they were before the
    conversion read them (:func:`tag_identity`). Nothing is recorded (None) for any other failure (the output, the disk,
    an interruption), nor when the files changed while they were read (a save of the tag replacing them: what was
    refused may be the mixture, never the new save)."""
    tag_dir = Path(root) / tag
    subject = getattr(exc, "subject", None)
    if not isinstance(exc, CheckpointFormatError) or subject is None:
        return None
    if Path(subject) != tag_dir and tag_dir not in Path(subject).parents:  # the tag's folder or a file in it
        return None
    if tag_identity(tag_dir) != read:
        log.warning("%s: its files changed while they were read (saved again?): no verdict on it from this read", tag)
        return None
    return record_verdict(root, tag, [str(exc)], checked_by, read)


def record_conversion_verdict(root: Path, tag: str, output: Path, checked_by: str) -> Verdict:
    """A conversion that committed read every element of the tag: its verdict (sound, or what is not finite) on the
    files it read, as its manifest records them."""
    manifest = read_manifest(output) or {}
    problems = list(manifest.get("non_finite") or [])
    return record_verdict(root, tag, problems, checked_by, manifest.get("source_files") or {})


def tag_identity(tag_dir: Path) -> dict:
    """The tag's files as they are now (names, sizes, modification times: what a verdict applies to). A folder that
    is not one checkpoint's files any more (a rank file deleted) is every regular file in it, so that a verdict on
    it still binds to what is there and is outdated by a repair; {} when the folder cannot be listed."""
    try:
        return source_identity(find_checkpoint_files(tag_dir).identity_files())
    except (OSError, UcpError):
        pass
    try:
        return source_identity(sorted(p for p in Path(tag_dir).iterdir() if p.is_file() and not p.is_symlink()))
    except OSError:
        return {}


def identity_digest(tag_dir: Path) -> str:
    """:func:`tag_identity` in 16 hex digits, for records that compare a tag's files later (a 768-rank save lists
    800 files)."""
    return hashlib.sha256(json.dumps(tag_identity(tag_dir), sort_keys=True).encode()).hexdigest()[:16]


FILE_LIST = "its save's file list"


def listed_damage(tag_dir: Path) -> tuple[str, ...]:
    """The tag's own damage found before any load, from names and sizes: each file its save's file list (written
    at the commit) names that is missing or of another size, each checkpoint file there the save did not write,
    and, where a list exists, model states that cannot be read (one mapped read for the save's identity, no
    weights). Empty when nothing is found or no list applies (a save without the hooks, a list of another save).
    The restart's judge and ``status`` ask the same, so that ``status --check`` predicts what the judge decides."""
    if save_files.read_file_list(tag_dir.parent, tag_dir.name) is None:
        return ()  # nothing to compare with: the load checks the files (nothing read here)
    try:
        save_id = recorded_save_id(tag_dir)
    except CheckpointFormatError as exc:
        return (str(exc),)
    except OSError as exc:
        return (f"{tag_dir}: cannot be read ({exc})",)
    return tuple(f"{problem} ({FILE_LIST})" for problem in save_files.problems(tag_dir, save_id))


UNCOMMITTED = (
    "newer than latest and never committed (a save killed or failed before every rank's files were durable): a "
    "restart does not load it; the next save of that step replaces it"
)


def uncommitted(tag_dir: Path) -> bool:
    """A save made with the hooks (its model states record a save identity) whose commit never wrote its file list:
    the files of a save that did not finish, whatever they look like."""
    try:
        save_id = recorded_save_id(tag_dir)
    except (CheckpointFormatError, OSError):
        return False  # unreadable: the tag's damage, said elsewhere
    listed = save_files.read_file_list(tag_dir.parent, tag_dir.name)
    return save_id is not None and (listed is None or listed.save_id != save_id)


def newer_than(tag: str, latest: str, root: Path) -> bool:
    """``tag`` is a newer save than the one ``latest`` names (by step, else by modification time)."""
    try:
        return newer((tag, (root / tag).stat().st_mtime), (latest, (root / latest).stat().st_mtime))
    except OSError:
        return False


def verdict_is_current(root: Path, tag: str) -> bool:
    """The tag has a verdict on its files as they are now (nothing to verify again)."""
    verdict = read_verdict(root, tag)
    return verdict is not None and verdict.applies_to(tag_identity(root / tag))
