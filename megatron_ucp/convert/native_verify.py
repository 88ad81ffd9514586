"""A native tag verified as it is, before anyone resumes from it or converts it: is this save sound?

Four questions, each answered by the one place that already answers it for a load or a conversion, and every
problem named by its file:

1. is every ``.pt`` file whole (its zip structure as ``torch.load`` judges it, every record's CRC-32;
   :func:`megatron_ucp.convert.verify.native_tag_problems`)?
2. do the files make one checkpoint (the reader's cross-checks: positions, DP size, shapes, fragment maps;
   :func:`megatron_ucp.deepspeed.reader.read_checkpoint` and the conversion plan)?
3. saved through the hooks: is every file of this save, and every partition what the save recorded
   (:mod:`megatron_ucp.convert.save_check`, the conversion's own check)?
4. is every real element of every fp32 master and optimizer state finite
   (:class:`megatron_ucp.convert.finite.FiniteCheck`, the conversion's own check)? Each NaN or Inf is named by
   parameter, state and rank file. Padding is not read (ZeRO-3 leaves it uninitialized).

Each real element is read once, by the plan's own items (the same fragments a conversion writes), and serves
questions 3 and 4 together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from megatron_ucp.convert.execute import plan_checkpoint
from megatron_ucp.convert.finite import FiniteCheck
from megatron_ucp.convert.save_check import PartitionSums, identity_problems, partition_problems
from megatron_ucp.convert.verify import native_tag_problems
from megatron_ucp.convert.writer import RankFileCache, prefetch, release, state_fragments
from megatron_ucp.deepspeed.reader import rank_file_count_problem, read_checkpoint
from megatron_ucp.errors import CheckpointFormatError
from megatron_ucp.plan.conversion import ConversionPlan

log = logging.getLogger(__name__)


@dataclass
class NativeReport:
    tag_dir: Path
    files: int = 0
    partitions_checked: int = 0
    """Partitions that matched the checksum the save recorded (0: a save without the hooks' record)."""
    elements: int = 0
    """Real elements of masters and optimizer states read and found finite or not."""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self, listed: bool = False) -> str:
        """One line; ``listed``: the problems were printed above it (not repeated)."""
        if not self.ok:
            first = "listed above" if listed else f"first: {self.problems[0]}"
            return f"FAILED: {self.tag_dir}: {len(self.problems)} problem(s); {first}"
        record = (
            f"{self.partitions_checked} partitions matching the checksums the save recorded"
            if self.partitions_checked
            else "no recorded checksums (not saved through the hooks)"
        )
        return (
            f"OK: {self.tag_dir} is sound: {self.files} files whole, {record}, {self.elements} elements of masters "
            f"and optimizer states finite ({self.seconds:.1f} s)"
        )


def verify_native(tag_dir: Path, progress: bool = False) -> NativeReport:
    """Answer the module's four questions for one native tag folder; stops after the first question that fails
    (a file that is not whole, or files that are not one checkpoint, cannot be read further)."""
    t0 = time.perf_counter()
    report = NativeReport(Path(tag_dir))
    report.files, report.problems = native_tag_problems(report.tag_dir, None)
    if report.problems:
        return _done(report, t0)
    try:
        meta = read_checkpoint(report.tag_dir)
        plan = plan_checkpoint(meta)
    except CheckpointFormatError as exc:
        report.problems.append(str(exc))
        return _done(report, t0)
    count = rank_file_count_problem(meta.files.tag_dir, meta.dp)
    if count:
        report.problems.append(count)
        return _done(report, t0)
    cache = RankFileCache(list(meta.files.rank_files))
    report.problems = identity_problems(meta, cache)
    if report.problems:
        return _done(report, t0)
    sums, finite = PartitionSums(meta, cache), FiniteCheck(cache.paths)
    read_every_element(plan, cache, (sums.add, finite.add), progress)
    report.problems, checked = partition_problems(meta, cache, sums.totals())
    report.partitions_checked, report.elements = checked.checked, finite.elements
    report.problems += finite.problems()
    return _done(report, t0)


def read_every_element(plan: ConversionPlan, cache: RankFileCache, observers: tuple, progress: bool = False) -> None:
    """Every real element of every state of every parameter, read once from the rank files by the plan's items
    (TP replicas included), each fragment told to every observer (a :data:`~megatron_ucp.convert.writer.
    ReadObserver`)."""
    for p in tqdm(plan.params, desc="verify", disable=not progress, leave=False):
        items = list(p.items) + [item for copies in p.replicas for item in copies]
        for state in plan.groups[p.group].states:
            fragments = state_fragments(p, state, cache, items)
            prefetch(fragments)
            for observe in observers:
                observe(p, state, items, fragments)
            release(fragments)  # one read, not one resident copy of the checkpoint


def _done(report: NativeReport, t0: float) -> NativeReport:
    report.seconds = time.perf_counter() - t0
    log.debug(report.summary())
    return report
