"""``TrainSpec`` (what to run) and ``TrainResult`` (what came back); no DeepSpeed import here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

OPTIMIZERS = ("bf16", "zero")
BASE_OPTIMIZERS = ("adamw", "nadam")
#: Prefix of the lines rank 0 prints for the launcher (``UCP_HARNESS {"kind": ..., ...}``).
MARKER = "UCP_HARNESS "
_PATH_FIELDS = ("save_dir", "load_dir", "dump_dir")


@dataclass
class TrainSpec:
    """One multi-process DeepSpeed run (TP=PP=1, DP = ``dp`` processes, CPU + gloo).

    ``optimizer="bf16"``: BF16_Optimizer (bf16 + ZeRO-1 + ``data_types.grad_accum_dtype: fp32``).
    ``optimizer="zero"``: DeepSpeedZeroOptimizer (bf16 + ZeRO stage ``zero_stage``, no fp32 grad accum);
    at ``zero_stage=3``, DeepSpeedZeroOptimizer_Stage3 (``extra_config`` can set ``sub_group_size``); at
    ``zero_stage=0``, no ZeRO (DeepSpeed's bf16 data parallelism: a job the hooks leave to stock DeepSpeed).
    Training runs until ``engine.global_steps == steps``; after every step in ``save_at`` it calls
    ``engine.save_checkpoint(save_dir)`` (tag ``global_step{N}``). See ``tests/support/dsharness/__init__.py``.
    """

    dp: int = 4
    optimizer: str = "bf16"
    zero_stage: int = 1
    steps: int = 4
    save_dir: Optional[Path] = None
    save_at: tuple[int, ...] = ()
    load_dir: Optional[Path] = None
    load_tag: Optional[str] = None
    load_universal: bool = False
    global_batch: int = 12
    seed: int = 1234
    hidden: int = 3
    num_layers: int = 1
    vocab: int = 64
    seq: int = 4
    uc_info: bool = False
    plugin: bool = False
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    dump_dir: Optional[Path] = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300
    expect_failure: bool = False
    resave_pause: float = 0.0
    """Seconds between two saves of one step (a step listed twice in ``save_at``)."""
    tracker: bool = False
    """After each save, rank 0 writes Megatron's ``latest_checkpointed_iteration.txt`` where
    ``megatron.checkpointing.get_checkpoint_tracker_filename`` says (the worker registers that one function when no
    Megatron is loaded), then a barrier: Megatron's own save (the asynchronous save redirects that write)."""
    tolerate_save_failures: bool = False
    """A save that raises :class:`~megatron_ucp.errors.SaveFailedError` (on every rank) is reported (rank 0:
    ``info`` ``save_failed``) and training goes on: a job's policy, so that one run meets many failures."""
    crash: Optional[tuple[int, int]] = None
    """``(step, rank)``: that rank raises ``RuntimeError`` right after that step's saves (the others go on to the next
    step's collectives, where they wait): a job dying of an exception on one rank."""
    memory_every: int = 0
    """Every this many steps (0: never), a memory save (``megatron_ucp.save_to_memory``, with the hooks'
    configuration: ``plugin_kwargs`` or ``MEGATRON_UCP_*`` in ``env``) at the start of the next step, as the runner
    takes them (committed by the memory saves' writer thread, beside training); none of the run's first state nor of
    a durable save's step. A rank that crashes (``crash``) waits for the memory save in flight to commit first, unless
    ``crash_in_commit``."""
    crash_in_commit: bool = False
    """The crashing rank raises without waiting for its memory save's commit (the process exits without it)."""
    nudge: Optional[int] = None
    """After this step, every rank adds 1 to the first element of the model's first parameter (the same on every
    rank): a job whose live weights are no longer its fp32 masters rounded, until the next step rounds them again."""
    base_optimizer: str = "adamw"
    """The torch optimizer ZeRO wraps: ``"adamw"``, or ``"nadam"`` (its ``mu_product`` is a 0-dim tensor per
    partition: state that is not one number per element)."""
    # --- additions beyond the agreed interface (all optional) -----------------------------------
    python: Optional[str] = None
    """Interpreter for the ranks; None = the running one (``sys.executable``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every rank (e.g. ``MEGATRON_UCP_*``)."""
    refuse: list[dict[str, Any]] = field(default_factory=list)
    """Loads tried before the real one, each expected to fail on every rank with one error (the hooks'
    cross-rank protocol): ``{"name", "dir", "tag" (optional), "plugin_kwargs" (optional, reinstalls the
    hooks with them for that attempt), "digest" (optional: a load meant to work; its outcome is then
    ``["loaded", <sha256 of the module's state dict>]``)}``. Rank 0 reports every rank's outcome
    (``TrainResult.refusals``)."""

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                setattr(self, name, Path(value))
        self.save_at = tuple(int(s) for s in self.save_at)
        if self.crash is not None:
            self.crash = (int(self.crash[0]), int(self.crash[1]))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.base_optimizer not in BASE_OPTIMIZERS:
            raise ValueError(f"base_optimizer must be one of {BASE_OPTIMIZERS}, got {self.base_optimizer!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.optimizer == "bf16" and self.zero_stage != 1:
            raise ValueError("optimizer='bf16' (BF16_Optimizer) is ZeRO stage 1 only")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.global_batch % self.dp:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by dp {self.dp}")
        if self.save_at and self.save_dir is None:
            raise ValueError("save_at needs save_dir")
        if self.load_universal and self.load_dir is None:
            raise ValueError("load_universal needs load_dir")

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.dp

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for name in _PATH_FIELDS:
            if data[name] is not None:
                data[name] = str(data[name])
        data["save_at"] = list(self.save_at)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainSpec":
        data = json.loads(text)
        data["save_at"] = tuple(data.get("save_at", ()))
        return cls(**data)


@dataclass
class TrainResult:
    """What a run produced. ``losses[i]`` is the global mean loss of global step ``steps[i]``."""

    losses: list[float]
    steps: list[int]
    returncode: int
    log: str
    dumps: dict[str, Path]
    optimizer_class: Optional[str] = None
    """``type(engine.optimizer).__name__`` as seen by rank 0."""
    ds_version: Optional[str] = None
    loaded_step: Optional[int] = None
    """``engine.global_steps`` right after the load (None when nothing was loaded)."""
    wall_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    """Everything rank 0 reported (timings, versions, client state keys after a load, ...)."""

    @property
    def refusals(self) -> dict[str, list[Any]]:
        """Per ``TrainSpec.refuse`` name: every rank's ``[error class, message]`` (None: it loaded)."""
        return self.info.get("refusals", {})

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def loss_at(self, step: int) -> float:
        return self.losses[self.steps.index(step)]

    def rank_logs(self) -> dict[int, str]:
        """Each rank's own output (its section of :attr:`log`), by rank: a claim "on every rank" is checked in each
        one, never as a count over the combined log (where one rank's traceback can repeat a line)."""
        sections = {}
        for section in self.log.split("===== rank ")[1:]:
            head, _, text = section.partition("\n")
            rank = head.split(" ", 1)[0]
            if rank.isdigit():
                sections[int(rank)] = text.split("\n===== harness: ", 1)[0]
        return sections
