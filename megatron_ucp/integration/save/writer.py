"""The writer thread of the saves that return before their files are written (the asynchronous save, the memory save):
each file of a save, from its host copy, written with the checkpoint engine's own ``save`` to a temporary name beside
its place, ``fsync``'d and renamed into place, on the cycles training leaves (the thread is niced).

One :class:`Writer` per kind of save: a memory save (node memory, every few iterations) never waits behind a durable
save's files going to the parallel file system. A job is any save in flight with ``files`` (the engine's save, the
host copy, the path), ``watch`` (:class:`~megatron_ucp.integration.save.commit.WriteWatch`: its ``tag`` names the
fault points), ``done`` (set when the writer is done with it), ``save.folder`` (named by a failure), and
``after_write`` (called in this thread on each file written: the memory save's checksums, off the training thread)
and ``then`` (called in this thread once the files are done, written or not: the memory save's commit).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp import faults
from megatron_ucp.background.store import NICE_INCREMENT
from megatron_ucp.integration.save.host_copy import written_form

log = logging.getLogger(__name__)


class Writer:
    """One thread writing the saves put to it, oldest first; an exception of any type fails that save (kept by its
    watch, said at its commit) and the thread goes on with the next."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.work: "queue.Queue[Any]" = queue.Queue()
        self.thread: Optional[threading.Thread] = None

    def put(self, job: Any) -> None:
        self.work.put(job)  # queued first: a thread that cannot start is started again by wait()
        if self.thread is None or not self.thread.is_alive():
            self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def wait(self, job: Any) -> None:
        """This writer done with ``job`` (a thread that ended is started again: the queue outlives it)."""
        while not job.done.wait(5.0):
            if self.thread is None or not self.thread.is_alive():
                log.error("megatron-ucp: the writer thread %s ended; starting it again for %s", self.name, job.save.tag)
                self._start()

    def stop(self) -> None:
        """The thread told to end once its queue is empty."""
        if self.thread is not None and self.thread.is_alive():
            self.work.put(None)

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self.work.get()
            if job is None:
                return
            try:
                for ce_save, copied, path in job.files:
                    write(job, lambda target, save=ce_save, copied=copied: save(written_form(copied), target), path)
                fsync_folders(job.watch.written)
            except BaseException as exc:  # of any type: this save fails, named; the writer goes on with the next
                job.watch.fail(job.save.folder, exc)
            finally:
                job.files.clear()  # the host copies go back to their buffers
                _then(job)
                job.done.set()


def _then(job: Any) -> None:
    """What follows a job's files in this thread, whether they were written or not (a memory save's commit, which
    every rank must reach); an exception of any type is said, and the thread goes on."""
    then: Optional[Callable[[], None]] = getattr(job, "then", None)
    if then is None:
        return
    try:
        then()
    except BaseException as exc:
        log.error("megatron-ucp: after writing %s: %s: %s", job.watch.tag, type(exc).__name__, exc)


def _lower_priority() -> None:
    """The writer thread yields the CPU to training (Linux nices a thread on its own): the files go out on the cycles
    training leaves; elsewhere it keeps the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + NICE_INCREMENT)
    except (AttributeError, OSError) as exc:
        log.debug("megatron-ucp: the writer thread keeps the process's priority: %s", exc)


def write(job: Any, save: Callable[[str], Any], path: str) -> None:
    """One file of ``job`` written durably under a temporary name, then renamed (then ``job.after_write(path)``, if
    any); the first failure stops the save's writes."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.ucp-writing")
    after: Optional[Callable[[str], None]] = getattr(job, "after_write", None)

    def durably() -> None:
        faults.die_point(f"async write {job.watch.tag}")
        point = f"{job.watch.tag}/{target.name}"
        try:
            faults.fault_point(f"write {point}")
            save(str(partial))
            faults.fault_point(f"fsync {point}")
            with open(partial, "rb") as handle:
                os.fsync(handle.fileno())
            faults.fault_point(f"rename {point}")
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if after is not None:
            after(path)

    job.watch.write(durably, path)


def fsync_folders(paths: list[str]) -> None:
    """The renames durable: each folder written into, fsync'd once."""
    for folder in sorted({os.path.dirname(p) for p in paths}):
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
