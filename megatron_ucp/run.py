"""Zero-edit runner: ``python -m megatron_ucp.run SCRIPT [script args]`` (also ``megatron-ucp run``).

Installs megatron-ucp's DeepSpeed hooks in-process, then runs an unmodified Megatron-DeepSpeed
entry script (``pretrain_gpt_alcf.py``) as ``__main__``. Nothing in Megatron-DeepSpeed is edited.

Call order in :func:`main`:

1. :func:`split_argv` takes the runner's own ``--ucp-*`` options out of argv (anywhere: before the
   script, or mixed into the script's arguments, as ``train_aGPT_7B.sh "$@"`` appends them), so
   the script's argparse never sees them.
2. :func:`build_settings` merges them with ``MEGATRON_UCP_*`` environment variables (options win)
   into a :class:`~megatron_ucp.config.UcpConfig` and the runner's own :class:`RunnerSettings`.
3. :func:`read_checkpoint_facts` reads what the script is about to resume (``--load``, its
   ``latest`` tag, the tag's ``mp_rank_00_model_states.pt``: DP size and global batch);
   :func:`plan_launch` decides, without I/O, what a DP change needs: keep the checkpoint's global
   batch when the command line does not pin one, and replace per-rank RNG states (which cannot be
   mapped across DP sizes) by a deterministic re-seed after the load. Every decision is logged.
4. ``megatron_ucp.install(config)``, then the script runs with the cleaned argv.

The pure parts (argv and environment parsing, the DP-change plan) take values and return values;
the I/O parts (reading the checkpoint, installing, running) are thin and come last in this file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import runpy
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from .config import UcpConfig
from .errors import UcpError

log = logging.getLogger("megatron_ucp.run")  # not __name__: "__main__" under python -m

OPTION_PREFIX = "--ucp-"
ENV_PREFIX = "MEGATRON_UCP_"
ENV_SWITCH = "MEGATRON_UCP"
"""``MEGATRON_UCP=0`` runs the script untouched: no hooks, no argv changes (same switch as patches/)."""
MEGATRON_DEFAULT_SEED = 1234
"""Megatron's ``--seed`` default (megatron/arguments.py)."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "all", "auto", "unlimited", ""}
_NONE_WORD = {"keep_last": "all", "ranks_per_node": "auto"}
"""How each optional-int field spells None on the command line and in help."""


# ================================================================================================
# option table: every UcpConfig field, plus the runner's own settings
# ================================================================================================

@dataclass(frozen=True)
class RunnerSettings:
    """What the runner itself does (not hooks): the DP-change adjustments of the script's argv."""

    keep_global_batch: bool = True
    """On a DP change, add the checkpoint's global batch when the command line does not pin one."""
    reseed: bool = True
    """On a DP change, add --no-load-rng and re-seed every rank deterministically after the load."""
    dry_run: bool = False
    """Print the decisions and the final command line, run nothing."""


@dataclass(frozen=True)
class OptionSpec:
    """One ``--ucp-<name>`` option / ``MEGATRON_UCP_<NAME>`` variable and the field it sets."""

    name: str
    kind: str
    """``bool``, ``int``, ``optint`` (an int or none/all) or ``str``."""
    help: str
    runner: bool = False
    """True for RunnerSettings fields, False for UcpConfig fields."""

    @property
    def option(self) -> str:
        return OPTION_PREFIX + self.name.replace("_", "-")

    @property
    def negative(self) -> Optional[str]:
        return OPTION_PREFIX + "no-" + self.name.replace("_", "-") if self.kind == "bool" else None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


_HELP = {
    "record_true_lengths": "record each rank's true partition lengths at save (needed for exact conversion)",
    "elastic_resume": "on a DP change, load the universal twin <tag>_universal (converting it first if missing)",
    "strict": "fail a universal load that leaves any checkpoint tensor or optimizer state unaccounted for",
    "async_convert": "convert every saved tag to the universal layout in the background",
    "keep_last": "keep at most N universal folders per checkpoint root ('all': keep every one)",
    "converter_workers": "worker processes per converter (one converter per node)",
    "converter_threads": "OpenMP/torch threads of each converter process (torch is only used for rare fallbacks)",
    "converter_exit_wait": "seconds a node waits at exit for its background converter to finish (0: do not wait)",
    "ranks_per_node": "processes per node, to run one converter per node (default: LOCAL_WORLD_SIZE)",
    "allow_untested_deepspeed": "install the hooks on a DeepSpeed version they were not written for",
    "keep_global_batch": "on a DP change, keep the checkpoint's global batch unless --global-batch-size is given",
    "reseed": "on a DP change, add --no-load-rng and re-seed each rank from (--seed, iteration, rank) after the load",
    "dry_run": "print the decisions and the final command line; run nothing",
}


def _kind_of(annotation: Any) -> Optional[str]:
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "int"
    if annotation is str:
        return "str"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and args == [int]:
        return "optint"
    if typing.get_origin(annotation) is typing.Union and args == [str]:
        return "str"
    return None


def option_specs() -> tuple[OptionSpec, ...]:
    """Options derived from the dataclass fields, so a new UcpConfig field gets an option and a variable."""
    specs = []
    for cls, runner in ((UcpConfig, False), (RunnerSettings, True)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _kind_of(hints[f.name])
            if kind is not None:
                specs.append(OptionSpec(f.name, kind, _HELP.get(f.name, f"{cls.__name__}.{f.name}"), runner))
    return tuple(specs)


def _spec_by_option() -> dict[str, tuple[OptionSpec, Optional[bool]]]:
    """``--ucp-x`` -> (spec, None); for bools also ``--ucp-no-x`` -> (spec, False) and ``--ucp-x`` -> True."""
    table: dict[str, tuple[OptionSpec, Optional[bool]]] = {}
    for spec in option_specs():
        table[spec.option] = (spec, True if spec.kind == "bool" else None)
        if spec.negative:
            table[spec.negative] = (spec, False)
    return table


# ================================================================================================
# argv: separate the runner's options from the script's (pure)
# ================================================================================================

@dataclass(frozen=True)
class Target:
    """What to run: a script path (``kind='path'``) or a module (``kind='module'``, from ``-m``)."""

    kind: str
    value: str


@dataclass(frozen=True)
class SplitArgv:
    target: Optional[Target]
    script_args: tuple[str, ...]
    """The script's arguments with every ``--ucp-*`` option removed."""
    options: tuple[tuple[str, str], ...]
    """(field name, raw value) in command-line order; the last one of a field wins."""
    help: bool = False


def _take_option(argv: Sequence[str], i: int, table: Mapping[str, tuple[OptionSpec, Optional[bool]]]
                 ) -> tuple[tuple[str, str], int]:
    """Parse the ``--ucp-*`` token at ``argv[i]``: ((field, raw value), next index)."""
    token = argv[i]
    name, eq, inline = token.partition("=")
    if name not in table:
        known = ", ".join(sorted(table))
        raise UcpError(f"unknown runner option {name!r}; known options: {known}", subject=name)
    spec, fixed = table[name]
    if spec.kind == "bool":
        if eq:
            if fixed is False:
                raise UcpError(f"{name} takes no value", subject=name)
            return (spec.name, inline), i + 1
        return (spec.name, "1" if fixed else "0"), i + 1
    if eq:
        return (spec.name, inline), i + 1
    if i + 1 >= len(argv):
        raise UcpError(f"{name} needs a value", subject=name)
    return (spec.name, argv[i + 1]), i + 2


def split_argv(argv: Sequence[str]) -> SplitArgv:
    """``[runner options] (SCRIPT | -m MODULE) [script args]``, with ``--ucp-*`` allowed anywhere."""
    table = _spec_by_option()
    options: list[tuple[str, str]] = []
    target: Optional[Target] = None
    rest: list[str] = []
    want_help = False
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith(OPTION_PREFIX):
            opt, i = _take_option(argv, i, table)
            options.append(opt)
            continue
        if target is None:
            if token in ("-h", "--help"):
                want_help = True
                i += 1
                continue
            if token == "-m":
                if i + 1 >= len(argv):
                    raise UcpError("-m needs a module name", subject="-m")
                target = Target("module", argv[i + 1])
                i += 2
                continue
            if token.startswith("-"):
                raise UcpError(f"unexpected {token!r} before the script; usage: python -m megatron_ucp.run "
                               "[--ucp-OPTION ...] SCRIPT [script args]", subject=token)
            target = Target("path", token)
            i += 1
            continue
        rest.append(token)
        i += 1
    return SplitArgv(target=target, script_args=tuple(rest), options=tuple(options), help=want_help)


# ================================================================================================
# settings: options > MEGATRON_UCP_* environment > defaults (pure)
# ================================================================================================

def _parse_value(spec: OptionSpec, raw: str, where: str) -> Any:
    text = raw.strip().lower()
    if spec.kind == "bool":
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise UcpError(f"{where}: expected one of 1/0, true/false, yes/no, on/off, got {raw!r}", subject=where)
    if spec.kind == "optint" and text in _NONE:
        return None
    if spec.kind in ("int", "optint"):
        try:
            return int(text)
        except ValueError:
            extra = f" or {_NONE_WORD.get(spec.name, 'none')!r}" if spec.kind == "optint" else ""
            raise UcpError(f"{where}: expected an integer{extra}, got {raw!r}", subject=where) from None
    return raw


def build_settings(options: Sequence[tuple[str, str]], env: Mapping[str, str]
                   ) -> tuple[UcpConfig, RunnerSettings, tuple[str, ...]]:
    """The config, the runner settings, and one line per value that differs from its default
    (saying where it came from), for the log."""
    specs = {s.name: s for s in option_specs()}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for spec in specs.values():
        if spec.env in env:
            values[spec.name] = _parse_value(spec, env[spec.env], spec.env)
            origin[spec.name] = spec.env
    for name, raw in options:
        spec = specs[name]
        values[name] = _parse_value(spec, raw, spec.option)
        # a bool switched off came from --ucp-no-<name> (or --ucp-<name>=0, which means the same)
        origin[name] = spec.negative if spec.kind == "bool" and values[name] is False else spec.option
    config = UcpConfig(**{k: v for k, v in values.items() if not specs[k].runner})
    settings = RunnerSettings(**{k: v for k, v in values.items() if specs[k].runner})
    defaults = {**dataclasses.asdict(UcpConfig()), **dataclasses.asdict(RunnerSettings())}
    lines = tuple(f"{k}={values[k]!r} (from {origin[k]})" for k in sorted(values) if values[k] != defaults[k])
    return config, settings, lines


def config_env(config: UcpConfig) -> dict[str, str]:
    """MEGATRON_UCP_* variables equal to ``config``: exported so that a script that also calls
    ``megatron_ucp.install()`` (patches/megatron-deepspeed) or a child process sees the same settings."""
    out = {}
    for spec in option_specs():
        if spec.runner:
            continue
        value = getattr(config, spec.name)
        out[spec.env] = ("1" if value else "0") if spec.kind == "bool" else (
            _NONE_WORD.get(spec.name, "none") if value is None else str(value))
    return out


# ================================================================================================
# what the script is about to do: a view of its Megatron arguments (pure)
# ================================================================================================

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


def _last_value(args: Sequence[str], name: str) -> Optional[str]:
    found = None
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            found = args[i + 1]
        elif token.startswith(name + "="):
            found = token[len(name) + 1:]
    return found


def _int_or_none(text: Optional[str], name: str) -> Optional[int]:
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
        global_batch_size=_int_or_none(_last_value(script_args, "--global-batch-size"), "--global-batch-size"),
        micro_batch_size=_int_or_none(_last_value(script_args, "--micro-batch-size"), "--micro-batch-size"),
        tensor_parallel=_int_or_none(_last_value(script_args, "--tensor-model-parallel-size"), "TP") or 1,
        pipeline_parallel=_int_or_none(_last_value(script_args, "--pipeline-model-parallel-size"), "PP") or 1,
        sequence_parallel=_int_or_none(_last_value(script_args, "--ds-sequence-parallel-size"), "SP") or 1,
        seed=_int_or_none(_last_value(script_args, "--seed"), "--seed"),
        no_load_rng="--no-load-rng" in flags,
        universal_checkpoint="--universal-checkpoint" in flags,
        finetune="--finetune" in flags,
        no_load_optim="--no-load-optim" in flags,
    )


_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMIX_RANK", "SLURM_PROCID")


def _first_int(env: Mapping[str, str], names: Sequence[str]) -> Optional[int]:
    for name in names:
        text = env.get(name, "").strip()
        if text.isdigit():
            return int(text)
    return None


def detect_world_size(env: Mapping[str, str]) -> Optional[int]:
    """The job's process count from the launcher's variables (torchrun/deepspeed, MPICH/PALS, Open MPI, Slurm)."""
    return _first_int(env, _WORLD_SIZE_VARS)


def detect_rank(env: Mapping[str, str]) -> Optional[int]:
    return _first_int(env, _RANK_VARS)


_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "PALS_LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE")


def detect_ranks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """Processes per node from the launcher (torchrun, PALS/MPICH on Aurora, Open MPI, Slurm), for
    one converter per node when ``ranks_per_node`` is not given."""
    return _first_int(env, _LOCAL_SIZE_VARS)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the resumed tag recorded (read from its mp_rank_00_model_states.pt)."""

    load_dir: str
    tag: str
    dp_world_size: Optional[int]
    global_batch_size: Optional[int]
    micro_batch_size: Optional[int]
    iteration: Optional[int] = None


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


def plan_launch(margs: MegatronArgs, facts: Optional[CheckpointFacts], world_size: Optional[int],
                config: UcpConfig, settings: RunnerSettings) -> LaunchPlan:
    """Decide what a resume at this world size needs (pure: values in, a plan out)."""
    if margs.load is None:
        return LaunchPlan(notes=("no --load: nothing to resume",))
    if facts is None:
        return LaunchPlan(notes=(f"no checkpoint to resume in {margs.load} (no tag to load): nothing to adapt",))
    where = f"{facts.load_dir}/{facts.tag}"
    if margs.finetune:
        return LaunchPlan(notes=(f"--finetune: {where} is loaded without optimizer or RNG states; nothing to adapt",))
    if world_size is None:
        return LaunchPlan(warnings=(
            "cannot tell this job's world size (none of " + ", ".join(_WORLD_SIZE_VARS) + " is set): "
            "a DP change cannot be detected before the launch; the hooks still detect it at load time",))
    mp = margs.tensor_parallel * margs.pipeline_parallel * margs.sequence_parallel
    if world_size % mp:
        return LaunchPlan(warnings=(f"world size {world_size} is not divisible by TP x PP x SP = {mp}",))
    dp_to = world_size // mp
    dp_from = facts.dp_world_size
    if dp_from is None:
        return LaunchPlan(warnings=(f"{where} records no dp_world_size: DP change not checked",), dp_to=dp_to)
    if dp_from == dp_to:
        return LaunchPlan(notes=(f"resuming {where} at the DP size it was saved at ({dp_to})",),
                          dp_from=dp_from, dp_to=dp_to)

    notes = [f"DP change: {where} was saved at DP={dp_from}, this job runs at DP={dp_to}"]
    warnings: list[str] = []
    extra: list[str] = []
    if mp != 1:
        warnings.append(f"TP x PP x SP = {mp}: megatron-ucp's elastic resume covers ZeRO-1/2 data parallelism "
                        "with TP=PP=1 only; the command line is left as it is")
        return LaunchPlan(notes=tuple(notes), warnings=tuple(warnings), dp_from=dp_from, dp_to=dp_to)
    if margs.universal_checkpoint:
        notes.append("--universal-checkpoint given: DeepSpeed loads the universal tag in latest_universal, "
                     "as Megatron users expect (with megatron-ucp's loader)")
    elif config.elastic_resume:
        notes.append(f"the elastic-resume hook loads the universal twin of {facts.tag} "
                     "(converting it first if it does not exist yet)")
    elif not margs.no_load_optim:
        warnings.append("elastic resume is off and --universal-checkpoint is not given: DeepSpeed will refuse to "
                        f"load ZeRO optimizer states saved at DP={dp_from} into DP={dp_to}")

    ckpt_batch = facts.global_batch_size
    micro = margs.micro_batch_size or facts.micro_batch_size
    if margs.global_batch_size is not None:
        if ckpt_batch is not None and margs.global_batch_size != ckpt_batch:
            warnings.append(f"global batch {margs.global_batch_size} (pinned by --global-batch-size) differs from the "
                            f"checkpoint's {ckpt_batch}: the LR schedule and sample counts continue with the new batch")
        else:
            notes.append(f"global batch {margs.global_batch_size} pinned by --global-batch-size")
    elif not settings.keep_global_batch:
        notes.append("keep_global_batch is off: the script's default global batch applies "
                     "(Megatron: micro batch x DP x gradient accumulation)")
    elif ckpt_batch is None:
        warnings.append(f"{where} does not record its global batch: the script's default applies, which "
                        "changes with the DP size")
    elif micro and ckpt_batch % (micro * dp_to):
        warnings.append(f"cannot keep the checkpoint's global batch {ckpt_batch} at DP={dp_to}: it is not a multiple "
                        f"of micro batch {micro} x DP {dp_to}; the script's default applies "
                        "(pin --global-batch-size to choose one)")
    else:
        extra += ["--global-batch-size", str(ckpt_batch)]
        how = f" (gradient accumulation {ckpt_batch // (micro * dp_to)} x micro batch {micro} x DP {dp_to})" \
            if micro else ""
        notes.append(f"keeping the checkpoint's global batch {ckpt_batch}{how}: adding --global-batch-size "
                     f"{ckpt_batch} (the command line did not pin one)")

    reseed = None
    if margs.no_load_rng:
        notes.append("--no-load-rng given: RNG states are not loaded")
    elif not settings.reseed:
        warnings.append(f"reseed is off: the script will load RNG states saved per rank at DP={dp_from} "
                        f"into DP={dp_to} ranks (Megatron indexes them by DP rank)")
    else:
        extra.append("--no-load-rng")
        reseed = margs.seed if margs.seed is not None else MEGATRON_DEFAULT_SEED
        notes.append(f"RNG states saved per rank at DP={dp_from} cannot be mapped to DP={dp_to}: adding "
                     f"--no-load-rng; after the load every rank re-seeds deterministically from "
                     f"sha256(seed={reseed}, iteration, rank)")
    return LaunchPlan(extra_args=tuple(extra), notes=tuple(notes), warnings=tuple(warnings),
                      dp_from=dp_from, dp_to=dp_to, reseed_base=reseed)


@dataclass(frozen=True)
class BatchEnv:
    """Variables for ALCF/helpers.sh so that a resume keeps the checkpoint's global batch."""

    assignments: tuple[tuple[str, int], ...] = ()
    messages: tuple[str, ...] = ()


def alcf_batch_env(facts: Optional[CheckpointFacts], world_size: int, micro_batch: int, mp_size: int,
                   user_global_batch: Optional[int], user_grad_acc_steps: Optional[int]) -> BatchEnv:
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
        return BatchEnv(messages=(f"cannot keep the checkpoint's global batch {ckpt} at DP={dp}: not a multiple of "
                                  f"MICRO_BATCH {micro_batch} x DP {dp}; helpers.sh's default applies "
                                  "(set GLOBAL_BATCH to choose)",))
    gas = ckpt // (micro_batch * dp)
    if user_grad_acc_steps is not None and user_grad_acc_steps != gas:
        return BatchEnv(messages=(f"GRAD_ACC_STEPS={user_grad_acc_steps} set by you: keeping the checkpoint's global "
                                  f"batch {ckpt} at DP={dp} needs {gas}; left as it is",))
    return BatchEnv(assignments=(("GLOBAL_BATCH", ckpt), ("GRAD_ACC_STEPS", gas)),
                    messages=(f"keeping the global batch {ckpt} of {where} (saved at DP={facts.dp_world_size}): "
                              f"GLOBAL_BATCH={ckpt} GRAD_ACC_STEPS={gas} at DP={dp} x MICRO_BATCH={micro_batch}",))


def derived_seed(base_seed: int, iteration: int, rank: int) -> int:
    """A per-rank seed for the resumed run: deterministic, distinct per (iteration, rank), < 2**31."""
    digest = hashlib.sha256(f"megatron-ucp:{base_seed}:{iteration}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def checkpoint_tag_file(margs: MegatronArgs) -> str:
    """The file DeepSpeed reads the tag from when --load-tag is not given."""
    from . import dsformat as F
    return F.LATEST_UNIVERSAL if margs.universal_checkpoint else F.LATEST


def facts_from_model_states(load_dir: str, tag: str, states: Mapping[str, Any]) -> CheckpointFacts:
    """Pull DP size, global batch and micro batch out of a loaded model-states dict (pure).

    Megatron's ``args`` (client state) is preferred: Megatron re-sets the engine's batch from
    ``--global-batch-size`` every iteration, so the saved ``ds_config`` can be stale.
    """
    from . import dsformat as F
    from .resume import checkpoint_global_batch

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
    return CheckpointFacts(load_dir=load_dir, tag=tag, dp_world_size=dp, global_batch_size=gb,
                           micro_batch_size=micro, iteration=int(iteration) if isinstance(iteration, int) else None)


# ================================================================================================
# I/O: read the checkpoint, log, install, run
# ================================================================================================

def read_checkpoint_facts(margs: MegatronArgs) -> Optional[CheckpointFacts]:
    """Read the tag the script will load and its model states (mapped: no weight bytes read).

    Runs before the script, so it must not import the script's packages: Megatron classes in the
    pickled ``args`` load as stand-ins (:mod:`megatron_ucp.lightpickle`), never by importing a
    ``megatron`` that might not be the checkout's own.
    """
    from . import dsformat as F
    from .lightpickle import stand_ins_for_unimportable
    from .paths import read_tag_file
    from .reader import load_raw

    if margs.load is None:
        return None
    root = Path(margs.load)
    tag = margs.load_tag
    if tag is None:
        tag = read_tag_file(root / checkpoint_tag_file(margs))
        if tag is None:
            return None
    path = root / tag / F.MODEL_STATES_FILE
    if not path.is_file():
        candidates = sorted((root / tag).glob("*_model_states.pt")) if (root / tag).is_dir() else []
        if not candidates:
            return None
        path = candidates[0]
    with stand_ins_for_unimportable():
        states = load_raw(path)
    if not isinstance(states, Mapping):
        raise UcpError(f"{path}: not a DeepSpeed model-states dict", subject=path)
    return facts_from_model_states(str(root), tag, states)


def _configure_logging(rank: Optional[int]) -> None:
    """megatron-ucp's own logger only (the script configures the root logger as it likes);
    INFO on rank 0 (or when the rank is unknown), warnings elsewhere, so 768 ranks do not repeat it."""
    pkg = logging.getLogger("megatron_ucp")
    if not pkg.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        pkg.addHandler(handler)
        pkg.propagate = False
    level = os.environ.get("MEGATRON_UCP_LOG_LEVEL", "INFO").upper()
    pkg.setLevel(level if rank in (None, 0) else logging.WARNING)


def apply_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and the accelerator (what Megatron's _set_random_seed seeds)."""
    import random

    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().manual_seed_all(seed)
    except Exception as exc:  # an accelerator without a generator of its own: torch's covers the CPU
        log.debug("accelerator seed not set: %s", exc)


@contextlib.contextmanager
def reseed_after_load(base_seed: int) -> Iterator[None]:
    """Wrap ``DeepSpeedEngine.load_checkpoint`` (outermost, above the hooks) so that a successful
    load is followed by a deterministic per-rank re-seed. Restored on exit (LIFO with uninstall)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    inner = DeepSpeedEngine.load_checkpoint

    @functools.wraps(inner)
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = inner(self, *args, **kwargs)
        load_path, client = result if isinstance(result, tuple) and len(result) == 2 else (None, None)
        if load_path is not None:
            iteration = client.get("iteration") if isinstance(client, Mapping) else None
            if not isinstance(iteration, int):
                iteration = int(getattr(self, "global_steps", 0))
            rank = int(self.global_rank)
            seed = derived_seed(base_seed, iteration, rank)
            apply_seed(seed)
            if rank == 0:
                log.info("megatron-ucp run: re-seeded RNG after the load: rank r uses sha256(seed=%d, iteration=%d, r) "
                         "(rank 0: %d)", base_seed, iteration, seed)
        return result

    DeepSpeedEngine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        if DeepSpeedEngine.__dict__.get("load_checkpoint") is load_checkpoint:
            DeepSpeedEngine.load_checkpoint = inner


def put_script_folder_first(target: Target) -> None:
    """``sys.path[0]`` = the script's folder, as ``python SCRIPT`` has it.

    Megatron-DeepSpeed imports its own ``megatron`` package from the checkout; launched through a
    shim or ``python -m megatron_ucp.run``, ``sys.path[0]`` would be the shim's folder or the
    current directory, and a ``megatron`` installed in the environment (megatron-core's
    namespace) would win. Done before anything is read, idempotent.
    """
    if target.kind != "path":
        return
    folder = str(Path(target.value).resolve().parent)
    if sys.path[:1] != [folder]:
        sys.path.insert(0, folder)


def _run_target(target: Target, args: Sequence[str]) -> int:
    """Run the script as ``__main__`` with ``sys.argv = [script, *args]``, like ``python SCRIPT args``."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target.kind == "module":
            sys.argv = [target.value, *args]
            runpy.run_module(target.value, run_name="__main__", alter_sys=True)
        else:
            script = str(Path(target.value).resolve())
            sys.argv = [target.value, *args]
            put_script_folder_first(target)
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def usage() -> str:
    lines = [
        "usage: python -m megatron_ucp.run [--ucp-OPTION ...] SCRIPT [script args]",
        "       python -m megatron_ucp.run [--ucp-OPTION ...] -m MODULE [module args]",
        "       megatron-ucp run ...   (the same)",
        "",
        "Runs an unmodified Megatron-DeepSpeed entry script (e.g. pretrain_gpt_alcf.py) with megatron-ucp's",
        "DeepSpeed hooks installed: correct ZeRO partition bookkeeping at save, elastic resume at any DP size,",
        "optional background conversion to universal checkpoints.",
        "",
        "--ucp-* options may appear anywhere (also among the script's arguments, e.g. appended by",
        "train_aGPT_7B.sh); they are removed before the script parses its argv. Each has a MEGATRON_UCP_*",
        "environment variable; options win over variables. MEGATRON_UCP=0 runs the script untouched.",
        "",
        "On a DP change (the tag in <--load>/latest was saved at another data-parallel size than",
        "WORLD_SIZE / (TP x PP)), the runner also:",
        "  * keeps the checkpoint's global batch when --global-batch-size is not on the command line",
        "    (Megatron's default, micro batch x DP x accumulation, changes with the node count), and says so;",
        "  * adds --no-load-rng (RNG states are saved per DP rank and cannot be mapped to another DP size)",
        "    and re-seeds every rank after the load from sha256(--seed, iteration, rank), and says so.",
        "",
        "options (environment variable; default):",
    ]
    defaults = {**dataclasses.asdict(UcpConfig()), **dataclasses.asdict(RunnerSettings())}
    for spec in option_specs():
        if spec.kind == "bool":
            name = f"{spec.option} / {spec.negative}"
        else:
            word = _NONE_WORD.get(spec.name, "none")
            name = f"{spec.option} {'N|' + word if spec.kind == 'optint' else 'N' if spec.kind == 'int' else 'VALUE'}"
        default = defaults[spec.name]
        shown = ("on" if default else "off") if spec.kind == "bool" else (
            _NONE_WORD.get(spec.name, "none") if default is None else default)
        lines.append(f"  {name}")
        lines.append(f"      {spec.help} ({spec.env}; default {shown})")
    lines += ["", "MEGATRON_UCP_LOG_LEVEL sets megatron-ucp's log level on rank 0 (default INFO).",
              "",
              "helper for train_scripts/train_aGPT_7B_ucp.sh:",
              "  python -m megatron_ucp.run --ucp-alcf-batch-env CKPT_DIR",
              "      prints GLOBAL_BATCH=... and GRAD_ACC_STEPS=... that keep the checkpoint's global batch at",
              "      WORLD_SIZE (reads helpers.sh's MICRO_BATCH, TP, PP, SP, GLOBAL_BATCH, GRAD_ACC_STEPS)"]
    return "\n".join(lines)


def _alcf_batch_env_main(args: Sequence[str], env: Mapping[str, str]) -> int:
    """``--ucp-alcf-batch-env CKPT_DIR`` (for train_aGPT_7B_ucp.sh): print ``NAME=value`` lines.

    Reads helpers.sh's variables WORLD_SIZE, MICRO_BATCH, TP, PP, SP, GLOBAL_BATCH, GRAD_ACC_STEPS.
    """
    if len(args) != 1:
        print("usage: python -m megatron_ucp.run --ucp-alcf-batch-env CKPT_DIR", file=sys.stderr)
        return 2
    try:
        def num(name: str, default: Optional[int]) -> Optional[int]:
            text = env.get(name, "").strip()
            return _int_or_none(text, name) if text else default

        facts = read_checkpoint_facts(MegatronArgs(load=args[0]))
        world = num("WORLD_SIZE", None)
        if world is None:
            raise UcpError("WORLD_SIZE is not set", subject="WORLD_SIZE")
        mp = (num("TP", 1) or 1) * (num("PP", 1) or 1) * (num("SP", 1) or 1)
        result = alcf_batch_env(facts, world, num("MICRO_BATCH", 1) or 1, mp, num("GLOBAL_BATCH", None),
                                num("GRAD_ACC_STEPS", None))
    except Exception as exc:
        print(f"megatron-ucp: cannot read the checkpoint in {args[0]}: {exc}", file=sys.stderr)
        return 0  # the launch goes on with helpers.sh's defaults
    for line in result.messages:
        print(f"megatron-ucp: {line}", file=sys.stderr)
    for key, value in result.assignments:
        print(f"{key}={value}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ
    rank = detect_rank(env)
    _configure_logging(rank)
    if argv[:1] == ["--ucp-alcf-batch-env"]:
        return _alcf_batch_env_main(argv[1:], env)
    try:
        split = split_argv(argv)
        if split.help or split.target is None:
            print(usage(), file=sys.stdout if split.help else sys.stderr)
            return 0 if split.help else 2
        if env.get(ENV_SWITCH, "1").strip().lower() in _FALSE:
            log.info("megatron-ucp run: %s=0: running %s without megatron-ucp", ENV_SWITCH, split.target.value)
            return _run_target(split.target, split.script_args)
        config, settings, changed = build_settings(split.options, env)
        if config.ranks_per_node is None and detect_ranks_per_node(env):
            config = dataclasses.replace(config, ranks_per_node=detect_ranks_per_node(env))
            changed += (f"ranks_per_node={config.ranks_per_node} (from the launcher's environment)",)
        if split.target.kind == "path" and not Path(split.target.value).is_file():
            raise UcpError(f"{split.target.value}: no such script", subject=split.target.value)
        margs = megatron_args(split.script_args)
        put_script_folder_first(split.target)
        try:
            facts = read_checkpoint_facts(margs)
        except Exception as exc:  # the script's own load reports a broken checkpoint in its own words
            log.warning("megatron-ucp run: could not read the checkpoint in --load %s: %s: %s", margs.load,
                        type(exc).__name__, exc)
            facts = None
        plan = plan_launch(margs, facts, detect_world_size(env), config, settings)
    except UcpError as exc:
        print(f"megatron-ucp run: error: {exc}", file=sys.stderr)
        return 2

    final_args = [*split.script_args, *plan.extra_args]
    for line in changed:
        log.info("megatron-ucp run: setting %s", line)
    for line in plan.notes:
        log.info("megatron-ucp run: %s", line)
    for line in plan.warnings:
        log.warning("megatron-ucp run: WARNING: %s", line)
    if settings.dry_run:
        print(json.dumps({"target": dataclasses.asdict(split.target), "argv": final_args,
                          "config": dataclasses.asdict(config), "runner": dataclasses.asdict(settings),
                          "dp_from": plan.dp_from, "dp_to": plan.dp_to, "reseed_base": plan.reseed_base,
                          "notes": list(plan.notes), "warnings": list(plan.warnings)}, indent=1))
        return 0

    import megatron_ucp

    os.environ.update(config_env(config))
    try:
        megatron_ucp.install(config)
    except UcpError as exc:
        print(f"megatron-ucp run: error: {exc}", file=sys.stderr)
        return 2
    try:
        with reseed_after_load(plan.reseed_base) if plan.reseed_base is not None else contextlib.nullcontext():
            return _run_target(split.target, final_args)
    finally:
        megatron_ucp.uninstall()


if __name__ == "__main__":
    sys.exit(main())
