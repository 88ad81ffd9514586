"""Install and uninstall the runtime hooks into DeepSpeed.

Every hook is a named attribute of a known DeepSpeed class or module, replaced through one
:class:`PatchSet` so that :func:`uninstall` restores exactly what was there. Hook modules are
listed in ``HOOK_MODULES``; each exposes ``wanted(config) -> bool`` and
``install(patches, config) -> None``. Installing twice with the same config is a no-op.
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Callable, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed.versions import check_hooks_supported

log = logging.getLogger(__name__)

# Order matters only for readability of logs: save-time recording, load path, background conversion.
HOOK_MODULES = (
    "megatron_ucp.integration.save_recording",
    "megatron_ucp.integration.elastic_load",
    "megatron_ucp.integration.async_trigger",
)

_MARK = "__megatron_ucp_original__"


class PatchSet:
    """Replaces attributes and remembers the originals, so every change can be undone."""

    def __init__(self) -> None:
        self._applied: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Set ``owner.name = make(original)``; the replacement keeps a pointer to the original."""
        original = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        if getattr(original, _MARK, None) is not None:
            raise RuntimeError(f"{owner!r}.{name} is already patched by megatron-ucp")
        replacement = make(original)
        setattr(replacement, _MARK, original)
        setattr(owner, name, replacement)
        self._applied.append((owner, name, original))

    def undo(self) -> None:
        while self._applied:
            owner, name, original = self._applied.pop()
            setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._applied)


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
        log.info("megatron-ucp hooks installed on DeepSpeed %s (%d patches: %s)", version, len(patches),
                 ", ".join(m.__name__.rsplit(".", 1)[-1] for m in installed))
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
