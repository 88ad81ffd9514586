"""``megatron-ucp status ROOT``: each tag's native checkpoint, universal twin and conversion state."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_ucp.background.status import format_status, root_status


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show each tag's universal conversion state",
        description="For every tag under a checkpoint root: native checkpoint present, universal "
        "twin complete / in progress (with progress) / pending / failed (with log path) / interrupted "
        "/ skipped / absent, DP size, sizes on disk, conversion time; and the background converters.",
    )
    p.add_argument("root", type=Path, help="checkpoint root (the --save folder)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-sizes", action="store_true", help="skip walking the folders for their sizes")
    p.add_argument(
        "--check", action="store_true", help="exit 1 when the tag in 'latest' has no complete universal checkpoint"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rs = root_status(args.root, sizes=not args.no_sizes)
    print(json.dumps(rs.to_json(), indent=1) if args.json else format_status(rs))
    return 1 if args.check and not rs.latest_converted else 0
