"""Elastic resume: ``engine.load_checkpoint`` at any DP size, with every tensor accounted for.

Two DeepSpeed attributes are replaced (entries of :data:`megatron_ucp.deepspeed.surface.SURFACE`, through
the install's :class:`~megatron_ucp.deepspeed.surface.PatchSet`, so ``uninstall()`` restores them):

``DeepSpeedEngine.load_checkpoint``
    Before loading, rank 0 reads the DP size recorded in the requested tag's model states and
    :func:`megatron_ucp.plan.resume.decide_resume` picks the route; the decision is broadcast so all
    ranks act alike. Same DP: DeepSpeed's native load, untouched. DP changed (TP and PP not), resume
    route ``auto`` or ``reshard``: DeepSpeed loads the module and the training state from the tag
    without optimizer states, then every rank copies its new partitions straight out of the old rank
    files (:mod:`megatron_ucp.integration.native_reshard`): no conversion, nothing written. Otherwise
    (a TP/PP change, or route ``universal``): the universal twin ``<tag>_universal`` is loaded in universal mode
    (the engine's ``load_universal`` flag is set
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
    checksums (:mod:`megatron_ucp.plan.accounting`) that every element of every file landed exactly
    once, and that no state the live optimizer keeps was left unrestored.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.convert.universal import staging_path, universal_state
from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.deepspeed.reader import load_raw, rank_file_count_problem, saved_layout
from megatron_ucp.errors import CheckpointFormatError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import lagging_universal_pointer, read_tag_file
from megatron_ucp.format.rawtensor import torch_views_from_raw
from megatron_ucp.format.torchload import structure_problems, torch_reader_problem
from megatron_ucp.integration import log_visibility
from megatron_ucp.integration.collectives import Failure, agreed, decide_on_first, is_first
from megatron_ucp.integration.fallback import load_with_fallback
from megatron_ucp.integration.finite_load import Origins, refuse_non_finite
from megatron_ucp.integration.handled import STOCK, unhandled_reason, warn_once
from megatron_ucp.integration.live_layout import current_layout
from megatron_ucp.integration.model_states_load import one_model_states_file_per_rank
from megatron_ucp.integration.module_read import with_the_rest_exchanged
from megatron_ucp.integration.moe_load import refuse_an_expert_layout_change
from megatron_ucp.integration.native_routes import reshard_load, same_dp_load
from megatron_ucp.integration.partition_load import load_universal_partitions
from megatron_ucp.integration.stage3_routes import (
    model_states_for,
    stage3_universal_optimizer_load,
)
from megatron_ucp.integration.sync_convert import convert_synchronously
from megatron_ucp.integration.training_state import check_training_state, restore_module_tensors
from megatron_ucp.plan.accounting import AccountingReport, Problem, ProblemKind
from megatron_ucp.plan.experts import recorded_experts
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.resume import (
    ResumeDecision,
    Route,
    TwinState,
    check_global_batch,
    checkpoint_global_batch,
    decide_resume,
)

log = logging.getLogger(__name__)

_REPORT_ATTR = "_megatron_ucp_load_report"
ENGINE_REPORT_ATTR = "megatron_ucp_load_report"
"""The engine attribute holding the last universal load's :class:`AccountingReport` (for tools)."""
# Inside our engine wrapper the optimizer loader leaves enforcement to the wrapper, so that tensor
# and training-state problems end up in one report and one summary line.
_DEFER_ENFORCEMENT: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_defer", default=False)


def wanted(config: UcpConfig) -> bool:
    return config.elastic_resume


def install(patches: Any, config: UcpConfig) -> None:
    """Patch the engine's load entry point and the ZeRO-1/2 universal loader (the install checked the
    whole surface they rely on)."""
    surface.replace(patches, surface.ENGINE, "load_checkpoint", lambda original: _engine_load(original, config))
    surface.replace(
        patches, surface.ZERO_BASE, surface.OPTIMIZER_LOADER, lambda original: _optimizer_load(original, config)
    )
    log_visibility.make_visible()


def on_uninstall() -> None:
    log_visibility.restore()


# ================================================================================================
# engine: decide, convert, load, finish
# ================================================================================================


def _elastic_engine(engine: Any) -> bool:
    """An optimizer class at a ZeRO stage some :data:`~megatron_ucp.deepspeed.surface.OPTIMIZER_LAYOUTS`
    entry handles, with every param group partitioned over the DP group: the engines this hook handles
    (the others load as stock DeepSpeed does, with one warning)."""
    reason = unhandled_reason(engine)
    if reason is not None:
        warn_once(reason, STOCK)
    return reason is None


def _gather_and_decide(
    engine: Any,
    load_dir: str,
    tag: Optional[str],
    loads_optimizer_states: bool,
    config: UcpConfig,
    seen: Optional[dict] = None,
) -> tuple[ResumeDecision, Optional[str], bool]:
    """Rank-0 side: read the facts from disk and decide. Returns (decision, native tag, tag from latest).
    ``seen`` receives the model states read for the decision (no weight bytes), for this rank's next steps."""

    live = current_layout(engine)
    universal_flag = bool(engine.load_universal_checkpoint())
    lag = lagging_universal_pointer(Path(load_dir)) if universal_flag and tag is None else None
    follow_latest = lag is not None
    if lag is not None and lag[1] is not None:
        log.warning(
            "megatron-ucp: %s names %s but %s names %s: following %s (loading %s)",
            F.LATEST,
            lag[0],
            F.LATEST_UNIVERSAL,
            lag[1],
            F.LATEST,
            F.universal_tag(lag[0]),
        )
    if universal_flag and not follow_latest:
        return decide_resume(requested_tag=tag, saved=None, live=live, load_universal=True), tag, False
    # Without --universal-checkpoint, or with it (the runner adds it on a TP/PP change) when
    # latest_universal does not name the twin of `latest`'s tag: decide from `latest`, converting
    # its tag when needed.
    resolved, from_latest = tag, False
    if resolved is None:
        resolved = read_tag_file(Path(load_dir) / F.LATEST)
        from_latest = resolved is not None
    saved_as: Optional[ParallelLayout] = None
    names_match = True
    tag_is_universal = False
    twin = TwinState.ABSENT
    staging = False
    stage_change: Optional[str] = None
    regrouped = False
    if resolved is not None:
        tag_dir = Path(load_dir) / resolved
        _check_tag_exists(Path(load_dir), tag_dir, from_latest)
        tag_is_universal = (tag_dir / F.UNIVERSAL_ZERO_DIR / F.UNIVERSAL_OPTIMIZER_STATE_FILE).is_file()
        saved = saved_layout(tag_dir) if tag_dir.is_dir() else None
        if saved is not None:
            saved_as = saved.layout
            # a mixture-of-experts save of DeepSpeed < 0.19 lists no names (no param_shapes): the native routes
            # check every rank file's fragments against the job's names instead
            unlisted = not saved.param_names and bool(recorded_experts((saved.states or {}).get("num_experts")))
            names_match = unlisted or saved.param_names == _live_param_names(engine)
            stage_change = _stage_change(engine, saved.per_parameter)
            regrouped = stage_change is None and _regrouped(engine, saved.states)
            if seen is not None:
                seen["model_states"] = saved.states
            if loads_optimizer_states and not tag_is_universal and saved_as is not None:
                problem = rank_file_count_problem(tag_dir, saved_as.dp)
                if problem is not None:
                    raise CheckpointFormatError(problem, subject=tag_dir)
        twin_dir = Path(load_dir) / F.universal_tag(resolved)
        twin = universal_state(twin_dir, tag_dir)
        staging = staging_path(twin_dir).exists()
    decision = decide_resume(
        requested_tag=resolved,
        saved=saved_as,
        live=live,
        load_universal=False,
        twin_state=twin,
        tag_is_universal=tag_is_universal,
        loads_optimizer_states=loads_optimizer_states,
        staging_present=staging,
        universal_of_latest=follow_latest,
        resume_route=config.resume_route,
        names_match=names_match,
        stage_change=stage_change,
        regrouped=regrouped,
    )
    return decision, resolved, from_latest


def _check_tag_exists(load_dir: Path, tag_dir: Path, from_latest: bool) -> None:
    """A tag to load that is not a folder is named (DeepSpeed asserts on an empty file list, naming nothing)."""
    if tag_dir.is_dir():
        return
    what = "is missing" if not tag_dir.exists() and not tag_dir.is_symlink() else "is not a folder"
    if from_latest:
        raise CheckpointFormatError(
            f"{load_dir / F.LATEST}: names {tag_dir.name!r}, but {tag_dir} {what}", subject=load_dir / F.LATEST
        )
    raise CheckpointFormatError(f"{tag_dir}: the tag to load {what}", subject=tag_dir)


def _live_param_names(engine: Any) -> frozenset[str]:
    """This rank's optimized parameter names (rank 0 is model-parallel rank 0, as the model states compared)."""
    optimizer = engine.optimizer
    names = surface.param_names(engine)
    return frozenset(names[lp] for group in surface.layout_of(optimizer).groups(optimizer) for lp in group)


def _stage_change(engine: Any, saved_per_parameter: bool) -> Optional[str]:
    """How the save's ZeRO partitioning differs from the job's (``"3 -> 1/2"``), or None."""
    live = surface.engine_layout(engine).per_parameter
    if live == saved_per_parameter:
        return None
    return f"{'3' if saved_per_parameter else '1/2'} -> {surface.zero_stage(engine) if not live else 3}"


def _regrouped(engine: Any, states: Optional[dict]) -> bool:
    """ZeRO-3 saved and live, and the optimizer cut its parameters into other sub-groups than the save's."""
    if not isinstance(states, dict) or not surface.engine_layout(engine).per_parameter:
        return False
    saved = [[str(n) for n in group] for group in states.get(F.PARAM_SHAPES) or [] if isinstance(group, dict)]
    live, _ = stage3_runtime.stage3_sub_groups(engine.optimizer, surface.param_names(engine))
    return saved != [[n for n, _ in group] for group in live]


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
        if not _elastic_engine(self):
            if load_optimizer_states and not load_module_only and not self.load_universal_checkpoint():
                refuse_an_expert_layout_change(self, load_dir, tag, config)
            return original(self, load_dir, tag, **kwargs)

        def load(chosen: Optional[str]) -> Any:  # refused on every rank or on none
            return agreed(
                lambda: _load_tag(self, original, load_dir, chosen, kwargs, config), f"loading {chosen or 'latest'}"
            )

        if tag is None and config.fallback:
            return load_with_fallback(
                Path(load_dir),
                load,
                universal=bool(self.load_universal_checkpoint()),
                scheduler=getattr(self, "lr_scheduler", None),
            )
        return load(tag)

    return load_checkpoint


def _load_tag(
    self: Any, original: Callable[..., Any], load_dir: str, tag: Optional[str], kwargs: dict, config: UcpConfig
) -> Any:
    """One load of ``tag`` (None: the one ``latest`` names) by the route its facts decide."""
    load_optimizer_states, load_module_only = kwargs["load_optimizer_states"], kwargs["load_module_only"]
    seen: dict = {}  # the first rank's read of the model states, for the facts of a reshard or a restart
    loads_states = load_optimizer_states and not load_module_only
    outcome = decide_on_first(lambda: _gather_and_decide(self, load_dir, tag, loads_states, config, seen))
    if isinstance(outcome, Failure):
        if is_first():
            log.error("megatron-ucp: deciding how to load %s failed: %s", load_dir, outcome.message)
        raise outcome.error(f"megatron-ucp could not decide how to load {load_dir}: {outcome.message}", load_dir)
    decision, native_tag, from_latest = outcome
    per_parameter = surface.engine_layout(self).per_parameter
    if decision.route is Route.NATIVE:
        if decision.checkpoint_dp is None or not loads_states:
            return original(self, load_dir, tag, **kwargs)
        if is_first():
            log.info("megatron-ucp: %s", decision.message)
        result = same_dp_load(self, original, load_dir, native_tag, kwargs, config, seen.get("model_states"))
        return _finite(self, result, config)

    if is_first():
        log.info("megatron-ucp: %s", decision.message)
        if decision.warning:
            log.warning("megatron-ucp: %s", decision.warning)
    if decision.route is Route.RESHARD:
        outcome = reshard_load(self, original, load_dir, decision.tag, kwargs, config, seen.get("model_states"))
        if outcome.report is not None:
            _finish_load(
                self,
                outcome.load_path,
                outcome.report,
                int(decision.checkpoint_dp),
                kwargs,
                config,
                restore_module=False,
                states=outcome.states,
            )
        return _finite(self, outcome.result, config, outcome.origins)
    if decision.convert and surface.node_local_storage(self):
        raise UnsupportedError(
            f"{decision.message}, but checkpoint.use_node_local_storage keeps each node's "
            "files on its own disk; converting needs them on one shared filesystem. Convert "
            "with `megatron-ucp convert` where all rank files are, then load again.",
            subject=load_dir,
        )
    if decision.convert:
        convert_synchronously(Path(load_dir), native_tag, decision, from_latest, config)

    _check_model_states_loadable(Path(load_dir), decision.tag)
    token = _DEFER_ENFORCEMENT.set(True)
    folder = _universal_folder(Path(load_dir), decision.tag)
    try:
        with (
            _universal_mode(
                self,
                lazy=config.module_read == "distributed" or per_parameter,
                path=model_states_for(self, folder) if folder is not None else None,
            ),
            stage3_universal_optimizer_load(self, config, _keep_report) if per_parameter else contextlib.nullcontext(),
        ):
            result = original(self, load_dir, decision.tag, **kwargs)
        _finish_universal_load(self, result, decision, kwargs, config)
    finally:
        _DEFER_ENFORCEMENT.reset(token)
    return _finite(self, result, config)


def _finite(engine: Any, result: Any, config: UcpConfig, origins: Optional[Origins] = None) -> Any:
    """The load's result, once every rank's masters and optimizer states are known to be finite (``origins``: a
    native reshard's, naming the old rank files a finding came from)."""
    if isinstance(result, tuple) and result[0] is not None:
        refuse_non_finite(engine, Path(result[0]).parent, config.strict, origins)
    return result


def _keep_report(optimizer: Any, report: AccountingReport) -> None:
    setattr(optimizer, _REPORT_ATTR, report)


def _universal_folder(load_dir: Path, tag: Optional[str]) -> Optional[Path]:
    """The universal folder a load reads: the tag given, else the one ``latest_universal`` names."""
    tag = tag if tag is not None else read_tag_file(load_dir / F.LATEST_UNIVERSAL)
    return load_dir / tag if tag is not None else None


def _check_model_states_loadable(load_dir: Path, tag: Optional[str]) -> None:
    """DeepSpeed's load starts with ``torch.load`` of the folder's model states, whose errors name no
    file (``PytorchStreamReader failed reading zip archive``): check its structure, and open it with
    torch's own zip reader, first and say which file is damaged. Headers only (a few ``pread`` calls)."""

    if tag is None:
        return
    folder = load_dir / tag
    path = folder / F.MODEL_STATES_FILE
    if not folder.is_dir() or not path.is_file():
        return  # DeepSpeed reports a missing tag or file in its own words
    problems = structure_problems(path) or [p for p in (torch_reader_problem(path),) if p]
    if problems:
        raise CheckpointFormatError(
            f"{path}: damaged ({problems[0]}); torch.load cannot read it. Reconvert: "
            f"megatron-ucp convert {load_dir} --tag {tag.removesuffix(F.UNIVERSAL_SUFFIX)} "
            "--force",
            subject=path,
        )


@contextlib.contextmanager
def _universal_mode(engine: Any, lazy: bool = False, path: Optional[Path] = None) -> Iterator[None]:
    """Set the engine's ``load_universal`` flag for one load; restore it whatever happens. At another
    TP/PP size each rank reads one model-states file as it is (:func:`one_model_states_file_per_rank`);
    ``lazy``: at any size, and only its pickle (universal mode loads no module weights from it); ``path``:
    the file to read where DeepSpeed's own name finds none (a folder converted from another ZeRO stage)."""
    cfg = surface.engine_config(engine)
    before = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        with one_model_states_file_per_rank(engine, always=lazy, lazy=lazy, path=path):
            yield
    finally:
        cfg.load_universal_checkpoint = before


def _finish_universal_load(engine: Any, result: Any, decision: ResumeDecision, kwargs: dict, config: UcpConfig) -> None:
    """After DeepSpeed's universal load: what it skips, the training state, the batch, one summary."""

    load_path = result[0] if isinstance(result, tuple) else None
    optimizer = engine.optimizer
    report: Optional[AccountingReport] = getattr(optimizer, _REPORT_ATTR, None)
    if report is not None:
        delattr(optimizer, _REPORT_ATTR)
    if load_path is None:
        return
    folder = Path(load_path).parent
    dp_from = engine.loaded_checkpoint_dp_world_size
    if report is None:
        report = AccountingReport(0, 0, (), 0, dp_from, int(engine.seq_dp_world_size)).with_more(
            [
                Problem(
                    ProblemKind.TRAINING_STATE,
                    None,
                    None,
                    f"the optimizer did not load {folder / F.UNIVERSAL_ZERO_DIR}: no tensors were restored",
                )
            ]
        )
    _finish_load(engine, Path(load_path), report, dp_from, kwargs, config, restore_module=True)


def _finish_load(
    engine: Any,
    load_path: Path,
    report: AccountingReport,
    dp_from: Optional[int],
    kwargs: dict,
    config: UcpConfig,
    restore_module: bool,
    states: Optional[dict] = None,
) -> None:
    """The training state and the batch checked, module tensors DeepSpeed skipped restored (universal
    mode), one summary line; enforced as ``config.strict`` says. ``states``: what the load already
    read from ``load_path`` less the module (the reshard route); else the file is opened memory-mapped,
    so that only the parts read here are paged in."""
    folder = load_path.parent
    dp_to = int(engine.seq_dp_world_size)
    problems: list[Problem] = []
    extras: list[str] = []
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
    if restore_module:
        optimized = set(_live_param_names(engine))
        if config.module_read == "distributed":  # what has no master, read once across the DP group
            states = with_the_rest_exchanged(states, optimized, load_path, surface.dp_group(engine.optimizer))
        p, e = restore_module_tensors(engine.module, optimized, folder, states)
        problems += p
        extras += e
    report = report.with_more(problems, extras, dp_from=dp_from)
    setattr(engine, ENGINE_REPORT_ATTR, report)
    report.enforce(config.strict, log, verbose=is_first())


# ================================================================================================
# optimizer: our universal loader for one rank's flat partitions
# ================================================================================================


def _optimizer_load(original: Callable[..., Any], config: UcpConfig) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir(self: Any, lp_groups_name: str, checkpoint_dir: str) -> None:
        layout = surface.layout_of(self)
        if layout is None or layout.lp_groups != lp_groups_name:
            return original(self, lp_groups_name, checkpoint_dir)
        report = load_universal_partitions(self, Path(checkpoint_dir), strict=config.strict)
        if _DEFER_ENFORCEMENT.get():
            setattr(self, _REPORT_ATTR, report)
        else:
            report.enforce(config.strict, log, verbose=is_first(self.dp_process_group))

    return load_hp_checkpoint_state_from_checkpoint_dir
