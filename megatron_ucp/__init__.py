"""megatron-ucp: elastic resume for Megatron-DeepSpeed ZeRO-1/2 bf16 training.

``install()`` patches DeepSpeed in-process (save-time recording of true partition lengths,
elastic universal loading, optional background conversion); ``uninstall()`` reverts it.
The converter, verifier and inspector are plain library functions behind the ``megatron-ucp`` CLI.
"""
from __future__ import annotations

from .config import UcpConfig
from .errors import UcpError
from .hooks import active_config, install, uninstall

__version__ = "0.1.0"

__all__ = ["UcpConfig", "UcpError", "install", "uninstall", "active_config", "__version__"]
