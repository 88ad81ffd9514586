"""Session cache of real DeepSpeed checkpoints for the converter tests (built once per session)."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.dsharness import TrainSpec, run_training

_CACHE: dict[tuple, "BuiltCheckpoint"] = {}
_BASE = Path(tempfile.mkdtemp(prefix="ucp-ckpts-"))
atexit.register(shutil.rmtree, _BASE, True)


@dataclass(frozen=True)
class BuiltCheckpoint:
    root: Path
    dump: Path
    """state_step{N}.pt: DeepSpeed's own gathered full fp32 + optimizer states at the save."""


def built_checkpoint(optimizer: str, dp: int, steps: int = 2, uc_info: bool = False, plugin: bool = False,
                     zero_stage: int = 1) -> BuiltCheckpoint:
    key = (optimizer, dp, steps, uc_info, plugin, zero_stage)
    if key not in _CACHE:
        name = "-".join(str(k) for k in key)
        root, dumps = _BASE / name / "ckpt", _BASE / name / "dumps"
        run_training(TrainSpec(dp=dp, optimizer=optimizer, zero_stage=zero_stage, steps=steps, save_dir=root,
                               save_at=(steps,), uc_info=uc_info, plugin=plugin, dump_dir=dumps))
        _CACHE[key] = BuiltCheckpoint(root=root, dump=dumps / f"state_step{steps}.pt")
    return _CACHE[key]


def copy_root(root: Path, dest: Path) -> Path:
    """Tests write next to the tag (the default output); work on a copy so the cache stays pristine."""
    shutil.copytree(root, dest)
    return dest
