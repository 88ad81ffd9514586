"""Install and uninstall the runtime hooks into DeepSpeed.

Every hook is a named attribute of a known DeepSpeed class or module, listed in
:data:`megatron_ucp.deepspeed.surface.SURFACE` (checked whole against the running release before
anything is patched) and replaced through one :class:`PatchSet` so that :func:`uninstall` restores
exactly what was there. Hook modules are
listed in ``HOOK_MODULES``; each exposes ``wanted(config) -> bool`` and
``install(patches, config) -> None``. Installing twice with the same config is a no-op.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed.surface import PatchSet, check_surface
from megatron_ucp.deepspeed.versions import check_hooks_supported

__all__ = ["PatchSet", "active_config", "install", "make_visible", "restore_visibility", "uninstall"]

log = logging.getLogger(__name__)

# Order matters only for readability of logs: save-time recording, load path, background conversion.
HOOK_MODULES = (
    "megatron_ucp.integration.save.recording",
    "megatron_ucp.integration.save.experts",
    "megatron_ucp.integration.resume.elastic_load",
    "megatron_ucp.integration.save.async_trigger",
    "megatron_ucp.integration.save.async_save",
    "megatron_ucp.integration.save.memory_save",
)

_lock = threading.Lock()
_state: dict[str, Any] = {"patches": None, "config": None, "modules": []}


def active_config() -> Optional[UcpConfig]:
    """The config of the current installation, or None when the hooks are not installed."""
    return _state["config"]


def install(config: Optional[UcpConfig] = None, **overrides: Any) -> UcpConfig:
    """Patch DeepSpeed in-process. Idempotent for an equal config; a new config reinstalls.

    Settings: ``config`` if given, else the ``MEGATRON_UCP_*`` environment (defaults where unset);
    keyword ``overrides`` win over both.
    """
    if config is None:
        config = UcpConfig.from_env()
    if overrides:
        config = UcpConfig(**{**config.__dict__, **overrides})
    with _lock:
        if _state["patches"] is not None:
            if _state["config"] == config:
                return config
            _uninstall_locked()
        version = check_hooks_supported(config.allow_untested_deepspeed)
        check_surface(version)
        patches = PatchSet()
        installed = []
        try:
            for module_name in HOOK_MODULES:
                module = importlib.import_module(module_name)
                if module.wanted(config):
                    module.install(patches, config)
                    installed.append(module)
        except BaseException:
            for module in reversed(installed):
                getattr(module, "on_uninstall", lambda: None)()
            patches.undo()
            raise
        _state.update(patches=patches, config=config, modules=installed)
        log.info(
            "megatron-ucp hooks installed on DeepSpeed %s (%d patches: %s)",
            version,
            len(patches),
            ", ".join(m.__name__.rsplit(".", 1)[-1] for m in installed),
        )
        return config


def uninstall() -> None:
    """Restore every patched DeepSpeed attribute. Safe to call when nothing is installed."""
    with _lock:
        _uninstall_locked()


def _uninstall_locked() -> None:
    patches = _state["patches"]
    if patches is None:
        return
    for module in reversed(_state["modules"]):
        getattr(module, "on_uninstall", lambda: None)()
    patches.undo()
    _state.update(patches=None, config=None, modules=[])
    log.info("megatron-ucp hooks uninstalled")


# ================================================================================================
# The decision and summary lines of the hooks reach the training log, whoever configured logging.
#
# When the ``megatron_ucp`` logger has no level of its own, it gets INFO on the first rank (WARNING on
# the others, so that 768 ranks do not repeat it): a root logger left at WARNING, or configured by a
# library at import (intel-extension-for-pytorch calls ``logging.basicConfig``), would otherwise drop
# them. A handler is added only when neither that logger nor the root logger has one (the lines then
# go to the application's handlers in its format). An application that sets the ``megatron_ucp``
# logger's level or handlers keeps full control. :func:`restore_visibility` undoes it (uninstall).
# ================================================================================================

_handler: Optional[logging.Handler] = None
_level_set = False


def make_visible() -> None:
    """A level (and, where nobody has one, a handler) for the ``megatron_ucp`` logger; see above."""
    global _handler, _level_set
    pkg = logging.getLogger("megatron_ucp")
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
        _level_set = True
    if _handler is not None or pkg.handlers or logging.getLogger().handlers:
        return
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[megatron-ucp] %(levelname)s %(message)s"))
    pkg.addHandler(_handler)
    pkg.propagate = False


def restore_visibility() -> None:
    """Remove the log handler and level :func:`make_visible` added, if any."""
    global _handler, _level_set
    pkg = logging.getLogger("megatron_ucp")
    if _handler is not None:
        pkg.removeHandler(_handler)
        pkg.propagate = True
        _handler = None
    if _level_set:
        pkg.setLevel(logging.NOTSET)
        _level_set = False
