"""The universal-checkpoint folder on disk: staging, commit, manifest, ``latest_universal``.

A conversion never writes into its final folder. It writes into a temporary sibling
``<parent>/.<name>.ucp-staging/``; when every share of the work is done, one converter claims
the commit (an exclusive lock file), writes ``ucp_manifest.json`` last, fsyncs, and renames the
staging folder into place. ``latest_universal`` is replaced afterwards by write-temp + rename.
So a folder named ``<tag>_universal`` with our manifest is finished by construction, and anything
interrupted is only ever a staging folder, recognisably stale once its heartbeats stop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_ucp.deepspeed.reader import find_checkpoint_files
from megatron_ucp.errors import CheckpointFormatError, OutputExistsError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio
from megatron_ucp.format.paths import read_tag_file, special_kind
from megatron_ucp.plan.resume import TwinState
from megatron_ucp.plan.tags import should_update_latest

log = logging.getLogger(__name__)

COMPLETE = TwinState.COMPLETE
FOREIGN = TwinState.FOREIGN
ABSENT = TwinState.ABSENT
STALE = TwinState.STALE
"""Complete, but made from files the source tag no longer holds (:func:`stale_reason`)."""
HEARTBEAT_SECONDS = 5.0


class ConversionInProgress(UcpError):
    """Another live converter owns the staging folder of this output."""


def staging_path(output: Path) -> Path:
    output = Path(output)
    return output.parent / F.staging_name(output.name)


def read_manifest(folder: Path) -> Optional[dict]:
    """The manifest of a finished folder, or None. Unknown fields are kept, never rejected."""
    path = Path(folder) / F.MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: unreadable manifest: {exc}", subject=path) from exc
    if not isinstance(data, dict) or data.get("format") != F.MANIFEST_FORMAT:
        raise CheckpointFormatError(f"{path}: not a megatron-ucp manifest", subject=path)
    if int(data.get("version", 0)) > F.MANIFEST_VERSION:
        log.warning(
            "%s: manifest version %s is newer than this megatron-ucp (%s); reading known fields only",
            path,
            data.get("version"),
            F.MANIFEST_VERSION,
        )
    return data


def source_identity(files: Iterable[Path]) -> dict[str, list[int]]:
    """What binds a universal folder to the native files it came from: each file's name, size and
    modification time (ns). A re-save of the same tag (a restart from an earlier step) rewrites
    them; ``cp -a``/``rsync -a`` copies keep them."""
    identity = {}
    for path in files:
        st = os.stat(path)
        identity[Path(path).name] = [int(st.st_size), int(st.st_mtime_ns)]
    return identity


def stale_reason(folder: Path, source_tag_dir: Path, current: Optional[dict[str, list[int]]] = None) -> Optional[str]:
    """Why the complete folder ``folder`` is not the conversion of ``source_tag_dir`` as it is now,
    or None when it is. A manifest from before source binding (no ``source_files``) is judged by
    modification times alone (:func:`_newer_than_manifest`). ``current`` is the source's :func:`source_identity`
    when the caller already took it."""

    try:
        manifest = read_manifest(folder)
    except CheckpointFormatError as exc:  # damaged: nothing binds it to anything, do not trust it
        return str(exc)
    if manifest is None:
        return None
    recorded = manifest.get("source_files")
    if current is None:
        try:
            files = find_checkpoint_files(Path(source_tag_dir))
            current = source_identity(files.identity_files())
        except (OSError, UcpError) as exc:
            return f"its source {source_tag_dir} cannot be read ({exc})"
    if not isinstance(recorded, dict):
        return _newer_than_manifest(folder, source_tag_dir, current)
    for name in sorted(set(recorded) | set(current)):
        if name not in current:
            return f"{name} is gone from {source_tag_dir}"
        if name not in recorded:
            return f"{source_tag_dir / name} is new since the conversion"
        if list(recorded[name]) != current[name]:
            return f"{source_tag_dir / name} changed since the conversion (re-saved?)"
    return None


def _newer_than_manifest(folder: Path, source_tag_dir: Path, current: dict[str, list[int]]) -> Optional[str]:
    """A folder converted before source binding: a source file modified after its manifest was
    written (it is written last) cannot be what was converted. A copy that reset every time may
    look stale (a reconversion), never the other way round."""
    written = (Path(folder) / F.MANIFEST_FILE).stat().st_mtime_ns
    newer = sorted(name for name, (_, mtime) in current.items() if mtime > written)
    if newer:
        return f"{Path(source_tag_dir) / newer[0]} was modified after the conversion (re-saved?)" + (
            f", and {len(newer) - 1} more" if len(newer) > 1 else ""
        )
    return None


def universal_state(folder: Path, source: Optional[Path] = None) -> TwinState:
    """``complete`` (our manifest), ``foreign`` (exists without it, e.g. stock output) or ``absent``;
    given the native ``source`` tag folder, ``stale`` for a complete folder made from other files."""
    folder = Path(folder)
    if not folder.is_dir():
        return ABSENT
    if not (folder / F.MANIFEST_FILE).is_file():
        return FOREIGN
    if source is not None and Path(source).is_dir() and stale_reason(folder, Path(source)) is not None:
        return STALE
    return COMPLETE


def is_universal_folder(path: Path) -> bool:
    """A converted folder (its ``zero/`` holds one folder per parameter), as opposed to a root or a native tag."""
    return (Path(path) / F.UNIVERSAL_ZERO_DIR).is_dir()


def list_zero_folder(zero_dir: Path) -> dict[str, tuple[str, ...]]:
    """A universal folder's ``zero/``: parameter folder (relative name) -> its file names, for every
    folder holding at least one ``.pt`` file (the one walk of that tree: the loader, ``verify`` and
    the converter's completeness check read it the same way)."""
    zero_dir = Path(zero_dir)
    if not zero_dir.is_dir():
        raise CheckpointFormatError(f"{zero_dir}: no zero/ folder: not a universal checkpoint", subject=zero_dir)
    listing: dict[str, tuple[str, ...]] = {}
    for dirpath, _, filenames in os.walk(zero_dir):
        rel = os.path.relpath(dirpath, zero_dir)
        if rel != "." and any(f.endswith(".pt") for f in filenames):
            listing[rel.replace(os.sep, "/")] = tuple(sorted(filenames))
    return listing


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` by write-temp, fsync, rename, fsync(parent)."""
    path = Path(path)
    kind = special_kind(path)
    if kind is not None:
        raise UcpError(f"{path}: is {kind}; it should be a small text file (remove it and run again)", subject=path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    osio.fsync_path(path.parent)


def move_latest_universal(root: Path, output: Path) -> str:
    """Point ``latest_universal`` at the complete folder ``output`` unless it names a newer one
    (:func:`megatron_ucp.plan.tags.should_update_latest`); returns what was done, for the log."""
    current = latest_universal_target(root)
    if should_update_latest((output.name, (Path(output) / F.MANIFEST_FILE).stat().st_mtime), current):
        write_latest_universal(root, output.name)
        return f"latest_universal -> {output.name}"
    return f"latest_universal left at the newer {current[0] if current else '?'}"


def write_latest_universal(root: Path, tag: str) -> None:
    write_text_atomic(Path(root) / F.LATEST_UNIVERSAL, tag)
    log.debug("%s -> %s", Path(root) / F.LATEST_UNIVERSAL, tag)  # each caller says what it did, once


def latest_universal_target(root: Path) -> Optional[tuple[str, float]]:
    """(name, manifest mtime) of the complete folder ``latest_universal`` names, or None."""
    try:
        name = read_tag_file(Path(root) / F.LATEST_UNIVERSAL)
    except (OSError, UcpError):
        return None
    if name is None:
        return None
    folder = Path(root) / name
    if not name or universal_state(folder) != COMPLETE:
        return None
    return name, (folder / F.MANIFEST_FILE).stat().st_mtime


@dataclass(frozen=True)
class StagingInfo:
    path: Path
    attempt_id: str
    fingerprint: str
    share_count: int
    shares_done: tuple[int, ...]
    heartbeat_age: Optional[float]
    """Seconds since the freshest heartbeat of a live-looking converter; None if none looks alive."""
    failed: tuple[str, ...]

    def is_live(self, stale_after: float) -> bool:
        return self.heartbeat_age is not None and self.heartbeat_age < stale_after


def inspect_staging(output: Path) -> Optional[StagingInfo]:
    """What a staging sibling says about an unfinished conversion (None when there is none)."""
    path = staging_path(output)
    if not path.is_dir():
        return None
    try:
        attempt = json.loads((path / "attempt.json").read_text())
    except (OSError, ValueError):
        attempt = {}
    done = []
    for f in (path / "shares").glob("*.done") if (path / "shares").is_dir() else []:
        try:
            done.append(int(f.name.split("-", 1)[0]))
        except ValueError:
            continue
    failed = (
        tuple(sorted(f.read_text(errors="replace").strip() for f in (path / "shares").glob("*.failed")))
        if (path / "shares").is_dir()
        else ()
    )
    now = time.time()
    ages = []
    host = socket.gethostname()
    for hb in (path / "heartbeats").glob("*") if (path / "heartbeats").is_dir() else []:
        try:
            hb_host, hb_pid = hb.read_text().split()[:2]
            age = now - hb.stat().st_mtime
        except (OSError, ValueError):
            continue
        if hb_host == host and not osio.pid_alive(int(hb_pid)):
            continue  # its process is gone: a dead heartbeat whatever its age
        ages.append(age)
    return StagingInfo(
        path=path,
        attempt_id=str(attempt.get("attempt_id", "")),
        fingerprint=str(attempt.get("fingerprint", "")),
        share_count=int(attempt.get("share_count", 1) or 1),
        shares_done=tuple(sorted(done)),
        heartbeat_age=min(ages) if ages else None,
        failed=failed,
    )


class Staging:
    """The temporary sibling one conversion (possibly split into shares) writes into.

    Call order: :meth:`open` (create, join or take over), write files under :attr:`path`,
    :meth:`mark_share_done`, then if :meth:`claim_commit` succeeds, write the common files and
    :meth:`commit`. :meth:`close` stops the heartbeat; :meth:`discard` removes the folder.
    """

    def __init__(
        self,
        output: Path,
        fingerprint: str,
        share_index: int = 0,
        share_count: int = 1,
        attempt_id: Optional[str] = None,
        stale_after: float = 60.0,
        content: tuple[str, ...] = (F.UNIVERSAL_ZERO_DIR,),
        marker: str = F.MANIFEST_FILE,
    ):
        self.output = Path(output)
        self.content = content
        """The folders the output holds (created empty)."""
        self.marker = marker
        """The file :meth:`commit` writes last: what makes the output finished."""
        self.path = staging_path(self.output)
        self.fingerprint = fingerprint
        self.share_index = share_index
        self.share_count = share_count
        self.attempt_id = attempt_id or f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        self.stale_after = stale_after
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._heartbeat = self.path / "heartbeats" / f"{share_index}-{socket.gethostname()}-{os.getpid()}"

    def open(self) -> "Staging":
        # Shares started at the same moment (one per node, or ranks of a distributed conversion) race
        # here: the folder is created complete (attempt.json inside) under a temporary name and
        # renamed into place, so nobody ever sees it half-made and takes it for a stale one.
        for _ in range(5):
            info = inspect_staging(self.output)
            if info is not None:
                joinable = (
                    info.attempt_id == self.attempt_id
                    and info.fingerprint == self.fingerprint
                    and info.share_count == self.share_count
                )
                if joinable:
                    break
                if info.is_live(self.stale_after):
                    raise ConversionInProgress(
                        f"{info.path}: another conversion of {self.output.name} is running (heartbeat "
                        f"{info.heartbeat_age:.0f}s ago); wait for it, or remove the folder if it is dead",
                        subject=info.path,
                    )
                log.warning(
                    "removing stale staging folder %s (attempt %s, shares done %s)",
                    info.path,
                    info.attempt_id or "?",
                    list(info.shares_done),
                )
                shutil.rmtree(info.path, ignore_errors=True)
            if self._create():
                break
        for sub in ("", *self.content, "shares", "heartbeats"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        attempt_file = self.path / "attempt.json"
        if not attempt_file.exists():
            write_text_atomic(
                attempt_file,
                json.dumps(
                    {
                        "attempt_id": self.attempt_id,
                        "fingerprint": self.fingerprint,
                        "share_count": self.share_count,
                        "created": time.time(),
                    }
                ),
            )
        self._beat()
        self._thread = threading.Thread(target=self._run_heartbeat, name="ucp-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _create(self) -> bool:
        """Make the staging folder atomically; False when another converter made one first."""
        tmp = self.path.parent / f"{self.path.name}.new-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        try:
            for sub in (*self.content, "shares", "heartbeats"):
                (tmp / sub).mkdir(parents=True, exist_ok=True)
            write_text_atomic(
                tmp / "attempt.json",
                json.dumps(
                    {
                        "attempt_id": self.attempt_id,
                        "fingerprint": self.fingerprint,
                        "share_count": self.share_count,
                        "created": time.time(),
                    }
                ),
            )
            (tmp / "heartbeats" / self._heartbeat.name).write_text(f"{socket.gethostname()} {os.getpid()}\n")
            try:
                os.rename(tmp, self.path)
                return True
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    return False
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _beat(self) -> None:
        self._heartbeat.write_text(f"{socket.gethostname()} {os.getpid()}\n")

    def _run_heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._beat()
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_SECONDS * 2)
            self._thread = None
        try:
            self._heartbeat.unlink()
        except OSError:
            pass

    def mark_share_done(self, summary: dict[str, Any]) -> None:
        write_text_atomic(self.path / "shares" / f"{self.share_index}-of-{self.share_count}.done", json.dumps(summary))

    def mark_share_failed(self, reason: str) -> None:
        try:
            write_text_atomic(
                self.path / "shares" / f"{self.share_index}-of-{self.share_count}.failed",
                f"share {self.share_index}: {reason}",
            )
        except OSError:
            pass

    def shares_done(self) -> list[dict]:
        out = []
        for i in range(self.share_count):
            f = self.path / "shares" / f"{i}-of-{self.share_count}.done"
            if not f.exists():
                return []
            out.append(json.loads(f.read_text()))
        return out

    def claim_commit(self) -> bool:
        """True for exactly one caller once every share is done."""
        if not self.shares_done():
            return False
        try:
            fd = os.open(self.path / "commit.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        os.close(fd)
        return True

    def commit(self, manifest: dict, force: bool) -> None:
        """Write the manifest last, make everything durable, rename into place."""
        for sub in ("shares", "heartbeats"):
            shutil.rmtree(self.path / sub, ignore_errors=True)
        for name in ("attempt.json", "commit.lock"):
            try:
                (self.path / name).unlink()
            except FileNotFoundError:
                pass
        write_text_atomic(self.path / self.marker, json.dumps(manifest, indent=1, sort_keys=True))
        for dirpath, _, _ in os.walk(self.path):
            osio.fsync_path(Path(dirpath))
        old = None
        if not self.output.exists():
            os.rename(self.path, self.output)
        elif not force:
            raise OutputExistsError(
                f"{self.output}: appeared while converting; pass --force to replace it", subject=self.output
            )
        elif osio.exchange(self.path, self.output):  # one atomic swap: the old folder is now at self.path
            old = self.path
        else:  # two renames: a moment with no folder at self.output
            old = self.output.parent / f".{self.output.name}.ucp-replaced-{os.getpid()}"
            os.rename(self.output, old)
            os.rename(self.path, self.output)
        osio.fsync_path(self.output.parent)
        if old is not None:
            osio.remove_out_of_sight(old)

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
