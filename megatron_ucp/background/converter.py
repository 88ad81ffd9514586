"""Background conversion after every save: the queue on the checkpoint filesystem and the converter process.

Everything lives under ``<root>/.ucp/`` and is coordinated through the shared checkpoint
filesystem only (no network service)::

    queue.json                 active job, pending job, recent events (QueueState; rewritten by rename)
    queue.lock                 exclusive lock (O_CREAT|O_EXCL), held for milliseconds
    events.log                 one line per event (complete, failed, skipped, interrupted, removed, ...)
    runners/node<i>.json       node i's converter: host, pid, phase, attempt; mtime = heartbeat
    runner.node<i>.log         the converter process's own output (also crashes before logging starts)
    convert-<tag>.log          log of one conversion (convert-<tag>.node<i>.log when split over nodes)
    progress/<tag>.node<i>.json  bytes done / expected of node i's share, for ``megatron-ucp status``

Call order. After ``save_checkpoint`` returned on every rank, each node's launcher calls
:func:`trigger`: under the lock it requests the tag (:func:`megatron_ucp.background.queue.request`),
activates it when nothing runs, and starts the node's converter if none is alive: a detached
``python -m megatron_ucp.background.converter`` (new session, low CPU and I/O priority, bounded threads).
The converter (:func:`run_converter`) loops: under the lock, settle the active job and take the
next (:func:`megatron_ucp.background.queue.advance`); convert its node's share with
:func:`megatron_ucp.convert.execute.convert` (staging sibling, last share commits); the committer
verifies the folder (read-back of every file), moves ``latest_universal`` and applies
``keep_last``; wait until the job settled on every node; repeat until nothing is pending, then
exit. Decisions are the pure functions of :mod:`megatron_ucp.background.queue`; this module only
gathers facts and executes them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp import faults
from megatron_ucp.background import queue as B
from megatron_ucp.background.store import (
    POLL_S,
    PROGRESS_DIR,
    ConverterSettings,
    QueueLock,
    advance_locked,
    job_facts,
    quick_json,
    read_queue,
    read_registrations,
    record_event,
    register,
    registration_path,
    twin_path,
    ucp_dir,
    unregister,
    write_queue,
)
from megatron_ucp.background.verdicts import record_conversion_verdict, record_refusal, record_verdict, tag_identity
from megatron_ucp.convert.commit import not_finite_pointer
from megatron_ucp.convert.execute import ConvertOptions, convert
from megatron_ucp.convert.universal import (
    COMPLETE,
    ConversionInProgress,
    inspect_staging,
    latest_universal_target,
    move_latest_universal,
    universal_state,
)
from megatron_ucp.errors import OutputExistsError, described
from megatron_ucp.export.hf_export import EXPORT_MARKER
from megatron_ucp.export.hf_source import HF_SUFFIX, hf_name
from megatron_ucp.format import dsformat as F
from megatron_ucp.format import osio

log = logging.getLogger("megatron_ucp.background.converter")  # not __name__: "__main__" in the converter process

HEARTBEAT_S = 5.0
PROGRESS_EVERY_S = 2.0
"""How often a share's progress file is rewritten (``megatron-ucp status`` reads it)."""


def lower_priority(nice: int) -> str:
    """Lowest best-effort I/O class level and ``nice``: training and data loading come first. Called first thing in
    the converter's main thread, so the threads and processes it starts inherit both. Returns what was applied."""
    applied = []
    if nice:
        try:
            applied.append(f"nice {os.nice(nice)}")
        except OSError as exc:
            log.debug("os.nice(%d) failed: %s", nice, exc)
    nr = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
    if not sys.platform.startswith("linux") or nr is None:
        log.debug("ioprio_set not available on %s/%s; I/O priority unchanged", sys.platform, platform.machine())
        return ", ".join(applied) or "unchanged"
    ioprio_class_be, ioprio_who_process, level = 2, 1, 7
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(nr, ioprio_who_process, 0, (ioprio_class_be << 13) | level) != 0:
            log.debug("ioprio_set failed: errno %d", ctypes.get_errno())
        else:
            applied.append(f"I/O best-effort level {level}")
    except (OSError, AttributeError) as exc:
        log.debug("ioprio_set unavailable: %s", exc)
    return ", ".join(applied) or "unchanged"


class _Heartbeat:
    """Refreshes this converter's registration mtime, so other nodes can tell it is alive."""

    def __init__(self, root: Path, node: int):
        self.path = registration_path(root, node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucp-runner-heartbeat", daemon=True)

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S * 2)


class _Progress:
    """``on_progress`` for :func:`convert`: a throttled progress file, and the fault-injection point
    "after the first parameter" (:mod:`megatron_ucp.faults`)."""

    def __init__(self, path: Path, attempt: Optional[str], tag: str, node: int):
        self.path = path
        self.attempt = attempt
        self.tag = tag
        self.node = node
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        if now - self.last >= PROGRESS_EVERY_S or done >= total:
            self.last = now
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                quick_json(self.path, {"done": done, "total": total, "updated": now, "attempt": self.attempt})
        faults.pause_point("after the first parameter", self.tag, self.node)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


class Converter:
    """Node ``node``'s background converter; :meth:`run` until the queue is empty."""

    def __init__(self, root: Path, node: int, settings: ConverterSettings):
        self.root = Path(root).resolve()
        self.node = node
        self.settings = settings
        self.pid = os.getpid()

    def run(self) -> int:
        with QueueLock(self.root, timeout=60.0):
            reg = read_registrations(self.root).get(self.node)
            if reg is not None and reg.pid != self.pid and reg.alive(self.settings.stale_after):
                log.info("node %d already has a converter (pid %d on %s); exiting", self.node, reg.pid, reg.host)
                return 0
            register(self.root, self.node, self.pid, "starting")
        try:
            with _Heartbeat(self.root, self.node):
                while True:
                    with QueueLock(self.root, timeout=60.0):
                        state = read_queue(self.root)
                        state, job, events = advance_locked(
                            self.root, state, self.settings, time.time(), redo_dead=False
                        )
                        write_queue(self.root, state, events)
                        if job is None:
                            unregister(self.root, self.node, self.pid)
                            log.info("queue empty; converter of node %d exits", self.node)
                            return 0
                        share = self.node if self.node < job.share_count else None
                        register(
                            self.root,
                            self.node,
                            self.pid,
                            "converting" if share is not None else "waiting",
                            job.attempt,
                        )
                    for event in events:
                        log.info("%s", event.line())
                    if share is not None:
                        (self._verify if job.kind == B.VERIFY else self._convert_share)(job, share)
                    register(self.root, self.node, self.pid, "waiting", job.attempt)
                    self._wait_settled(job)
        finally:
            with contextlib.suppress(Exception):
                unregister(self.root, self.node, self.pid)

    def _convert_share(self, job: B.Job, share: int) -> None:

        output = twin_path(self.root, job.tag)
        info = inspect_staging(output)
        if info is not None and info.attempt_id == job.attempt and share in info.shares_done:
            return  # this node did its share already (an earlier converter of this node exited)
        log_path = ucp_dir(self.root) / B.log_name(job.tag, share, job.share_count)
        handler = _log_to(log_path)
        progress = _Progress(
            ucp_dir(self.root) / PROGRESS_DIR / f"{job.tag}.node{share}.json", job.attempt, job.tag, self.node
        )
        t0 = time.perf_counter()
        read = tag_identity(self.root / job.tag)  # the files as they are before they are read
        try:
            log.info(
                "converting %s, share %d of %d (attempt %s, %d worker(s))",
                job.tag,
                share + 1,
                job.share_count,
                job.attempt,
                self.settings.workers,
            )
            result = convert(
                ConvertOptions(
                    source=self.root / job.tag,
                    output=output,
                    workers=self.settings.workers,
                    force=False,
                    replace_stale=True,
                    update_latest=False,
                    share_index=share,
                    share_count=job.share_count,
                    attempt_id=job.attempt,
                    progress=False,
                    stale_after=self.settings.stale_after,
                    on_progress=progress,
                )
            )
            log.info("%s", result.summary)
            if result.committed:
                self._finish(job, output, log_path, time.perf_counter() - t0, read)
        except Terminated as exc:  # say so before the process ends (the queue would only see it die)
            record_event(
                self.root,
                job.tag,
                B.EventKind.INTERRUPTED,
                f"converter pid {os.getpid()} on {socket.gethostname()} stopped by {exc}; the next save, "
                f"resume or `megatron-ucp convert {self.root} --tag {job.tag}` completes it",
                attempt=job.attempt,
                log=str(log_path),
            )
            raise
        except ConversionInProgress as exc:
            log.warning("%s; waiting for that converter instead", exc)
        except OutputExistsError as exc:
            if universal_state(output) != COMPLETE:
                record_event(self.root, job.tag, B.EventKind.FAILED, str(exc), attempt=job.attempt, log=str(log_path))
        except Exception as exc:  # the conversion failed: loud in the logs, harmless to training
            log.exception("conversion of %s failed", job.tag)
            record_refusal(self.root, job.tag, exc, CHECKED_BY, read)
            record_event(self.root, job.tag, B.EventKind.FAILED, described(exc), attempt=job.attempt, log=str(log_path))
            self._again_if_saved_again(job, read)
        finally:
            progress.remove()
            _stop_logging(handler)

    def _verify(self, job: B.Job, share: int) -> None:
        """A verify job: the tag's files read once (:func:`megatron_ucp.convert.native_verify.verify_native`: whole,
        one save, as recorded, finite), its verdict recorded; settled by its own event (an unsound tag: rejected,
        reported as a warning at the next save)."""
        from megatron_ucp.convert.native_verify import verify_native

        log_path = ucp_dir(self.root) / B.log_name(job.tag, share, 1, B.VERIFY)
        handler = _log_to(log_path)
        said = dict(attempt=job.attempt, log=str(log_path), job=B.VERIFY)
        try:
            identity = tag_identity(self.root / job.tag)  # the files as they are before they are read
            report = verify_native(self.root / job.tag)
            record_verdict(self.root, job.tag, report.problems, VERIFIED_BY, identity)
            kind = B.EventKind.COMPLETE if report.ok else B.EventKind.REJECTED
            record_event(self.root, job.tag, kind, report.summary(), seconds=round(report.seconds, 3), **said)
            self._again_if_saved_again(job, identity)
        except Terminated as exc:
            record_event(self.root, job.tag, B.EventKind.INTERRUPTED, f"verification stopped by {exc}", **said)
            raise
        except Exception as exc:  # a verification that could not run: loud in the logs, harmless to training
            log.exception("verification of %s failed", job.tag)
            record_event(self.root, job.tag, B.EventKind.FAILED, described(exc), **said)
        finally:
            _stop_logging(handler)

    def _finish(self, job: B.Job, output: Path, log_path: Path, seconds: float, read: dict) -> None:
        """The committer: read-back verification, then ``latest_universal``, then retention; a tag saved again while
        it was read is converted again (``read``: its files before the conversion read them)."""
        from megatron_ucp.convert.verify import verify_universal

        try:
            report = verify_universal(output)
        except Exception as exc:  # unreadable beyond a list of problems
            report = None
            problems = [described(exc)]
        else:
            problems = report.problems
        if report is None or not report.ok:
            rejected = output.with_name(f".{output.name}.ucp-rejected-{int(time.time())}")
            os.rename(output, rejected)
            record_event(
                self.root,
                job.tag,
                B.EventKind.REJECTED,
                f"read-back verification failed ({len(problems)} problem(s); first: {problems[0]}); "
                f"moved to {rejected.name}, latest_universal unchanged",
                attempt=job.attempt,
                log=str(log_path),
            )
            return
        non_finite = not record_conversion_verdict(self.root, job.tag, output, CHECKED_BY).sound
        resaved = tag_identity(self.root / job.tag) != read
        if non_finite:  # a restart should not be pointed at NaN
            moved = not_finite_pointer(job.tag)
        elif resaved:  # the twin is of the earlier save: stale at birth
            moved = f"latest_universal unchanged: {job.tag} was saved again while it was converted"
        else:
            moved = move_latest_universal(self.root, output)
        record_event(
            self.root,
            job.tag,
            B.EventKind.COMPLETE,
            f"converted and verified ({report.params} params, {report.state_files} files) in "
            f"{B.fmt_seconds(seconds)}; {moved}",
            attempt=job.attempt,
            log=str(log_path),
            seconds=round(seconds, 3),
        )
        if resaved:
            self._again_if_saved_again(job, read)
            return
        if self.settings.export_hf:
            self._export_hf(job.tag, output, log_path, finite=not non_finite)
        self._retention()

    def _again_if_saved_again(self, job: B.Job, read: dict) -> None:
        """A job settled on files replaced while it read them (a save of the tag again, as Megatron's last iteration,
        whose own request joined this active job): the tag is requested again, for its newest save."""
        if tag_identity(self.root / job.tag) == read:
            return
        with QueueLock(self.root, timeout=60.0):
            state, events = B.request(read_queue(self.root), job.tag, job.share_count, time.time(), kind=job.kind)
            write_queue(self.root, state, events)
        log.warning("%s was saved again while its %s job read it: queued again for its newest save", job.tag, job.kind)

    def _export_hf(self, tag: str, universal: Path, log_path: Path, finite: bool) -> None:
        """The Hugging Face export of a converted tag, from its universal folder, in this process (never the
        training's); its own events (``job: export-hf``): status shows them, the training's exit reports a failure."""
        from megatron_ucp.export.hf_export import ExportOptions, export_hf

        said = dict(log=str(log_path), job=B.EXPORT_HF)
        if not finite:
            record_event(self.root, tag, B.EventKind.SKIPPED, "not exported: its masters are not finite", **said)
            return
        try:
            result = export_hf(
                ExportOptions(source=universal, output=self.root / hf_name(tag), force=True, progress=False)
            )
            record_event(
                self.root, tag, B.EventKind.COMPLETE, result.summary(), seconds=round(result.seconds, 3), **said
            )
        except Terminated as exc:
            record_event(self.root, tag, B.EventKind.INTERRUPTED, f"export stopped by {exc}", **said)
            raise
        except Exception as exc:  # loud in the logs and the store, harmless to training and to the conversion
            log.exception("Hugging Face export of %s failed", tag)
            record_event(self.root, tag, B.EventKind.FAILED, described(exc), **said)

    def _retention(self) -> None:
        keep = self.settings.keep_last
        if keep is None:
            return
        current = latest_universal_target(self.root)
        state = read_queue(self.root)
        protected = {current[0]} if current else set()
        protected |= {F.universal_tag(j.tag) for j in (state.active, state.pending) if j is not None}
        folders = _finished(self.root, F.UNIVERSAL_SUFFIX, F.MANIFEST_FILE, lambda p: universal_state(p) == COMPLETE)
        exports = _finished(self.root, HF_SUFFIX, EXPORT_MARKER, lambda p: True)
        for name, suffix, job in (
            *((n, F.UNIVERSAL_SUFFIX, None) for n in B.select_for_removal(folders, keep, protected)),
            *((n, HF_SUFFIX, B.EXPORT_HF) for n in B.select_for_removal(exports, keep, ())),
        ):
            try:
                osio.remove_out_of_sight(self.root / name)  # a half-deleted folder must not look complete
            except OSError as exc:
                log.warning("retention: could not remove %s: %s", self.root / name, exc)
                continue
            said = f"retention (keep_last={keep}) removed {name}"
            record_event(self.root, name[: -len(suffix)], B.EventKind.REMOVED, said, job=job)

    def _wait_settled(self, job: B.Job) -> None:
        """Until the job is complete, failed or dead on every node: one conversion at a time per root."""
        while True:
            state = read_queue(self.root)
            if state.active is None or state.active.attempt != job.attempt:
                return  # someone already settled it and moved on
            facts = job_facts(self.root, job, read_registrations(self.root), self.settings.stale_after)
            if B.judge(state, job, facts, time.time()) is not B.Outcome.RUNNING:
                return
            time.sleep(POLL_S)


_LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"


CHECKED_BY = "background conversion"
VERIFIED_BY = "background verification"


def _finished(root: Path, suffix: str, marker: str, complete: Any) -> list[tuple[str, float]]:
    """The finished folders ``<tag><suffix>`` of a root, with their marker's time (what retention orders by)."""
    return [
        (p.name, (p / marker).stat().st_mtime)
        for p in sorted(root.iterdir())
        if p.name.endswith(suffix) and not p.name.startswith(".") and (p / marker).is_file() and complete(p)
    ]


def run_converter(root: Path, node: int, nodes: int, settings: ConverterSettings) -> int:
    priority = lower_priority(settings.nice)
    # No torch here: the converter reads and writes torch files without it (OMP_NUM_THREADS, set by
    # converter_env, bounds torch's threads where a rare fallback imports it).
    log.info("converter of node %d/%d for %s: priority %s, %d worker(s)", node, nodes, root, priority, settings.workers)
    return Converter(root, node, settings).run()


class Terminated(SystemExit):
    """SIGTERM (the job's end, a scheduler's kill): unwinds like ``sys.exit(143)``, recorded on the way."""

    def __init__(self) -> None:
        super().__init__(143)

    def __str__(self) -> str:
        return "SIGTERM"


def _log_to(path: Path) -> logging.Handler:
    """A job's own log file, on the root logger (every module's lines of the job) until :func:`_stop_logging`."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def _stop_logging(handler: logging.Handler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()


def _add_settings(parser: argparse.ArgumentParser) -> None:
    """The options :meth:`ConverterSettings.argv` writes (the trigger's command line for this process)."""
    defaults = ConverterSettings()
    for name, kind in ConverterSettings.OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=kind, default=getattr(defaults, name))


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ucp.background.converter",
        description="Background converter of one node (started by the async trigger).",
    )
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    _add_settings(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT, stream=sys.stdout)
    signal.signal(signal.SIGTERM, _terminate)  # run finally blocks: record, unregister, stop heartbeats
    settings = ConverterSettings(**{name: getattr(args, name) for name, _ in ConverterSettings.OPTIONS})
    try:
        return run_converter(args.root, args.node, args.nodes, settings)
    except Exception:
        log.exception("background converter of node %d failed", args.node)
        return 1


if __name__ == "__main__":
    sys.exit(main())
