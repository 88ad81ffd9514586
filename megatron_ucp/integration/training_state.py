"""After a universal load: what DeepSpeed's universal mode skips, restored and checked.

Universal mode loads no module state dict and no client state beyond the model-states file:
:func:`restore_module_tensors` brings back buffers and frozen parameters (strict about what the
checkpoint holds, listing what it never held), and :func:`check_training_state` compares the
iteration, sample counters and learning-rate schedule with the checkpoint's, so that one summary
line says what was and was not restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ucp.deepspeed.reader import flatten_module_states, load_torch_file
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.accounting import Problem, ProblemKind
from megatron_ucp.plan.names import counterpart_names
from megatron_ucp.plan.resume import SCHEDULE_FLAGS, restored_global_samples, schedule_difference


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
                        "run's --train-iters, --lr-decay-iters, --lr-warmup-iters, --lr or --min-lr set it; "
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
