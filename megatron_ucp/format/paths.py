"""Safe handling of the user's paths: tag files, tag names and where an output may go.

Three rules, each a class of defect found by adversarial runs:

* ``latest`` / ``latest_universal`` are read only when they are regular files (a FIFO would block
  the reader forever; a directory or a device is not a tag file), decoded as UTF-8 or refused with
  the file named, and must hold one tag name inside the root: no ``/``, ``..``, ``.`` (a trailing
  ``/``, as shell completion adds, is dropped).
* a tag given on the command line obeys the same rule.
* an output folder may not be, contain or lie inside a source folder, however the paths are spelled
  (symlinks, ``..``, ``.``): ``--force`` replaces the output, so this is what keeps a source safe.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Optional

from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)
MAX_TAG_FILE_BYTES = 4096
"""A tag file holds one folder name; anything longer is not one."""


def special_kind(path: Path) -> Optional[str]:
    """What ``path`` is when it is not a regular file (following symlinks); None for a regular
    file or when it does not exist."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        raise
    return None if stat.S_ISREG(mode) else _kind_of(mode)


def _kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_checkpoint_file(path: os.PathLike | str) -> BinaryIO:
    """Open a checkpoint file for reading, refusing (never blocking on) anything but a regular file.

    The one way this package opens a file it reads: a FIFO would block ``open`` forever and a
    device would never end, so the file is opened non-blocking and judged by ``fstat`` of what was
    opened (no window between a check and the open). Raises :class:`CheckpointFormatError` naming
    the file and what it is; a missing file raises ``FileNotFoundError``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        kind = "a symlink loop" if exc.errno == errno.ELOOP else None
        raise CheckpointFormatError(
            f"{path}: {'is ' + kind if kind else 'cannot read: ' + str(exc.strerror)}", subject=path, damaged=path
        ) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointFormatError(f"{path}: is {_kind_of(mode)}, not a regular file", subject=path, damaged=path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def normalize_tag(tag: str, where: str) -> str:
    """A tag name as DeepSpeed writes it: one folder name under the root. ``where`` names the
    origin (the ``latest`` file, ``--tag``) for the error."""
    name = tag.strip().rstrip("/")
    if not name:
        raise CheckpointFormatError(f"{where}: empty tag name", subject=where)
    if "/" in name or name in (".", "..") or "\0" in name:
        raise CheckpointFormatError(
            f"{where}: {tag!r} is not a tag name (a folder directly under the checkpoint "
            "root; paths and '..' are not followed)",
            subject=where,
        )
    return name


def read_tag_file(path: Path) -> Optional[str]:
    """The tag a ``latest``-style file names; None when the file does not exist.

    Refuses, naming the file: special files (never opened), undecodable bytes, empty content,
    anything that is not a single tag name.
    """
    path = Path(path)
    kind = special_kind(path)
    if kind is not None:
        raise CheckpointFormatError(
            f"{path}: is {kind}, not a file holding a tag name; remove or replace it", subject=path
        )
    try:  # the shared opener: also refuses a file replaced by a FIFO between the check and the open
        with open_checkpoint_file(path) as fh:
            data = fh.read(MAX_TAG_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read: {exc.strerror}", subject=path) from exc
    if len(data) > MAX_TAG_FILE_BYTES:
        raise CheckpointFormatError(f"{path}: {len(data)}+ bytes, not a tag name", subject=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(
            f"{path}: not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "it should hold a tag name such as global_step100",
            subject=path,
        ) from None
    if not text.strip():
        raise CheckpointFormatError(f"{path}: empty; pass --tag", subject=path)
    return normalize_tag(text, str(path))


def lagging_universal_pointer(root: Path) -> Optional[tuple[str, Optional[str]]]:
    """``(latest's tag, latest_universal's tag or None)`` when ``latest`` names a native tag whose
    universal twin ``latest_universal`` does not name; None when they agree or there is no ``latest``.

    ``latest`` is what training saved last, or what the user pointed back at after a loss spike;
    ``latest_universal`` trails it (the background conversion of the newest save has not finished)
    or names a newer tag than the user chose. A universal load that followed it would resume from
    another iteration without a word: the elastic-load hook follows ``latest`` instead.
    """
    latest = root / F.LATEST
    native = read_tag_file(latest) if latest.is_file() else None
    if native is None or (root / native / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE).is_file():
        return None
    pointer = root / F.LATEST_UNIVERSAL
    named = read_tag_file(pointer) if pointer.is_file() else None
    return None if named == F.universal_tag(native) and (root / named).is_dir() else (native, named)


@dataclass(frozen=True)
class TagToLoad:
    """Which tag folder a load reads (:func:`tag_to_load`)."""

    tag: Optional[str]
    """The folder's name; None when the pointer file names none (there is nothing to load)."""
    pointer: Optional[str]
    """The pointer file it came from (``latest`` or ``latest_universal``); None: the load named it."""
    lag: Optional[tuple[str, Optional[str]]] = None
    """``(latest's tag, latest_universal's tag)`` when ``latest_universal`` was passed over for ``latest``."""


def tag_to_load(root: Path, tag: Optional[str], universal: bool) -> TagToLoad:
    """Which tag folder a load of ``root`` reads, the one rule for the runner, the hooks' decision, the fallback and
    the universal route: the tag named; else, without ``--universal-checkpoint``, the one ``latest`` names; with it,
    the one ``latest_universal`` names while that is the twin of ``latest``'s tag, else ``latest``'s tag (converted at
    load), so that a universal load never resumes from another iteration than ``latest`` without a word
    (:func:`lagging_universal_pointer`). Raises :class:`CheckpointFormatError` for a pointer file it cannot read."""
    if tag is not None:
        return TagToLoad(tag, None)
    lag = lagging_universal_pointer(root) if universal else None
    pointer = F.LATEST_UNIVERSAL if universal and lag is None else F.LATEST
    return TagToLoad(read_tag_file(root / pointer), pointer, lag)


def _real(path: Path) -> Path:
    """The canonical path (symlinks, ``.``, ``..`` resolved) of ``path``, or of its nearest existing
    ancestor joined with the rest when it does not exist yet."""
    path = Path(os.path.abspath(path))
    missing: list[str] = []
    while not path.exists() and path != path.parent:
        missing.append(path.name)
        path = path.parent
    real = Path(os.path.realpath(path))
    for name in reversed(missing):
        real = real / name
    return real


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_placement(output: Path, sources: Iterable[Path]) -> None:
    """Refuse an output that is, contains or lies inside any of ``sources`` (canonical paths)."""
    out = _real(output)
    for source in sources:
        src = _real(source)
        if _within(out, src):
            what = "is" if out == src else "lies inside"
            raise UcpError(
                f"{output}: {what} the source {source}; the output must be a folder of its own "
                "(default: <root>/<tag>_universal)",
                subject=output,
            )
        if _within(src, out):
            raise UcpError(
                f"{output}: contains the source {source}; replacing it would delete the source", subject=output
            )
