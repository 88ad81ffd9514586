"""``built_checkpoint``: a plain-function view of the session checkpoint cache (the ``ds_checkpoint`` fixture).

Returns the step-2 checkpoint of the shared default run (``steps=4, save_at=(2, 4)``), so tests that
use it and tests that use the fixture train each distinct configuration only once per session.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.dsharness.checkpoints import session_cache


@dataclass(frozen=True)
class BuiltCheckpoint:
    root: Path
    """Checkpoint root holding global_step2 and global_step4 (``latest`` names global_step4)."""
    dump: Path
    """state_step2.pt: DeepSpeed's own gathered full fp32 + optimizer states at the step-2 save."""


def built_checkpoint(
    optimizer: str, dp: int, uc_info: bool = False, plugin: bool = False, zero_stage: int = 1
) -> BuiltCheckpoint:
    fields = {"uc_info": uc_info, "plugin": plugin, "zero_stage": zero_stage}
    defaults = {"uc_info": False, "plugin": False, "zero_stage": 1}
    ck = session_cache()(optimizer=optimizer, dp=dp, **{k: v for k, v in fields.items() if v != defaults[k]})
    return BuiltCheckpoint(root=ck.root, dump=ck.dump("state_step2"))


def copy_root(root: Path, dest: Path) -> Path:
    """Tests write next to the tag (the default output); work on a copy so the cache stays pristine."""
    shutil.copytree(root, dest)
    return dest
