"""Reading a native save's rank files outside a job, for tests and benchmarks: each file opened and checked on its
own, and which old files a new rank opens."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_ucp.deepspeed.tensor_reads import Source
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.integration.resume.native.binding import SavedFacts, expectation, inspect_file
from megatron_ucp.plan.reshard import Read


def source_ranks(reads: Sequence[Sequence[Read]]) -> list[int]:
    """The old rank files a new rank opens (sorted, each once)."""
    return sorted({read.source_rank for group in reads for read in group})


def open_source(path: Path, rank: int, facts: SavedFacts, reads: Sequence[Sequence[Read]]) -> Source:
    """One file opened and checked on its own, outside a job (tools, tests): raises on its first problem."""
    source, file_facts = inspect_file(path, facts, expectation(facts, rank, reads))
    if source is None:
        raise CheckpointFormatError(file_facts.problems[0], subject=path)
    return source
