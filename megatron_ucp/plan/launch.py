"""What a Megatron-DeepSpeed launch is about to do, and what a DP change needs (pure).

The runner (:mod:`megatron_ucp.integration.run`) reads the script's arguments
(:func:`megatron_args`) and the checkpoint it resumes (:class:`CheckpointFacts`), then
:func:`plan_launch` decides without I/O: keep the checkpoint's global batch when the command line
does not pin one, and replace per-rank RNG states (which cannot be mapped across DP sizes) by a
deterministic re-seed (:func:`derived_seed`) after the load. :func:`alcf_batch_env` is the same
decision for the AuroraGPT wrapper's environment variables. Every branch is tested in milliseconds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from megatron_ucp import launchenv
from megatron_ucp.config import RunnerSettings, UcpConfig
from megatron_ucp.errors import UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.plan.experts import recorded_expert_parallel, recorded_experts
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.resume import checkpoint_global_batch
from megatron_ucp.plan.tensor_parallel import tp_pp_of_states

MEGATRON_DEFAULT_SEED = 1234
"""Megatron's ``--seed`` default (megatron/arguments.py)."""


@dataclass(frozen=True)
class MegatronArgs:
    """The Megatron options the runner reads (argparse semantics: ``--x v`` or ``--x=v``, last wins)."""

    load: Optional[str] = None
    load_tag: Optional[str] = None
    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: int = 1
    seed: Optional[int] = None
    no_load_rng: bool = False
    universal_checkpoint: bool = False
    finetune: bool = False
    no_load_optim: bool = False
    expert_parallel: int = 1
    """``--moe-expert-parallel-size`` (the fork's default 1)."""


def _last_value(args: Sequence[str], name: str) -> Optional[str]:
    found = None
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            found = args[i + 1]
        elif token.startswith(name + "="):
            found = token[len(name) + 1 :]
    return found


def int_or_none(text: Optional[str], name: str) -> Optional[int]:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UcpError(f"{name} {text!r} is not an integer", subject=name) from None


def megatron_args(script_args: Sequence[str]) -> MegatronArgs:
    """Read the options that matter for a resume from the script's argv."""
    flags = set(script_args)
    return MegatronArgs(
        load=_last_value(script_args, "--load"),
        load_tag=_last_value(script_args, "--load-tag"),
        global_batch_size=int_or_none(_last_value(script_args, "--global-batch-size"), "--global-batch-size"),
        micro_batch_size=int_or_none(_last_value(script_args, "--micro-batch-size"), "--micro-batch-size"),
        tensor_parallel=int_or_none(_last_value(script_args, "--tensor-model-parallel-size"), "TP") or 1,
        pipeline_parallel=int_or_none(_last_value(script_args, "--pipeline-model-parallel-size"), "PP") or 1,
        sequence_parallel=int_or_none(_last_value(script_args, "--ds-sequence-parallel-size"), "SP") or 1,
        seed=int_or_none(_last_value(script_args, "--seed"), "--seed"),
        no_load_rng="--no-load-rng" in flags,
        universal_checkpoint="--universal-checkpoint" in flags,
        finetune="--finetune" in flags,
        no_load_optim="--no-load-optim" in flags,
        expert_parallel=int_or_none(_last_value(script_args, "--moe-expert-parallel-size"), "EP") or 1,
    )


def detect_world_size(env: Mapping[str, str]) -> Optional[int]:
    """The job's process count from the launcher's variables (:mod:`megatron_ucp.launchenv`)."""
    return launchenv.world_size(env)


def detect_rank(env: Mapping[str, str]) -> Optional[int]:
    found = launchenv.rank(env)
    return found[0] if found is not None else None


def detect_ranks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """Processes per node from the launcher, for one converter per node when ``ranks_per_node`` is not given."""
    return launchenv.local_size(env)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the resumed tag recorded (read from its mp_rank_00_model_states.pt)."""

    load_dir: str
    tag: str
    dp_world_size: Optional[int]
    global_batch_size: Optional[int]
    micro_batch_size: Optional[int]
    iteration: Optional[int] = None
    tp: int = 1
    pp: int = 1
    experts: int = 1
    """Experts per MoE layer the model states record (``num_experts``; 1: no mixture of experts)."""
    ep: int = 1
    """The expert-parallel size Megatron's saved ``args`` record (``moe_expert_parallel_size``)."""


@dataclass(frozen=True)
class LaunchPlan:
    """The runner's decisions: arguments to append, what to log, and the re-seed to apply."""

    extra_args: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    dp_from: Optional[int] = None
    dp_to: Optional[int] = None
    reseed_base: Optional[int] = None
    """When set: after the load, re-seed each rank from (this seed, iteration, rank)."""

    @property
    def dp_changed(self) -> bool:
        return self.dp_from is not None and self.dp_to is not None and self.dp_from != self.dp_to


def plan_launch(
    margs: MegatronArgs,
    facts: Optional[CheckpointFacts],
    world_size: Optional[int],
    config: UcpConfig,
    settings: RunnerSettings,
) -> LaunchPlan:
    """Decide what a resume at this world size needs (pure: values in, a plan out)."""
    if margs.load is None:
        return LaunchPlan(notes=("no --load: nothing to resume",))
    if facts is None:
        return LaunchPlan(notes=(f"no checkpoint to resume in {margs.load} (no tag to load): nothing to adapt",))
    where = f"{facts.load_dir}/{facts.tag}"
    if margs.finetune:
        return LaunchPlan(notes=(f"--finetune: {where} is loaded without optimizer or RNG states; nothing to adapt",))
    if world_size is None:
        return LaunchPlan(
            warnings=(
                "cannot tell this job's world size (none of " + ", ".join(launchenv.WORLD_SIZE) + " is set): "
                "a DP change cannot be detected before the launch; the hooks still detect it at load time",
            )
        )
    mp = margs.tensor_parallel * margs.pipeline_parallel * margs.sequence_parallel
    if world_size % mp:
        return LaunchPlan(warnings=(f"world size {world_size} is not divisible by TP x PP x SP = {mp}",))
    dp_to = world_size // mp
    dp_from = facts.dp_world_size
    if dp_from is None:
        return LaunchPlan(warnings=(f"{where} records no dp_world_size: DP change not checked",), dp_to=dp_to)
    saved = (facts.tp, facts.pp, dp_from)
    now = (margs.tensor_parallel, margs.pipeline_parallel, dp_to)
    if saved == now:
        at = f"({dp_to})" if saved[:2] == (1, 1) else f"(TP={now[0]}, PP={now[1]}, DP={dp_to})"
        if facts.experts > 1 and facts.ep != margs.expert_parallel:
            return _expert_parallel_change(margs, facts, config, where, at, dp_from, dp_to)
        return LaunchPlan(
            notes=(f"resuming {where} at the DP size it was saved at {at}",), dp_from=dp_from, dp_to=dp_to
        )

    change = ParallelLayout(*saved).describe_change(ParallelLayout(*now))
    notes = [
        f"{change}: {where} was saved at TP={saved[0]} x PP={saved[1]} x DP={dp_from}, "
        f"this job runs at TP={now[0]} x PP={now[1]} x DP={dp_to}"
        if saved[:2] != now[:2]
        else f"DP change: {where} was saved at DP={dp_from}, this job runs at DP={dp_to}"
    ]
    warnings: list[str] = []
    extra: list[str] = []
    if facts.experts > 1 and (saved[:2] != (1, 1) or now[:2] != (1, 1)):
        # the hooks leave mixture-of-experts jobs at TP/PP > 1 to stock DeepSpeed, which refuses another DP size
        warnings.append(
            f"{where} is a mixture-of-experts checkpoint ({facts.experts} experts per MoE layer) with TP or PP > 1: "
            "megatron-ucp does not reshard its expert groups yet; DeepSpeed loads it as stock does, and refuses "
            f"ZeRO optimizer states saved at DP={dp_from} at DP={dp_to}"
        )
    elif facts.experts > 1 and config.elastic_resume and not margs.no_load_optim:
        ep = margs.expert_parallel
        if facts.ep == ep and config.resume_route != "universal" and dp_to % ep == 0:
            notes.append(
                f"{where} is a mixture-of-experts checkpoint ({facts.experts} experts per MoE layer, EP={ep} kept): "
                f"the elastic-resume hook reshards {facts.tag} from its native rank files, each expert-parallel "
                f"rank's experts over expert-DP {dp_from // ep} -> {dp_to // ep} (no conversion)"
            )
        else:
            notes.append(
                f"{where} is a mixture-of-experts checkpoint ({facts.experts} experts per MoE layer"
                f"{f', EP {facts.ep} -> {ep}' if facts.ep != ep else ''}): the elastic-resume hook loads the "
                f"universal twin of {facts.tag}, every expert under its global index (converting it first if it "
                "does not exist yet)"
            )
    elif saved[:2] != now[:2] and not margs.universal_checkpoint:
        # Megatron compares TP, PP and the padded vocabulary with the checkpoint's unless this is set
        extra.append("--universal-checkpoint")
        notes.append(
            "TP/PP change: adding --universal-checkpoint (Megatron then accepts the new TP/PP and padded "
            f"vocabulary; megatron-ucp loads the universal twin of {facts.tag}, converting it first when "
            "it does not exist)"
        )
    elif margs.universal_checkpoint:
        notes.append(
            f"--universal-checkpoint given: loading the universal twin of {facts.tag} (the tag in latest) "
            "with megatron-ucp's loader, converting it first when latest_universal does not name it"
        )
    elif config.elastic_resume:
        notes.append(
            f"the elastic-resume hook loads the universal twin of {facts.tag} (converting it first if it "
            "does not exist yet): resume route universal"
            if config.resume_route == "universal"
            else f"the elastic-resume hook reshards {facts.tag} from its native rank files (resume route "
            f"{config.resume_route}; no conversion)"
        )
    elif not margs.no_load_optim:
        warnings.append(
            "elastic resume is off and --universal-checkpoint is not given: DeepSpeed will refuse to "
            f"load ZeRO optimizer states saved at DP={dp_from} into DP={dp_to}"
        )

    ckpt_batch = facts.global_batch_size
    micro = margs.micro_batch_size or facts.micro_batch_size
    if margs.global_batch_size is not None:
        if ckpt_batch is not None and margs.global_batch_size != ckpt_batch:
            warnings.append(
                f"global batch {margs.global_batch_size} (pinned by --global-batch-size) differs from the "
                f"checkpoint's {ckpt_batch}: the LR schedule and sample counts continue with the new batch"
            )
        else:
            notes.append(f"global batch {margs.global_batch_size} pinned by --global-batch-size")
    elif not settings.keep_global_batch:
        notes.append(
            "keep_global_batch is off: the script's default global batch applies "
            "(Megatron: micro batch x DP x gradient accumulation)"
        )
    elif ckpt_batch is None:
        warnings.append(
            f"{where} does not record its global batch: the script's default applies, which changes with the DP size"
        )
    elif micro and ckpt_batch % (micro * dp_to):
        warnings.append(
            f"cannot keep the checkpoint's global batch {ckpt_batch} at DP={dp_to}: it is not a multiple "
            f"of micro batch {micro} x DP {dp_to}; the script's default applies "
            "(pin --global-batch-size to choose one)"
        )
    else:
        extra += ["--global-batch-size", str(ckpt_batch)]
        how = (
            f" (gradient accumulation {ckpt_batch // (micro * dp_to)} x micro batch {micro} x DP {dp_to})"
            if micro
            else ""
        )
        notes.append(
            f"keeping the checkpoint's global batch {ckpt_batch}{how}: adding --global-batch-size "
            f"{ckpt_batch} (the command line did not pin one)"
        )

    reseed = None
    if margs.no_load_rng:
        notes.append("--no-load-rng given: RNG states are not loaded")
    elif not settings.reseed:
        warnings.append(
            f"reseed is off: the script will load RNG states saved per rank at DP={dp_from} "
            f"into DP={dp_to} ranks (Megatron indexes them by DP rank)"
        )
    else:
        extra.append("--no-load-rng")
        reseed = margs.seed if margs.seed is not None else MEGATRON_DEFAULT_SEED
        notes.append(
            f"RNG states saved per rank at {saved} cannot be mapped to (TP, PP, DP) {now}: adding "
            if saved[:2] != now[:2]
            else f"RNG states saved per rank at DP={dp_from} cannot be mapped to DP={dp_to}: adding "
            f"--no-load-rng; after the load every rank re-seeds deterministically from "
            f"sha256(seed={reseed}, iteration, rank)"
        )
    return LaunchPlan(
        extra_args=tuple(extra),
        notes=tuple(notes),
        warnings=tuple(warnings),
        dp_from=dp_from,
        dp_to=dp_to,
        reseed_base=reseed,
    )


def _expert_parallel_change(
    margs: MegatronArgs, facts: CheckpointFacts, config: UcpConfig, where: str, at: str, dp_from: int, dp_to: int
) -> LaunchPlan:
    """The same DP with another EP: nothing of the batch or the RNG states changes, each rank holds other experts."""
    change = f"EP change: {where} was saved at EP={facts.ep} {at}, this job runs at EP={margs.expert_parallel}"
    if margs.no_load_optim or margs.finetune:
        return LaunchPlan(
            notes=(f"{change}: no optimizer states loaded, DeepSpeed loads each expert's weights",),
            dp_from=dp_from,
            dp_to=dp_to,
        )
    if not config.elastic_resume or facts.tp * facts.pp > 1:
        return LaunchPlan(
            notes=(change,),
            warnings=(
                "DeepSpeed will load every rank's saved expert partitions into the experts the rank holds now, which "
                "are other experts (megatron-ucp reshards experts at TP = PP = 1 with elastic resume on)",
            ),
            dp_from=dp_from,
            dp_to=dp_to,
        )
    return LaunchPlan(
        notes=(
            f"{change}: the elastic-resume hook loads the universal twin of {facts.tag}, every expert under its global "
            "index (converting it first if it does not exist yet)",
        ),
        dp_from=dp_from,
        dp_to=dp_to,
    )


@dataclass(frozen=True)
class BatchEnv:
    """Variables for ALCF/helpers.sh so that a resume keeps the checkpoint's global batch."""

    assignments: tuple[tuple[str, int], ...] = ()
    messages: tuple[str, ...] = ()


def alcf_batch_env(
    facts: Optional[CheckpointFacts],
    world_size: int,
    micro_batch: int,
    mp_size: int,
    user_global_batch: Optional[int],
    user_grad_acc_steps: Optional[int],
) -> BatchEnv:
    """GLOBAL_BATCH and GRAD_ACC_STEPS for helpers.sh (pure).

    train_aGPT_7B.sh always passes ``--global-batch-size=$GLOBAL_BATCH``, where GLOBAL_BATCH
    defaults to nodes x 12 x MICRO_BATCH x GAS (GAS from a node-count table) and also sizes the
    DeepSpeed config. The runner cannot un-pin it, so the wrapper sets both variables before
    helpers.sh runs: GAS = checkpoint batch / (micro x DP), when that divides exactly.
    """
    if facts is None:
        return BatchEnv(messages=("no checkpoint to resume: helpers.sh's global batch applies",))
    if world_size % mp_size:
        return BatchEnv(messages=(f"world size {world_size} is not divisible by TP x PP x SP = {mp_size}",))
    dp = world_size // mp_size
    ckpt = facts.global_batch_size
    where = f"{facts.load_dir}/{facts.tag}"
    if user_global_batch is not None:
        same = "the checkpoint's" if user_global_batch == ckpt else f"the checkpoint has {ckpt}"
        return BatchEnv(messages=(f"GLOBAL_BATCH={user_global_batch} set by you ({same}): left as it is",))
    if ckpt is None:
        return BatchEnv(messages=(f"{where} does not record its global batch: helpers.sh's default applies",))
    if ckpt % (micro_batch * dp):
        return BatchEnv(
            messages=(
                f"cannot keep the checkpoint's global batch {ckpt} at DP={dp}: not a multiple of "
                f"MICRO_BATCH {micro_batch} x DP {dp}; helpers.sh's default applies "
                "(set GLOBAL_BATCH to choose)",
            )
        )
    gas = ckpt // (micro_batch * dp)
    if user_grad_acc_steps is not None and user_grad_acc_steps != gas:
        return BatchEnv(
            messages=(
                f"GRAD_ACC_STEPS={user_grad_acc_steps} set by you: keeping the checkpoint's global "
                f"batch {ckpt} at DP={dp} needs {gas}; left as it is",
            )
        )
    return BatchEnv(
        assignments=(("GLOBAL_BATCH", ckpt), ("GRAD_ACC_STEPS", gas)),
        messages=(
            f"keeping the global batch {ckpt} of {where} (saved at DP={facts.dp_world_size}): "
            f"GLOBAL_BATCH={ckpt} GRAD_ACC_STEPS={gas} at DP={dp} x MICRO_BATCH={micro_batch}",
        ),
    )


def derived_seed(base_seed: int, iteration: int, rank: int) -> int:
    """A per-rank seed for the resumed run: deterministic, distinct per (iteration, rank), < 2**31."""
    digest = hashlib.sha256(f"megatron-ucp:{base_seed}:{iteration}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def facts_from_model_states(load_dir: str, tag: str, states: Mapping[str, Any]) -> CheckpointFacts:
    """Pull DP size, global batch and micro batch out of a loaded model-states dict (pure).

    Megatron's ``args`` (client state) is preferred: Megatron re-sets the engine's batch from
    ``--global-batch-size`` every iteration, so the saved ``ds_config`` can be stale.
    """

    dp = states.get(F.DP_WORLD_SIZE)
    dp = int(dp) if isinstance(dp, int) else None
    ckpt_args = states.get("args")
    ds_config = states.get(F.DS_CONFIG) if isinstance(states.get(F.DS_CONFIG), Mapping) else {}
    gb = getattr(ckpt_args, "global_batch_size", None)
    if not isinstance(gb, int):
        gb = checkpoint_global_batch(ds_config, dp)
    micro = getattr(ckpt_args, "micro_batch_size", None)
    if not isinstance(micro, int):
        micro = ds_config.get("train_micro_batch_size_per_gpu")
        micro = micro if isinstance(micro, int) else None
    iteration = states.get("iteration")
    tp, pp = tp_pp_of_states(states) or (1, 1)
    experts = recorded_experts(states.get("num_experts")) or 1
    return CheckpointFacts(
        load_dir=load_dir,
        tag=tag,
        dp_world_size=dp,
        global_batch_size=gb,
        micro_batch_size=micro,
        iteration=int(iteration) if isinstance(iteration, int) else None,
        tp=tp,
        pp=pp,
        experts=experts,
        ep=recorded_expert_parallel(states) or 1,
    )
