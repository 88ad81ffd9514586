"""One typed configuration for everything :func:`megatron_ucp.install` turns on, and its one parser.

Built once (from keyword arguments, ``--ucp-*`` options or ``MEGATRON_UCP_*`` variables) and
validated in ``__post_init__``; every hook reads the same frozen object. The option table is
derived from the dataclass fields (:func:`option_specs`), so a new field gets its ``--ucp-*``
option and its variable; :func:`build_settings` merges options over variables over defaults.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from megatron_ucp.errors import UcpError

MODULE_READS = ("distributed", "full")
"""The ``module_read`` values: ``distributed`` rebuilds the module's weights from the fp32 masters each
rank loads (one all-gather, no module bytes read) and reads what has no master as one 1/DP slice per
rank; ``full`` lets every rank read the whole module from the model-states file, as DeepSpeed does."""

RESUME_ROUTES = ("auto", "reshard", "universal")
"""The ``resume_route`` values: ``auto`` reshards the native files on a DP-only change and goes
through the universal folder on a TP/PP change; ``reshard`` is ``auto`` said explicitly (a TP/PP
change still needs the universal folder, and the log says so); ``universal`` always takes the
universal folder (converted on demand), as megatron-ucp did before it could reshard."""


@dataclass(frozen=True)
class UcpConfig:
    # --- save time (issue: correct conversion) -------------------------------------------------
    record_true_lengths: bool = True
    """Record each rank's true unpadded lengths (and fix BF16_Optimizer's group_paddings) at save."""

    # --- load time (issue: elastic resume) -----------------------------------------------------
    elastic_resume: bool = True
    """On a restart at another layout, load instead of failing: a DP change by the :attr:`resume_route`, a TP,
    PP, EP or ZeRO-stage change through the universal twin (converted first when missing)."""
    strict: bool = True
    """A load that leaves a tensor or an optimizer state unaccounted for, or whose loaded partitions differ from
    what the save recorded, stops the job; False downgrades these to warnings (files that do not belong
    together are refused either way)."""
    resume_route: str = "auto"
    """How a DP change is loaded (:data:`RESUME_ROUTES`): ``auto``/``reshard``
    copy each rank's partitions straight from the native files (a TP/PP change still goes through the
    universal folder); ``universal`` always loads the universal twin, converting it when missing."""
    fallback: bool = True
    """A restart that loads the tag ``latest`` names (no tag given) falls back to the newest older tag that passes
    when that one fails its verdict, its files or its load (:mod:`megatron_ucp.integration.resume.fallback`);
    ``--ucp-no-fallback``: that tag's error instead."""
    module_read: str = "distributed"
    """How a restart reads the module (:data:`MODULE_READS`): ``distributed`` (each byte once across the
    job) or ``full`` (every rank the whole module, as DeepSpeed does)."""
    requantize_8bit: bool = False
    """At a DP change, read bitsandbytes' 8-bit optimizer state as values and quantize it again in the new partitions
    (not exact: one more quantization; :mod:`megatron_ucp.integration.resume.native.requantize`). Off: such a save
    is refused at a DP change, by name, before anything loads."""

    # --- asynchronous saves ---------------------------------------------------------------------
    async_save: bool = False
    """``save_checkpoint`` returns once each rank's state is copied into host memory; the files are written in the
    background and the save committed (``latest``, Megatron's tracker) when every rank's are durable
    (:mod:`megatron_ucp.integration.save.async_save`)."""
    saves_in_flight: int = 1
    """With :attr:`async_save`: how many saves may be written at once (each holds a host copy of the state)."""

    # --- memory saves ---------------------------------------------------------------------------
    memory_save_interval: Optional[int] = None
    """Every this many iterations, a save to each node's memory (:attr:`local_dir`) with a replica on the next node:
    a restart on the surviving nodes resumes from it at the new node count
    (:mod:`megatron_ucp.integration.save.memory_save`). None: no memory saves."""
    local_dir: str = ""
    """Each node's folder for memory saves (``{node}`` replaced by the node's name); empty: a folder under
    ``/dev/shm`` named after the checkpoint root."""

    # --- background conversion (issue: async conversion) ---------------------------------------
    async_convert: bool = False
    """Convert every saved tag to the universal layout in background processes."""
    verify_saves: bool = False
    """Without :attr:`async_convert`: read every saved tag once in the background (node 0's converter) and record
    its verdict (whole, one save, as recorded, finite), which ``status`` shows and a restart's fallback uses. With
    it, the conversion's own read gives the verdict."""
    keep_last: Optional[int] = None
    """Keep at most this many universal folders (and Hugging Face exports) per checkpoint root (None: keep all)."""
    export_hf: bool = False
    """With :attr:`async_convert`: export every converted tag as a Hugging Face model (``<tag>_hf``) in the
    background converter, after its conversion (:mod:`megatron_ucp.export.hf_export`)."""
    converter_workers: int = 1
    """Worker processes per converter (each node runs one converter)."""
    converter_threads: int = 1
    """OpenMP / torch threads of each converter process (``OMP_NUM_THREADS``); the converter only
    imports torch for rare fallbacks (states of 4 GB and more, frozen non-fp32 parameters)."""
    ranks_per_node: Optional[int] = None
    """Processes per node, to pick one converter per node; None reads LOCAL_WORLD_SIZE / launcher env."""
    converter_exit_wait: int = 900
    """Seconds a node's launcher process waits at exit for its background converter, and each rank for its saves in
    flight (asynchronous saves, the last memory save's commit) (0: no wait)."""

    # --- safety -------------------------------------------------------------------------------
    allow_untested_deepspeed: bool = False
    """Install hooks on a DeepSpeed version they were not written for (logs a loud warning)."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise UcpError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.saves_in_flight < 1:
            raise UcpError(f"saves_in_flight must be >= 1, got {self.saves_in_flight}")
        if self.converter_workers < 1:
            raise UcpError(f"converter_workers must be >= 1, got {self.converter_workers}")
        if self.converter_threads < 1:
            raise UcpError(f"converter_threads must be >= 1, got {self.converter_threads}")
        if self.converter_exit_wait < 0:
            raise UcpError(f"converter_exit_wait must be >= 0 seconds, got {self.converter_exit_wait}")
        if self.memory_save_interval is not None and self.memory_save_interval < 1:
            raise UcpError(f"memory_save_interval must be >= 1 or none, got {self.memory_save_interval}")
        if self.memory_save_interval is not None and not self.record_true_lengths:
            raise UcpError("memory_save_interval needs record_true_lengths (a memory save goes through the save hook)")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UcpError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.resume_route not in RESUME_ROUTES:
            raise UcpError(f"resume_route must be auto, reshard or universal, got {self.resume_route!r}")
        if self.module_read not in MODULE_READS:
            raise UcpError(f"module_read must be {' or '.join(MODULE_READS)}, got {self.module_read!r}")

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "UcpConfig":
        """The config ``MEGATRON_UCP_<FIELD>`` variables describe (unset fields keep their defaults).

        Same parsing as the runner's ``--ucp-*`` options (see :mod:`megatron_ucp.integration.run`); bad values
        raise :class:`UcpError` naming the variable.
        """
        return build_settings([], os.environ if env is None else env)[0]


OPTION_PREFIX = "--ucp-"
ENV_PREFIX = "MEGATRON_UCP_"
ENV_SWITCH = "MEGATRON_UCP"
"""``MEGATRON_UCP=0`` runs the script untouched: no hooks, no argv changes (same switch as patches/)."""

_TRUE = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}
_NONE = {"none", "all", "auto", "unlimited", ""}
NONE_WORD = {"keep_last": "all", "ranks_per_node": "auto"}
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
    "elastic_resume": "on a restart at another layout, load the checkpoint instead of failing: a DP change reshards "
    "straight from the native rank files (see --ucp-resume-route), a TP, PP, EP or ZeRO-stage change loads the "
    "universal twin <tag>_universal (converting it first if missing)",
    "strict": "stop a load (native or universal) that leaves any checkpoint tensor or optimizer state unaccounted "
    "for, or whose loaded partitions differ from what the save recorded; --ucp-no-strict warns and continues "
    "(files that do not belong together are refused either way)",
    "resume_route": "how a DP change loads: auto/reshard (straight from the native rank files; TP/PP changes go "
    "through the universal folder) or universal (always the universal twin, converted on demand)",
    "fallback": "when the tag 'latest' names is not sound (its verdict, its files, or its load refusing it), a "
    "restart that names no tag loads the newest older tag that passes, saying so; --ucp-no-fallback stops on it",
    "module_read": "how a restart reads the module: distributed (weights rebuilt from the masters each rank "
    "loads, the rest read as one 1/DP slice per rank: each byte once across the job) or full (every rank reads "
    "the whole module, as DeepSpeed does)",
    "requantize_8bit": "at a DP change, move bitsandbytes' 8-bit optimizer state (--optimizer adam8bit) by "
    "dequantizing and quantizing it again in the new partitions: not exact (one more quantization, measured and "
    "reported); without it such a resume is refused by name",
    "async_save": "return from each save once every rank's state is copied into host memory; write the files in "
    "the background and make the save latest only when every rank's files are durable (costs host memory: one copy "
    "of what each rank saves, per save in flight)",
    "saves_in_flight": "with --ucp-async-save: how many saves may be written at once (a save that finds as many "
    "still writing waits for them)",
    "memory_save_interval": "every N iterations, save each rank's state to its node's memory (--ucp-local-dir) with "
    "a replica on the next node; a restart on the surviving nodes resumes from the newest whole one, at the new node "
    "count, when it is newer than the durable 'latest' ('none': no memory saves)",
    "local_dir": "each node's folder for memory saves ({node} is replaced by the node's name; default: a folder "
    "under /dev/shm named after the checkpoint root)",
    "async_convert": "convert every saved tag to the universal layout in the background",
    "verify_saves": "without --ucp-async-convert: verify every saved tag in the background (every file read once: "
    "whole, of one save, as recorded, finite) and record its verdict for status and the restart's fallback",
    "keep_last": "keep at most N universal folders (and Hugging Face exports) per checkpoint root ('all': keep every "
    "one)",
    "export_hf": "with --ucp-async-convert: export every converted tag as a Hugging Face model folder <tag>_hf (bf16 "
    "safetensors, config, tokenizer) in the background converter",
    "converter_workers": "worker processes per converter (one converter per node)",
    "converter_threads": "OpenMP/torch threads of each converter process (torch is only used for rare fallbacks)",
    "converter_exit_wait": "seconds a node waits at exit for its background converter to finish, and each rank for its "
    "saves in flight (asynchronous saves, the last memory save's commit) (0: do not wait)",
    "ranks_per_node": "processes per node, to run one converter per node ('auto': LOCAL_WORLD_SIZE)",
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


def spec_by_option() -> dict[str, tuple[OptionSpec, Optional[bool]]]:
    """``--ucp-x`` -> (spec, None); for bools also ``--ucp-no-x`` -> (spec, False) and ``--ucp-x`` -> True."""
    table: dict[str, tuple[OptionSpec, Optional[bool]]] = {}
    for spec in option_specs():
        table[spec.option] = (spec, True if spec.kind == "bool" else None)
        if spec.negative:
            table[spec.negative] = (spec, False)
    return table


# ================================================================================================
# settings: options > MEGATRON_UCP_* environment > defaults (pure)
# ================================================================================================


def parse_value(spec: OptionSpec, raw: str, where: str) -> Any:
    text = raw.strip().lower()
    if spec.kind == "bool":
        if text in _TRUE:
            return True
        if text in FALSE_WORDS:
            return False
        raise UcpError(f"{where}: expected one of 1/0, true/false, yes/no, on/off, got {raw!r}", subject=where)
    if spec.kind == "optint" and text in _NONE:
        return None
    if spec.kind in ("int", "optint"):
        try:
            return int(text)
        except ValueError:
            extra = f" or {NONE_WORD.get(spec.name, 'none')!r}" if spec.kind == "optint" else ""
            raise UcpError(f"{where}: expected an integer{extra}, got {raw!r}", subject=where) from None
    return raw


def build_settings(
    options: Sequence[tuple[str, str]], env: Mapping[str, str]
) -> tuple[UcpConfig, RunnerSettings, tuple[str, ...]]:
    """The config, the runner settings, and one line per value that differs from its default
    (saying where it came from), for the log."""
    specs = {s.name: s for s in option_specs()}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for spec in specs.values():
        if spec.env in env:
            values[spec.name] = parse_value(spec, env[spec.env], spec.env)
            origin[spec.name] = spec.env
    for name, raw in options:
        spec = specs[name]
        values[name] = parse_value(spec, raw, spec.option)
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
        out[spec.env] = (
            ("1" if value else "0")
            if spec.kind == "bool"
            else (NONE_WORD.get(spec.name, "none") if value is None else str(value))
        )
    return out
