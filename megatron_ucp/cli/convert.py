"""``megatron-ucp convert ROOT``: convert a native checkpoint (ZeRO-1/2/3, any TP/PP/DP) to the universal layout."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from megatron_ucp.background.verdicts import record_conversion_verdict, record_refusal, tag_identity
from megatron_ucp.cli import add_shared
from megatron_ucp.convert.distributed import DistributedConvertError, convert_distributed, detect_launch, launch_summary
from megatron_ucp.convert.execute import ConvertOptions, convert, resolve_checkpoint
from megatron_ucp.deepspeed.folder import ResolvedCheckpoint
from megatron_ucp.errors import AlreadyConvertedError, CheckpointFormatError, UcpError

log = logging.getLogger(__name__)


def _share(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/2), got {text!r}")
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"share index must be in 0..{count - 1}, got {index}")
    return index, count


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a native checkpoint to the universal layout",
        description="Convert a DeepSpeed ZeRO-1/2/3 (bf16/fp16) checkpoint of any TP/PP/DP, experts included, into "
        "DeepSpeed's universal layout, bit-exactly, streaming, without temporary fragment files. A tag already "
        "converted is left as it is (exit 0; --force reconverts it).",
    )
    add_shared(p, "root", "checkpoint root (holding 'latest') or a tag folder (global_stepN)")
    add_shared(p, "--tag", "tag to convert (default: the root's 'latest')")
    add_shared(p, "--output", "output folder (default: ROOT/<tag>_universal)")
    add_shared(
        p, "--workers", "parallel writers (threads) in this process (default 1; the number of cores is a good choice)"
    )
    add_shared(p, "--force", "replace an existing output folder")
    p.add_argument("--no-latest", action="store_true", help="do not update ROOT/latest_universal")
    p.add_argument(
        "--share",
        type=_share,
        default=(0, 1),
        metavar="I/N",
        help="convert share I of N (one converter per node); the last share to finish commits",
    )
    p.add_argument("--attempt-id", help="id shared by the N converters of one conversion (required with --share)")
    add_shared(p, "--no-progress")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="this process is one of many started by torchrun, mpiexec (MPICH/PALS, Open MPI) or srun: "
        "convert share RANK of WORLD_SIZE, commit once, exit together (see docs/distributed_convert.md)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="with --distributed: how long processes wait for each other (default 1800)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    index, count = args.share
    if args.distributed:
        if count > 1:
            raise UcpError("--distributed takes the share from the launcher (RANK/WORLD_SIZE); do not pass --share")
        return _run_distributed(args)
    hint = launch_summary()
    if hint and count == 1:
        log.warning("launched as %s but --distributed not given: this process converts everything alone", hint)
    if count > 1 and not args.attempt_id:
        raise UcpError("--share I/N needs --attempt-id (the same for all N converters)")
    tag = _resolved(args)
    read = tag_identity(tag.tag_dir) if tag is not None else {}  # the files as they are before they are read
    try:
        result = convert(_options(args, share_index=index, share_count=count, progress=not args.no_progress))
    except AlreadyConvertedError as done:  # the job is done already: not an error
        print(f"megatron-ucp convert: {done}")
        return 0
    except CheckpointFormatError as refused:  # the tag's own files are at fault: its verdict says so
        if tag is not None:
            record_refusal(tag.tag_dir.parent, tag.tag, refused, CHECKED_BY, read)
        raise
    if result.committed and tag is not None:  # every element of the tag was read: what it found is its verdict
        record_conversion_verdict(tag.tag_dir.parent, tag.tag, result.output, CHECKED_BY)
    print(result.summary)
    _exit_now_if_program(0)
    return 0


CHECKED_BY = "megatron-ucp convert"


def _resolved(args: argparse.Namespace) -> Optional[ResolvedCheckpoint]:
    """The tag the command converts, for its verdict; None when it cannot be resolved (the conversion says why)."""
    try:
        return resolve_checkpoint(args.root, tag=args.tag)
    except UcpError:
        return None


def _options(args: argparse.Namespace, **more: object) -> ConvertOptions:
    """What the command line says, the same for one converter and for one process of many."""
    return ConvertOptions(
        source=args.root,
        tag=args.tag,
        output=args.output,
        workers=args.workers,
        force=args.force,
        update_latest=False if args.no_latest else None,
        attempt_id=args.attempt_id,
        **more,  # type: ignore[arg-type]
    )


def _run_distributed(args: argparse.Namespace) -> int:
    launch = detect_launch()
    if launch is None:
        raise UcpError(
            "--distributed: no launcher environment (RANK/WORLD_SIZE from torchrun, PMI_RANK/PMI_SIZE or "
            "PALS_RANKID from mpiexec, OMPI_COMM_WORLD_RANK/SIZE, SLURM_PROCID/SLURM_NTASKS)"
        )
    options = _options(args, progress=not args.no_progress and launch.rank == 0)
    try:
        result = convert_distributed(options, launch, timeout=args.dist_timeout)
    except DistributedConvertError as exc:
        print(f"megatron-ucp convert: rank {launch.rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    tag = _resolved(args)
    if tag is not None and launch.rank == result.committed_by:  # one verdict, by the rank that committed
        record_conversion_verdict(tag.tag_dir.parent, tag.tag, result.output, CHECKED_BY)
    if launch.rank == 0:
        print(result.summary())
    _exit_now_if_program(0)
    return 0


def _exit_now_if_program(code: int) -> None:
    """When this process is the ``megatron-ucp`` program itself, end it now, skipping interpreter teardown.

    Tearing down an interpreter that imported torch takes ~0.5 s on a small machine: a sixth of a
    1.4 GB conversion. Everything the conversion wrote is fsynced and committed by now; output
    streams and log handlers are flushed here. In-process callers (tests, the async converter
    calling ``cli.main``) are never affected: only the ``megatron-ucp`` script or
    ``python -m megatron_ucp.cli`` as ``__main__``.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    as_module = spec is not None and spec.name in ("megatron_ucp.cli", "megatron_ucp.cli.__main__")
    as_script = Path(getattr(main, "__file__", "") or "").name == "megatron-ucp"
    if not (as_module or as_script):
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
