"""``megatron-ucp status ROOT``: each tag's native checkpoint, universal twin and conversion state."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_ucp.background.status import root_status
from megatron_ucp.background.status_text import format_status, not_a_root
from megatron_ucp.cli import add_shared


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show what a restart resumes from, each tag's state (sound, damaged, converted) and what to do",
        description="For every tag under a checkpoint root: native checkpoint present, whether it is known sound "
        "or damaged (a recorded verdict, the file list its save wrote), universal twin complete / in progress "
        "(with progress) / pending / failed (with log path) / interrupted / skipped / absent, DP size, sizes on "
        "disk, conversion time; the background converters; what a restart resumes from, and anything a killed "
        "save left (set aside, a commit cut short). Reads folder names, sizes, markers, manifests and records "
        "only, unless --deep.",
    )
    add_shared(p, "root", "checkpoint root (the --save folder)")
    add_shared(p, "--json")
    p.add_argument("--no-sizes", action="store_true", help="skip walking the folders for their sizes")
    p.add_argument(
        "--check",
        action="store_true",
        help="say what a restart would load (the tag in 'latest', or the tag the fallback would load instead, from "
        "the verdicts recorded and the saves' file lists; with --deep, after reading every file) and exit 1 when it "
        "would load none",
    )
    p.add_argument(
        "--deep",
        action="store_true",
        help="also read every file: each native tag's files against their zip records and CRCs and its rank "
        "file count, each complete universal folder against its manifest and, bit for bit, its native tag; "
        "exit 1 when any is damaged",
    )
    add_shared(p, "--no-progress", "no progress bars (with --deep)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    wrong = not_a_root(args.root)
    if wrong is not None:
        print(f"megatron-ucp status: {wrong}", file=sys.stderr)
        return 1
    rs = root_status(args.root, sizes=not args.no_sizes)
    deep = None
    if args.deep:
        deep = _deep(rs, progress=not args.json and not args.no_progress)
        rs = root_status(args.root, sizes=not args.no_sizes)  # with the verdicts the deep check recorded
    if args.json:
        out = rs.to_json()
        if deep is not None:
            out["deep"] = {tag: problems for tag, (_, problems) in deep.items()}
        print(json.dumps(out, indent=1))
    else:
        text = format_status(rs)
        if deep is not None:
            text = text.rsplit("\n", 1)[0]  # the shallow "checked:" line no longer applies
            text += "\n\ndeep check (every file read):\n" + "\n".join(f"  {line}" for line, _ in deep.values())
        print(text)
    code = 0
    if deep is not None and any(problems for _, problems in deep.values()):
        code = 1
    if args.check:
        answer = rs.resume_answer()
        print(f"megatron-ucp status --check: {answer.said}", file=sys.stderr)
        if answer.tag is None:
            code = 1
    return code


def _deep(rs, progress: bool) -> dict[str, tuple[str, list[str]]]:
    """Per tag: one line saying what was read and found, and the problems (each naming its file)."""
    from megatron_ucp.background.verdicts import record_verdict, tag_identity
    from megatron_ucp.convert.native_verify import verify_native  # these import torch
    from megatron_ucp.convert.verify import verify_universal

    out: dict[str, tuple[str, list[str]]] = {}
    for row in rs.tags:
        said, problems = [], []
        native = rs.root / row.tag
        if row.native:
            identity = tag_identity(native)  # the files as they are before they are read
            report = verify_native(native, progress=progress)
            record_verdict(rs.root, row.tag, report.problems, "megatron-ucp status --deep", identity)
            said.append(
                f"native: {report.files} files read, "
                + (f"sound ({report.elements} elements finite)" if report.ok else f"{len(report.problems)} problem(s)")
            )
            problems += report.problems
        if row.universal.value == "complete":
            report = verify_universal(
                rs.root / f"{row.tag}_universal", native if row.native and not problems else None, progress=progress
            )
            said.append(f"universal: {report.summary()}")
            problems += report.problems
        if said:
            shown = "".join(f"\n      {p}" for p in problems[:10])
            more = f"\n      ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            out[row.tag] = (f"{row.tag}: " + "; ".join(said) + shown + more, problems)
    return out
