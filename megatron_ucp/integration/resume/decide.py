"""Which way one load goes: decided once, on the first rank, from the live job and the saved tag's facts (its model
states, its universal twin; :func:`megatron_ucp.plan.resume.decide_resume`), agreed by every rank. The model states
read for it stay on the first rank for the route (:attr:`Decided.model_states`): no file read twice. Also a
mixture-of-experts job left to stock DeepSpeed, refused where stock would load other experts silently
(:func:`refuse_an_expert_layout_change`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_ucp.config import UcpConfig
from megatron_ucp.convert.universal import staging_path, universal_state
from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.deepspeed.reader import rank_file_count_problem, saved_layout, saved_partition_counts
from megatron_ucp.errors import CheckpointFormatError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.paths import tag_to_load
from megatron_ucp.integration.collectives import JOB, Failure
from megatron_ucp.integration.handled import warn_once
from megatron_ucp.integration.live_job import LiveJob, LoadCall
from megatron_ucp.integration.node_memory import names_elsewhere
from megatron_ucp.plan.experts import expert_layout_change, recorded_experts
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.resume import ResumeDecision, TwinState, decide_resume

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decided:
    """One load's decision, the same on every rank, and the first rank's read of the facts behind it."""

    decision: ResumeDecision
    native_tag: Optional[str]
    """The native tag the decision is about (``latest``'s when no tag was given)."""
    from_latest: bool
    model_states: Optional[dict] = None
    """The first rank's read of the tag's model states (no weight bytes); None on the other ranks."""


def decide(call: LoadCall, tag: Optional[str]) -> Decided:
    """Collective: the first rank reads the facts and decides, every rank learns the decision; a failure to decide
    is every rank's error."""
    seen: dict = {}
    decision, native_tag, from_latest = JOB.decided(
        lambda: _decide_from_facts(call.job, call.load_dir, tag, call.loads_states, call.config, seen),
        f"megatron-ucp could not decide how to load {call.load_dir}",
        call.load_dir,
    )
    return Decided(decision, native_tag, from_latest, seen.get("model_states"))


def _decide_from_facts(
    job: LiveJob,
    load_dir: str,
    tag: Optional[str],
    loads_optimizer_states: bool,
    config: UcpConfig,
    seen: dict,
) -> tuple[ResumeDecision, Optional[str], bool]:
    """First-rank side: read the facts from disk and decide. Returns (decision, native tag, tag from latest).
    ``seen`` receives the model states read for the decision (no weight bytes), for this rank's next steps."""

    universal_flag = job.load_universal
    target = tag_to_load(Path(load_dir), tag, universal_flag)
    lag = target.lag
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
        return decide_resume(requested_tag=tag, saved=None, live=job.layout, load_universal=True), tag, False
    # Without --universal-checkpoint, or with it (the runner adds it on a TP/PP change) when
    # latest_universal does not name the twin of `latest`'s tag: decide from `latest`, converting
    # its tag when needed.
    resolved = target.tag  # the one latest names, when no tag was given (also when latest_universal lags)
    from_latest = tag is None and resolved is not None
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
            names_match = unlisted or saved.param_names == job.optimized
            stage_change = _stage_change(job, saved.per_parameter)
            regrouped = stage_change is None and _regrouped(job, saved.states)
            seen["model_states"] = saved.states
            if loads_optimizer_states and not tag_is_universal and saved_as is not None:
                problem = rank_file_count_problem(tag_dir, saved_as.dp, held=names_elsewhere(tag_dir))
                if problem is not None:
                    raise CheckpointFormatError(problem, subject=tag_dir, damaged=tag_dir)
        twin_dir = Path(load_dir) / F.universal_tag(resolved)
        twin = universal_state(twin_dir, tag_dir)
        staging = staging_path(twin_dir).exists()
    decision = decide_resume(
        requested_tag=resolved,
        saved=saved_as,
        live=job.layout,
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


def _stage_change(job: LiveJob, saved_per_parameter: bool) -> Optional[str]:
    """How the save's ZeRO partitioning differs from the job's (``"3 -> 1/2"``), or None."""
    if job.per_parameter == saved_per_parameter:
        return None
    return f"{'3' if saved_per_parameter else '1/2'} -> {job.zero_stage if not job.per_parameter else 3}"


def _regrouped(job: LiveJob, states: Optional[dict]) -> bool:
    """ZeRO-3 saved and live, and the optimizer cut its parameters into other sub-groups than the save's."""
    if not isinstance(states, dict) or not job.per_parameter:
        return False
    saved = [[str(n) for n in group] for group in states.get(F.PARAM_SHAPES) or [] if isinstance(group, dict)]
    live, _ = stage3_runtime.stage3_sub_groups(job.optimizer, job.names)
    return saved != [[n for n, _ in group] for group in live]


# ================================================================================================
# a mixture-of-experts job left to stock DeepSpeed (see the module's docstring)
# ================================================================================================


def refuse_an_expert_layout_change(engine: Any, load_dir: str, tag: Optional[str], config: UcpConfig) -> None:
    """Collective: the first rank compares its saved partition counts with the live groups; every rank raises
    the same error (strict) or goes on to stock's load."""
    # every rank takes the same way: at PP > 1 only the stages holding MoE layers know of them
    if not JOB.count(int(bool(getattr(engine, "has_moe_layers", False)))):
        return
    verdict = JOB.decide(lambda: _expert_change(engine, Path(load_dir), tag))
    if verdict is None or isinstance(verdict, Failure):  # nothing changed, or unreadable: stock's load says it
        return
    if config.strict:
        raise UnsupportedError(
            f"{verdict}. megatron-ucp does not reshard expert groups at TP or PP > 1 yet: resume at the EP size "
            "of the save, "
            "or set MEGATRON_UCP_STRICT=0 to load as stock DeepSpeed does",
            subject=load_dir,
        )
    warn_once(verdict, "MEGATRON_UCP_STRICT=0: loading as stock DeepSpeed does")


def _expert_change(engine: Any, root: Path, tag: Optional[str]) -> Optional[str]:
    tag = tag_to_load(root, tag, universal=False).tag  # the native tag: its expert layout
    found = saved_partition_counts(root / tag) if tag is not None and (root / tag).is_dir() else None
    if found is None:
        return None
    change = expert_layout_change(found[1], surface.group_dp_sizes(engine.optimizer))
    return None if change is None else f"{found[0]}: {change}"
