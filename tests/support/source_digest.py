"""The bytes of a checkpoint folder, to prove a refused or failed command left its sources as they were.

The store's verdicts (``.ucp/verdicts/<tag>.json``) are left out: what a refused conversion found in a tag's
own files is that tag's verdict, written beside the sources, never into them. Tests that care whether one
was written ask :func:`verdict_files`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from megatron_ucp.background.store import ucp_dir
from megatron_ucp.background.verdicts import VERDICTS_DIR


def verdict_files(root: Path) -> list[Path]:
    folder = ucp_dir(root) / VERDICTS_DIR
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def source_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the verdicts and symlinks (relative name -> sha256)."""
    verdicts = ucp_dir(root) / VERDICTS_DIR
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.is_symlink() and path.parent != verdicts
    }
