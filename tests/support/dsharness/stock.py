"""Run DeepSpeed's own universal converter (``deepspeed.checkpoint.ds_to_universal``) unmodified."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .launch import REPO_ROOT, child_env


@dataclass(frozen=True)
class StockRun:
    returncode: int
    log: str
    output: Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def stock_ds_to_universal(
    tag_dir: Path, output: Path, inject_missing_state: bool = True, python: Optional[str] = None, timeout: float = 300
) -> StockRun:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT``.

    One extract and one merge worker (the machine is small). Stock DeepSpeed writes
    ``latest_universal`` into ``output``'s parent: convert a private copy of a checkpoint.
    """
    python = python or sys.executable
    cmd = [
        python,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(output),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    if inject_missing_state:
        cmd.append("--inject_missing_state")
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=child_env(python),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
    return StockRun(returncode=proc.returncode, log=proc.stdout.decode(errors="replace"), output=Path(output))
