"""The writer thread shared by the asynchronous and the memory saves: each file to a temporary name then into place,
``after_write`` on each file written, ``then`` once the files are done whether they were written or not, and an
exception of any type (in a write or in ``then``) never ends the thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp.integration.save.commit import WriteWatch
from megatron_ucp.integration.save.writer import Writer


@dataclass
class _Save:
    folder: Path
    tag: str = "global_step1"


@dataclass
class _Job:
    save: _Save
    files: list = field(default_factory=list)
    watch: WriteWatch = field(default_factory=lambda: WriteWatch("global_step1", 0))
    done: threading.Event = field(default_factory=threading.Event)
    after_write: Optional[Callable[[str], None]] = None
    then: Optional[Callable[[], None]] = None


def _text_save(value: Any, target: str) -> None:
    Path(target).write_text(str(value))


def _failing_save(value: Any, target: str) -> None:
    raise KeyError("not a file")


def test_each_file_is_written_then_seen_and_the_job_then_runs_after_the_last(tmp_path: Path) -> None:
    seen: list[str] = []
    order: list[str] = []
    job = _Job(
        _Save(tmp_path),
        files=[(_text_save, "a", str(tmp_path / "a.pt")), (_text_save, "b", str(tmp_path / "b.pt"))],
        after_write=lambda path: (seen.append(Path(path).read_text()), order.append("after")),
        then=lambda: order.append("then"),
    )
    writer = Writer("test-writer")
    writer.put(job)
    writer.wait(job)
    assert (tmp_path / "a.pt").read_text() == "a" and (tmp_path / "b.pt").read_text() == "b"
    assert seen == ["a", "b"] and order == ["after", "after", "then"]
    assert job.watch.outcome() is None and job.files == []  # the host copies let go
    assert not list(tmp_path.glob(".*ucp-writing"))
    writer.stop()


def test_a_failed_write_fails_its_save_and_then_still_runs(tmp_path: Path) -> None:
    """``then`` is a memory save's commit: every rank must reach it, to agree that the save failed."""
    ran: list[str] = []
    job = _Job(
        _Save(tmp_path),
        files=[(_failing_save, "a", str(tmp_path / "a.pt")), (_text_save, "b", str(tmp_path / "b.pt"))],
        then=lambda: ran.append("then"),
    )
    writer = Writer("test-writer")
    writer.put(job)
    writer.wait(job)
    failure = job.watch.outcome()
    assert failure is not None and "KeyError" in str(failure) and "a.pt" in str(failure)
    assert not (tmp_path / "b.pt").exists()  # the first failure stops the save's writes
    assert ran == ["then"]
    writer.stop()


def test_an_exception_out_of_then_is_said_and_the_next_save_is_written(tmp_path: Path, caplog) -> None:
    def broken() -> None:
        raise ZeroDivisionError("a commit broke off")

    first = _Job(_Save(tmp_path), files=[(_text_save, "a", str(tmp_path / "a.pt"))], then=broken)
    second = _Job(_Save(tmp_path, "global_step2"), files=[(_text_save, "b", str(tmp_path / "b.pt"))])
    writer = Writer("test-writer")
    with caplog.at_level(logging.ERROR, logger="megatron_ucp"):
        writer.put(first)
        writer.put(second)
        writer.wait(first)
        writer.wait(second)
    assert "ZeroDivisionError: a commit broke off" in caplog.text
    assert first.done.is_set() and (tmp_path / "b.pt").read_text() == "b"
    writer.stop()
