"""What a memory save leaves to the masters: the model's optimized weights.

After a ZeRO-1/2 optimizer step every optimized bf16 weight is its fp32 master rounded to nearest, and every rank's
optimizer file holds its masters; the model states repeat them (13.5 GB at AuroraGPT-7B, a seventh of a save, all of
it written, summed and replicated by node 0's first rank). A memory save therefore writes each optimized weight as an
empty placeholder (the shape ``(0,)`` ZeRO-3 gives its partitioned parameters), in the model states' ``module`` and
in a pipeline model's layer files; buffers, frozen parameters and the client state stay. Its record says so, and a
restart from it rebuilds the weights from the loaded masters on every route that can (the native reshard and the
same-DP load, reading the module once across the job) and refuses the others before anything is loaded, so that the
durable checkpoint is loaded instead.

Only where it is exact: not ZeRO-3 (its model states hold no weights anyway), not a mixture of experts (DeepSpeed's
own module load reads the experts' files), not when the masters are derived from the weights at a load
(``load_from_fp32_weights`` off) or the restart reads the module from the files (``module_read = full``), and only
when on every rank the live weights are exactly the masters rounded (checked at each memory save, over this rank's
partition: a job that changed its weights after the step keeps them).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed.model_states import flatten_module_states, with_leaves_replaced
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import JOB, is_first
from megatron_ucp.integration.live_job import LiveJob, differing_partitions, live_job

log = logging.getLogger(__name__)

Shape = Callable[[Any, str], Any]
"""A saved state dict as it is written into ``path`` (:func:`leaving_out`)."""

_SAID: set[str] = set()


_MISMATCH = "the live weights are not the fp32 masters rounded to nearest"


def why_kept(job: LiveJob, config: Optional[UcpConfig]) -> Optional[str]:
    """Why this rank's memory save must keep the weights (None: the masters hold them exactly, and a restart with
    these settings rebuilds them). Local."""
    if config is not None and config.module_read != "distributed":
        return f"module_read={config.module_read}: a restart reads the module from the files"
    if job.per_parameter:
        return "ZeRO-3 saves no weights in its model states"
    if getattr(job.engine, "has_moe_layers", False):
        return "a mixture of experts: DeepSpeed's own module load reads the experts' files"
    if not job.loads_fp32_masters:
        return "zero_optimization.load_from_fp32_weights is off: a load derives the masters from the weights"
    if differing_partitions(job.weight_partitions()):
        return _MISMATCH
    return None


def decided(engine: Any, tag_dir: Path, config: Optional[UcpConfig]) -> Optional[Shape]:
    """Collective (every rank, the main group; never raises before it): what this memory save writes of each state
    dict when every rank's masters hold its weights (:func:`leaving_out`), else None (the files as a save writes
    them). Why is said once per reason and run: on the first rank (a warning when the weights differ from the masters,
    else a note: nothing is lost), and where the check itself failed."""
    try:
        job: Optional[LiveJob] = live_job(engine)
        why = why_kept(job, config)
    except Exception as exc:  # of any type: this rank keeps them, said here once, and every rank still meets below
        job, why = None, f"the check of the weights failed ({type(exc).__name__})"
        _say_once(why, f"{why}: {exc}", logging.WARNING)
    kept = JOB.count(1 if why is not None else 0)
    if kept and is_first():  # a mismatch (here or elsewhere) is a warning; a setting that keeps them, a note
        if why is not None:
            _say_once(why, why, logging.WARNING if why == _MISMATCH else logging.INFO)
        else:
            _say_once(
                "elsewhere",
                f"on {kept} rank(s) the weights are not the masters rounded, or their check failed",
                logging.WARNING,
            )
    if kept:
        return None
    try:
        return leaving_out(job, tag_dir)  # type: ignore[arg-type]
    except Exception as exc:  # of any type: this rank's files keep them (a restart rebuilds from the masters anyway)
        if "leaving out" not in _SAID:
            _SAID.add("leaving out")
            log.warning("megatron-ucp: %s: the weights stay in this rank's memory save files (%s)", tag_dir, exc)
        return _as_it_is


def _say_once(key: str, said: str, level: int) -> None:
    if key not in _SAID:  # once per reason and run
        _SAID.add(key)
        log.log(level, "megatron-ucp: memory saves keep the model's weights in their files: %s", said)


def _as_it_is(state_dict: Any, path: str) -> Any:
    return state_dict


def leaving_out(job: LiveJob, tag_dir: Path) -> Shape:
    """The save's state dicts with the optimized weights as empty placeholders: the model states' ``module`` (by the
    names the engine gives its parameters), and each of a pipeline stage's layer files (by identity with the live
    parameters, per file name as DeepSpeed's save names it). Any other file is written as it is."""
    optimized = job.optimized_params
    layers: dict[str, set[str]] = {}
    if job.pipeline:
        module, ids = job.engine.module, {id(lp) for lp in optimized.values()}
        for idx, layer in enumerate(module.forward_funcs):
            if hasattr(layer, "state_dict"):
                keys = {k for k, t in layer.state_dict(keep_vars=True).items() if id(t) in ids}
                layers[Path(module.ckpt_layer_path(str(tag_dir), idx)).name] = keys

    def shape(state_dict: Any, path: str) -> Any:
        name = Path(path).name
        if not isinstance(state_dict, dict):
            return state_dict
        if name in layers:
            return with_leaves_replaced(
                state_dict, {k: _placeholder(state_dict[k]) for k in layers[name] if k in state_dict}
            )
        module = state_dict.get(F.MODULE)
        if F.MODEL_FILE_RE.match(name) and isinstance(module, dict):
            out = {
                n: _placeholder(t)
                for n, t in flatten_module_states(module).items()
                if n in optimized and isinstance(t, torch.Tensor) and t.numel() == optimized[n].numel()
            }
            return {**state_dict, F.MODULE: with_leaves_replaced(module, out)}
        return state_dict

    return shape


def _placeholder(value: Any) -> Any:
    return torch.empty(0, dtype=value.dtype) if isinstance(value, torch.Tensor) else value
