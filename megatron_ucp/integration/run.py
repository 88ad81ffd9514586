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
import json
import logging
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import megatron_ucp
from megatron_ucp.config import (
    ENV_SWITCH,
    FALSE_WORDS,
    NONE_WORD,
    OPTION_PREFIX,
    OptionSpec,
    RunnerSettings,
    UcpConfig,
    build_settings,
    config_env,
    option_specs,
    spec_by_option,
)
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.reader import load_raw, model_states_path
from megatron_ucp.errors import UcpError
from megatron_ucp.format.lightpickle import stand_ins_for_unimportable
from megatron_ucp.format.paths import tag_to_load
from megatron_ucp.integration.save import async_save, memory_trigger
from megatron_ucp.integration.save.async_trigger import wait_at_end_of_run
from megatron_ucp.plan.launch import (
    CheckpointFacts,
    MegatronArgs,
    alcf_batch_env,
    derived_seed,
    detect_rank,
    detect_ranks_per_node,
    detect_world_size,
    facts_from_model_states,
    int_or_none,
    megatron_args,
    plan_launch,
)

log = logging.getLogger("megatron_ucp.integration.run")  # not __name__: "__main__" under python -m

ALCF_BATCH_ENV = "--ucp-alcf-batch-env"
"""The runner's one mode that runs no script: print the checkpoint's batch settings for train_aGPT_7B_ucp.sh."""


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


def _take_option(
    argv: Sequence[str], i: int, table: Mapping[str, tuple[OptionSpec, Optional[bool]]]
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
    table = spec_by_option()
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
                raise UcpError(
                    f"unexpected {token!r} before the script; usage: python -m megatron_ucp.run "
                    "[--ucp-OPTION ...] SCRIPT [script args]",
                    subject=token,
                )
            target = Target("path", token)
            i += 1
            continue
        rest.append(token)
        i += 1
    return SplitArgv(target=target, script_args=tuple(rest), options=tuple(options), help=want_help)


# ================================================================================================
# I/O: read the checkpoint, log, install, run
# ================================================================================================


def read_checkpoint_facts(margs: MegatronArgs) -> Optional[CheckpointFacts]:
    """Read the tag the script will load and its model states (mapped: no weight bytes read).

    Runs before the script, so it must not import the script's packages: Megatron classes in the
    pickled ``args`` load as stand-ins (:mod:`megatron_ucp.format.lightpickle`), never by importing a
    ``megatron`` that might not be the checkout's own.
    """

    if margs.load is None:
        return None
    root = Path(margs.load)
    tag = tag_to_load(root, margs.load_tag, bool(margs.universal_checkpoint)).tag  # the hooks' own rule
    if tag is None:
        return None
    path = model_states_path(root / tag) if (root / tag).is_dir() else None
    if path is None:
        return None
    with stand_ins_for_unimportable():
        states = load_raw(path, random_access=True)  # the pickle only, no readahead into the weights
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
        surface.accelerator().manual_seed_all(seed)
    except Exception as exc:  # an accelerator without a generator of its own: torch's covers the CPU
        log.debug("accelerator seed not set: %s", exc)


@contextlib.contextmanager
def reseed_after_load(base_seed: int) -> Iterator[None]:
    """Wrap ``DeepSpeedEngine.load_checkpoint`` (outermost, above the hooks) so that a successful
    load is followed by a deterministic per-rank re-seed. Restored on exit (LIFO with uninstall)."""
    with surface.scoped_replace(surface.ENGINE, "load_checkpoint", _reseeding(base_seed), stack=True):
        yield


def _reseeding(base_seed: int) -> Callable[[Any], Any]:
    def make(inner: Any) -> Any:
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
                    log.info(
                        "megatron-ucp run: re-seeded RNG after the load: rank r uses sha256(seed=%d, "
                        "iteration=%d, r) (rank 0: %d)",
                        base_seed,
                        iteration,
                        seed,
                    )
            return result

        return load_checkpoint

    return make


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
            word = NONE_WORD.get(spec.name, "none")
            name = f"{spec.option} {'N|' + word if spec.kind == 'optint' else 'N' if spec.kind == 'int' else 'VALUE'}"
        default = defaults[spec.name]
        shown = (
            ("on" if default else "off")
            if spec.kind == "bool"
            else (NONE_WORD.get(spec.name, "none") if default is None else default)
        )
        lines.append(f"  {name}")
        lines.append(f"      {spec.help} ({spec.env}; default {shown})")
    lines += [
        "",
        "MEGATRON_UCP_LOG_LEVEL sets megatron-ucp's log level on rank 0 (default INFO).",
        "",
        "helper for train_scripts/train_aGPT_7B_ucp.sh:",
        "  python -m megatron_ucp.run --ucp-alcf-batch-env CKPT_DIR",
        "      prints GLOBAL_BATCH=... and GRAD_ACC_STEPS=... that keep the checkpoint's global batch at",
        "      WORLD_SIZE (reads helpers.sh's MICRO_BATCH, TP, PP, SP, GLOBAL_BATCH, GRAD_ACC_STEPS)",
    ]
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
            return int_or_none(text, name) if text else default

        facts = read_checkpoint_facts(MegatronArgs(load=args[0]))
        world = num("WORLD_SIZE", None)
        if world is None:
            raise UcpError("WORLD_SIZE is not set", subject="WORLD_SIZE")
        mp = (num("TP", 1) or 1) * (num("PP", 1) or 1) * (num("SP", 1) or 1)
        result = alcf_batch_env(
            facts, world, num("MICRO_BATCH", 1) or 1, mp, num("GLOBAL_BATCH", None), num("GRAD_ACC_STEPS", None)
        )
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
    if argv[:1] == [ALCF_BATCH_ENV]:
        return _alcf_batch_env_main(argv[1:], env)
    try:
        split = split_argv(argv)
        if split.help or split.target is None:
            print(usage(), file=sys.stdout if split.help else sys.stderr)
            return 0 if split.help else 2
        if env.get(ENV_SWITCH, "1").strip().lower() in FALSE_WORDS:
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
            log.warning(
                "megatron-ucp run: could not read the checkpoint in --load %s: %s: %s",
                margs.load,
                type(exc).__name__,
                exc,
            )
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
        print(
            json.dumps(
                {
                    "target": dataclasses.asdict(split.target),
                    "argv": final_args,
                    "config": dataclasses.asdict(config),
                    "runner": dataclasses.asdict(settings),
                    "dp_from": plan.dp_from,
                    "dp_to": plan.dp_to,
                    "reseed_base": plan.reseed_base,
                    "notes": list(plan.notes),
                    "warnings": list(plan.warnings),
                },
                indent=1,
            )
        )
        return 0

    os.environ.update(config_env(config))
    try:
        megatron_ucp.install(config)
    except UcpError as exc:
        print(f"megatron-ucp run: error: {exc}", file=sys.stderr)
        return 2
    memory_trigger.install(config)
    ended_normally = False
    try:
        with reseed_after_load(plan.reseed_base) if plan.reseed_base is not None else contextlib.nullcontext():
            status = _run_target(split.target, final_args)  # Megatron's --exit-interval: sys.exit(), status 0
        ended_normally = status == 0
        return status
    finally:
        try:
            if ended_normally:  # the last save's background conversion, before uninstall stops the wait
                wait_at_end_of_run()
            else:  # an exception or a failing exit status: the saves in flight wait for nobody at the exit
                async_save.note_crash()
        finally:
            try:
                memory_trigger.uninstall()
                megatron_ucp.uninstall()
            finally:
                async_save.forget_crash()  # the exit handlers went with the hooks: a later run here starts clean


if __name__ == "__main__":
    sys.exit(main())
