"""Exact byte ranges of a checkpoint file, read straight into the caller's memory.

A restart that reads each byte once across the job reads, on each rank, only the ranges its share
needs: slices of old rank files' partitions, a slice of the saved module weights. A copy out of a
memory mapping either reads ahead around every page fault (each rank then reads its neighbours'
bytes too) or, with readahead off, one page per fault (slow). So the ranges are read with ``preadv``
into the destination's memory, the file's readahead switched off first: the kernel reads exactly
those bytes, in large requests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.format.paths import open_checkpoint_file
from megatron_ucp.format.rawtensor import RawTensor


def file_offset(tensor: RawTensor, start: int = 0) -> Optional[int]:
    """Where element ``start`` of a tensor mapped from an unmodified file (:func:`~megatron_ucp.format.torchload.load`)
    sits in that file; None for a tensor in ordinary memory (a small record, a tensor torch made)."""
    storage = tensor.storage
    if storage.region is None:
        return None
    return storage.address - storage.region[0] + (tensor.offset + start) * tensor.element_size()


class RangeReader:
    """One file, opened on first use with readahead off; ranges read exactly (``with`` closes it)."""

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = Path(path)
        self.handle: Any = None
        self.bytes_read = 0

    def read(self, offset: int, into: memoryview) -> None:
        """``len(into)`` bytes from ``offset`` of the file into ``into`` (a writable byte view)."""
        if self.handle is None:
            self.handle = open_checkpoint_file(self.path)
            if hasattr(os, "posix_fadvise"):  # no readahead past the ranges: each byte read by one rank
                os.posix_fadvise(self.handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        done = 0
        while done < len(into):
            got = os.preadv(self.handle.fileno(), [into[done:]], offset + done)
            if got <= 0:
                raise CheckpointFormatError(
                    f"{self.path}: ends at byte {offset + done}, inside a range being read (changed while loading?)",
                    subject=self.path,
                    damaged=self.path,
                )
            done += got
        self.bytes_read += done

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
