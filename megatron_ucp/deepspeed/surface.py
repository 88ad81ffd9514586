"""DeepSpeed's runtime surface: every internal the hooks read or replace, in one table, checked once.

The hooks live inside DeepSpeed's engine and ZeRO optimizers, whose internals change between
releases without notice. :data:`SURFACE` lists each class or module attribute the package touches,
why, and whether it is replaced or only called; :func:`check_surface` resolves the whole table
against the running release at install and names every missing entry at once. The rest of the
package reaches DeepSpeed's runtime only through this module: :func:`replace` and
:func:`scoped_replace` (through a :class:`PatchSet`, and only for entries the table marks
``REPLACE``), the typed accessors below, and one :class:`OptimizerLayout` per ZeRO optimizer class
(its stages and the instance attributes that hold its groups, partitions and masters). A new
DeepSpeed release is one entry in ``versions.INTERNALS`` and one matrix entry; a moved internal is
one edit here; ZeRO-3 is one more :class:`OptimizerLayout` (docs/EXTENDING.md), its own accessors in
:mod:`megatron_ucp.deepspeed.stage3_runtime`.

Size: the table, the only way to replace what it lists, and the accessors and layouts that read what it
checks are one contract (every internal of every release in one place); splitting it would scatter it.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from megatron_ucp.deepspeed.versions import Internals, installed_deepspeed_version, internals
from megatron_ucp.errors import UnsupportedError

ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
ZERO_BASE = "deepspeed.runtime.base_optimizer:ZeROOptimizer"
BF16 = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
ZERO = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
SD_LOADERS = "deepspeed.runtime.state_dict_factory:SDLoaderFactory"
PIPE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
PIPE_GRID = "deepspeed.runtime.pipe.topology:PipelineParallelGrid"
FRAGMENT = "deepspeed.utils.tensor_fragment:tensor_fragment"
BWC = "deepspeed.utils.bwc"
TORCH_CKPT_ENGINE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine"
ACCELERATOR = "deepspeed.accelerator"
TORCH_BACKEND = "deepspeed.comm.torch:TorchBackend"
OPTIMIZER_LOADER = "load_hp_checkpoint_state_from_checkpoint_dir"


class Use(enum.Enum):
    REPLACE = "replaced"
    CALL = "called"


@dataclass(frozen=True)
class Internal:
    """One DeepSpeed attribute the package relies on, and why."""

    owner: str
    """``module:Class`` or ``module``."""
    name: str
    use: Use
    why: str
    when: Callable[[Internals], bool] = lambda facts: True
    """Releases that have it (``versions.INTERNALS``); the others neither need nor check it."""

    def __str__(self) -> str:
        return f"{self.owner.rpartition(':')[2] or self.owner}.{self.name}"


R, C = Use.REPLACE, Use.CALL
SURFACE: tuple[Internal, ...] = (
    # save hook (integration/save/recording.py)
    Internal(
        ENGINE, "_save_checkpoint", R, "adds each parameter's TP layout and the save's identity to the model states"
    ),
    Internal(ENGINE, "save_checkpoint", R, "agrees on the save's identity; queues the background conversion"),
    Internal(BF16, "state_dict", R, "records true lengths, the partition geometry and checksums"),
    Internal(ZERO, "state_dict", R, "records true lengths, the partition geometry and checksums"),
    Internal(STAGE3, "state_dict", R, "records each sub-group's and parameter's true lengths and checksums"),
    Internal(
        ENGINE,
        "_save_moe_checkpoint",
        R,
        "the MoE save of _save_checkpoint: adds the TP layout and the save's identity; on 0.19 also hands Megatron's "
        "universal_checkpoint_info to it as the dict 0.19 wants (integration/save/experts.py)",
    ),
    Internal(
        ENGINE,
        "_get_non_moe_state_dict",
        R,
        "leaves the fork's lifted expert keys out of its MoE model states, as before 0.19 "
        "(integration/save/experts.py)",
        when=lambda facts: not facts.saves_fork_moe,
    ),
    Internal(
        TORCH_CKPT_ENGINE,
        "save",
        C,
        "every file of a save is written through it: watched for the length of one save (integration/save/commit.py)",
    ),
    Internal(
        ENGINE,
        "_take_model_step",
        R,
        "an asynchronous save commits at the optimizer step, where DeepSpeed's decoupled engine commits "
        "(integration/save/async_save.py)",
    ),
    # elastic load (integration/resume/elastic_load.py and the loaders below it)
    Internal(ENGINE, "load_checkpoint", R, "decides the route of a load (same DP, reshard, universal)"),
    Internal(ZERO_BASE, OPTIMIZER_LOADER, R, "our universal loader for BF16_Optimizer and DeepSpeedZeroOptimizer"),
    Internal(SD_LOADERS, "get_sd_loader", R, "for one load: one model-states file per rank, read as it is"),
    Internal(
        ENGINE,
        "load_module_state_dict",
        R,
        "for one load: the optimized weights left for the rebuild from the masters, the rest read once per job",
    ),
    Internal(ENGINE, "zero_load_from_fp32_weights", C, "whether a native load takes the masters from the files"),
    Internal(PIPE_MODULE, "ckpt_layer_path_list", C, "a pipeline model's layer files, which its layers load"),
    Internal(
        PIPE_MODULE,
        "ckpt_layer_path",
        C,
        "the layer file a pipeline model's save writes (a memory save leaves the optimized weights out of it)",
    ),
    Internal(PIPE_GRID, "get_slice_parallel_rank", C, "which of a layer's model-parallel files this rank loads"),
    Internal(PIPE_GRID, "get_slice_parallel_world_size", C, "how many model-parallel files a layer has"),
    Internal(ENGINE, "_load_checkpoint", C, "DeepSpeed's module + training-state load, called by load_checkpoint"),
    Internal(
        ENGINE,
        "_load_zero_checkpoint",
        R,
        "ZeRO-3: for one load, the native reshard, our universal loader or the restart's checks instead",
    ),
    Internal(ENGINE, "load_universal_checkpoint", C, "whether the job asked for a universal load"),
    Internal(ENGINE, "zero_optimization_stage", C, "which optimizer layout applies"),
    Internal(ENGINE, "train_batch_size", C, "the global batch, checked against the checkpoint's"),
    Internal(ENGINE, "_get_zero_ckpt_name", C, "this rank's optimizer file name as DeepSpeed spells it"),
    Internal(ENGINE, "_get_ckpt_name", C, "this rank's model-states file name as DeepSpeed spells it"),
    Internal(ENGINE, "_get_rank_zero_ckpt_name", C, "an old rank's optimizer file name as DeepSpeed spells it"),
    Internal(ENGINE, "use_node_local_storage", C, "node-local files cannot be converted or resharded across nodes"),
    Internal(BF16, "_load_universal_checkpoint", C, "the universal load that calls our loader"),
    Internal(ZERO, "_load_universal_checkpoint", C, "the universal load that calls our loader"),
    Internal(BF16, "_load_global_state", C, "the group's step and hyperparameters after our partitions"),
    Internal(ZERO, "_load_global_state", C, "the group's step and hyperparameters after our partitions"),
    Internal(BF16, "update_lp_params", C, "bf16 weights from the loaded fp32 masters"),
    Internal(ZERO, "update_lp_params", C, "bf16 weights from the loaded fp32 masters"),
    Internal(FRAGMENT, "get_hp_fragment_address", C, "where a parameter's fragment sits in the flat fp32 partition"),
    Internal(BWC, "bwc_tensor_model_parallel_world_size", C, "TP size of the live model from its mpu"),
    Internal(BWC, "bwc_tensor_model_parallel_rank", C, "this rank's TP place from the mpu"),
    Internal(BWC, "bwc_pipeline_parallel_world_size", C, "PP size of the live model from its mpu"),
    # async trigger (integration/save/async_trigger.py)
    Internal(
        ENGINE,
        "_commit_decoupled_checkpoint",
        R,
        "decoupled checkpoint engines commit here, not in save",
        when=lambda facts: facts.decoupled_commit,
    ),
    Internal(
        TORCH_BACKEND,
        "destroy_process_group",
        R,
        "the job leaves its process group: the asynchronous saves in flight are committed first, where every rank "
        "still meets (a process that ends without exit handlers never commits them otherwise)",
    ),
    # device placement (integration/collectives.py, integration/run.py)
    Internal(ACCELERATOR, "get_accelerator", C, "the device collectives and the reseed run on"),
)
"""Class and module attributes. Instance attributes (an optimizer's groups and partitions) are in
:data:`OPTIMIZER_LAYOUTS` and :data:`OPTIMIZER_SHARED`, checked once per class by :func:`layout_of`."""

SHARED = ((ZERO_BASE, OPTIMIZER_LOADER, (BF16, ZERO)),)
"""Replaced once on the base class: neither subclass may override it, or the replacement misses it."""


def resolve(owner: str) -> Any:
    """The class or module an owner string names (imports DeepSpeed)."""
    module, _, attribute = owner.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def _entry(owner: str, name: str) -> Internal:
    for entry in SURFACE:
        if entry.owner == owner and entry.name == name:
            return entry
    raise KeyError(f"{owner}.{name} is not in megatron_ucp.deepspeed.surface.SURFACE: add it there first")


def check_surface(version: Optional[str] = None) -> int:
    """Resolve every entry :data:`SURFACE` needs on the running release; raise naming all missing ones.

    Returns how many entries were checked."""
    version = version or installed_deepspeed_version()
    facts = internals(version)
    missing, checked = [], 0
    for entry in SURFACE:
        if not entry.when(facts):
            continue
        checked += 1
        try:
            owner = resolve(entry.owner)
        except (ImportError, AttributeError):
            missing.append(f"{entry} ({entry.owner.partition(':')[0]} does not import: {entry.why})")
            continue
        if not hasattr(owner, entry.name):
            missing.append(f"{entry} ({entry.why})")
    for base, name, subclasses in SHARED:
        for sub in subclasses:
            cls = _safe_resolve(sub)
            if cls is not None and name in cls.__dict__:
                missing.append(
                    f"{sub.rpartition(':')[2]} overrides {name} (the hook replaces the shared "
                    f"{base.rpartition(':')[2]} implementation)"
                )
    if missing:
        raise UnsupportedError(
            f"DeepSpeed {version} lacks what the megatron-ucp hooks rely on: "
            + "; ".join(missing)
            + ". Install a supported DeepSpeed or apply the diffs in patches/",
            subject=str(missing[0]),
        )
    return checked


def _safe_resolve(owner: str) -> Any:
    try:
        return resolve(owner)
    except (ImportError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------------
# replacing: through a PatchSet, and only what the table lists
# ------------------------------------------------------------------------------------------------

_MARK = "__megatron_ucp_original__"


class PatchSet:
    """Replaces attributes and remembers the originals, so every change can be undone."""

    def __init__(self) -> None:
        self._applied: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], stack: bool = False) -> None:
        """Set ``owner.name = make(original)``; the replacement keeps a pointer to the original.
        ``stack``: wrap a replacement of ours too (an outermost wrapper for one run, not a second install)."""
        original = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        if getattr(original, _MARK, None) is not None and not stack:
            raise RuntimeError(f"{owner!r}.{name} is already patched by megatron-ucp")
        replacement = make(original)
        setattr(replacement, _MARK, original)
        setattr(owner, name, replacement)
        self._applied.append((owner, name, original))

    def undo(self) -> None:
        while self._applied:
            owner, name, original = self._applied.pop()
            setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._applied)


def replace(patches: PatchSet, owner: str, name: str, make: Callable[[Any], Any], stack: bool = False) -> None:
    """Replace a :data:`SURFACE` entry marked ``REPLACE`` through ``patches``."""
    if _entry(owner, name).use is not Use.REPLACE:
        raise KeyError(f"{owner}.{name} is listed as called, not replaced, in SURFACE")
    patches.replace(resolve(owner), name, make, stack=stack)


@contextlib.contextmanager
def scoped_replace(owner: str, name: str, make: Callable[[Any], Any], stack: bool = False) -> Iterator[None]:
    """:func:`replace` for the duration of a ``with`` block (one load, one run), undone whatever happens."""
    patches = PatchSet()
    replace(patches, owner, name, make, stack=stack)
    try:
        yield
    finally:
        patches.undo()


# ------------------------------------------------------------------------------------------------
# typed accessors
# ------------------------------------------------------------------------------------------------


def accelerator() -> Any:
    return resolve(ACCELERATOR).get_accelerator()


def zero_stage(engine: Any) -> Optional[int]:
    """The engine's ZeRO stage; None when it has none to tell (not a ZeRO engine)."""
    try:
        return int(engine.zero_optimization_stage())
    except Exception:
        return None


def loads_fp32_masters(engine: Any) -> bool:
    """A native load takes the fp32 masters from the rank files (else DeepSpeed derives them from the
    module's weights: ``zero_optimization.load_from_fp32_weights: false``)."""
    try:
        return bool(engine.zero_load_from_fp32_weights())
    except Exception:
        return True


def pipeline_module(engine: Any) -> bool:
    """The engine's module is a pipeline model (it loads its weights from per-layer files)."""
    return isinstance(getattr(engine, "module", None), resolve(PIPE_MODULE))


def slice_parallel(module: Any) -> tuple[int, int]:
    """A pipeline model's model-parallel (slice) rank and size: which of each layer's files it loads."""
    grid = instance_attribute(module, "_grid")
    return int(grid.get_slice_parallel_rank()), int(grid.get_slice_parallel_world_size())


def decoupled_checkpoint_engine(engine: Any) -> bool:
    """The engine's checkpoint engine commits after ``save_checkpoint`` returns (0.17+: ``is_decoupled()``)."""
    ce = getattr(engine, "checkpoint_engine", None)
    try:
        return bool(ce is not None and ce.is_decoupled())
    except Exception:
        return False


def node_local_storage(engine: Any) -> bool:
    try:
        return bool(engine.use_node_local_storage())
    except Exception:
        return False


def engine_config(engine: Any) -> Any:
    """The engine's parsed ``DeepSpeedConfig`` (``load_universal_checkpoint`` is set on it for one load)."""
    return instance_attribute(engine, "_config")


def experts_data_first(engine: Any) -> bool:
    """DeepSpeed-MoE's D + E topology (``use_data_before_expert_parallelism``): expert-parallel groups strided
    over DP, expert-data-parallel groups contiguous, the other way round from the default E + D that the expert
    placement assumes (every release 0.16-0.19 parses the key into ``use_data_before_expert_parallel_``)."""
    return bool(getattr(getattr(engine, "_config", None), "use_data_before_expert_parallel_", False))


def model_states_file(engine: Any, load_dir: str, tag: str) -> str:
    return engine._get_ckpt_name(load_dir, tag)


def own_optimizer_file(engine: Any, load_dir: str, tag: str) -> str:
    return engine._get_zero_ckpt_name(load_dir, tag)


def rank_optimizer_file(engine: Any, load_dir: str, tag: str, mp_rank: int, dp_rank: int, bf16: bool) -> str:
    return engine._get_rank_zero_ckpt_name(load_dir, tag, mp_rank, dp_rank, bf16)


def load_global_state(optimizer: Any, state: dict) -> None:
    """The optimizer group's step and hyperparameters from a saved optimizer dict."""
    optimizer._load_global_state(state)


def _hp_mapping(lp: Any) -> Any:
    """A live bf16 parameter's link to its fp32 fragment (ZeRO-1/2: ``lp_fragment_address``,
    ``optim_fragment``, ``get_hp_fragment_address()``); None on a parameter this rank's partition does not touch."""
    return getattr(lp, "_hp_mapping", None)


def fragment_address(lp: Any) -> Optional[tuple[int, int, int]]:
    """ZeRO-1/2: where this rank's fragment of a live parameter is, as DeepSpeed's own map says: its first
    element in the parameter, its length, and its place in the flat fp32 partition. None: no fragment here."""
    mapping = _hp_mapping(lp)
    if mapping is None:
        return None
    hp = mapping.get_hp_fragment_address()
    return int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel), int(hp.start)


def link_optimizer_fragments(lp: Any, buffers: dict[str, Any]) -> None:
    """ZeRO-1/2: point a parameter's optimizer-state fragments at new flat state buffers (what DeepSpeed's
    ``_link_hp_params`` does), so that ``safe_get_full_optimizer_state`` reads what was loaded."""
    mapping = _hp_mapping(lp)
    if mapping is not None:
        address = mapping.get_hp_fragment_address()
        mapping.optim_fragment = {s: b.narrow(0, address.start, address.numel) for s, b in buffers.items()}


def tp_size_and_rank(mpu: Any) -> tuple[int, int]:
    """TP size and rank from an ``mpu`` (Megatron's, or DeepSpeed's pipeline grid); (1, 0) without one."""
    if mpu is None:
        return 1, 0
    bwc = resolve(BWC)
    return int(bwc.bwc_tensor_model_parallel_world_size(mpu)), int(bwc.bwc_tensor_model_parallel_rank(mpu))


def pp_size(mpu: Any) -> int:
    return 1 if mpu is None else int(resolve(BWC).bwc_pipeline_parallel_world_size(mpu))


def instance_attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or an error naming the release and the attribute when DeepSpeed moved it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise UnsupportedError(
            f"DeepSpeed {installed_deepspeed_version()}: {type(obj).__name__} has no {name!r}, "
            "which megatron-ucp relies on; DeepSpeed internals changed",
            subject=f"{type(obj).__name__}.{name}",
        ) from None


# ------------------------------------------------------------------------------------------------
# instance attributes both ZeRO optimizer classes share
# ------------------------------------------------------------------------------------------------

OPTIMIZER_SHARED = (
    ("dp_process_group", "the DP group the partitions are cut over"),
    ("real_dp_process_group", "each parameter group's DP group (its size and this rank's place)"),
    ("nccl_start_alignment_factor", "the alignment the flat buffer is padded to"),
    ("param_names", "each live parameter's name, as the files name it"),
    ("optimizer", "the wrapped torch optimizer (its param groups and per-flat state)"),
)
"""Attributes :class:`OptimizerLayout` does not name because every ZeRO optimizer class has them."""


def dp_group(optimizer: Any) -> Any:
    return instance_attribute(optimizer, "dp_process_group")


def elastic_checkpoint(optimizer: Any) -> bool:
    """DeepSpeedZeroOptimizer's ``zero_optimization.elastic_checkpoint`` (its own save and load form; other classes
    have none). Every release 0.16-0.19 sets the attribute in its constructor: one that does not is a change of
    internals, said as such."""
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer":
        return False
    return bool(instance_attribute(optimizer, "elastic_checkpoint"))


def group_dp_groups(optimizer: Any) -> list[Any]:
    """One DP process group per parameter group."""
    return instance_attribute(optimizer, "real_dp_process_group")


def group_dp_sizes(optimizer: Any) -> list[int]:
    """Each parameter group's DP size (they differ where mixture-of-experts groups are partitioned over
    the expert-data-parallel group)."""
    import torch.distributed as dist

    return [int(dist.get_world_size(group=pg)) for pg in group_dp_groups(optimizer)]


def alignment_factor(optimizer: Any) -> int:
    return int(instance_attribute(optimizer, "nccl_start_alignment_factor"))


def param_names(owner: Any) -> dict[Any, str]:
    """Live parameter -> name, from a ZeRO optimizer or the engine (both keep the same map)."""
    return instance_attribute(owner, "param_names")


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ZeRO optimizer wraps: one param group (one flat fp32 tensor) per group."""
    return instance_attribute(optimizer, "optimizer")


def optimizer_mpu(optimizer: Any) -> Any:
    """The model-parallel unit the optimizer was built with; None without model parallelism."""
    return getattr(optimizer, "mpu", None)


# ------------------------------------------------------------------------------------------------
# ZeRO-3's own instance attributes (its accessors: megatron_ucp.deepspeed.stage3_runtime)
# ------------------------------------------------------------------------------------------------

STAGE3_ATTRIBUTES = (
    "dp_process_group",
    "optimizer",
    "sub_group_to_group_id",
    "unflatten",
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "swap_optimizer",
)
"""What the stage-3 hooks read besides the layout's lists: the DP group, the wrapped torch optimizer, each
sub-group's param group, how bf16 partitions are re-pointed, the loss scaler state DeepSpeed's own load
restores, and whether the optimizer swaps to NVMe (left to DeepSpeed)."""
# ------------------------------------------------------------------------------------------------
# optimizer layouts: one per ZeRO optimizer class
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerLayout:
    """Where one ZeRO optimizer class keeps a rank's share of the model, by attribute name.

    Each list attribute holds one entry per parameter group: ``lp_groups`` the live bf16 parameters,
    ``lp_flat`` their flat buffer, ``lp_partitions`` its per-rank views, ``hp_partitions`` this rank's
    fp32 masters. ``round_robin_padding`` names the per-parameter padding list the class adds inside
    the flat buffer (DeepSpeedZeroOptimizer only), ``recorded_paddings`` what it itself records as
    ``group_paddings``.
    """

    owner: str
    stages: tuple[int, ...]
    lp_groups: str
    lp_flat: str
    lp_partitions: str
    hp_partitions: str
    round_robin_padding: Optional[str] = None
    recorded_paddings: Optional[str] = None
    per_parameter: bool = False
    """ZeRO-3: ``lp_groups`` are optimizer sub-groups, each parameter partitioned on its own over the DP
    group (``lp_flat``: this rank's bf16 partition of each sub-group, ``lp_partitions``: its per-parameter
    views, ``hp_partitions``: its fp32 partition); else one flat buffer per param group, cut in DP parts."""
    extra: tuple[str, ...] = ()
    """Further instance attributes the hooks read from this class."""

    @property
    def class_name(self) -> str:
        return self.owner.rpartition(":")[2]

    def required(self) -> list[str]:
        """Every instance attribute the hooks read from this class (checked on its first optimizer)."""
        shared = [] if self.per_parameter else [n for n, _ in OPTIMIZER_SHARED]
        return [self.lp_groups, self.lp_flat, self.lp_partitions, self.hp_partitions, *shared, *self.extra]

    def groups(self, optimizer: Any) -> list[list[Any]]:
        return instance_attribute(optimizer, self.lp_groups)

    def flats(self, optimizer: Any) -> list[Any]:
        return instance_attribute(optimizer, self.lp_flat)

    def lp_partitions_of(self, optimizer: Any) -> list[list[Any]]:
        return instance_attribute(optimizer, self.lp_partitions)

    def masters(self, optimizer: Any) -> list[Any]:
        return instance_attribute(optimizer, self.hp_partitions)

    def padded_numels(self, optimizer: Any) -> tuple[list[int], list[int]]:
        """Each group's real element count, and the count with the padding the class adds between
        parameters (what its flat buffer holds before the DP alignment)."""
        numels = [sum(p.numel() for p in group) for group in self.groups(optimizer)]
        paddings = (getattr(optimizer, self.round_robin_padding, None) if self.round_robin_padding else None) or [
            [0]
        ] * len(numels)
        return numels, [n + sum(pad) for n, pad in zip(numels, paddings)]


OPTIMIZER_LAYOUTS = (
    OptimizerLayout(
        BF16,
        stages=(1,),
        lp_groups="bf16_groups",
        lp_flat="bf16_groups_flat",
        lp_partitions="bf16_partitioned_groups",
        hp_partitions="fp32_groups_flat_partition",
    ),
    OptimizerLayout(
        ZERO,
        stages=(1, 2),
        lp_groups="bit16_groups",
        lp_flat="bit16_groups_flat",
        lp_partitions="parallel_partitioned_bit16_groups",
        hp_partitions="single_partition_of_fp32_groups",
        round_robin_padding="round_robin_bit16_padding",
        recorded_paddings="groups_padding",
    ),
    OptimizerLayout(
        STAGE3,
        stages=(3,),
        lp_groups="fp16_groups",
        lp_flat="fp16_partitioned_groups_flat",
        lp_partitions="fp16_partitioned_groups",
        hp_partitions="fp32_partitioned_groups_flat",
        per_parameter=True,
        extra=STAGE3_ATTRIBUTES,
    ),
)
ELASTIC_STAGES = tuple(sorted({s for layout in OPTIMIZER_LAYOUTS for s in layout.stages}))
"""ZeRO stages some optimizer layout handles: what the hooks save, convert and load."""


def layout_named(class_name: str) -> Optional[OptimizerLayout]:
    """The layout of the optimizer class of that name (as files record it); None for any other."""
    return next((layout for layout in OPTIMIZER_LAYOUTS if layout.class_name == class_name), None)


_CHECKED: set[type] = set()


def layout_of(optimizer: Any) -> Optional[OptimizerLayout]:
    """The layout of this optimizer's class; None for a class the hooks leave to DeepSpeed.

    The first optimizer of each class is checked for every attribute its layout and
    :data:`OPTIMIZER_SHARED` name, so that a release that moved one fails here, naming them all."""
    layout = layout_named(type(optimizer).__name__)
    if layout is not None and type(optimizer) not in _CHECKED:
        _checkinstance_attribute(optimizer, layout)
        _CHECKED.add(type(optimizer))
    return layout


def _checkinstance_attribute(optimizer: Any, layout: OptimizerLayout) -> None:
    missing = [n for n in layout.required() if not hasattr(optimizer, n)]
    if missing:
        raise UnsupportedError(
            f"DeepSpeed {installed_deepspeed_version()}: {layout.class_name} has no "
            + ", ".join(repr(n) for n in missing)
            + ", which megatron-ucp relies on; DeepSpeed internals changed",
            subject=f"{layout.class_name}.{missing[0]}",
        )


def engine_layout(engine: Any) -> Optional[OptimizerLayout]:
    """The layout of an engine the hooks handle (its optimizer's class at its ZeRO stage), else None."""
    layout = layout_of(getattr(engine, "optimizer", None))
    return layout if layout is not None and zero_stage(engine) in layout.stages else None
