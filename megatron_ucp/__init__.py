"""megatron-ucp: elastic resume for Megatron-DeepSpeed ZeRO-1/2 bf16 training.

``install()`` patches DeepSpeed in-process (save-time recording of true partition lengths,
elastic universal loading, optional background conversion); ``uninstall()`` reverts it.
The converter, verifier and inspector are plain library functions behind the ``megatron-ucp`` CLI.
"""

from __future__ import annotations

from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import UcpError
from megatron_ucp.integration.install import active_config, install, uninstall
from megatron_ucp.version import __version__

__all__ = ["UcpConfig", "UcpError", "install", "uninstall", "active_config", "__version__"]
