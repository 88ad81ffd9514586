"""The one finish of every route's load: the training state and the global batch checked, what universal mode skips
restored (:func:`restore_module_tensors`), every master and optimizer state finite (:func:`refuse_non_finite`: a NaN
that reached a save matches its checksums, so only this look at what the load placed stops it), one summary line and
one report, enforced.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megatron_ucp.deepspeed.reader import flatten_module_states, load_raw, load_torch_file
from megatron_ucp.errors import CheckpointFormatError, refuse_or_warn
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.rawtensor import torch_views_from_raw
from megatron_ucp.integration.collectives import comm, is_first
from megatron_ucp.integration.live_job import LiveJob, LoadCall, live_groups
from megatron_ucp.integration.resume.engine_load import CopiedFrom, LoadOutcome, loaded_path
from megatron_ucp.integration.resume.module_read import how_module_is_read, with_the_rest_exchanged
from megatron_ucp.plan.accounting import Problem, ProblemKind
from megatron_ucp.plan.names import counterpart_names
from megatron_ucp.plan.reshard import pieces_in
from megatron_ucp.plan.resume import (
    SCHEDULE_FLAGS,
    Route,
    check_global_batch,
    checkpoint_global_batch,
    restored_global_samples,
    schedule_difference,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 24
"""Elements looked at at once: the mask is 16 MiB, whatever a rank's partition holds."""


def non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor, a chunk at a time where it lives."""
    flat = tensor.detach().reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def _all_finite(tensor: torch.Tensor) -> bool:
    """One pass over the whole partition (padding included): the common case costs one sync per chunk of a state."""
    flat = tensor.detach().reshape(-1)
    return all(
        not bool((~torch.isfinite(flat[start : start + CHUNK])).any()) for start in range(0, flat.numel(), CHUNK)
    )


def _copied_from(origins: CopiedFrom, group: int, offset: int, tensor: torch.Tensor) -> list[str]:
    """The names of the old rank files whose elements in ``tensor`` (at ``offset`` of partition ``group``) are not
    finite."""
    ranks = {
        rank
        for rank, first, end in pieces_in(origins.reads[group], offset, offset + tensor.numel())
        if not _all_finite(tensor[first - offset : end - offset])
    }
    return [origins.rank_file(rank).name for rank in sorted(ranks)]


def _loaded(job: LiveJob) -> Iterator[tuple[int, int, str, str, torch.Tensor]]:
    """(partition, offset in it, parameter, state, its real elements) of every master and floating optimizer state
    of this rank that holds a NaN or Inf anywhere (a partition found finite whole is not cut into its parameters)."""
    for index, group in enumerate(live_groups(job.optimizer, job.names)):
        kept = job.base.state.get(group.flat, {})
        tensors = [(F.FP32_STATE, group.flat)] + [
            (name, value)
            for name, value in sorted(kept.items())
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == group.flat.shape
        ]
        suspects = [(name, tensor) for name, tensor in tensors if not _all_finite(tensor)]
        for fragment in group.fragments:
            for name, tensor in suspects:
                yield (
                    index,
                    fragment.offset,
                    job.names.get(fragment.lp, "?"),
                    name,
                    tensor.reshape(-1)[fragment.offset : fragment.offset + fragment.numel],
                )


def refuse_non_finite(job: LiveJob, folder: Path, strict: bool, origins: Optional[CopiedFrom] = None) -> None:
    """Raises on the ranks whose masters or optimizer states hold NaN or Inf (``strict``; else warns there); the
    load's agreement (:meth:`~megatron_ucp.integration.collectives.Collective.agreed`) makes it every rank's error. No
    collective here: another group's load may have failed before this point. ``origins``: a native reshard's,
    so that each finding names the old rank file(s) it came from."""
    rank = comm().get_rank()
    found = []
    with torch.no_grad():
        for index, offset, param, name, tensor in _loaded(job):
            nan, inf = non_finite(tensor)
            if nan or inf:
                files = _copied_from(origins, index, offset, tensor) if origins is not None else []
                source = f", copied from {' and '.join(files)}" if files else ""
                found.append(f"'{name}' of {param}: {nan} NaN and {inf} Inf of {tensor.numel()}{source}")
    if found:
        what = (
            f"{folder}: rank {rank} loaded masters or optimizer states that are not finite "
            f"({'; '.join(found[:4])}{' ...' if len(found) > 4 else ''}): resuming would train on NaN"
        )
        error = CheckpointFormatError(what, subject=folder, damaged=folder)  # saved in the folder it loaded
        refuse_or_warn(strict, error, [what], log, say=True)


def check_training_state(
    engine: Any, states: dict, ckpt_batch: Optional[int], current_batch: int, load_lr_scheduler_states: bool
) -> tuple[list[Problem], list[str]]:
    """DeepSpeed restores these in universal mode; check it did, and fix global_samples' fallback."""
    problems: list[Problem] = []
    extras: list[str] = []
    for key in ("global_steps", "skipped_steps"):
        if key not in states:
            problems.append(
                Problem(ProblemKind.TRAINING_STATE, None, key, "missing from the checkpoint's model states")
            )
        elif getattr(engine, key) != states[key]:
            problems.append(
                Problem(
                    ProblemKind.TRAINING_STATE,
                    None,
                    key,
                    f"engine has {getattr(engine, key)}, checkpoint {states[key]}",
                )
            )
    samples = restored_global_samples(states, ckpt_batch, current_batch)
    if samples is not None and states.get("global_samples") is None:
        engine.global_samples = samples  # DeepSpeed used steps x the *current* batch
    if samples is not None and engine.global_samples != samples:
        problems.append(
            Problem(
                ProblemKind.TRAINING_STATE,
                None,
                "global_samples",
                f"engine has {engine.global_samples}, checkpoint {samples}",
            )
        )
    extras.append(
        f"global_steps={engine.global_steps} global_samples={engine.global_samples} "
        f"skipped_steps={engine.skipped_steps}"
    )
    saved = states.get("lr_scheduler")
    scheduler = engine.lr_scheduler
    if scheduler is not None and load_lr_scheduler_states:
        if saved is None:
            problems.append(
                Problem(
                    ProblemKind.TRAINING_STATE,
                    None,
                    "lr_scheduler",
                    "the engine has an LR scheduler but the checkpoint saved none: it would restart its schedule",
                )
            )
        else:
            progress, settings = schedule_difference(scheduler.state_dict(), saved)
            if getattr(scheduler, "override_opt_param_scheduler", False):
                settings = []  # the run asked for its own values (Megatron keeps them over the checkpoint's)
            if progress:
                what = "; ".join(progress)
                problems.append(Problem(ProblemKind.TRAINING_STATE, None, "lr_scheduler", f"not restored: {what}"))
            if settings:
                problems.append(
                    Problem(
                        ProblemKind.COMMAND_LINE,
                        None,
                        "lr_scheduler",
                        f"this run's learning-rate schedule is not the checkpoint's ({'; '.join(settings)}): this "
                        "run's --lr, --min-lr, --train-iters, --lr-decay-iters and --lr-warmup-iters set it (the "
                        "last three counted in samples: a change of the global batch changes them too); "
                        f"{SCHEDULE_FLAGS}",
                    )
                )
            if not progress and not settings:
                extras.append("lr scheduler restored")
    elif saved is not None and scheduler is None:
        extras.append("lr scheduler state left to the client (no DeepSpeed scheduler)")
    return problems, extras


def megatron_saved_names(module: torch.nn.Module) -> Optional[set[str]]:
    """The module tensors Megatron's own save writes for this model (``state_dict_for_save_checkpoint``,
    flattened); None for a model without that method, which DeepSpeed saves as ``state_dict()``.

    Megatron's language model leaves deterministic persistent buffers out of its save (RoPE's
    ``inv_freq``): no checkpoint of the model holds them, so their absence says nothing is lost.
    """
    save = getattr(module, "state_dict_for_save_checkpoint", None)
    if not callable(save):
        return None
    try:
        return set(flatten_module_states(save()))
    except Exception:  # a model whose save needs state we do not have: judge it as DeepSpeed's save
        return None


def saved_module_tensors(folder: Path, states: dict) -> dict[str, Any]:
    """The module tensors a checkpoint holds, by flat name: the model states' ``module`` dict, or for
    a pipeline model (saved per layer) its ``layer_XX-model_00-model_states.pt`` files, named
    ``<layer index>.<key>`` as the pipeline model names them."""
    saved = flatten_module_states(states.get("module"))
    if saved or not folder.is_dir():
        return saved
    for path in sorted(folder.glob("layer_*-model_00-model_states.pt")):
        if F.LAYER_FILE_RE.match(path.name):
            index = int(path.name.split("-")[0][len("layer_") :])
            saved.update({f"{index}.{k}": v for k, v in flatten_module_states(load_torch_file(path)).items()})
    return saved


def _saved_parameter_names(folder: Path) -> list[str]:
    zero = folder / F.UNIVERSAL_ZERO_DIR
    return sorted(p.name for p in zero.iterdir() if p.is_dir()) if zero.is_dir() else []


def restore_module_tensors(
    module: torch.nn.Module, optimized: set[str], folder: Path, states: dict
) -> tuple[list[Problem], list[str]]:
    """Buffers and frozen parameters: universal mode skips the module state dict, so restore them here.

    ``optimized``: names of the parameters the optimizer restored. Frozen parameters (the others)
    come from ``zero/<name>/fp32.pt`` when the converter wrote one, else from the model states'
    module dict; persistent buffers from the checkpoint's module tensors
    (:func:`saved_module_tensors`), through the ``GPTModel`` <-> ``GPTModelPipe`` name map when the
    other class saved it. Strict: a held buffer of another shape is a problem, and so is a
    persistent buffer the checkpoint lacks, unless Megatron's own save never writes it
    (:func:`megatron_saved_names`); those stay as the model built them and are listed in one line.
    Non-persistent buffers are not part of any checkpoint. Returns (problems, extras).
    """

    saved = saved_module_tensors(folder, states)
    live = module.state_dict()
    named_params = dict(module.named_parameters())
    frozen = [n for n in named_params if n not in optimized]
    buffers = [n for n, _ in module.named_buffers() if n in live]
    unmatched = [n for n in buffers if n not in saved]
    if unmatched and saved:
        renamed = counterpart_names(unmatched, named_params, _saved_parameter_names(folder), saved)
        saved.update({live_name: saved[saved_name] for live_name, saved_name in renamed.items()})
    writes = megatron_saved_names(module) if any(n not in saved for n in buffers) else None
    problems: list[Problem] = []
    never_held: list[str] = []
    restored_frozen = restored_buffers = 0
    with torch.no_grad():
        for name in frozen:
            param = named_params[name]
            file = folder / F.UNIVERSAL_ZERO_DIR / name / f"{F.FP32_STATE}.pt"
            if file.is_file():
                source = load_torch_file(file, mmap=True)
                source = source.get(F.PARAM) if isinstance(source, dict) else source
            else:
                source = saved.get(name)
            if not torch.is_tensor(source) or tuple(source.shape) != tuple(param.shape):
                problems.append(
                    Problem(
                        ProblemKind.MODULE_TENSOR,
                        name,
                        F.FP32_STATE,
                        "frozen parameter not found (or of another shape) in zero/ and in the model states",
                    )
                )
                continue
            param.copy_(source)
            restored_frozen += 1
        for name in buffers:
            target = live[name]
            if name not in saved:
                if writes is not None and name not in writes:
                    never_held.append(name)
                else:
                    problems.append(
                        Problem(
                            ProblemKind.MODULE_TENSOR,
                            name,
                            "buffer",
                            f"persistent buffer missing from {folder.name}'s module states, although "
                            "the model's save writes it: it would keep the value the model was "
                            "built with",
                        )
                    )
                continue
            source = saved[name]
            if not torch.is_tensor(source) or tuple(source.shape) != tuple(target.shape):
                shape = tuple(source.shape) if torch.is_tensor(source) else type(source).__name__
                problems.append(
                    Problem(
                        ProblemKind.MODULE_TENSOR,
                        name,
                        "buffer",
                        f"{folder.name}'s model states hold it as {shape}, the model's buffer is {tuple(target.shape)}",
                    )
                )
                continue
            target.copy_(source)
            restored_buffers += 1
    extras = [f"{restored_buffers} buffers, {restored_frozen} frozen params restored"] if (buffers or frozen) else []
    if never_held:
        extras.append(
            f"{len(never_held)} persistent buffer(s) Megatron's save never writes, left as the model built "
            "them: " + ", ".join(never_held)
        )
    return problems, extras


# ================================================================================================
# the finish
# ================================================================================================

ENGINE_REPORT_ATTR = "megatron_ucp_load_report"
"""The engine attribute holding the last accounted load's :class:`AccountingReport` (for tools)."""


def finish(call: LoadCall, outcome: LoadOutcome) -> Any:
    """Every route's end: where the route accounted for the tensors (its report), the training state and the batch
    checked, the module tensors universal mode skips restored, one summary line, enforced as ``config.strict``
    says; then, on every route the hooks read (not DeepSpeed's own load of a form they do not), every master and
    optimizer state finite. Returns DeepSpeed's result."""
    if outcome.report is not None and outcome.load_path is not None:
        _account(call, outcome)
    loaded = loaded_path(outcome.result)
    if loaded is not None and not outcome.stock:
        refuse_non_finite(call.job, loaded.parent, call.config.strict, outcome.origins)
    return outcome.result


def _account(call: LoadCall, outcome: LoadOutcome) -> None:
    """The report completed with the training state's and the module's checks, kept on the engine, enforced.
    The model states are what the load already read (the reshard route), else the file mapped, so that only the
    parts read here are paged in."""
    job, kwargs, config = call.job, call.kwargs, call.config
    engine = job.engine
    load_path, dp_from = outcome.load_path, outcome.dp_from
    folder = load_path.parent
    dp_to = job.layout.dp
    problems: list[Problem] = []
    extras: list[str] = []
    states = outcome.states
    if states is None:  # the pickle only (our reader: readahead off), tensors read when used
        states = torch_views_from_raw(load_raw(load_path, random_access=True))
    if not isinstance(states, dict):
        raise CheckpointFormatError(f"{load_path}: not a DeepSpeed model-states dict", subject=load_path)

    current_batch = int(engine.train_batch_size())
    ckpt_batch = checkpoint_global_batch(states.get(F.DS_CONFIG), dp_from)
    if dp_from is not None and int(dp_from) != dp_to:
        warning = check_global_batch(ckpt_batch, current_batch, dp_from, dp_to)
        if warning and is_first():
            log.warning("megatron-ucp: !!! %s", warning)

    if not kwargs["load_module_only"]:
        p, e = check_training_state(engine, states, ckpt_batch, current_batch, kwargs["load_lr_scheduler_states"])
        problems += p
        extras += e
    if outcome.restore_module:
        optimized = set(job.optimized)
        if how_module_is_read(call, Route.UNIVERSAL_EXISTING).distributed:  # once across the DP group
            states = with_the_rest_exchanged(states, optimized, load_path, job.dp_group)
        p, e = restore_module_tensors(engine.module, optimized, folder, states)
        problems += p
        extras += e
    report = outcome.report.with_more(problems, extras, dp_from=dp_from)
    setattr(engine, ENGINE_REPORT_ATTR, report)
    report.enforce(config.strict, log, verbose=is_first(), folder=folder)
