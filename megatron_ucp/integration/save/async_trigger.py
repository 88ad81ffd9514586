"""Asynchronous conversion hook: every committed save gets its universal twin in the background.

``DeepSpeedEngine.save_checkpoint`` is wrapped: after DeepSpeed returned on every rank (files
written, checkpoint engine committed, ``latest`` written, the final barrier passed), the first
process of each node calls :func:`megatron_ucp.background.converter.trigger`, which queues the tag under
the root's lock and starts the node's detached converter process if none runs; then
``save_checkpoint`` returns. No collective is added: every node sees the same saves in the same
order, and the queue on the shared filesystem makes their requests agree.

With a decoupled checkpoint engine (``checkpoint_engine.is_decoupled()``) the files are only
committed later, in ``_commit_decoupled_checkpoint`` (called from ``step``); that method is
wrapped too and triggers the conversion after its commit and barrier, never before.

Failures never reach training: anything raised here is logged (with the command that converts
the tag by hand) and ``save_checkpoint`` returns normally. Rank 0 reports, at each save, every
queue event not reported yet: conversions completed, failed (with the log path), skipped because
saves came faster than conversions, interrupted, or removed by ``keep_last``.

End of run: an ``atexit`` handler in each node's launcher process (or the runner, when the script
ends normally: :func:`wait_at_end_of_run`) waits up to
``converter_exit_wait`` seconds for its node's converter, so the last save's conversion finishes
inside the job allocation; if it does not, it says so, and ``megatron-ucp status`` /
``megatron-ucp convert`` show and complete it. When training dies of an uncaught exception the
handler does not wait (a crashing job should end now: :func:`~megatron_ucp.integration.save.async_save.crashed`); the
detached converter goes on while the node lives.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp import launchenv
from megatron_ucp.background import queue as B
from megatron_ucp.background.store import ConverterSettings, read_queue
from megatron_ucp.background.trigger import trigger, unfinished, wait_for_converter
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.versions import internals
from megatron_ucp.integration.handled import STOCK, unhandled_reason, warn_once
from megatron_ucp.integration.save import async_save, memory_save

log = logging.getLogger(__name__)


_state: dict[str, Any] = {
    "config": None,
    "launched": {},
    "timings": [],
    "warned": set(),
}


def wanted(config: UcpConfig) -> bool:
    return config.async_convert or config.verify_saves


def _job(config: UcpConfig) -> str:
    """What each save queues: its conversion (whose read also judges it), else its verification alone."""
    if config.export_hf and not config.async_convert:
        _warn_once(
            "export",
            "megatron-ucp: --ucp-export-hf needs --ucp-async-convert (it exports the converted tags): no export",
        )
    return B.CONVERT if config.async_convert else B.VERIFY


def install(patches: Any, config: UcpConfig) -> None:
    """Wrap the engine's save (and, on releases with decoupled checkpoint engines, its commit); the
    install checked the surface."""
    # stacked: the save recording wraps save_checkpoint too (it installs first); undone in reverse order
    async_save.after_commit(lambda engine, save_dir, tag, place: _after_commit(engine, save_dir, tag, config, place))
    surface.replace(
        patches, surface.ENGINE, "save_checkpoint", lambda original: _wrap_save(original, config), stack=True
    )
    if internals().decoupled_commit:  # before 0.17 every checkpoint engine commits inside save_checkpoint
        surface.replace(
            patches, surface.ENGINE, "_commit_decoupled_checkpoint", lambda original: _wrap_decoupled(original, config)
        )
    _state.update(config=config, launched={}, warned=set())
    atexit.register(_at_exit)
    async_save.watch_for_crash()  # a job dying of an exception does not wait for the converter at its exit


def on_uninstall() -> None:
    """Stop waiting at exit; converters already started finish on their own."""
    atexit.unregister(_at_exit)
    async_save.stop_watching_for_crash()
    _state.update(config=None, launched={})


def trigger_timings() -> list[float]:
    """Seconds each post-save trigger took in this process (what async conversion adds to a save)."""
    return list(_state["timings"])


def _wrap_save(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint(self: Any, save_dir: str, tag: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, save_dir, tag, *args, **kwargs)
        # decoupled: the files are committed later, see _wrap_decoupled; asynchronous: at its commit (after_commit)
        if memory_save.target() is not None:  # a memory save: no tag of the checkpoint root, nothing to convert
            return result
        if not surface.decoupled_checkpoint_engine(self) and not (async_save.enabled() and async_save.supported(self)):
            _after_commit(self, save_dir, str(tag) if tag is not None else f"global_step{self.global_steps}", config)
        return result

    return save_checkpoint


def _wrap_decoupled(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def _commit_decoupled_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        info = self.checkpoint_engine.get_commit_info()
        result = original(self, *args, **kwargs)
        if info is not None:
            _after_commit(self, info.save_dir, str(info.tag), config)
        return result

    return _commit_decoupled_checkpoint


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _state["warned"]:
        _state["warned"].add(key)
        log.warning(message, *args)


def _after_commit(
    engine: Optional[Any], save_dir: str, tag: str, config: UcpConfig, place: Optional[tuple[int, int]] = None
) -> None:
    """Queue the conversion on each node's launcher; never raises (training goes on regardless). ``engine`` None: an
    asynchronous save committed at the end of the run (its engine was handled when it saved); ``place``: this
    process's (rank, world size) at that save, when the process group may be gone."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        reason = unhandled_reason(engine) if engine is not None else None  # None: an asynchronous save's commit
        if reason is not None:
            warn_once(reason, STOCK)
            return
        if engine is not None and surface.node_local_storage(engine):
            _warn_once(
                "local",
                "megatron-ucp: async conversion skipped: checkpoint.use_node_local_storage puts "
                "each node's files on its own disk; conversion needs them on one shared filesystem",
            )
            return
        rank, world = place if place is not None else (dist.get_rank(), dist.get_world_size())
        where = B.node_assignment(
            rank, world, launchenv.local_rank(os.environ), launchenv.local_size(os.environ), config.ranks_per_node
        )
        if where.note and rank == 0:
            _warn_once("nodes", "megatron-ucp: %s", where.note)
        kind = _job(config)
        if not where.launcher or (kind == B.VERIFY and where.node != 0):
            return  # a verification is one process's read: node 0's
        root = Path(save_dir).resolve()
        settings = ConverterSettings(
            workers=config.converter_workers,
            threads=config.converter_threads,
            keep_last=config.keep_last,
            export_hf=config.export_hf,
            job_id=ConverterSettings.job_id_from_env(),
        )
        nodes = where.nodes if kind == B.CONVERT else 1
        result = trigger(root, tag, where.node, nodes, settings, report=rank == 0, kind=kind)
        tags = _state["launched"].setdefault((str(root), where.node), [])
        if tag not in tags:
            tags.append(tag)
        if rank == 0:
            for event in result.events:
                level = (
                    logging.INFO
                    if event.kind in (B.EventKind.COMPLETE, B.EventKind.REMOVED, B.EventKind.CLEANED)
                    else logging.WARNING
                )
                log.log(level, "megatron-ucp: background conversion: %s", event.line())
            log.info(
                "megatron-ucp: %s queued for background %s on %d node(s) (active: %s, pending: %s%s)",
                tag,
                "conversion" if kind == B.CONVERT else "verification",
                nodes,
                result.active or "-",
                result.pending or "-",
                f", converter pid {result.spawned} started" if result.spawned else "",
            )
    except Exception as exc:  # loud, harmless
        log.error(
            "megatron-ucp: could not queue the background conversion of %s in %s: %s: %s. Training continues; "
            "convert it later with: megatron-ucp convert %s --tag %s",
            tag,
            save_dir,
            type(exc).__name__,
            exc,
            save_dir,
            tag,
        )
    finally:
        _state["timings"].append(time.perf_counter() - t0)


def _at_exit() -> None:
    wait_at_end_of_run()


def wait_at_end_of_run() -> None:
    """Wait (bounded by ``converter_exit_wait``) for this node's converter so the last save's
    conversion finishes inside the job. At process exit (``atexit``) for scripts that install the
    hooks themselves; the runner calls it when the script ends normally, before it uninstalls the
    hooks (which would stop the wait). Not after a crash: the job should end now."""

    async_save.finish_in_flight()  # the last saves committed first: only then are they converted
    config: Optional[UcpConfig] = _state["config"]
    launched: dict = _state["launched"]
    if config is None or not launched:
        return
    wait = 0 if async_save.crashed() else config.converter_exit_wait
    deadline = time.monotonic() + wait
    kind = _job(config)
    work, command = ("conversion", "convert") if kind == B.CONVERT else ("verification", "verify")
    for (root, node), tags in sorted(launched.items()):
        try:
            owed = unfinished(Path(root), tags, kind)
            if owed and wait > 0:
                log.warning(
                    "megatron-ucp: waiting up to %ds for the background %s of %s (node %d)",
                    max(0, int(deadline - time.monotonic())),
                    work,
                    ", ".join(owed),
                    node,
                )
            done = wait_for_converter(Path(root), node, max(0.0, deadline - time.monotonic()))
            owed = unfinished(Path(root), tags, kind)
            if config.export_hf and kind == B.CONVERT:
                _say_failures(Path(root), [t for t in tags if t not in owed], B.EXPORT_HF)
            if owed:
                log.warning(
                    "megatron-ucp: background %s of %s in %s did not finish before exit (%s). "
                    "`megatron-ucp status %s` shows it; `megatron-ucp %s %s --tag %s` completes it.",
                    work,
                    ", ".join(owed),
                    root,
                    "converter still running, detached" if not done else "converter stopped",
                    root,
                    command,
                    root,
                    owed[-1],
                )
                _say_failures(Path(root), owed, kind)
            elif node == 0:
                log.info("megatron-ucp: background %ss in %s finished (last saved: %s)", work, root, tags[-1])
        except Exception as exc:
            log.error("megatron-ucp: waiting for the background %s in %s failed: %s", work, root, exc)


def _say_failures(root: Path, tags: list[str], kind: str) -> None:
    """Each owed tag whose job failed or was rejected, in the job's own words (not only "did not finish")."""
    state = read_queue(root)
    for tag in tags:
        last = state.last_event(tag, B.event_job(kind))
        if last is not None and last.kind in (B.EventKind.FAILED, B.EventKind.REJECTED):
            log.error("megatron-ucp: background %s: %s", kind, last.line())
