"""Small Linux I/O helpers for the converter's hot path; each is a no-op where unsupported.

* :func:`will_need` / :func:`done_with`: ``madvise`` on memory-mapped rank-file ranges. Reading a
  parameter's fragments through the mapping makes their pages resident in *this* process (they
  count in its RSS); ``MADV_DONTNEED`` on a private, unmodified file mapping drops them again
  (the page cache keeps them), so resident memory stays at the parameter being written, not the
  checkpoint. ``MADV_WILLNEED`` starts readahead for the next one (cold caches).
* :func:`read_only_this`: a loader copying one rank's slice out of a mapped state file reads
  that slice, not the kernel's readahead window around it.
* :func:`read_ahead`: ``posix_fadvise(WILLNEED)`` on the files a share reads, at its start, so the
  disk streams them while the first parameters are being written (cold caches).
* :func:`start_writeback`: ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts writing a finished
  file to disk without waiting, so the final ``fsync`` of each file finds little left to do and
  the disk works while the next file is produced.
* :func:`exchange`: ``renameat2(RENAME_EXCHANGE)`` swaps two paths atomically, so replacing a
  committed folder (``convert --force``) never leaves a moment with no folder at that path.
* :func:`write_durably` (:func:`prepare`, then :func:`place`): a small file (a pointer such as ``latest``, a
  record) replaced so that a reader sees the previous content or the new one, never a partial one, also after a
  power loss.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import sys
import time
from pathlib import Path

MADV_RANDOM = 1
MADV_WILLNEED = 3
MADV_DONTNEED = 4
SYNC_FILE_RANGE_WRITE = 2
PAGE = mmap.PAGESIZE

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
        _libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        _libc.sync_file_range.restype = ctypes.c_int
    except (OSError, AttributeError):
        _libc = None
_renameat2 = getattr(_libc, "renameat2", None) if _libc is not None else None  # glibc >= 2.28
if _renameat2 is not None:
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _renameat2.restype = ctypes.c_int
AT_FDCWD = -100
RENAME_EXCHANGE = 2


FAULT_AROUND = 1 << 18
"""A read fault on a file mapping also maps cached neighbours (the kernel's ``fault_around_bytes``,
64 KiB by default; more was seen mapped in practice): :func:`done_with` drops this much around."""


def _madvise(start: int, end: int, advice: int) -> None:
    if _libc is not None and end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


def will_need(address: int, nbytes: int) -> None:
    if nbytes > 0:
        _madvise(address - address % PAGE, address + nbytes + (-(address + nbytes)) % PAGE, MADV_WILLNEED)


def read_only_this(address: int, nbytes: int, bounds: tuple[int, int]) -> None:
    """Before copying ``nbytes`` at ``address`` out of a file mapping spanning ``bounds``: read those
    pages and no others. The kernel's fault readahead (``read_ahead_kb``: 8 MiB on some VMs) would
    otherwise read far around each fault, a whole state file for a rank that needs a slice of it;
    ``MADV_RANDOM`` on the mapping turns it off, ``MADV_WILLNEED`` on the range reads exactly it, in
    one request."""
    if nbytes <= 0:
        return
    lo, hi = bounds
    _madvise(lo - lo % PAGE, hi + (-hi) % PAGE, MADV_RANDOM)
    will_need(address, nbytes)


def done_with(address: int, nbytes: int, bounds: tuple[int, int]) -> None:
    """Drop the pages of a *read-only use* of a private file mapping from this process (not the cache).

    The range is widened to the fault-around granularity (the kernel mapped those neighbours
    too) and clipped to ``bounds``, an address range known to lie inside the same file mapping:
    never beyond it, where ``MADV_DONTNEED`` could hit anonymous memory and zero it.
    """
    if nbytes <= 0:
        return
    lo, hi = bounds
    lo -= lo % PAGE
    hi += (-hi) % PAGE
    start = max(lo, address - address % FAULT_AROUND)
    end = min(hi, address + nbytes + (-(address + nbytes)) % FAULT_AROUND)
    _madvise(start, end, MADV_DONTNEED)


def read_ahead(paths: "list[os.PathLike | str]") -> None:
    """Ask the kernel to start reading these files into the page cache (no wait; cached files: cheap)."""
    advice = getattr(os, "POSIX_FADV_WILLNEED", None)
    if advice is None:
        return
    for path in paths:
        try:  # non-blocking: a FIFO among the paths must not stop us here (the reader refuses it)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            os.close(fd)


def start_writeback(fd: int) -> None:
    if _libc is not None:
        _libc.sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


def exchange(a: os.PathLike | str, b: os.PathLike | str) -> bool:
    """Atomically swap two existing paths; False where the system or file system cannot (caller renames)."""
    if _renameat2 is None:
        return False
    if _renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def fsync_path(path: os.PathLike | str) -> None:
    """fsync a file (its data) or a directory (its entries: what makes renames durable).

    A file's fsync error is raised: its bytes may not be on disk. Some file systems refuse fsync on
    directories (EINVAL); that refusal is ignored, the data fsyncs still stand.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def remove_out_of_sight(path: os.PathLike | str) -> None:
    """Delete a folder by first renaming it to a hidden sibling nobody takes for a finished one, so
    that a deletion interrupted half-way never leaves a folder that looks complete. Raises the
    rename's ``OSError`` (then nothing changed); the deletion itself is best effort."""
    path = Path(path)
    trash = path.with_name(f".{path.name.lstrip('.')}.ucp-trash-{os.getpid()}-{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """A local process exists and is not a zombie (a killed converter stays one until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"])


def write_durably(path: os.PathLike | str, text: str) -> None:
    """A small file replaced by rename after its bytes and then its folder are on disk: a reader sees the previous
    content or this one, never a partial one, also after a power loss."""
    place(prepare(path, text), path)


def prepare(path: os.PathLike | str, text: str) -> Path:
    """``text`` durably in a temporary sibling of ``path`` (:func:`place` puts it there)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def place(tmp: os.PathLike | str, path: os.PathLike | str) -> None:
    """A prepared file renamed into place, the rename made durable."""
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))
