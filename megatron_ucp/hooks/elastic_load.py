"""Elastic resume: ``engine.load_checkpoint`` at any DP size, with every tensor accounted for.

Two DeepSpeed attributes are replaced (through the :class:`~megatron_ucp.hooks.PatchSet`, so
``uninstall()`` restores them):

``DeepSpeedEngine.load_checkpoint``
    Before loading, rank 0 reads the DP size recorded in the requested tag's model states and
    :func:`megatron_ucp.resume.decide_resume` picks the route; the decision is broadcast so all
    ranks act alike. Same DP: DeepSpeed's native load, untouched. DP changed: the universal twin
    ``<tag>_universal`` is loaded in universal mode (the engine's ``load_universal`` flag is set
    for the call and restored afterwards), converting it first when it is missing (one converter
    per node, all ranks waiting). Universal loads (this route or the explicit
    ``{"checkpoint": {"load_universal": true}}``) then restore what DeepSpeed skips (module buffers,
    frozen parameters, ``global_samples`` after a batch change), check the training state and the
    global batch, and log one summary line.

``ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir``
    Our own loader for BF16_Optimizer and DeepSpeedZeroOptimizer (ZeRO-1/2). It copies each
    parameter's fragments of fp32 and of every optimizer state file into this rank's flat
    partition, creates the flat optimizer states with the checkpoint's keys on every rank (zeros
    where a rank holds only padding: stock DeepSpeed dies there with ``IndexError``), restores the
    group's ``step`` and hyperparameters, and proves with one ``all_reduce`` of element counts and
    checksums (:mod:`megatron_ucp.accounting`) that every element of every file landed exactly
    once, and that no state the live optimizer keeps was left unrestored.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from .. import dsformat as F
from .. import integrity
from ..accounting import (AccountingReport, Column, Ledger, Problem, ProblemKind, add_sum, check_folders, check_ledger,
                          check_optimizer_states, checksum, group_tensor_states, ledger_totals)
from ..config import UcpConfig
from ..errors import CheckpointFormatError, UcpError, UnsupportedError
from ..paths import read_tag_file
from ..resume import (ResumeDecision, Route, TwinState, check_global_batch, checkpoint_global_batch, decide_resume,
                      restored_global_samples)

log = logging.getLogger(__name__)

_OPTIMIZER_LOADER = "load_hp_checkpoint_state_from_checkpoint_dir"
_REPORT_ATTR = "_megatron_ucp_load_report"
ENGINE_REPORT_ATTR = "megatron_ucp_load_report"
"""The engine attribute holding the last universal load's :class:`AccountingReport` (for tools)."""
_LP_GROUPS = {"BF16_Optimizer": "bf16_groups", "DeepSpeedZeroOptimizer": "bit16_groups"}
# Inside our engine wrapper the optimizer loader leaves enforcement to the wrapper, so that tensor
# and training-state problems end up in one report and one summary line.
_DEFER_ENFORCEMENT: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_defer", default=False)
# Optimizers outside torch.optim whose lazily created states are known (they cannot be probed on CPU).
_KNOWN_STATES = {
    "FusedAdam": ("step", "exp_avg", "exp_avg_sq"),
    "DeepSpeedCPUAdam": ("step", "exp_avg", "exp_avg_sq"),
    "FusedLamb": ("step", "exp_avg", "exp_avg_sq"),
    "DeepSpeedCPULamb": ("step", "exp_avg", "exp_avg_sq"),
}


def wanted(config: UcpConfig) -> bool:
    return config.elastic_resume


def install(patches: Any, config: UcpConfig) -> None:
    """Patch the engine's load entry point and the ZeRO-1/2 universal loader; refuse if they moved."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for owner, names in ((DeepSpeedEngine, ("load_checkpoint", "_load_checkpoint", "_load_zero_checkpoint",
                                            "load_universal_checkpoint", "zero_optimization_stage",
                                            "train_batch_size")),
                         (ZeROOptimizer, (_OPTIMIZER_LOADER,)),
                         (BF16_Optimizer, ("_load_universal_checkpoint", "_load_global_state", "update_lp_params")),
                         (DeepSpeedZeroOptimizer, ("_load_universal_checkpoint", "_load_global_state",
                                                   "update_lp_params"))):
        for name in names:
            if not hasattr(owner, name):
                raise UnsupportedError(f"DeepSpeed's {owner.__name__} has no attribute {name!r}: the elastic-load "
                                       "hook cannot patch this DeepSpeed; use the diffs in patches/",
                                       subject=f"{owner.__name__}.{name}")
    for cls in (BF16_Optimizer, DeepSpeedZeroOptimizer):
        if _OPTIMIZER_LOADER in cls.__dict__:
            raise UnsupportedError(f"{cls.__name__} overrides {_OPTIMIZER_LOADER}; the elastic-load hook expects "
                                   "the shared ZeROOptimizer implementation", subject=cls.__name__)
    patches.replace(DeepSpeedEngine, "load_checkpoint", lambda original: _engine_load(original, config))
    patches.replace(ZeROOptimizer, _OPTIMIZER_LOADER, lambda original: _optimizer_load(original, config))
    _make_logs_visible()


_handler: Optional[logging.Handler] = None


def _make_logs_visible() -> None:
    """The decision and summary lines must reach the training log even when nobody configured logging.

    Only when neither megatron-ucp's logger nor the root logger has a handler (the runner and
    applications that configure logging keep full control); undone by :func:`on_uninstall`.
    """
    global _handler
    pkg = logging.getLogger("megatron_ucp")
    if _handler is not None or pkg.handlers or logging.getLogger().handlers:
        return
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[megatron-ucp] %(levelname)s %(message)s"))
    pkg.addHandler(_handler)
    pkg.propagate = False
    if pkg.level == logging.NOTSET:  # INFO on the first rank only, so that 768 ranks do not repeat it
        pkg.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)


def on_uninstall() -> None:
    """Remove the log handler :func:`_make_logs_visible` added, if any."""
    global _handler
    if _handler is not None:
        pkg = logging.getLogger("megatron_ucp")
        pkg.removeHandler(_handler)
        pkg.propagate = True
        _handler = None


# ================================================================================================
# small distributed helpers (deepspeed.comm + the accelerator's device: gloo/CPU, ccl/XPU, nccl/CUDA)
# ================================================================================================

def _comm() -> Any:
    """``torch.distributed`` itself, not ``deepspeed.comm``: DeepSpeed's wrappers differ between
    versions (0.19.5's ``log_wrapper`` raises ``KeyError: 'log_name'`` on ``broadcast_object_list``
    when the comms logger is on, as Megatron-DeepSpeed configures it), while the process groups
    DeepSpeed hands out are torch's own."""
    import torch.distributed as dist

    return dist


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _broadcast_from_first(value: Any, group: Any = None) -> Any:
    """``value`` of the group's first rank on every rank of the group."""
    dist = _comm()
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _count_across(flag: int, group: Any = None) -> int:
    """Sum of one small integer across the group (also a barrier)."""
    dist = _comm()
    t = torch.tensor([int(flag)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, group=group)
    return int(t.item())


def _is_first(group: Any = None) -> bool:
    return _comm().get_rank(group=group) == 0


@dataclass(frozen=True)
class _Failure:
    """An exception on the deciding rank, shipped to the others so that all raise together."""

    message: str


# ================================================================================================
# engine: decide, convert, load, finish
# ================================================================================================

def _elastic_engine(engine: Any) -> bool:
    """ZeRO stage 1/2 with BF16_Optimizer or DeepSpeedZeroOptimizer: the engines this hook handles."""
    try:
        stage = int(engine.zero_optimization_stage())
    except Exception:
        return False
    return stage in (1, 2) and type(engine.optimizer).__name__ in _LP_GROUPS


def _model_states_path(tag_dir: Path) -> Optional[Path]:
    if (tag_dir / F.MODEL_STATES_FILE).is_file():
        return tag_dir / F.MODEL_STATES_FILE
    found = sorted(p for p in tag_dir.glob("*_model_states.pt") if F.MODEL_FILE_RE.match(p.name))
    return found[0] if found else None


def _read_checkpoint_dp(tag_dir: Path) -> Optional[int]:
    """``dp_world_size`` recorded in a tag's model states (memory-mapped: no weight bytes read)."""
    from ..reader import load_torch_file

    path = _model_states_path(tag_dir)
    if path is None:
        return None
    states = load_torch_file(path, mmap=True)
    dp = states.get(F.DP_WORLD_SIZE) if isinstance(states, dict) else None
    return int(dp) if dp is not None else None


def _gather_and_decide(engine: Any, load_dir: str, tag: Optional[str], loads_optimizer_states: bool
                       ) -> tuple[ResumeDecision, Optional[str], bool]:
    """Rank-0 side: read the facts from disk and decide. Returns (decision, native tag, tag from latest)."""
    from ..universal import staging_path, universal_state

    current_dp = int(engine.seq_dp_world_size)
    if engine.load_universal_checkpoint():
        return decide_resume(requested_tag=tag, checkpoint_dp=None, current_dp=current_dp,
                             load_universal=True), tag, False
    resolved, from_latest = tag, False
    if resolved is None:
        resolved = read_tag_file(Path(load_dir) / F.LATEST)
        from_latest = resolved is not None
    checkpoint_dp = None
    tag_is_universal = False
    twin = TwinState.ABSENT
    staging = False
    if resolved is not None:
        tag_dir = Path(load_dir) / resolved
        tag_is_universal = (tag_dir / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE).is_file()
        if tag_dir.is_dir():
            checkpoint_dp = _read_checkpoint_dp(tag_dir)
        twin_dir = Path(load_dir) / F.universal_tag(resolved)
        twin = TwinState(universal_state(twin_dir, tag_dir))
        staging = staging_path(twin_dir).exists()
    decision = decide_resume(requested_tag=resolved, checkpoint_dp=checkpoint_dp, current_dp=current_dp,
                             load_universal=False, twin_state=twin, tag_is_universal=tag_is_universal,
                             loads_optimizer_states=loads_optimizer_states, staging_present=staging)
    return decision, resolved, from_latest


def _engine_load(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(self: Any, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Optional[Callable] = None) -> Any:
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                      custom_load_fn=custom_load_fn)
        if not _elastic_engine(self):
            return original(self, load_dir, tag, **kwargs)

        outcome: Any
        if _is_first():
            try:
                outcome = _gather_and_decide(self, load_dir, tag,
                                             load_optimizer_states and not load_module_only)
            except Exception as exc:  # every rank must hear about it, or the others wait forever
                outcome = _Failure(f"{type(exc).__name__}: {exc}")
                log.error("megatron-ucp: deciding how to load %s failed: %s", load_dir, exc)
        else:
            outcome = None
        outcome = _broadcast_from_first(outcome)
        if isinstance(outcome, _Failure):
            raise UcpError(f"megatron-ucp could not decide how to load {load_dir}: {outcome.message}",
                           subject=load_dir)
        decision, native_tag, from_latest = outcome
        if decision.route is Route.NATIVE:
            if decision.checkpoint_dp is not None and _is_first():
                log.info("megatron-ucp: %s", decision.message)
            return original(self, load_dir, tag, **kwargs)

        if _is_first():
            log.info("megatron-ucp: %s", decision.message)
            if decision.warning:
                log.warning("megatron-ucp: %s", decision.warning)
        if decision.convert and _node_local_storage(self):
            raise UnsupportedError(f"{decision.message}, but checkpoint.use_node_local_storage keeps each node's "
                                   "files on its own disk; converting needs them on one shared filesystem. Convert "
                                   "with `megatron-ucp convert` where all rank files are, then load again.",
                                   subject=load_dir)
        if decision.convert:
            _convert_synchronously(Path(load_dir), native_tag, decision, from_latest, config)

        _check_model_states_loadable(Path(load_dir), decision.tag)
        token = _DEFER_ENFORCEMENT.set(True)
        try:
            with _universal_mode(self):
                result = original(self, load_dir, decision.tag, **kwargs)
            _finish_universal_load(self, result, decision, kwargs, config)
        finally:
            _DEFER_ENFORCEMENT.reset(token)
        return result

    return load_checkpoint


def _check_model_states_loadable(load_dir: Path, tag: Optional[str]) -> None:
    """DeepSpeed's load starts with ``torch.load`` of the folder's model states, whose errors name no
    file (``PytorchStreamReader failed reading zip archive``): check its structure first and say
    which file is damaged. Headers only (a few ``pread`` calls)."""
    from ..torchload import structure_problems

    if tag is None:
        return
    folder = load_dir / tag
    path = folder / F.MODEL_STATES_FILE
    if not folder.is_dir() or not path.is_file():
        return  # DeepSpeed reports a missing tag or file in its own words
    problems = structure_problems(path)
    if problems:
        raise CheckpointFormatError(f"{path}: damaged ({problems[0]}); torch.load cannot read it. Reconvert: "
                                    f"megatron-ucp convert {load_dir} --tag {tag.removesuffix(F.UNIVERSAL_SUFFIX)} "
                                    "--force", subject=path)


def _node_local_storage(engine: Any) -> bool:
    try:
        return bool(engine.use_node_local_storage())
    except Exception:
        return False


@contextlib.contextmanager
def _universal_mode(engine: Any) -> Iterator[None]:
    """Set the engine's ``load_universal`` flag for one load; restore it whatever happens."""
    cfg = engine._config
    before = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        yield
    finally:
        cfg.load_universal_checkpoint = before


def _convert_synchronously(load_dir: Path, native_tag: Optional[str], decision: ResumeDecision, from_latest: bool,
                           config: UcpConfig) -> None:
    """Convert the native tag to its universal twin while every rank waits (one converter per node)."""
    from ..universal import COMPLETE, universal_state

    dist = _comm()
    if native_tag is None or decision.tag is None:
        raise UcpError("internal: a conversion needs a native tag", subject=decision)
    from ..background import node_assignment
    from .async_trigger import _LOCAL_RANK_ENV, _LOCAL_SIZE_ENV, _env_int

    rank, world = dist.get_rank(), dist.get_world_size()
    where = node_assignment(rank, world, _env_int(_LOCAL_RANK_ENV), _env_int(_LOCAL_SIZE_ENV), config.ranks_per_node)
    share = (where.node, where.nodes) if where.launcher else None
    attempt = _broadcast_from_first(f"elastic-load-{uuid.uuid4().hex}" if rank == 0 else None)
    twin = load_dir / decision.tag
    error: Optional[BaseException] = None
    t0 = time.perf_counter()
    if share is not None:
        try:
            _convert_or_wait(load_dir / native_tag, twin, share, attempt, from_latest, config)
        except Exception as exc:
            error = exc
            log.error("megatron-ucp: converting %s on rank %d failed: %s", native_tag, rank, exc)
    failures = _count_across(1 if error is not None else 0)  # also the barrier: every converter finished
    if error is not None:
        raise error
    if failures:
        raise UcpError(f"converting {native_tag} to {decision.tag} failed on {failures} rank(s); see their log",
                       subject=twin)
    if universal_state(twin) != COMPLETE:
        raise UcpError(f"{twin}: conversion reported success but the folder is not complete on rank {rank} "
                       "(is the checkpoint directory shared by every node?)", subject=twin)
    if rank == 0:
        log.info("megatron-ucp: converted %s -> %s in %.1fs", native_tag, decision.tag, time.perf_counter() - t0)


def _convert_or_wait(source: Path, twin: Path, share: tuple[int, int], attempt: str, from_latest: bool,
                     config: UcpConfig) -> None:
    """Run this rank's share; if another live converter (e.g. the async one) owns it, wait for it."""
    from ..convert import ConvertOptions, convert
    from ..errors import OutputExistsError
    from ..universal import COMPLETE, ConversionInProgress, inspect_staging, universal_state

    options = ConvertOptions(source=source, output=twin, workers=config.converter_workers, replace_stale=True,
                             update_latest=from_latest,
                             share_index=share[0], share_count=share[1], attempt_id=attempt, progress=False)
    for _ in range(2):
        try:
            convert(options)
            return
        except OutputExistsError:
            if universal_state(twin, source) == COMPLETE:
                return
            raise
        except ConversionInProgress as exc:
            log.info("megatron-ucp: %s; waiting for it", exc)
            while universal_state(twin) != COMPLETE:
                info = inspect_staging(twin)
                if info is None or not info.is_live(options.stale_after):
                    break
                time.sleep(2.0)
            if universal_state(twin) == COMPLETE:
                return
    raise UcpError(f"{twin}: could not convert (another converter kept failing or died)", subject=twin)


def _finish_universal_load(engine: Any, result: Any, decision: ResumeDecision, kwargs: dict,
                           config: UcpConfig) -> None:
    """After DeepSpeed's universal load: what it skips, the training state, the batch, one summary."""
    from ..reader import load_torch_file

    load_path = result[0] if isinstance(result, tuple) else None
    optimizer = engine.optimizer
    report: Optional[AccountingReport] = getattr(optimizer, _REPORT_ATTR, None)
    if report is not None:
        delattr(optimizer, _REPORT_ATTR)
    if load_path is None:
        return
    folder = Path(load_path).parent
    dp_to = int(engine.seq_dp_world_size)
    dp_from = engine.loaded_checkpoint_dp_world_size
    problems: list[Problem] = []
    extras: list[str] = []
    if report is None:
        report = AccountingReport(0, 0, (), 0, dp_from, dp_to)
        problems.append(Problem(ProblemKind.TRAINING_STATE, None, None,
                                f"the optimizer did not load {folder / F.UNIVERSAL_ZERO_DIR}: no tensors were "
                                "restored"))
    states = load_torch_file(Path(load_path), mmap=True)
    if not isinstance(states, dict):
        raise CheckpointFormatError(f"{load_path}: not a DeepSpeed model-states dict", subject=load_path)

    current_batch = int(engine.train_batch_size())
    ckpt_batch = checkpoint_global_batch(states.get(F.DS_CONFIG), dp_from)
    if dp_from is not None and int(dp_from) != dp_to:
        warning = check_global_batch(ckpt_batch, current_batch, dp_from, dp_to)
        if warning and _is_first():
            log.warning("megatron-ucp: !!! %s", warning)

    if not kwargs["load_module_only"]:
        p, e = _check_training_state(engine, states, ckpt_batch, current_batch, kwargs["load_lr_scheduler_states"])
        problems += p
        extras += e
    optimized = {engine.optimizer.param_names[lp] for group in _lp_groups(engine.optimizer) for lp in group}
    p, e = restore_module_tensors(engine.module, optimized, folder, states)
    problems += p
    extras += e
    report = report.with_more(problems, extras, dp_from=dp_from)
    setattr(engine, ENGINE_REPORT_ATTR, report)
    report.enforce(config.strict, log, verbose=_is_first())


def _check_training_state(engine: Any, states: dict, ckpt_batch: Optional[int], current_batch: int,
                          load_lr_scheduler_states: bool) -> tuple[list[Problem], list[str]]:
    """DeepSpeed restores these in universal mode; check it did, and fix global_samples' fallback."""
    problems: list[Problem] = []
    extras: list[str] = []
    for key in ("global_steps", "skipped_steps"):
        if key not in states:
            problems.append(Problem(ProblemKind.TRAINING_STATE, None, key, "missing from the checkpoint's model states"))
        elif getattr(engine, key) != states[key]:
            problems.append(Problem(ProblemKind.TRAINING_STATE, None, key,
                                    f"engine has {getattr(engine, key)}, checkpoint {states[key]}"))
    samples = restored_global_samples(states, ckpt_batch, current_batch)
    if samples is not None and states.get("global_samples") is None:
        engine.global_samples = samples  # DeepSpeed used steps x the *current* batch
    if samples is not None and engine.global_samples != samples:
        problems.append(Problem(ProblemKind.TRAINING_STATE, None, "global_samples",
                                f"engine has {engine.global_samples}, checkpoint {samples}"))
    extras.append(f"global_steps={engine.global_steps} global_samples={engine.global_samples} "
                  f"skipped_steps={engine.skipped_steps}")
    saved = states.get("lr_scheduler")
    scheduler = engine.lr_scheduler
    if scheduler is not None and load_lr_scheduler_states:
        if saved is None:
            problems.append(Problem(ProblemKind.TRAINING_STATE, None, "lr_scheduler",
                                    "the engine has an LR scheduler but the checkpoint saved none: it would "
                                    "restart its schedule"))
        elif scheduler.state_dict() != saved:
            problems.append(Problem(ProblemKind.TRAINING_STATE, None, "lr_scheduler",
                                    f"scheduler state {scheduler.state_dict()} differs from the checkpoint's {saved}"))
        else:
            extras.append("lr scheduler restored")
    elif saved is not None and scheduler is None:
        extras.append("lr scheduler state left to the client (no DeepSpeed scheduler)")
    return problems, extras


def restore_module_tensors(module: torch.nn.Module, optimized: set[str], folder: Path,
                           states: dict) -> tuple[list[Problem], list[str]]:
    """Buffers and frozen parameters: universal mode skips the module state dict, so restore them here.

    ``optimized``: names of the parameters the optimizer restored. Frozen parameters (the others)
    come from ``zero/<name>/fp32.pt`` when the converter wrote one, else from the model states'
    module dict; persistent buffers from the model states' module dict. Strict about what the
    checkpoint holds (a held buffer of another shape is a problem), not about what it never held:
    Megatron leaves deterministic buffers such as RoPE's ``inv_freq`` out of its save, so those
    stay as the model built them and are listed in one line. Returns (problems, extras).
    """
    from ..reader import flatten_module_states, load_torch_file

    saved = flatten_module_states(states.get("module"))
    live = module.state_dict()
    named_params = dict(module.named_parameters())
    frozen = [n for n in named_params if n not in optimized]
    buffers = [n for n, _ in module.named_buffers() if n in live]
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
                problems.append(Problem(ProblemKind.MODULE_TENSOR, name, F.FP32_STATE,
                                        "frozen parameter not found (or of another shape) in zero/ and in the "
                                        "model states"))
                continue
            param.copy_(source)
            restored_frozen += 1
        for name in buffers:
            target = live[name]
            if name not in saved:
                never_held.append(name)
                continue
            source = saved[name]
            if not torch.is_tensor(source) or tuple(source.shape) != tuple(target.shape):
                shape = tuple(source.shape) if torch.is_tensor(source) else type(source).__name__
                problems.append(Problem(ProblemKind.MODULE_TENSOR, name, "buffer",
                                        f"{folder.name}'s model states hold it as {shape}, the model's buffer is "
                                        f"{tuple(target.shape)}"))
                continue
            target.copy_(source)
            restored_buffers += 1
    extras = [f"{restored_buffers} buffers, {restored_frozen} frozen params restored"] if (buffers or frozen) else []
    if never_held:
        extras.append(f"{len(never_held)} live buffer(s) the checkpoint never held, left as the model built them: "
                      + ", ".join(never_held))
    return problems, extras


# ================================================================================================
# optimizer: our universal loader for one rank's flat partitions
# ================================================================================================

def _lp_groups(optimizer: Any) -> list[list[Any]]:
    return getattr(optimizer, _LP_GROUPS[type(optimizer).__name__])


def _optimizer_load(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir(self: Any, lp_groups_name: str, checkpoint_dir: str) -> None:
        if type(self).__name__ not in _LP_GROUPS or _LP_GROUPS[type(self).__name__] != lp_groups_name:
            return original(self, lp_groups_name, checkpoint_dir)
        report = load_universal_partitions(self, Path(checkpoint_dir), strict=config.strict)
        if _DEFER_ENFORCEMENT.get():
            setattr(self, _REPORT_ATTR, report)
        else:
            report.enforce(config.strict, log, verbose=_is_first(self.dp_process_group))

    return load_hp_checkpoint_state_from_checkpoint_dir


def _list_zero_folder(zero_dir: Path) -> dict[str, tuple[str, ...]]:
    """Parameter folder (relative name) -> its state files (names without ``.pt``)."""
    if not zero_dir.is_dir():
        raise CheckpointFormatError(f"{zero_dir}: no zero/ folder: not a universal checkpoint", subject=zero_dir)
    listing: dict[str, tuple[str, ...]] = {}
    for dirpath, _, filenames in os.walk(zero_dir):
        rel = os.path.relpath(dirpath, zero_dir)
        states = sorted(f[:-3] for f in filenames if f.endswith(".pt"))
        if rel != "." and states:
            listing[rel.replace(os.sep, "/")] = tuple(states)
    return listing


def _manifest_sums(checkpoint_dir: Path) -> Optional[dict[str, dict]]:
    """Per state file ``{"numel", "sum"[, "rows_numel", "rows_sum"]}`` recorded by the converter, or
    None (stock's folder, one converted before megatron-ucp recorded them, an unknown algorithm)."""
    from ..universal import read_manifest

    manifest = read_manifest(checkpoint_dir)
    sums = (manifest or {}).get("checksums")
    if not isinstance(sums, dict) or sums.get("algorithm") != integrity.ALGORITHM:
        return None
    files = sums.get("files")
    return files if isinstance(files, dict) else None


class _Clock:
    """Adds up the time spent inside ``with clock:`` blocks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> "_Clock":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._t0


@dataclass(frozen=True)
class _FolderFacts:
    """What the group's first rank reads once and broadcasts (no metadata storm on the file system)."""

    listing: dict[str, tuple[str, ...]]
    sums: Optional[dict[str, dict]]


@dataclass(frozen=True)
class _ParamLayout:
    """A state file's tensor in the parameter's flat layout, never materialized: a rank copies only
    the bytes of its fragment out of the memory-mapped file.

    ``pieces`` are flat views in order (the tensor, then its kept vocabulary rows); positions from
    ``held`` to ``numel`` (vocabulary padding the folder did not keep) read as zeros.
    """

    pieces: tuple[torch.Tensor, ...]
    held: int
    numel: int
    rows_restored: bool

    def narrow(self, start: int, length: int) -> torch.Tensor:
        parts, pos = [], 0
        for piece in self.pieces:
            lo, hi = max(start, pos), min(start + length, pos + piece.numel())
            if lo < hi:
                parts.append(piece.narrow(0, lo - pos, hi - lo))
            pos += piece.numel()
        got = sum(t.numel() for t in parts)
        if got < length:
            parts.append(self.pieces[0].new_zeros(length - got))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def source_sum(self) -> int:
        """Checksum of everything the file holds (reads all of it: the path without manifest sums)."""
        sums, pos = [], 0
        for piece in self.pieces:
            sums.append(checksum(piece, pos))
            pos += piece.numel()
        return integrity.combine(sums)


def _tensor_of(entry: Any, path: Path) -> torch.Tensor:
    tensor = entry.get(F.PARAM) if isinstance(entry, dict) else entry
    if not torch.is_tensor(tensor):
        raise CheckpointFormatError(f"{path}: no tensor under {F.PARAM!r}", subject=path)
    return tensor


def _layout(full: torch.Tensor, entry: Any, lp: Any, name: str, state: str, path: Path) -> _ParamLayout:
    """The file's tensor as the parameter's flat layout (:class:`_ParamLayout`).

    Vocabulary tensors trimmed to ``original_vocab_size`` get their padded rows back from
    :data:`~megatron_ucp.dsformat.VOCAB_PADDED_ROWS` when the folder kept them (megatron-ucp's
    conversions do) and the padded size is the one they were saved at; otherwise (stock folders,
    another padded size) those rows start at zero, as with stock DeepSpeed, and are not counted.
    """
    shape = tuple(lp.shape)
    numel = 1
    for d in shape:
        numel *= int(d)
    if tuple(full.shape) == shape:
        return _ParamLayout((full.reshape(-1),), full.numel(), numel, False)
    is_vocab = isinstance(entry, dict) and entry.get(F.VOCAB_TENSOR, False)
    if (is_vocab and full.dim() == len(shape) and full.dim() >= 1 and full.shape[0] <= shape[0]
            and tuple(full.shape[1:]) == shape[1:]):
        rows = entry.get(F.VOCAB_PADDED_ROWS)
        if torch.is_tensor(rows) and tuple(rows.shape) == (shape[0] - full.shape[0], *shape[1:]):
            rows = rows if rows.dtype == full.dtype else rows.to(full.dtype)
            return _ParamLayout((full.reshape(-1), rows.reshape(-1)), numel, numel, True)
        return _ParamLayout((full.reshape(-1),), full.numel(), numel, False)
    raise CheckpointFormatError(f"{path}: parameter {name!r} state {state!r} has shape {tuple(full.shape)}, the model's "
                                f"parameter is {shape} (a different model, or TP>1 which megatron-ucp does not "
                                "support yet)", subject=name)


def _recorded_source(sums: dict[str, dict], name: str, state: str, layout: _ParamLayout, path: Path
                     ) -> tuple[int, int]:
    """(elements, checksum) the manifest says the file holds, for what this layout restores."""
    record = sums.get(f"{name}/{state}")
    if not isinstance(record, dict) or "numel" not in record or "sum" not in record:
        raise CheckpointFormatError(f"{path}: not in the manifest's checksums although the folder has them "
                                    "(a file added after the conversion?)", subject=path)
    count, value = int(record["numel"]), int(record["sum"])
    if layout.rows_restored:
        count += int(record.get("rows_numel", 0))
        value = integrity.combine([value, int(record.get("rows_sum", 0))])
    return count, value


def _same_step(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def expected_state_keys(optimizer: torch.optim.Optimizer, group_index: int) -> Optional[frozenset[str]]:
    """The per-parameter states ``optimizer`` keeps for one group, discovered without touching it.

    For torch.optim classes: build a throwaway instance with the group's hyperparameters on a
    2-element CPU tensor and take one step; for a few DeepSpeed optimizers: a table. None when
    unknown (then only the checkpoint's own consistency is checked). States already present in the
    live optimizer count too.
    """
    cls = type(optimizer)
    group = optimizer.param_groups[group_index]
    present: set[str] = set()
    for p in group["params"]:
        present.update(optimizer.state.get(p, {}).keys())
    keys: Optional[set[str]] = None
    if cls.__module__.startswith("torch.optim"):
        try:
            accepted = inspect.signature(cls.__init__).parameters
            kwargs = {k: v for k, v in group.items() if k in accepted and k not in ("params", "self")}
            for flag in ("fused", "capturable", "differentiable", "foreach"):
                if flag in kwargs:
                    kwargs[flag] = False if flag != "foreach" else None
            probe_param = torch.zeros(2, requires_grad=True)
            probe_param.grad = torch.ones(2)
            probe = cls([probe_param], **kwargs)
            probe.step()
            keys = set(probe.state[probe_param].keys())
        except Exception as exc:
            log.debug("could not probe %s for its state names: %s", cls.__name__, exc)
    if keys is None and cls.__name__ in _KNOWN_STATES:
        keys = set(_KNOWN_STATES[cls.__name__])
        if group.get("amsgrad"):
            keys.add("max_exp_avg_sq")
    if keys is None:
        return frozenset(present) if present else None
    return frozenset(keys | present)


def load_universal_partitions(optimizer: Any, checkpoint_dir: Path, strict: bool = True) -> AccountingReport:
    """Load this rank's ZeRO-1/2 partitions from ``<checkpoint_dir>/zero`` and account for them.

    Collective over the optimizer's DP group: every rank must call it. Returns the report (the
    same on every rank); raising is left to the caller, except when a rank failed to load at all.
    With ``strict=False`` optimizer tensor states missing from the checkpoint start at zero (as a
    fresh optimizer's would) instead of being absent, so that the first step does not fail.
    """
    from ..reader import load_torch_file

    t_start = time.perf_counter()
    clock = _Clock()
    dist = _comm()
    group = optimizer.dp_process_group
    dp_to = dist.get_world_size(group=group)
    zero_dir = checkpoint_dir / F.UNIVERSAL_ZERO_DIR
    lp_groups = _lp_groups(optimizer)
    base = optimizer.optimizer
    names = [[optimizer.param_names[lp] for lp in lps] for lps in lp_groups]
    optimized = {n for group_names in names for n in group_names}
    frozen = set(optimizer.param_names.values()) - optimized

    facts: Any = None
    if _is_first(group):
        try:
            facts = _FolderFacts(_list_zero_folder(zero_dir), _manifest_sums(checkpoint_dir))
        except Exception as exc:
            facts = _Failure(f"{type(exc).__name__}: {exc}")
    facts = _broadcast_from_first(facts, group)
    if isinstance(facts, _Failure):
        raise CheckpointFormatError(f"cannot read {zero_dir}: {facts.message}", subject=zero_dir)
    listing, sums = facts.listing, facts.sums
    if sums is None and _is_first(group):
        log.info("megatron-ucp: %s has no checksums in %s (stock's folder, or converted by an older megatron-ucp): "
                 "accounting checks against the files themselves, which reads each parameter in full on one rank "
                 "(slower; `megatron-ucp convert --force` records them)", checkpoint_dir, F.MANIFEST_FILE)
    # Frozen parameters' folders are the engine hook's to restore (they are not in the optimizer).
    accountable = {k: v for k, v in listing.items() if k in optimized}
    ledger = Ledger.from_listing(accountable)
    table = ledger.new_table(device="cpu")
    failure: Optional[BaseException] = None
    dp_from: Optional[int] = None
    restored_keys: list[set[str]] = []
    group_states = group_tensor_states(names, accountable)
    problems: list[Problem] = []
    try:
        optim_sd = load_torch_file(zero_dir / F.UNIVERSAL_OPTIMIZER_STATE_FILE, mmap=False)
        optimizer._load_global_state(optim_sd)
        dp_from = _source_dp(optim_sd)
        loaded_groups = optim_sd.get(F.PARAM_GROUPS) or []
        if len(loaded_groups) != len(base.param_groups):
            problems.append(Problem(ProblemKind.PARAM_GROUPS, None, None,
                                    f"the checkpoint has {len(loaded_groups)} param groups, the optimizer "
                                    f"{len(base.param_groups)}: hyperparameters not restored"))
            loaded_groups = [None] * len(base.param_groups)
        for i, (param_group, lps) in enumerate(zip(base.param_groups, lp_groups)):
            restored_keys.append(_load_group(optimizer, i, param_group, lps, names[i], group_states[i], accountable,
                                             zero_dir, ledger, table, sums, clock))
            if loaded_groups[i] is not None:
                for key, value in loaded_groups[i].items():
                    if key != "params":
                        param_group[key] = value
    except Exception as exc:
        failure = exc
        log.error("megatron-ucp: rank %d failed to load %s: %s", dist.get_rank(), zero_dir, exc)

    t_wait = time.perf_counter()  # the all-reduce also waits for the slowest rank: timed on its own
    flags = torch.zeros((1, len(Column)), dtype=torch.int64)
    flags[0, 0] = 1 if failure is not None else 0
    totals = torch.cat([table, flags]).to(_device())
    dist.all_reduce(totals, group=group)
    totals = totals.cpu()
    collective = time.perf_counter() - t_wait
    failed_ranks = int(totals[-1, 0])
    if failure is not None:
        raise failure
    if failed_ranks:
        raise UcpError(f"loading {zero_dir} failed on {failed_ranks} other rank(s); see their log", subject=zero_dir)
    totals = totals[:-1]

    with clock:
        problems += check_folders(names, {k: v for k, v in listing.items() if k not in frozen})
        problems += check_ledger(ledger, totals)
        for i, keys in enumerate(restored_keys):
            expected = expected_state_keys(base, i)
            problems += check_optimizer_states(i, names[i], expected, keys, type(base).__name__)
            if not strict and expected is not None:
                _start_missing_states_fresh(base, i, expected - keys)
        n_params, n_files, elements, state_names = ledger_totals(ledger, totals)
    load = time.perf_counter() - t_start - clock.seconds - collective
    seconds = (("load", round(load, 4)), ("accounting", round(clock.seconds, 4)), ("collective", round(collective, 4)))
    return AccountingReport(n_params, n_files, state_names, elements, dp_from, dp_to, tuple(problems),
                            seconds=seconds)


def _start_missing_states_fresh(base: torch.optim.Optimizer, index: int, missing: Iterable[str]) -> None:
    """Non-strict partial load: a state the checkpoint lacks starts at zero, as a fresh one would."""
    flat = base.param_groups[index]["params"][0]
    state = base.state[flat]
    for key in sorted(missing):
        if key != F.STEP_STATE and key not in state:
            state[key] = torch.zeros_like(flat)


def _source_dp(optim_sd: dict) -> Optional[int]:
    info = optim_sd.get(F.ZERO_PARTITION_INFO)
    if isinstance(info, dict) and info.get("dp_size"):
        return int(info["dp_size"])
    count = optim_sd.get(F.PARTITION_COUNT)
    if isinstance(count, (list, tuple)) and count:
        count = count[0]
    return int(count) if isinstance(count, int) else None


def _load_group(optimizer: Any, index: int, param_group: dict, lps: list, names: list[str], states: tuple[str, ...],
                listing: dict[str, tuple[str, ...]], zero_dir: Path, ledger: Ledger, table: torch.Tensor,
                sums: Optional[dict[str, dict]], clock: "_Clock") -> set[str]:
    """Fill one param group's flat fp32 partition and optimizer states on this rank; return the keys set.

    A rank whose partition of the group is all padding reads no fragment but still gets every state
    key (zeros) and the group's step, so the optimizer and the next save look like everyone else's.
    A rank reads only its fragments' bytes; the owner of a parameter's first element adds what the
    file holds to the ledger: from the manifest's ``sums`` when there are some, else from the file.
    """
    from ..reader import load_torch_file

    flat = param_group["params"][0]
    buffers = {state: torch.zeros_like(flat) for state in states}
    group_step: Any = None
    step_source = next((n for n in names if F.STEP_STATE in listing.get(n, ())), None)
    if step_source is not None:
        group_step = load_torch_file(zero_dir / step_source / f"{F.STEP_STATE}.pt", mmap=False)

    with torch.no_grad():
        for lp, name in zip(lps, names):
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None or name not in listing:
                continue
            lp_address = mapping.lp_fragment_address
            hp_address = mapping.get_hp_fragment_address()
            for state in listing[name]:
                row = ledger.index(name, state)
                path = zero_dir / name / f"{state}.pt"
                if state == F.STEP_STATE:
                    step = load_torch_file(path, mmap=False)
                    table[row, Column.CONSUMERS] += 1
                    table[row, Column.STEP_MISMATCH] += 0 if _same_step(step, group_step) else 1
                    continue
                if state != F.FP32_STATE and state not in buffers:
                    continue  # not one of this group's states: check_folders reports the odd file
                entry = load_torch_file(path, mmap=True)
                full = _tensor_of(entry, path)
                if full.dtype != torch.float32:  # fp32 masters and Adam states: a bf16 file would load silently
                    raise CheckpointFormatError(f"{path}: {full.dtype} tensor; universal optimizer states are "
                                                "float32", subject=path)
                layout = _layout(full, entry, lp, name, state, path)
                target = (mapping.get_hp_fragment() if state == F.FP32_STATE
                          else buffers[state].narrow(0, hp_address.start, hp_address.numel))
                fragment = layout.narrow(lp_address.start, lp_address.numel)
                target.copy_(fragment)
                real = max(0, min(lp_address.numel, layout.held - lp_address.start))
                table[row, Column.CONSUMERS] += 1
                table[row, Column.LOADED_COUNT] += real
                with clock:
                    if real:  # what landed (on an accelerator: what was copied there, hashed on the CPU)
                        placed = target[:real] if target.device.type == "cpu" else fragment[:real]
                        add_sum(table, row, True, checksum(placed, lp_address.start))
                    if lp_address.start == 0:
                        count, value = ((layout.held, layout.source_sum()) if sums is None
                                        else _recorded_source(sums, name, state, layout, path))
                        table[row, Column.SOURCE_COUNT] += count
                        add_sum(table, row, False, value)

    state_dict = optimizer.optimizer.state[flat]
    for state, buffer in buffers.items():
        state_dict[state] = buffer
    if group_step is not None:
        state_dict[F.STEP_STATE] = group_step.clone() if torch.is_tensor(group_step) else group_step
    for lp in lps:
        mapping = getattr(lp, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.get_hp_fragment_address()
            mapping.optim_fragment = {s: b.narrow(0, address.start, address.numel) for s, b in buffers.items()}
    return set(buffers) | ({F.STEP_STATE} if group_step is not None else set())
