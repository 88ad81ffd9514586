"""One typed configuration for everything :func:`megatron_ucp.install` turns on.

Built once (from keyword arguments, ``--ucp-*`` options or ``MEGATRON_UCP_*`` variables) and
validated in ``__post_init__``; every hook reads the same frozen object.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

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
    """OpenMP / torch threads of each converter process (``OMP_NUM_THREADS``); the converter only
    imports torch for rare fallbacks (states of 4 GB and more, frozen non-fp32 parameters)."""
    ranks_per_node: Optional[int] = None
    """Processes per node, to pick one converter per node; None reads LOCAL_WORLD_SIZE / launcher env."""
    converter_exit_wait: int = 900
    """Seconds a node's launcher process waits at exit for its background converter (0: no wait)."""

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
        if self.converter_exit_wait < 0:
            raise UcpError(f"converter_exit_wait must be >= 0 seconds, got {self.converter_exit_wait}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UcpError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "UcpConfig":
        """The config ``MEGATRON_UCP_<FIELD>`` variables describe (unset fields keep their defaults).

        Same parsing as the runner's ``--ucp-*`` options (see :mod:`megatron_ucp.run`); bad values
        raise :class:`UcpError` naming the variable.
        """
        from .run import build_settings  # the one parser of options and variables

        return build_settings([], os.environ if env is None else env)[0]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
