"""Megatron's ``latest_checkpointed_iteration.txt`` naming an asynchronous save only at its commit.

Megatron-DeepSpeed's ``save_checkpoint`` writes its tracker (on the first rank, through
``megatron.checkpointing.get_checkpoint_tracker_filename``) as soon as DeepSpeed's save returns, which an asynchronous
save does before its files are written. For that one write the function names a file aside in the store
(:func:`aside_next_write`); the commit writes the real tracker with the save's iteration (:func:`name_at_commit`). A
load's reads of the tracker, and every save when the hooks are not asynchronous, go to the real file. Without
Megatron (no ``megatron.checkpointing`` loaded) there is no tracker and nothing to do.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Optional

from megatron_ucp.background.store import ucp_dir
from megatron_ucp.integration.save.commit import write_pointer

TRACKER = "latest_checkpointed_iteration.txt"
_ASIDE: dict[str, str] = {}
"""Save folder -> where Megatron's next tracker write goes instead (set after a save returns, taken at its commit)."""


def redirect() -> Optional[str]:
    """Megatron's ``get_checkpoint_tracker_filename`` made to honour :func:`aside_next_write` (once per process);
    returns why it could not (no Megatron loaded: nothing to redirect)."""
    module = sys.modules.get("megatron.checkpointing")
    original = getattr(module, "get_checkpoint_tracker_filename", None) if module is not None else None
    if original is None:
        return "megatron.checkpointing.get_checkpoint_tracker_filename not found"
    if getattr(original, "megatron_ucp_redirect", False):
        return None

    def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
        aside = _ASIDE.get(os.path.abspath(checkpoints_path))
        if aside is not None and threading.current_thread() is threading.main_thread():
            return aside
        return original(checkpoints_path)

    get_checkpoint_tracker_filename.megatron_ucp_redirect = True  # type: ignore[attr-defined]
    get_checkpoint_tracker_filename.__wrapped__ = original  # type: ignore[attr-defined]
    module.get_checkpoint_tracker_filename = get_checkpoint_tracker_filename
    return None


def aside_next_write(save_dir: Path) -> None:
    """Megatron's tracker write after this save goes aside (the store's folder, made here: Megatron opens the file)."""
    ucp_dir(save_dir).mkdir(parents=True, exist_ok=True)
    _ASIDE[os.path.abspath(save_dir)] = str(ucp_dir(save_dir) / f".tracker-{os.getpid()}")


def name_at_commit(save_dir: Path, iteration: Optional[int]) -> None:
    """The save into ``save_dir`` committed: Megatron's tracker names ``iteration``, when Megatron wrote one for it."""
    aside = _ASIDE.pop(os.path.abspath(save_dir), None)
    if iteration is None or aside is None or not Path(aside).exists():
        return  # not Megatron's save: it wrote no tracker
    Path(aside).unlink(missing_ok=True)
    write_pointer(Path(save_dir) / TRACKER, str(iteration))


def restore() -> None:
    """Megatron's own function back, nothing aside."""
    _ASIDE.clear()
    module = sys.modules.get("megatron.checkpointing")
    redirected = getattr(module, "get_checkpoint_tracker_filename", None)
    if getattr(redirected, "megatron_ucp_redirect", False):
        module.get_checkpoint_tracker_filename = redirected.__wrapped__
