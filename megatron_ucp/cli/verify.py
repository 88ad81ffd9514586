"""``megatron-ucp verify UNIVERSAL_DIR [--source TAG_DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check a universal checkpoint (completeness; bit-exact with --source)",
        description="Check that every parameter and state is present with the shape the model states "
        "record; with --source, that every tensor equals the source's fragments bit for bit.",
    )
    p.add_argument("universal_dir", type=Path)
    p.add_argument("--source", type=Path, help="the native tag folder (or root) it was converted from")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_ucp.convert.verify import verify_universal  # imports torch: only for this command

    report = verify_universal(args.universal_dir, args.source, progress=not args.no_progress)
    for problem in report.problems[:50]:
        print(f"  {problem}", file=sys.stderr)
    if len(report.problems) > 50:
        print(f"  ... and {len(report.problems) - 50} more", file=sys.stderr)
    print(report.summary())
    return 0 if report.ok else 1
