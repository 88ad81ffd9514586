"""``megatron-ucp verify PATH [--tag T] [--source TAG_DIR]``: a universal folder, or a native tag (and its twin)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ucp.cli import add_shared


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check a native tag (whole, one save, as recorded, finite) or a universal checkpoint (bit-exact)",
        description="PATH is a universal folder: every parameter and state present with the shape the model "
        "states record, matching the checksums its manifest recorded. PATH is a checkpoint root (its tag --tag, "
        "default the tag in 'latest') or a native tag folder: the tag itself is checked (every file whole, the "
        "files one checkpoint of one save, every partition what the save recorded when it was saved through the "
        "hooks, every real element of the masters and optimizer states finite), and its universal twin, when "
        "there is one, is verified and compared bit for bit with the tag. A native tag's verdict is recorded in its "
        "root's .ucp/ store, for `megatron-ucp status` and a restart's fallback.",
    )
    add_shared(p, "path", "a universal folder, a checkpoint root or a native tag folder")
    add_shared(p, "--tag", "with a checkpoint root: the tag whose twin to verify (default: 'latest')")
    p.add_argument("--source", type=Path, help="compare with this native tag folder (or root) instead")
    add_shared(p, "--no-progress", "no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # these import torch: only for this command
    from megatron_ucp.background.verdicts import record_verdict, tag_identity
    from megatron_ucp.convert.native_verify import verify_native
    from megatron_ucp.convert.universal import is_universal_folder
    from megatron_ucp.convert.verify import twin_of, verify_universal

    reports = []
    if args.tag is None and is_universal_folder(args.path):
        reports.append(verify_universal(args.path, args.source, progress=not args.no_progress))
    else:
        tag_dir, twin = twin_of(args.path, args.tag)
        identity = tag_identity(tag_dir)  # the files as they are before they are read
        native = verify_native(tag_dir, progress=not args.no_progress)
        reports.append(native)
        # in the root's store (made if needed), where `megatron-ucp status` and a restart's fallback read it
        record_verdict(tag_dir.parent, tag_dir.name, native.problems, "megatron-ucp verify", identity, say=False)
        if twin is None:
            if native.ok:  # nothing missing: a DP change reads the native files; the twin is for other changes
                absent = f"{tag_dir}: no universal twin (`megatron-ucp convert {tag_dir.parent} --tag {tag_dir.name}`"
                print(f"{absent} makes one, for --universal-checkpoint or a TP or PP change)", file=sys.stderr)
        else:
            source = args.source if args.source is not None else tag_dir if native.ok else None
            reports.append(verify_universal(twin, source, progress=not args.no_progress))
    for report in reports:
        for problem in report.problems[:50]:
            print(f"  {problem}", file=sys.stderr)
        if len(report.problems) > 50:
            print(f"  ... and {len(report.problems) - 50} more", file=sys.stderr)
    for report in reports:
        print(report.summary(listed=True))
    return 0 if all(report.ok for report in reports) else 1
