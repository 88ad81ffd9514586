"""The ``megatron-ucp`` command: parses arguments, calls the library, maps errors to exit codes.

Each subcommand lives in ``megatron_ucp/cli/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``. The options several commands share
are declared once (:data:`SHARED_OPTIONS`, added by :func:`add_shared` with the command's own help).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ucp.errors import UcpError

COMMANDS = ("convert", "inspect", "verify", "status", "synthesize", "export_hf", "relaunch")

SHARED_OPTIONS: dict[str, dict[str, Any]] = {
    "root": dict(type=Path),
    "path": dict(type=Path),
    "--tag": dict(),
    "--output": dict(type=Path),
    "--force": dict(action="store_true"),
    "--workers": dict(type=int, default=1),
    "--json": dict(action="store_true", help="machine-readable output"),
    "--no-progress": dict(action="store_true", help="no progress bar"),
}
"""How each option several commands take is spelled and parsed, in one place; each command says what it means."""


def add_shared(parser: argparse.ArgumentParser, name: str, help: Optional[str] = None, **kwargs: Any) -> None:
    """``name`` from :data:`SHARED_OPTIONS` on ``parser``, with this command's ``help`` (and any setting of its own,
    e.g. another default)."""
    spec = {**SHARED_OPTIONS[name], **kwargs, **({"help": help} if help is not None else {})}
    parser.add_argument(name, **spec)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ucp",
        description="Elastic resume for Megatron-DeepSpeed (ZeRO-1/2/3, mixture of experts): run a training job "
        "with the hooks, convert, inspect, verify and follow its checkpoints.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # `run` is dispatched before parsing (its arguments are the training script's): listed here for --help only
    sub.add_parser("run", help="run a training script with the hooks installed (megatron-ucp run --help)")
    for name in COMMANDS:
        importlib.import_module(f"megatron_ucp.cli.{name}").register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # The runner hands the rest of argv to a training script untouched; see megatron_ucp.integration.run.
        from megatron_ucp.integration.run import main as run_main

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UcpError as exc:
        print(f"megatron-ucp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"megatron-ucp {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megatron-ucp {args.command}: interrupted; outputs not committed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
