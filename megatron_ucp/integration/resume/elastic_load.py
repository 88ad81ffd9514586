"""Elastic resume's entry: ``engine.load_checkpoint`` at any DP size, with every tensor accounted for.

The call order of a load, told once here (every step collective; one :class:`~megatron_ucp.integration.live_job.
LoadCall` carried through):

1. the live job read once (:func:`~megatron_ucp.integration.live_job.live_job`); what a killed save left, settled;
2. with no tag given, the restart's judge and fallback around the rest (:mod:`.fallback`);
3. one decision, on the first rank, agreed (:mod:`.decide`);
4. one route, each returning a :class:`~megatron_ucp.integration.resume.engine_load.LoadOutcome`:
   the native ones (:mod:`.native.routes`): the old files bound (:mod:`.native.binding`), DeepSpeed's own load,
   then the copy and its ledger (:mod:`.native.reshard`) or the check of what DeepSpeed loaded; the universal twin
   (:mod:`.universal.route`); or DeepSpeed's own load where nothing of ours applies;
5. one finish (:func:`~megatron_ucp.integration.resume.finish.finish`): training state, module tensors, finite
   masters and states, the summary and the report enforced.

The whole load is agreed across the job (:meth:`~megatron_ucp.integration.collectives.Collective.agreed`): refused
on every rank or on none. Two DeepSpeed attributes are replaced, through the install's
:class:`~megatron_ucp.deepspeed.surface.PatchSet` (``uninstall()`` restores them): ``DeepSpeedEngine.load_checkpoint``
and ZeRO-1/2's ``load_hp_checkpoint_state_from_checkpoint_dir`` (the universal partition loader). A job no optimizer
layout handles loads as stock DeepSpeed loads it, with one warning.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ucp.background.set_aside import recover
from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.errors import (
    AccountingError,
    CheckpointFormatError,
    PlanError,
    UcpError,
    UnsupportedError,
    briefly,
)
from megatron_ucp.integration.collectives import JOB, is_first
from megatron_ucp.integration.handled import STOCK, unhandled_reason, warn_once
from megatron_ucp.integration.install import make_visible, restore_visibility
from megatron_ucp.integration.live_job import LoadCall, live_job
from megatron_ucp.integration.node_memory import human_size, restoring
from megatron_ucp.integration.resume import from_memory
from megatron_ucp.integration.resume.decide import Decided, decide, refuse_an_expert_layout_change
from megatron_ucp.integration.resume.engine_load import LoadOutcome
from megatron_ucp.integration.resume.fallback import SchedulerAsBefore, load_with_fallback
from megatron_ucp.integration.resume.finish import finish
from megatron_ucp.integration.resume.native.routes import refuse_weights_left_out, reshard_load, same_dp_load
from megatron_ucp.integration.resume.universal.partition_load import install_partition_loader
from megatron_ucp.integration.resume.universal.route import universal_load
from megatron_ucp.plan.resume import Route

log = logging.getLogger(__name__)


def wanted(config: UcpConfig) -> bool:
    return config.elastic_resume


def install(patches: Any, config: UcpConfig) -> None:
    """Patch the engine's load entry point and the ZeRO-1/2 universal loader (the install checked the
    whole surface they rely on)."""
    from_memory.reset()
    surface.replace(patches, surface.ENGINE, "load_checkpoint", lambda original: _engine_load(original, config))
    install_partition_loader(patches, config)
    make_visible()


def on_uninstall() -> None:
    restore_visibility()


def _engine_load(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(
        self: Any,
        load_dir: str,
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Optional[Callable] = None,
    ) -> Any:
        kwargs = dict(
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        reason = unhandled_reason(self)
        if reason is not None:  # an optimizer class, stage or grouping no layout handles: stock, one warning
            warn_once(reason, STOCK)
            if load_optimizer_states and not load_module_only and not self.load_universal_checkpoint():
                refuse_an_expert_layout_change(self, load_dir, tag, config)
            return original(self, load_dir, tag, **kwargs)
        job = live_job(self)  # read once; everything after reads this
        call = LoadCall(job, original, load_dir, kwargs, config)
        JOB.decide(lambda: recover(Path(load_dir)))  # what a killed save left settled before anything is read
        if from_memory.first_load() and tag is None and from_memory.wanted(config):
            loaded = _from_memory(call)
            if loaded is not None:
                return loaded

        def load(chosen: Optional[str]) -> Any:  # refused on every rank or on none
            return JOB.agreed(
                lambda: _load_tag(call, chosen),
                f"loading {chosen or 'latest'}",
            )

        if tag is None and config.fallback:
            return load_with_fallback(
                Path(load_dir),
                load,
                universal=job.load_universal,
                scheduler=getattr(self, "lr_scheduler", None),
            )
        return load(tag)

    return load_checkpoint


def _from_memory(call: LoadCall) -> Any:
    """A restart from the nodes' memory saves when one newer than the durable ``latest`` is whole
    (:mod:`.from_memory`); None: load the durable checkpoint (said why)."""
    try:
        restored, error = from_memory.restore(call), None
    except Exception as exc:  # of any type, on every rank alike (what restore reads, it shares first): the durable
        restored, error = None, exc
    if JOB.count(1 if error is not None else 0):
        if restored is not None:
            restored.assembly.clear()
        if is_first():
            said = f"reading the nodes' memory saves failed ({briefly(error) if error else 'on another rank'})"
            log.error("megatron-ucp: restart: %s; loading the durable checkpoint", said)
        return None
    if restored is None:
        return None
    if is_first():
        log.warning("megatron-ucp: %s", restored.summary)
    memory = dataclasses.replace(call, load_dir=str(restored.load_dir))
    as_before = SchedulerAsBefore(getattr(call.job.engine, "lr_scheduler", None))
    try:
        with restoring(restored.assembly):
            loaded = JOB.agreed(
                lambda: _load_tag(memory, restored.tag, native_only=True), f"loading the memory save {restored.tag}"
            )
        if is_first():
            log.info(
                "megatron-ucp: the memory save of iteration %d: %s of its files sent between nodes over the process "
                "group (of %s in all), in up to %d round(s)",
                restored.step,
                human_size(restored.assembly.received),
                human_size(sum(size for _, size, _ in restored.assembly.of_file.values())),
                restored.assembly.rounds,
            )
        return loaded
    except UcpError as exc:
        refusal = isinstance(exc, (CheckpointFormatError, AccountingError, UnsupportedError, PlanError))
        try:
            others = JOB.count(0 if refusal else 1)  # a refusal on every rank, or the job's own failure
        except Exception:  # the group is broken (a rank died): this rank's own error
            raise exc from None
        if others or restored.durable is None:  # nothing durable to fall back to: the engine may be half-loaded
            raise
        as_before.restore()  # a refused load may have added its steps to Megatron's scheduler already
        if is_first():
            said = (
                f"the memory save of iteration {restored.step} was refused ({exc}); loading the durable checkpoint "
                f"{restored.durable or '(none)'} instead"
            )
            log.error("megatron-ucp: restart: %s", said)
            from_memory.record(call.load_dir, said, None)
        return None
    finally:
        restored.assembly.clear()  # the memory save's generation stays where it was saved


def _load_tag(call: LoadCall, tag: Optional[str], native_only: bool = False) -> Any:
    """One load of ``tag`` (None: the one ``latest`` names): decide, route, finish. ``native_only``: a memory save's
    folder, which exists on each node alone: a route through the universal twin (converted into the checkpoint's
    folder, read by every rank) is refused before anything loads."""
    decided = decide(call, tag)
    decision = decided.decision
    if native_only and decision.route not in (Route.NATIVE, Route.RESHARD):
        raise UnsupportedError(
            f"{decision.message}: a memory save is loaded only by the native routes (its folder is on each node "
            "alone, the universal twin would be converted into it)",
            subject=call.load_dir,
        )
    if decision.route is Route.NATIVE and (decision.checkpoint_dp is None or not call.loads_states):
        # nothing of ours to do: stock DeepSpeed's load, of the tag the first rank read from `latest` (a rank reading
        # it again could see another value on a shared file system, and load something else)
        refuse_weights_left_out(call, "this load is DeepSpeed's own (no optimizer states, or no partition record)")
        return call.deepspeed(tag if tag is not None else decided.native_tag)
    if is_first():
        log.info("megatron-ucp: %s", decision.message)
        if decision.warning and decision.route is not Route.NATIVE:
            log.warning("megatron-ucp: %s", decision.warning)
    return finish(call, _route(call, decided))


def _route(call: LoadCall, decided: Decided) -> LoadOutcome:
    """The decided route's load, up to its report: each a straight function of the call, the saved facts the
    decision read, and the decision."""
    decision = decided.decision
    if decision.route is Route.NATIVE:
        return same_dp_load(call, decided.native_tag, decided.model_states)
    if decision.route is Route.RESHARD:
        return reshard_load(call, decision.tag, int(decision.checkpoint_dp), decided.model_states)
    return universal_load(call, decision, decided.native_tag, decided.from_latest)
