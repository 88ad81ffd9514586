"""Old import path of the hook installer (``megatron_ucp.hooks.install``); the code lives in
:mod:`megatron_ucp.integration.install`."""

from megatron_ucp.integration.install import PatchSet, active_config, install, uninstall

__all__ = ["PatchSet", "active_config", "install", "uninstall"]
