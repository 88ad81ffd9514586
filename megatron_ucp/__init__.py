"""megatron-ucp: elastic resume for Megatron-DeepSpeed ZeRO-1/2 bf16 training.

``install()`` patches DeepSpeed in-process (save-time recording of true partition lengths,
elastic universal loading, optional background conversion); ``uninstall()`` reverts it.
The converter, verifier and inspector are plain library functions behind the ``megatron-ucp`` CLI.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import UcpError
from megatron_ucp.integration.install import active_config, install, uninstall
from megatron_ucp.version import __version__

__all__ = [
    "UcpConfig",
    "UcpError",
    "install",
    "uninstall",
    "active_config",
    "wait_for_saves",
    "save_to_memory",
    "__version__",
]


def wait_for_saves() -> None:
    """Collective: this process's asynchronous saves written and committed, and its memory save's commit done (for a
    script that reads a save's files itself right after ``save_checkpoint``, or that leaves its process group through
    ``torch.distributed`` itself; a load through the engine waits by itself). Nothing to do without them."""
    from megatron_ucp.integration.save.async_save import wait_for_saves as wait
    from megatron_ucp.integration.save.memory_save import wait as wait_for_memory

    wait_for_memory()
    wait()


def save_to_memory(root: "os.PathLike | str", iteration: int, save: Callable[[str], Any]) -> bool:
    """Collective: a memory save at ``iteration`` (``--ucp-memory-save-interval``) of the job whose durable saves go
    to ``root``: ``save(folder)`` is the job's own save into ``folder`` (``engine.save_checkpoint(folder, ...)``, or
    Megatron's ``save_checkpoint`` with ``args.save`` there), written to the node's memory and replicated on the next
    node. True once every rank's state is copied into host memory (the files are written and the save committed by
    the memory saves' writer thread, beside training); False when it failed (said on every rank; training goes on).
    The runner calls it by itself for Megatron-DeepSpeed scripts."""
    from megatron_ucp.integration.save.memory_save import save_to_memory as save_now

    config = active_config()
    if config is None or config.memory_save_interval is None:
        raise UcpError("save_to_memory needs the hooks installed with memory_save_interval set")
    return save_now(config, root, iteration, save)
