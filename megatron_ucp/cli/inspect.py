"""``megatron-ucp inspect ROOT``: geometry, padding, and what stock DeepSpeed would do."""

from __future__ import annotations

import argparse
import json

from megatron_ucp.cli import add_shared
from megatron_ucp.convert.inspection import format_report, inspect_checkpoint, inspect_geometry
from megatron_ucp.deepspeed.reader import BF16_OPTIMIZER, ZERO_OPTIMIZER, padding_style
from megatron_ucp.errors import UcpError
from megatron_ucp.plan.geometry import GroupGeometry, parse_dp_range

DEFAULT_TARGET_DP = "1-1024"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="report partition geometry and predict stock DeepSpeed failures",
        description="Report DP size, DeepSpeed version, optimizer class, per-group size / partition / "
        "padding, ranks holding only padding, whether stock ds_to_universal would crash, and at which "
        "target DP sizes stock DeepSpeed's universal loader would crash. Reads metadata only.",
    )
    add_shared(p, "root", nargs="?", help="checkpoint root or tag folder")
    add_shared(p, "--tag", "tag (default: the root's 'latest')")
    p.add_argument(
        "--target-dp",
        metavar="RANGE",
        help="DP sizes to check for the stock loader, listed in full: e.g. 256,512,768 or 12-768:12 (default: "
        f"{DEFAULT_TARGET_DP}, summarised)",
    )
    p.add_argument(
        "--group-numels", metavar="N1,N2,...", help="no checkpoint: inspect param groups of these sizes (with --dp)"
    )
    p.add_argument("--dp", type=int, help="DP size for --group-numels")
    p.add_argument(
        "--optimizer",
        choices=["bf16", "zero"],
        default="bf16",
        help="optimizer class for --group-numels (bf16: BF16_Optimizer, zero: DeepSpeedZeroOptimizer)",
    )
    p.add_argument("--ds-version", default="0.19.8", help="DeepSpeed version for --group-numels")
    add_shared(p, "--json")
    add_shared(
        p,
        "--no-progress",
        "accepted as every command accepts it (inspect reads metadata only and shows no progress bar)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    targets = parse_dp_range(args.target_dp or DEFAULT_TARGET_DP)
    if args.group_numels:
        if args.root is not None or not args.dp:
            raise UcpError("--group-numels needs --dp and no checkpoint path")
        try:
            numels = [int(v.replace("_", "")) for v in args.group_numels.split(",") if v.strip()]
        except ValueError as exc:
            raise UcpError(f"--group-numels: expected comma-separated integers, got {args.group_numels!r}") from exc
        kind = BF16_OPTIMIZER if args.optimizer == "bf16" else ZERO_OPTIMIZER
        style = padding_style(kind, args.ds_version, saved_with_ucp=False)
        report = inspect_geometry(
            [GroupGeometry(numel=n, dp=args.dp) for n in numels],
            style,
            targets,
            source=f"<{len(numels)} groups at DP={args.dp}>",
            ds_version=args.ds_version,
            optimizer=kind,
        )
    else:
        if args.root is None:
            raise UcpError("give a checkpoint path, or --group-numels with --dp")
        report = inspect_checkpoint(args.root, args.tag, targets)
    print(
        json.dumps(report.to_dict(), indent=1)
        if args.json
        else format_report(report, full_ranges=args.target_dp is not None)
    )
    return 0
