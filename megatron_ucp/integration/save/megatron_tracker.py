"""Megatron's ``latest_checkpointed_iteration.txt`` written by the save's commit, with ``latest``.

Megatron-DeepSpeed's ``save_checkpoint`` writes its tracker (on the first rank, through
``megatron.checkpointing.get_checkpoint_tracker_filename``) as soon as DeepSpeed's save returns: after ``latest``
(a process killed in between leaves them naming two saves), and, for an asynchronous save, before its files are
written. The save's commit writes the real tracker with the save's iteration, before ``latest``, in the commit a
killed process's next start completes: a synchronous save's from its client state (:func:`for_synchronous_save`;
Megatron's own write after it writes the same value again), an asynchronous save's when Megatron wrote one for it
(:func:`at_commit`; with several saves in flight, each names its own iteration at its own commit), Megatron's own
write after an asynchronous save (the next call of the function after it) going to a file in the store instead
(:func:`aside_next_write`). A load's reads of the tracker go to the real file. Without Megatron (no
``megatron.checkpointing`` loaded) there is no tracker and nothing to do.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from megatron_ucp.background.set_aside import Pointer
from megatron_ucp.background.store import ucp_dir
from megatron_ucp.format import dsformat as F

TRACKER = F.MEGATRON_TRACKER
_NEXT: dict[str, Path] = {}
"""Save folder -> where Megatron's next tracker write goes instead (set after a save returns, taken by that write)."""


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
        if threading.current_thread() is threading.main_thread():
            aside = _NEXT.pop(os.path.abspath(checkpoints_path), None)
            if aside is not None:
                return str(aside)
        return original(checkpoints_path)

    get_checkpoint_tracker_filename.megatron_ucp_redirect = True  # type: ignore[attr-defined]
    get_checkpoint_tracker_filename.__wrapped__ = original  # type: ignore[attr-defined]
    module.get_checkpoint_tracker_filename = get_checkpoint_tracker_filename
    return None


def aside_next_write(save_dir: Path, tag: str) -> Path:
    """Megatron's tracker write after this save goes to a file of its own in the store (made ready here: Megatron
    opens it); returns that file."""
    ucp_dir(save_dir).mkdir(parents=True, exist_ok=True)
    aside = ucp_dir(save_dir) / f".tracker-{os.getpid()}-{tag}"
    aside.unlink(missing_ok=True)
    _NEXT[os.path.abspath(save_dir)] = aside
    return aside


def at_commit(save_dir: Path, aside: Optional[Path], iteration: Optional[int]) -> Optional[Pointer]:
    """What the commit of the save whose tracker write went to ``aside`` writes: the tracker naming ``iteration``,
    when Megatron wrote one for it (None: not Megatron's save, or no tracker redirected)."""
    if aside is None:
        return None
    key = os.path.abspath(save_dir)
    if _NEXT.get(key) == aside:
        del _NEXT[key]  # Megatron never wrote it: not Megatron's save
    wrote = aside.exists()
    aside.unlink(missing_ok=True)
    return Pointer(Path(save_dir) / TRACKER, str(iteration)) if wrote and iteration is not None else None


def iteration_of(client_state: Any) -> Optional[int]:
    """Megatron's iteration, from the client state it saves (None: not Megatron's save)."""
    iteration = client_state.get("iteration") if isinstance(client_state, dict) else None
    return iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None


def for_synchronous_save(save_dir: Path, client_state: Any) -> Optional[Pointer]:
    """The tracker a synchronous save's commit writes (Megatron loaded and its save: its iteration); None else."""
    iteration = iteration_of(client_state)
    if iteration is None or redirect() is not None:
        return None
    return Pointer(Path(save_dir) / TRACKER, str(iteration))


def restore() -> None:
    """Megatron's own function back, nothing aside."""
    _NEXT.clear()
    module = sys.modules.get("megatron.checkpointing")
    redirected = getattr(module, "get_checkpoint_tracker_filename", None)
    if getattr(redirected, "megatron_ucp_redirect", False):
        module.get_checkpoint_tracker_filename = redirected.__wrapped__
