"""A save into a tag folder that already exists leaves one save there, never two mixed.

DeepSpeed writes a save's files into ``<save_dir>/<tag>/`` over whatever is there. A save of a tag that exists
with more rank files (a restart that fell back past a damaged tag and saves it again at a smaller DP size, a rerun
from an earlier iteration, another TP or PP size) leaves the earlier save's extra files beside the new ones: every
later load refuses the folder ("files of another save in the folder?"), falls back past it and saves it again,
losing the same iterations at every restart.

Before a hooked save writes (:func:`set_aside`, the first rank; every rank waits for it), an existing folder of the
tag is moved aside whole, with the universal twin, Hugging Face export and verdict made of it, into
``<save_dir>/.ucp/replaced/<tag>.<time>.<pid>/``, by renames (instant on one file system). When the new save commits,
that folder is removed (:meth:`SetAside.drop`, in the background: the earlier save was replaced by the user's own
save); when the save fails, the partial new folder is moved there in its turn and the earlier save put back
(:meth:`SetAside.put_back`): a failed save changes nothing, and the earlier save is never deleted before its
replacement commits.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_ucp.background.store import VERDICTS_DIR, ucp_dir
from megatron_ucp.export.hf_source import hf_name
from megatron_ucp.format import dsformat as F

log = logging.getLogger(__name__)

REPLACED_DIR = "replaced"
"""Under the store (``<save_dir>/.ucp/``): earlier saves of a tag being saved again, until the new one commits."""
CHECKPOINT_FILE_ENDINGS = ("optim_states.pt", "model_states.pt")
"""The files of a save that a load binds (every layout's rank files and model states)."""


def _companions(save_dir: Path, tag: str) -> dict[str, Path]:
    """What belongs to the tag's save: its folder, its universal twin, its export, its verdict (name -> path)."""
    return {
        tag: save_dir / tag,
        F.universal_tag(tag): save_dir / F.universal_tag(tag),
        hf_name(tag): save_dir / hf_name(tag),
        f"verdict-{tag}.json": ucp_dir(save_dir) / VERDICTS_DIR / f"{tag}.json",
    }


@dataclass(frozen=True)
class SetAside:
    """An earlier save of the tag being saved, moved aside (``folder``), and what was in it."""

    save_dir: Path
    tag: str
    folder: Path
    moved: tuple[str, ...]

    def drop(self) -> threading.Thread:
        """The new save committed: the earlier one is removed beside training (a large save takes a while to
        delete on a parallel file system; the save does not wait for it, the process's exit does)."""
        log.info("megatron-ucp: %s committed; removing the earlier save of it (%s)", self.tag, self.folder)
        remover = threading.Thread(target=shutil.rmtree, args=(self.folder,), kwargs={"ignore_errors": True})
        remover.start()
        return remover

    def put_back(self) -> None:
        """The new save failed: its partial files moved aside in turn (``<folder>/failed-save``), the earlier save
        back where it was."""
        places = _companions(self.save_dir, self.tag)
        if places[self.tag].exists():
            os.replace(places[self.tag], self.folder / "failed-save")
        for name in self.moved:
            os.replace(self.folder / name, places[name])
        log.error(
            "megatron-ucp: the save of %s failed: the earlier save of it is back in %s; the failed save's files are in "
            "%s",
            self.tag,
            self.save_dir / self.tag,
            self.folder / "failed-save",
        )


def holds_a_save(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint file (a rank file or model states) of some save."""
    try:
        return any(entry.is_file() and entry.name.endswith(CHECKPOINT_FILE_ENDINGS) for entry in os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return False


def set_aside(save_dir: Path, tag: str) -> Optional[SetAside]:
    """The tag's existing save moved aside before it is saved again (first rank); None when there is none."""
    existing = _companions(save_dir, tag)
    if not holds_a_save(existing[tag]):
        return None
    folder = ucp_dir(save_dir) / REPLACED_DIR / f"{tag}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}"
    folder.mkdir(parents=True)
    moved = []
    for name, path in existing.items():
        if path.exists():
            os.replace(path, folder / name)
            moved.append(name)
    log.warning(
        "megatron-ucp: %s already holds a save of %s; this save replaces it: the earlier save (%s) is kept in %s "
        "until this one commits, then removed",
        save_dir,
        tag,
        ", ".join(moved),
        folder,
    )
    return SetAside(save_dir, tag, folder, tuple(moved))
