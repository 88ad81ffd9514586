"""One summary of `make test`'s pytest runs (the full suite and each DeepSpeed release of the matrix).

``python tests/support/matrix_summary.py RESULTS_DIR`` reads every JUnit XML file pytest wrote there and
prints one line per run and a closing ``N passed, N failed, N skipped`` line over all of them. When
no run against the real Megatron-DeepSpeed is among them (no snapshot beside the checkout), the
lines just above that closing line say so and how to run them: a green `make test` without them
proves much less, and one skipped test among hundreds is easy to miss.
Exit status: 0, or 1 when a run failed or no test ran at all.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MDS_RESULTS_PREFIX = "megatron-deepspeed-"
"""The Makefile names the JUnit file of each run against the real Megatron-DeepSpeed so."""


def not_run_note(expected: str) -> str:
    where = expected or "../shared/third_party/megatron-deepspeed"
    if (Path(where) / "pretrain_gpt_alcf.py").is_file():
        why = f"a checkout is at {where}, but no run against it left results (stopped before them?)"
    else:
        why = f"no checkout at {where} (pretrain_gpt_alcf.py not found)"
    return (
        f"\n!!! The tests against the real Megatron-DeepSpeed did NOT run: {why}.\n"
        "!!! To run them: MEGATRON_DEEPSPEED_DIR=/path/to/Megatron-DeepSpeed EZPZ_DIR=/path/to/ezpz make test\n"
        "!!! (argonne-lcf/Megatron-DeepSpeed and saforem2/ezpz; see tests/integration/mds.py)"
    )


def counts(path: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one JUnit XML file; errors count as failures."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/support/matrix_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    files = sorted(Path(argv[1]).glob("*.xml"))
    passed = failed = skipped = 0
    print("\n=== make test: every run")
    width = max([32] + [len(path.stem) + 1 for path in files])
    for path in files:
        p, f, s = counts(path)
        passed, failed, skipped = passed + p, failed + f, skipped + s
        print(f"  {path.stem:<{width}} {p:4d} passed {f:3d} failed {s:3d} skipped")
    if not any(path.stem.startswith(MDS_RESULTS_PREFIX) for path in files):
        print(not_run_note(os.environ.get("MEGATRON_DEEPSPEED_DIR", "")))
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
