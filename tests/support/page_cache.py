"""Which bytes of a file are in the page cache (``mincore``), and how to drop a folder from it.

With every rank loading its own private copy of a checkpoint, evicted first, what is resident in a
copy afterwards is exactly what that rank read from it: its storage reads per file, not its
neighbours' (the ranks of one machine share the page cache of shared files)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = mmap.PAGESIZE


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (whole pages; the last one counted in full). Maps the file
    without touching it (a private mapping: ``mincore`` then sees the file's cached pages)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mapped)
        base = ctypes.addressof(anchor)
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        del anchor
        return sum(_PAGE for v in vec if v & 1)
    finally:
        mapped.close()


def evict(folder: Path) -> None:
    """Drop every file under ``folder`` from the page cache (written back first)."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
