"""Megatron-DeepSpeed's memory saves: the runner's trigger of :func:`~megatron_ucp.integration.save.memory_save.
save_to_memory` inside Megatron's training loop, every ``--ucp-memory-save-interval`` iterations.

At the entry of ``megatron.training.train_step``, when ``args.iteration`` is a multiple of the interval (and not an
iteration the durable save just saved), the state is as Megatron's own save of that iteration sees it: Megatron's
``save_checkpoint`` runs with ``args.save`` pointed at the node's memory-save folder for that one call, so that the
memory save holds exactly what a durable save holds (args, iteration, tokens, RNG states, the engine's files);
Megatron's tracker and ``lr_state_dict.yaml`` are not written (the restart writes its own tracker), never into the
checkpoint root. Nothing in
Megatron-DeepSpeed is edited: ``train_step`` is replaced on the module when ``megatron.training`` is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any, Iterator, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.integration.node_memory import local_folder, node_name, note_progress
from megatron_ucp.integration.save.memory_save import save_to_memory

log = logging.getLogger(__name__)

MODULE = "megatron.training"
_STATE: dict[str, Any] = {"finder": None, "last": None, "folder": None}


def install(config: UcpConfig) -> None:
    """Replace ``train_step`` when ``megatron.training`` is imported (now, if it already is)."""
    if config.memory_save_interval is None:
        return
    module = sys.modules.get(MODULE)
    if module is not None:
        _wrap(module, config)
        return
    if _STATE["finder"] is None:
        finder = _Finder(config)
        _STATE["finder"] = finder
        sys.meta_path.insert(0, finder)


def uninstall() -> None:
    _STATE.update(last=None, folder=None)
    finder = _STATE["finder"]
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _STATE["finder"] = None
    module = sys.modules.get(MODULE)
    original = getattr(getattr(module, "train_step", None), "__wrapped_by_megatron_ucp__", None)
    if module is not None and original is not None:
        module.train_step = original


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps ``train_step`` as soon as ``megatron.training`` has run its body."""

    def __init__(self, config: UcpConfig) -> None:
        self.config = config

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, config = spec.loader, self.config

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                _wrap(module, config)

        spec.loader = _Loader()
        return spec


def _note(config: UcpConfig, save_dir: str, iteration: int) -> None:
    """The iteration about to be trained, in the node's folder (what a restart counts as lost)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    folder = _STATE.get("folder")
    if folder is None:
        folder = _STATE["folder"] = local_folder(config, save_dir, node_name(rank))
    note_progress(folder, rank, iteration)


@contextlib.contextmanager
def _quiet_rank0_writes() -> Iterator[None]:
    """Megatron's own small writes of a save, on the first rank alone, between its barriers (``lr_state_dict.yaml``,
    its tracker) left out of a memory save: a failure there (a full node folder) would raise on that rank alone, past
    a barrier the others wait in. The restart writes its own tracker."""
    from megatron import checkpointing

    saved = checkpointing.save_lr_state_dict, checkpointing.get_checkpoint_tracker_filename
    checkpointing.save_lr_state_dict = lambda *a, **k: None
    checkpointing.get_checkpoint_tracker_filename = lambda *a, **k: os.devnull
    try:
        yield
    finally:
        checkpointing.save_lr_state_dict, checkpointing.get_checkpoint_tracker_filename = saved


def _wrap(module: Any, config: UcpConfig) -> None:
    original = getattr(module, "train_step", None)
    if original is None or hasattr(original, "__wrapped_by_megatron_ucp__"):
        if original is None:
            log.warning("megatron-ucp: %s has no train_step: no memory saves", MODULE)
        return
    interval = int(config.memory_save_interval or 0)

    @functools.wraps(original)
    def train_step(forward_step_func: Any, data_iterator: Any, model: Any, optimizer: Any, scheduler: Any, *args, **kw):
        from megatron import get_args
        from megatron.checkpointing import save_checkpoint

        margs = get_args()
        iteration = int(getattr(margs, "iteration", 0) or 0)
        save_dir = getattr(margs, "save", None)
        durable = getattr(margs, "save_interval", None)
        if save_dir:
            _note(config, save_dir, iteration)
        if _STATE["last"] is None:  # the run's first step: its state is what it loaded (or its start), never saved
            _STATE["last"] = iteration
        if (
            save_dir
            and iteration > 0
            and iteration % interval == 0
            and _STATE["last"] != iteration
            and not (durable and iteration % durable == 0)
        ):
            _STATE["last"] = iteration

            def save(into: str) -> None:
                with _quiet_rank0_writes():
                    margs.save = into
                    try:
                        save_checkpoint(iteration, model, optimizer, scheduler)
                    finally:
                        margs.save = save_dir

            save_to_memory(config, save_dir, iteration, save)
        return original(forward_step_func, data_iterator, model, optimizer, scheduler, *args, **kw)

    train_step.__wrapped_by_megatron_ucp__ = original  # type: ignore[attr-defined]
    module.train_step = train_step
    log.info("megatron-ucp: memory saves every %d iteration(s), at the entry of Megatron's train_step", interval)
