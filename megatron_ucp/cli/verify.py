"""``megatron-ucp verify PATH [--tag T] [--source TAG_DIR]``: a universal folder, or the twin of a native tag."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check a universal checkpoint (completeness; bit-exact against its native tag)",
        description="Check that every parameter and state of a universal checkpoint is present with the shape "
        "the model states record and matches the checksums its manifest recorded. PATH is a universal folder, "
        "or a checkpoint root (the twin of --tag, default the tag in 'latest') or a native tag folder: then the "
        "twin is also compared bit for bit with the native tag's fragments.",
    )
    p.add_argument("path", type=Path, help="a universal folder, a checkpoint root or a native tag folder")
    p.add_argument("--tag", help="with a checkpoint root: the tag whose twin to verify (default: 'latest')")
    p.add_argument("--source", type=Path, help="compare with this native tag folder (or root) instead")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_ucp.convert.verify import verify_universal, what_to_verify  # imports torch: only for this command

    folder, source = what_to_verify(args.path, args.tag)
    source = args.source if args.source is not None else source
    report = verify_universal(folder, source, progress=not args.no_progress)
    for problem in report.problems[:50]:
        print(f"  {problem}", file=sys.stderr)
    if len(report.problems) > 50:
        print(f"  ... and {len(report.problems) - 50} more", file=sys.stderr)
    print(report.summary())
    return 0 if report.ok else 1
