"""One typed configuration for everything :func:`megatron_ucp.install` turns on.

Built once (from keyword arguments, ``--ucp-*`` options or ``MEGATRON_UCP_*`` variables) and
validated in ``__post_init__``; every hook reads the same frozen object.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from .errors import UcpError


@dataclass(frozen=True)
class UcpConfig:
    # --- save time (issue: correct conversion) -------------------------------------------------
    record_true_lengths: bool = True
    """Record each rank's true unpadded lengths (and fix BF16_Optimizer's group_paddings) at save."""

    # --- load time (issue: elastic resume) -----------------------------------------------------
    elastic_resume: bool = True
    """On a DP change, load the universal twin of the requested tag (converting it if needed)."""
    strict: bool = True
    """Every tensor of a universal checkpoint must be consumed; False downgrades misses to warnings."""

    # --- background conversion (issue: async conversion) ---------------------------------------
    async_convert: bool = False
    """Convert every saved tag to the universal layout in background processes."""
    keep_last: Optional[int] = None
    """Keep at most this many universal folders per checkpoint root (None: keep all)."""
    converter_workers: int = 1
    """Worker processes per converter (each node runs one converter)."""
    converter_threads: int = 1
    """torch intra-op threads per converter worker."""
    ranks_per_node: Optional[int] = None
    """Processes per node, to pick one converter per node; None reads LOCAL_WORLD_SIZE / launcher env."""

    # --- safety -------------------------------------------------------------------------------
    allow_untested_deepspeed: bool = False
    """Install hooks on a DeepSpeed version they were not written for (logs a loud warning)."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise UcpError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.converter_workers < 1:
            raise UcpError(f"converter_workers must be >= 1, got {self.converter_workers}")
        if self.converter_threads < 1:
            raise UcpError(f"converter_threads must be >= 1, got {self.converter_threads}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UcpError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
