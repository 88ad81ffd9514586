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

__all__ = ["UcpConfig", "UcpError", "install", "uninstall", "active_config", "wait_for_saves", "__version__"]


def wait_for_saves() -> None:
    """Collective: this process's asynchronous saves written and committed (for a script that reads a save's files
    itself right after ``save_checkpoint``; a load through the engine waits by itself). Nothing to do without them."""
    from megatron_ucp.integration.save.async_save import wait_for_saves as wait

    wait()
