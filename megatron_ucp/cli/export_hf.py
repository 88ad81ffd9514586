"""``megatron-ucp export-hf ROOT [--tag T] [--output DIR] [--dtype bf16|fp32]``: a Hugging Face model folder."""

from __future__ import annotations

import argparse

from megatron_ucp.cli import add_shared


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
    add_shared(p, "path", "a checkpoint root, a native tag folder, or a universal folder")
    add_shared(p, "--tag", "with a checkpoint root: the tag to export (default: the tag in 'latest')")
    add_shared(p, "--output", "the export folder (default: <root>/<tag>_hf)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    p.add_argument("--max-shard-size", type=float, default=2.0, metavar="GIB", help="per safetensors file (2)")
    add_shared(p, "--workers", "writer threads of a conversion run first (2)", default=2)
    add_shared(p, "--force", "replace an existing export folder")
    add_shared(p, "--no-progress")
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
