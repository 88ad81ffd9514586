"""Execute a conversion plan: stream the state files, commit the universal folder atomically,
verify it, inspect a checkpoint, and split the work between the processes of a distributed run.

The converter API (docs/ARCHITECTURE.md) is re-exported here::

    from megatron_ucp.convert import ConvertOptions, convert, resolve_checkpoint

Imports: ``deepspeed``, ``plan``, ``format``, ``errors``.
"""

from megatron_ucp.convert.execute import (
    ConvertOptions,
    ConvertResult,
    convert,
    default_output,
    plan_checkpoint,
    resolve_checkpoint,
)
from megatron_ucp.convert.writer import RankFileCache

__all__ = [
    "ConvertOptions",
    "ConvertResult",
    "RankFileCache",
    "convert",
    "default_output",
    "plan_checkpoint",
    "resolve_checkpoint",
]
