"""The file list of a save committed through the hooks: every file it wrote, with its size and a digest of its zip
directory, in the store (``<save_dir>/.ucp/save-files/<tag>.json``), written by the commit before ``latest`` names
the save.

The optimizer partitions carry checksums of their own (the save record); the model states, the pipeline's layer files
and the experts' files do not. The list covers them all alike: a file of the save that is missing, cut short or
written over is found by its name and size without reading it (:func:`problems`, what a load checks before
DeepSpeed reads anything), and, with ``deep``, by the digest of its zip directory, every record's size and CRC-32
as torch's writer computed them from the bytes it wrote (what ``verify`` checks, beside every record's bytes against
its CRC-32: together, every byte of every file).

A list applies to the tag's files only while they are the save it lists (its ``save_id``, which every file of the
save carries): a tag saved again by a job without the hooks is not judged by an earlier save's list.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.torch_archive import directory_digest

FILE_LISTS_DIR = "save-files"
SAVED_ENDINGS = ("model_states.pt", "optim_states.pt")
"""The names of what DeepSpeed saves (model states, rank files, layer and expert files): another file in a tag folder
(the user's, an evaluation's) is no file of a save."""
VERSION = 1


@dataclass(frozen=True)
class SavedFile:
    """One file as the save wrote it."""

    path: str
    """Absolute while the save gathers them; relative to the tag folder in the list."""
    bytes: int
    directory_sha256: Optional[str]
    """:func:`~megatron_ucp.format.torch_archive.directory_digest`; None: not a torch zip."""


def describe(path: os.PathLike | str) -> SavedFile:
    """A file just written, as the list records it (its size and the end of the file read; raises ``OSError``)."""
    return SavedFile(os.path.abspath(path), os.stat(path).st_size, directory_digest(path))


def file_list_path(save_dir: os.PathLike | str, tag: str) -> Path:
    return Path(save_dir) / F.UCP_DIR / FILE_LISTS_DIR / f"{tag}.json"


def file_list_text(folder: os.PathLike | str, save_id: str, files: Sequence[SavedFile]) -> str:
    """The list's content (what the commit writes): each file named relative to the tag ``folder``, sorted."""
    entries = {}
    for f in files:
        entries[os.path.relpath(f.path, folder)] = {"bytes": f.bytes, "directory_sha256": f.directory_sha256}
    record = {"version": VERSION, "tag": Path(folder).name, "save_id": save_id, "at": time.time()}
    record["files"] = dict(sorted(entries.items()))
    return json.dumps(record, indent=1)


@dataclass(frozen=True)
class FileList:
    tag: str
    save_id: str
    files: tuple[SavedFile, ...]
    """Relative to the tag folder."""


def read_file_list(save_dir: os.PathLike | str, tag: str) -> Optional[FileList]:
    """The tag's list; None when there is none or it cannot be read (a list is a check, never a condition)."""
    try:
        raw = json.loads(file_list_path(save_dir, tag).read_text())
        files = tuple(
            SavedFile(str(name), int(entry["bytes"]), entry.get("directory_sha256"))
            for name, entry in dict(raw["files"]).items()
        )
        return FileList(str(raw["tag"]), str(raw["save_id"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def problems(
    tag_dir: os.PathLike | str, save_id: Optional[str], deep: bool = False, rank_files: bool = True
) -> list[str]:
    """Each file of the save whose list applies (``save_id``: the save the tag's files are of) that is missing, of
    another size (``deep``: or another zip directory) than the save wrote, and each checkpoint file
    (:data:`SAVED_ENDINGS`) in the folder the save did not write, named by its path; [] when no list applies.
    ``rank_files`` False: the optimizer rank files left out (a load binds each of them itself, with what it finds
    in it)."""
    folder = Path(tag_dir)
    listed = read_file_list(folder.parent, folder.name)
    if listed is None or save_id is None or listed.save_id != save_id:
        return []
    found = []
    for f in listed.files:
        if not rank_files and F.OPTIM_FILE_RE.match(f.path):
            continue
        path = folder / f.path
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError:
            size = None
        if size is None:
            found.append(f"{path}: is missing (its save wrote {f.bytes} bytes there)")
        elif size != f.bytes:
            cut = "cut short? " if size < f.bytes else ""
            found.append(f"{path}: {size} bytes, its save wrote {f.bytes} ({cut}the file is not the one saved)")
        elif deep and f.directory_sha256 is not None and _digest(path) != f.directory_sha256:
            found.append(f"{path}: its zip directory is not the one its save wrote (written over or damaged)")
    names = {f.path for f in listed.files}
    try:
        found += [
            f"{folder / name}: a checkpoint file its save did not write (another save's?)"
            for name in sorted(os.listdir(folder))
            if name.endswith(SAVED_ENDINGS) and name not in names and (rank_files or not F.OPTIM_FILE_RE.match(name))
        ]
    except OSError:
        pass
    return found


def check(tag_dir: os.PathLike | str, save_id: Optional[str]) -> None:
    """Raise :class:`~megatron_ucp.errors.CheckpointFormatError` naming each file other than the optimizer rank files
    that :func:`problems` finds (names and sizes: a stat per file, nothing read), the first as its subject: what a
    load checks before DeepSpeed reads the model states, layer and expert files."""
    found = problems(tag_dir, save_id, rank_files=False)
    if found:
        more = "".join(f"\n  {line}" for line in found[1:8]) + (
            f"\n  ... and {len(found) - 8} more" if len(found) > 8 else ""
        )
        raise CheckpointFormatError(
            f"{found[0]} (the save's file list: {file_list_path(Path(tag_dir).parent, Path(tag_dir).name)}){more}",
            subject=found[0].split(": ", 1)[0],
            damaged=found[0].split(": ", 1)[0],
        )


def _digest(path: Path) -> Optional[str]:
    try:
        return directory_digest(path)
    except OSError:
        return None
