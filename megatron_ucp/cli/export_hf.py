"""``megatron-ucp export-hf ROOT [--tag T] [--output DIR] [--dtype bf16|fp32]``: a Hugging Face model folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-hf",
        help="export a checkpoint as a Hugging Face LlamaForCausalLM folder (safetensors, config, tokenizer)",
        description="Writes a folder that transformers' AutoModelForCausalLM.from_pretrained loads with no "
        "network: config.json from the run's own Megatron args, the weights from the fp32 masters of the tag's "
        "universal folder (converted first when there is none or it is stale) as sharded safetensors with an "
        "index, generation_config.json, and the tokenizer files when the run's tokenizer is a file on disk. "
        "Any TP, PP, DP and ZeRO stage; a model LlamaForCausalLM cannot compute (experts, biases, LayerNorm, "
        "learned positions) is refused, listing why. Needs the [hf] extra (safetensors).",
    )
    p.add_argument("path", type=Path, help="a checkpoint root, a native tag folder, or a universal folder")
    p.add_argument("--tag", help="with a checkpoint root: the tag to export (default: the tag in 'latest')")
    p.add_argument("--output", type=Path, help="the export folder (default: <root>/<tag>_hf)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    p.add_argument("--max-shard-size", type=float, default=2.0, metavar="GIB", help="per safetensors file (2)")
    p.add_argument("--workers", type=int, default=2, help="writer threads of a conversion run first (2)")
    p.add_argument("--force", action="store_true", help="replace an existing export folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_ucp.export.hf_export import ExportOptions, export_hf

    result = export_hf(
        ExportOptions(
            source=args.path,
            tag=args.tag,
            output=args.output,
            dtype=args.dtype,
            force=args.force,
            max_shard_bytes=max(1, int(args.max_shard_size * 2**30)),
            workers=args.workers,
            progress=not args.no_progress,
        )
    )
    print(result.summary())
    return 0
