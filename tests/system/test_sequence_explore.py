"""The sequence explorer (benchmarks/sequence_explore.py) over one scripted sequence of what a requeued job and its
user do, every step held to its oracle: ``status --check``'s prediction holds for the next restart, ``status`` says
what ``verify`` found, the commands ``status`` prints run, the losses follow the uninterrupted run, a killed save
fails its run and never becomes ``latest``. The long random runs are the benchmark's (docs/resume.md)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import sequence_explore  # noqa: E402

OPS = [
    "train", "train", "kill", "cut", "train", "verify", "delete-file", "train", "flip", "edit-latest", "follow",
    "train", "rerun", "nan", "deep", "train", "delete-tag", "train-batch", "convert", "follow", "train",
]  # fmt: skip


def test_a_scripted_sequence_keeps_every_promise(tmp_path: Path):
    explorer = sequence_explore.explore([3], len(OPS), tmp_path, ops=OPS)
    assert not explorer.findings, "\n".join(f"step {f['step']}: {f['finding']}" for f in explorer.findings)
    done = explorer.sequences[3]
    assert len(done) == len(OPS) and explorer.counts["prediction held"] >= 5, (explorer.counts, done)
    assert explorer.counts["fell back"] >= 1, done  # the damage was met, not only trained past
