"""What a ``load_checkpoint`` call should do when the DP size may have changed: pure decisions.

The elastic-load hook (:mod:`megatron_ucp.integration.resume.elastic_load`) gathers the facts (the DP size the
requested tag was saved at, the current DP size, the ``load_universal`` flag, the state of the
universal twin ``<tag>_universal``) and asks :func:`decide_resume` what to do. Keeping the
decision here, free of I/O and of ``torch.distributed``, means every rank reaches the same answer
from the same files, and every branch is tested in milliseconds.

Call order in the hook: :func:`decide_resume` -> (convert, one converter per node as
:func:`megatron_ucp.background.queue.node_assignment` picks) -> load -> :func:`check_global_batch` and
:func:`restored_global_samples`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_ucp.config import RESUME_ROUTES
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.parallel_layout import ParallelLayout


class Route(enum.Enum):
    """How the checkpoint gets loaded."""

    NATIVE = "native"
    """DeepSpeed's own load of the native tag, untouched (same DP size, or nothing to reshard)."""
    UNIVERSAL_EXISTING = "universal-existing"
    """DP changed and the universal twin is there: load it in universal mode."""
    CONVERT_THEN_UNIVERSAL = "convert-then-universal"
    """DP changed and there is no twin yet: convert synchronously, then load it in universal mode."""
    EXPLICIT_UNIVERSAL = "explicit-universal"
    """The user asked for a universal load (``load_universal`` flag, or a universal tag)."""
    RESHARD = "native-reshard"
    """DP changed (TP and PP not): each rank copies its new partitions straight out of the native rank
    files (:mod:`megatron_ucp.plan.reshard`); no conversion, no second copy on disk."""


class TwinState(str, enum.Enum):
    """State of a universal folder: the one vocabulary (:func:`megatron_ucp.convert.universal.universal_state`
    returns these, ``status`` reports them, the resume decision reads them). A ``str``: it compares
    and formats as its value."""

    COMPLETE = "complete"
    FOREIGN = "foreign"
    ABSENT = "absent"
    STALE = "stale"
    """Complete, but converted from an earlier save of the tag: reconverted before loading."""

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class ResumeDecision:
    """One decision, with the sentence the hook logs for it."""

    route: Route
    tag: Optional[str]
    """The tag to hand to DeepSpeed (None: let DeepSpeed read ``latest`` / ``latest_universal``)."""
    checkpoint_dp: Optional[int]
    current_dp: int
    message: str
    warning: Optional[str] = None
    """Something the user should hear loudly (e.g. a universal folder we did not write)."""

    @property
    def universal(self) -> bool:
        return self.route not in (Route.NATIVE, Route.RESHARD)

    @property
    def convert(self) -> bool:
        return self.route is Route.CONVERT_THEN_UNIVERSAL

    @property
    def dp_changed(self) -> bool:
        return self.checkpoint_dp is not None and self.checkpoint_dp != self.current_dp


def decide_resume(
    *,
    requested_tag: Optional[str],
    saved: Optional[ParallelLayout],
    live: ParallelLayout,
    load_universal: bool,
    twin_state: TwinState | str = TwinState.ABSENT,
    tag_is_universal: bool = False,
    loads_optimizer_states: bool = True,
    staging_present: bool = False,
    universal_of_latest: bool = False,
    resume_route: str = "auto",
    names_match: bool = True,
    stage_change: Optional[str] = None,
    regrouped: bool = False,
) -> ResumeDecision:
    """Decide how to load ``requested_tag`` (already resolved from ``latest`` when it was None).

    ``saved`` is the layout the tag's model states record (None when the tag or its model states are
    missing: DeepSpeed then fails or warns in its own words), ``live`` the running job's. A change of
    TP or PP needs the universal route like a DP change does (the native load cannot reshape TP
    slices or pipeline stages).
    ``tag_is_universal`` says the tag folder itself is a universal checkpoint. Without optimizer
    states to load, a DP change needs no resharding (DeepSpeed rebuilds fp32 from the weights).
    ``universal_of_latest``: ``load_universal`` is set, but the tag comes from ``latest`` (the hook
    found no ``latest_universal`` naming its twin): load the twin of ``requested_tag`` in universal
    mode whatever the layout, converting it when needed. ``resume_route``: one of :data:`RESUME_ROUTES`.
    ``names_match``: the saved parameter names are the model's; when not (``GPTModelPipe`` saved,
    ``GPTModel`` resumed, or the other way) only the universal route maps them, whatever the route.
    ``stage_change``: the save's ZeRO partitioning is not the job's (``"stage 1/2 -> 3"``: flat partitions
    saved, per-parameter ones live, or the other way): only the universal folder bridges them.
    ``regrouped``: ZeRO-3 at the saved DP size, but the optimizer cut its parameters into other sub-groups
    (another ``sub_group_size``): DeepSpeed's own load would copy partitions of the wrong sizes, so the
    partitions are resharded as for a DP change. A mixture-of-experts save or job (``ep`` > 1 in ``saved`` or
    ``live``) changing DP at the same EP reshards as any DP change (each expert-parallel rank's buffer over its
    expert-DP ranks); an EP change goes through the universal folder, whose experts carry global indices.
    """
    checkpoint_dp, current_dp = (saved.dp if saved is not None else None), live.dp
    if resume_route not in RESUME_ROUTES:
        raise UcpError(
            f"resume route must be one of {', '.join(RESUME_ROUTES)}, got {resume_route!r}", subject=resume_route
        )
    twin = TwinState(twin_state.value if isinstance(twin_state, TwinState) else twin_state)
    if load_universal:
        shown = requested_tag if requested_tag is not None else f"the tag in {F.LATEST_UNIVERSAL}"
        return ResumeDecision(
            Route.EXPLICIT_UNIVERSAL,
            requested_tag,
            checkpoint_dp,
            current_dp,
            f"load_universal is set: loading {shown} in universal mode at DP={current_dp}",
        )
    if requested_tag is None or checkpoint_dp is None:
        return ResumeDecision(
            Route.NATIVE,
            requested_tag,
            checkpoint_dp,
            current_dp,
            "no readable checkpoint DP size: native DeepSpeed load",
        )
    if tag_is_universal:
        return ResumeDecision(
            Route.EXPLICIT_UNIVERSAL,
            requested_tag,
            checkpoint_dp,
            current_dp,
            f"{requested_tag} is a universal checkpoint (saved at DP={checkpoint_dp}): "
            f"loading it in universal mode at DP={current_dp}",
        )
    mp_changed = saved.model_axes() != live.model_axes() or stage_change is not None
    ep_changed = saved.ep != live.ep
    if checkpoint_dp == current_dp and not mp_changed and not universal_of_latest and not regrouped and not ep_changed:
        unchanged = (
            f"DP unchanged ({current_dp})"
            if live.model_parallel == 1
            else f"layout unchanged (TP={live.tp}, PP={live.pp}, DP={current_dp})"
        )
        return ResumeDecision(
            Route.NATIVE, requested_tag, checkpoint_dp, current_dp, f"{unchanged}: native load of {requested_tag}"
        )
    if not loads_optimizer_states and not mp_changed and not universal_of_latest:
        return ResumeDecision(
            Route.NATIVE,
            requested_tag,
            checkpoint_dp,
            current_dp,
            f"{saved.describe_change(live)} but no optimizer states are loaded: "
            f"native load of {requested_tag} (fp32 master weights rebuilt from bf16 weights)",
        )
    target = F.universal_tag(requested_tag)
    changed = saved.describe_change(live)
    if stage_change is not None:
        moved = "" if saved == live else f", {changed}"
        changed = f"ZeRO stage changed {stage_change}{moved}"
    elif regrouped and checkpoint_dp == current_dp:
        changed = f"DP unchanged ({current_dp}) but ZeRO-3 cut the parameters into other sub-groups (sub_group_size)"
    if not mp_changed and not universal_of_latest and resume_route != "universal" and names_match and not ep_changed:
        how = "" if resume_route == "reshard" else " (resume route auto)"
        if live.ep > 1:
            how = (
                f", EP={live.ep} kept: each expert-parallel rank's experts over expert-DP {checkpoint_dp // live.ep} "
                f"-> {current_dp // live.ep}{how}"
            )
        return ResumeDecision(
            Route.RESHARD,
            requested_tag,
            checkpoint_dp,
            current_dp,
            f"{changed}: resharding {requested_tag} from its native rank files{how}, no conversion",
        )
    if universal_of_latest and checkpoint_dp == current_dp and not mp_changed:
        changed = f"load_universal is set ({changed})"
    elif stage_change is not None and resume_route == "reshard":
        changed += " (resume route reshard: the native files reshard within a stage; a stage change goes through "
        changed += "the universal folder)"
    elif mp_changed and resume_route == "reshard":
        changed += (
            " (resume route reshard: the native files reshard DP only; a TP/PP change goes through the "
            "universal folder)"
        )
    elif ep_changed and resume_route != "universal":
        changed += (
            " (mixture of experts: experts move between ranks, so they go through the universal folder, every "
            "expert under its global index)"
        )
    elif not names_match and resume_route != "universal":
        changed += (
            " (the saved parameter names are not the model's, as when GPTModelPipe and GPTModel trade "
            "places: the universal route maps them)"
        )
    if twin is TwinState.COMPLETE:
        return ResumeDecision(
            Route.UNIVERSAL_EXISTING, target, checkpoint_dp, current_dp, f"{changed}: loading {target}"
        )
    if twin is TwinState.FOREIGN:
        return ResumeDecision(
            Route.UNIVERSAL_EXISTING,
            target,
            checkpoint_dp,
            current_dp,
            f"{changed}: loading {target} (not written by megatron-ucp; strict accounting checks it is complete)",
            warning=(
                f"{target} has no megatron-ucp manifest (stock ds_to_universal output, or an unfinished "
                "conversion). Loading it anyway; the accounting after the load fails on any missing tensor. "
                f"Delete it to have megatron-ucp convert {requested_tag} itself."
            ),
        )
    if twin is TwinState.STALE:
        return ResumeDecision(
            Route.CONVERT_THEN_UNIVERSAL,
            target,
            checkpoint_dp,
            current_dp,
            f"{changed}: {target} was converted from an earlier save of {requested_tag}; "
            f"reconverting {requested_tag} now, then loading {target}",
        )
    note = " (replacing a stale or unfinished staging folder)" if staging_present else ""
    return ResumeDecision(
        Route.CONVERT_THEN_UNIVERSAL,
        target,
        checkpoint_dp,
        current_dp,
        f"{changed}: no {target} yet, converting {requested_tag} now{note}, then loading {target}",
    )


def checkpoint_global_batch(ds_config: Optional[Mapping[str, Any]], checkpoint_dp: Optional[int]) -> Optional[int]:
    """The global batch a checkpoint was trained with, from the ds_config saved in its model states.

    ``train_batch_size`` when recorded; otherwise micro batch x gradient accumulation x DP (what
    DeepSpeed derives); None when the config does not say.
    """
    if not isinstance(ds_config, Mapping):
        return None
    batch = ds_config.get("train_batch_size")
    if isinstance(batch, int) and batch > 0:
        return batch
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accum = ds_config.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accum, int) and checkpoint_dp:
        return micro * accum * checkpoint_dp
    return None


def check_global_batch(
    checkpoint_batch: Optional[int], current_batch: int, checkpoint_dp: Optional[int], current_dp: int
) -> Optional[str]:
    """A loud warning when the global batch differs from the checkpoint's, else None.

    The LR schedule and consumed-sample counters assume the global batch; DeepSpeed derives
    gradient accumulation from ``train_batch_size``, so keeping that constant keeps the run equal.
    """
    if checkpoint_batch is None or checkpoint_batch == current_batch:
        return None
    return (
        f"GLOBAL BATCH CHANGED on resume: the checkpoint was trained with a global batch of {checkpoint_batch} "
        f"(DP={checkpoint_dp}), this run uses {current_batch} (DP={current_dp}). The LR schedule and "
        "consumed-sample counts assume the old batch; set train_batch_size (Megatron's --global-batch-size) to "
        f"{checkpoint_batch} to continue the same run."
    )


def restored_global_samples(
    checkpoint: Mapping[str, Any], checkpoint_batch: Optional[int], current_batch: int
) -> Optional[int]:
    """``global_samples`` to restore: the recorded one, else steps x the checkpoint's own batch.

    DeepSpeed falls back to steps x the *current* batch, wrong after a batch change.
    """
    if checkpoint.get("global_samples") is not None:
        return int(checkpoint["global_samples"])
    steps = checkpoint.get("global_steps")
    if steps is None:
        return None
    return int(steps) * int(checkpoint_batch if checkpoint_batch is not None else current_batch)


SCHEDULE_PROGRESS = ("num_steps",)
"""The learning-rate scheduler's own progress: the one value of its state a load must restore from the checkpoint
(every other value is set by the run's command line)."""
SCHEDULE_FLAGS = (
    "Megatron's --override-opt_param-scheduler trains on with this run's values, "
    "--use-checkpoint-opt_param-scheduler with the checkpoint's values."
)


def schedule_difference(live: Mapping[str, Any], saved: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """How a loaded learning-rate scheduler's state differs from the checkpoint's, in words: (its progress, which
    the load failed to restore; the schedule's settings, which this run's command line chose: ``--train-iters``,
    ``--lr-decay-iters``, ``--lr``, ...). Each entry ``key this-run vs checkpoint``."""
    keys = sorted(set(live) | set(saved), key=str)
    differ = [k for k in keys if live.get(k) != saved.get(k)]
    said = {k: f"{k} {live.get(k)!r} (this run) vs {saved.get(k)!r} (the checkpoint)" for k in differ}
    return [said[k] for k in differ if k in SCHEDULE_PROGRESS], [said[k] for k in differ if k not in SCHEDULE_PROGRESS]
